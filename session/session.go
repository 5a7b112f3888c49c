package session

import (
	"cmp"
	"context"
	"errors"
	"math"
	"net"
	"sync"
	"sync/atomic"
	"time"

	"github.com/shmlink/shmlink/buffer"
	"github.com/shmlink/shmlink/internal/shm"
	"github.com/shmlink/shmlink/internal/testhook"
	"github.com/shmlink/shmlink/queue"
)

// A Session is one control connection plus the shared memory it set up: a
// buffer region and an IO queue per direction. It multiplexes streams.
// The client side opens streams (OpenStream); the server side accepts them
// (AcceptStream). All methods are safe for concurrent use. The package
// documentation describes its goroutines and locks.
type Session struct {
	cfg      Config
	conn     net.Conn
	isClient bool
	version  uint8

	shm   sharedMem  // the mapping, and what unread data may hold of it
	rx    receiver   // who harvests the receive queue; spinning; the lease
	tk    ticker     // the housekeeping timer: ends leases, hands the connection back
	ctl   *ctlWriter // writes on the control connection
	putMu sync.Mutex // serializes puts on the send queue: it has one producer
	ctr   counters
	// warnRefused and warnAck rate-limit warnings a peer can trigger.
	warnRefused, warnAck rateLimit

	mu   sync.Mutex  // guards tab, err, idle and hr
	tab  streamTable // the session's streams
	err  error       // why the session ended; set once
	idle idleState
	hr   hotRestart // hot-restart state (hotrestart.go)
	ka   keepAlive  // Config.KeepAlive's checks (keepalive.go)

	// announces is set on a client whose server is shmlink (its marker,
	// marker.go): OpenStream announces a stream at once, so that the
	// server's AcceptStream returns it before any byte is written.
	announces bool
	// closeReasons is set on a server whose client is shmlink (its
	// marker, marker.go): a refused stream's close says so (section 11).
	closeReasons bool

	// pollOff turns polling off once the session pairs with its peer in
	// this process (local.go), whatever Config.PollTime says (pollTime).
	pollOff atomic.Bool

	// localPeer is set when the peer is this process (peerIsSelf) and
	// the queue's file is known: local, once set, is the peer's session,
	// to whose harvester (localWake) wakes go (local.go).
	localPeer    bool
	localID      shm.FileID
	local        atomic.Pointer[Session]
	localWake    chan struct{}
	localPending atomic.Uint64 // wakes handed over and not yet harvested
	// localSleeper is a reader of this session asleep in waitForData that
	// harvests the next wake itself, in place of the harvester goroutine
	// (local.go, sleepLocal), or nil.
	localSleeper atomic.Pointer[Stream]

	dead        chan struct{} // closed when the session ends, for any reason
	closeOnce   sync.Once     // runs fail's ending once
	closeCalled atomic.Bool   // set by the first Close

	// pumpHook, if set (tests only, before the session is used), is
	// called by a pump once it has set the connection's read deadline,
	// before it reads (ctlread.go).
	pumpHook func(*Stream)
	// pumpDoneHook, if set (tests only), is called by a pump that got
	// what it waited for, after it chose whether to hand the connection
	// back and before it lets go of it (ctlread.go).
	pumpDoneHook func(*Stream)
	// waitHook, if set (tests only, before the session is used), is
	// called by a reader at the start of each wait for data, once it
	// found too few bytes buffered (waitForData, recv.go).
	waitHook func(*Stream)
	// spillHook, if set (tests only, under shm.mu), is called by
	// pushChain before it copies a checked chain at off out of the region
	// (recv.go).
	spillHook func(region *buffer.Region, off uint32)
}

