package session

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"math"
	"net"
	"os"
	"runtime"
	"sync"
	"sync/atomic"
	"time"

	"github.com/shmlink/shmlink/buffer"
	"github.com/shmlink/shmlink/internal/wire"
	"github.com/shmlink/shmlink/queue"
)

// Stream states carried in the low byte of an event's or a FallbackData's
// status (PROTOCOL.md section 4).
const (
	stateOpen   = 0
	stateClosed = 1
)

// maxEventBytes bounds the bytes one event (one slice chain) carries: a
// large write goes out as a train of events, so the reader copies the
// first out while the writer still copies the rest in (on two cores, a
// 1 MiB round trip takes 0.14 ms instead of 0.4 ms with one 4 MiB event:
// BenchmarkPingPong), and one write cannot take the whole buffer region.
const maxEventBytes = 64 << 10

// maxFallbackChunk is the most data bytes one FallbackData message carries.
const maxFallbackChunk = 64 << 10

// A Session is one control connection plus the shared memory it set up: a
// buffer region and an IO queue per direction. It multiplexes streams.
// The client side opens streams (OpenStream); the server side accepts them
// (AcceptStream). All methods are safe for concurrent use.
type Session struct {
	cfg      Config
	conn     net.Conn
	isClient bool
	version  uint8
	pollMsg  []byte // the encoded Polling message
	maxLinks int    // slices in the buffer region: the longest possible chain
	// shmLimit and heapLimit bound a stream's unread bytes in the region
	// and copied out of it (Config.StreamMemoryLimit, StreamHeapLimit);
	// sessionShmLimit bounds the unread bytes of all streams in the region
	// (half of it), counted by shmUnread.
	shmLimit, heapLimit, sessionShmLimit int
	// pressureBytes is the free capacity of the region (a quarter of it)
	// below which those limits apply: with more free, nobody waits for
	// slices and copying out would only slow the reader down.
	pressureBytes int
	shmUnread     atomic.Int64
	// names are the files of a v2 handshake that this client created and
	// still has to unlink; the v2 server sends no reply, so they go as
	// soon as anything comes from it (see forgetNames).
	names     []string
	namesLive atomic.Bool

	// memMu guards the mappings: holders of the read lock may touch shared
	// memory; release takes the write lock to unmap.
	memMu sync.RWMutex
	mem   *memory // nil once released
	// drainMu is held by whoever pops the receive queue and dispatches
	// what it popped: the receive loop after a wakeup, or a reader polling
	// for its data (Stream.poll). The queue has one consumer at a time and
	// events reach their streams in queue order.
	drainMu sync.Mutex
	// polling is set while a reader polls the receive queue holding its
	// working flag at 1 (at most one reader per session does).
	polling atomic.Bool
	// The working-flag lease (lease.go): waiters counts the goroutines
	// blocked for the session's events; leaseSeq counts the polls that
	// ended with a lease, tickSeq is its value at the last leaseTick, and
	// leaseArmed is set while leaseTimer runs.
	waiters    atomic.Int32
	leaseSeq   atomic.Uint64
	tickSeq    atomic.Uint64
	leaseArmed atomic.Bool
	leaseTimer *time.Timer
	sendMu     sync.Mutex
	ctlMu      sync.Mutex // serializes writes on conn
	scratch    []byte     // message buffer, guarded by ctlMu
	released   atomic.Bool
	// closeCalled is set by the first Close.
	closeCalled atomic.Bool
	ctr         counters

	mu sync.Mutex
	// streams routes events to streams by id: open streams and streams
	// waiting for the peer's close. A stream leaves it once both closes
	// were exchanged, so that a later event for its id is a new stream.
	streams map[uint32]*Stream
	// live holds the streams not yet closed locally, routed or not: they
	// may still read from shared memory, and Close must end them.
	live    map[*Stream]struct{}
	nextID  uint32
	freeIDs []uint32 // client: ids whose streams both sides closed, for reuse
	// awaiting holds the ids of streams a client closed first and no longer
	// routes; the peer's close, if one comes, makes the id reusable. At most
	// maxAwaiting: shmipc-go and the Rust crate never send that close.
	awaiting map[uint32]struct{}
	accepts  []*Stream
	acceptCh chan struct{} // cap 1: a stream was queued for AcceptStream
	err      error         // why the session ended; set once under mu
	// closeWhenIdle ends the session with its last stream.
	closeWhenIdle bool
	// idleTimeout > 0 ends the session after that long without a stream;
	// idleTimer is armed while the session is idle.
	idleTimeout time.Duration
	idleTimer   *time.Timer
	hr          hotRestart // hot-restart state (hotrestart.go)

	dead      chan struct{} // closed when the session ends, for any reason
	recvDone  chan struct{} // closed when recvLoop has returned
	closeOnce sync.Once
}

