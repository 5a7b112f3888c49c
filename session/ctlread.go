package session

import (
	"bufio"
	"errors"
	"io"
	"math"
	"os"
	"sync/atomic"
	"time"

	"github.com/shmlink/shmlink/internal/wire"
)

// Who reads the control connection (docs/protocol.md section 12.3).
//
// A reader that sleeps until a Polling wakes it would, if the receive
// loop read the Polling, be woken by a second goroutine switch (the
// receive loop harvests, then readies the reader): on a host whose idle
// CPUs halt, the switch wakes another CPU, which costs more than the
// socket's own wakeup. So the right to read the connection, the baton,
// moves: a reader that is about to sleep, and is the only goroutine
// waiting for the session's events, reads the connection itself, and the
// kernel's wakeup runs it directly, as a Unix socket's reader. It handles
// what comes (Polling, StreamClose) until its own data is there, then
// returns with the baton left free: a reader that loops (a request
// handler, io.Copy) takes it back at its next wait without waking anyone.
// The receive loop takes a free baton back after batonIdle, at once when
// another goroutine waits for events, and for every message but Polling
// and StreamClose (FallbackData, hot restart: the receive loop's own).
//
// The baton's holder reads whole messages: it peeks a message's header
// and, for every message but FallbackData, the message itself in the
// buffered reader before it consumes anything. So when a read stops at a
// deadline (a kick: the read deadline set in the past to make the holder
// look up), the baton moves between messages, never inside one.

// The states of the baton.
const (
	batonLoop   = iota // the receive loop holds it (or is taking it back)
	batonReader        // a stream's reader holds it
	batonFree          // nobody reads the connection: the next waiter takes it
)

// batonIdle is how long the baton stays free before the receive loop
// takes it back (Go's timers round it up to about 1 ms in an idle
// process): meanwhile Pollings wait in the socket, and nobody waits for
// what they announce.
const batonIdle = 200 * time.Microsecond

// aLongTimeAgo is a read deadline in the past: it makes a blocked read
// return at once (a kick).
var aLongTimeAgo = time.Unix(1, 0)

// ctlReader is the read side of the control connection.
type ctlReader struct {
	r      *bufio.Reader          // owned by the baton's holder
	state  atomic.Int32           // batonLoop, batonReader or batonFree
	holder atomic.Pointer[Stream] // the stream whose reader holds the baton
	// kick is set by a reader that asked the receive loop for the baton;
	// the receive loop offers it on offer and waits on back until it
	// returns.
	kick      atomic.Bool
	offer     chan struct{} // cap 1
	back      chan struct{} // cap 1
	idleTimer *time.Timer   // returns a free baton to the receive loop
	// brokenAt is the read deadline set by writeFailed (Unix ns), zero
	// while no write has found the peer's end closed.
	brokenAt atomic.Int64
}

func (rd *ctlReader) init(s *Session) {
	rd.r = bufio.NewReaderSize(s.conn, 64<<10)
	rd.offer = make(chan struct{}, 1)
	rd.back = make(chan struct{}, 1)
	rd.idleTimer = time.AfterFunc(time.Hour, s.reclaimBaton)
	rd.idleTimer.Stop()
}

// peekMessage returns the header of the next control message without
// consuming it; for every message but FallbackData, whose payload the
// receive loop reads in pieces, the whole message is then in rd.r's
// buffer. malformed says that err is the header's, not the read's. A
// connection that ends inside a message returns io.ErrUnexpectedEOF. Only
// the baton's holder calls it.
func (s *Session) peekMessage() (h wire.Header, malformed bool, err error) {
	b, err := s.rd.r.Peek(wire.HeaderSize)
	if err != nil {
		if len(b) > 0 && errors.Is(err, io.EOF) {
			err = io.ErrUnexpectedEOF
		}
		return h, false, err
	}
	// FallbackData of any length is taken in pieces (recvFallback); every
	// other message after the handshake has at most maxSmallPayload bytes.
	if h, err = wire.ParseHeader(b, math.MaxUint32); err != nil {
		return h, true, err
	}
	if h.Type != wire.TypeFallbackData && int(h.Length)-wire.HeaderSize <= maxSmallPayload {
		if _, err := s.rd.r.Peek(int(h.Length)); err != nil {
			if errors.Is(err, io.EOF) {
				err = io.ErrUnexpectedEOF
			}
			return h, false, err
		}
	}
	return h, false, nil
}

// maxSmallPayload is the longest payload of a message other than
// FallbackData after the handshake.
const maxSmallPayload = 16

// connDeadline returns the read deadline of the connection for the
// receive loop: the one writeFailed set, or none.
func (s *Session) connDeadline() time.Time {
	if at := s.rd.brokenAt.Load(); at != 0 {
		return time.Unix(0, at)
	}
	return time.Time{}
}

// brokenPassed reports whether the read deadline writeFailed set has
// passed.
func (s *Session) brokenPassed() bool {
	at := s.rd.brokenAt.Load()
	return at != 0 && time.Now().UnixNano() >= at
}

// isTimeout reports whether err is a read that stopped at its deadline.
func isTimeout(err error) bool { return errors.Is(err, os.ErrDeadlineExceeded) }