// sharedMem is a session's mapping of the shared memory and the limits on
// what unread data may hold of it (docs/protocol.md section 13).
type sharedMem struct {
	// mu is read-held by whoever touches the mapping and write-held only
	// to unmap it.
	mu       sync.RWMutex
	mem      *memory     // nil once unmapped
	unmapped atomic.Bool // mem is gone for good
	// unread is the capacity of the slices that the unread data of all
	// streams occupies, in bytes; sessionLimit bounds it (half the region).
	unread       atomic.Int64
	sessionLimit int
	// holding counts the peer's slices that streams hold: the current
	// slice of each unread message in the region, and each slice behind a
	// zero-copy result not yet released. Each is a slice the peer cannot
	// have allocated again, so a correct peer never takes it to maxLinks;
	// one that puts a slice we hold, again and again, would make every
	// such message cost memory here (Stream.pushChain refuses it).
	holding atomic.Int64
	// streamLimit and heapLimit bound one stream's unread bytes held in
	// the region and copied out of it (Config.StreamMemoryLimit,
	// Config.StreamHeapLimit).
	streamLimit, heapLimit int
	// heapUnread is the unread bytes all streams hold on the heap, with
	// heapChunkCost per message queued there (Stream.addHeap). No
	// FallbackData is delivered while its stream holds more than
	// socketLimit there, or all streams more than four times that:
	// max(StreamHeapLimit, MaxMessageSize) and the cost of its pieces, so
	// that a peer may always send one whole message of the largest size. The receive loop waits for
	// readers then, and ends the session if none reads for
	// Config.QueueFullTimeout.
	heapUnread  atomic.Int64
	socketLimit int
	// heapWaiting is set while the receive loop waits for readers to take
	// heap bytes before it delivers more FallbackData (recvFallback);
	// heapTaken (cap 1) then says that a reader took some.
	heapWaiting atomic.Bool
	heapTaken   chan struct{}
	// spaceWaiters counts the writers that wait for free slices
	// (Stream.withSpace). While there are any, whoever frees slices here,
	// or harvests the peer's events (its reader frees what it read),
	// wakes those listed in spaceListed (noteFreed), under spaceMu. Each
	// stream's channel (Stream.spaceCh) is listed at most once.
	spaceWaiters atomic.Int32
	spaceMu      sync.Mutex
	spaceListed  []*Stream
	// spaceWait is the first of withSpace's timed waits (4 µs); they
	// double up to 64 times it. A test sets it long.
	spaceWait time.Duration
	// pressureBytes is the free capacity of the region (a quarter of it)
	// below which those limits apply: with more free, nobody waits for
	// slices and copying out would only slow the reader down.
	pressureBytes int
	maxLinks      int // slices in the region: the longest possible chain

	maxSlice int // data bytes of the region's largest slice: the most a Reserve gives
}

// streamTable holds a session's streams, guarded by Session.mu.
type streamTable struct {
	// routed maps ids to the streams events go to: open streams and, on
	// a server, streams waiting for the peer's close. A stream leaves it
	// once both closes were exchanged (on a client, once the application
	// closed it: forgetClosed), so that a later event for its id is a new
	// stream.
	routed map[uint32]*Stream
	// live holds the streams not yet closed locally, routed or not: they
	// may still read from shared memory, and Close must end them.
	live    map[*Stream]struct{}
	nextID  uint32
	freeIDs []uint32 // client: ids whose streams both sides closed, for reuse
	// awaiting holds the ids of streams a client closed first and no longer
	// routes; the peer's close, if one comes, makes the id reusable. At most
	// maxAwaiting: shmipc-go and the Rust crate never send that close.
	awaiting map[uint32]struct{}
	// refused holds the ids of streams a server refused whose close from
	// the client has not come yet; at most maxAwaiting.
	refused  map[uint32]struct{}
	accepts  []*Stream     // opened by the client, not yet accepted
	acceptCh chan struct{} // cap 1: a stream was queued on accepts
}

// maxAwaiting bounds streamTable.awaiting and streamTable.refused.
const maxAwaiting = 4096

// idleState ends a session that has no stream, guarded by Session.mu.
type idleState struct {
	closeWhenIdle bool          // end with the last stream
	timeout       time.Duration // > 0: end after that long without a stream
	timer         *time.Timer   // armed while the session is idle
}

// Client runs the client side of the handshake over conn (docs/protocol.md
// section 1.4), creating a buffer region and an IO queue as cfg says, and
// returns a session that opens streams. A nil cfg means the defaults. It
// speaks v3 on every network: over a Unix socket with MemoryAuto with
// memfds, over TCP with files in cfg.ShmDir. The session owns conn from then on, also when Client
// fails: conn is closed then. It returns a *ConfigError if cfg is invalid,
// and a *SessionError wrapping ErrHandshake if the handshake fails
// (Config.HandshakeTimeout bounds it), which also wraps ErrPeerRefused
// (and a *PeerError) when the peer's credentials are refused
// (Config.AllowUIDs, Config.PeerCheck).
func Client(conn net.Conn, cfg *Config) (*Session, error) {
	return start(context.Background(), conn, cfg, true)
}

