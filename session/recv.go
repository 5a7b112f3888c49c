package session

import (
	"errors"
	"fmt"
	"io"
	"os"
	"runtime"
	"sync"
	"sync/atomic"
	"time"

	"github.com/shmlink/shmlink/buffer"
	"github.com/shmlink/shmlink/internal/wire"
	"github.com/shmlink/shmlink/queue"
	"golang.org/x/sys/unix"
)

// The receive direction, top to bottom: the receive loop reads control
// messages; a Polling makes it harvest the receive queue, dispatching each
// event to its stream (pushChain); a stream's reader consumes what was
// pushed. A reader with nothing to read spins on the queue itself for a
// while (Stream.spin) before it sleeps, and may lease the working flag
// when it returns (docs/protocol.md section 12).

// receiver is a session's receive side.
type receiver struct {
	// mu is held by whoever harvests the receive queue and dispatches what
	// it popped: the receive loop after a Polling, a spinning reader, or a
	// goroutine settling the working flag. The queue has one consumer at a
	// time, and events reach their streams in queue order.
	mu sync.Mutex
	// spinning is set while a reader spins on the receive queue holding
	// its working flag at 1 (at most one reader per session does).
	spinning atomic.Bool
	// The working-flag lease: waiters counts the goroutines blocked for
	// the session's events; leaseSeq counts the spins that ended with a
	// lease, tickSeq is its value at the last leaseTick, and leased is set
	// from such a spin until leaseTick ends the lease.
	waiters  atomic.Int32
	leaseSeq atomic.Uint64
	tickSeq  atomic.Uint64
	leased   atomic.Bool
	done     chan struct{} // closed when recvLoop has returned
	in       ctlIn         // the control connection's read side
}

func (rx *receiver) init(s *Session) {
	rx.done = make(chan struct{})
	rx.in.init(s)
	s.tk.init(s, rx.in.handBackAfter)
}

// Stream states carried in the low byte of an event's or a FallbackData's
// status (docs/protocol.md section 4).
const (
	stateOpen   = 0
	stateClosed = 1
)

// fallbackPiece is the most bytes of a FallbackData that recvFallback
// reads and delivers at once.
const fallbackPiece = 64 << 10

// recvFallback reads the n-byte payload of a FallbackData (stream id,
// status, data; docs/protocol.md section 1.2) from r and delivers the data
// to its stream in pieces of at most fallbackPiece bytes as they arrive,
// the status's close with the last one. So the memory it takes is bounded
// by the stream's heap limits (Stream.pushBytes), not by the length of the
// message, which a shmipc-go peer does not bound (section 8). It returns
// the error of reading r, or of delivering.
func (s *Session) recvFallback(r io.Reader, n int) (readErr, err error) {
	var head [8]byte // wire.ParseHeader has checked that n holds it
	if _, err := io.ReadFull(r, head[:]); err != nil {
		return err, nil
	}
	id, status, _, err := wire.ParseFallback(head[:])
	if err != nil {
		return nil, err
	}
	if status&0xff > stateClosed {
		return nil, fmt.Errorf("%w: stream %d: status %#x", ErrProtocol, id, status)
	}
	s.ctr.fallbackRead.Add(1)
	left := n - len(head)
	for first := true; first || left > 0; first = false {
		k := min(left, fallbackPiece)
		var data []byte // the stream's from here: a buffer of its own
		if k > 0 {
			data = make([]byte, k)
			if _, err := io.ReadFull(r, data); err != nil {
				return err, nil
			}
		}
		left -= k
		s.ctr.bytesReceived.Add(uint64(k))
		st := status&^0xff | stateOpen // the close comes with the last piece
		if left == 0 {
			st = status
		}
		if err := s.deliverFallback(queue.Event{StreamID: id, Status: st}, data); err != nil {
			return nil, err
		}
	}
	return nil, nil
}

// deliverFallback dispatches a piece of FallbackData. While its stream, or
// the session, holds too many unread bytes on the heap (Stream.pushBytes),
// it waits for readers to take some, and so stops reading the control
// connection: the peer's writes wait, as on a socket whose reader is slow
// (docs/protocol.md section 13). Meanwhile it harvests the receive queue
// every millisecond, so that other streams' data in shared memory still
// arrives. It fails with the limit's error once no reader has taken a byte
// for Config.QueueFullTimeout, or if the session ends.
func (s *Session) deliverFallback(ev queue.Event, data []byte) error {
	m := &s.shm
	var (
		tick  *time.Ticker
		limit *time.Timer
	)
	defer func() {
		if tick != nil {
			m.heapWaiting.Store(false)
			tick.Stop()
			limit.Stop()
		}
	}()
	for {
		err := s.dispatch(ev, data)
		var full *heapFullError
		if !errors.As(err, &full) {
			return err
		}
		if tick == nil {
			// Set before the next try, so that a read after its check
			// still signals heapTaken.
			m.heapWaiting.Store(true)
			tick = time.NewTicker(time.Millisecond)
			limit = time.NewTimer(s.cfg.QueueFullTimeout)
			continue
		}
		select {
		case <-m.heapTaken:
			limit.Reset(s.cfg.QueueFullTimeout)
		case <-tick.C:
		case <-limit.C:
			return fmt.Errorf("%w, and its readers read nothing for %v (Config.QueueFullTimeout)", full, s.cfg.QueueFullTimeout)
		case <-s.dead:
			return ErrSessionClosed
		}
	}
}

// heapFullError is Stream.pushBytes's refusal: the stream, or the session,
// holds more unread bytes on the heap than its limits allow.
type heapFullError struct {
	id                    uint32
	stream, session       int64
	streamMax, sessionMax int
}

func (e *heapFullError) Error() string {
	return fmt.Sprintf("stream %d: %d unread bytes on the heap (session: %d) past the limit of %d per stream and %d per session (Config.StreamHeapLimit, MaxMessageSize)",
		e.id, e.stream, e.session, e.streamMax, e.sessionMax)
}

// readFailed ends the session for a failed read: with the error of the
// write that found the peer's end closed if the read stopped at the
// deadline that set (writeFailed), else with err.
func (s *Session) readFailed(err error) {
	if b := s.ctl.broken.Load(); b != nil && errors.Is(err, os.ErrDeadlineExceeded) {
		s.fail(b)
		return
	}
	s.failOp("read", err)
}

// handle acts on one control message after the handshake.
func (s *Session) handle(h wire.Header, payload []byte) error {
	switch h.Type {
	case wire.TypePolling:
		// Counted once handled, so that a count equal to the peer's
		// WakeupsSent means no wakeup is still on its way to a harvest.
		err := s.harvest()
		s.ctr.wakeupsReceived.Add(1)
		return err
	case wire.TypeStreamClose:
		id, err := wire.ParseStreamClose(payload)
		if err != nil {
			return err
		}
		return s.dispatch(queue.Event{StreamID: id, Status: stateClosed}, nil)
	case wire.TypeHotRestart:
		return s.handleHotRestart(payload)
	case wire.TypeHotRestartAck:
		return s.handleHotRestartAck(payload)
	}
	return fmt.Errorf("%w: %v after the handshake", ErrProtocol, h.Type)
}

// harvest pops every event of the receive queue and dispatches it, then
// settles the working flag (see harvestLocked). It lets go of the queue
// after every maxHarvest events and returns ErrSessionClosed if the
// session ended meanwhile, so that a peer that keeps putting events cannot
// keep it busy past the session's end.
func (s *Session) harvest() error {
	for {
		more, err := s.harvestBatch()
		if err != nil || !more {
			return err
		}
		if isClosedChan(s.dead) {
			return ErrSessionClosed
		}
		runtime.Gosched() // let readers and Close have the queue between batches
	}
}

// harvestBatch is one round of harvest: it pops at most maxHarvest events
// and dispatches them, and settles the working flag once the queue is
// empty; more reports that it stopped at that bound.
func (s *Session) harvestBatch() (more bool, err error) {
	s.rx.mu.Lock()
	err = s.withMem(func(m *memory) (err error) {
		more, err = s.harvestLocked(m, true)
		return err
	})
	s.rx.mu.Unlock()
	return more, err
}

// maxHarvest is the most events one call of harvestLocked pops.
const maxHarvest = 1024

