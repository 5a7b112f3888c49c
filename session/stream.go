package session

import (
	"errors"
	"io"
	"net"
	"runtime"
	"sync"
	"sync/atomic"
	"time"

	"github.com/shmlink/shmlink/buffer"
	"github.com/shmlink/shmlink/queue"
)

// chunk is one received message waiting to be read: the unread part of a
// slice chain in shared memory (off != 0), or bytes that came as
// FallbackData (off == 0).
type chunk struct {
	off     uint32 // current slice, absolute offset; 0 for fallback bytes
	data    []byte // unread bytes of the current slice, or fallback bytes
	next    uint32 // next slice of the chain, if hasNext
	hasNext bool
	pinned  bool // a zero-copy view into the current slice was handed out
	remain  int  // unread bytes of the whole message, data included
	links   int  // slices of the chain visited so far (cycle guard)
	charge  int  // capacity of the chain's slices, counted in Stream.shm
}

// A Stream is one bidirectional byte stream of a session. It implements
// net.Conn, with CloseWrite for a half-close like *net.TCPConn's, and adds
// a zero-copy API: Reserve and Flush on the write side, Peek, ReadBytes,
// Discard and ReleasePreviousRead on the read side.
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

	mu            sync.Mutex
	recv          []chunk // FIFO from rhead
	rhead         int
	buffered      int           // unread bytes in recv
	shm           int           // capacity of the slices that recv's unread bytes occupy
	inRead        atomic.Bool   // a read call is running
	lastRead      atomic.Int64  // when a recent read call ended, Unix ns (see leaveRead)
	held          []uint32      // consumed slices with a zero-copy view out
	remoteClosed  bool          // the peer's close arrived
	closed        bool          // Close was called
	wclosed       bool          // our close was started, by CloseWrite or Close
	closeSent     bool          // our close is out, or can no longer be sent
	closeOnSocket bool          // it went as a StreamClose message (or not at all)
	readCh        chan struct{} // cap 1: data or state arrived
	closedCh      chan struct{} // closed by Close
	rdl, wdl      deadline

	rmu       sync.Mutex // serializes readers; guards reads and waited
	reads     uint64     // read calls ended
	waited    bool       // the current read call waited for data
	wmu       sync.Mutex // serializes writers; guards the fields below
	w         buffer.ChainWriter
	pending   []byte // reserved bytes that did not fit in shared memory
	viaSocket bool   // data went as FallbackData: keep it there (see writeSome)
	queued    bool   // events were put since the last FallbackData (see writeFallback)
}

func newStream(s *Session, id uint32) *Stream {
	return &Stream{
		s:        s,
		id:       id,
		readCh:   make(chan struct{}, 1),
		closedCh: make(chan struct{}),
		rdl:      makeDeadline(),
		wdl:      makeDeadline(),
	}
}

// ID returns the stream id (PROTOCOL.md section 4): 2, 3, 4, ... in the
// order the client opened its streams.
func (st *Stream) ID() uint32 { return st.id }

// Session returns the session the stream belongs to.
func (st *Stream) Session() *Session { return st.s }

// LocalAddr returns the local address of the session's control connection.
func (st *Stream) LocalAddr() net.Addr { return st.s.LocalAddr() }

// RemoteAddr returns the remote address of the session's control connection.
func (st *Stream) RemoteAddr() net.Addr { return st.s.RemoteAddr() }

// SetDeadline sets both the read and the write deadline; see net.Conn.
func (st *Stream) SetDeadline(t time.Time) error {
	if err := st.SetReadDeadline(t); err != nil {
		return err
	}
	return st.SetWriteDeadline(t)
}

// SetReadDeadline sets the time after which blocked and future reads fail
// with a net.Error whose Timeout() is true and which unwraps to
// os.ErrDeadlineExceeded. The zero time means no deadline. It returns
// ErrStreamClosed after Close.
func (st *Stream) SetReadDeadline(t time.Time) error {
	if st.isClosed() {
		return ErrStreamClosed
	}
	st.rdl.set(t)
	return nil
}

// SetWriteDeadline is SetReadDeadline for writes, Reserve and Flush.
func (st *Stream) SetWriteDeadline(t time.Time) error {
	if st.isClosed() {
		return ErrStreamClosed
	}
	st.wdl.set(t)
	return nil
}

func (st *Stream) isClosed() bool {
	st.mu.Lock()
	defer st.mu.Unlock()
	return st.closed
}

func (st *Stream) notifyRead() {
	select {
	case st.readCh <- struct{}{}:
	default:
	}
}

// ---- receive side: called by the session's receive loop ----

