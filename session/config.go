package session

import (
	"fmt"
	"log/slog"
	"path/filepath"
	"slices"
	"sync/atomic"
	"time"

	"github.com/shmlink/shmlink/buffer"
	"github.com/shmlink/shmlink/internal/wire"
	"github.com/shmlink/shmlink/queue"
)

// MemoryType says how a client shares its buffer region and IO queue with a
// server (docs/protocol.md section 1.4).
type MemoryType uint8

const (
	// MemoryAuto uses MemoryMemfd over a Unix socket and MemoryFile over TCP.
	MemoryAuto MemoryType = iota
	// MemoryMemfd creates anonymous memfds and passes them with SCM_RIGHTS
	// (handshake v3). It needs a Unix socket.
	MemoryMemfd
	// MemoryFile creates files in Config.ShmDir and sends their paths
	// (handshake v3 with file paths, on every network; docs/protocol.md
	// section 1.4).
	MemoryFile
)

// String returns "auto", "memfd" or "file".
func (m MemoryType) String() string {
	switch m {
	case MemoryAuto:
		return "auto"
	case MemoryMemfd:
		return "memfd"
	case MemoryFile:
		return "file"
	}
	return fmt.Sprintf("MemoryType(%d)", uint8(m))
}

// Defaults used by a zero Config; each field's doc states its own. Sizes
// are in bytes, caps in events.
const (
	// defaultBufferSize is the size of the buffer region a client creates.
	defaultBufferSize = 32 << 20
	// defaultQueueCap is the number of 12-byte events per IO-queue direction.
	defaultQueueCap = 8192
	// defaultShmDir is where file-backed regions and queues are created.
	defaultShmDir = "/dev/shm"
	// defaultHandshakeTimeout bounds the whole handshake on either side.
	defaultHandshakeTimeout = 3 * time.Second
	// defaultAcceptBacklog is how many opened streams a server session holds
	// for AcceptStream before it refuses new ones (by closing them).
	defaultAcceptBacklog = 4096
	// defaultPollTime is the longest a reader waiting for data polls
	// shared memory after the last event before it sleeps until a wakeup;
	// a wait polls for a quarter of it unless its answers lately came
	// later (Stream.stretch).
	defaultPollTime = 200 * time.Microsecond
	// defaultStreamHeapLimit is how many unread bytes a stream may copy
	// out of shared memory to the heap (see Config.StreamHeapLimit).
	defaultStreamHeapLimit = 16 << 20
	// defaultQueueFullTimeout is how long a writer waits for room in a full
	// IO queue before its write fails with ErrQueueFull.
	defaultQueueFullTimeout = 5 * time.Second
	// defaultMaxMessageSize is MaxMessageSize's default: 32 MiB, the
	// Rust crate's read buffer.
	defaultMaxMessageSize = wire.DefaultMaxMessageSize
	// defaultMaxStreams bounds the streams of a server session.
	defaultMaxStreams = 16384
	// defaultWriteTimeout bounds one write on the control connection.
	defaultWriteTimeout = 10 * time.Second
)

// maxPollTime bounds PollTime: polling is worth it only while it is
// shorter than going to sleep and being woken (tens of microseconds on a
// VM, docs/protocol.md section 12). A variable for the tests of leases,
// which need polls that do not end by time.
var maxPollTime atomic.Int64

func init() { maxPollTime.Store(int64(10 * time.Millisecond)) }