// ClientContext is Client bounded by ctx too: if ctx is done before the
// handshake completes, conn is closed, everything the handshake created is
// released, and the error wraps ErrHandshake and ctx.Err(). Once it has
// returned, ctx no longer affects the session.
func ClientContext(ctx context.Context, conn net.Conn, cfg *Config) (*Session, error) {
	return start(ctx, conn, cfg, true)
}

// Server runs the server side of the handshake over conn, accepting the v2
// and v3 handshakes (docs/protocol.md section 1.4), and returns a session
// whose streams come from AcceptStream. A nil cfg means the defaults. The
// session owns conn from then on, also when Server fails: conn is closed
// then. Its errors are Client's.
func Server(conn net.Conn, cfg *Config) (*Session, error) {
	return start(context.Background(), conn, cfg, false)
}

// ServerContext is Server bounded by ctx too, as ClientContext is Client.
func ServerContext(ctx context.Context, conn net.Conn, cfg *Config) (*Session, error) {
	return start(ctx, conn, cfg, false)
}

// start runs the handshake on conn and starts the session. A ctx that is
// done during the handshake closes conn, which ends the handshake's reads
// and writes at once; its own deadline (HandshakeTimeout) cannot override
// that, as it could a deadline set from ctx.
func start(ctx context.Context, conn net.Conn, cfg *Config, isClient bool) (*Session, error) {
	if cfg != nil {
		if err := cfg.Validate(); err != nil {
			conn.Close()
			return nil, err
		}
	}
	c := cfg.withDefaults()
	handshake := serverHandshake
	if isClient {
		handshake = clientHandshake
	}
	stop := context.AfterFunc(ctx, func() { conn.Close() })
	mem, version, err := handshake(conn, &c)
	if !stop() && ctx.Err() != nil { // ctx closed conn, or is closing it
		if err == nil {
			mem.release()
		}
		err = handshakeError("canceled", ctx.Err())
	}
	if err != nil {
		conn.Close()
		c.Logger.Debug("shmlink: handshake failed", "remote", conn.RemoteAddr(), "err", err)
		return nil, err
	}
	if c.PollTime > 0 && sharesOneCPU(conn) {
		c.PollTime = -1 // docs/protocol.md section 12.8
		c.Logger.Debug("shmlink: polling off: both processes run on one CPU", "remote", conn.RemoteAddr())
	}
	s := &Session{
		cfg:      c,
		conn:     conn,
		isClient: isClient,
		version:  version,
		ctl:      newCtlWriter(conn, version, c.WriteTimeout),
		tab: streamTable{
			routed:   make(map[uint32]*Stream),
			live:     make(map[*Stream]struct{}),
			nextID:   cmp.Or(testhook.FirstStreamID.Load(), 2), // docs/protocol.md section 4
			acceptCh: make(chan struct{}, 1),
		},
		dead: make(chan struct{}),
	}
	s.rx.init(s)
	s.shm.init(mem, &c)
	s.announces = isClient && mem.features&featAnnounce != 0
	s.closeReasons = !isClient && mem.features&featCloseReason != 0
	c.Logger.Debug("shmlink: session started", "client", isClient, "version", version,
		"remote", conn.RemoteAddr(), "buffer", len(mem.bufMem), "queue", len(mem.queueMem))
	s.startKeepAlive()
	if mem.queueKnown && !c.socketWakes && peerIsSelf(conn) {
		s.localPeer = true
		s.localWake = make(chan struct{}, 1)
		s.pairLocal(mem.queueID)
	}
	go s.recvLoop()
	return s, nil
}

