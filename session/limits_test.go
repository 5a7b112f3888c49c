package session

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/shmlink/shmlink/buffer"
	"github.com/shmlink/shmlink/internal/wire"
	"github.com/shmlink/shmlink/queue"
	"github.com/stretchr/testify/require"
)

// rawClient runs the client's handshake on a socket pair and starts a
// server session on the other end, but no client session: the test plays
// the client with the memory it created, and reads its socket only if it
// wants to.
func rawClient(t *testing.T, ccfg, scfg *Config) (*memory, *Session, func([]byte) error) {
	t.Helper()
	mem, server, cc := rawClientConn(t, ccfg, scfg)
	write := func(b []byte) error {
		_, err := cc.Write(b)
		return err
	}
	return mem, server, write
}

// rawClientConn is rawClient that returns the client's socket.
func rawClientConn(t *testing.T, ccfg, scfg *Config) (*memory, *Session, net.Conn) {
	t.Helper()
	return rawClientMarking(t, ccfg, scfg, true)
}

// rawClientMarking is rawClientConn whose client writes its marker only
// if mark is set: without it, it plays a shmipc-go or Rust client.
func rawClientMarking(t *testing.T, ccfg, scfg *Config, mark bool) (*memory, *Session, net.Conn) {
	t.Helper()
	cc, sc := socketPair(t)
	done := make(chan *Session, 1)
	go func() {
		s, err := Server(sc, scfg)
		if err != nil {
			t.Error(err)
		}
		done <- s
	}()
	c := ccfg.withDefaults()
	mem, _, err := clientHandshakeMarking(cc, &c, mark)
	require.NoError(t, err)
	server := <-done
	require.NotNil(t, server)
	t.Cleanup(func() {
		server.Close()
		cc.Close()
		mem.release()
	})
	return mem, server, cc
}

// announce puts the event that opens stream id on the peer: an empty
// slice, then a Polling.
func announceRaw(t *testing.T, mem *memory, id uint32, write func([]byte) error) {
	t.Helper()
	off, err := mem.region.Alloc(0)
	require.NoError(t, err)
	require.NoError(t, mem.region.SetPayload(off, 0))
	require.NoError(t, mem.send.Put(queue.Event{StreamID: id, Offset: off}))
	require.NoError(t, write(wire.AppendSimple(nil, 3, wire.TypePolling)))
}

// A peer that keeps putting harmless events (closes of unknown streams)
// cannot keep the receive loop busy past Close (docs/protocol.md section
// 13): harvest lets go of the queue every maxHarvest events.
func TestEventFloodDoesNotBlockClose(t *testing.T) {
	mem, server, write := rawClient(t, nil, nil)
	stop := make(chan struct{})
	flooding := make(chan struct{})
	go func() {
		defer close(flooding)
		for i := uint32(0); ; i++ {
			select {
			case <-stop:
				return
			default:
			}
			if mem.send.Put(queue.Event{StreamID: 1000 + i%1000, Status: stateClosed}) != nil {
				continue // full: the server is behind
			}
			if mem.send.MarkWorking() {
				// Failing once the server closed the connection: the
				// flood goes on all the same, as from a peer process.
				write(wire.AppendSimple(nil, 3, wire.TypePolling))
			}
		}
	}()
	defer func() { close(stop); <-flooding }()
	// The flood has reached the server once it counts thousands of events.
	waitFor(t, "the flood", func() bool { return server.Stats().EventsReceived > 20_000 })
	closed := make(chan struct{})
	go func() {
		server.Close()
		close(closed)
	}()
	waitDone(t, closed, "Close during an event flood")
}

// A server session refuses streams beyond Config.MaxStreams: the client
// reads ErrStreamRefused on them, and the server counts them in Stats.
func TestMaxStreams(t *testing.T) {
	client, server := pairWith(t, nil, &Config{MaxStreams: 3})
	var open []*Stream
	for range 3 {
		c, err := client.OpenStream(t.Context())
		require.NoError(t, err)
		open = append(open, c)
		accept(t, server)
	}
	for range 5 {
		c, err := client.OpenStream(t.Context())
		require.NoError(t, err)
		require.NoError(t, c.SetReadDeadline(time.Now().Add(10*time.Second)))
		_, err = c.Read(make([]byte, 1))
		require.ErrorIs(t, err, ErrStreamRefused)
		require.NoError(t, c.Close())
	}
	require.EqualValues(t, 5, server.Stats().StreamsRefused)
	// The refused ids were answered: the server keeps no state for them.
	waitFor(t, "the refused ids are forgotten", func() bool {
		server.mu.Lock()
		defer server.mu.Unlock()
		return len(server.tab.refused) == 0
	})
	// The open streams still work.
	_, err := open[0].Write([]byte("x"))
	require.NoError(t, err)
}