// Client runs the client side of the handshake over conn (PROTOCOL.md 1.4),
// creating a buffer region and an IO queue as cfg says, and returns a
// session that opens streams. A nil cfg means the defaults. Over a Unix
// socket with MemoryAuto it uses v3 and memfds; over TCP, v2 with files in
// cfg.ShmDir. The session owns conn from then on, also when Client fails:
// conn is closed then.
func Client(conn net.Conn, cfg *Config) (*Session, error) {
	return start(conn, cfg, true)
}

// Server runs the server side of the handshake over conn, accepting the v2
// and v3 handshakes (PROTOCOL.md 1.4), and returns a session whose streams
// come from AcceptStream. A nil cfg means the defaults. The session owns conn
// from then on, also when Server fails: conn is closed then. A failed
// handshake returns a *SessionError wrapping ErrHandshake.
func Server(conn net.Conn, cfg *Config) (*Session, error) {
	return start(conn, cfg, false)
}

func start(conn net.Conn, cfg *Config, isClient bool) (*Session, error) {
	if cfg != nil {
		if err := cfg.Validate(); err != nil {
			conn.Close()
			return nil, err
		}
	}
	c := cfg.withDefaults()
	var (
		mem     *memory
		version uint8
		err     error
	)
	if isClient {
		mem, version, err = clientHandshake(conn, &c)
	} else {
		mem, version, err = serverHandshake(conn, &c)
	}
	if err != nil {
		conn.Close()
		c.Logger.Debug("shmlink: handshake failed", "remote", conn.RemoteAddr(), "err", err)
		return nil, err
	}
	s := &Session{
		cfg:      c,
		conn:     conn,
		isClient: isClient,
		version:  version,
		pollMsg:  wire.AppendSimple(nil, version, wire.TypePolling),
		mem:      mem,
		streams:  make(map[uint32]*Stream),
		live:     make(map[*Stream]struct{}),
		nextID:   2, // PROTOCOL.md section 4
		acceptCh: make(chan struct{}, 1),
		dead:     make(chan struct{}),
		recvDone: make(chan struct{}),
	}
	s.leaseTimer = s.newLeaseTimer()
	dataBytes := 0
	for _, l := range mem.region.Lists() {
		s.maxLinks += int(l.Cap)
		dataBytes += int(l.Cap) * int(l.SliceSize)
	}
	s.pressureBytes = dataBytes / 4
	switch s.shmLimit = c.StreamMemoryLimit; {
	case s.shmLimit == 0:
		s.shmLimit = mem.region.Len() / 4
	case s.shmLimit < 0:
		s.shmLimit = math.MaxInt
	}
	s.heapLimit = max(c.StreamHeapLimit, 0)
	s.sessionShmLimit = mem.region.Len() / 2
	if len(mem.remove) > 0 {
		s.names = mem.remove
		s.namesLive.Store(true)
	}
	if c.StreamMemoryLimit < 0 {
		s.sessionShmLimit = math.MaxInt
	}
	c.Logger.Debug("shmlink: session started", "client", isClient, "version", version,
		"remote", conn.RemoteAddr(), "buffer", len(mem.bufMem), "queue_cap", mem.send.Cap())
	go s.recvLoop()
	return s, nil
}

// IsClient reports whether this is the client side of the session.
func (s *Session) IsClient() bool { return s.isClient }

// Version returns the negotiated protocol version, 2 or 3.
func (s *Session) Version() uint8 { return s.version }

// LocalAddr returns the local address of the control connection.
func (s *Session) LocalAddr() net.Addr { return s.conn.LocalAddr() }