// init sets up the mapping mem and its limits from c.
func (m *sharedMem) init(mem *memory, c *Config) {
	m.mem = mem
	slices, dataBytes := mem.region.Capacity()
	m.maxLinks = slices
	m.maxSlice = mem.region.MaxSliceSize()
	m.pressureBytes = dataBytes / 4
	m.heapTaken = make(chan struct{}, 1)
	m.spaceWait = 4 * time.Microsecond
	m.heapLimit = max(c.StreamHeapLimit, 0)
	// Each queued piece counts heapChunkCost beyond its bytes: one whole
	// message of the largest size, in pieces of fallbackPiece, still fits.
	limit := max(m.heapLimit, c.MaxMessageSize)
	m.socketLimit = limit + (limit/fallbackPiece+1)*heapChunkCost
	switch {
	case c.StreamMemoryLimit == 0:
		m.streamLimit = len(mem.bufMem) / 4
		m.sessionLimit = len(mem.bufMem) / 2
	case c.StreamMemoryLimit < 0:
		m.streamLimit = math.MaxInt
		m.sessionLimit = math.MaxInt
	default:
		m.streamLimit = c.StreamMemoryLimit
		m.sessionLimit = len(mem.bufMem) / 2
	}
}

// pollTime returns how long a reader may poll for data at most:
// Config.PollTime (-1 when both processes run on one CPU, sharesOneCPU),
// or -1 once the session paired with its peer in this process (pollOff);
// 0 or less means polling is off.
func (s *Session) pollTime() time.Duration {
	if s.pollOff.Load() {
		return -1
	}
	return s.cfg.PollTime
}

// withMem runs f with the mapping read-locked, or returns the session's
// error without running it once the memory is unmapped. A fault on the
// memory while f runs ends the session (fault.go), and withMem returns
// the session's error.
func (s *Session) withMem(f func(m *memory) error) error {
	s.shm.mu.RLock()
	defer s.shm.mu.RUnlock()
	m := s.shm.mem
	if m == nil {
		return s.Err()
	}
	err := guard(func() error { return f(m) })
	if err != nil && isFault(err) {
		return s.failOp("shared memory", err)
	}
	return err
}

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
// ErrSessionClosed after Close, after CloseWhenIdle once the last stream
// closed, and after the idle timeout (SetIdleTimeout); ErrHotRestarted on
// a server whose client acknowledged the hot restart (SendHotRestart); or
// a *SessionError when the peer or the connection failed.
func (s *Session) Err() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.err
}

// NumStreams returns the number of streams the session routes events to:
// open ones, and on a server closed ones still waiting for the peer's
// close. A client stops routing a stream when the application closes it
// (Close, not CloseWrite), whether or not the server closed it too.
func (s *Session) NumStreams() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.tab.routed)
}

// OpenStream opens a new stream on a client session. When the server is
// shmlink (it marks the client's region in the handshake, docs/protocol.md
// section 11) the stream is announced at once with an event whose slice
// holds zero bytes, so that the server's AcceptStream returns before any
// data and protocols where the server speaks first work. Other servers
// (shmipc-go, the Rust crate) learn of the stream at its first byte, as
// their own clients do: nothing new goes to them. Ids of streams that both
// sides closed are reused. It returns an error on a server session (only
// clients open streams), the session's error once it has ended,
// ErrStreamIDs when ids are exhausted, ErrDraining once the session has
// acknowledged a hot restart (docs/protocol.md section 5), ctx.Err() if ctx
// is done before the announcement is queued, and ErrQueueFull if the peer
// leaves the IO queue full for Config.QueueFullTimeout.
func (s *Session) OpenStream(ctx context.Context) (*Stream, error) {
	if !s.isClient {
		return nil, errNotClient
	}
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	s.mu.Lock()
	id, err := s.newIDLocked()
	if err != nil {
		s.mu.Unlock()
		return nil, err
	}
	st := newStream(s, id)
	s.addLocked(st)
	s.mu.Unlock()
	if !s.announces {
		return st, nil // the server learns of the stream at its first byte
	}
	st.wmu.Lock()
	err = s.announce(ctx, st)
	st.wmu.Unlock()
	if err != nil {
		st.Close()
		return nil, err
	}
	return st, nil
}