// pushChain queues the message whose slice chain starts at off. The chain is
// walked and checked first: a bad offset, a cycle or a size beyond a
// slice's cap ends the session instead of reaching the reader. The caller
// holds memMu's read lock with the memory mapped.
func (st *Stream) pushChain(off uint32) error {
	region := st.s.mem.region
	var cr buffer.ChainReader
	if err := cr.Reset(region, off); err != nil {
		return err
	}
	total, charge := 0, 0
	for {
		p, soff, err := cr.Next()
		if err == io.EOF {
			break
		}
		if err != nil {
			return err
		}
		total += len(p)
		charge += region.SliceSize(soff)
	}
	st.mu.Lock()
	if st.closed || total == 0 {
		// Nothing to read: a closed stream drops its data, and an empty
		// message (the announcement of a new stream) carries none.
		st.mu.Unlock()
		_, err := region.FreeChain(off)
		return err
	}
	st.s.ctr.bytesReceived.Add(uint64(total))
	overShm := st.shm+charge > st.s.shmLimit || st.s.shmUnread.Load()+int64(charge) > int64(st.s.sessionShmLimit)
	if overShm && st.buffered-st.shm+total <= st.s.heapLimit && region.FreeBytes() < st.s.pressureBytes && st.stalled() {
		// Over the stream's share of shared memory, or over the share of
		// all our unread data, while the region runs short and the reader
		// has stalled: copy the message out and free its slices now, so
		// that a stalled reader holds heap, not slices that the other
		// streams, or writers on either side, need. A reader that keeps
		// reading only slows its writer down (backpressure): copying its
		// data out would slow it down further.
		data := make([]byte, 0, total)
		cr.Reset(region, off) // cannot fail: it did above
		for {
			p, _, err := cr.Next()
			if err != nil {
				break // io.EOF: the walk above saw the same chain
			}
			data = append(data, p...)
		}
		st.recv = append(st.recv, chunk{data: data, remain: len(data)})
		st.buffered += len(data)
		st.mu.Unlock()
		st.s.ctr.spilled.Add(uint64(len(data)))
		st.notifyRead()
		_, err := region.FreeChain(off)
		return err
	}
	p, next, hasNext, err := region.Payload(off)
	if err != nil {
		st.mu.Unlock()
		return err
	}
	st.recv = append(st.recv, chunk{off: off, data: p, next: next, hasNext: hasNext, remain: total, links: 1, charge: charge})
	st.buffered += total
	st.shm += charge
	st.s.shmUnread.Add(int64(charge))
	st.mu.Unlock()
	st.notifyRead()
	return nil
}

// pushBytes queues data that came as FallbackData; the stream owns data.
func (st *Stream) pushBytes(data []byte) {
	st.mu.Lock()
	if st.closed {
		st.mu.Unlock()
		return
	}
	st.recv = append(st.recv, chunk{data: data, remain: len(data)})
	st.buffered += len(data)
	st.mu.Unlock()
	st.notifyRead()
}

// remoteClose records the peer's close: reads end with io.EOF once the data
// already queued is read. If our close was started too, the stream is
// unrouted now: the peer may reuse its id as soon as it sees our close.
func (st *Stream) remoteClose() {
	st.mu.Lock()
	if st.remoteClosed {
		st.mu.Unlock()
		return // a second close from the peer
	}
	st.remoteClosed = true
	wclosed, sent, onSocket := st.wclosed, st.closeSent, st.closeOnSocket
	st.mu.Unlock()
	st.notifyRead()
	if wclosed {
		st.s.unroute(st, true)
		if sent {
			st.s.recycle(st.id, onSocket)
		}
	}
}

// ---- read side ----

// waitReadable blocks until at least want bytes are buffered, the stream
// has ended, or a deadline passes. It returns with st.mu and memMu's read
// lock held and err nil when bytes are buffered (maybe fewer than want if
// the stream ended), and with neither held when err is non-nil. io.EOF
// means the peer closed and nothing is left.
func (st *Stream) waitReadable(want int) error {
	s := st.s
	for {
		s.memMu.RLock()
		st.mu.Lock()
		if st.closed {
			st.mu.Unlock()
			s.memMu.RUnlock()
			return ErrStreamClosed
		}
		remoteClosed := st.remoteClosed
		ended := remoteClosed || s.mem == nil || isClosedChan(s.dead)
		if st.buffered >= want || (ended && st.buffered > 0) {
			if s.mem == nil { // released: nothing can be read any more
				st.mu.Unlock()
				s.memMu.RUnlock()
				return s.Err()
			}
			return nil
		}
		st.mu.Unlock()
		s.memMu.RUnlock()
		if remoteClosed {
			return io.EOF
		}
		if ended {
			return s.Err()
		}
		select {
		case <-st.rdl.wait():
			return errDeadline
		default:
		}
		st.waited = true
		if st.poll(want) {
			continue
		}
		// About to sleep until the receive loop delivers: end any lease
		// of the working flag, so that the peer wakes us (lease.go).
		s.waiters.Add(1)
		s.settle()
		select {
		case <-st.readCh:
		case <-s.dead:
		case <-st.closedCh:
		case <-st.rdl.wait():
		}
		s.waiters.Add(-1)
	}
}

