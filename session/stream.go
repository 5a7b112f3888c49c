package session

import (
	"net"
	"sync"
	"sync/atomic"
	"time"

	"github.com/shmlink/shmlink/buffer"
)

// A Stream is one bidirectional byte stream of a session. It implements
// net.Conn, with CloseWrite for a half-close like *net.TCPConn's, and adds
// a zero-copy API: Reserve and Flush on the write side, Peek, ReadBytes,
// ReadChunk, Discard and ReleasePreviousRead on the read side.
//
// Errors follow package net: a deadline that passed gives a net.Error with
// Timeout() true that unwraps to os.ErrDeadlineExceeded; calls after Close,
// or after the session was closed locally, give errors satisfying
// errors.Is(err, net.ErrClosed); the peer's close reads as io.EOF after all
// its data; when the session ends otherwise (the peer process died, a
// protocol error) every call gives the session's *SessionError.
//
// Read and Write may be called concurrently with each other and with Close
// and the deadline setters; concurrent Reads (or Writes) are serialized.
type Stream struct {
	s  *Session
	id uint32

	// mu guards state and the receive buffer (recv, rhead, buffered, shm,
	// held). It is the innermost lock (doc.go).
	mu    sync.Mutex
	state streamState // changes only in transition
	recvBuf
	// readCh (cap 1) is signalled when data or state arrived, and after
	// closedCh, the session's dead or the read deadline's channel closed:
	// a reader sleeps on it alone (waitForData).
	readCh   chan struct{}
	closedCh chan struct{} // closed by the transition to closed
	rdl, wdl deadline
	// srcRead is set while ReadFrom waits on its source (its reader's
	// Read, or a socket's bytes), holding wmu; a Close meanwhile does not
	// wait for wmu but sets closeLeft, and ReadFrom ends the close once
	// that wait returns (see Close and Stream.outside).
	srcRead, closeLeft bool
	// closing counts the Close under way (0 or 1; added under mu by the
	// Close that made the transition), so that a session's Close that
	// finds the stream closing waits for it (see Session.Close).
	closing sync.WaitGroup

	// Read side, guarded by rmu: one read call at a time.
	rmu    sync.Mutex
	reads  uint64 // read calls ended
	waited bool   // the current read call waited for data
	// waitEnd is when the current read call's last wait ended (monoNow;
	// 0: none): endRead stamps lastRead with it (see endWait).
	waitEnd time.Duration
	// waitEWMA is the recent waits' mean length, in ns (0: none yet), and
	// waitSkips counts the waits that did not poll since the last that did
	// (see spinBudget); missRun counts the latest waits in a row that
	// lasted longer than their poll, up to busyVainPolls (see selfWake and
	// spinBudget). hitEWMA is the mean length of the recent waits that a
	// poll caught (0: none yet), stretchScore the score of the stretched
	// polls, stretchSkips counts the waits that did not stretch while the
	// score was negative (see stretch), and budget is the poll budget of
	// the wait under way or last ended (see recordWait).
	waitEWMA     time.Duration
	hitEWMA      time.Duration
	budget       time.Duration
	waitSkips    uint32
	missRun      uint32
	stretchScore int8
	stretchSkips uint8
	// A wait after a pause (see afterPause) polls or sleeps at once by
	// what such waits recently took (see pauseBudget): pausePoll and
	// pauseSleep are the mean lengths (EWMA, weight 1/8; 0: none yet) of
	// those that polled and of those that slept at once, pauseWaits counts
	// them (one in probeEvery tries the way not preferred), and pauseWay
	// is how the wait under way waits.
	pausePoll  time.Duration
	pauseSleep time.Duration
	pauseWaits uint32
	pauseWay   waitWay
	inRead     atomic.Bool  // a read call is running (read by the receive loop)
	holdWait   atomic.Bool  // that call waits for more bytes than it has (see spillOwn)
	lastRead   atomic.Int64 // when a recent read call ended, monoNow in ns (see endRead)

	// Write side, guarded by wmu: one write call at a time.
	wmu       sync.Mutex
	w         buffer.ChainWriter
	pending   []byte // reserved bytes that did not fit in shared memory
	viaSocket bool   // data went as FallbackData: keep it there (see writeSome)
	queued    bool   // events were put since the last FallbackData (see Session.writeFallback)
	// spaceTimer bounds withSpace's waits, and spaceCh (cap 1) ends them
	// when slices are freed (sharedMem.noteFreed); both are made at the
	// stream's first wait for space and kept, so that waits allocate
	// nothing. spaceListed is guarded by the session's shm.spaceMu.
	spaceTimer  *time.Timer
	spaceCh     chan struct{}
	spaceListed bool
}