// RemoteAddr returns the remote address of the control connection.
func (s *Session) RemoteAddr() net.Addr { return s.conn.RemoteAddr() }

// Done returns a channel closed when the session has ended, by Close or
// because the peer or the connection failed; Err then says why.
func (s *Session) Done() <-chan struct{} { return s.dead }

// Err returns nil while the session runs, then why it ended:
// ErrSessionClosed after Close, or a *SessionError.
func (s *Session) Err() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.err
}

// NumStreams returns the number of streams the session routes events to:
// open ones and closed ones still waiting for the peer's close.
func (s *Session) NumStreams() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.streams)
}

// OpenStream opens a new stream on a client session and announces it to the
// server with an event whose slice holds zero bytes (PROTOCOL.md section 4:
// the server creates a stream on its first event), so that the server's
// AcceptStream returns before any data: protocols where the server speaks
// first work. Ids of streams that both sides closed are reused. It returns
// ErrNotClient on a server session, the session's error once it has ended,
// ErrStreamIDs when ids are exhausted, ErrDraining once the session has
// acknowledged a hot restart (see Draining), ctx.Err() if ctx is done
// before the announcement is queued, and ErrQueueFull if the peer leaves
// the IO queue full for Config.QueueFullTimeout.
func (s *Session) OpenStream(ctx context.Context) (*Stream, error) {
	if !s.isClient {
		return nil, ErrNotClient
	}
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	s.mu.Lock()
	if s.err != nil {
		s.mu.Unlock()
		return nil, s.err
	}
	if s.hr.acked {
		s.mu.Unlock()
		return nil, ErrDraining
	}
	var id uint32
	for id == 0 && len(s.freeIDs) > 0 {
		id = s.freeIDs[len(s.freeIDs)-1]
		s.freeIDs = s.freeIDs[:len(s.freeIDs)-1]
		if s.streams[id] != nil {
			id = 0 // cannot happen: recycled ids are unrouted first
		}
	}
	if id == 0 {
		if s.nextID == 0 {
			s.mu.Unlock()
			return nil, ErrStreamIDs
		}
		id = s.nextID
		s.nextID++
	}
	st := newStream(s, id)
	s.addLocked(st)
	s.mu.Unlock()
	st.wmu.Lock()
	err := s.announce(ctx, st)
	st.wmu.Unlock()
	if err != nil {
		st.Close()
		return nil, err
	}
	return st, nil
}

// addLocked registers a new stream: routed and live. The caller holds mu.
func (s *Session) addLocked(st *Stream) {
	s.streams[st.id] = st
	s.live[st] = struct{}{}
	if s.idleTimer != nil {
		s.idleTimer.Stop()
	}
}

// announce sends the event that opens st on the server: its slice holds
// zero bytes and the server recycles it. When no slice can be had it sends
// an empty FallbackData instead, and the stream stays on the socket like
// one that fell back: the server may pop the stream's later events from
// the IO queue (its data, its close) before it reads the announcement from
// the socket, and the announcement would then open the stream anew, after
// its end. The caller holds st.wmu.
func (s *Session) announce(ctx context.Context, st *Stream) error {
	s.memMu.RLock()
	defer s.memMu.RUnlock()
	if s.mem == nil {
		return s.Err()
	}
	region := s.mem.region
	off, err := region.Alloc(0)
	if errors.Is(err, buffer.ErrNoSpace) {
		st.viaSocket = true
		return s.writeFallback(st.id, nil, false)
	}
	if err == nil {
		err = region.SetPayload(off, 0)
	}
	if err != nil {
		s.fail(&SessionError{Op: "open stream", Err: err})
		return s.Err()
	}
	// The announcement always wakes the server: its AcceptStream must not
	// wait for the end of a lease of the working flag.
	err = s.putEvent(queue.Event{StreamID: st.id, Offset: off, Status: stateOpen}, nil, ctx.Done(), true)
	if err != nil {
		region.Free(off)
		if err == errDeadline {
			return ctx.Err()
		}
		return err
	}
	return nil
}

