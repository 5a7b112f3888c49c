package session

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"reflect"
	"runtime"
	"sync"
	"syscall"
	"time"

	"github.com/shmlink/shmlink/buffer"
	"github.com/shmlink/shmlink/internal/wire"
	"github.com/shmlink/shmlink/queue"
	"golang.org/x/sys/unix"
)

// The send direction, top to bottom: Write copies bytes into a chain of
// slices (buffer.ChainWriter) and publishes it as an event on the send
// queue (putEvent), which wakes the peer with a Polling when its working
// flag was clear. When the region has no slice left, a writer waits for
// the peer to free some (withSpace), or, with Config.Fallback, sends the
// bytes over the control connection as FallbackData.

// maxEventBytes bounds the bytes one event (one slice chain) carries: a
// large write goes out as a train of events, so that the reader copies
// the first out while the writer still copies the rest in, and one write
// cannot take the whole buffer region.
const maxEventBytes = 64 << 10

// maxFallbackChunk is the most data bytes one FallbackData message carries.
const maxFallbackChunk = 64 << 10

// Write writes p to the stream; see net.Conn. Data goes into slices of
// shared memory, one event per chain of up to 64 KiB (maxEventBytes). When
// the buffer region is exhausted Write waits for the peer to free slices
// (backpressure), or, with Config.Fallback, sends the rest over the control
// connection as FallbackData. It sends over the connection without
// Config.Fallback too when the region is held by this process's own
// unread data: readers of this session that stopped reading hold half of
// it, more than StreamHeapLimit lets them copy out (docs/protocol.md
// section 13). p is not retained. It returns ErrStreamClosed after Close,
// ErrWriteClosed after CloseWrite, ErrStreamRefused once the server has
// refused the stream, a deadline error (Timeout() true) after the write
// deadline, ErrQueueFull if the peer leaves the IO queue full for
// Config.QueueFullTimeout, and the session's error if it ended. Bytes
// counted in n were handed to the peer.
func (st *Stream) Write(p []byte) (int, error) {
	st.wmu.Lock()
	defer st.wmu.Unlock()
	if err := st.flushLocked(); err != nil {
		return 0, err
	}
	if len(p) == 0 {
		return 0, st.writeCheck() // fails after Close as any other Write
	}
	return st.writeAllLocked(p)
}

// writeAllLocked sends p, in pieces of writeSome, and returns the bytes
// handed to the peer; it stops at the first error. The caller holds wmu.
func (st *Stream) writeAllLocked(p []byte) (int, error) {
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
	state := st.state
	st.mu.Unlock()
	switch {
	case state.has(stClosed):
		return ErrStreamClosed
	case state.has(stWriteClosed):
		return ErrWriteClosed
	case state.has(stRefused):
		return ErrStreamRefused
	}
	select {
	case <-st.wdl.wait():
		return errDeadline
	default:
	}
	if b := st.s.ctl.broken.Load(); b != nil {
		return b // the peer's end is closed: the session ends soon
	}
	return st.s.Err()
}

// writeSome sends a prefix of p, at most maxEventBytes, and returns its
// length. The caller holds wmu.
//
// Once a stream has sent FallbackData it keeps sending over the control
// connection: an event put after a FallbackData could otherwise be
// harvested by the peer before it reads that FallbackData from the socket,
// reordering the stream's bytes.
func (st *Stream) writeSome(p []byte) (int, error) {
	if err := st.writeCheck(); err != nil {
		return 0, err
	}
	s := st.s
	if !st.viaSocket {
		p := p[:min(len(p), maxEventBytes)]
		k := 0
		err := st.withSpace(!s.cfg.Fallback, func(m *memory) error {
			st.w.Reset(m.region)
			n, err := st.w.Write(p[:st.w.WholeSlices(len(p))])
			if n == 0 {
				return err
			}
			k = n // what did not fit goes in the next call
			return st.publishLocked(m)
		})
		if k > 0 || !errors.Is(err, buffer.ErrNoSpace) {
			if err != nil {
				return 0, err
			}
			return k, nil
		}
		s.ctr.memoryFull.Add(1)
		st.viaSocket = true
	}
	k := min(len(p), maxFallbackChunk)
	if err := s.writeFallback(st, p[:k], st.queued, st.wdl.wait()); err != nil {
		return 0, err
	}
	st.queued = false
	return k, nil
}