func newStream(s *Session, id uint32) *Stream {
	st := &Stream{
		s:        s,
		id:       id,
		readCh:   make(chan struct{}, 1),
		closedCh: make(chan struct{}),
	}
	st.rdl.init(st.readCh)
	st.wdl.init(nil)
	st.wdl.onExpire = func() { s.cutWrite(st) }
	return st
}

// streamState is where a stream is in its life: which of its two ends are
// closed, and how far our close got. Its flags combine; they are set, never
// cleared, and only by Stream.transition.
type streamState uint8

const (
	// stClosed: Close was called. Every
	// call fails with ErrStreamClosed; data that arrives is dropped.
	stClosed streamState = 1 << iota
	// stWriteClosed: our close was started, by CloseWrite or Close. Writes
	// fail with ErrWriteClosed.
	stWriteClosed
	// stCloseSent: our close is out, or can no longer be sent.
	stCloseSent
	// stCloseOnSocket: it went as a StreamClose message, or not at all
	// (see Session.reuseID).
	stCloseOnSocket
	// stRemoteClosed: the peer's close arrived. Reads end with io.EOF once
	// the data before it is read.
	stRemoteClosed
	// stRefused: on a client, the peer's close said that the server
	// refused the stream (docs/protocol.md section 11): reads and writes
	// fail with ErrStreamRefused. On a server, the stream is refused: its
	// close says so.
	stRefused
)

func (f streamState) has(flags streamState) bool { return f&flags == flags }

// streamEvent is what moves a stream from one state to the next.
type streamEvent uint8

const (
	evClose       streamEvent = iota // Close was called
	evCloseWrite                     // CloseWrite flushed and starts our close
	evCloseSent                      // our close went out (on the socket if onSocket)
	evRemoteClose                    // the peer's close arrived
	evRefused                        // the server refuses the stream (stRefused)
)

// streamActions is what a transition leaves for its caller to do once
// st.mu is released, in this order.
type streamActions struct {
	sendClose bool // send our close of the stream
	unroute   bool // stop routing events to the stream: both closes crossed
	reuseID   bool // the stream id may be used again (see Session.reuseID)
}

// transition applies ev to st's state and returns what is left to do. ok
// is false when ev does not apply: a second Close, a CloseWrite after
// Close, a second close from the peer. It is the one place where a
// stream's state changes. The caller holds st.mu.
//
// Both sides must have seen both closes before an id may be reused, and
// the two closes may cross: whichever of evCloseSent and evRemoteClose
// comes second unroutes the stream and frees its id.
func (st *Stream) transition(ev streamEvent, onSocket bool) (act streamActions, ok bool) {
	old := st.state
	switch ev {
	case evClose:
		if old.has(stClosed) {
			return act, false
		}
		st.state |= stClosed | stWriteClosed
		close(st.closedCh)
		signal(st.readCh)
		act.sendClose = !old.has(stWriteClosed)
	case evCloseWrite:
		if old&(stClosed|stWriteClosed) != 0 {
			return act, false
		}
		st.state |= stWriteClosed
		act.sendClose = true
	case evCloseSent:
		st.state |= stCloseSent
		if onSocket {
			st.state |= stCloseOnSocket
		}
		act.unroute = old.has(stRemoteClosed)
		act.reuseID = act.unroute && !onSocket
	case evRemoteClose:
		if old.has(stRemoteClosed) {
			return act, false
		}
		st.state |= stRemoteClosed
		act.unroute = old.has(stWriteClosed)
		act.reuseID = old.has(stCloseSent) && !old.has(stCloseOnSocket)
	case evRefused:
		st.state |= stRefused
	}
	return act, true
}