// Config tunes a session. The zero value works: every zero field takes the
// default named in its comment. Negative values are invalid (Validate, and
// so Client and Server, return a *ConfigError naming the field) except
// where a field's comment gives them a meaning: PollTime,
// StreamMemoryLimit, StreamHeapLimit. A Config is copied when a session
// starts, so changing it later has no effect on running sessions.
type Config struct {
	// BufferSize is the size in bytes of the buffer region a client creates
	// (docs/protocol.md section 2): 64 KiB to 4 GiB - 1 (offsets are
	// 32-bit), with room for at least 2 slices of every size class.
	// Default 32 MiB. Servers map whatever the client created. A memfd
	// region takes memory for one page per slice when it is formatted
	// (about 4.9 MiB of the default 32 MiB with the default SizeClasses)
	// and for the rest as data first passes through it; a file-backed
	// region takes all of it at the dial, which fails with an error
	// wrapping syscall.ENOSPC if ShmDir's file system has no room
	// (docs/protocol.md section 13).
	BufferSize int

	// SizeClasses are the slice sizes (data bytes per slice) and the share
	// of the region (percent) each gets, used by a client that creates the
	// region (docs/protocol.md section 2.2). Default
	// buffer.DefaultSizeClasses(): 8172, 32748 and 131052 bytes at 20, 30
	// and 50 percent. The existing peers' default,
	// buffer.PeerSizeClasses(), gives the same sizes 50, 30 and 20 percent:
	// more slices for small messages, fewer of the largest for bulk data.
	// A region has at most 2^20 slices in all (docs/protocol.md section
	// 2.1): Validate refuses classes and a BufferSize that make more, and
	// a server refuses a peer's region that has more.
	SizeClasses []buffer.SizeClass

	// QueueCap is the number of events per direction of the IO queue a
	// client creates (docs/protocol.md section 3): at most queue.MaxCap,
	// and one for which the second direction's counters are aligned for
	// this architecture's atomics (queue.CheckFormat says which). Default
	// 8192.
	QueueCap uint32

	// MemoryType selects memfd or file-backed shared memory for a client.
	// Default MemoryAuto.
	MemoryType MemoryType

	// ShmDir is the directory where a client creates file-backed shared
	// memory, and the only directory from which a server maps files named
	// by a peer: regular files directly inside it that belong to the peer's
	// uid (on a Unix socket the credentials' uid, over loopback TCP the uid
	// that owns the peer's socket, between hosts this process's effective
	// uid; docs/protocol.md section 9). Any other path is refused before it
	// is opened (ErrPathRefused). Default "/dev/shm".
	ShmDir string

	// HandshakeTimeout bounds the handshake on both sides. Default
	// 3 s.
	HandshakeTimeout time.Duration

	// MaxMessageSize bounds, with StreamHeapLimit, the FallbackData bytes
	// a stream may hold unread on the heap: max(StreamHeapLimit,
	// MaxMessageSize) per stream, four times that per session, each
	// message queued there counting 256 bytes beyond its own, with room
	// for that on one whole message of this size. Past it
	// the session stops reading its control connection until readers
	// take some (the peer's writes wait), and ends with an error naming
	// the limits once none has for QueueFullTimeout (docs/protocol.md
	// section 13). A FallbackData of any length is taken in pieces as it
	// arrives, so a peer's single flush larger than this works while its
	// stream is read (shmipc-go and the Rust crate send a whole flush as
	// one FallbackData). In bytes; default 32 MiB, the Rust crate's read
	// buffer; at least 64 KiB.
	MaxMessageSize int

	// AcceptBacklog is the number of streams a server session queues for
	// AcceptStream; beyond it new streams are refused (see MaxStreams).
	// On shmlink's "quic" network it bounds, across a listener's
	// connections, the streams that Accept has not returned; one beyond
	// it is refused at once (docs/protocol.md section 17, Streams).
	// Default 4096.
	AcceptBacklog int

	// MaxStreams is the most streams a server session keeps at once: open
	// ones, and closed ones waiting for the client's close. A stream the
	// client opens beyond it, or beyond AcceptBacklog, is refused: closed at
	// once, so a shmlink client gets ErrStreamRefused, another client
	// io.EOF (docs/protocol.md sections 11 and 13).
	// Default 16384.
	MaxStreams int

	// WriteTimeout bounds every write on the control connection (wakeups,
	// closes, FallbackData, hot restart): a peer that does not read its
	// end for that long ends the session with a *SessionError whose cause
	// is a timeout. A stream's own write deadline, its Close and
	// OpenStream's context end its call sooner without ending the session.
	// Default 10 s.
	WriteTimeout time.Duration

	// QueueFullTimeout is how long a write waits for room in a full IO queue
	// before failing with ErrQueueFull, unless its deadline comes first.
	// It also bounds how long the peer's FallbackData waits for a reader
	// to take bytes once a stream holds its limit of them on the heap
	// (MaxMessageSize); past it the session ends. Default 5 s.
	QueueFullTimeout time.Duration

	// Fallback makes a writer that finds the buffer region exhausted send
	// its bytes over the control connection as FallbackData (docs/protocol.md
	// section 1.2) at once, instead of waiting for the peer to free slices;
	// the stream then stays on the socket, to keep its bytes in order. The
	// default (false) is backpressure: the writer waits, until its write
	// deadline, the stream's or session's end, or free slices; but not for
	// slices held by this process's own readers that stopped reading, half
	// the region or more, past StreamHeapLimit: those it could wait for
	// forever (an echo whose peer wrote until the region was full), so
	// the writer falls back then too (docs/protocol.md section 13).
	Fallback bool

	// KeepAlive, if positive, makes the session check that its peer still
	// answers whenever it has heard nothing from it for KeepAlive: it puts
	// a probe on the IO queue (the close of stream 0, which no stream
	// uses) with a Polling, and ends the session, with an error that names
	// KeepAlive, when the peer has taken no event of its queue by the next
	// check. A peer that froze (stopped, deadlocked) is so noticed within
	// about twice KeepAlive, also by streams that wait for it with no
	// deadline (docs/protocol.md section 13). Zero, the default, turns it
	// off; negative is invalid. Other shmipc peers ignore the probe but
	// may log it.
	KeepAlive time.Duration

	// PollTime is the longest a reader waiting for data keeps polling the
	// receive queue in shared memory, after the last event it saw, before
	// it sleeps until the peer's wakeup message. While it polls, the peer
	// sends no wakeups, so a message costs no system call; the price is a
	// busy CPU while it polls. A wait polls for a base poll, a quarter of
	// PollTime (50 µs by default). On a host not known to be busy, a
	// stream whose recent waits that a poll caught took on average more
	// than a quarter of a base poll polls for 4 times that mean, up to
	// PollTime, while such longer polls catch at least one answer for
	// every two they miss: answers that come a little later than a base
	// poll are caught instead of costing a wakeup of both processes
	// (docs/protocol.md section 12.7). A reader that got its data leaves
	// the flag that spares the peer's wakeups set (a lease) until no
	// reader has polled for 16 to 32 ms (20 to 40 ms on a client; at least
	// PollTime), unless another reader sleeps: events for streams nobody
	// is reading wait that long at most, and no reader waits on them
	// (sections 12, 12.2). A stream whose recent waits ran longer than 4
	// of its polls on average (a server between requests that come in
	// gaps), or, on a host with an idle CPU, whose last 8 waits each
	// outlasted their poll (answers a few polls away), stops polling,
	// since its data does not come within a poll, and polls only in one
	// wait of 16 until its waits shorten again (sections 12.1, 12.6).
	// Default 200 µs, at most 10 ms; negative turns polling off (every
	// wait sleeps, every message after a pause costs a wakeup). A session
	// whose two processes may run only on one and the same CPU (a host
	// with one CPU online, or both bound to one CPU, as sched_getaffinity
	// reports them when the session starts) does not poll whatever
	// PollTime says: the peer could not run while a reader polled for its
	// answer (section 12.8). Nor does a session whose peer is a session of
	// this process, over a Unix socket: its wakeups go to that session
	// without a system call, and a wakeup costs less than a poll
	// (section 12.9).
	PollTime time.Duration

	// StreamMemoryLimit is how many bytes of the buffer region one stream's
	// unread messages may occupy, counted on the receiving side as the
	// capacity of their slices (a 1-byte message takes a whole slice of
	// the smallest size that fits). While less than a quarter of the
	// region is free, the unread messages past it of a stream whose reader
	// has stalled (no read call running or ended within the last
	// millisecond) are copied to the heap and their slices freed, so a
	// reader that stalls cannot starve the other streams, or the opposite
	// direction, of shared memory; a reader that keeps reading gets
	// backpressure instead. The unread bytes of all streams
	// together are held to half the region the same way. Default (0): a
	// quarter of the region; negative: no limit (on either).
	StreamMemoryLimit int

	// StreamHeapLimit is how many unread bytes one stream may hold in the
	// heap after copying them out of shared memory (see StreamMemoryLimit),
	// and a quarter of what all streams of the session may hold there.
	// Past it messages stay in shared memory, the region fills, and the
	// peer's writers wait for space (or fall back, by their Config). Bytes
	// that arrive as FallbackData are taken up to the larger of this and
	// MaxMessageSize. Default
	// 16 MiB; negative: nothing is copied out.
	StreamHeapLimit int

	// AllowUIDs lists the user ids whose processes may be the peer on a
	// Unix socket, as the kernel reports them (PeerCred): a server checks
	// every client, and a client its server, before the handshake. Empty
	// (the default) allows only this process's effective uid; a non-empty
	// list replaces that default, so list os.Geteuid() too to keep it. A
	// refused peer's connection is closed and the handshake fails with a
	// *PeerError (errors.Is ErrPeerRefused). TCP carries no credentials;
	// over loopback TCP the check applies to the uid that owns the peer's
	// socket (PID 0 and GID -1 in its PeerCred), and a connection whose
	// owner cannot be found is refused. Between hosts no check is made,
	// and shmlink.ListenConfig keeps TCP listeners on loopback unless told
	// otherwise (docs/protocol.md section 9). Set AllowUIDs or PeerCheck,
	// not both.
	AllowUIDs []int

	// PeerCheck, if set, decides instead of AllowUIDs which processes may
	// be the peer on a Unix socket or loopback TCP (see AllowUIDs for what
	// the kernel tells there): it is called once per connection,
	// before the handshake, with the peer's credentials, and an error
	// refuses the peer (the handshake fails with a *PeerError wrapping it).
	// It may be called from many goroutines at once and should return
	// quickly: the handshake timeout does not bound it. Default nil: the
	// AllowUIDs rule.
	PeerCheck func(PeerCred) error

	// Epoch is the hot-restart epoch a client puts in the names of the
	// shared-memory objects it creates (docs/protocol.md sections 5 and 6):
	// "shmlink_<pid>_e<Epoch>_<random>". shmlink.Dialer sets it to the
	// epoch of the last HotRestart it saw from the address. Default 0.
	Epoch uint64

	// Logger receives session events (handshakes, protocol errors). Nil
	// means silent.
	Logger *slog.Logger

	// socketWakes (tests only) keeps a session whose peer is this process
	// waking it over the connection, as between two processes (local.go).
	socketWakes bool
}