// harvestLocked pops the events of the receive queue, at most maxHarvest,
// and dispatches them; more reports that it stopped at that bound. With
// settle set, once the queue is empty it clears the working flag and
// checks the queue again, harvesting anew if an event came meanwhile, so
// that no event is stranded without a wakeup (docs/protocol.md section
// 3.3); but while a reader spins on the queue the flag stays at 1, and that
// reader settles it when it stops. The caller holds rx.mu and shm.mu's
// read lock.
func (s *Session) harvestLocked(m *memory, settle bool) (more bool, err error) {
	for n := 0; ; {
		for ; n < maxHarvest; n++ {
			ev, ok, err := m.recv.Pop()
			if err != nil {
				return false, err
			}
			if !ok {
				break
			}
			s.ctr.eventsReceived.Add(1)
			if err := s.dispatchLocked(m, ev, nil); err != nil {
				return false, err
			}
		}
		if n > 0 {
			// The peer's reader frees what it read before it answers.
			s.shm.noteFreed()
		}
		if n == maxHarvest {
			return true, nil
		}
		if !settle || s.rx.spinning.Load() {
			return false, nil
		}
		m.recv.ClearWorking()
		if m.recv.Empty() {
			return false, nil
		}
		m.recv.SetWorking()
	}
}

// dispatch delivers a StreamClose or a FallbackData (data non-nil) to its
// stream, after the events put before it were sent: it harvests first.
func (s *Session) dispatch(ev queue.Event, data []byte) error {
	if err := s.harvest(); err != nil {
		return err
	}
	s.rx.mu.Lock()
	defer s.rx.mu.Unlock()
	return s.withMem(func(m *memory) error { return s.dispatchLocked(m, ev, data) })
}

// dispatchLocked delivers one event, or a FallbackData's data, to its
// stream; an open event for an unknown id opens a stream on a server. The
// caller holds rx.mu and shm.mu's read lock.
func (s *Session) dispatchLocked(m *memory, ev queue.Event, data []byte) error {
	state := ev.Status & 0xff
	if state > stateClosed {
		return fmt.Errorf("%w: stream %d: status %#x", ErrProtocol, ev.StreamID, ev.Status)
	}
	st, err := s.route(m, ev)
	if st == nil || err != nil {
		return err
	}
	if ev.Offset != 0 {
		err = st.pushChain(m.region, ev.Offset)
	} else if len(data) > 0 {
		err = st.pushBytes(data)
	}
	if state == stateClosed && err == nil {
		st.remoteClose(s.isClient && ev.Status>>reasonShift&0xff == reasonRefused)
	}
	return err
}

// route returns the stream ev goes to, opening one on a server. It returns
// nil when ev was dealt with here: its slices recycled for an unknown or
// refused id, or a new stream refused because the accept backlog or
// Config.MaxStreams is full, or the session closes when idle. The caller
// holds rx.mu and shm.mu's read lock.
func (s *Session) route(m *memory, ev queue.Event) (*Stream, error) {
	id, closing := ev.StreamID, ev.Status&0xff == stateClosed
	s.mu.Lock()
	t := &s.tab
	if st := t.routed[id]; st != nil {
		s.mu.Unlock()
		return st, nil
	}
	if _, ok := t.refused[id]; ok {
		if closing {
			delete(t.refused, id) // the client's close: the id may open anew
		}
		s.mu.Unlock()
		return nil, freeChain(m, ev.Offset)
	}
	if s.isClient || closing || id == 0 || s.err != nil {
		if _, ok := t.awaiting[id]; ok && closing {
			// The peer answered the close of a stream we forgot.
			delete(t.awaiting, id)
			if s.err == nil {
				t.freeIDs = append(t.freeIDs, id)
			}
		}
		s.mu.Unlock()
		return nil, freeChain(m, ev.Offset) // data for a stream we do not know
	}
	if len(t.accepts) < s.cfg.AcceptBacklog && len(t.routed) < s.cfg.MaxStreams && !s.idle.closeWhenIdle {
		st := newStream(s, id)
		s.addLocked(st)
		t.accepts = append(t.accepts, st)
		s.mu.Unlock()
		select {
		case t.acceptCh <- struct{}{}:
		default:
		}
		return st, nil
	}
	// Refused: closed at once. Until the client's close the id stays
	// refused, so that the client's events still in flight are recycled
	// instead of opening it again.
	boundedAdd(&t.refused, id)
	backlog, streams := len(t.accepts), len(t.routed)
	s.mu.Unlock()
	s.ctr.streamsRefused.Add(1)
	if s.warnRefused.allow() {
		s.cfg.Logger.Warn("shmlink: refusing streams: accept backlog or MaxStreams full, or closing when idle",
			"remote", s.conn.RemoteAddr(), "stream", id, "backlog", backlog, "streams", streams,
			"refused_total", s.ctr.streamsRefused.Load())
	}
	s.sendCloseLocked(m, id, false, s.refusalStatus(), true)
	return nil, freeChain(m, ev.Offset)
}

// refusalStatus is the status of the close of a stream the server
// refuses: 1, with the reason for a client that reads it (section 11).
func (s *Session) refusalStatus() uint32 {
	if s.closeReasons {
		return stateClosed | reasonRefused<<reasonShift
	}
	return stateClosed
}

// boundedAdd adds id to the set *ids, made on first use, which holds at
// most maxAwaiting ids: when full, an arbitrary one is dropped first.
func boundedAdd(ids *map[uint32]struct{}, id uint32) {
	if *ids == nil {
		*ids = make(map[uint32]struct{})
	}
	if len(*ids) >= maxAwaiting {
		for old := range *ids {
			delete(*ids, old)
			break
		}
	}
	(*ids)[id] = struct{}{}
}

// rateLimit lets an event through at most once a second: for warnings a
// peer could otherwise trigger in a flood.
type rateLimit struct{ last atomic.Int64 }

// allow reports whether the event may be logged now.
func (r *rateLimit) allow() bool {
	now, last := time.Now().UnixNano(), r.last.Load()
	return now-last >= int64(time.Second) && r.last.CompareAndSwap(last, now)
}

// freeChain recycles the chain at off, if any.
func freeChain(m *memory, off uint32) error {
	if off == 0 {
		return nil
	}
	_, err := m.region.FreeChain(off)
	return err
}

// ---- a stream's receive buffer ----

// recvBuf is a stream's receive buffer, guarded by Stream.mu.
type recvBuf struct {
	recv     []chunk // FIFO from rhead
	rhead    int
	buffered int       // unread bytes in recv
	shm      int       // capacity of the slices that recv's unread bytes occupy
	heap     int       // unread bytes in recv held on the heap, with heapChunkCost per chunk there
	slices   int       // the peer's slices held: one per chunk in shared memory, and held's
	held     []uint32  // consumed slices with a zero-copy view out
	heldBufs []*[]byte // consumed spill buffers with a zero-copy view out
}

// chunk is one received message waiting to be read: the unread part of a
// slice chain in shared memory (off != 0), or bytes that came as
// FallbackData or were copied out of shared memory (off == 0).
type chunk struct {
	off     uint32 // current slice, absolute offset; 0 for bytes on the heap
	data    []byte // unread bytes of the current slice, or the heap bytes
	next    uint32 // next slice of the chain, if hasNext
	hasNext bool
	pinned  bool    // a zero-copy view into the current slice (or buf) was handed out
	remain  int     // unread bytes of the whole message, data included
	links   int     // slices of the chain visited so far (cycle guard)
	charge  int     // capacity of the chain's slices, counted in recvBuf.shm
	buf     *[]byte // pooled buffer behind heap bytes copied out of shared memory (spillbuf.go)
}

// readRest copies into p the bytes of c's message that follow its current
// slice; p must not be longer than they are. An error means the chain
// changed since pushChain checked it.
func (c *chunk) readRest(region *buffer.Region, p []byte) error {
	if len(p) == 0 {
		return nil
	}
	if !c.hasNext {
		return buffer.ErrCorrupt
	}
	var cr buffer.ChainReader
	if err := cr.Reset(region, c.next); err != nil {
		return err
	}
	return readFull(&cr, p)
}

// readFull fills p from the chain cr reads (io.ReadFull without the
// interface, which would move cr to the heap).
func readFull(cr *buffer.ChainReader, p []byte) error {
	for n := 0; n < len(p); {
		k, err := cr.Read(p[n:])
		n += k
		switch {
		case err == io.EOF && n < len(p):
			return io.ErrUnexpectedEOF
		case err != nil && err != io.EOF:
			return err
		}
	}
	return nil
}