// apply runs the unroute and reuseID actions of a transition (the caller
// sends the close, which needs what only it knows). memHeld says the
// caller holds shm.mu's read lock.
func (st *Stream) apply(act streamActions, memHeld bool) {
	if act.unroute {
		st.s.unroute(st, memHeld)
	}
	if act.reuseID {
		st.s.reuseID(st.id)
	}
}

// is reports whether st's state has every flag of flags.
func (st *Stream) is(flags streamState) bool {
	st.mu.Lock()
	defer st.mu.Unlock()
	return st.state.has(flags)
}

// ID returns the stream id (docs/protocol.md section 4): 2, 3, 4, ... in
// the order the client opened its streams; ids of streams both sides
// closed are reused.
func (st *Stream) ID() uint32 { return st.id }

// Session returns the session the stream belongs to.
func (st *Stream) Session() *Session { return st.s }

// LocalAddr returns the local address of the session's control connection.
func (st *Stream) LocalAddr() net.Addr { return st.s.LocalAddr() }

// RemoteAddr returns the remote address of the session's control connection.
func (st *Stream) RemoteAddr() net.Addr { return st.s.RemoteAddr() }

// SetDeadline sets both the read and the write deadline; see net.Conn. It
// returns ErrStreamClosed after Close.
func (st *Stream) SetDeadline(t time.Time) error {
	if err := st.SetReadDeadline(t); err != nil {
		return err
	}
	return st.SetWriteDeadline(t)
}

// SetReadDeadline sets the time after which blocked and future reads fail
// with a net.Error whose Timeout() is true and which unwraps to
// os.ErrDeadlineExceeded. The zero time means no deadline. It returns
// ErrStreamClosed after Close. A deadline bounds the wait for data: a read
// that finds bytes buffered, or the peer's end, returns them even after
// the deadline passed, as yamux's streams do (a socket's Read fails
// instead); likewise a write that finds room in shared memory.
func (st *Stream) SetReadDeadline(t time.Time) error {
	if st.is(stClosed) {
		return ErrStreamClosed
	}
	st.rdl.set(t)
	st.s.rx.in.kick(st.s, st) // a reader reading the connection must see it
	return nil
}

// SetWriteDeadline is SetReadDeadline for Write, Reserve and Flush.
func (st *Stream) SetWriteDeadline(t time.Time) error {
	if st.is(stClosed) {
		return ErrStreamClosed
	}
	st.wdl.set(t)
	return nil
}

// notifyRead wakes the stream's reader, if one waits: asleep, or
// reading the control connection (ctlIn).
func (st *Stream) notifyRead() {
	select {
	case st.readCh <- struct{}{}:
	default:
	}
	st.s.rx.in.kick(st.s, st)
}

// Close closes the stream: the peer reads io.EOF after the data already
// sent, blocked calls on this stream return ErrStreamClosed, bytes not yet
// read are dropped (their slices recycled), and reserved bytes not yet
// flushed are discarded. Zero-copy results become invalid. After
// CloseWrite, Close sends nothing more. Close does not wait for a peer
// that stops reading: a Write blocked on the control connection returns
// (what it began of a message is finished in the background), and when
// the connection is held the close goes out in its turn on the session's
// closer goroutine, which Session.Close waits for. Close returns nil, and
// ErrStreamClosed when called again, like a net.Conn.
//
// The stream id is reused by a later OpenStream once both sides have
// closed the stream; the stream itself must not be used after Close.
func (st *Stream) Close() error {
	st.mu.Lock()
	act, ok := st.transition(evClose, false)
	// A ReadFrom waiting on its source holds wmu for as long as that
	// takes, and may read into a slice of the region: Close does not wait
	// for it, and leaves it the end of the close (closeLeft). Its writes
	// of viaSocket came before it set srcRead under mu.
	inSrcRead := ok && st.srcRead
	st.closeLeft = inSrcRead
	if ok {
		st.closing.Add(1)
		defer st.closing.Done()
	}
	st.mu.Unlock()
	if !ok {
		return ErrStreamClosed
	}
	st.rdl.stop()
	st.wdl.stop()
	st.s.rx.in.kick(st.s, st)
	st.s.cutWrite(st) // a Write blocked on the control connection returns
	var viaSocket bool
	if inSrcRead {
		viaSocket = st.viaSocket
	} else {
		st.wmu.Lock()
		st.abortLocked()
		viaSocket = st.viaSocket
		st.wmu.Unlock()
	}
	st.dropUnread()
	if act.sendClose {
		st.sendClose(viaSocket)
	}
	s := st.s
	if s.isClient && s.Err() == nil {
		s.forgetClosed(st)
	}
	if !inSrcRead {
		st.forgetClosedLive()
	}
	return nil
}