// AcceptStream waits for the next stream the client opened. It returns
// ErrNotServer on a client session, ctx.Err() when ctx is done, and the
// session's error once the session has ended and every stream it had
// opened was accepted.
func (s *Session) AcceptStream(ctx context.Context) (*Stream, error) {
	if s.isClient {
		return nil, ErrNotServer
	}
	for {
		s.mu.Lock()
		if len(s.accepts) > 0 {
			st := s.accepts[0]
			s.accepts[0] = nil
			s.accepts = s.accepts[1:]
			s.mu.Unlock()
			return st, nil
		}
		err := s.err
		s.mu.Unlock()
		if err != nil {
			return nil, err
		}
		select {
		case <-s.acceptCh:
		case <-s.dead:
		case <-ctx.Done():
			return nil, ctx.Err()
		}
	}
}

// Close ends the session: every stream fails with an error satisfying
// errors.Is(err, net.ErrClosed), data not yet read is dropped, the control
// connection is closed and the shared memory unmapped (and its files
// removed). Slices returned by zero-copy reads become invalid. Close waits
// for the session's goroutine and returns nil, also when the session had
// already ended by itself; later calls return ErrSessionClosed.
func (s *Session) Close() error {
	if s.closeCalled.Swap(true) {
		return ErrSessionClosed
	}
	s.fail(ErrSessionClosed)
	s.mu.Lock()
	sts := make([]*Stream, 0, len(s.live))
	for st := range s.live {
		sts = append(sts, st)
	}
	s.accepts = nil
	s.mu.Unlock()
	for _, st := range sts {
		st.Close()
	}
	// Streams closed earlier were waiting for the peer's close: forget them.
	s.mu.Lock()
	clear(s.streams)
	s.mu.Unlock()
	<-s.recvDone
	s.maybeRelease()
	return nil
}

// fail ends the session with err (the first error wins): the control
// connection is closed and every blocked call wakes. The shared memory stays
// mapped until no stream holds data in it (maybeRelease).
func (s *Session) fail(err error) {
	s.closeOnce.Do(func() {
		s.mu.Lock()
		if s.err == nil {
			s.err = err
		}
		err = s.err
		if s.idleTimer != nil {
			s.idleTimer.Stop()
		}
		s.leaseTimer.Stop()
		sts := make([]*Stream, 0, len(s.live))
		for st := range s.live {
			sts = append(sts, st)
		}
		s.mu.Unlock()
		switch {
		case errors.Is(err, ErrProtocol) || errors.Is(err, buffer.ErrCorrupt) || errors.Is(err, queue.ErrCorrupt):
			s.cfg.Logger.Warn("shmlink: session ended", "remote", s.conn.RemoteAddr(), "err", err)
		case !errors.Is(err, net.ErrClosed):
			s.cfg.Logger.Debug("shmlink: session ended", "remote", s.conn.RemoteAddr(), "err", err)
		}
		close(s.dead)
		s.conn.Close()
		for _, st := range sts {
			st.notifyRead()
		}
	})
}

// maybeRelease unmaps the shared memory once the session has ended and no
// stream is left that may still read from it. It waits for the receive
// loop, so it must not be called from it before it returns, nor with memMu
// held.
func (s *Session) maybeRelease() {
	s.mu.Lock()
	ready := s.err != nil && len(s.live) == 0
	s.mu.Unlock()
	if !ready || s.released.Load() {
		return
	}
	<-s.recvDone
	s.memMu.Lock()
	if s.mem != nil {
		s.mem.release()
		s.mem = nil
		s.released.Store(true)
	}
	s.memMu.Unlock()
}

// unroute stops routing events to st: both sides closed it (or the session
// ended), so a later event for its id belongs to a new stream. inRecvLoop
// says the caller is the receive loop, which releases the memory itself
// when it returns.
func (s *Session) unroute(st *Stream, inRecvLoop bool) {
	s.mu.Lock()
	if s.streams[st.id] == st {
		delete(s.streams, st.id)
	}
	s.mu.Unlock()
	s.checkIdle(inRecvLoop)
}

// maxAwaiting bounds Session.awaiting.
const maxAwaiting = 4096

