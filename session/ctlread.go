package session

import (
	"bufio"
	"errors"
	"fmt"
	"io"
	"math"
	"os"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/shmlink/shmlink/internal/wire"
)

// Who reads the control connection (docs/protocol.md section 12.1).
//
// A reader that sleeps until a Polling arrives would, if the receive loop
// read the connection, be woken twice: the connection wakes the receive
// loop, which harvests the queue and wakes the reader. On a host whose idle
// CPUs halt, each wakeup of another goroutine may cost tens of
// microseconds. So the connection is read by one goroutine at a time, the
// holder of ctlIn.tok: the receive loop, or a reader waiting for its
// stream's data (a pump), which then wakes by itself when the Polling
// comes, harvests, and goes on with its data.
//
//   - A reader about to sleep whose waits run long (Stream.selfWake) takes
//     the connection if nobody holds it; other readers make sure that the
//     receive loop reads it (needReader). If the receive loop holds it,
//     the reader asks it to let go (yield): the loop's read is cut short by
//     a deadline in the past (a kick), and the loop hands the connection
//     over (freed). If another reader holds it, the reader sleeps as
//     before, and that pump delivers its data.
//   - A pump reads Polling and StreamClose messages only. Anything else
//     (FallbackData, HotRestart, an error) it leaves to the receive loop.
//   - A pump that got its data keeps the connection free for a while
//     (ctlIn.let): a reader that loops (a request handler, a bufio.Reader)
//     is back within microseconds and takes it again without waking
//     anyone. After that, or at once when other goroutines wait for the
//     session or the stream ended, the receive loop takes it back
//     (bgWake, signalled by the session's timer: tick.go).
//   - Something else a pump waits for (its stream's data dispatched by
//     another goroutine, Close, a new read deadline) kicks it while it is
//     blocked between messages.
//
// Messages that arrive while nobody holds the connection wait in the
// socket for that while; none of them is needed by a reader in a read
// call, which would hold the connection or have woken the receive loop.
// Only AcceptStream may wait that long for a stream opened meanwhile.

// How long the connection stays free after a pump got its data, before
// the receive loop reads it again (ctlIn.handBackAfter), after a pause in
// traffic; while let-goes come one after another, standbyTick (let). On
// a server, AcceptStream may wait that long for a stream opened meanwhile,
// so it is short: a server's reader (a request handler) is back within it.
// A client's reader may pause between requests for longer, and nothing on
// a client waits for the receive loop but what ends or drains the session.
const (
	serverHandBack = time.Millisecond
	clientHandBack = 20 * time.Millisecond
)

// ctlIn is the read side of the control connection.
type ctlIn struct {
	tok sync.Mutex // held by the goroutine that reads r
	r   *bufio.Reader
	err error // a pump's read error for the receive loop; guarded by tok

	// kickMu guards the conn's read deadline and what follows.
	kickMu  sync.Mutex
	loopHas bool      // the receive loop holds tok
	yield   bool      // a reader asked the receive loop to let go
	idle    bool      // tok's holder is blocked, or about to be, between messages
	kicked  bool      // the read deadline was moved to the past since
	rdl     time.Time // the holder's own deadline (a pump's read deadline)
	// pumping is the stream whose reader holds tok and is idle: whoever
	// makes it readable kicks it.
	pumping atomic.Pointer[Stream]

	handBackAfter time.Duration // serverHandBack or clientHandBack
	freed         chan struct{} // cap 1: the receive loop let go at a reader's request
	bgWake        chan struct{} // cap 1: the receive loop should take tok
	// freeSince is when tok was let go (ticker.now), 0 while it is held:
	// the session's timer signals bgWake handBackAfter later.
	freeSince atomic.Int64
	// handBackAt is when the timer hands tok back (ticker.now), set with
	// freeSince; lastLet is when tok was last let go, and letGap the time
	// between the last two let-goes (math.MaxInt64 before the second).
	handBackAt atomic.Int64
	lastLet    atomic.Int64
	letGap     atomic.Int64
	brokenAt   time.Time // deadline set by writeFailed; guarded by kickMu
	hasBroken  bool      // brokenAt is set; guarded by kickMu
}