// pollBatch is how many times Stream.poll checks the queue between its
// checks of the clock, deadlines and the session's end.
const pollBatch = 64

// poll waits for want bytes (or the stream's end) by polling the receive
// queue itself, dispatching what it pops to every stream, for as long as
// events keep coming and then Config.PollTime more. Meanwhile it holds the
// queue's working flag at 1, so the peer sends no wakeup (PROTOCOL.md
// section 3.3): while traffic flows a message costs no system call and no
// goroutine switch on either side. One reader per session polls; poll
// returns false at once in the others, and when its time runs out; true
// when st may be readable, ended, closed or past its read deadline.
func (st *Stream) poll(want int) bool {
	s := st.s
	if s.cfg.PollTime <= 0 || !s.polling.CompareAndSwap(false, true) {
		return false
	}
	// Got what it waited for, the reader leases the working flag to its
	// next poll (lease.go); otherwise it settles the flag.
	ready := false
	defer func() { s.endPoll(ready) }()
	idleSince := time.Now()
	drained := false // since the last look at the clock
	for {
		s.memMu.RLock()
		if s.mem == nil {
			s.memMu.RUnlock()
			return true
		}
		recv := s.mem.recv
		recv.SetWorking()
		// st is checked after each drain and at the end of a batch (the
		// caller checked it before the first); in between the loop only
		// reads the queue's tail, so that a reader waiting for its peer
		// does not slow the peer down.
		for range pollBatch {
			if recv.Empty() || !s.drainMu.TryLock() {
				continue
			}
			err := s.drainLocked(false)
			s.drainMu.Unlock()
			if err != nil {
				s.memMu.RUnlock()
				s.fail(&SessionError{Op: "read", Err: err})
				return true
			}
			drained = true
			if st.readyFor(want) {
				s.memMu.RUnlock()
				ready = true
				return true
			}
		}
		if st.readyFor(want) {
			s.memMu.RUnlock()
			ready = true
			return true
		}
		s.memMu.RUnlock()
		select {
		case <-s.dead:
			return true
		case <-st.closedCh:
			return true
		case <-st.rdl.wait():
			return true
		default:
		}
		if now := time.Now(); drained {
			idleSince, drained = now, false
		} else if now.Sub(idleSince) > s.cfg.PollTime {
			return false
		}
		// Let the process's other goroutines run; the peer runs on its own.
		runtime.Gosched()
	}
}

// readyFor reports whether a reader waiting for want bytes can go on.
func (st *Stream) readyFor(want int) bool {
	st.mu.Lock()
	defer st.mu.Unlock()
	return st.buffered >= want || st.remoteClosed || st.closed
}

// Read reads up to len(p) bytes; see net.Conn. After the peer's Close it
// returns the data still queued, then io.EOF. It returns ErrStreamClosed
// after Close, a deadline error (Timeout() true) after the read deadline,
// and the session's error if the session ended first.
func (st *Stream) Read(p []byte) (int, error) {
	st.rmu.Lock()
	defer st.rmu.Unlock()
	st.inRead.Store(true)
	defer st.leaveRead()
	if len(p) == 0 {
		return 0, nil
	}
	if err := st.waitReadable(1); err != nil {
		return 0, err
	}
	n, err := st.consumeLocked(p, len(p))
	st.mu.Unlock()
	st.s.memMu.RUnlock()
	if err != nil {
		st.s.fail(&SessionError{Op: "read", Err: err})
	}
	return n, nil
}

// stallTime is how long a stream's reader must have been out of every
// read call before its data may be copied out of shared memory (see
// pushChain).
const stallTime = time.Millisecond

// leaveRead records the end of a read call. Reading the clock would cost a
// busy reader more than a small read itself, so the time is recorded only
// after a read that waited, and after every stampEvery-th read: one that
// finds its data buffered each time stamps at least every stampEvery reads.
// The caller holds rmu.
func (st *Stream) leaveRead() {
	st.reads++
	if st.waited || st.reads%stampEvery == 0 {
		st.lastRead.Store(time.Now().UnixNano())
		st.waited = false
	}
	st.inRead.Store(false)
}

// stampEvery is how many read calls may end between two stamps of
// lastRead.
const stampEvery = 8

// stalled reports whether the stream's reader has stayed out of every read
// call for stallTime: it does not read, for now, what it has.
func (st *Stream) stalled() bool {
	return !st.inRead.Load() && time.Now().UnixNano()-st.lastRead.Load() > int64(stallTime)
}