// forgetClosed stops routing events to st, which a client closed before
// the peer did: a client drops events for ids it does not route, and
// shmipc-go and the Rust crate never answer a close, so keeping st would
// leak it. If the peer does answer (this package does), the id is reused
// then, provided our close went through the IO queue (see recycle).
func (s *Session) forgetClosed(st *Stream) {
	st.mu.Lock()
	remoteClosed, onSocket := st.remoteClosed, st.closeOnSocket
	st.mu.Unlock()
	s.mu.Lock()
	if s.streams[st.id] == st && !remoteClosed {
		delete(s.streams, st.id)
		if !onSocket && s.err == nil {
			if s.awaiting == nil {
				s.awaiting = make(map[uint32]struct{})
			}
			if len(s.awaiting) >= maxAwaiting {
				for id := range s.awaiting {
					delete(s.awaiting, id) // that id is simply not reused
					break
				}
			}
			s.awaiting[st.id] = struct{}{}
		}
	}
	s.mu.Unlock()
	s.checkIdle(false)
}

// retire forgets st as a live stream: it was closed locally and holds no
// shared memory any more.
func (s *Session) retire(st *Stream) {
	s.mu.Lock()
	delete(s.live, st)
	s.mu.Unlock()
	s.checkIdle(false)
	s.maybeRelease()
}

// recycle makes id available to OpenStream again. A client calls it once
// both closes of the stream were exchanged and its own close went through
// the IO queue: a StreamClose on the socket could be overtaken by the next
// stream's first event, which the server would then route to the old
// stream, so such ids are not reused.
func (s *Session) recycle(id uint32, onSocket bool) {
	if !s.isClient || onSocket {
		return
	}
	s.mu.Lock()
	if s.err == nil && s.streams[id] == nil {
		s.freeIDs = append(s.freeIDs, id)
	}
	s.mu.Unlock()
}

// checkIdle acts on a session that has no stream left, neither routed nor
// live: a session marked with CloseWhenIdle ends, one with an idle timeout
// arms its timer.
func (s *Session) checkIdle(inRecvLoop bool) {
	s.maybeAck()
	s.mu.Lock()
	idle := len(s.streams) == 0 && len(s.live) == 0 && s.err == nil
	closeNow := idle && s.closeWhenIdle
	if idle && !closeNow && s.idleTimeout > 0 {
		if s.idleTimer == nil {
			s.idleTimer = time.AfterFunc(s.idleTimeout, s.idleExpired)
		} else {
			s.idleTimer.Reset(s.idleTimeout)
		}
	}
	if closeNow {
		s.err = ErrSessionClosed // OpenStream fails from here on
	}
	s.mu.Unlock()
	if closeNow {
		s.fail(ErrSessionClosed)
		if !inRecvLoop {
			s.maybeRelease()
		}
	}
}

// idleExpired ends the session if it is still idle when its idle timer
// fires.
func (s *Session) idleExpired() {
	s.mu.Lock()
	idle := len(s.streams) == 0 && len(s.live) == 0 && s.err == nil
	if idle {
		s.err = ErrSessionClosed // OpenStream fails from here on
	}
	s.mu.Unlock()
	if idle {
		s.cfg.Logger.Debug("shmlink: idle session closed", "remote", s.conn.RemoteAddr(), "after", s.idleTimeout)
		s.fail(ErrSessionClosed)
		s.maybeRelease()
	}
}

// CloseWhenIdle makes the session end as soon as it has no stream left
// (right away if it has none): for a session dialed for a single stream.
func (s *Session) CloseWhenIdle() {
	s.mu.Lock()
	s.closeWhenIdle = true
	s.mu.Unlock()
	s.checkIdle(false)
}

// SetIdleTimeout makes the session end once it has had no stream for d:
// none open and none waiting for the peer's close. OpenStream then returns
// ErrSessionClosed. Zero or a negative d turns the timeout off. It is meant
// for a pool of client sessions (shmlink.Dialer).
func (s *Session) SetIdleTimeout(d time.Duration) {
	s.mu.Lock()
	s.idleTimeout = d
	if d <= 0 && s.idleTimer != nil {
		s.idleTimer.Stop()
	}
	s.mu.Unlock()
	s.checkIdle(false)
}