// boundedAdd keeps at most maxAwaiting ids, whatever a peer does.
func TestBoundedAdd(t *testing.T) {
	var ids map[uint32]struct{}
	for id := range uint32(3 * maxAwaiting) {
		boundedAdd(&ids, id)
	}
	require.Len(t, ids, maxAwaiting)
}

// FallbackData for a stream nobody reads is taken only up to the limits
// (docs/protocol.md section 13); past them the receive loop waits for the
// reader, and after Config.QueueFullTimeout the session ends with an error
// that names them, instead of the heap growing with what the peer sends.
func TestFallbackDataLimit(t *testing.T) {
	client, server := pairWith(t, nil, &Config{StreamHeapLimit: 64 << 10, MaxMessageSize: 64 << 10,
		QueueFullTimeout: 200 * time.Millisecond})
	c, err := client.OpenStream(t.Context())
	require.NoError(t, err)
	accept(t, server) // and never read
	data := make([]byte, 32<<10)
	for i := 0; ; i++ {
		require.Less(t, i, 100, "the server took 3 MiB for a stream nobody reads")
		if client.writeFallback(c, data, false, nil) != nil {
			break // the server ended the session
		}
		if isClosedChan(server.dead) {
			break
		}
	}
	waitDone(t, server.Done(), "the server's end")
	require.ErrorContains(t, server.Err(), "StreamHeapLimit")
	require.ErrorContains(t, server.Err(), "QueueFullTimeout")
	require.LessOrEqual(t, server.shm.heapUnread.Load(), int64(256<<10), "the heap held past the limits")
}

// A peer that stops reading its control connection cannot block our
// writers: a stream's write returns at its deadline, and the session ends
// after Config.WriteTimeout with an error that names it and is not a
// caller's deadline (docs/protocol.md section 13).
func TestWriteTimeout(t *testing.T) {
	mem, server, write := rawClient(t,
		&Config{BufferSize: 64 << 10, SizeClasses: tinyConfig().SizeClasses},
		&Config{Fallback: true, WriteTimeout: 500 * time.Millisecond})
	announceRaw(t, mem, 2, write)
	st := accept(t, server)
	// The client never frees a slice nor reads its socket: the region
	// fills, the server falls back to FallbackData, the socket fills.
	require.NoError(t, st.SetWriteDeadline(time.Now().Add(200*time.Millisecond)))
	data := make([]byte, 1<<20)
	var err error
	for range 64 {
		if _, err = st.Write(data); err != nil {
			break
		}
	}
	require.Error(t, err)
	waitDone(t, server.Done(), "the session's end after WriteTimeout")
	serr := server.Err()
	require.ErrorContains(t, serr, "WriteTimeout")
	require.False(t, errors.Is(serr, os.ErrDeadlineExceeded), "the session's end is not a deadline: %v", serr)
}

// One harvest pops at most maxHarvest events and says there are more: the
// receive loop then checks for the session's end before it goes on.
func TestHarvestBound(t *testing.T) {
	mem, server, _ := rawClient(t, nil, nil)
	for i := range 3 * maxHarvest {
		require.NoError(t, mem.send.Put(queue.Event{StreamID: 1000 + uint32(i), Status: stateClosed}))
	}
	server.rx.mu.Lock()
	more, err := server.harvestLocked(server.shm.mem, true)
	server.rx.mu.Unlock()
	require.NoError(t, err)
	require.True(t, more)
	require.EqualValues(t, maxHarvest, server.Stats().EventsReceived)
}