// withSpace runs try with shm.mu read-locked, and while try reports that
// the region has no slice left (buffer.ErrNoSpace) and wait is set, again
// after waiting for slices to be freed: it yields at first, then waits
// until slices are freed on this side or the peer's events are harvested
// (sharedMem.noteFreed), or at the latest for a time that grows from 4 µs
// to 256 µs, since the peer's reader frees slices without telling us
// (docs/protocol.md section 10, rule 6). It returns try's last error, or
// why the write cannot go on (writeCheck). It stops waiting, with
// ErrNoSpace, once this session's stalled readers hold half the region
// and the heap limit keeps their data there (spillStalled): the caller
// then sends over the control connection. Errors other than ErrNoSpace
// and the session's mean the peer corrupted shared memory: they end the
// session. The caller holds wmu.
func (st *Stream) withSpace(wait bool, try func(m *memory) error) error {
	s := st.s
	var lastSpill time.Time
	waiting := false // counted in spaceWaiters: from the first wait on
	defer func() {
		if waiting {
			s.shm.unwatchSpace(st)
			st.spaceTimer.Stop()
			s.shm.spaceWaiters.Add(-1)
		}
	}()
	for tries := 0; ; tries++ {
		if tries == yieldTries {
			waiting = true
			s.shm.spaceWaiters.Add(1)
			if st.spaceTimer == nil {
				st.spaceTimer = time.NewTimer(time.Hour)
				st.spaceCh = make(chan struct{}, 1)
			}
		}
		if tries >= yieldTries {
			// Listed before the try: a free after its failure wakes us.
			s.shm.watchSpace(st)
		}
		err := s.withMem(try)
		if err == nil || (errors.Is(err, buffer.ErrNoSpace) && !wait) {
			return err
		}
		if !errors.Is(err, buffer.ErrNoSpace) {
			if errors.Is(err, buffer.ErrCorrupt) {
				return s.failOp("write", err)
			}
			return err
		}
		if tries == 0 {
			s.ctr.memoryFull.Add(1)
		}
		if err := st.writeCheck(); err != nil {
			return err
		}
		if tries < yieldTries {
			runtime.Gosched()
			continue
		}
		if now := time.Now(); now.Sub(lastSpill) >= spillEvery {
			// Our own unread data may be what fills the region: an echo
			// server blocked here holds the request it has not read yet.
			lastSpill = now
			if s.spillStalled() {
				// It still does, past the heap limit: no slice comes
				// until this process reads, and a socket's writer would
				// not wait for its own reader. The caller sends over the
				// control connection (docs/protocol.md section 13).
				return err
			}
		}
		st.spaceTimer.Reset(s.shm.spaceWait << min(tries-yieldTries, 6))
		select {
		case <-st.spaceCh:
		case <-st.spaceTimer.C:
		case <-st.closedCh:
		case <-st.wdl.wait():
		case <-s.dead:
		}
		if err := st.writeCheck(); err != nil {
			return err
		}
	}
}

// spillEvery is how often, at most, a writer waiting for space copies out
// the unread data of its session's stalled streams (spillStalled): at its
// first wait, and then after each spillEvery of waiting. Its wakeups come
// as fast as slices are freed, and a copy more often than that would copy
// out data that its reader is about to take anyway.
const spillEvery = 16 * time.Millisecond

// yieldTries is how many times withSpace yields before it waits.
const yieldTries = 16

// watchSpace lists st to be woken (on st.spaceCh) the next time slices
// are freed here or the peer's events are harvested, while st counts in
// spaceWaiters. A wakeup left over from an earlier wait only makes st try
// once more.
func (m *sharedMem) watchSpace(st *Stream) {
	m.spaceMu.Lock()
	defer m.spaceMu.Unlock()
	if !st.spaceListed {
		st.spaceListed = true
		m.spaceListed = append(m.spaceListed, st)
	}
}