// recvLoop reads control messages until the connection ends; it alone
// drains the receive queue, so the queue has a single consumer.
func (s *Session) recvLoop() {
	defer func() {
		close(s.recvDone)
		s.maybeRelease()
	}()
	r := bufio.NewReaderSize(s.conn, 64<<10)
	var hdr [wire.HeaderSize]byte
	var small [16]byte
	for {
		if _, err := io.ReadFull(r, hdr[:]); err != nil {
			if errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) {
				// The peer may have put events (data, closes) and closed
				// the connection before its Polling went out (the Rust
				// crate's SessionManager::close does): deliver them.
				if derr := s.drain(); derr != nil && !errors.Is(derr, ErrSessionClosed) {
					s.fail(&SessionError{Op: "read", Err: derr})
					return
				}
				err = ErrPeerClosed
			}
			s.fail(&SessionError{Op: "read", Err: err})
			return
		}
		h, err := wire.ParseHeader(hdr[:], uint32(s.cfg.MaxMessageSize))
		if err != nil {
			s.fail(&SessionError{Op: "read", Err: err})
			return
		}
		n := int(h.Length) - wire.HeaderSize
		var payload []byte
		if h.Type == wire.TypeFallbackData {
			// The data part becomes the stream's; read it into its own buffer.
			payload = make([]byte, n)
		} else if n <= len(small) {
			payload = small[:n]
		} else {
			s.fail(&SessionError{Op: "read", Err: fmt.Errorf("%w: %v of %d bytes", ErrProtocol, h.Type, h.Length)})
			return
		}
		if _, err := io.ReadFull(r, payload); err != nil {
			s.fail(&SessionError{Op: "read", Err: err})
			return
		}
		s.forgetNames()
		if err := s.handle(h, payload); err != nil {
			s.fail(&SessionError{Op: "read " + h.Type.String(), Err: err})
			return
		}
	}
}

// handle acts on one runtime control message.
func (s *Session) handle(h wire.Header, payload []byte) error {
	switch h.Type {
	case wire.TypePolling:
		// Counted once handled, so that a count equal to the peer's
		// WakeupsSent means no wakeup is still on its way to a drain.
		err := s.drain()
		s.ctr.wakeupsReceived.Add(1)
		return err
	case wire.TypeStreamClose:
		id, err := wire.ParseStreamClose(payload)
		if err != nil {
			return err
		}
		// Events put before the close was sent come first.
		if err := s.drain(); err != nil {
			return err
		}
		return s.dispatch(queue.Event{StreamID: id, Status: stateClosed}, nil)
	case wire.TypeFallbackData:
		id, status, data, err := wire.ParseFallback(payload)
		if err != nil {
			return err
		}
		if err := s.drain(); err != nil {
			return err
		}
		s.ctr.fallbackRead.Add(1)
		s.ctr.bytesReceived.Add(uint64(len(data)))
		return s.dispatch(queue.Event{StreamID: id, Status: status}, data)
	case wire.TypeHotRestart:
		return s.handleHotRestart(payload)
	case wire.TypeHotRestartAck:
		return s.handleHotRestartAck(payload)
	}
	return fmt.Errorf("%w: %v after the handshake", ErrProtocol, h.Type)
}

// drain pops every event of the receive queue and dispatches it, then
// settles the working flag (see drainLocked).
func (s *Session) drain() error {
	s.drainMu.Lock()
	defer s.drainMu.Unlock()
	s.memMu.RLock()
	defer s.memMu.RUnlock()
	if s.mem == nil {
		return ErrSessionClosed
	}
	return s.drainLocked(true)
}

// drainLocked pops every event of the receive queue and dispatches it.
// With settle set it then clears the working flag and checks the queue
// again, draining anew if an event came meanwhile, so that no event is
// stranded without a wakeup (PROTOCOL.md section 3.3); but while a reader
// polls the queue the flag stays at 1, and that reader settles it when it
// stops. The caller holds drainMu and memMu's read lock with the memory
// mapped.
func (s *Session) drainLocked(settle bool) error {
	recv := s.mem.recv
	for {
		for {
			ev, ok, err := recv.Pop()
			if err != nil {
				return err
			}
			if !ok {
				break
			}
			s.ctr.eventsReceived.Add(1)
			s.forgetNames()
			if err := s.dispatchLocked(ev, nil); err != nil {
				return err
			}
		}
		if !settle || s.polling.Load() {
			return nil
		}
		recv.ClearWorking()
		if recv.Empty() {
			return nil
		}
		recv.SetWorking()
	}
}