// consumeLocked moves up to n buffered bytes into p (or drops them when p
// is nil), recycling or holding the slices it finishes. It runs with
// memMu read-locked and st.mu held. An error means the peer corrupted a
// chain; the bytes counted until then are valid.
func (st *Stream) consumeLocked(p []byte, n int) (int, error) {
	done := 0
	for done < n && st.rhead < len(st.recv) {
		c := &st.recv[st.rhead]
		k := min(n-done, len(c.data))
		if p != nil {
			copy(p[done:], c.data[:k])
		}
		c.data = c.data[k:]
		c.remain -= k
		st.buffered -= k
		done += k
		if len(c.data) == 0 {
			if err := st.advanceLocked(c); err != nil {
				return done, err
			}
		}
	}
	return done, nil
}

// advanceLocked finishes the current slice of c and moves to the next slice
// with bytes, or pops c at the end of its chain.
func (st *Stream) advanceLocked(c *chunk) error {
	region := st.s.mem.region
	for len(c.data) == 0 {
		if c.off != 0 {
			if c.pinned {
				st.held = append(st.held, c.off)
			} else if err := region.Free(c.off); err != nil {
				st.dropHeadLocked()
				return err
			}
		}
		if !c.hasNext || c.remain <= 0 {
			var err error
			if c.hasNext || c.remain != 0 {
				// The chain changed since pushChain walked it.
				err = buffer.ErrCorrupt
			}
			st.dropHeadLocked()
			return err
		}
		if c.links >= st.s.maxLinks {
			st.dropHeadLocked()
			return buffer.ErrCorrupt
		}
		p, next, hasNext, err := region.Payload(c.next)
		if err != nil {
			st.dropHeadLocked()
			return err
		}
		*c = chunk{off: c.next, data: p, next: next, hasNext: hasNext, remain: c.remain, links: c.links + 1, charge: c.charge}
		if len(p) > c.remain {
			c.data = p[:c.remain]
		}
	}
	return nil
}

// dropHeadLocked pops the first chunk, forgetting what it had left.
func (st *Stream) dropHeadLocked() {
	c := &st.recv[st.rhead]
	st.buffered -= c.remain
	st.shm -= c.charge
	st.s.shmUnread.Add(-int64(c.charge))
	*c = chunk{}
	st.rhead++
	if st.rhead == len(st.recv) {
		st.recv = st.recv[:0]
		st.rhead = 0
	}
}

// Peek returns the next n bytes without consuming them, waiting until they
// have arrived. When they lie in one slice of shared memory the returned
// slice points into it (zero copy) and stays valid until the bytes are
// consumed and then released by ReleasePreviousRead, or until Close;
// otherwise it is a fresh copy owned by the caller. It returns io.EOF if
// the peer closed with no bytes left, io.ErrUnexpectedEOF if it closed with
// fewer than n, and the errors of Read otherwise. n must be positive.
func (st *Stream) Peek(n int) ([]byte, error) {
	st.rmu.Lock()
	defer st.rmu.Unlock()
	st.inRead.Store(true)
	defer st.leaveRead()
	return st.peek(n)
}

func (st *Stream) peek(n int) ([]byte, error) {
	if n <= 0 {
		return nil, errors.New("shmlink: Peek of a non-positive length")
	}
	if err := st.waitReadable(n); err != nil {
		return nil, err
	}
	defer st.s.memMu.RUnlock()
	defer st.mu.Unlock()
	if st.buffered < n {
		return nil, io.ErrUnexpectedEOF
	}
	c := &st.recv[st.rhead]
	if len(c.data) >= n {
		if c.off != 0 {
			c.pinned = true
		}
		return c.data[:n:n], nil
	}
	out := make([]byte, 0, n)
	region := st.s.mem.region
	for i := st.rhead; len(out) < n && i < len(st.recv); i++ {
		c := st.recv[i]
		out = append(out, c.data[:min(len(c.data), n-len(out))]...)
		left, next, hasNext, links := c.remain-len(c.data), c.next, c.hasNext, c.links
		for len(out) < n && hasNext && left > 0 && links < st.s.maxLinks {
			p, nx, hn, err := region.Payload(next)
			if err != nil {
				break
			}
			p = p[:min(len(p), left)]
			out = append(out, p[:min(len(p), n-len(out))]...)
			left -= len(p)
			next, hasNext, links = nx, hn, links+1
		}
	}
	if len(out) < n {
		st.s.fail(&SessionError{Op: "read", Err: buffer.ErrCorrupt})
		return nil, io.ErrUnexpectedEOF
	}
	return out, nil
}