// Validate reports the first field of c that is out of range, as a
// *ConfigError naming it. Zero fields are valid (they mean the default).
// It refuses every config whose region or queue the handshake could not
// create (buffer.CheckFormat, queue.CheckFormat), so a config it passes
// makes working sessions.
func (c *Config) Validate() error {
	switch {
	case c.BufferSize < 0:
		return &ConfigError{Field: "BufferSize", Reason: "negative"}
	case c.BufferSize > 0 && c.BufferSize < 64<<10:
		return &ConfigError{Field: "BufferSize", Reason: "below 64 KiB"}
	case c.BufferSize > 1<<32-1:
		return &ConfigError{Field: "BufferSize", Reason: "above 4 GiB - 1 (offsets are 32-bit)"}
	case c.QueueCap > queue.MaxCap:
		return &ConfigError{Field: "QueueCap", Reason: fmt.Sprintf("above %d", queue.MaxCap)}
	case c.MemoryType > MemoryFile:
		return &ConfigError{Field: "MemoryType", Reason: "unknown"}
	case c.ShmDir != "" && !filepath.IsAbs(c.ShmDir):
		return &ConfigError{Field: "ShmDir", Reason: "not an absolute path"}
	case c.HandshakeTimeout < 0:
		return &ConfigError{Field: "HandshakeTimeout", Reason: "negative"}
	case c.MaxMessageSize < 0:
		return &ConfigError{Field: "MaxMessageSize", Reason: "negative"}
	case c.MaxMessageSize > 0 && c.MaxMessageSize < 64<<10:
		return &ConfigError{Field: "MaxMessageSize", Reason: "below 64 KiB"}
	case c.AcceptBacklog < 0:
		return &ConfigError{Field: "AcceptBacklog", Reason: "negative"}
	case c.MaxStreams < 0:
		return &ConfigError{Field: "MaxStreams", Reason: "negative"}
	case c.WriteTimeout < 0:
		return &ConfigError{Field: "WriteTimeout", Reason: "negative"}
	case c.QueueFullTimeout < 0:
		return &ConfigError{Field: "QueueFullTimeout", Reason: "negative"}
	case c.KeepAlive < 0:
		return &ConfigError{Field: "KeepAlive", Reason: "negative"}
	case c.PollTime > time.Duration(maxPollTime.Load()):
		return &ConfigError{Field: "PollTime", Reason: fmt.Sprintf("above %v: a poller keeps a core busy that long", time.Duration(maxPollTime.Load()))}
	}
	if err := c.validateAccess(); err != nil {
		return err
	}
	// What the handshake makes of the rest: the region and the queue a
	// client creates with these settings and the defaults.
	d := c.withDefaults()
	if err := buffer.CheckFormat(d.BufferSize-markerSize, d.SizeClasses); err != nil {
		field := "BufferSize"
		if c.SizeClasses != nil {
			field = "SizeClasses"
		}
		return &ConfigError{Field: field, Reason: err.Error()}
	}
	if err := queue.CheckFormat(d.QueueCap); err != nil {
		return &ConfigError{Field: "QueueCap", Reason: err.Error()}
	}
	return nil
}

