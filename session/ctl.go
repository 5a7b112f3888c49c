package session

import (
	"bytes"
	"errors"
	"fmt"
	"net"
	"os"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/shmlink/shmlink/internal/wire"
	"golang.org/x/sys/unix"
)

// ctlWriter writes control messages on the session's connection
// (docs/protocol.md section 1.2), always whole ones, and never for longer
// than Config.WriteTimeout: a peer that stops reading its end ends the
// session instead of blocking our writers (docs/protocol.md section 13).
//
// One writer at a time holds sem. A writer whose own deadline (a stream's
// write deadline) passes in the middle of a message leaves the rest of it
// to a flusher goroutine, which holds sem until the message is out. A
// wakeup (Polling) never waits: it is written at once when the connection
// is free and takes it without blocking, else it is owed (pollOwed) and
// the holder of sem writes it before letting go. So at most one Polling
// and one message are ever owed, and only for WriteTimeout.
type ctlWriter struct {
	conn     net.Conn
	raw      syscall.RawConn // nil if conn has none: wakeups then wait like other writes
	timeout  time.Duration   // Config.WriteTimeout
	sem      chan struct{}   // cap 1: held while writing on conn
	pollOwed atomic.Bool     // a Polling is to be written by sem's holder
	pollMsg  []byte          // the encoded Polling message
	flushers sync.WaitGroup  // flusher goroutines; Session.Close waits for them
	owing    atomic.Int32    // flusher goroutines running: writes owed on conn
	// broken is the error of a write that found the peer's end closed
	// (writeFailed); the session ends once the receive loop has read what
	// the peer sent before.
	broken atomic.Pointer[SessionError]
	// wokeAt is when the last Polling went out (ticker.now).
	wokeAt atomic.Int64

	// cutMu guards cutFor and cut. cutFor is the stream whose message
	// sem's holder is writing (writeTimed), nil if none: its Close, its
	// write deadline and the context of its announcement stop that write
	// (cutWrite), and cut records that one did.
	cutMu  sync.Mutex
	cutFor *Stream
	cut    bool

	// closesMu guards closes and closing: the ids of streams whose
	// StreamClose is owed to the closer goroutine (Session.owedClose), and
	// whether that goroutine runs.
	closesMu sync.Mutex
	closes   []uint32
	closing  bool

	// The state of writeNow's raw write, made once so that a write
	// allocates nothing; owned by sem's holder.
	rawBuf  []byte
	rawN    int
	rawErr  error
	rawFunc func(fd uintptr) bool
	notSock bool // the descriptor is not a socket: write(2) it
}

func newCtlWriter(conn net.Conn, version uint8, timeout time.Duration) *ctlWriter {
	c := &ctlWriter{
		conn:    conn,
		timeout: timeout,
		sem:     make(chan struct{}, 1),
		pollMsg: wire.AppendSimple(nil, version, wire.TypePolling),
	}
	if sc, ok := conn.(syscall.Conn); ok {
		c.raw, _ = sc.SyscallConn()
	}
	c.rawFunc = c.writeRaw
	return c
}

// writeRaw writes rawBuf on fd until it is written or the socket would
// block, never waiting: it is the function writeNow passes to RawConn. It
// sends with sendDontWait, which does not wake the runtime's monitor
// thread (rawio.go, docs/protocol.md section 12.4); a descriptor that is
// not a socket is written with write(2).
func (c *ctlWriter) writeRaw(fd uintptr) bool {
	for c.rawN < len(c.rawBuf) {
		var k int
		var errno unix.Errno
		if c.notSock {
			n, err := unix.Write(int(fd), c.rawBuf[c.rawN:])
			k, errno = n, errnoOf(err)
		} else {
			k, errno = sendDontWait(fd, c.rawBuf[c.rawN:])
		}
		switch errno {
		case 0:
			c.rawN += k
			continue
		case unix.EINTR:
			continue
		case unix.EAGAIN:
			return true // the rest goes to a flusher
		case unix.ENOTSOCK:
			if !c.notSock {
				c.notSock = true
				continue
			}
		}
		c.rawErr = os.NewSyscallError("write", errno)
		return true
	}
	return true // done: never wait for the socket here
}