// pushChain queues the message whose slice chain starts at off. The chain is
// walked and checked first: a bad offset, a cycle or a size beyond a
// slice's cap ends the session instead of reaching the reader. The caller
// holds shm.mu's read lock.
func (st *Stream) pushChain(region *buffer.Region, off uint32) error {
	s := st.s
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
	defer st.mu.Unlock()
	if st.state.has(stClosed) || total == 0 {
		// Nothing to read: a closed stream drops its data, and an empty
		// message (the announcement of a new stream) carries none.
		_, err := region.FreeChain(off)
		return err
	}
	s.ctr.bytesReceived.Add(uint64(total))
	if st.mustCopyOut(region, charge, total) {
		// Over the stream's share of shared memory, or over the share of
		// all our unread data, while the region runs short and the reader
		// has stalled: copy the message out and free its slices now, so
		// that a stalled reader holds heap, not slices that the other
		// streams, or writers on either side, need.
		data, buf := getSpillBuf(total)
		if s.spillHook != nil {
			s.spillHook(region, off)
		}
		cr.Reset(region, off) // cannot fail: it did above
		if err := readFull(&cr, data); err != nil {
			// The peer changed the chain since the walk above (a size
			// that shrank): the pooled buffer's tail would hold bytes of
			// an earlier message, maybe another stream's.
			putSpillBuf(buf)
			return fmt.Errorf("%w: stream %d: the peer changed a message's slices while it was copied out of the region: %v",
				buffer.ErrCorrupt, st.id, err)
		}
		st.recv = append(st.recv, chunk{data: data, remain: total, buf: buf})
		st.buffered += total
		st.addHeap(total + heapChunkCost)
		s.ctr.spilled.Add(uint64(total))
		st.notifyRead()
		_, err := region.FreeChain(off)
		return err
	}
	if n := s.shm.holding.Load(); n >= int64(s.shm.maxLinks) {
		// Every slice of the region is ours already: the peer put a slice
		// that we still hold (one slice in event after event), and each
		// such message would cost memory here without bound.
		return fmt.Errorf("%w: stream %d: a message arrived while the session holds %d slices of a region of %d: the peer put a slice that is still unread",
			buffer.ErrCorrupt, st.id, n, s.shm.maxLinks)
	}
	p, next, hasNext, err := region.Payload(off)
	if err != nil {
		return err
	}
	c := chunk{off: off, data: p[:min(len(p), total)], next: next, hasNext: hasNext, remain: total, links: 1, charge: charge}
	st.recv = append(st.recv, c)
	st.buffered += total
	st.shm += charge
	s.shm.unread.Add(int64(charge))
	st.holdSlices(1)
	st.notifyRead()
	if len(c.data) == 0 {
		// The first slice is empty: move to the first one with bytes.
		return st.advanceLocked(region, &st.recv[len(st.recv)-1])
	}
	return nil
}

// mustCopyOut reports whether a message of total bytes in slices of charge
// bytes of capacity goes to the heap rather than staying in shared memory
// (docs/protocol.md section 13): it would take the stream, or all streams,
// over their share of the region, while the region runs short and the
// reader has stalled (or waits for more bytes than it has, see spillOwn),
// and the heap limits allow it (heapRoom). A reader that keeps reading
// only slows its writer down (backpressure): copying its data out would
// slow it down further. The caller holds st.mu.
func (st *Stream) mustCopyOut(region *buffer.Region, charge, total int) bool {
	m := &st.s.shm
	overShm := st.shm+charge > m.streamLimit || m.unread.Load()+int64(charge) > int64(m.sessionLimit)
	return overShm && st.heapRoom(total) &&
		region.FreeBytes() < m.pressureBytes && (st.stalled() || st.holdWait.Load())
}

// heapRoom reports whether a copy of n bytes out of the region fits under
// the heap limits: the stream's (Config.StreamHeapLimit) and the
// session's, 4 times that, which every unread byte on the heap counts
// against, with heapChunkCost per message (docs/protocol.md section 13).
// The caller holds st.mu.
func (st *Stream) heapRoom(n int) bool {
	m := &st.s.shm
	return st.heap+n <= m.heapLimit && m.heapUnread.Load()+int64(n+heapChunkCost) <= 4*int64(m.heapLimit)
}

// pushBytes queues data that came as FallbackData; the stream owns data.
// It refuses data with a *heapFullError, queueing nothing, when the stream,
// or all streams of the session, already hold more unread bytes on the
// heap than the limits allow (docs/protocol.md section 13): the peer sends
// faster than the application reads.
func (st *Stream) pushBytes(data []byte) error {
	m := &st.s.shm
	st.mu.Lock()
	if st.state.has(stClosed) {
		st.mu.Unlock()
		return nil
	}
	if st.heap > m.socketLimit || m.heapUnread.Load() > 4*int64(m.socketLimit) {
		err := &heapFullError{id: st.id, stream: int64(st.heap), session: m.heapUnread.Load(),
			streamMax: m.socketLimit, sessionMax: 4 * m.socketLimit}
		st.mu.Unlock()
		return err
	}
	st.recv = append(st.recv, chunk{data: data, remain: len(data)})
	st.buffered += len(data)
	st.addHeap(len(data) + heapChunkCost)
	st.mu.Unlock()
	st.notifyRead()
	return nil
}

// heapChunkCost is what a message on the heap counts beyond its bytes
// against the heap limits (docs/protocol.md section 13): about the memory
// of its chunk (72 bytes, up to twice that while recv grows) and of its
// buffer's allocation. Without it, a peer sending FallbackData of one byte
// each held some 90 bytes of heap per byte counted.
const heapChunkCost = 256

// holdSlices counts n slices more (or fewer, if negative) that st holds of
// the peer's messages (sharedMem.holding). The caller holds st.mu.
func (st *Stream) holdSlices(n int) {
	st.slices += n
	st.s.shm.holding.Add(int64(n))
}

// addHeap counts n unread bytes more (or fewer, if negative) held on the
// heap by st and by its session: a message's bytes, and heapChunkCost for
// the message itself while it is queued. The caller holds st.mu.
func (st *Stream) addHeap(n int) {
	m := &st.s.shm
	st.heap += n
	m.heapUnread.Add(int64(n))
	if n < 0 && m.heapWaiting.Load() {
		select {
		case m.heapTaken <- struct{}{}:
		default:
		}
	}
}

// remoteClose records the peer's close: reads end with io.EOF once the data
// already queued is read, or at once with ErrStreamRefused if refused (the
// close's reason, on a client). If our close was started too, the stream
// is unrouted now: the peer may reuse its id as soon as it sees our close.
// Only the receive loop, or a reader harvesting for it, calls it.
func (st *Stream) remoteClose(refused bool) {
	st.mu.Lock()
	if refused {
		st.transition(evRefused, false)
	}
	act, ok := st.transition(evRemoteClose, false)
	st.mu.Unlock()
	if ok {
		st.notifyRead()
		st.apply(act, true) // the caller holds shm.mu
	}
}

// dropUnread drops every unread message of a closed stream, recycling its
// slices, and those behind zero-copy results.
func (st *Stream) dropUnread() {
	s := st.s
	s.shm.mu.RLock()
	defer s.shm.mu.RUnlock()
	st.mu.Lock()
	defer st.mu.Unlock()
	if m := s.shm.mem; m != nil {
		// Errors mean the peer corrupted its own chains, or truncated its
		// memory; there is nothing left to read from them, so they are
		// ignored here.
		guard(func() error {
			for i := st.rhead; i < len(st.recv); i++ {
				c := st.recv[i]
				st.recycleBuf(c)
				if c.off != 0 {
					if c.pinned {
						st.held = append(st.held, c.off)
						st.holdSlices(1)
					} else {
						m.region.Free(c.off)
					}
					if c.hasNext {
						m.region.FreeChain(c.next)
					}
				}
			}
			st.releaseHeldLocked(m.region)
			return nil
		})
	}
	s.shm.unread.Add(-int64(st.shm))
	s.shm.heapUnread.Add(-int64(st.heap))
	s.shm.holding.Add(-int64(st.slices))
	st.recvBuf = recvBuf{}
	s.shm.noteFreed()
}

// ---- read calls ----

// startRead and endRead bracket every read call: they serialize readers
// and record when the call ended (see stalled).
func (st *Stream) startRead() {
	st.rmu.Lock()
	st.inRead.Store(true)
}

// endRead records the end of a read call and lets the next one in.
// Reading the clock would cost a busy reader more than a small read
// itself, so the time is recorded only after a read that waited, and
// after every stampEvery-th read: one that finds its data buffered each
// time stamps at least every stampEvery reads.
func (st *Stream) endRead() {
	st.reads++
	if st.waited || st.reads%stampEvery == 0 {
		end := st.waitEnd // the wait's end (endWait): a copy ago at most
		if end == 0 {
			end = monoNow()
		}
		st.lastRead.Store(int64(end))
		st.waited, st.waitEnd = false, 0
	}
	st.inRead.Store(false)
	st.rmu.Unlock()
}

// stampEvery is how many read calls may end between two stamps of
// lastRead.
const stampEvery = 8