func (in *ctlIn) init(s *Session) {
	in.r = bufio.NewReaderSize(newCtlReader(s.conn), 64<<10)
	in.handBackAfter = serverHandBack
	if s.isClient {
		in.handBackAfter = clientHandBack
	}
	in.freed = make(chan struct{}, 1)
	in.bgWake = make(chan struct{}, 1)
	in.letGap.Store(math.MaxInt64)
}

// taken records that tok was taken, and disarms the session's timer if
// it has nothing else to look after (relax); let records that it was let
// go, and has the timer hand it back to the receive loop later unless a
// reader takes it first.
func (in *ctlIn) taken(s *Session) {
	in.freeSince.Store(0)
	s.relax()
}

// let gives tok handBackAfter before the hand-back, or the ticker's
// standby period if longer when the last let-go was less than that ago:
// while traffic flows, a request handler that takes a few milliseconds
// gets the connection back without waking the receive loop.
func (in *ctlIn) let(s *Session) {
	now := s.tk.now()
	after := in.handBackAfter
	if last := time.Duration(in.lastLet.Swap(int64(now))); last != 0 {
		in.letGap.Store(int64(now - last))
		if now-last < s.tk.standby {
			after = max(after, s.tk.standby)
		}
	}
	in.free(s, now, after)
}

// free records that tok is free from now on, and has the session's timer
// hand it back to the receive loop after after, unless a reader takes it
// first. The receive loop, letting go for a reader, calls it directly:
// its let-goes are not requests, and do not count in letGap.
func (in *ctlIn) free(s *Session, now, after time.Duration) {
	in.handBackAt.Store(int64(now + after))
	in.freeSince.Store(int64(now))
	s.tk.poke(after)
}

// signal makes a pending signal on c, a channel of capacity 1.
func signal(c chan struct{}) {
	select {
	case c <- struct{}{}:
	default:
	}
}

// setDeadlineLocked sets the conn's read deadline to the holder's: rdl,
// or writeFailed's if that comes first. The caller holds kickMu.
func (in *ctlIn) setDeadlineLocked(s *Session, rdl time.Time) {
	in.rdl = rdl
	in.kicked = false
	d := rdl
	if in.hasBroken && (d.IsZero() || in.brokenAt.Before(d)) {
		d = in.brokenAt
	}
	s.conn.SetReadDeadline(d)
}

// kickLocked cuts short the holder's wait between messages. The caller
// holds kickMu.
func (in *ctlIn) kickLocked(s *Session) {
	if in.idle && !in.kicked {
		in.kicked = true
		s.conn.SetReadDeadline(time.Unix(1, 0))
	}
}

// kick wakes st's reader if it is blocked reading the connection: it has
// something else to look at.
func (in *ctlIn) kick(s *Session, st *Stream) {
	if in.pumping.Load() != st {
		return
	}
	in.kickMu.Lock()
	if in.pumping.Load() == st {
		in.kickLocked(s)
	}
	in.kickMu.Unlock()
}

// setBroken makes the connection's reads fail at t (writeFailed).
func (in *ctlIn) setBroken(s *Session, t time.Time) {
	in.kickMu.Lock()
	defer in.kickMu.Unlock()
	in.brokenAt, in.hasBroken = t, true
	if in.idle {
		in.kickLocked(s) // the holder sets it
		return
	}
	d := in.rdl
	if d.IsZero() || t.Before(d) {
		d = t
	}
	s.conn.SetReadDeadline(d)
}

