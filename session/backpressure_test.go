package session

import (
	"bytes"
	"io"
	"math/rand/v2"
	"os"
	"runtime"
	"testing"
	"time"

	"github.com/shmlink/shmlink/buffer"
	"github.com/stretchr/testify/require"
)

// tinyConfig is a 64 KiB region of 4 KiB slices: easy to exhaust.
func tinyConfig() *Config {
	return &Config{
		BufferSize:  64 << 10,
		SizeClasses: []buffer.SizeClass{{SliceSize: 4076, Percent: 100}},
	}
}

func randomBytes(n int, seed uint64) []byte {
	b := make([]byte, n)
	r := rand.New(rand.NewPCG(seed, seed))
	for i := range b {
		b[i] = byte(r.Uint32())
	}
	return b
}

// A reader that keeps every slice (no copying out): the writer waits for
// space, its deadline ends the wait, nothing goes over the socket, and the
// bytes it counted as written arrive intact once the reader reads.
func TestBackpressureDeadline(t *testing.T) {
	scfg := tinyConfig()
	scfg.StreamMemoryLimit, scfg.StreamHeapLimit = -1, -1
	client, server := pairWith(t, tinyConfig(), scfg)
	c, s := streamPair(t, client, server)

	data := randomBytes(1<<20, 1)
	require.NoError(t, c.SetWriteDeadline(time.Now().Add(100*time.Millisecond)))
	n, err := c.Write(data)
	require.ErrorIs(t, err, os.ErrDeadlineExceeded)
	require.Less(t, n, 64<<10, "more than the region was written")
	_, err = c.Reserve(100)
	require.ErrorIs(t, err, os.ErrDeadlineExceeded, "Reserve waits for space too")

	st := client.Stats()
	require.Zero(t, st.FallbackWrites, "%+v", st)
	require.NotZero(t, st.MemoryFull, "%+v", st)

	// The reader drains; the writer, without a deadline, finishes the rest.
	require.NoError(t, c.SetWriteDeadline(time.Time{}))
	done := make(chan error, 1)
	go func() {
		_, err := c.Write(data[n:])
		if err == nil {
			err = c.CloseWrite()
		}
		done <- err
	}()
	got, err := io.ReadAll(s)
	require.NoError(t, err)
	require.NoError(t, <-done)
	require.True(t, bytes.Equal(data, got), "the bytes differ")
	require.Zero(t, client.Stats().FallbackWrites)
}

// One stream whose reader stalls must not starve the others: past
// Config.StreamMemoryLimit its data is copied to the heap and its slices
// freed, so another stream keeps exchanging through the same small region.
func TestStalledReader(t *testing.T) {
	client, server := pair(t, tinyConfig())
	stalledC, stalledS := streamPair(t, client, server)
	c, s := streamPair(t, client, server)

	data := randomBytes(1<<20, 2)
	_, err := stalledC.Write(data) // nobody reads it yet
	require.NoError(t, err)

	msg := make([]byte, 1024)
	for i := range 100 {
		msg[0] = byte(i)
		_, err := c.Write(msg)
		require.NoError(t, err)
		_, err = io.ReadFull(s, msg)
		require.NoError(t, err)
		_, err = s.Write(msg)
		require.NoError(t, err)
		_, err = io.ReadFull(c, msg)
		require.NoError(t, err)
		require.Equal(t, byte(i), msg[0])
	}

	require.NoError(t, stalledC.CloseWrite())
	got, err := io.ReadAll(stalledS)
	require.NoError(t, err)
	require.True(t, bytes.Equal(data, got), "the stalled stream's bytes differ")

	releaseWarm(client, server)
	st := server.Stats()
	require.NotZero(t, st.Spilled, "%+v", st)
	require.Zero(t, client.Stats().FallbackWrites)
	for i, n := range st.SlicesInUse {
		require.Zero(t, n, "list %d: slices still in use", i)
	}
}