// A peer that puts a stream's data and close and then closes its end of
// the connection has them delivered, even when a write of ours finds the
// connection closed (EPIPE) before the receive loop has harvested them:
// the stream reads its data and io.EOF, not the write's error (#14: the
// two-process test's server failed with "session write: broken pipe").
func TestPeerGoneBeforeHarvest(t *testing.T) {
	mem, server, cc := rawClientConn(t, nil, &Config{PollTime: -1})
	write := func(b []byte) error { _, err := cc.Write(b); return err }
	announceRaw(t, mem, 2, write)
	st := accept(t, server)

	server.rx.mu.Lock() // no harvest until the write has failed
	var w buffer.ChainWriter
	w.Reset(mem.region)
	_, err := w.Write([]byte("last words"))
	require.NoError(t, err)
	head, _ := w.Finish()
	require.NoError(t, mem.send.Put(queue.Event{StreamID: 2, Offset: head}))
	require.NoError(t, mem.send.Put(queue.Event{StreamID: 2, Status: stateClosed}))
	require.NoError(t, cc.Close())
	_, err = st.Write([]byte("reply")) // its wakeup meets EPIPE
	server.rx.mu.Unlock()
	require.NoError(t, err, "the bytes were handed over before the wakeup failed")

	require.NoError(t, st.SetReadDeadline(time.Now().Add(10*time.Second)))
	got, err := io.ReadAll(st)
	require.NoError(t, err)
	require.Equal(t, "last words", string(got))
	waitDone(t, server.Done(), "the session's end")
	require.ErrorIs(t, server.Err(), ErrPeerClosed)
}

// A peer that dies leaves errors in the net vocabulary (#15): the
// stream's Read and Write match syscall.ECONNRESET, as a socket's do,
// not io.EOF, which is for a stream the peer closed; and a message
// carries one "shmlink: " prefix.
func TestPeerDeathErrors(t *testing.T) {
	mem, server, cc := rawClientConn(t, nil, nil)
	announceRaw(t, mem, 2, func(b []byte) error { _, err := cc.Write(b); return err })
	st := accept(t, server)
	require.NoError(t, cc.Close()) // the peer dies
	require.NoError(t, st.SetReadDeadline(time.Now().Add(10*time.Second)))
	_, rerr := st.Read(make([]byte, 1))
	waitDone(t, server.Done(), "the session's end")
	_, werr := st.Write([]byte("x"))
	for _, err := range []error{rerr, werr, server.Err()} {
		require.ErrorIs(t, err, syscall.ECONNRESET)
		require.NotErrorIs(t, err, io.EOF)
		require.Equal(t, 1, strings.Count(err.Error(), "shmlink: "), "%q", err)
	}
}

// One FallbackData longer than MaxMessageSize, as a shmipc-go peer sends
// a flush that does not fit in shared memory (#18: the session ended for
// a single 40 MiB write), is taken in pieces while its stream is read:
// every byte arrives and the session lives.
func TestHugeFallbackDataInPieces(t *testing.T) {
	mem, server, write := rawClient(t, nil, nil)
	announceRaw(t, mem, 2, write)
	st := accept(t, server)
	const n = 40 << 20 // over the default MaxMessageSize of 32 MiB
	data := randomBytes(n, 3)
	sent := make(chan error, 1)
	go func() {
		msg := wire.AppendFallbackHeader(nil, 3, 2, stateClosed, n) // the data and the close
		sent <- write(append(msg, data...))
	}()
	require.NoError(t, st.SetReadDeadline(time.Now().Add(time.Minute)))
	got, err := io.ReadAll(st)
	require.NoError(t, err)
	require.NoError(t, <-sent)
	require.True(t, bytes.Equal(data, got), "%d bytes of %d, or different ones", len(got), n)
	require.NoError(t, server.Err())
	require.EqualValues(t, 1, server.Stats().FallbackReads)
}