// ReadBytes consumes and returns the next n bytes, waiting until they have
// arrived. Like Peek, the result points into shared memory when the bytes
// lie in one slice; those slices are recycled only by ReleasePreviousRead
// (or Close), so the result stays valid until then. Errors are Peek's.
func (st *Stream) ReadBytes(n int) ([]byte, error) {
	st.rmu.Lock()
	defer st.rmu.Unlock()
	st.inRead.Store(true)
	defer st.leaveRead()
	b, err := st.peek(n)
	if err != nil {
		return nil, err
	}
	_, err = st.discard(n)
	return b, err
}

// ReadChunk consumes and returns the next bytes that lie contiguously in
// one slice of shared memory (or in one FallbackData message): at least 1
// and at most max, waiting until some have arrived. It never copies: the
// result points into shared memory (or the received message) and stays
// valid until ReleasePreviousRead or Close, which recycle the slices behind
// every result returned since the last release. It returns io.EOF once the
// peer closed and every byte was read, and the errors of Read otherwise;
// max must be positive.
func (st *Stream) ReadChunk(max int) ([]byte, error) {
	st.rmu.Lock()
	defer st.rmu.Unlock()
	st.inRead.Store(true)
	defer st.leaveRead()
	if max <= 0 {
		return nil, errors.New("shmlink: ReadChunk of a non-positive length")
	}
	if err := st.waitReadable(1); err != nil {
		return nil, err
	}
	c := &st.recv[st.rhead]
	k := min(max, len(c.data))
	b := c.data[:k:k]
	if c.off != 0 {
		c.pinned = true
	}
	_, err := st.consumeLocked(nil, k)
	st.mu.Unlock()
	st.s.memMu.RUnlock()
	if err != nil {
		st.s.fail(&SessionError{Op: "read", Err: err})
		return nil, st.s.Err()
	}
	return b, nil
}

// Discard skips the next n bytes, waiting until they have arrived, and
// returns how many it skipped: fewer than n only with an error (io.EOF if
// the peer closed first, or Read's errors).
func (st *Stream) Discard(n int) (int, error) {
	st.rmu.Lock()
	defer st.rmu.Unlock()
	st.inRead.Store(true)
	defer st.leaveRead()
	return st.discard(n)
}

func (st *Stream) discard(n int) (int, error) {
	done := 0
	for done < n {
		if err := st.waitReadable(1); err != nil {
			return done, err
		}
		k, err := st.consumeLocked(nil, n-done)
		st.mu.Unlock()
		st.s.memMu.RUnlock()
		done += k
		if err != nil {
			st.s.fail(&SessionError{Op: "read", Err: err})
			return done, st.s.Err()
		}
	}
	return done, nil
}

// ReleasePreviousRead recycles the slices behind zero-copy results of Peek
// and ReadBytes whose bytes have been consumed. Those results must not be
// used afterwards.
func (st *Stream) ReleasePreviousRead() {
	s := st.s
	s.memMu.RLock()
	defer s.memMu.RUnlock()
	st.mu.Lock()
	defer st.mu.Unlock()
	if s.mem == nil {
		st.held = st.held[:0]
		return
	}
	st.releaseHeldLocked()
}

func (st *Stream) releaseHeldLocked() {
	for _, off := range st.held {
		if err := st.s.mem.region.Free(off); err != nil {
			go st.s.fail(&SessionError{Op: "release", Err: err})
			break
		}
	}
	st.held = st.held[:0]
}

// Buffered returns the number of bytes that can be read without waiting.
func (st *Stream) Buffered() int {
	st.mu.Lock()
	defer st.mu.Unlock()
	return st.buffered
}

// ---- write side ----

// Write writes p to the stream; see net.Conn. Data goes into slices of
// shared memory, one event per chain of up to 4 MiB. When the buffer region
// is exhausted Write waits for the peer to free slices (backpressure), or,
// with Config.Fallback, sends the rest over the control connection as
// FallbackData. p is not retained. It returns ErrStreamClosed after Close,
// ErrWriteClosed after CloseWrite, a deadline error (Timeout() true) after
// the write deadline, ErrQueueFull if the peer leaves the IO queue full for
// Config.QueueFullTimeout, and the session's error if it ended. Bytes
// counted in n were handed to the peer.
func (st *Stream) Write(p []byte) (int, error) {
	st.wmu.Lock()
	defer st.wmu.Unlock()
	if err := st.flushLocked(); err != nil {
		return 0, err
	}
	n := 0
	for n < len(p) {
		k, err := st.writeSome(p[n:])
		n += k
		if err != nil {
			return n, err
		}
	}
	return n, nil
}

// writeCheck returns why a write cannot go on, or nil.
func (st *Stream) writeCheck() error {
	st.mu.Lock()
	closed, wclosed := st.closed, st.wclosed
	st.mu.Unlock()
	if closed {
		return ErrStreamClosed
	}
	if wclosed {
		return ErrWriteClosed
	}
	select {
	case <-st.wdl.wait():
		return errDeadline
	default:
	}
	return st.s.Err()
}