// Copies out of the region for stalled readers are bounded per session,
// not only per stream: all unread bytes on the heap, copies and
// FallbackData, count against 4 times StreamHeapLimit (docs/protocol.md
// section 13). With the session's heap at that bound, a stalled stream's
// messages stay in shared memory and its writer waits, as with copying
// off; with room, they are copied out. Other streams' copies or
// FallbackData made that heap before; without the bound, a peer that
// opened streams nobody reads took StreamHeapLimit of heap for each.
func TestCopyOutSessionBound(t *testing.T) {
	for _, full := range []bool{false, true} {
		t.Run(map[bool]string{false: "room", true: "full"}[full], func(t *testing.T) {
			client, server := pair(t, tinyConfig())
			c, s := streamPair(t, client, server)
			waitFor(t, "a stalled reader", s.stalled)
			m := &server.shm
			var other int64
			if full {
				other = 4 * int64(m.heapLimit) // what other streams hold
			}
			m.heapUnread.Add(other)
			defer m.heapUnread.Add(-other)
			// Full, the write must wait; with room, it must not (the
			// deadline only turns a regression into a failure).
			wait := 10 * time.Second
			if full {
				wait = 100 * time.Millisecond
			}
			require.NoError(t, c.SetWriteDeadline(time.Now().Add(wait)))
			_, err := c.Write(randomBytes(1<<20, 3))
			spilled := server.Stats().Spilled
			if full {
				require.ErrorIs(t, err, os.ErrDeadlineExceeded, "the writer waits for space")
				require.Zero(t, spilled, "bytes copied out past the session's bound")
			} else {
				require.NoError(t, err)
				require.NotZero(t, spilled, "bytes copied out")
			}
		})
	}
}

// A writer waiting for space is woken by what frees it, not by its timed
// waits alone, which the runtime may round up to a millisecond: its own
// session's reader freeing slices, or the harvest of the peer's events
// (whose reader freed what it had read first). With the timed waits an
// hour long, each phase ends only if that wakeup comes.
func TestSpaceWaitWakes(t *testing.T) {
	keep := tinyConfig()
	keep.StreamMemoryLimit, keep.StreamHeapLimit = -1, -1 // no copying out
	client, server := pairWith(t, keep, keep)
	client.shm.spaceWait = time.Hour
	c1, s1 := streamPair(t, client, server)
	c2, s2 := streamPair(t, client, server)
	msg := make([]byte, 4<<10)

	// fill writes on w until the region is full.
	fill := func(w *Stream) int {
		require.NoError(t, w.SetWriteDeadline(time.Now().Add(50*time.Millisecond)))
		n, err := w.Write(make([]byte, 1<<20))
		require.ErrorIs(t, err, os.ErrDeadlineExceeded)
		require.NoError(t, w.SetWriteDeadline(time.Time{}))
		return n
	}
	// blocked starts c1.Write(msg) and returns once it waits for space.
	blocked := func() <-chan error {
		done := make(chan error, 1)
		go func() {
			_, err := c1.Write(msg)
			done <- err
		}()
		for client.shm.spaceWaiters.Load() == 0 {
			select {
			case err := <-done:
				t.Fatalf("the write did not wait for space: %v", err)
			default:
				runtime.Gosched()
			}
		}
		return done
	}
	wait := func(done <-chan error, what string) {
		select {
		case err := <-done:
			require.NoError(t, err)
		case <-time.After(time.Minute):
			t.Fatalf("a writer waiting for space was not woken by %s", what)
		}
	}

	// The region is full: less than half of it with what the client has
	// not read, the rest with what it wrote (with half, the writer would
	// not wait for its own reader: TestWriteWhileOwnReaderHoldsRegion).
	// Its read frees slices in its own session.
	_, err := s2.Write(make([]byte, 24<<10))
	require.NoError(t, err)
	for c2.Buffered() < 24<<10 { // all harvested: only the read can wake the writer
		runtime.Gosched()
	}
	n := fill(c1)
	done := blocked()
	_, err = io.ReadFull(c2, make([]byte, 24<<10))
	require.NoError(t, err)
	wait(done, "its own reader's free")
	_, err = io.ReadFull(s1, make([]byte, n))
	require.NoError(t, err)
	_, err = io.ReadFull(s1, msg)
	require.NoError(t, err)
	require.Zero(t, client.Stats().FallbackWrites)

	// The region is full of what the server has not read: its read frees
	// slices in the peer's session, and its answer's event tells.
	n = fill(c2)
	done = blocked()
	_, err = io.ReadFull(s2, make([]byte, n))
	require.NoError(t, err)
	_, err = s1.Write([]byte{1})
	require.NoError(t, err)
	wait(done, "the harvest of the peer's event")
	_, err = io.ReadFull(s1, msg)
	require.NoError(t, err)
	_, err = io.ReadFull(c1, msg[:1])
	require.NoError(t, err)
}