// unwatchSpace takes st off the list of watchSpace, at the end of its
// wait, so that the list holds no stream that no longer waits.
func (m *sharedMem) unwatchSpace(st *Stream) {
	m.spaceMu.Lock()
	defer m.spaceMu.Unlock()
	if !st.spaceListed {
		return
	}
	st.spaceListed = false
	for i, w := range m.spaceListed {
		if w == st {
			last := len(m.spaceListed) - 1
			m.spaceListed[i], m.spaceListed[last] = m.spaceListed[last], nil
			m.spaceListed = m.spaceListed[:last]
			break
		}
	}
}

// noteFreed wakes the writers waiting for free slices, if any: slices were
// freed on this side, or the peer's events harvested. One atomic load when
// nobody waits; it allocates nothing.
func (m *sharedMem) noteFreed() {
	if m.spaceWaiters.Load() == 0 {
		return
	}
	m.spaceMu.Lock()
	for i, st := range m.spaceListed {
		st.spaceListed = false
		select {
		case st.spaceCh <- struct{}{}:
		default:
		}
		m.spaceListed[i] = nil
	}
	m.spaceListed = m.spaceListed[:0]
	m.spaceMu.Unlock()
}

// publishLocked finishes the chain in st.w and puts its event. On failure
// the chain is recycled. The caller holds wmu and shm.mu's read lock.
func (st *Stream) publishLocked(m *memory) error {
	head, size := st.w.Finish()
	if size == 0 {
		return nil
	}
	err := st.s.putEvent(m, queue.Event{StreamID: st.id, Offset: head, Status: stateOpen}, st.closedCh, st.wdl.wait(), false)
	if err != nil {
		m.region.FreeChain(head)
		return err
	}
	st.s.ctr.bytesSent.Add(uint64(size))
	st.queued = true
	return nil
}

// MaxSliceSize returns the largest slice size of the session's buffer
// region in bytes (docs/protocol.md section 2): the most Stream.Reserve
// gives at once. It returns 0 once the session's shared memory is
// unmapped.
func (s *Session) MaxSliceSize() int {
	n := 0
	s.withMem(func(m *memory) error {
		n = m.region.MaxSliceSize()
		return nil
	})
	return n
}

// Reserve returns n contiguous bytes to fill in place; they are sent, after
// any bytes reserved before, by the next Flush or Write. The memory lies in
// a slice of shared memory (zero copy); when the region is exhausted the
// first Reserve after a Flush waits for space like Write (unless
// Config.Fallback), and later ones, whose earlier bytes may not be filled
// yet, return heap memory that Flush copies out. Either way it belongs to
// the stream and must not be used after that Flush, Write or Close. Errors
// are Write's, and one wrapping ErrBadLength when n is outside [1,
// Session.MaxSliceSize()].
func (st *Stream) Reserve(n int) ([]byte, error) {
	st.wmu.Lock()
	defer st.wmu.Unlock()
	return st.reserveLocked(n)
}