// newIDLocked picks the id of a new client stream: a reused one if any,
// else the next. The caller holds s.mu.
func (s *Session) newIDLocked() (uint32, error) {
	switch {
	case s.err != nil:
		return 0, s.err
	case s.hr.acked:
		return 0, ErrDraining
	}
	t := &s.tab
	for len(t.freeIDs) > 0 {
		id := t.freeIDs[len(t.freeIDs)-1]
		t.freeIDs = t.freeIDs[:len(t.freeIDs)-1]
		if t.routed[id] == nil { // reused ids are unrouted first
			return id, nil
		}
	}
	if t.nextID == 0 {
		return 0, ErrStreamIDs
	}
	t.nextID++
	return t.nextID - 1, nil
}

// addLocked registers a new stream: routed and live. The caller holds s.mu.
func (s *Session) addLocked(st *Stream) {
	s.tab.routed[st.id] = st
	s.tab.live[st] = struct{}{}
	if s.idle.timer != nil {
		s.idle.timer.Stop()
	}
}

// AcceptStream waits for the next stream the client opened. It returns
// an error on a client session, ctx.Err() when ctx is done, and the
// session's error once the session has ended and every stream it had
// opened was accepted.
func (s *Session) AcceptStream(ctx context.Context) (*Stream, error) {
	if s.isClient {
		return nil, errNotServer
	}
	for {
		s.mu.Lock()
		if len(s.tab.accepts) > 0 {
			st := s.tab.accepts[0]
			s.tab.accepts[0] = nil
			s.tab.accepts = s.tab.accepts[1:]
			s.mu.Unlock()
			return st, nil
		}
		err := s.err
		s.mu.Unlock()
		if err != nil {
			return nil, err
		}
		select {
		case <-s.tab.acceptCh:
		case <-s.dead:
		case <-ctx.Done():
			return nil, ctx.Err()
		}
	}
}

// liveStreams returns the streams not yet closed locally.
func (s *Session) liveStreams() []*Stream {
	s.mu.Lock()
	defer s.mu.Unlock()
	sts := make([]*Stream, 0, len(s.tab.live))
	for st := range s.tab.live {
		sts = append(sts, st)
	}
	return sts
}

// Close ends the session: every stream fails with an error satisfying
// errors.Is(err, net.ErrClosed), data not yet read is dropped, the control
// connection is closed and the shared memory unmapped (and its files
// removed). Slices returned by zero-copy reads become invalid. Close waits
// for the session's goroutine and returns nil, also when the session had
// already ended by itself; later calls return ErrSessionClosed. Before
// it closes the connection it gives the peer a bounded chance (until
// min(HandshakeTimeout, 1 s)) to take the events still queued.
func (s *Session) Close() error {
	if s.closeCalled.Swap(true) {
		return ErrSessionClosed
	}
	s.drainSend()
	s.fail(ErrSessionClosed)
	s.mu.Lock()
	s.tab.accepts = nil
	s.mu.Unlock()
	for _, st := range s.liveStreams() {
		if st.Close() == ErrStreamClosed {
			// Another goroutine's Close is under way (a handler closing
			// its connection as the server shuts down): it forgets
			// the stream before the memory may be unmapped below.
			st.closing.Wait()
		}
	}
	// fail forgot the streams closed earlier, and each Close above
	// unrouted its own; what is left is a stream whose Close runs
	// concurrently and would unroute it a moment later: forget it now, so
	// that the session counts no stream once Close returns.
	s.mu.Lock()
	clear(s.tab.routed)
	s.mu.Unlock()
	<-s.rx.done
	s.ctl.flushers.Wait()
	s.unmapIfUnused()
	return nil
}

// drainSend gives the peer a bounded chance, until the send queue is
// empty and no write is owed on the connection, or for at most
// min(HandshakeTimeout, 1 s), to take the events still queued and the
// owed writes before Close closes the connection. A shmipc-go peer acts on
// the connection's end before it reads the events queued before it, and
// would lose a stream's last data and close (docs/protocol.md section 8).
// An owed write is the rest of a message whose stream's Close or deadline
// cut its write, or closes owed to the closer goroutine (ctlWriter.owing):
// closing the connection under it would end it inside a message, and the
// peer's session with an error. It returns at once when the session has
// ended.
func (s *Session) drainSend() {
	limit := time.Now().Add(min(s.cfg.HandshakeTimeout, time.Second))
	var tick *time.Ticker
	for s.Err() == nil {
		var empty bool
		if s.withMem(func(m *memory) error { empty = m.send.Empty(); return nil }) != nil {
			break
		}
		if empty && s.ctl.owing.Load() == 0 {
			break
		}
		if time.Now().After(limit) {
			break
		}
		if tick == nil {
			tick = time.NewTicker(time.Millisecond) // the peer's harvest sends us nothing
			defer tick.Stop()
		}
		select {
		case <-s.dead:
		case <-tick.C:
		}
	}
}