// Write does not retain p: when its write deadline passes in the middle of
// a FallbackData, the rest of that message goes out on a flusher goroutine
// after Write has returned (and counted the message as written), so it
// must not be read from p, which the caller may reuse at once. Here the
// server reads nothing until Write has returned and p is overwritten: its
// stream's heap limit stops its receive loop, and the socket fills. Where
// the socket fills depends on what went before; each try shifts it.
func TestWriteDeadlineDoesNotRetainP(t *testing.T) {
	ccfg := tinyConfig()
	ccfg.Fallback = true
	scfg := tinyConfig()
	scfg.StreamHeapLimit, scfg.MaxMessageSize = 64<<10, 64<<10
	flushed := 0 // tries in which a flusher went on after Write returned
	for try := range 16 {
		client, server := pairWith(t, ccfg, scfg)
		c, s := streamPair(t, client, server)
		data := randomBytes(1<<20, uint64(try))
		head := try * 5 << 10 // written first, without a deadline
		_, err := c.Write(data[:head])
		require.NoError(t, err)
		p := append([]byte(nil), data[head:]...)
		require.NoError(t, c.SetWriteDeadline(time.Now().Add(100*time.Millisecond)))
		n, err := c.Write(p)
		require.ErrorIs(t, err, os.ErrDeadlineExceeded)
		require.Less(t, n, len(p), "the socket never filled")
		if len(client.ctl.sem) == 1 {
			flushed++ // the connection is held: a flusher writes the rest
		}
		for i := range p {
			p[i] = 0xA5 // the caller's next use of its buffer
		}
		type result struct {
			b   []byte
			err error
		}
		read := make(chan result, 1)
		go func() {
			b, err := io.ReadAll(s)
			read <- result{b, err}
		}()
		require.NoError(t, c.CloseWrite()) // after the flusher's message
		r := <-read
		require.NoError(t, r.err)
		got, want := r.b, data[:head+n]
		require.Equal(t, len(want), len(got), "the bytes counted as written")
		if i := mismatch(got, want); i >= 0 {
			t.Fatalf("try %d: byte %d of %d differs: got %#x want %#x (%#x is the caller's buffer after Write returned)",
				try, i, len(want), got[i], want[i], 0xA5)
		}
	}
	require.NotZero(t, flushed, "no try ended with a flusher")
	t.Logf("%d of 16 tries ended with a flusher", flushed)
}

// mismatch returns the index of the first byte at which a and b differ,
// or -1 if they are equal.
func mismatch(a, b []byte) int {
	for i := range min(len(a), len(b)) {
		if a[i] != b[i] {
			return i
		}
	}
	if len(a) != len(b) {
		return min(len(a), len(b))
	}
	return -1
}