// wake sends the peer a Polling (docs/protocol.md section 3.3) without
// waiting for the connection: at once if it is free, else it is owed to
// its holder; to a peer session of this process, it hands the Polling to
// that session instead (wakeLocal).
func (s *Session) wake() {
	if p := s.local.Load(); p != nil {
		s.wakeLocal(p)
		return
	}
	s.ctl.pollOwed.Store(true)
	select {
	case s.ctl.sem <- struct{}{}:
	default:
		return // the holder writes it before it lets go
	}
	if s.flushPoll() {
		s.releaseCtl()
	}
}

// flushPoll writes the Polling owed, if any. It reports false when a
// flusher took the connection over. The caller holds sem.
func (s *Session) flushPoll() bool {
	if !s.ctl.pollOwed.Swap(false) {
		return true
	}
	s.ctr.wakeupsSent.Add(1)
	s.ctl.wokeAt.Store(int64(s.tk.now()))
	return s.writeNow(s.ctl.pollMsg)
}

// acquireCtl takes the connection, waiting until closed is closed
// (ErrStreamClosed), cancel is closed (errDeadline) or the session ends
// (its error).
func (s *Session) acquireCtl(closed, cancel <-chan struct{}) error {
	select {
	case s.ctl.sem <- struct{}{}:
		return nil
	default:
	}
	select {
	case s.ctl.sem <- struct{}{}:
		return nil
	case <-closed:
		return ErrStreamClosed
	case <-cancel:
		return errDeadline
	case <-s.dead:
		return s.Err()
	}
}

// releaseCtl lets go of the connection, first writing a Polling owed
// meanwhile. A wake that finds the connection taken after our check sees
// it free and writes its Polling itself.
func (s *Session) releaseCtl() {
	for {
		<-s.ctl.sem
		if !s.ctl.pollOwed.Load() {
			return
		}
		select {
		case s.ctl.sem <- struct{}{}:
		default:
			return // a new holder writes it
		}
		if !s.flushPoll() {
			return
		}
	}
}

// writeNow writes b without blocking as far as the connection takes it;
// what it does not take goes to a flusher goroutine, which then holds the
// connection, and writeNow reports false. The caller holds sem.
func (s *Session) writeNow(b []byte) bool {
	c := s.ctl
	n := 0
	if c.raw != nil {
		c.rawBuf, c.rawN, c.rawErr = b, 0, nil
		err := c.raw.Write(c.rawFunc)
		n, c.rawBuf = c.rawN, nil
		if err == nil {
			err = c.rawErr
		}
		if err != nil {
			s.writeFailed(err)
			return true // nothing more can be written
		}
	}
	if n == len(b) {
		return true
	}
	rest := append([]byte(nil), b[n:]...)
	c.startOwed()
	go s.flush(net.Buffers{rest})
	return false
}

// startOwed counts a flusher goroutine about to start: the rest of a
// message, or closes owed (Session.owedClose), that it writes on the
// connection in its turn. Session.Close lets them go out before it closes
// the connection (drainSend), and waits for the goroutines after.
func (c *ctlWriter) startOwed() {
	c.flushers.Add(1)
	c.owing.Add(1)
}

// endOwed counts the end of a flusher goroutine that startOwed counted.
func (c *ctlWriter) endOwed() {
	c.owing.Add(-1)
	c.flushers.Done()
}

// flush writes what a writer left of its message, within WriteTimeout,
// then lets go of the connection. It runs on its own goroutine holding sem.
func (s *Session) flush(rest net.Buffers) {
	defer s.ctl.endOwed()
	if _, _, err := s.writeTimed(&rest, nil, nil); err != nil {
		s.writeFailed(err)
	}
	s.releaseCtl()
}

// sendCtl writes the message made of bufs on the connection, waiting for
// it until st (nil: none) is closed or cancel is closed, and stopping its
// write at those too (writeTimed): the rest then goes out on a flusher
// goroutine, from a copy, since bufs may be the caller's (Stream.Write
// does not retain p), and sendCtl returns nil, since the message will be
// whole. It returns ErrStreamClosed or errDeadline when it wrote nothing
// before st closed or cancel was closed, and the session's error when the
// session ended or the write failed (which ends it).
func (s *Session) sendCtl(bufs net.Buffers, st *Stream, cancel <-chan struct{}) error {
	if err := s.acquireCtl(closedOf(st), cancel); err != nil {
		return err
	}
	n, stop, err := s.writeTimed(&bufs, st, cancel)
	switch {
	case err == nil:
	case stop != nil && n == 0:
		err = stop
	case stop != nil:
		rest := bytes.Join(bufs, nil) // one message: maxFallbackChunk and its header at most
		s.ctl.startOwed()
		go s.flush(net.Buffers{rest})
		return nil
	default:
		err = s.writeFailed(err)
	}
	s.releaseCtl()
	return err
}