// fail ends the session with err (the first error wins): the control
// connection is closed and every blocked call wakes. The shared memory stays
// mapped until no stream holds data in it (unmapIfUnused).
func (s *Session) fail(err error) {
	s.closeOnce.Do(func() {
		s.mu.Lock()
		if s.err == nil {
			s.err = err
		}
		err = s.err
		if s.idle.timer != nil {
			s.idle.timer.Stop()
		}
		if s.hr.ackTimer != nil {
			s.hr.ackTimer.Stop()
		}
		// A stream closed here stays routed until the peer's close, which
		// will not come now; one closed from here on sees s.err (Close).
		for id, st := range s.tab.routed {
			if _, ok := s.tab.live[st]; !ok {
				delete(s.tab.routed, id)
			}
		}
		s.mu.Unlock()
		s.tk.stop()
		s.stopKeepAlive()
		s.unpairLocal()
		switch {
		case errors.Is(err, ErrProtocol) || errors.Is(err, buffer.ErrCorrupt) || errors.Is(err, queue.ErrCorrupt):
			s.cfg.Logger.Warn("shmlink: session ended", "remote", s.conn.RemoteAddr(), "err", err)
		case !errors.Is(err, net.ErrClosed):
			s.cfg.Logger.Debug("shmlink: session ended", "remote", s.conn.RemoteAddr(), "err", err)
		}
		close(s.dead)
		s.conn.Close()
		for _, st := range s.liveStreams() {
			st.notifyRead()
		}
	})
}

// failOp ends the session with a *SessionError for op and cause, and
// returns the session's error (which is that one, unless the session had
// ended already).
func (s *Session) failOp(op string, cause error) error {
	s.fail(&SessionError{Op: op, Err: cause})
	return s.Err()
}

// unmapIfUnused unmaps the shared memory once the session has ended and no
// stream is left that may still read from it. It waits for the receive
// loop, so the receive loop must not call it, nor anyone holding shm.mu.
func (s *Session) unmapIfUnused() {
	s.mu.Lock()
	ready := s.err != nil && len(s.tab.live) == 0
	s.mu.Unlock()
	if !ready || s.shm.unmapped.Load() {
		return
	}
	<-s.rx.done
	s.shm.mu.Lock()
	if s.shm.mem != nil {
		s.shm.mem.release()
		s.shm.mem = nil
		s.shm.unmapped.Store(true)
	}
	s.shm.mu.Unlock()
}

// unroute stops routing events to st: both sides closed it (or the session
// ended), so a later event for its id belongs to a new stream. memHeld
// says the caller holds shm.mu's read lock (the receive loop, or a reader
// harvesting for it), so the memory is not unmapped here.
func (s *Session) unroute(st *Stream, memHeld bool) {
	s.mu.Lock()
	if s.tab.routed[st.id] == st {
		delete(s.tab.routed, st.id)
	}
	s.mu.Unlock()
	s.checkIdle(memHeld)
}

// forgetClosed stops routing events to st, which a client closed before
// the peer did: a client drops events for ids it does not route, and
// shmipc-go and the Rust crate never answer a close, so keeping st would
// leak it. If the peer does answer (this package does), the id is reused
// then, provided our close went through the IO queue (see reuseID).
func (s *Session) forgetClosed(st *Stream) {
	st.mu.Lock()
	state := st.state
	st.mu.Unlock()
	s.mu.Lock()
	if s.tab.routed[st.id] == st && !state.has(stRemoteClosed) {
		delete(s.tab.routed, st.id)
		if !state.has(stCloseOnSocket) && s.err == nil {
			// When the set is full, an arbitrary id is not reused.
			boundedAdd(&s.tab.awaiting, st.id)
		}
	}
	s.mu.Unlock()
	s.checkIdle(false)
}