// stallTime is how long a stream's reader must have been out of every
// read call before its data may be copied out of shared memory (see
// mustCopyOut).
const stallTime = time.Millisecond

// stalled reports whether the stream's reader has stayed out of every read
// call for stallTime: it does not read, for now, what it has.
func (st *Stream) stalled() bool {
	return !st.inRead.Load() && int64(monoNow())-st.lastRead.Load() > int64(stallTime)
}

// whenReadable waits until want bytes are buffered, or fewer but some once
// the stream has ended, then runs f with shm.mu read-locked and st.mu held.
// An error from f means the peer corrupted shared memory: it ends the
// session, and whenReadable returns the session's error. Without bytes it
// returns io.EOF once the peer closed, ErrStreamRefused once the server
// refused the stream, ErrStreamClosed after Close, a deadline error, or
// the session's error. The caller holds rmu.
func (st *Stream) whenReadable(want int, f func(region *buffer.Region) error) error {
	s := st.s
	for {
		ran, state, buffered, ended, err := st.tryRead(want, f)
		if ran {
			if err != nil {
				return s.failOp("read", err)
			}
			return nil
		}
		switch {
		case state.has(stClosed):
			return ErrStreamClosed
		case state.has(stRefused):
			return ErrStreamRefused
		case state.has(stRemoteClosed) && buffered == 0:
			return io.EOF
		case ended:
			return s.Err()
		}
		holds := buffered > 0
		if holds {
			// A Peek for more bytes than it has: the rest may need the
			// slices that these hold, and the messages that come while
			// it waits go to the heap too while the region runs short.
			st.holdWait.Store(true)
			st.spillOwn()
		}
		err = st.waitForData(want, buffered)
		if holds {
			st.holdWait.Store(false)
		}
		if err != nil {
			return err
		}
	}
}

// spillOwn copies st's unread messages out of shared memory, within
// Config.StreamHeapLimit, while the region runs short, for a reader that
// waits for more bytes than it has (a Peek or ReadBytes): it cannot take
// them until the rest arrives, and the rest may need their slices. Its
// writer's process cannot see that it waits, and another stalled reader's
// messages are copied out only while it is out of every read call. The
// caller holds rmu.
func (st *Stream) spillOwn() {
	s := st.s
	s.withMem(func(m *memory) error {
		if m.region.FreeBytes() < s.shm.pressureBytes {
			st.spill(m.region)
		}
		return nil
	})
}

// closed reports whether Close was called on st.
func (st *Stream) closed() bool {
	st.mu.Lock()
	defer st.mu.Unlock()
	return st.state.has(stClosed)
}

// tryRead runs f, under the fault guard, if want bytes are buffered, or
// fewer but some once the stream ended; ran says whether it did. It
// returns what it saw of the stream otherwise.
func (st *Stream) tryRead(want int, f func(region *buffer.Region) error) (ran bool, state streamState, buffered int, ended bool, err error) {
	s := st.s
	s.shm.mu.RLock()
	defer s.shm.mu.RUnlock()
	st.mu.Lock()
	defer st.mu.Unlock()
	m := s.shm.mem
	state, buffered = st.state, st.buffered
	ended = state.has(stRemoteClosed) || m == nil || isClosedChan(s.dead)
	if state.has(stClosed) || m == nil || (buffered < want && (!ended || buffered == 0)) {
		return false, state, buffered, ended, nil
	}
	return true, state, buffered, ended, guard(func() error { return f(m.region) })
}

// waitForData waits until something may have changed for a reader waiting
// for want bytes, which found have bytes buffered: it spins on the receive
// queue first; then, if its waits run long (selfWake), it reads the
// control connection itself if nobody else does (pump); else it sleeps
// until the receive loop, or the reader that reads the connection,
// delivers. It returns a deadline error once the read deadline has
// passed. The caller holds rmu.
func (st *Stream) waitForData(want, have int) error {
	s := st.s
	if s.waitHook != nil {
		s.waitHook(st)
	}
	select {
	case <-st.rdl.wait():
		return errDeadline
	default:
	}
	st.waited = true
	start := monoNow()
	cold := st.coldWake(start)
	budget := st.spinBudget(cold, cold && st.afterPause(start))
	if st.spin(want, budget, start) {
		st.endWait(start)
		return nil
	}
	// About to sleep until a Polling comes: end any lease of the working
	// flag, so that the peer sends one.
	s.ctr.parks.Add(1)
	s.rx.waiters.Add(1)
	defer s.rx.waiters.Add(-1)
	s.settle()
	s.unlease()
	s.releaseWarm()
	var freed chan struct{} // nil: this wait leaves the connection to others
	if st.selfWake(budget) {
		freed = s.rx.in.freed
	} else {
		s.rx.in.needReader()
	}
	asked := false // this reader asked the receive loop to let go
	for {
		if freed != nil {
			ok, ask := st.pump(want, have)
			if ok {
				s.ctr.selfWakes.Add(1)
				st.endWait(start)
				return nil
			}
			asked = asked || ask
		}
		// The close of closedCh, dead or the read deadline's channel
		// signals readCh too (newStream, transition, fail): one channel to
		// sleep on costs less than a select of five (64 streams of 64 B:
		// selectgo and its channel locks took 16 % of the client).
		if freed == nil {
			self := st.sleepLocal()
			<-st.readCh
			if self {
				st.wokeLocal()
			}
		} else {
			select {
			case <-st.readCh:
			case <-freed:
				continue // the receive loop let go of the connection
			}
		}
		st.endWait(start)
		if asked {
			s.rx.in.withdraw()
		}
		return nil
	}
}

// selfWake reports whether a wait that polled for budget in vain reads
// the control connection itself (docs/protocol.md section 12.1): when the
// stream's waits run long, so that it does not poll (spinBudget: requests
// that come in gaps, a server between them), or polling is off; and, on a
// host whose CPUs are all busy (hostBusy), when its last busyMisses waits
// each outlasted their poll. A stream whose data usually comes within a
// poll leaves the connection to the receive loop. Measured with gRPC
// unary calls (one caller, idle cores), such streams reading it
// themselves made the polls of both processes miss 1.5 to 2 times as
// often, and calls slower: a turn there takes several goroutine
// hand-offs, and the receive loop's wakeup of the reader also wakes an
// idle CPU for them early. On a busy host, that early wakeup wakes
// nobody: the receive loop's wakeup of the reader is a second round of
// the scheduler against the other processes. The caller holds rmu.
func (st *Stream) selfWake(budget time.Duration) bool {
	if st.s.local.Load() != nil {
		return false // no Polling comes on the connection (local.go)
	}
	return budget <= 0 || st.s.pollTime() <= 0 ||
		(st.missRun >= busyMisses && hostBusy())
}

// Tuning of spinBudget.
const (
	// longWaits is how many polls (of the length spinBudget gives, base
	// or stretched) a stream's mean wait must exceed for its reader to
	// stop polling: data that comes that late never comes
	// within a poll, and a wait that slept because the peer slept too
	// (a wakeup's time, tens of µs) stays well below it.
	longWaits = 4
	// probeEvery is how often a reader whose waits run long polls anyway,
	// to notice that traffic sped up.
	probeEvery = 16
	// busyMisses is how many waits in a row must have outlasted their poll
	// (basePoll at least) for a reader on a busy host to read the control
	// connection itself (selfWake). A poll that misses now and then (a ping-pong whose
	// peer lost its CPU for a moment) keeps the receive loop reading; one
	// that always misses (requests 100 µs apart: more than a base poll,
	// less than longWaits) does not.
	busyMisses = 4
	// vainPolls is how many waits in a row must have outlasted their poll
	// for a reader on a host with an idle CPU (hostHasIdleCPU) to stop
	// polling, as for long waits: answers that take a few polls (a
	// gRPC call that builds and parses 64 KB, requests 100 µs apart) are
	// never caught by a poll, which then only burns its CPU. Its probes
	// (one wait in probeEvery) resume polling once one of them ends within
	// its poll. On a busy host the rule made things worse: there a run of
	// misses is mostly a peer that lost its CPU for a while, and a reader
	// that sleeps is woken late (gRPC unary calls with a busy loop on
	// every CPU caught a third to a half as many answers by polling, and
	// took a median 1.5 times as long). Waits after a pause keep their own
	// rule (pauseBudget).
	vainPolls = 8
	// busyVainPolls is vainPolls for a reader on a host without an idle
	// CPU: a run this long is no peer that lost its CPU for a while, but
	// answers that never come within a poll. A server whose requests came
	// 100 to 300 µs apart with a busy loop on every CPU polled in vain in
	// 4540 of 5031 waits (2 caught their data), and each poll held for
	// a base poll the CPU that its client, just woken on it, needed: the
	// client's round trip took a median 64-68 µs against uds's 30-36 µs.
	// A poll that catches its answer one time in ten ends a run this long
	// once in a thousand runs.
	busyVainPolls = 64
	// stretchFactor is how many times the mean of a stream's recent waits
	// that a poll caught its poll lasts when that exceeds a base poll
	// (stretch): answers that come about as late as they used to, with
	// room for their spread. gRPC unary calls of 64 B with 1 caller, on a
	// host where a call took about 55 µs: the client's caught waits
	// spread from 20 to 100 µs around 40.
	stretchFactor = 4
	// stretchPolls is how many base polls Config.PollTime holds: a base
	// poll (basePoll) is PollTime/stretchPolls, and no poll is longer than
	// PollTime.
	stretchPolls = 4
	// stretchWin and stretchLoss are what a stretched poll adds to its
	// stream's stretchScore when its data came after a base poll and
	// within the stretched one, or did not come within it; stretchCap
	// bounds the score either way. A stream stretches while the score is
	// not negative: while its stretched polls catch at least one answer
	// for every two they miss. gRPC unary calls with 1 caller: 64 B, the
	// polls caught 2.4 answers per miss; 64 KB (answers that take longer
	// than PollTime, between frames that come within one), 0.24, and
	// polling on cost 1.2 times a Unix socket's CPU per call.
	stretchWin  = 2
	stretchLoss = 1
	stretchCap  = 16
)