// FallbackData past a stream's heap limit waits for its reader instead of
// ending the session (#18: a shmipc-go peer writing 40 MiB on each of 20
// streams at once lost its session), and while it waits, data of other
// streams in shared memory still arrives: here the application reads the
// other stream to its end before it reads the first one.
func TestFallbackBackpressure(t *testing.T) {
	mem, server, write := rawClient(t, nil, &Config{
		StreamHeapLimit: 64 << 10, MaxMessageSize: 64 << 10, QueueFullTimeout: time.Minute})
	announceRaw(t, mem, 2, write)
	announceRaw(t, mem, 4, write)
	a, b := accept(t, server), accept(t, server)
	if a.ID() != 2 {
		a, b = b, a
	}
	const n = 4 << 20 // 64 times the limit, in one message
	data := randomBytes(n, 7)
	sent := make(chan error, 1)
	go func() {
		msg := wire.AppendFallbackHeader(nil, 3, 2, stateClosed, n)
		if err := write(append(msg, data...)); err != nil {
			sent <- err
			return
		}
		// The wakeup for stream 4's event comes only after the message
		// that waits for stream 2's reader: the server has to find the
		// event without it.
		sent <- write(wire.AppendSimple(nil, 3, wire.TypePolling))
	}()
	eventually(t, func() bool { return a.Buffered() >= 64<<10 }, "stream 2's first bytes")
	require.NoError(t, b.SetReadDeadline(time.Now().Add(10*time.Second)))
	type result struct {
		got []byte
		err error
	}
	read := make(chan result, 1)
	parks := server.Stats().Parks
	go func() {
		got, err := io.ReadAll(b)
		read <- result{got, err}
	}()
	// Once stream 4's reader sleeps, no spin of its own finds the event.
	eventually(t, func() bool { return server.Stats().Parks > parks }, "stream 4's reader asleep")
	off, err := mem.region.Alloc(5)
	require.NoError(t, err)
	require.NoError(t, mem.region.SetPayload(off, 5))
	p, _, _, err := mem.region.Payload(off)
	require.NoError(t, err)
	copy(p, "hello")
	require.NoError(t, mem.send.Put(queue.Event{StreamID: 4, Offset: off, Status: stateClosed}))

	r := <-read
	require.NoError(t, r.err, "stream 4, behind stream 2's waiting FallbackData")
	require.Equal(t, "hello", string(r.got))
	require.NoError(t, a.SetReadDeadline(time.Now().Add(time.Minute)))
	got, err := io.ReadAll(a)
	require.NoError(t, err)
	require.NoError(t, <-sent)
	require.True(t, bytes.Equal(data, got), "%d bytes of %d, or different ones", len(got), n)
	require.NoError(t, server.Err())
	require.LessOrEqual(t, server.shm.heapUnread.Load(), int64(0))
}

// A server tells a shmlink client that it refused a stream, in the second
// byte of the close's status (docs/protocol.md section 11); a client
// without the client's marker, as shmipc-go's and the Rust crate's, gets
// the plain close {id, 0, 1} it knows.
func TestRefusalReasonOnlyToMarkedClients(t *testing.T) {
	for _, mark := range []bool{true, false} {
		t.Run(fmt.Sprint("marked=", mark), func(t *testing.T) {
			mem, server, cc := rawClientMarking(t, nil, &Config{AcceptBacklog: 1}, mark)
			require.Equal(t, mark, server.closeReasons)
			write := func(b []byte) error { _, err := cc.Write(b); return err }
			announceRaw(t, mem, 2, write) // waits in the backlog
			announceRaw(t, mem, 3, write) // refused
			var closes []queue.Event
			waitFor(t, "the refusal", func() bool {
				for {
					ev, ok, err := mem.recv.Pop()
					require.NoError(t, err)
					if !ok {
						return len(closes) > 0
					}
					closes = append(closes, ev)
				}
			})
			want := uint32(stateClosed)
			if mark {
				want |= reasonRefused << reasonShift
			}
			require.Equal(t, []queue.Event{{StreamID: 3, Status: want}}, closes)
			require.EqualValues(t, 1, server.Stats().StreamsRefused)
		})
	}
}

// A peer that puts one slice in event after event, for a stream nobody
// reads, would have each event queue a message here that holds a slice
// already held: without a bound, memory that grows with what the peer
// sends. A session that would hold more slices than its region has ends
// with ErrCorrupt instead (docs/protocol.md section 13).
func TestReusedSliceRefused(t *testing.T) {
	mem, server, write := rawClient(t, nil, nil)
	announceRaw(t, mem, 2, write)
	st := accept(t, server) // and never read
	off, err := mem.region.Alloc(1)
	require.NoError(t, err)
	require.NoError(t, mem.region.SetPayload(off, 1))
	slices, _ := mem.region.Capacity()
	for sent := 0; sent < 3*slices && !isClosedChan(server.dead); {
		if mem.send.Put(queue.Event{StreamID: 2, Offset: off}) != nil {
			// Full: let the server harvest, or end.
			if mem.send.MarkWorking() {
				write(wire.AppendSimple(nil, 3, wire.TypePolling))
			}
			waitFor(t, "the server harvests", func() bool { return mem.send.Empty() || isClosedChan(server.dead) })
			continue
		}
		sent++
		if mem.send.MarkWorking() {
			write(wire.AppendSimple(nil, 3, wire.TypePolling)) // fails once the server ended
		}
	}
	waitDone(t, server.Done(), "the server's end")
	require.ErrorIs(t, server.Err(), buffer.ErrCorrupt)
	require.ErrorContains(t, server.Err(), "still unread")
	st.mu.Lock()
	queued := len(st.recv) - st.rhead
	st.mu.Unlock()
	require.LessOrEqual(t, queued, slices, "messages queued, each holding the one slice")
}