// forgetLive forgets st as a live stream: it was closed locally and holds
// no shared memory any more.
func (s *Session) forgetLive(st *Stream) {
	s.mu.Lock()
	delete(s.tab.live, st)
	s.mu.Unlock()
	s.checkIdle(false)
	s.unmapIfUnused()
}

// reuseID makes id available to OpenStream again. A client calls it once
// both closes of the stream were exchanged and its own close went through
// the IO queue: a StreamClose on the socket could be overtaken by the next
// stream's first event, which the server would then route to the old
// stream, so such ids are not reused.
func (s *Session) reuseID(id uint32) {
	if !s.isClient {
		return
	}
	s.mu.Lock()
	if s.err == nil && s.tab.routed[id] == nil {
		s.tab.freeIDs = append(s.tab.freeIDs, id)
	}
	s.mu.Unlock()
}

// idleLocked reports whether the session runs without any stream, routed
// or live. The caller holds s.mu.
func (s *Session) idleLocked() bool {
	return len(s.tab.routed) == 0 && len(s.tab.live) == 0 && s.err == nil
}

// checkIdle acts on a session that has no stream left: a draining client
// acknowledges the hot restart, a session marked with CloseWhenIdle ends,
// one with an idle timeout arms its timer. memHeld is unroute's.
func (s *Session) checkIdle(memHeld bool) {
	s.maybeAck()
	s.mu.Lock()
	idle := s.idleLocked()
	closeNow := idle && s.idle.closeWhenIdle
	if idle && !closeNow && s.idle.timeout > 0 {
		if s.idle.timer == nil {
			s.idle.timer = time.AfterFunc(s.idle.timeout, s.idleExpired)
		} else {
			s.idle.timer.Reset(s.idle.timeout)
		}
	}
	if closeNow {
		s.err = ErrSessionClosed // OpenStream fails from here on
	}
	s.mu.Unlock()
	if closeNow {
		s.fail(ErrSessionClosed)
		if !memHeld {
			s.unmapIfUnused()
		}
	} else if idle {
		s.releaseWarmHeld(memHeld) // an idle session keeps no warm slice
	}
}

// idleExpired ends the session if it is still idle when its idle timer
// fires.
func (s *Session) idleExpired() {
	s.mu.Lock()
	idle := s.idleLocked()
	if idle {
		s.err = ErrSessionClosed // OpenStream fails from here on
	}
	s.mu.Unlock()
	if idle {
		s.cfg.Logger.Debug("shmlink: idle session closed", "remote", s.conn.RemoteAddr(), "after", s.idle.timeout)
		s.fail(ErrSessionClosed)
		s.unmapIfUnused()
	}
}

// CloseWhenIdle makes the session end as soon as it has no stream left
// (right away if it has none): for a session dialed for a single stream,
// or a server session whose listener closed. A server session also
// refuses new streams from then on, as a closed listener's backlog would
// (a shmlink client reads ErrStreamRefused on them, another client io.EOF;
// Stats.StreamsRefused counts them), and refuses the streams AcceptStream
// has not returned yet.
func (s *Session) CloseWhenIdle() {
	s.mu.Lock()
	s.idle.closeWhenIdle = true
	var pending []*Stream
	if !s.isClient {
		pending, s.tab.accepts = s.tab.accepts, nil
	}
	s.mu.Unlock()
	for _, st := range pending {
		st.Refuse() // the application never had it
	}
	s.checkIdle(false)
}

// SetIdleTimeout makes the session end once it has had no stream for d:
// none routed (NumStreams is 0) and none that the application has yet to
// Close. OpenStream then returns
// ErrSessionClosed. Zero or a negative d turns the timeout off. It is meant
// for a pool of client sessions (shmlink.Dialer, docs/protocol.md
// section 18).
func (s *Session) SetIdleTimeout(d time.Duration) {
	s.mu.Lock()
	s.idle.timeout = d
	if d <= 0 && s.idle.timer != nil {
		s.idle.timer.Stop()
	}
	s.mu.Unlock()
	s.checkIdle(false)
}