// writeSome sends a prefix of p and returns its length.
//
// Once a stream has sent FallbackData it keeps sending over the control
// connection: an event put after a FallbackData could otherwise be drained
// by the peer before it reads that FallbackData from the socket, reordering
// the stream's bytes.
func (st *Stream) writeSome(p []byte) (int, error) {
	if err := st.writeCheck(); err != nil {
		return 0, err
	}
	s := st.s
	if !st.viaSocket {
		s.memMu.RLock()
		if s.mem == nil {
			s.memMu.RUnlock()
			return 0, s.Err()
		}
		st.w.Reset(s.mem.region)
		k, err := st.w.Write(p[:min(len(p), maxEventBytes)])
		for tries := 0; k == 0 && errors.Is(err, buffer.ErrNoSpace) && !s.cfg.Fallback; tries++ {
			// Shared memory is exhausted: wait for the peer to free slices.
			s.memMu.RUnlock()
			if err := st.waitSpace(tries); err != nil {
				return 0, err
			}
			s.memMu.RLock()
			if s.mem == nil {
				s.memMu.RUnlock()
				return 0, s.Err()
			}
			k, err = st.w.Write(p[:min(len(p), maxEventBytes)])
		}
		if k > 0 {
			err = st.publishLocked()
			s.memMu.RUnlock()
			if err != nil {
				return 0, err
			}
			return k, nil
		}
		s.memMu.RUnlock()
		if !errors.Is(err, buffer.ErrNoSpace) {
			s.fail(&SessionError{Op: "write", Err: err})
			return 0, s.Err()
		}
		s.ctr.memoryFull.Add(1)
		st.viaSocket = true
	}
	k := min(len(p), maxFallbackChunk)
	if err := s.writeFallback(st.id, p[:k], st.queued); err != nil {
		return 0, err
	}
	st.queued = false
	return k, nil
}

// waitSpace backs off after the tries-th attempt to get a slice found the
// buffer region exhausted: it yields at first, then sleeps, growing from
// 4 µs to 256 µs, since the peer's reader frees slices without telling us.
// It returns why the write cannot go on, or nil to try again.
func (st *Stream) waitSpace(tries int) error {
	if tries == 0 {
		st.s.ctr.memoryFull.Add(1)
	}
	if err := st.writeCheck(); err != nil {
		return err
	}
	if tries < 16 {
		runtime.Gosched()
		return nil
	}
	if tries%16 == 0 {
		// Our own unread data may be what fills the region: an echo
		// server blocked here holds the request it has not read yet.
		st.s.spillStalled()
	}
	time.Sleep(time.Duration(4<<min(tries-16, 6)) * time.Microsecond)
	return st.writeCheck()
}

// spillStalled copies out of shared memory the unread data of every
// stream whose reader has stalled (see pushChain), while the region runs
// short, so that a writer of ours waiting for space is not waiting for
// its own session's readers.
func (s *Session) spillStalled() {
	s.memMu.RLock()
	defer s.memMu.RUnlock()
	if s.mem == nil || s.mem.region.FreeBytes() >= s.pressureBytes {
		return
	}
	s.mu.Lock()
	streams := make([]*Stream, 0, len(s.live))
	for st := range s.live {
		streams = append(streams, st)
	}
	s.mu.Unlock()
	for _, st := range streams {
		if st.stalled() {
			st.spill()
		}
	}
}

// spill replaces every unread message of st held in shared memory by a
// copy on the heap, within Config.StreamHeapLimit, and frees its slices.
// Messages with a zero-copy view out stay. The caller holds memMu's read
// lock with the memory mapped.
func (st *Stream) spill() {
	region := st.s.mem.region
	st.mu.Lock()
	defer st.mu.Unlock()
	for i := st.rhead; i < len(st.recv); i++ {
		c := &st.recv[i]
		if c.off == 0 || c.pinned {
			continue
		}
		if st.buffered-st.shm+c.remain > st.s.heapLimit {
			return
		}
		data := make([]byte, 0, c.remain)
		data = append(data, c.data...)
		left, next, hasNext, links := c.remain-len(c.data), c.next, c.hasNext, c.links
		for hasNext && left > 0 && links < st.s.maxLinks {
			p, nx, hn, err := region.Payload(next)
			if err != nil {
				break
			}
			p = p[:min(len(p), left)]
			data = append(data, p...)
			left -= len(p)
			next, hasNext, links = nx, hn, links+1
		}
		if len(data) != c.remain {
			continue // a corrupt chain: the reader will find it
		}
		region.Free(c.off)
		if c.hasNext {
			region.FreeChain(c.next)
		}
		st.shm -= c.charge
		st.s.shmUnread.Add(-int64(c.charge))
		st.s.ctr.spilled.Add(uint64(len(data)))
		*c = chunk{data: data, remain: len(data)}
	}
}

