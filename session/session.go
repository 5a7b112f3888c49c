package session

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"runtime"
	"sync"
	"sync/atomic"
	"time"

	"github.com/shmlink/shmlink/buffer"
	"github.com/shmlink/shmlink/queue"
)

// Stream states carried in the low byte of an event's or a FallbackData's
// status (PROTOCOL.md section 4).
const (
	stateOpen   = 0
	stateClosed = 1
)

// maxEventBytes bounds the bytes one event (one slice chain) carries, so a
// single large write cannot take the whole buffer region.
const maxEventBytes = 4 << 20

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

	// memMu guards the mappings: holders of the read lock may touch shared
	// memory; release takes the write lock to unmap.
	memMu    sync.RWMutex
	mem      *memory // nil once released
	sendMu   sync.Mutex
	ctlMu    sync.Mutex // serializes writes on conn
	scratch  []byte     // message buffer, guarded by ctlMu
	released atomic.Bool
	ctr      counters

	mu       sync.Mutex
	streams  map[uint32]*Stream
	nextID   uint32
	accepts  []*Stream
	acceptCh chan struct{} // cap 1: a stream was queued for AcceptStream
	err      error         // why the session ended; set once under mu
	// closeWhenIdle ends the session with its last stream.
	closeWhenIdle bool

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
		pollMsg:  AppendSimple(nil, version, TypePolling),
		mem:      mem,
		streams:  make(map[uint32]*Stream),
		nextID:   2, // PROTOCOL.md section 4
		acceptCh: make(chan struct{}, 1),
		dead:     make(chan struct{}),
		recvDone: make(chan struct{}),
	}
	for _, l := range mem.region.Lists() {
		s.maxLinks += int(l.Cap)
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

// NumStreams returns the number of streams the session tracks: open ones
// and ones waiting for the peer's close.
func (s *Session) NumStreams() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.streams)
}