// A writer does not wait for its own process's readers (docs/protocol.md
// section 13). The client fills the region with data that the server does
// not read, beyond what the server may copy to its heap; then the server
// writes before it reads, as an echo server does whose client wrote until
// its write deadline. The region has nothing for the server's write until
// the server reads, so it goes over the control connection, and both
// directions arrive intact. Without the rule the server's write waited
// forever.
func TestWriteWhileOwnReaderHoldsRegion(t *testing.T) {
	scfg := tinyConfig()
	scfg.StreamHeapLimit = 8 << 10
	client, server := pairWith(t, tinyConfig(), scfg)
	c, s := streamPair(t, client, server)
	// streamPair's read kept its slice warm for the server's next write
	// (docs/protocol.md section 2.4): hand it back, so that the client's
	// write fills the whole region and the server's finds nothing.
	releaseWarm(server)

	data := randomBytes(1<<20, 3)
	wrote := make(chan int, 1)
	go func() {
		n, _ := c.Write(data)
		wrote <- n
	}()
	for client.shm.spaceWaiters.Load() == 0 { // the region is full
		runtime.Gosched()
	}
	require.NoError(t, c.SetWriteDeadline(time.Now()))
	n := <-wrote
	require.Less(t, n, len(data))

	answer := randomBytes(64<<10, 4) // as large as the region
	done := make(chan error, 1)
	go func() {
		_, err := s.Write(answer)
		done <- err
	}()
	require.NoError(t, c.SetReadDeadline(time.Now().Add(time.Minute))) // fail, not hang
	got := make([]byte, len(answer))
	_, err := io.ReadFull(c, got)
	require.NoError(t, err, "the server's write waited for its own reader")
	require.True(t, bytes.Equal(answer, got), "the answer's bytes differ")
	require.NoError(t, <-done)
	require.NotZero(t, server.Stats().FallbackWrites)

	got = make([]byte, n)
	_, err = io.ReadFull(s, got)
	require.NoError(t, err)
	require.True(t, bytes.Equal(data[:n], got), "the request's bytes differ")
}

// A Peek (here ReadBytes) for more bytes than the region can hold as they
// came, each message in a slice of its own, gets them: while its reader
// waits holding bytes, the stream counts as stalled and its messages are
// copied out of the region. Before, a reader in a read call never counted
// as stalled, so nothing was copied out: ReadBytes(4000) of 1-byte writes
// stopped at 2402 bytes with every slice of the default region in use, and
// the writer waited for space for ever. So did it when the reader read the
// control connection itself: it stopped only with all n bytes.
func TestPeekMoreMessagesThanSlices(t *testing.T) {
	for _, tc := range []struct {
		name  string
		cfg   *Config
		n     int // 1-byte messages
		slice int // a ReadBytes of n at once, or Peek of this many bytes in one message
	}{
		{"small-messages", nil, 4000, 0},
		{"one-large-message", &Config{BufferSize: 2 << 20}, 0, 4 << 20},
		// The reader reads the control connection itself (a pump),
		// which waited for all n bytes before, and for ever.
		{"small-messages-pump", &Config{PollTime: -1}, 4000, 0},
		{"one-large-message-pump", &Config{BufferSize: 2 << 20, PollTime: -1}, 0, 4 << 20},
	} {
		t.Run(tc.name, func(t *testing.T) {
			client, server := pair(t, tc.cfg)
			c, s := streamPair(t, client, server)
			data := randomBytes(max(tc.n, tc.slice), 11)
			wrote := make(chan error, 1)
			go func() {
				var err error
				if tc.n > 0 {
					for i := 0; i < tc.n && err == nil; i++ {
						_, err = c.Write(data[i : i+1])
					}
				} else {
					_, err = c.Write(data)
				}
				wrote <- err
			}()
			done := make(chan error, 1)
			var got []byte
			go func() {
				var err error
				if tc.n > 0 {
					got, err = s.ReadBytes(tc.n)
				} else {
					got, err = s.Peek(tc.slice)
				}
				done <- err
			}()
			require.NoError(t, result(t, done))
			require.True(t, bytes.Equal(data, got), "the bytes differ")
			require.NoError(t, result(t, wrote))
		})
	}
}