// publishLocked finishes the chain in st.w and puts its event. On failure
// the chain is recycled. The caller holds wmu and memMu's read lock with
// the memory mapped.
func (st *Stream) publishLocked() error {
	head, size := st.w.Finish()
	if size == 0 {
		return nil
	}
	err := st.s.putEvent(queue.Event{StreamID: st.id, Offset: head, Status: stateOpen}, st.closedCh, st.wdl.wait(), false)
	if err != nil {
		st.s.mem.region.FreeChain(head)
		return err
	}
	st.s.ctr.bytesSent.Add(uint64(size))
	st.queued = true
	return nil
}

// MaxSliceSize returns the largest slice size of the session's buffer
// region in bytes (PROTOCOL.md section 2): the most Stream.Reserve gives at
// once. It returns 0 once the session's shared memory is released.
func (s *Session) MaxSliceSize() int {
	s.memMu.RLock()
	defer s.memMu.RUnlock()
	if s.mem == nil {
		return 0
	}
	return s.mem.region.MaxSliceSize()
}

// Reserve returns n contiguous bytes to fill in place; they are sent, after
// any bytes reserved before, by the next Flush or Write. The memory lies in
// a slice of shared memory (zero copy); when the region is exhausted the
// first Reserve after a Flush waits for space like Write (unless
// Config.Fallback), and later ones, whose earlier bytes may not be filled
// yet, return heap memory that Flush copies out. Either way it belongs to
// the stream and must not be used after that Flush, Write or Close. Errors
// are Write's; n must be in [1, Session.MaxSliceSize()].
func (st *Stream) Reserve(n int) ([]byte, error) {
	st.wmu.Lock()
	defer st.wmu.Unlock()
	if err := st.writeCheck(); err != nil {
		return nil, err
	}
	if n <= 0 {
		return nil, errors.New("shmlink: Reserve of a non-positive length")
	}
	s := st.s
	if !st.viaSocket && len(st.pending) == 0 {
		s.memMu.RLock()
		if s.mem == nil {
			s.memMu.RUnlock()
			return nil, s.Err()
		}
		fresh := st.w.Len() == 0
		if fresh {
			st.w.Reset(s.mem.region)
		}
		b, err := st.w.Reserve(n)
		// With nothing reserved yet, wait for the peer to free slices
		// (unless Config.Fallback); bytes reserved before may be unfilled
		// yet, so they cannot be sent to make room, and the rest goes to
		// the heap until Flush.
		for tries := 0; fresh && !s.cfg.Fallback && errors.Is(err, buffer.ErrNoSpace); tries++ {
			s.memMu.RUnlock()
			if err := st.waitSpace(tries); err != nil {
				return nil, err
			}
			s.memMu.RLock()
			if s.mem == nil {
				s.memMu.RUnlock()
				return nil, s.Err()
			}
			b, err = st.w.Reserve(n)
		}
		s.memMu.RUnlock()
		if err == nil {
			return b, nil
		}
		if !errors.Is(err, buffer.ErrNoSpace) {
			return nil, err
		}
	}
	start := len(st.pending)
	st.pending = append(st.pending, make([]byte, n)...)
	return st.pending[start : start+n : start+n], nil
}

// Flush sends every byte reserved since the last Flush or Write. Errors are
// Write's, also when nothing is reserved.
func (st *Stream) Flush() error {
	st.wmu.Lock()
	defer st.wmu.Unlock()
	if err := st.writeCheck(); err != nil {
		st.abortLocked()
		return err
	}
	return st.flushLocked()
}

func (st *Stream) flushLocked() error {
	if st.w.Len() == 0 && len(st.pending) == 0 {
		return nil
	}
	if err := st.writeCheck(); err != nil {
		st.abortLocked()
		return err
	}
	s := st.s
	if st.w.Len() > 0 {
		s.memMu.RLock()
		if s.mem == nil {
			s.memMu.RUnlock()
			st.w = buffer.ChainWriter{}
			st.pending = st.pending[:0]
			return s.Err()
		}
		err := st.publishLocked()
		s.memMu.RUnlock()
		if err != nil {
			st.pending = st.pending[:0]
			return err
		}
	}
	if !s.cfg.Fallback && !st.viaSocket {
		// Backpressure: the heap bytes go into shared memory as it frees.
		for len(st.pending) > 0 {
			k, err := st.writeSome(st.pending)
			if err != nil {
				st.pending = st.pending[:0]
				return err
			}
			st.pending = st.pending[k:]
		}
	}
	for len(st.pending) > 0 {
		st.viaSocket = true
		k := min(len(st.pending), maxFallbackChunk)
		err := s.writeFallback(st.id, st.pending[:k], st.queued)
		st.queued = false
		if err != nil {
			st.pending = st.pending[:0]
			return err
		}
		st.pending = st.pending[k:]
	}
	st.pending = nil
	return nil
}