// forgetNames unlinks the files of a v2 handshake once the server has
// spoken: it mapped them before anything it sends, so a kill -9 of this
// process later leaves nothing behind in ShmDir.
func (s *Session) forgetNames() {
	if s.namesLive.Load() && s.namesLive.CompareAndSwap(true, false) {
		for _, p := range s.names {
			os.Remove(p)
		}
	}
}

// dispatch delivers one event or FallbackData (data non-nil) to its stream.
func (s *Session) dispatch(ev queue.Event, data []byte) error {
	s.memMu.RLock()
	defer s.memMu.RUnlock()
	if s.mem == nil {
		return ErrSessionClosed
	}
	return s.dispatchLocked(ev, data)
}

// dispatchLocked is dispatch with memMu read-locked and the memory mapped.
func (s *Session) dispatchLocked(ev queue.Event, data []byte) error {
	state := ev.Status & 0xff
	if state > stateClosed {
		return fmt.Errorf("%w: stream %d: status %#x", ErrProtocol, ev.StreamID, ev.Status)
	}
	s.mu.Lock()
	st := s.streams[ev.StreamID]
	if st == nil {
		if s.isClient || state != stateOpen || ev.StreamID == 0 || s.err != nil {
			if _, ok := s.awaiting[ev.StreamID]; ok && state == stateClosed {
				// The peer answered the close of a stream we forgot.
				delete(s.awaiting, ev.StreamID)
				if s.err == nil {
					s.freeIDs = append(s.freeIDs, ev.StreamID)
				}
			}
			s.mu.Unlock()
			// Data for a stream we do not know: recycle it.
			if ev.Offset != 0 {
				if _, err := s.mem.region.FreeChain(ev.Offset); err != nil {
					return err
				}
			}
			return nil
		}
		st = newStream(s, ev.StreamID)
		if len(s.accepts) < s.cfg.AcceptBacklog {
			s.addLocked(st)
			s.accepts = append(s.accepts, st)
			select {
			case s.acceptCh <- struct{}{}:
			default:
			}
		} else {
			// Refused: the stream is closed at once but stays routed until
			// the client's close, so that the client's events still in
			// flight are recycled instead of opening it again.
			st.closed, st.wclosed, st.closeSent = true, true, true
			close(st.closedCh)
			s.streams[st.id] = st
			s.mu.Unlock()
			s.cfg.Logger.Warn("shmlink: accept backlog full, refusing stream", "stream", ev.StreamID)
			onSocket := s.sendCloseLocked(ev.StreamID, false)
			st.mu.Lock()
			st.closeOnSocket = onSocket
			st.mu.Unlock()
			if ev.Offset != 0 {
				if _, err := s.mem.region.FreeChain(ev.Offset); err != nil {
					return err
				}
			}
			if state == stateClosed {
				st.remoteClose()
			}
			return nil
		}
	}
	s.mu.Unlock()
	if ev.Offset != 0 {
		if err := st.pushChain(ev.Offset); err != nil {
			return err
		}
	} else if len(data) > 0 {
		st.pushBytes(data)
	}
	if state == stateClosed {
		st.remoteClose()
	}
	return nil
}