// basePoll returns how long a wait polls unless its stream stretches the
// poll (Stream.stretch), and the unit of the rules that decide whether it
// polls at all: Config.PollTime/stretchPolls (50 µs by default), at least
// 1 ns; 0 or less when polling is off (docs/protocol.md section 12.7).
func (s *Session) basePoll() time.Duration {
	p := s.pollTime()
	if p > 0 {
		return max(p/stretchPolls, 1)
	}
	return p
}

// stretched returns how long a poll for an answer lasts by what the
// stream's answers took, given the base poll base (basePoll):
// stretchFactor times the mean of the stream's recent waits that a poll
// caught (hitEWMA) when that is longer, up to Config.PollTime, unless the
// host is busy (hostBusy). A poll that ends just before the answer comes
// costs a wakeup of both processes, which on a VM whose idle CPUs halt
// costs more CPU and time than polling on; and once one reader sleeps,
// its peer's next wait starts late and misses too, so a turn that takes a
// little more than a base poll keeps both asleep (docs/protocol.md section
// 12.7). Only a host found busy (hostBusy: under 5 % idle) keeps the base
// poll, not one without an idle CPU known (hostHasIdleCPU: a quarter of
// the CPU time idle), which the two processes' polls themselves make: an
// early build conditioned on that kept a base poll in a third of the
// waits of gRPC unary calls of 64 B with 1 caller. The caller holds rmu.
func (st *Stream) stretched(base time.Duration) time.Duration {
	want := stretchFactor * st.hitEWMA
	if want <= base || hostBusy() {
		return base
	}
	return min(want, st.s.pollTime())
}

// stretch returns the budget of a wait that polls for its answer, given
// the base poll base and the stretched poll poll (stretched): poll, or
// base while the stream's stretched polls lately missed more than twice
// for each answer they caught (stretchScore < 0), except in one such wait
// of probeEvery, which stretches to notice that they pay again. The
// caller holds rmu.
func (st *Stream) stretch(base, poll time.Duration) time.Duration {
	if poll > base && st.stretchScore < 0 {
		if st.stretchSkips++; st.stretchSkips < probeEvery {
			return base
		}
		st.stretchSkips = 0
	}
	return poll
}

// coldWake reports whether a wait that begins at start (monoNow) follows a
// cold wakeup of the peer: the session sent the peer a Polling less than
// a base poll (basePoll) ago, and the stream's last read call ended more
// than a base poll before start (as endRead stamps it: after a read that
// waited, and every stampEvery reads), so the peer had been asleep a
// while. A request after
// a pause does that; a turn of a ping-pong does not, even when it costs a
// Polling. The caller holds rmu.
func (st *Stream) coldWake(start time.Duration) bool {
	s := st.s
	base := s.basePoll()
	return base > 0 && int64(start)-st.lastRead.Load() > int64(base) && s.wokePeerAt(start)
}

// afterPause reports whether a wait that begins at start (monoNow), after a
// cold wakeup of the peer (coldWake), follows a pause: the stream's last
// read call ended more than longWaits base polls before start. The peer had
// then been asleep long enough for its CPU to go idle, and its answer takes
// at least a wakeup. A turn of busy traffic does not qualify, even when the
// reader's own goroutine came back late. The caller holds rmu.
func (st *Stream) afterPause(start time.Duration) bool {
	return int64(start)-st.lastRead.Load() > int64(longWaits*st.s.basePoll())
}

// spinBudget returns how long the next wait polls before it sleeps, and
// records it as the wait's budget (recordWait): a base poll (basePoll),
// stretched when the stream's answers lately came later (stretch), unless
// polling would not pay:
//   - after a cold wakeup of the peer (cold: see coldWake) on a host whose
//     CPUs are all busy (hostBusy), it sleeps at once. The peer needs a
//     CPU to answer, and the one that the poll would hold is the one it
//     waits for (docs/protocol.md section 12.3);
//   - after a pause (paused: see afterPause), it polls for a base poll or
//     sleeps at once, whichever such waits of the stream recently found
//     quicker (pauseBudget; docs/protocol.md section 12.5);
//   - when the stream's recent waits were long (a server between requests
//     that arrive in gaps; longWaits polls), or its last vainPolls waits
//     (on a host with an idle CPU; busyVainPolls elsewhere) each outlasted
//     their poll (answers a few polls away), it sleeps at once instead of
//     burning the CPU for nothing, and polls once in probeEvery waits.
//
// The caller holds rmu.
func (st *Stream) spinBudget(cold, paused bool) time.Duration {
	st.budget = st.pickBudget(cold, paused)
	return st.budget
}

// pickBudget returns spinBudget's budget. The caller holds rmu.
func (st *Stream) pickBudget(cold, paused bool) time.Duration {
	base := st.s.basePoll()
	st.pauseWay = wayNone
	if base > 0 && cold && hostBusy() {
		return 0
	}
	if base <= 0 {
		return base
	}
	stretched := st.stretched(base)
	poll := base // the poll the stream's waits get, for longWaits
	if st.stretchScore >= 0 {
		poll = stretched
	}
	if st.waitEWMA <= longWaits*poll {
		if paused {
			return st.pauseBudget(base)
		}
		if st.missRun < vainPolls || (st.missRun < busyVainPolls && !hostHasIdleCPU()) {
			return st.stretch(base, stretched)
		}
	}
	if st.waitSkips++; st.waitSkips >= probeEvery {
		st.waitSkips = 0
		return stretched // a probe stretches: its answer updates the score too
	}
	return 0
}

// waitWay is how a wait after a pause waits (see pauseBudget).
type waitWay uint8

const (
	wayNone  waitWay = iota // not a wait after a pause
	wayPoll                 // it polls for a base poll first
	waySleep                // it sleeps at once
)

// pauseSlack is how much longer than the polling ones, at least, the waits
// that slept at once may take on average for a stream to prefer sleeping:
// sleeping leaves the CPU to others, so a tie goes to it.
const pauseSlack = 2 * time.Microsecond

// pauseBudget returns the budget of a wait after a pause: limit, or 0 to
// sleep at once, whichever the stream prefers (prefersSleep), and the other
// one in every probeEvery such waits, to keep both means current. A poll
// after a pause waits for a peer that must wake first; on a host whose
// idle CPUs poll before they halt (a VM's haltpoll), a reader that slept
// is woken as fast and the poll's CPU time is spent for nothing; elsewhere
// the poll catches the answer sooner. Measuring both tells them apart
// (docs/protocol.md section 12.5). The caller holds rmu.
func (st *Stream) pauseBudget(limit time.Duration) time.Duration {
	st.pauseWaits++
	if st.prefersSleep() != (st.pauseWaits%probeEvery == 0) {
		st.pauseWay = waySleep
		return 0
	}
	st.pauseWay = wayPoll
	return limit
}

// prefersSleep reports whether waits after a pause sleep at once: once
// both ways were tried, while those that slept took on average no more
// than pauseSlack or an eighth longer than those that polled. The caller
// holds rmu.
func (st *Stream) prefersSleep() bool {
	return st.pausePoll > 0 && st.pauseSleep > 0 &&
		st.pauseSleep <= st.pausePoll+max(st.pausePoll/8, pauseSlack)
}