// A message whose first slice is empty and not marked allocated (the
// peer recycled it, or never took it) ends the session with ErrCorrupt,
// and that message is the one dropped: an earlier unread message of the
// stream stays queued, with its slice still counted as held, where the
// bad message's chunk used to stay and the earlier one went.
func TestBadFirstSliceDropsItsOwnMessage(t *testing.T) {
	mem, server, write := rawClient(t, nil, nil)
	announceRaw(t, mem, 2, write)
	st := accept(t, server) // and never read
	first, err := mem.region.Alloc(5)
	require.NoError(t, err)
	copy(mem.bufMem[first+20:], "hello") // after the 20-byte slice header
	require.NoError(t, mem.region.SetPayload(first, 5))
	require.NoError(t, mem.send.Put(queue.Event{StreamID: 2, Offset: first}))
	require.NoError(t, write(wire.AppendSimple(nil, 3, wire.TypePolling)))
	waitFor(t, "the first message", func() bool { return st.Buffered() == 5 })
	held := server.shm.holding.Load()

	// The bad message: slice a, empty, flags "next" only (not allocated),
	// chained to slice b with 1 byte.
	a, err := mem.region.Alloc(1)
	require.NoError(t, err)
	b, err := mem.region.Alloc(1)
	require.NoError(t, err)
	require.NoError(t, mem.region.SetPayload(a, 0))
	require.NoError(t, mem.region.SetPayload(b, 1))
	binary.NativeEndian.PutUint32(mem.bufMem[a+12:], b) // next
	binary.NativeEndian.PutUint32(mem.bufMem[a+16:], 1) // flags: next, not allocated
	require.NoError(t, mem.send.Put(queue.Event{StreamID: 2, Offset: a}))
	require.NoError(t, write(wire.AppendSimple(nil, 3, wire.TypePolling)))
	waitDone(t, server.Done(), "the server's end")
	require.ErrorIs(t, server.Err(), buffer.ErrCorrupt)

	st.mu.Lock()
	defer st.mu.Unlock()
	require.Equal(t, 1, len(st.recv)-st.rhead, "chunks queued")
	require.Equal(t, first, st.recv[st.rhead].off, "the first message is the one left")
	require.Equal(t, "hello", string(st.recv[st.rhead].data))
	require.Equal(t, 5, st.buffered)
	require.Equal(t, held, server.shm.holding.Load(), "slices held")
}

// FallbackData of one byte each counts its chunk's cost (heapChunkCost)
// against the heap limits besides its byte: the server takes no more such
// messages than the limit holds at that cost, where counting bytes alone
// let it queue a message per byte of the limit, each some 90 bytes of heap
// (docs/protocol.md section 13).
func TestTinyFallbackCounted(t *testing.T) {
	mem, server, cc := rawClientConn(t, nil, &Config{StreamHeapLimit: 64 << 10, MaxMessageSize: 64 << 10})
	write := func(b []byte) error { _, err := cc.Write(b); return err }
	announceRaw(t, mem, 2, write)
	st := accept(t, server) // and never read
	go func() {
		// Until the server stops reading and the test's cleanup closes
		// the socket.
		var batch []byte
		for {
			batch = batch[:0]
			for range 256 {
				batch = wire.AppendFallbackHeader(batch, 3, 2, 0, 1)
				batch = append(batch, 'x')
			}
			if write(batch) != nil {
				return
			}
		}
	}()
	waitFor(t, "the server waits for a reader", func() bool { return server.shm.heapWaiting.Load() })
	st.mu.Lock()
	queued, heap := len(st.recv)-st.rhead, st.heap
	st.mu.Unlock()
	limit := server.shm.socketLimit
	require.Greater(t, queued, 100, "tiny messages taken")
	// Each counts more than 64 bytes: the heap it takes stays near what
	// is counted, not 90 times more.
	require.LessOrEqual(t, queued, limit/64, "messages queued for the limit of %d", limit)
	require.Equal(t, queued*(1+heapChunkCost), heap, "bytes and cost of the messages counted")
	got := make([]byte, queued)
	_, err := io.ReadFull(st, got)
	require.NoError(t, err)
	require.Equal(t, bytes.Repeat([]byte{'x'}, queued), got)
}