// withDefaults returns a copy of c with every zero field set to its default.
func (c *Config) withDefaults() Config {
	out := Config{}
	if c != nil {
		out = *c
	}
	if out.BufferSize == 0 {
		out.BufferSize = defaultBufferSize
	}
	if out.SizeClasses == nil {
		out.SizeClasses = buffer.DefaultSizeClasses()
	} else {
		out.SizeClasses = append([]buffer.SizeClass(nil), out.SizeClasses...)
	}
	out.AllowUIDs = slices.Clone(out.AllowUIDs)
	if out.QueueCap == 0 {
		out.QueueCap = defaultQueueCap
	}
	if out.ShmDir == "" {
		out.ShmDir = defaultShmDir
	}
	out.ShmDir = filepath.Clean(out.ShmDir)
	if out.HandshakeTimeout == 0 {
		out.HandshakeTimeout = defaultHandshakeTimeout
	}
	if out.MaxMessageSize == 0 {
		out.MaxMessageSize = defaultMaxMessageSize
	}
	if out.AcceptBacklog == 0 {
		out.AcceptBacklog = defaultAcceptBacklog
	}
	if out.MaxStreams == 0 {
		out.MaxStreams = defaultMaxStreams
	}
	if out.WriteTimeout == 0 {
		out.WriteTimeout = defaultWriteTimeout
	}
	if out.QueueFullTimeout == 0 {
		out.QueueFullTimeout = defaultQueueFullTimeout
	}
	if out.StreamHeapLimit == 0 {
		out.StreamHeapLimit = defaultStreamHeapLimit
	}
	if out.PollTime == 0 {
		out.PollTime = defaultPollTime
	}
	if out.Logger == nil {
		out.Logger = slog.New(slog.DiscardHandler)
	}
	return out
}