// abortLocked drops reserved bytes, recycling their slices.
func (st *Stream) abortLocked() {
	st.pending = nil
	if st.w.Len() == 0 {
		return
	}
	s := st.s
	s.memMu.RLock()
	if s.mem != nil {
		st.w.Abort()
	}
	s.memMu.RUnlock()
	st.w = buffer.ChainWriter{}
}

// Close closes the stream: the peer reads io.EOF after the data already
// sent, blocked calls on this stream return ErrStreamClosed, bytes not yet
// read are dropped (their slices recycled), and reserved bytes not yet
// flushed are discarded. Zero-copy results become invalid. After
// CloseWrite, Close sends nothing more. Close returns nil, and
// ErrStreamClosed when called again, like a net.Conn.
//
// The stream id is reused by a later OpenStream once both sides have
// closed the stream; the stream itself must not be used after Close.
func (st *Stream) Close() error {
	st.mu.Lock()
	if st.closed {
		st.mu.Unlock()
		return ErrStreamClosed
	}
	st.closed = true
	close(st.closedCh)
	mustSend := !st.wclosed
	st.wclosed = true
	st.mu.Unlock()
	st.rdl.stop()
	st.wdl.stop()

	st.wmu.Lock()
	st.abortLocked()
	viaSocket := st.viaSocket
	st.wmu.Unlock()

	s := st.s
	s.memMu.RLock()
	st.mu.Lock()
	if s.mem != nil {
		region := s.mem.region
		for i := st.rhead; i < len(st.recv); i++ {
			// Errors mean the peer corrupted its own chains; there is
			// nothing left to read from them, so they are ignored here.
			if c := st.recv[i]; c.off != 0 {
				if c.pinned {
					st.held = append(st.held, c.off)
				} else {
					region.Free(c.off)
				}
				if c.hasNext {
					region.FreeChain(c.next)
				}
			}
		}
		st.releaseHeldLocked()
	}
	s.shmUnread.Add(-int64(st.shm))
	st.recv, st.rhead, st.buffered, st.shm, st.held = nil, 0, 0, 0, nil
	st.mu.Unlock()
	s.memMu.RUnlock()
	if mustSend {
		st.sendClose(viaSocket)
	}
	if s.Err() != nil {
		s.unroute(st, false) // no close will come from the peer
	} else if s.isClient {
		s.forgetClosed(st)
	}
	s.retire(st)
	return nil
}

// CloseWrite half-closes the stream: bytes reserved and not yet flushed are
// sent, then the peer reads io.EOF after everything written, while this
// side goes on reading what the peer sends. Later writes fail with
// ErrWriteClosed; Close is still needed to release the stream and sends
// nothing more. CloseWrite returns nil when called again, ErrStreamClosed
// after Close, and the error of sending the reserved bytes, if any (the
// write side is closed anyway).
func (st *Stream) CloseWrite() error {
	st.wmu.Lock()
	defer st.wmu.Unlock()
	st.mu.Lock()
	closed, wclosed := st.closed, st.wclosed
	st.mu.Unlock()
	if closed {
		return ErrStreamClosed
	}
	if wclosed {
		return nil
	}
	err := st.flushLocked()
	st.mu.Lock()
	if st.closed {
		// Close ran meanwhile and sent the close itself.
		st.mu.Unlock()
		return ErrStreamClosed
	}
	st.wclosed = true
	st.mu.Unlock()
	st.sendClose(st.viaSocket)
	return err
}

// sendClose sends our close of the stream, once wclosed is set. When the
// peer's close came first the stream is unrouted before: a client may reuse
// the id as soon as it has our close, and its next event for the id must
// open a new stream. A client recycles the id once both closes are out.
func (st *Stream) sendClose(viaSocket bool) {
	s := st.s
	st.mu.Lock()
	remoteClosed := st.remoteClosed
	st.mu.Unlock()
	if remoteClosed {
		s.unroute(st, false)
	}
	onSocket := true
	s.memMu.RLock()
	if s.mem != nil && s.Err() == nil {
		onSocket = s.sendCloseLocked(st.id, viaSocket)
	}
	s.memMu.RUnlock()
	st.mu.Lock()
	st.closeSent, st.closeOnSocket = true, onSocket
	remoteClosed = st.remoteClosed
	st.mu.Unlock()
	if remoteClosed {
		s.unroute(st, false)
		s.recycle(st.id, onSocket)
	}
}