// handOff gives the baton to the reader that kicked: the receive loop
// frees it, offers it, and waits until it comes back. It reports false if
// the session ended meanwhile.
func (s *Session) handOff() bool {
	s.rd.kick.Store(false)
	s.rd.state.Store(batonFree)
	s.rd.idleTimer.Reset(batonIdle)
	select {
	case s.rd.offer <- struct{}{}:
	default:
	}
	return s.awaitBaton()
}

// awaitBaton waits until the baton comes back to the receive loop; false
// if the session ended first.
func (s *Session) awaitBaton() bool {
	select {
	case <-s.rd.back:
		s.conn.SetReadDeadline(s.connDeadline())
		return true
	case <-s.dead:
		return false
	}
}

// reclaimBaton runs on the idle timer: a baton still free goes back to the
// receive loop.
func (s *Session) reclaimBaton() {
	if s.rd.state.CompareAndSwap(batonFree, batonLoop) {
		s.returnBaton()
	}
}

// returnBaton wakes the receive loop to take the baton, whose state the
// caller has set to batonLoop.
func (s *Session) returnBaton() {
	select {
	case s.rd.back <- struct{}{}:
	default:
	}
}

// takeBaton makes st's reader the baton's holder if the baton is free, or,
// when the receive loop holds it and st's reader is the only goroutine
// waiting for the session's events, asks the receive loop for it (the
// offer then comes on rd.offer). It reports whether st's reader holds the
// baton now. The caller holds rmu and counts in rx.waiters.
func (st *Stream) takeBaton() bool {
	s := st.s
	if s.rd.brokenAt.Load() != 0 {
		return false
	}
	if s.rd.state.CompareAndSwap(batonFree, batonReader) {
		s.rd.holder.Store(st)
		return true
	}
	if s.rd.state.Load() == batonLoop && s.rx.waiters.Load() == 1 && s.rd.kick.CompareAndSwap(false, true) {
		s.conn.SetReadDeadline(aLongTimeAgo)
	}
	return false
}

// acceptOffer takes the baton the receive loop offered, if it is still
// free.
func (st *Stream) acceptOffer() bool {
	s := st.s
	if s.rd.brokenAt.Load() == 0 && s.rd.state.CompareAndSwap(batonFree, batonReader) {
		s.rd.holder.Store(st)
		return true
	}
	return false
}

// releaseBaton ends st's reader's hold of the baton: it stays free for
// the reader's next wait, unless another goroutine waits for events or
// the receive loop must read (giveBack), which takes it back at once. The
// caller has already left rx.waiters.
func (st *Stream) releaseBaton(giveBack bool) {
	s := st.s
	s.rd.holder.Store(nil)
	s.rd.state.Store(batonFree)
	// A goroutine that starts to wait after this store sees the baton
	// free and takes it (takeBaton); one that waits already is counted.
	if giveBack || s.rx.waiters.Load() > 0 || isClosedChan(s.dead) || s.rd.brokenAt.Load() != 0 {
		s.reclaimBaton()
		return
	}
	s.rd.idleTimer.Reset(batonIdle)
}

// kickHolder makes st's reader, if it holds the baton and reads the
// connection, look up: its stream was closed or its deadline moved.
func (st *Stream) kickHolder() {
	if st.s.rd.holder.Load() == st {
		st.s.conn.SetReadDeadline(aLongTimeAgo)
	}
}

// readAsHolder reads and handles control messages as the baton's holder
// until st has want bytes or ended, its read deadline passed, or a message
// comes that only the receive loop handles (giveBack: the caller releases
// the baton with it). The caller holds rmu.
func (st *Stream) readAsHolder(want int) (giveBack bool) {
	s := st.s
	for setDeadline := true; ; {
		at, cancel := st.rdl.when()
		if setDeadline {
			// Before the checks below: a kick after them makes the read
			// return. A kick while no read runs leaves the deadline in
			// the past for the next one, which then comes here again.
			s.conn.SetReadDeadline(at)
			setDeadline = false
		}
		if st.readyFor(want) || isClosedChan(cancel) || (!at.IsZero() && !time.Now().Before(at)) ||
			isClosedChan(st.closedCh) || isClosedChan(s.dead) || s.rd.brokenAt.Load() != 0 {
			return false
		}
		h, malformed, err := s.peekMessage()
		if err != nil {
			// A kick or the stream's deadline: look again. Anything else
			// (the connection's end, a malformed message) is the receive
			// loop's to handle.
			if malformed || !isTimeout(err) {
				return true
			}
			setDeadline = true
			continue
		}
		if h.Type != wire.TypePolling && h.Type != wire.TypeStreamClose {
			return true
		}
		var msg [wire.HeaderSize + maxSmallPayload]byte
		n, _ := s.rd.r.Read(msg[:h.Length]) // peeked: all of it is buffered
		if h.Type == wire.TypePolling {
			s.ctr.directWakeups.Add(1)
		}
		st.inHandle.Store(true)
		err = s.handle(h, msg[wire.HeaderSize:n])
		st.inHandle.Store(false)
		if err != nil {
			s.failOp("read "+h.Type.String(), err)
			return true
		}
	}
}