// OpenStream opens a new stream on a client session. Nothing is sent until
// the first write (PROTOCOL.md section 4). It returns ErrNotClient on a
// server session, the session's error once it has ended, ErrStreamIDs when
// ids are exhausted, or ctx.Err() if ctx is already done.
func (s *Session) OpenStream(ctx context.Context) (*Stream, error) {
	if !s.isClient {
		return nil, ErrNotClient
	}
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.err != nil {
		return nil, s.err
	}
	id := s.nextID
	if id == 0 {
		return nil, ErrStreamIDs
	}
	s.nextID++
	st := newStream(s, id)
	s.streams[id] = st
	return st, nil
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
// for the session's goroutine and returns nil; later calls return nil too.
func (s *Session) Close() error {
	s.fail(ErrSessionClosed)
	s.mu.Lock()
	sts := make([]*Stream, 0, len(s.streams))
	for _, st := range s.streams {
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
		s.err = err
		sts := make([]*Stream, 0, len(s.streams))
		for _, st := range s.streams {
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
	ready := s.err != nil && len(s.streams) == 0
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

// removeStream forgets a stream that both sides have closed (or that was
// closed locally after the session ended). A session marked with
// CloseWhenIdle ends with its last stream. inRecvLoop says the caller is
// the receive loop, which releases the memory itself when it returns.
func (s *Session) removeStream(st *Stream, inRecvLoop bool) {
	s.mu.Lock()
	if s.streams[st.id] == st {
		delete(s.streams, st.id)
	}
	idle := len(s.streams) == 0 && s.closeWhenIdle
	s.mu.Unlock()
	if idle {
		s.fail(ErrSessionClosed)
	}
	if !inRecvLoop {
		s.maybeRelease()
	}
}

// CloseWhenIdle makes the session end as soon as it has no stream left
// (right away if it has none): for a session dialed for a single stream.
func (s *Session) CloseWhenIdle() {
	s.mu.Lock()
	s.closeWhenIdle = true
	idle := len(s.streams) == 0
	s.mu.Unlock()
	if idle {
		s.fail(ErrSessionClosed)
		s.maybeRelease()
	}
}

// recvLoop reads control messages until the connection ends; it alone
// drains the receive queue, so the queue has a single consumer.
func (s *Session) recvLoop() {
	defer func() {
		close(s.recvDone)
		s.maybeRelease()
	}()
	r := bufio.NewReaderSize(s.conn, 64<<10)
	var hdr [HeaderSize]byte
	var small [16]byte
	for {
		if _, err := io.ReadFull(r, hdr[:]); err != nil {
			if errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) {
				err = ErrPeerClosed
			}
			s.fail(&SessionError{Op: "read", Err: err})
			return
		}
		h, err := ParseHeader(hdr[:], uint32(s.cfg.MaxMessageSize))
		if err != nil {
			s.fail(&SessionError{Op: "read", Err: err})
			return
		}
		n := int(h.Length) - HeaderSize
		var payload []byte
		if h.Type == TypeFallbackData {
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
		if err := s.handle(h, payload); err != nil {
			s.fail(&SessionError{Op: "read " + h.Type.String(), Err: err})
			return
		}
	}
}

// handle acts on one runtime control message.
func (s *Session) handle(h Header, payload []byte) error {
	switch h.Type {
	case TypePolling:
		s.ctr.wakeupsReceived.Add(1)
		return s.drain()
	case TypeStreamClose:
		id, err := ParseStreamClose(payload)
		if err != nil {
			return err
		}
		// Events put before the close was sent come first.
		if err := s.drain(); err != nil {
			return err
		}
		return s.dispatch(queue.Event{StreamID: id, Status: stateClosed}, nil)
	case TypeFallbackData:
		id, status, data, err := ParseFallback(payload)
		if err != nil {
			return err
		}
		if err := s.drain(); err != nil {
			return err
		}
		s.ctr.fallbackRead.Add(1)
		s.ctr.bytesReceived.Add(uint64(len(data)))
		return s.dispatch(queue.Event{StreamID: id, Status: status}, data)
	case TypeHotRestart:
		if !s.isClient {
			return fmt.Errorf("%w: HotRestart sent to a server", ErrProtocol)
		}
		_, err := ParseEpoch(payload)
		return err // hot restart is handled by a later layer; tolerated here
	case TypeHotRestartAck:
		if s.isClient {
			return fmt.Errorf("%w: HotRestartAck sent to a client", ErrProtocol)
		}
		_, err := ParseEpoch(payload)
		return err
	}
	return fmt.Errorf("%w: %v after the handshake", ErrProtocol, h.Type)
}

// drain pops every event of the receive queue and dispatches it, then
// clears the working flag and re-checks, so that no event is stranded
// without a wakeup (PROTOCOL.md section 3.3).
func (s *Session) drain() error {
	s.memMu.RLock()
	defer s.memMu.RUnlock()
	if s.mem == nil {
		return ErrSessionClosed
	}
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
			if err := s.dispatchLocked(ev, nil); err != nil {
				return err
			}
		}
		recv.ClearWorking()
		if recv.Empty() {
			return nil
		}
		recv.SetWorking()
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
		refuse := false
		if !s.isClient && state == stateOpen && ev.StreamID != 0 && s.err == nil {
			if len(s.accepts) < s.cfg.AcceptBacklog {
				st = newStream(s, ev.StreamID)
				s.streams[ev.StreamID] = st
				s.accepts = append(s.accepts, st)
				select {
				case s.acceptCh <- struct{}{}:
				default:
				}
			} else {
				refuse = true
			}
		}
		if st == nil {
			s.mu.Unlock()
			// Data for a stream we do not know (or refuse): recycle it.
			if ev.Offset != 0 {
				if _, err := s.mem.region.FreeChain(ev.Offset); err != nil {
					return err
				}
			}
			if refuse {
				s.cfg.Logger.Warn("shmlink: accept backlog full, refusing stream", "stream", ev.StreamID)
				s.sendCloseLocked(ev.StreamID, false)
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
// is idle (PROTOCOL.md section 3.3). It waits for room while the queue is
// full, until closed is closed (ErrStreamClosed), cancel is closed
// (errDeadline), the session ends, or
// Config.QueueFullTimeout passes (ErrQueueFull). The caller holds memMu's
// read lock with the memory mapped.
func (s *Session) putEvent(ev queue.Event, closed, cancel <-chan struct{}) error {
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
	if send.MarkWorking() {
		s.ctr.wakeupsSent.Add(1)
		return s.writeCtl(s.pollMsg)
	}
	return nil
}

// sendCloseLocked tells the peer that stream id is closed: an event
// {id, 0, 1}, or a StreamClose message when the queue is full or viaSocket
// is set (the stream's earlier data went over the socket, which the event
// could overtake). Errors end the session and are not returned: a close
// that cannot be sent means the session is gone anyway. The caller holds
// memMu's read lock with the memory mapped.
func (s *Session) sendCloseLocked(id uint32, viaSocket bool) {
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
			return
		}
		if !errors.Is(err, queue.ErrFull) {
			s.fail(&SessionError{Op: "send", Err: err})
			return
		}
	}
	s.ctlMu.Lock()
	s.scratch = AppendStreamClose(s.scratch[:0], s.version, id)
	err := s.writeCtlLocked(s.scratch)
	s.ctlMu.Unlock()
	if err != nil {
		s.fail(&SessionError{Op: "write", Err: err})
	}
}

// writeFallback sends data for stream id as one FallbackData message
// (PROTOCOL.md section 1.2).
func (s *Session) writeFallback(id uint32, data []byte) error {
	s.ctlMu.Lock()
	defer s.ctlMu.Unlock()
	s.scratch = AppendFallbackHeader(s.scratch[:0], s.version, id, stateOpen, len(data))
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