// learnPause adds a wait after a pause, of length d, to the mean of its
// way (pauseWay). The caller holds rmu.
func (st *Stream) learnPause(d time.Duration) {
	mean := &st.pausePoll
	if st.pauseWay == waySleep {
		mean = &st.pauseSleep
	}
	st.pauseWay = wayNone
	addWait(mean, d)
}

// addWait adds a wait of d to the mean *mean, an EWMA of weight 1/8 that
// starts at the first wait (at least 1 ns, so that 0 means "none yet").
func addWait(mean *time.Duration, d time.Duration) {
	if *mean == 0 {
		*mean = max(d, 1)
		return
	}
	*mean += (d - *mean) / 8
}

// endWait records the end of a wait that began at start (monoNow): its
// length (recordWait), and its end, which endRead takes as the read
// call's end rather than read the clock again. The caller holds rmu.
func (st *Stream) endWait(start time.Duration) {
	now := monoNow()
	st.waitEnd = now
	st.recordWait(now - start)
}

// recordWait adds a wait of d to the stream's mean (an EWMA of weight 1/8;
// a wait counts as at most 2*longWaits base polls, so the mean comes back
// down within a dozen waits once data flows again), to its run of waits
// longer than their poll (missRun: longer than the wait's budget, and
// than a base poll), to the mean of the waits that a poll caught
// (hitEWMA: within a budget that polled), to the score of the stretched
// polls (stretchScore: a wait longer than a base poll whose poll was
// stretched; see stretch), and, for a wait after a pause, to the mean of
// its way (learnPause). The wait's budget is the one spinBudget returned
// last. The caller holds rmu.
func (st *Stream) recordWait(d time.Duration) {
	base := st.s.basePoll()
	if base <= 0 {
		return // no polling to tune
	}
	if d > max(base, st.budget) {
		st.missRun = min(st.missRun+1, busyVainPolls)
	} else {
		st.missRun = 0
	}
	if st.budget > 0 && d <= st.budget {
		addWait(&st.hitEWMA, d)
	}
	if st.budget > base && d > base {
		if d <= st.budget {
			st.stretchScore = min(st.stretchScore+stretchWin, stretchCap)
		} else {
			st.stretchScore = max(st.stretchScore-stretchLoss, -stretchCap)
		}
	}
	d = min(d, 2*longWaits*base)
	if st.pauseWay != wayNone {
		st.learnPause(d)
	}
	addWait(&st.waitEWMA, d)
}

// Read reads up to len(p) bytes; see net.Conn. After the peer's Close it
// returns the data still queued, then io.EOF. It returns ErrStreamClosed
// after Close, ErrStreamRefused on a client's stream that the server
// refused, a deadline error (Timeout() true) after the read deadline, and
// the session's error if the session ended first.
func (st *Stream) Read(p []byte) (n int, err error) {
	st.startRead()
	defer st.endRead()
	if len(p) == 0 {
		if st.closed() {
			return 0, ErrStreamClosed // as any other Read after Close
		}
		return 0, nil
	}
	err = st.whenReadable(1, func(region *buffer.Region) (err error) {
		n, err = st.consumeLocked(region, p, len(p))
		return err
	})
	if n > 0 {
		// Bytes counted before a corrupt chain are valid; the next call
		// returns the session's error.
		return n, nil
	}
	return 0, err
}

// Peek returns the next n bytes without consuming them, waiting until they
// have arrived. When they lie in one slice of shared memory, or in one
// message that the session copied out of it while the reader stalled
// (docs/protocol.md section 13), the returned slice points there (zero
// copy) and stays valid until the bytes are consumed and then released by
// ReleasePreviousRead, or until Close; otherwise it is a fresh copy owned
// by the caller. Treat every result as the former. It returns io.EOF if
// the peer closed with no bytes left, io.ErrUnexpectedEOF if it closed with
// fewer than n, one wrapping ErrBadLength if n is not positive, and the
// errors of Read otherwise. While it waits, the bytes it has are copied
// out of shared memory if the region runs short, up to
// Config.StreamHeapLimit: a larger n, in messages that fill the region,
// waits until the read deadline.
func (st *Stream) Peek(n int) ([]byte, error) {
	st.startRead()
	defer st.endRead()
	return st.peek(n)
}

func (st *Stream) peek(n int) (b []byte, err error) {
	if n <= 0 {
		return nil, fmt.Errorf("shmlink: Peek of %d bytes: %w", n, ErrBadLength)
	}
	short := false
	err = st.whenReadable(n, func(region *buffer.Region) error {
		if short = st.buffered < n; short {
			return nil
		}
		c := &st.recv[st.rhead]
		if len(c.data) >= n {
			if c.off != 0 || c.buf != nil {
				c.pinned = true
			}
			b = c.data[:n:n]
			return nil
		}
		b = make([]byte, n)
		k := 0
		for i := st.rhead; k < n; i++ {
			c := &st.recv[i]
			k += copy(b[k:], c.data)
			more := min(n-k, c.remain-len(c.data))
			if err := c.readRest(region, b[k:k+more]); err != nil {
				b = nil
				return err
			}
			k += more
		}
		return nil
	})
	if short {
		return nil, io.ErrUnexpectedEOF
	}
	return b, err
}

// ReadBytes consumes and returns the next n bytes, waiting until they have
// arrived. Like Peek, the result points into shared memory (or the
// session's copy of a message, section 13) when the bytes lie in one
// piece; those are recycled only by ReleasePreviousRead (or Close), so the
// result stays valid until then. Errors are Peek's.
func (st *Stream) ReadBytes(n int) ([]byte, error) {
	st.startRead()
	defer st.endRead()
	b, err := st.peek(n)
	if err != nil {
		return nil, err
	}
	_, err = st.discard(n)
	return b, err
}

// ReadChunk consumes and returns the next bytes that lie contiguously in
// one slice of shared memory (or in one FallbackData message, or in the
// session's copy of a message that it copied out of shared memory while the
// reader stalled, docs/protocol.md section 13): at least 1 and at most max,
// waiting until some have arrived. It never copies: the result points into
// shared memory (or the message, or the copy) and stays valid until
// ReleasePreviousRead or Close, which recycle the slices and copies behind
// every result returned since the last release. It returns io.EOF once the
// peer closed and every byte was read, one wrapping ErrBadLength if max is
// not positive, and the errors of Read otherwise.
func (st *Stream) ReadChunk(max int) (b []byte, err error) {
	st.startRead()
	defer st.endRead()
	if max <= 0 {
		return nil, fmt.Errorf("shmlink: ReadChunk of at most %d bytes: %w", max, ErrBadLength)
	}
	err = st.whenReadable(1, func(region *buffer.Region) error {
		c := &st.recv[st.rhead]
		k := min(max, len(c.data))
		b = c.data[:k:k]
		if c.off != 0 || c.buf != nil {
			c.pinned = true
		}
		_, err := st.consumeLocked(region, nil, k)
		return err
	})
	if err != nil {
		return nil, err
	}
	return b, nil
}

// WriteTo writes what arrives on the stream to w until the peer's
// io.EOF or an error: io.Copy(w, stream) uses it. Each slice of shared
// memory goes to w.Write as it is (zero copy on our side), and is
// released once w.Write returns: w must not keep the bytes. That is so
// when the peer cannot shrink the memory (a sealed memfd) or w is a socket
// or file of package net or os; otherwise, as with files or a peer's
// memfd that we could not seal, the bytes are copied to a buffer on the
// heap first (up to 64 KiB at a time), so that a peer that truncates its
// memory ends the session with an error instead of faulting in w.Write
// (docs/protocol.md sections 13 and 13.1). It returns the bytes written
// and nil at the stream's io.EOF, Read's other errors, w's error, or
// io.ErrShortWrite.
func (st *Stream) WriteTo(w io.Writer) (int64, error) {
	if !st.s.inProcessSafe(w) {
		return st.writeToStaged(w)
	}
	var n int64
	for {
		b, err := st.ReadChunk(maxEventBytes)
		if len(b) > 0 {
			k, werr := w.Write(b)
			st.ReleasePreviousRead()
			n += int64(k)
			switch {
			case werr != nil:
				return n, werr
			case k < len(b):
				return n, io.ErrShortWrite
			}
		}
		if err == io.EOF {
			return n, nil
		}
		if err != nil {
			return n, err
		}
	}
}

// writeToStaged is WriteTo through a buffer on the heap (stagePool): Read
// copies into it under the fault guard, and w.Write gets the copy.
func (st *Stream) writeToStaged(w io.Writer) (n int64, err error) {
	stage := stagePool.Get().(*[]byte)
	defer stagePool.Put(stage)
	for {
		k, rerr := st.Read(*stage)
		if k > 0 {
			wk, werr := w.Write((*stage)[:k])
			n += int64(wk)
			switch {
			case werr != nil:
				return n, werr
			case wk < k:
				return n, io.ErrShortWrite
			}
		}
		if rerr == io.EOF {
			return n, nil
		}
		if rerr != nil {
			return n, rerr
		}
	}
}