// readCtlMsg reads one whole control message from r, as a peer would: its
// header (docs/protocol.md section 1.1) and its payload, of at most 1 MiB.
// It returns io.EOF only at the end of r before a message began.
func readCtlMsg(r io.Reader) (wire.Header, []byte, error) {
	var hdr [wire.HeaderSize]byte
	if _, err := io.ReadFull(r, hdr[:]); err != nil {
		return wire.Header{}, nil, err
	}
	h, err := wire.ParseHeader(hdr[:], 1<<20)
	if err != nil {
		return h, nil, err
	}
	payload := make([]byte, int(h.Length)-wire.HeaderSize)
	if _, err := io.ReadFull(r, payload); err != nil {
		return h, nil, err
	}
	return h, payload, nil
}

// A stream's first FallbackData after events goes after a Polling, so that
// a peer that handles FallbackData without draining its queue first (the
// Rust crate) sees the events before it (docs/protocol.md section 10). A
// Flush whose FallbackData met its write deadline with nothing sent owes
// that Polling still: the stream's next FallbackData carries it.
func TestPollingOwedAfterFailedFlush(t *testing.T) {
	mem, server, cc := rawClientConn(t,
		&Config{BufferSize: 64 << 10, SizeClasses: tinyConfig().SizeClasses},
		&Config{Fallback: true, WriteTimeout: 10 * time.Second})
	write := func(b []byte) error { _, err := cc.Write(b); return err }
	announceRaw(t, mem, 2, write)
	a := accept(t, server)
	announceRaw(t, mem, 3, write)
	b := accept(t, server)
	// The announcements' empty slices are recycled before a fills the
	// region: AcceptStream may return first, and a slice recycled after
	// the fill would be a free one for b's Reserve below. (The server's
	// view counts a slice it keeps warm as free.)
	waitFor(t, "the announcements' slices recycled", func() bool {
		return sum(server.Stats().SlicesInUse) == 0
	})

	_, err := b.Write([]byte("hello")) // an event in shared memory
	require.NoError(t, err)
	// a fills the region, then the socket, which the test does not read
	// yet: a holds the connection.
	aDone := make(chan error, 1)
	go func() { _, err := a.Write(make([]byte, 4<<20)); aDone <- err }()
	waitFor(t, "a waits in its socket write", func() bool { return goroutineWaits("(*Session).writeTimed", "IO wait") })
	require.NoError(t, b.SetWriteDeadline(time.Now().Add(100*time.Millisecond)))
	p, err := b.Reserve(10) // the region is full: on the heap
	require.NoError(t, err)
	copy(p, "xxxxxxxxxx")
	require.ErrorIs(t, b.Flush(), os.ErrDeadlineExceeded, "nothing sent (and the reservation dropped)")
	require.NoError(t, b.SetWriteDeadline(time.Time{}))

	// Read the connection: which message came before b's first
	// FallbackData?
	var prev wire.MsgType
	readDone := make(chan error, 1)
	go func() {
		last := wire.MsgType(0xff)
		for {
			h, payload, err := readCtlMsg(cc)
			if err != nil {
				readDone <- err
				return
			}
			if h.Type == wire.TypeFallbackData && binary.BigEndian.Uint32(payload) == b.ID() {
				prev = last
				readDone <- nil
				io.Copy(io.Discard, cc) // the rest of a's bytes
				return
			}
			last = h.Type
		}
	}()
	_, err = b.Write([]byte("world")) // the region is still full: FallbackData
	require.NoError(t, err)
	require.NoError(t, result(t, readDone))
	require.Equal(t, wire.TypePolling, prev, "b's first FallbackData after its event came after %v", prev)
	require.NoError(t, result(t, aDone))
}