// A Peek that found nothing buffered, and whose messages then fill the
// region before it waits, still gets them all: the messages came while it
// did not yet count as waiting for more (holdWait), so they stayed in the
// region, and only a copy-out of them makes room for the rest. A reader
// that read the control connection itself (a pump) waited for one byte
// more than it held when the pump began, not when it last looked: with
// the region full that byte never came, and the writer waited for space
// for ever (1 stress run in a few hundred beside a busy loop). The
// messages here arrive in the reader's first wait, before it spins,
// sleeps or pumps, and the pump finds the connection free.
func TestPeekAfterRegionFilled(t *testing.T) {
	for _, tc := range []struct {
		name string
		cfg  *Config
	}{
		{"pump", &Config{BufferSize: 2 << 20, PollTime: -1}},
		{"poll-then-sleep", &Config{BufferSize: 2 << 20}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			client, server := pair(t, tc.cfg)
			c, s := streamPair(t, client, server)
			data := randomBytes(4<<20, 12)
			wrote := make(chan error, 1)
			first := true
			server.waitHook = func(st *Stream) {
				if st != s || !first {
					return
				}
				first = false
				go func() {
					_, err := c.Write(data)
					wrote <- err
				}()
				waitFor(t, "the writer waits for space with every message delivered", func() bool {
					if client.shm.spaceWaiters.Load() == 0 {
						return false
					}
					delivered := false
					server.withMem(func(m *memory) error {
						delivered = m.recv.Empty()
						return nil
					})
					return delivered
				})
				// The receive loop lets go of the connection, for the
				// pump to take it at once rather than after asking. The
				// test holds it until then: the session's timer hands it
				// back to the loop within a millisecond.
				in := &server.rx.in
				waitFor(t, "the receive loop lets go", func() bool {
					if in.tok.TryLock() {
						return true
					}
					in.kickMu.Lock()
					if in.loopHas && !in.yield {
						in.yield = true
						in.kickLocked(server)
					}
					in.kickMu.Unlock()
					return false
				})
				in.tok.Unlock()
			}
			done := make(chan error, 1)
			var got []byte
			go func() {
				var err error
				got, err = s.Peek(len(data))
				done <- err
			}()
			require.NoError(t, result(t, done))
			require.False(t, first, "the reader never waited")
			require.True(t, bytes.Equal(data, got), "the bytes differ")
			require.NoError(t, result(t, wrote))
			require.NotZero(t, server.Stats().Spilled, "nothing was copied out of the region")
		})
	}
}

// A message copied out of shared memory for a stalled reader arrives whole
// or not at all. A peer that shrinks a slice of it between the check of its
// chain and the copy would otherwise leave the end of the pooled buffer
// unwritten: bytes of an earlier message, maybe another stream's, in the
// reader's data. The session ends with ErrCorrupt instead.
func TestSpillOfShrunkChain(t *testing.T) {
	client, server := pair(t, tinyConfig())
	c, s := streamPair(t, client, server)
	shrunk := false
	server.shm.mu.Lock() // pushChain reads the hook under shm.mu
	server.spillHook = func(region *buffer.Region, off uint32) {
		if !shrunk {
			shrunk = true
			require.NoError(t, region.SetPayload(off, 1)) // as the peer may, in its own memory
		}
	}
	server.shm.mu.Unlock()
	data := randomBytes(2<<20, 4)
	c.Write(data) // fails once the server ended
	waitDone(t, server.Done(), "the server's end")
	require.ErrorIs(t, server.Err(), buffer.ErrCorrupt)
	got, _ := io.ReadAll(s)
	require.True(t, bytes.HasPrefix(data, got), "%d bytes read, not all the peer's", len(got))
}