// Discard skips the next n bytes, waiting until they have arrived, and
// returns how many it skipped: fewer than n only with an error (io.EOF if
// the peer closed first, or Read's errors).
func (st *Stream) Discard(n int) (int, error) {
	st.startRead()
	defer st.endRead()
	return st.discard(n)
}

func (st *Stream) discard(n int) (done int, err error) {
	for done < n && err == nil {
		err = st.whenReadable(1, func(region *buffer.Region) error {
			k, err := st.consumeLocked(region, nil, n-done)
			done += k
			return err
		})
	}
	return done, err
}

// ReleasePreviousRead recycles the slices, and the session's copies of
// messages (docs/protocol.md section 13), behind zero-copy results of Peek,
// ReadBytes and ReadChunk whose bytes have been consumed. Those results
// must not be used afterwards.
func (st *Stream) ReleasePreviousRead() {
	s := st.s
	s.shm.mu.RLock()
	defer s.shm.mu.RUnlock()
	st.mu.Lock()
	defer st.mu.Unlock()
	if m := s.shm.mem; m == nil {
		st.dropHeldLocked()
		st.releaseBufsLocked()
	} else if err := guard(func() error { st.releaseHeldLocked(m.region); return nil }); err != nil {
		st.dropHeldLocked()
		go s.failOp("release", err)
	}
}

// releaseHeldLocked recycles the slices behind zero-copy results. The
// caller holds shm.mu's read lock and st.mu.
func (st *Stream) releaseHeldLocked(region *buffer.Region) {
	st.releaseBufsLocked()
	if len(st.held) == 0 {
		return
	}
	for _, off := range st.held {
		if err := region.Free(off); err != nil {
			go st.s.failOp("release", err)
			break
		}
	}
	st.dropHeldLocked()
	st.s.shm.noteFreed()
}

// dropHeldLocked forgets the slices behind zero-copy results. The caller
// holds st.mu.
func (st *Stream) dropHeldLocked() {
	st.holdSlices(-len(st.held))
	st.held = st.held[:0]
}

// releaseBufsLocked returns to their pools the spill buffers behind
// zero-copy results. The caller holds st.mu.
func (st *Stream) releaseBufsLocked() {
	for i, p := range st.heldBufs {
		putSpillBuf(p)
		st.heldBufs[i] = nil
	}
	st.heldBufs = st.heldBufs[:0]
}

// recycleBuf takes back the spill buffer of a chunk that is being dropped
// or was read to its end: at once, or at the next release while a
// zero-copy view of it is out. Past maxHeldBufs such buffers it leaves the
// buffer to the garbage collector, so that a reader that never releases
// (Peek, then Read) holds no more memory than it did without pools. The
// caller holds st.mu.
func (st *Stream) recycleBuf(c chunk) {
	switch {
	case c.buf == nil:
	case !c.pinned:
		putSpillBuf(c.buf)
	case len(st.heldBufs) < maxHeldBufs:
		st.heldBufs = append(st.heldBufs, c.buf)
	}
}

// maxHeldBufs bounds the spill buffers a stream keeps for
// ReleasePreviousRead: at most 512 KiB.
const maxHeldBufs = 8

// Buffered returns the number of bytes that can be read without waiting.
func (st *Stream) Buffered() int {
	st.mu.Lock()
	defer st.mu.Unlock()
	return st.buffered
}

// consumeLocked moves up to n buffered bytes into p (or drops them when p
// is nil), recycling or holding the slices it finishes. An error means the
// peer corrupted a chain; the bytes counted until then are valid. The
// caller holds shm.mu's read lock and st.mu.
func (st *Stream) consumeLocked(region *buffer.Region, p []byte, n int) (int, error) {
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
		if c.off == 0 {
			st.addHeap(-k)
		}
		done += k
		if len(c.data) == 0 {
			if err := st.advanceLocked(region, c); err != nil {
				return done, err
			}
		}
	}
	return done, nil
}

// advanceLocked finishes the current slice of c and moves to the next slice
// with bytes, or pops c at the end of its chain. c is the stream's first
// chunk, or its last one (a message pushChain just queued, whose first
// slice is empty); an error drops c. The caller holds shm.mu's read lock
// and st.mu.
func (st *Stream) advanceLocked(region *buffer.Region, c *chunk) error {
	for len(c.data) == 0 {
		if c.off != 0 {
			if c.pinned {
				st.held = append(st.held, c.off)
				st.holdSlices(1)
			} else if err := region.FreeWarm(c.off); err != nil {
				st.dropLocked(c)
				return err
			} else {
				st.s.shm.noteFreed()
			}
		}
		if !c.hasNext || c.remain <= 0 {
			var err error
			if c.hasNext || c.remain != 0 {
				err = buffer.ErrCorrupt // the chain changed since pushChain walked it
			}
			st.dropLocked(c)
			return err
		}
		if c.links >= st.s.shm.maxLinks {
			st.dropLocked(c)
			return buffer.ErrCorrupt
		}
		p, next, hasNext, err := region.Payload(c.next)
		if err != nil {
			st.dropLocked(c)
			return err
		}
		*c = chunk{off: c.next, data: p[:min(len(p), c.remain)], next: next, hasNext: hasNext,
			remain: c.remain, links: c.links + 1, charge: c.charge}
	}
	return nil
}

// dropLocked forgets chunk c, the stream's first or its last, and what it
// had left. The caller holds st.mu.
func (st *Stream) dropLocked(c *chunk) {
	if last := len(st.recv) - 1; c != &st.recv[st.rhead] && c == &st.recv[last] {
		st.forgetLocked(c)
		st.recv = st.recv[:last]
		return
	}
	st.dropHeadLocked()
}

// dropHeadLocked pops the first chunk, forgetting what it had left. The
// caller holds st.mu.
func (st *Stream) dropHeadLocked() {
	c := &st.recv[st.rhead]
	st.forgetLocked(c)
	st.rhead++
	if st.rhead == len(st.recv) {
		st.recv = st.recv[:0]
		st.rhead = 0
	}
}

// forgetLocked takes what chunk c had left out of the stream's counts and
// clears it. The caller holds st.mu.
func (st *Stream) forgetLocked(c *chunk) {
	st.recycleBuf(*c)
	st.buffered -= c.remain
	if c.off == 0 {
		st.addHeap(-c.remain - heapChunkCost)
	}
	st.shm -= c.charge
	st.s.shm.unread.Add(-int64(c.charge))
	if c.off != 0 {
		st.holdSlices(-1)
	}
	*c = chunk{}
}

// ---- spinning and the working-flag lease ----

// spinBatch is how many times Stream.spin checks the queue between its
// checks of the clock, deadlines and the session's end.
const spinBatch = 64

// spin waits for want bytes (or the stream's end) by spinning on the
// receive queue itself, dispatching what it pops to every stream, for as
// long as events keep coming and then budget more (counted from start, the
// wait's beginning on the monoNow clock, until the first event:
// spinBudget). Meanwhile it holds the queue's working flag at 1, so the
// peer sends no Polling (docs/protocol.md section 3.3): while traffic
// flows a message costs no system call and no goroutine switch on either
// side. One reader per session spins; spin returns false at once in the
// others, and when its time runs out; true when st may be readable, ended,
// closed or past its read deadline.
func (st *Stream) spin(want int, budget, start time.Duration) bool {
	s := st.s
	if budget <= 0 || !s.rx.spinning.CompareAndSwap(false, true) {
		return false
	}
	// Got what it waited for, the reader leases the working flag to its
	// next spin; otherwise it settles the flag.
	ready := false
	defer func() { s.endSpin(ready) }()
	idleSince := start
	asked := false // whether to give the CPU up to the peer (peerWaking)
	for {
		harvested, err := st.spinBatch(want)
		if err != nil {
			s.failOp("read", err)
			return true
		}
		if ready = st.readyFor(want); ready {
			s.ctr.spinHits.Add(1)
			return true
		}
		select {
		case <-s.dead:
			return true
		case <-st.closedCh:
			return true
		case <-st.rdl.wait():
			return true
		default:
		}
		now := monoNow()
		if harvested {
			idleSince = now
		} else if now-idleSince > budget {
			s.ctr.spinMisses.Add(1)
			return false
		}
		// The peer we just woke may be waiting for this CPU: the kernel
		// tends to wake a socket's reader on the writer's CPU. Asked once
		// per spin: the peer then runs until it sleeps again.
		if !asked {
			asked = true
			if s.peerWaking(now) {
				yieldCPU()
				continue
			}
		}
		// Let the process's other goroutines run; the peer runs on its own.
		runtime.Gosched()
	}
}