// beginIdle marks the holder as between messages (kicks may come), and
// for a pump publishes its stream and brings the connection's deadline up
// to its stream's; endIdle ends that, restoring the deadline if a kick
// moved it.
//
// A SetReadDeadline kicks a pump only while it is published and idle: one
// that came while it was not (before its first beginIdle, or while it
// handled a message) is caught here, since st.rdl is read after st is
// published, under st.rdl's lock, which the setter takes before it looks
// for a pump to kick. Without that, a deadline cleared in such a window
// left the old one on the connection: once it passed, every read failed at
// once and the pump spun without reading.
func (in *ctlIn) beginIdle(s *Session, st *Stream) (yield bool) {
	in.kickMu.Lock()
	defer in.kickMu.Unlock()
	if st == nil && in.yield {
		in.yield, in.loopHas = false, false
		return true
	}
	in.idle = true
	if st != nil {
		in.pumping.Store(st)
		if rdl, _ := st.rdl.when(); !rdl.Equal(in.rdl) {
			in.setDeadlineLocked(s, rdl)
		}
	}
	return false
}

func (in *ctlIn) endIdle(s *Session, st *Stream) {
	in.kickMu.Lock()
	in.idle = false
	in.pumping.Store(nil)
	if in.kicked {
		rdl := in.rdl
		if st != nil {
			rdl, _ = st.rdl.when() // a kick may have come with a new one
		}
		in.setDeadlineLocked(s, rdl)
	}
	in.kickMu.Unlock()
}

// ctlResult is how readCtl ended.
type ctlResult int

const (
	ctlDone    ctlResult = iota // the receive loop: the connection ended
	ctlYield                    // the receive loop: a reader takes the connection
	ctlReady                    // a pump: its stream has the bytes it waits for
	ctlEnded                    // a pump: its stream or the session ended, or its deadline passed
	ctlHandOff                  // a pump: the rest is the receive loop's
)

// recvLoop is the receive loop: it reads control messages whenever no
// reader does (see ctlIn), until the connection ends.
func (s *Session) recvLoop() {
	in := &s.rx.in
	defer func() {
		close(s.rx.done)
		s.unmapIfUnused()
	}()
	if !in.loopTake() {
		in.tok.Lock() // a reader got there first: the loop waits its turn
	}
	for {
		in.taken(s)
		in.kickMu.Lock()
		in.loopHas = true
		in.setDeadlineLocked(s, time.Time{})
		in.kickMu.Unlock()
		if s.readCtl(nil, 0) == ctlDone {
			in.tok.Unlock()
			return
		}
		// Let go for a reader: it reads until it has its data, then gives
		// the connection back, or leaves it free for a while. Recorded
		// before the reader can take it, whose taken would be undone.
		in.free(s, s.tk.now(), in.handBackAfter)
		in.tok.Unlock()
		signal(in.freed)
		for taken := false; !taken; {
			select {
			case <-in.bgWake:
				taken = in.loopTake()
			case <-s.dead:
				in.tok.Lock()
				taken = true
			}
		}
	}
}

// loopTake takes tok for the receive loop if it is free, and records that
// the loop holds it (loopHas) in the same critical section of kickMu. A
// reader whose TryLock of tok fails then sees loopHas and asks the loop to
// let go (pump). Were loopHas set later, a reader could come in between,
// take the holder for another reader, and sleep: its wait would take the
// receive loop's extra wakeup, and its needReader a stale bgWake that
// makes the loop take the connection back from the next reader it frees.
func (in *ctlIn) loopTake() bool {
	in.kickMu.Lock()
	defer in.kickMu.Unlock()
	if !in.tok.TryLock() {
		return false
	}
	in.loopHas = true
	return true
}