// writeTimed writes bufs (consuming them) within WriteTimeout. A write of
// st's message (st not nil) stops early once st is closed or cancel is
// closed: Stream.Close, the write deadline's expiry and the context's end
// move the connection's write deadline into the past (cutWrite), so a
// deadline moved earlier while the write blocks counts, and one moved later
// does too. It returns the bytes written and, for a write stopped that
// way, stop: ErrStreamClosed or errDeadline. A stop by WriteTimeout is an
// error that names it. The caller holds sem.
func (s *Session) writeTimed(bufs *net.Buffers, st *Stream, cancel <-chan struct{}) (n int64, stop, err error) {
	c := s.ctl
	closed := closedOf(st)
	if err := c.conn.SetWriteDeadline(time.Now().Add(c.timeout)); err != nil {
		return 0, nil, err
	}
	// writeNow writes without a deadline, and a passed one would fail it.
	defer c.conn.SetWriteDeadline(time.Time{})
	if st != nil {
		c.cutMu.Lock()
		c.cutFor, c.cut = st, false
		c.cutMu.Unlock()
		// A cut that came before cutFor was set found no write to cut, but
		// it closed its channel first.
		if stop = stopCause(closed, cancel); stop != nil {
			c.endCut()
			return 0, stop, stop
		}
	}
	n, err = bufs.WriteTo(c.conn)
	cut := st != nil && c.endCut()
	if err == nil || !errors.Is(err, os.ErrDeadlineExceeded) {
		return n, nil, err
	}
	if cut {
		return n, stopCause(closed, cancel), err
	}
	// Not wrapped: the session's end must not read as a caller's deadline.
	return n, nil, fmt.Errorf("the peer took no control message for %v (Config.WriteTimeout): %v", c.timeout, err)
}

// closedOf returns st's channel that is closed when st is, or nil (never
// ready) if st is nil.
func closedOf(st *Stream) <-chan struct{} {
	if st == nil {
		return nil
	}
	return st.closedCh
}

// stopCause returns ErrStreamClosed if closed is closed, else errDeadline
// if cancel is, else nil.
func stopCause(closed, cancel <-chan struct{}) error {
	switch {
	case isClosedChan(closed):
		return ErrStreamClosed
	case isClosedChan(cancel):
		return errDeadline
	}
	return nil
}

// endCut ends writeTimed's exposure to cutWrite and reports whether a cut
// came. The caller holds sem.
func (c *ctlWriter) endCut() bool {
	c.cutMu.Lock()
	cut := c.cut
	c.cutFor, c.cut = nil, false
	c.cutMu.Unlock()
	return cut
}

// cutWrite stops the write of st's message on the connection, if one is
// under way (writeTimed): st was closed, or its write deadline or the
// context of its announcement passed, after the channel that says so was
// closed. The write returns what it wrote by then; the rest goes out on a
// flusher.
func (s *Session) cutWrite(st *Stream) {
	c := s.ctl
	c.cutMu.Lock()
	if c.cutFor == st {
		c.cut = true
		c.conn.SetWriteDeadline(time.Unix(1, 0))
	}
	c.cutMu.Unlock()
}

// writeFailed deals with a failed write on the control connection and
// returns the error for the writer. A peer that closed its end (EPIPE,
// ECONNRESET) may have put events and sent messages before it did, a
// stream's data and close among them: the session then ends where the
// receive loop reads the end of the connection, once it has delivered
// them (recvLoop), or WriteTimeout from now if the peer still sends. Any
// other failure ends the session at once.
func (s *Session) writeFailed(err error) error {
	if !errors.Is(err, syscall.EPIPE) && !errors.Is(err, syscall.ECONNRESET) {
		return s.failOp("write", err)
	}
	serr := &SessionError{Op: "write", Err: err}
	if s.ctl.broken.CompareAndSwap(nil, serr) {
		s.rx.in.setBroken(s, time.Now().Add(s.ctl.timeout))
	} else {
		serr = s.ctl.broken.Load()
	}
	return serr
}

// writeCtl writes one whole control message within WriteTimeout; a
// failure ends the session and returns its error.
func (s *Session) writeCtl(msg []byte) error {
	return s.sendCtl(net.Buffers{msg}, nil, nil)
}