// wokePeerAt reports whether this session sent the peer a Polling less
// than a base poll (basePoll) before now (monoNow): the peer is waking.
func (s *Session) wokePeerAt(now time.Duration) bool {
	return now-time.Duration(s.ctl.wokeAt.Load()) < s.basePoll()
}

// peerWaking reports whether a spinning reader gives its CPU up to the
// peer, once per spin, rather than to the process's other goroutines
// (docs/protocol.md section 12.3): a Polling went out less than a base
// poll before now (monoNow), so the peer is waking, and the host has an idle
// CPU, so the CPU goes to the peer and not to another busy process.
func (s *Session) peerWaking(now time.Duration) bool {
	return s.wokePeerAt(now) && hostHasIdleCPU()
}

// yieldCPU gives the thread's CPU to another runnable thread, if any, and
// returns when the scheduler runs this one again; at once if there is
// none. A raw system call: it does not hand the goroutine's P over, and
// the wait is one scheduler turn.
func yieldCPU() {
	unix.RawSyscall(unix.SYS_SCHED_YIELD, 0, 0, 0)
}

// spinBatch checks the receive queue spinBatch times, harvesting what
// comes (st is checked after each harvest; in between the loop only reads
// the queue's tail, so that a reader waiting for its peer does not slow the
// peer down). It reports whether it harvested anything; an error means the
// queue or a chain is corrupt.
func (st *Stream) spinBatch(want int) (harvested bool, err error) {
	s := st.s
	merr := s.withMem(func(m *memory) error {
		m.recv.SetWorking()
		for range spinBatch {
			var did bool
			if did, err = s.tryHarvest(m); !did {
				continue
			}
			harvested = true
			if err != nil || st.readyFor(want) {
				break
			}
		}
		return nil
	})
	if err == nil && isFault(merr) {
		err = merr
	}
	return harvested, err
}

// tryHarvest harvests the receive queue, without settling its working
// flag, if it holds events and nobody else harvests it now; did says
// whether it did. The caller holds shm.mu's read lock.
func (s *Session) tryHarvest(m *memory) (did bool, err error) {
	if m.recv.Empty() || !s.rx.mu.TryLock() {
		return false, nil
	}
	defer s.rx.mu.Unlock()
	_, err = s.harvestLocked(m, false)
	return true, err
}

// readyFor reports whether a reader waiting for want bytes can go on.
func (st *Stream) readyFor(want int) bool {
	st.mu.Lock()
	defer st.mu.Unlock()
	return st.buffered >= want || st.state&(stRemoteClosed|stClosed) != 0
}

// The working-flag lease (docs/protocol.md section 12).
//
// A reader that spins on the receive queue holds the queue's working flag
// at 1, so the peer puts events without sending a Polling. When the reader
// has its data and returns to the application, clearing the flag at once
// would make the peer's next event cost a wakeup (a system call in each
// process and a goroutine switch here), although a reader that loops
// (io.Copy, a bufio.Reader, a request handler) is back within
// microseconds. So the flag stays at 1, leased, and events that come
// meanwhile wait in the queue for the next spin. The lease ends, and the
// flag is settled (cleared, then the queue harvested: see harvestLocked),
// when
//   - a goroutine is about to block for the session's events (a reader in
//     waitForData): it settles before it sleeps, and a spinner that stops
//     while one is blocked settles instead of leasing;
//   - no spin has run for one to two ticks of the session's timer, and
//     for at least Config.PollTime (leaseTick; tick.go).
// A new stream's announcement wakes the peer whatever the flag says (see
// announce), so a lease never delays AcceptStream.

// endSpin ends the spin of the reader holding rx.spinning. With lease set
// (the reader got what it waited for) and no goroutine blocked for the
// session's events, the working flag stays at 1 and the session's timer
// ends the lease later; otherwise the flag is settled now.
func (s *Session) endSpin(lease bool) {
	s.rx.spinning.Store(false)
	if lease {
		// A goroutine that starts to wait after this load settles by
		// itself (waitForData): the atomics order its count before its
		// settle, and our store of spinning before this load.
		if s.rx.waiters.Load() == 0 {
			s.lease()
			return
		}
	}
	s.settle()
}

// lease records a lease of the working flag, which the caller holds at 1:
// the session's timer ends it once no spin renews it (leaseTick).
func (s *Session) lease() {
	s.rx.leaseSeq.Add(1)
	if !s.rx.leased.Load() {
		s.rx.leased.Store(true)
	}
	s.tk.poke(s.tk.standby)
}

// unlease records that a goroutine about to wait for the session's events
// has settled the working flag: any lease is over, since a spin that ends
// while it waits settles instead of leasing (endSpin). It disarms the
// session's timer if nothing else is pending (relax).
func (s *Session) unlease() {
	if s.rx.leased.Load() {
		s.rx.leased.Store(false)
	}
	s.relax()
}

// settle clears the receive queue's working flag, unless a reader is
// spinning, and harvests what came meanwhile. A corrupt queue ends the
// session.
func (s *Session) settle() {
	if err := s.harvest(); err != nil && !errors.Is(err, ErrSessionClosed) {
		s.failOp("read", err)
	}
}

// ---- copying stalled readers' data out of shared memory ----

// spillStalled copies out of shared memory the unread data of every
// stream whose reader has stalled (see mustCopyOut), while the region runs
// short, so that a writer of ours waiting for space is not waiting for
// its own session's readers. It reports whether those readers still hold
// half the region's capacity or more once it is done (the heap limit
// stopped the copy): a writer waiting for space then waits for its own
// process (see withSpace).
func (s *Session) spillStalled() (stuck bool) {
	s.withMem(func(m *memory) error {
		if m.region.FreeBytes() >= s.shm.pressureBytes {
			return nil
		}
		held := 0
		for _, st := range s.liveStreams() {
			if st.stalled() {
				held += st.spill(m.region)
			}
		}
		_, total := m.region.Capacity()
		stuck = 2*held >= total
		return nil
	})
	return stuck
}

// spill replaces every unread message of st held in shared memory by a
// copy on the heap, within the heap limits (heapRoom), and frees its
// slices.
// Messages with a zero-copy view out stay. It returns the capacity of the
// slices that st's unread data still occupies, in bytes. The caller holds
// shm.mu's read lock.
func (st *Stream) spill(region *buffer.Region) (held int) {
	st.mu.Lock()
	defer st.mu.Unlock()
	for i := st.rhead; i < len(st.recv); i++ {
		c := &st.recv[i]
		if c.off == 0 || c.pinned {
			continue
		}
		if !st.heapRoom(c.remain) {
			break
		}
		data, buf := getSpillBuf(c.remain)
		k := copy(data, c.data)
		if c.readRest(region, data[k:]) != nil {
			putSpillBuf(buf)
			continue // a corrupt chain: the reader will find it
		}
		region.Free(c.off)
		if c.hasNext {
			region.FreeChain(c.next)
		}
		st.shm -= c.charge
		st.s.shm.unread.Add(-int64(c.charge))
		st.holdSlices(-1)
		st.s.ctr.spilled.Add(uint64(len(data)))
		*c = chunk{data: data, remain: len(data), buf: buf}
		st.addHeap(len(data) + heapChunkCost)
		st.s.shm.noteFreed()
	}
	return st.shm
}

// releaseWarm pushes the slices that this process keeps warm for its next
// writes (buffer.Region.FreeWarm) back onto the free lists, for a reader
// about to sleep or a session left without streams: traffic has paused,
// so an idle session keeps none, and the peer and the in-use counts see
// them free (docs/protocol.md section 2.4, "Warm slices"). A corrupt list
// or a fault in shared memory ends the session; a session whose memory is
// gone has nothing to release.
func (s *Session) releaseWarm() { s.releaseWarmHeld(false) }

// releaseWarmHeld is releaseWarm for a caller that holds shm.mu's read
// lock when memHeld is set (a second read lock could wait behind a writer
// that waits for the first).
func (s *Session) releaseWarmHeld(memHeld bool) {
	release := func(m *memory) error { return m.region.ReleaseWarm() }
	var err error
	if !memHeld {
		err = s.withMem(release)
	} else if m := s.shm.mem; m != nil {
		err = guard(func() error { return release(m) })
	}
	switch {
	case err == nil:
	case isFault(err):
		s.failOp("shared memory", err)
	case errors.Is(err, buffer.ErrCorrupt):
		s.failOp("release", err)
	}
}