// reserveLocked is Reserve; the caller holds wmu.
func (st *Stream) reserveLocked(n int) ([]byte, error) {
	if err := st.writeCheck(); err != nil {
		return nil, err
	}
	if n <= 0 || n > st.s.shm.maxSlice {
		// Checked here too, not only by the region: bytes reserved on the
		// heap (below) must obey the same bound.
		return nil, fmt.Errorf("shmlink: Reserve of %d bytes, outside [1, %d]: %w", n, st.s.shm.maxSlice, ErrBadLength)
	}
	if !st.viaSocket && len(st.pending) == 0 {
		// With nothing reserved yet, wait for the peer to free slices
		// (unless Config.Fallback); bytes reserved before may be unfilled
		// yet, so they cannot be sent to make room, and the rest goes to
		// the heap until Flush.
		fresh := st.w.Len() == 0
		var b []byte
		err := st.withSpace(fresh && !st.s.cfg.Fallback, func(m *memory) (err error) {
			if fresh {
				st.w.Reset(m.region)
			}
			b, err = st.w.Reserve(n)
			return err
		})
		if !errors.Is(err, buffer.ErrNoSpace) {
			return b, err
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

// flushLocked sends what was reserved: the chain in shared memory first,
// then the bytes that went to the heap. The caller holds wmu.
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
		err := s.withMem(st.publishLocked)
		if err != nil {
			st.w = buffer.ChainWriter{} // its slices are gone with the mapping, or recycled
			st.pending = nil
			return err
		}
	}
	defer func() { st.pending = nil }()
	if !s.cfg.Fallback && !st.viaSocket {
		// Backpressure: the heap bytes go into shared memory as it frees.
		for len(st.pending) > 0 {
			k, err := st.writeSome(st.pending)
			if err != nil {
				return err
			}
			st.pending = st.pending[k:]
		}
	}
	for len(st.pending) > 0 {
		st.viaSocket = true
		k := min(len(st.pending), maxFallbackChunk)
		if err := s.writeFallback(st, st.pending[:k], st.queued, st.wdl.wait()); err != nil {
			return err // nothing sent: the Polling is still owed
		}
		st.queued = false
		st.pending = st.pending[k:]
	}
	return nil
}

// abortLocked drops reserved bytes, recycling their slices. The caller
// holds wmu.
func (st *Stream) abortLocked() {
	st.pending = nil
	if st.w.Len() == 0 {
		return
	}
	st.s.withMem(func(*memory) error { return st.w.Abort() })
	st.w = buffer.ChainWriter{}
}

// announce sends the event that opens st on the server: its slice holds
// zero bytes and the server recycles it. When no slice can be had it sends
// an empty FallbackData instead, and the stream stays on the socket like
// one that fell back: the server may pop the stream's later events from
// the IO queue (its data, its close) before it reads the announcement from
// the socket, and the announcement would then open the stream anew, after
// its end. The caller holds st.wmu.
func (s *Session) announce(ctx context.Context, st *Stream) error {
	return s.withMem(func(m *memory) error {
		off, err := m.region.Alloc(0)
		if errors.Is(err, buffer.ErrNoSpace) {
			st.viaSocket = true
			stop := context.AfterFunc(ctx, func() { s.cutWrite(st) })
			defer stop()
			err := s.writeFallback(st, nil, false, ctx.Done())
			if err == errDeadline {
				return ctx.Err()
			}
			return err
		}
		if err == nil {
			err = m.region.SetPayload(off, 0)
		}
		if err != nil {
			return s.failOp("open stream", err)
		}
		// The announcement always wakes the server: its AcceptStream must
		// not wait for the end of a lease of the working flag.
		err = s.putEvent(m, queue.Event{StreamID: st.id, Offset: off, Status: stateOpen}, nil, ctx.Done(), true)
		if err != nil {
			m.region.Free(off)
			if err == errDeadline {
				return ctx.Err()
			}
		}
		return err
	})
}

// putEvent publishes one event on the send queue and wakes the peer if it
// is idle (docs/protocol.md section 3.3), or with wake set whatever its
// working flag says (a peer of this package may lease the flag). It waits
// for room while the queue is full, until closed is closed
// (ErrStreamClosed), cancel is closed (errDeadline), the session ends, or
// Config.QueueFullTimeout passes (ErrQueueFull). The caller holds shm.mu's
// read lock.
func (s *Session) putEvent(m *memory, ev queue.Event, closed, cancel <-chan struct{}, wake bool) error {
	var start time.Time
	for tries := 0; ; tries++ {
		full, err := s.put(m, ev)
		if err != nil {
			return err
		}
		if !full {
			break
		}
		if tries == 0 {
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
		if tries < 64 {
			runtime.Gosched()
		} else {
			time.Sleep(min(time.Duration(tries-63)*10*time.Microsecond, time.Millisecond))
		}
	}
	if m.send.MarkWorking() || wake {
		s.expectReply(m)
		s.wake()
	}
	return nil
}

// expectReply leases the receive queue's working flag (docs/protocol.md
// section 12) before a Polling wakes the peer, unless a goroutine of ours
// waits for the session's events: the peer's answer then comes without a
// Polling of its own. On a host whose idle CPUs halt, the peer that our
// Polling wakes often runs on our CPU at once, before our reader polls;
// without the lease it would answer with a Polling, which costs it a
// system call and wakes our receive loop for nothing. A writer that does
// not read afterwards costs its peer nothing more than a lease does.
//
// rx.mu orders this against a goroutine that starts to wait: it counts
// itself in rx.waiters, then settles the flag under rx.mu. Only tried,
// since the caller holds shm.mu's read lock, which rx.mu's holders take
// after it; a harvest in progress skips the lease.
func (s *Session) expectReply(m *memory) {
	if s.pollTime() <= 0 || s.rx.waiters.Load() != 0 || m.recv.Working() || !s.rx.mu.TryLock() {
		return
	}
	leased := s.rx.waiters.Load() == 0
	if leased {
		m.recv.SetWorking()
	}
	s.rx.mu.Unlock()
	if leased {
		s.lease()
	}
}

// put puts ev on the send queue once and reports whether the queue was
// full (the caller counts that in Stats.QueueFull); any other error ends
// the session. The caller holds shm.mu's read lock.
func (s *Session) put(m *memory, ev queue.Event) (full bool, err error) {
	err = s.putLocked(m, ev)
	switch {
	case err == nil:
		s.ctr.eventsSent.Add(1)
		return false, nil
	case errors.Is(err, queue.ErrFull):
		return true, nil
	}
	return false, s.failOp("send", err)
}

// putLocked puts ev on the send queue under putMu, released even if the
// access faults. The caller holds shm.mu's read lock.
func (s *Session) putLocked(m *memory, ev queue.Event) error {
	s.putMu.Lock()
	defer s.putMu.Unlock()
	return m.send.Put(ev)
}

// sendCloseLocked tells the peer that stream id is closed: an event
// {id, 0, status}, status being 1 and maybe a reason (docs/protocol.md
// section 11), or a StreamClose message when the queue is full or
// viaSocket is set (the stream's earlier data went over the socket, which
// the event could overtake); a StreamClose carries no reason. With wait
// unset, a StreamClose does not wait for the connection (sendStreamClose).
// It reports whether the close went over the socket (or could not be
// sent). Errors end the session and are not returned: a close that cannot
// be sent means the session is gone anyway. The caller holds shm.mu's read
// lock.
func (s *Session) sendCloseLocked(m *memory, id uint32, viaSocket bool, status uint32, wait bool) (onSocket bool) {
	if viaSocket {
		return s.sendStreamClose(id, wait)
	}
	full, err := s.put(m, queue.Event{StreamID: id, Status: status})
	if err != nil {
		return true
	}
	if !full {
		if m.send.MarkWorking() {
			s.wake()
		}
		return false
	}
	s.ctr.queueFull.Add(1)
	return s.sendStreamClose(id, wait)
}

// sendStreamClose sends the close of stream id as a StreamClose message,
// and reports true. A Polling goes first: the peer may handle StreamClose
// without harvesting its receive queue (the Rust crate does), and events
// of this stream may still be in it.
//
// With wait set it waits for the connection, as the receive loop's
// refusals do: a peer that floods us with streams and stops reading is
// held back by it. Without, as a stream's Close, it does not: another
// writer may hold the connection for as long as WriteTimeout if the peer
// stopped reading it, and a socket's close does not wait either. The
// close is then owed (owedClose) and goes out in its turn, after the
// stream's data (the last of which a flusher holding the connection may
// still be writing); the id is not reused (Session.reuseID), so nothing
// can overtake it.
func (s *Session) sendStreamClose(id uint32, wait bool) bool {
	var msg [24]byte
	b := append(msg[:0], s.ctl.pollMsg...)
	b = wire.AppendStreamClose(b, s.version, id)
	if wait {
		s.ctr.wakeupsSent.Add(1)
		s.writeCtl(b) // an error ends the session
		return true
	}
	select {
	case s.ctl.sem <- struct{}{}:
		s.ctr.wakeupsSent.Add(1)
		if s.writeNow(b) { // an error ends the session
			s.releaseCtl()
		}
	default:
		s.owedClose(id)
	}
	return true
}

// owedClose leaves the StreamClose of stream id to the closer goroutine,
// starting it if it does not run: one goroutine, and 4 bytes per close
// owed, however many streams close while the connection is held.
func (s *Session) owedClose(id uint32) {
	c := s.ctl
	c.closesMu.Lock()
	defer c.closesMu.Unlock()
	c.closes = append(c.closes, id)
	if !c.closing {
		c.closing = true
		c.startOwed()
		go s.writeOwedCloses()
	}
}

// writeOwedCloses is the closer goroutine: it writes the StreamCloses
// owed, behind one Polling, each time it gets the connection, until none
// is owed. Session.Close waits for it; once the session has ended, the
// closes owed are dropped.
func (s *Session) writeOwedCloses() {
	c := s.ctl
	defer c.endOwed()
	var ids []uint32
	var msg []byte
	for {
		c.closesMu.Lock()
		ids, c.closes = c.closes, ids[:0]
		if len(ids) == 0 {
			c.closing = false
			c.closesMu.Unlock()
			return
		}
		c.closesMu.Unlock()
		msg = append(msg[:0], c.pollMsg...)
		for _, id := range ids {
			msg = wire.AppendStreamClose(msg, s.version, id)
		}
		s.ctr.wakeupsSent.Add(1)
		s.writeCtl(msg) // an error ends the session: the next ones fail at once
	}
}

// writeFallback sends data for st as one FallbackData message
// (docs/protocol.md section 1.2), after a Polling if poll is set. It waits
// for the connection, and writes, until st is closed (ErrStreamClosed) or
// cancel is closed (errDeadline); when that comes in the middle of the
// message, the rest goes out after it returns nil (Session.sendCtl). A
// stream sets poll on its first FallbackData after events: a peer may
// handle FallbackData without harvesting its receive queue first (the Rust
// crate does), so the Polling makes it harvest the stream's earlier events
// before it reads these bytes.
func (s *Session) writeFallback(st *Stream, data []byte, poll bool, cancel <-chan struct{}) error {
	var hdr [24]byte
	b := hdr[:0]
	if poll {
		b = append(b, s.ctl.pollMsg...)
	}
	b = wire.AppendFallbackHeader(b, s.version, st.id, stateOpen, len(data))
	if err := s.sendCtl(net.Buffers{b, data}, st, cancel); err != nil {
		return err
	}
	if poll {
		s.ctr.wakeupsSent.Add(1)
	}
	s.ctr.fallbackWrites.Add(1)
	s.ctr.bytesSent.Add(uint64(len(data)))
	return nil
}

// unreserveLocked gives back the last k bytes of the last reservation,
// left unfilled. The caller holds wmu and reserved nothing after it.
func (st *Stream) unreserveLocked(k int) {
	switch {
	case k <= 0:
	case len(st.pending) > 0: // the reservation went to the heap
		st.pending = st.pending[:len(st.pending)-k]
	default:
		st.w.Unreserve(k)
		if st.w.Len() == 0 { // nothing left: free the slice, or it leaks
			st.s.withMem(func(*memory) error { return st.w.Abort() })
			st.w = buffer.ChainWriter{}
		}
	}
}

// readSrc is r.Read(b) for ReadFrom (see outside). It returns k < 0 if
// the stream was closed meanwhile: the caller then ends the close. If it
// was closed before, it reads nothing and returns ErrStreamClosed.
func (st *Stream) readSrc(r io.Reader, b []byte) (k int, err error) {
	var rerr error
	closed, err := st.outside(func() { k, rerr = r.Read(b) })
	switch {
	case closed:
		return -1, nil
	case err != nil:
		return 0, err
	}
	return k, rerr
}

// outside runs f, a call into ReadFrom's source that may block for as
// long as the source has nothing to say, with srcRead set meanwhile so
// that a Close does not wait for it. The caller holds wmu. It reports
// closed if the stream was closed meanwhile: the caller then ends the
// close. If it was closed before, it does not run f and returns
// ErrStreamClosed: that Close came after the caller's last check, saw no
// srcRead, and waits for wmu to end the close itself, so f could hold it
// for ever.
func (st *Stream) outside(f func()) (closed bool, err error) {
	st.mu.Lock()
	if st.state.has(stClosed) {
		st.mu.Unlock()
		return false, ErrStreamClosed
	}
	st.srcRead = true
	st.mu.Unlock()
	f()
	st.mu.Lock()
	st.srcRead = false
	closed = st.closeLeft
	st.closeLeft = false
	st.mu.Unlock()
	return closed, nil
}

// stagePool holds the heap buffers (maxEventBytes each) through which
// ReadFrom reads sources that are not sockets (until a Read fills one;
// on memory the peer can shrink, always unless the source is an *os.File),
// and WriteTo feeds writers
// that must not touch such memory (Session.inProcessSafe;
// docs/protocol.md section 13.1).
var stagePool = sync.Pool{New: func() any {
	b := make([]byte, maxEventBytes)
	return &b
}}

// srcWaiter waits until a Read of ReadFrom's source, a socket, would not
// block, so that ReadFrom takes shared memory only for bytes that are
// there: a proxy's io.Copy(stream, conn) on a connection that is idle
// between requests holds no slice.
type srcWaiter struct {
	rc   syscall.RawConn
	fn   func(fd uintptr) bool // made once: a wait allocates nothing
	peek [1]byte
}

// newSrcWaiter returns a srcWaiter for r if r is a *net.TCPConn or a
// *net.UnixConn, or the wrapper of a *net.TCPConn through which
// io.Copy(stream, conn) calls ReadFrom (TCPConn.WriteTo hands its copy
// to io.Copy with its WriteTo hidden), else nil. Only those types: a
// type of another package that wraps one may hold bytes of its own (a
// bufio.Reader's) that the socket does not show, and then a wait for the
// socket could last for ever.
func newSrcWaiter(r io.Reader) *srcWaiter {
	var sc syscall.Conn
	switch c := r.(type) {
	case *net.TCPConn:
		sc = c
	case *net.UnixConn:
		sc = c
	default:
		t := reflect.TypeOf(r)
		if t.PkgPath() != "net" || t.Name() != "tcpConnWithoutWriteTo" {
			return nil
		}
		tc, ok := reflect.ValueOf(r).FieldByName("TCPConn").Interface().(*net.TCPConn)
		if !ok || tc == nil {
			return nil
		}
		sc = tc
	}
	rc, err := sc.SyscallConn()
	if err != nil {
		return nil
	}
	w := &srcWaiter{rc: rc}
	w.fn = func(fd uintptr) bool {
		for {
			switch _, errno := peekDontWait(fd, w.peek[:]); errno {
			case unix.EINTR:
				continue
			case unix.EAGAIN:
				return false // the network poller waits for the socket
			}
			return true // bytes, the end, or an error, which Read returns
		}
	}
	return w
}

// wait returns once a Read of the socket would not block: it has bytes,
// its end or an error to report, its read deadline passed, or it was
// closed. The Read that follows reports those.
func (w *srcWaiter) wait() { _ = w.rc.Read(w.fn) }

// ReadFrom reads from r until io.EOF or an error and sends what it reads,
// each read as it comes: io.Copy(stream, r) uses it. r reads straight into
// slices of shared memory, one copy less than Write from a buffer: up to
// 64 KiB, or the largest slice size if less, per Read. It returns the
// bytes sent, and nil at r's io.EOF, r's other errors, or Write's. It
// holds the stream's write side meanwhile, as a TCPConn's ReadFrom does:
// other writes wait, and the write deadline applies while it waits for
// shared memory, not while r.Read blocks.
//
// A source that says nothing holds no shared memory (a proxy's idle
// connections). When r is a *net.TCPConn or a *net.UnixConn, ReadFrom
// waits for r's bytes in the network poller before it takes shared memory
// for them (r's read deadline applies). Any other r (a tls.Conn, a pipe,
// a bufio.Reader) may block in Read for as long as it likes, so ReadFrom
// reads it into a buffer of its own on the heap (64 KiB, pooled) and
// copies what came into shared memory, as Write does, until a Read fills
// that buffer: data is streaming, and r then reads straight into slices
// until a Read comes back short. Only a Read that follows a full one
// blocks holding the slice it reads into. Such an r reads into slices
// only when the peer cannot shrink the memory (a sealed memfd) or r is an
// *os.File: otherwise a peer that truncated its memory would make r's copy
// fault, so every Read goes to the heap buffer, and the copy into shared
// memory runs under the fault guard (docs/protocol.md sections 13 and
// 13.1).
//
// A Close while ReadFrom waits on r returns at once (so does the
// session's Close). ReadFrom returns ErrStreamClosed once r has something
// to say: it drops what a Read returned, and leaves a socket's bytes in
// the socket. The session keeps its memory mapped until then.
func (st *Stream) ReadFrom(r io.Reader) (int64, error) {
	st.wmu.Lock()
	defer st.wmu.Unlock()
	if err := st.flushLocked(); err != nil {
		return 0, err
	}
	size := min(maxEventBytes, max(st.s.MaxSliceSize(), 1))
	src := newSrcWaiter(r)
	// r may read straight into shared memory: it cannot fault (fault.go).
	inPlace := st.s.inProcessSafe(r)
	full := false     // the last Read filled its room: more is likely there
	var stage *[]byte // the heap buffer for sources that are not sockets
	defer func() {
		if stage != nil {
			stagePool.Put(stage)
		}
	}()
	var n int64
	for {
		if src != nil && !full {
			closed, err := st.outside(src.wait)
			if closed {
				st.forgetClosedLive() // nothing was reserved
				return n, ErrStreamClosed
			}
			if err != nil {
				return n, err
			}
		}
		var k int
		var rerr, err error
		if src == nil && (!full || !inPlace) {
			// r may have nothing to say for a long time: read it into
			// the heap, not into a slice that it would hold meanwhile.
			// So always if its copy into memory the peer may truncate
			// would fault in this process.
			if stage == nil {
				stage = stagePool.Get().(*[]byte)
			}
			k, rerr, err = st.copyFromSrc(r, (*stage)[:size])
		} else {
			k, rerr, err = st.readSrcInPlace(r, size)
		}
		n += int64(k)
		if err != nil {
			return n, err
		}
		full = k == size
		if rerr == io.EOF {
			return n, nil
		}
		if rerr != nil {
			return n, rerr
		}
	}
}

// copyFromSrc is one step of ReadFrom for a source that is not a socket:
// one r.Read into b, a buffer on the heap, and what it returned sent as
// Write sends it. It returns the bytes sent, r's error, and the error
// that ends ReadFrom: Write's, or ErrStreamClosed if the stream was
// closed during the Read (whose bytes it drops). The caller holds wmu.
func (st *Stream) copyFromSrc(r io.Reader, b []byte) (k int, rerr, err error) {
	k, rerr = st.readSrc(r, b)
	if k < 0 { // closed meanwhile
		st.forgetClosedLive() // nothing was reserved
		return 0, nil, ErrStreamClosed
	}
	k, err = st.writeAllLocked(b[:k])
	return k, rerr, err
}

// readSrcInPlace is one step of ReadFrom that reads r straight into
// shared memory: it reserves size bytes, runs one r.Read into them, and
// sends what it returned. It returns the bytes sent, r's error, and the
// error that ends ReadFrom: Reserve's or Flush's, or ErrStreamClosed if
// the stream was closed during the Read (whose bytes it drops). The
// caller holds wmu.
func (st *Stream) readSrcInPlace(r io.Reader, size int) (k int, rerr, err error) {
	b, err := st.reserveLocked(size)
	if err != nil {
		return 0, nil, err
	}
	k, rerr = st.readSrc(r, b)
	if k < 0 { // closed meanwhile
		st.abortLocked()
		st.forgetClosedLive()
		return 0, nil, ErrStreamClosed
	}
	st.unreserveLocked(size - k)
	if k > 0 {
		if err := st.flushLocked(); err != nil {
			return 0, nil, err
		}
	}
	return k, rerr, nil
}