// forgetClosedLive ends the close of st: the stream stops counting as
// live, so the session may unmap its memory once it has ended. The
// caller is Close, or ReadFrom holding wmu for a Close that came while it
// waited in its reader's Read, once the reservation that Read filled is
// aborted: the memory it wrote into stays mapped until then.
func (st *Stream) forgetClosedLive() {
	s := st.s
	s.forgetLive(st)
	// After forgetLive: a session that ends from here on forgets st with
	// the other streams no longer live (fail), one that ended before is
	// seen here.
	if s.Err() != nil {
		s.unroute(st, false) // no close will come from the peer
	}
}

// Refuse closes a stream that a server session accepted but will not
// serve, as the session refuses the streams past its accept backlog: a
// shmlink client's reads and writes on it fail with ErrStreamRefused, a
// client of another implementation reads io.EOF (docs/protocol.md section
// 11). What the client sent and was not read is dropped. It is meant for a
// stream whose data the application has not used, for instance to shed
// load. On a client session, and after CloseWrite, it is Close. It returns
// Close's results.
func (st *Stream) Refuse() error {
	if !st.s.isClient {
		st.mu.Lock()
		st.transition(evRefused, false)
		st.mu.Unlock()
	}
	return st.Close()
}

// CloseWrite half-closes the stream: bytes reserved and not yet flushed are
// sent, then the peer reads io.EOF after everything written, while this
// side goes on reading what the peer sends. Later writes fail with
// ErrWriteClosed; Close is still needed to release the stream and sends
// nothing more. It waits for a Write or ReadFrom under way to return, as
// its bytes come first (a Write waiting for space returns at its write
// deadline). CloseWrite returns nil when called again, ErrStreamClosed
// after Close, and the error of sending the reserved bytes, if any (the
// write side is closed anyway).
func (st *Stream) CloseWrite() error {
	st.wmu.Lock()
	defer st.wmu.Unlock()
	st.mu.Lock()
	state := st.state
	st.mu.Unlock()
	if state.has(stClosed) {
		return ErrStreamClosed
	}
	if state.has(stWriteClosed) {
		return nil
	}
	err := st.flushLocked()
	st.mu.Lock()
	act, ok := st.transition(evCloseWrite, false)
	st.mu.Unlock()
	if !ok {
		return ErrStreamClosed // Close ran meanwhile and sent the close itself
	}
	if act.sendClose {
		st.sendClose(st.viaSocket)
	}
	return err
}

// sendClose sends our close of the stream, once stWriteClosed is set, and
// records it (evCloseSent); viaSocket says the stream's data went over the
// socket, so must its close. When the peer's close came first the stream
// is unrouted before: a client may reuse the id as soon as it has our
// close, and its next event for the id must open a new stream.
func (st *Stream) sendClose(viaSocket bool) {
	s := st.s
	if st.is(stRemoteClosed) {
		s.unroute(st, false)
	}
	status := uint32(stateClosed)
	if !s.isClient && st.is(stRefused) {
		status = s.refusalStatus()
	}
	onSocket := true
	s.withMem(func(m *memory) error {
		if s.Err() == nil {
			onSocket = s.sendCloseLocked(m, st.id, viaSocket, status, false)
		}
		return nil
	})
	st.mu.Lock()
	act, _ := st.transition(evCloseSent, onSocket)
	st.mu.Unlock()
	st.apply(act, false)
}