// readCtl reads and handles control messages, holding tok: for the
// receive loop (st nil) until the connection ends (ctlDone) or a reader
// asks for it (ctlYield); for a pump, until st is ready for want bytes,
// has ended, or a message is left to the receive loop.
func (s *Session) readCtl(st *Stream, want int) ctlResult {
	in := &s.rx.in
	var small [16]byte
	for {
		if st != nil {
			if res, ok := st.pumpDone(want); ok {
				return res
			}
		} else if in.err != nil {
			err := in.err
			in.err = nil
			s.readEnded(err)
			return ctlDone
		}
		if in.r.Buffered() < wire.HeaderSize {
			if in.beginIdle(s, st) {
				return ctlYield
			}
			if st != nil {
				// Published as pumping before this check: whoever makes
				// st ready after it kicks.
				if res, ok := st.pumpDone(want); ok {
					in.endIdle(s, st)
					return res
				}
			}
		}
		hdr, err := in.r.Peek(wire.HeaderSize)
		in.endIdle(s, st)
		if err != nil {
			if res, again := s.ctlReadError(st, err); !again {
				return res
			}
			continue
		}
		// FallbackData of any length is taken in pieces (recvFallback);
		// every other message after the handshake has at most 16 bytes.
		h, err := wire.ParseHeader(hdr, math.MaxUint32)
		if err != nil {
			if st != nil {
				return ctlHandOff
			}
			s.failOp("read", err)
			return ctlDone
		}
		n := int(h.Length) - wire.HeaderSize
		if st != nil && h.Type != wire.TypePolling && h.Type != wire.TypeStreamClose {
			return ctlHandOff
		}
		if h.Type == wire.TypeFallbackData {
			in.r.Discard(wire.HeaderSize)
			if rerr, err := s.recvFallback(in.r, n); rerr != nil {
				s.readFailed(rerr)
				return ctlDone
			} else if err != nil {
				s.failOp("read FallbackData", err)
				return ctlDone
			}
			continue
		}
		if n > len(small) {
			if st != nil {
				return ctlHandOff
			}
			s.failOp("read", fmt.Errorf("%w: %v of %d bytes", ErrProtocol, h.Type, h.Length))
			return ctlDone
		}
		msg, err := in.r.Peek(wire.HeaderSize + n)
		if err != nil {
			if res, again := s.ctlReadError(st, err); !again {
				return res
			}
			continue
		}
		payload := small[:copy(small[:], msg[wire.HeaderSize:])]
		in.r.Discard(len(msg))
		if err := s.handle(h, payload); err != nil {
			s.failOp("read "+h.Type.String(), err)
			if st != nil {
				return ctlEnded
			}
			return ctlDone
		}
	}
}

// ctlReadError deals with a failed read of the connection: again says to
// read on after a kick or a deadline that does not end the read. Bytes of
// a message read in part stay in the bufio.Reader for the next try.
func (s *Session) ctlReadError(st *Stream, err error) (res ctlResult, again bool) {
	in := &s.rx.in
	if errors.Is(err, os.ErrDeadlineExceeded) {
		in.kickMu.Lock()
		broken := in.hasBroken && !time.Now().Before(in.brokenAt)
		in.kickMu.Unlock()
		if !broken {
			return 0, true // a kick, or a pump's deadline: pumpDone decides
		}
		if st != nil {
			return ctlHandOff, false // the receive loop ends the session
		}
	}
	if st != nil {
		in.err = err
		return ctlHandOff, false
	}
	s.readEnded(err)
	return ctlDone, false
}

// readEnded ends the session for err, the read of the connection that
// failed. The peer may have put events (data, closes) and closed the
// connection before its Polling went out (the Rust crate's
// SessionManager::close does): at the connection's end they are delivered
// first. The end is io.EOF, or ECONNRESET when the peer closed with our
// bytes unread (a Polling it had no reason to read, say).
func (s *Session) readEnded(err error) {
	if errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) || errors.Is(err, syscall.ECONNRESET) {
		if herr := s.harvest(); herr != nil && !errors.Is(herr, ErrSessionClosed) {
			s.failOp("read", herr)
			return
		}
		err = ErrPeerClosed
	}
	s.readFailed(err)
}

// pumpDone reports whether a pump for want bytes stops reading the
// connection, and why.
func (st *Stream) pumpDone(want int) (ctlResult, bool) {
	s := st.s
	st.mu.Lock()
	buffered, state := st.buffered, st.state
	st.mu.Unlock()
	switch {
	case isClosedChan(s.dead) || state&(stRemoteClosed|stClosed) != 0:
		return ctlEnded, true
	case buffered >= want:
		return ctlReady, true
	}
	if at, c := st.rdl.when(); isClosedChan(c) || (!at.IsZero() && !time.Now().Before(at)) {
		return ctlEnded, true
	}
	return 0, false
}