// putEvent publishes one event on the send queue and wakes the peer if it
// is idle (PROTOCOL.md section 3.3), or with wake set whatever its working
// flag says (a peer of this package may lease the flag: lease.go). It
// waits for room while the queue is full, until closed is closed
// (ErrStreamClosed), cancel is closed (errDeadline), the session ends, or
// Config.QueueFullTimeout passes (ErrQueueFull). The caller holds memMu's
// read lock with the memory mapped.
func (s *Session) putEvent(ev queue.Event, closed, cancel <-chan struct{}, wake bool) error {
	send := s.mem.send
	var start time.Time
	for spins := 0; ; spins++ {
		s.sendMu.Lock()
		err := send.Put(ev)
		s.sendMu.Unlock()
		if err == nil {
			s.ctr.eventsSent.Add(1)
			break
		}
		if !errors.Is(err, queue.ErrFull) {
			s.fail(&SessionError{Op: "send", Err: err})
			return s.Err()
		}
		if spins == 0 {
			start = time.Now()
			s.ctr.queueFull.Add(1)
		}
		select {
		case <-s.dead:
			return s.Err()
		case <-closed:
			return ErrStreamClosed
		case <-cancel:
			return errDeadline
		default:
		}
		if time.Since(start) > s.cfg.QueueFullTimeout {
			return ErrQueueFull
		}
		// The peer is behind: give it the CPU, then back off.
		if spins < 64 {
			runtime.Gosched()
		} else {
			time.Sleep(min(time.Duration(spins-63)*10*time.Microsecond, time.Millisecond))
		}
	}
	if send.MarkWorking() || wake {
		s.ctr.wakeupsSent.Add(1)
		return s.writeCtl(s.pollMsg)
	}
	return nil
}

// sendCloseLocked tells the peer that stream id is closed: an event
// {id, 0, 1}, or a StreamClose message when the queue is full or viaSocket
// is set (the stream's earlier data went over the socket, which the event
// could overtake). It reports whether the close went over the socket (or
// could not be sent). Errors end the session and are not returned: a close
// that cannot be sent means the session is gone anyway. The caller holds
// memMu's read lock with the memory mapped.
func (s *Session) sendCloseLocked(id uint32, viaSocket bool) (onSocket bool) {
	if !viaSocket {
		s.sendMu.Lock()
		err := s.mem.send.Put(queue.Event{StreamID: id, Status: stateClosed})
		s.sendMu.Unlock()
		if err == nil {
			s.ctr.eventsSent.Add(1)
			if s.mem.send.MarkWorking() {
				s.ctr.wakeupsSent.Add(1)
				s.writeCtl(s.pollMsg)
			}
			return false
		}
		if !errors.Is(err, queue.ErrFull) {
			s.fail(&SessionError{Op: "send", Err: err})
			return true
		}
		s.ctr.queueFull.Add(1)
	}
	// A Polling first: the peer may handle StreamClose without draining its
	// receive queue (the Rust crate does), and events of this stream may
	// still be in it.
	s.ctlMu.Lock()
	s.scratch = append(s.scratch[:0], s.pollMsg...)
	s.ctr.wakeupsSent.Add(1)
	s.scratch = wire.AppendStreamClose(s.scratch, s.version, id)
	err := s.writeCtlLocked(s.scratch)
	s.ctlMu.Unlock()
	if err != nil {
		s.fail(&SessionError{Op: "write", Err: err})
	}
	return true
}

// writeFallback sends data for stream id as one FallbackData message
// (PROTOCOL.md section 1.2), after a Polling if poll is set. A stream sets
// poll on its first FallbackData after events: a peer may handle
// FallbackData without draining its receive queue first (the Rust crate
// does), so the Polling makes it drain the stream's earlier events before
// it reads these bytes.
func (s *Session) writeFallback(id uint32, data []byte, poll bool) error {
	s.ctlMu.Lock()
	defer s.ctlMu.Unlock()
	s.scratch = s.scratch[:0]
	if poll {
		s.scratch = append(s.scratch, s.pollMsg...)
		s.ctr.wakeupsSent.Add(1)
	}
	s.scratch = wire.AppendFallbackHeader(s.scratch, s.version, id, stateOpen, len(data))
	bufs := net.Buffers{s.scratch, data}
	if _, err := bufs.WriteTo(s.conn); err != nil {
		s.fail(&SessionError{Op: "write", Err: err})
		return s.Err()
	}
	s.ctr.fallbackWrites.Add(1)
	s.ctr.bytesSent.Add(uint64(len(data)))
	return nil
}

// writeCtl writes one whole control message; a failure ends the session.
func (s *Session) writeCtl(msg []byte) error {
	s.ctlMu.Lock()
	err := s.writeCtlLocked(msg)
	s.ctlMu.Unlock()
	if err != nil {
		s.fail(&SessionError{Op: "write", Err: err})
		return s.Err()
	}
	return nil
}

func (s *Session) writeCtlLocked(msg []byte) error {
	_, err := s.conn.Write(msg)
	return err
}