// needReader makes sure that somebody reads the connection for a reader
// about to sleep without reading it itself: the receive loop, unless a
// pump reads it.
func (in *ctlIn) needReader() {
	in.kickMu.Lock()
	has := in.loopHas
	in.kickMu.Unlock()
	if !has {
		signal(in.bgWake)
	}
}

// pump reads the connection for st's reader, waiting for want bytes, or
// fewer but more than the have bytes its caller found buffered, if nobody
// else reads it (see ctlIn); ok says whether it did, and st may have
// changed. If the receive loop reads it, pump asks it to let go
// (asked); the caller then waits, ctlIn.freed says that the connection is
// free, and a caller that goes without reading it withdraws the request
// (withdraw). The caller holds rmu and counts in rx.waiters.
func (st *Stream) pump(want, have int) (ok, asked bool) {
	s := st.s
	in := &s.rx.in
	if !in.tok.TryLock() {
		in.kickMu.Lock()
		if in.loopHas {
			in.yield, asked = true, true
			in.kickLocked(s)
		}
		in.kickMu.Unlock()
		return false, asked
	}
	in.taken(s)
	// A reader that waits for more bytes than it holds (a Peek) stops at
	// the first new ones, as one that sleeps wakes at each message:
	// whenReadable then copies what it holds out of the region while that
	// runs short (spillOwn), since the rest may need those slices. A pump
	// that waited for all of them would wait for ever once the writer
	// waits for space. New means new since the caller looked (have), not
	// since now: messages that the receive loop delivered in between,
	// before the caller flagged its wait (holdWait), stayed in the region
	// and may hold its last slices; the pump then returns at once, for
	// whenReadable to copy them out, instead of waiting for a message
	// that has no slice to come in.
	want = min(want, have+1)
	rdl, _ := st.rdl.when()
	in.kickMu.Lock()
	in.setDeadlineLocked(s, rdl)
	in.kickMu.Unlock()
	if s.pumpHook != nil {
		s.pumpHook(st)
	}
	res := s.readCtl(st, want)
	// Others wait for the session's events (this reader counts in
	// rx.waiters too), or this stream is done, or a message is the
	// receive loop's: it takes the connection now. Else the connection
	// stays free for this reader's next wait. Recorded before tok is let
	// go: a reader that takes it at once must not have its taken undone.
	handBack := res != ctlReady || s.rx.waiters.Load() > 1
	if handBack {
		in.freeSince.Store(int64(s.tk.now()))
	} else {
		in.let(s)
	}
	if s.pumpDoneHook != nil {
		s.pumpDoneHook(st)
	}
	in.tok.Unlock()
	// Checked again once tok is free: a reader that began to wait after
	// the check above found tok held, by this pump, and sleeps counting on
	// it: either it could not read the connection itself (pump's TryLock
	// failed, and nobody was asked to let go), or its needReader's signal
	// went to a receive loop that could not take tok. Nobody else would
	// read the connection until the timer's hand-back, up to 16 ms (20 ms
	// on a client), while the reader's Polling waits in it.
	if handBack || s.rx.waiters.Load() > 1 {
		signal(in.bgWake)
	}
	return res != ctlHandOff, false
}

// withdraw takes back a reader's request that the receive loop let go of
// the connection, for a reader that got what it waited for another way:
// a request still pending is dropped, and a connection already let go is
// taken back at once, since other readers may sleep counting on the loop.
func (in *ctlIn) withdraw() {
	in.kickMu.Lock()
	defer in.kickMu.Unlock()
	if in.yield {
		in.yield = false
		return
	}
	if !in.loopHas {
		signal(in.bgWake) // the loop takes it unless a reader holds it
	}
}
