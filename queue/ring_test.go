package queue

import (
	"encoding/binary"
	"errors"
	"fmt"
	"math"
	"runtime"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/stretchr/testify/require"
)

// newPair formats a fresh queue of cap events in aligned heap memory.
func newPair(t testing.TB, cap uint32) (mem []byte, first, second *Ring) {
	t.Helper()
	mem = alignedMem(Size(cap))
	first, second, err := FormatPair(mem, cap)
	require.NoError(t, err)
	return mem, first, second
}

// testCaps are caps that are not powers of 2 and valid on this build.
func testCaps() []uint32 {
	var caps []uint32
	for _, c := range []uint32{1, 3, 5, 6, 7, 12, 100} {
		if validCap(c) {
			caps = append(caps, c)
		}
	}
	return caps
}

func TestPutPopFIFOWraparound(t *testing.T) {
	for _, cap := range testCaps() {
		mem, r, _ := newPair(t, cap)
		next, want := uint32(0), uint32(0)
		// Fill levels that cross the end of the event area many times.
		for round := range 50 {
			n := 1 + (round*5)%int(cap)
			for range n {
				require.NoError(t, r.Put(Event{StreamID: next, Offset: next * 3, Status: next % 2}))
				next++
			}
			require.Equal(t, n, r.len())
			// The event of the last Put sits at (tail-1)%cap, in wire order.
			i := offEvents + int((next-1)%cap)*eventSize
			require.Equal(t, []uint32{next - 1, (next - 1) * 3, (next - 1) % 2}, []uint32{
				binary.NativeEndian.Uint32(mem[i:]),
				binary.NativeEndian.Uint32(mem[i+4:]),
				binary.NativeEndian.Uint32(mem[i+8:]),
			})
			for range n {
				e, ok, err := r.Pop()
				require.NoError(t, err)
				require.True(t, ok)
				require.Equal(t, Event{StreamID: want, Offset: want * 3, Status: want % 2}, e, "cap %d", cap)
				want++
			}
			require.True(t, r.Empty())
		}
		require.EqualValues(t, next, binary.NativeEndian.Uint64(mem[offHead:]))
		require.EqualValues(t, next, binary.NativeEndian.Uint64(mem[offTail:]))
	}
}

func TestFullEmpty(t *testing.T) {
	for _, cap := range testCaps() {
		_, r, other := newPair(t, cap)
		e, ok, err := r.Pop()
		require.NoError(t, err)
		require.False(t, ok)
		require.Zero(t, e)
		require.True(t, r.Empty())
		for i := range cap {
			require.NoError(t, r.Put(Event{StreamID: i}))
			require.False(t, r.Empty())
		}
		require.Equal(t, int(cap), r.len())
		require.ErrorIs(t, r.Put(Event{StreamID: 99}), ErrFull)
		require.Equal(t, int(cap), r.len())
		require.True(t, other.Empty(), "the halves are independent")

		e, ok, err = r.Pop()
		require.NoError(t, err)
		require.True(t, ok)
		require.Equal(t, Event{StreamID: 0}, e)
		require.NoError(t, r.Put(Event{StreamID: cap}))
		require.ErrorIs(t, r.Put(Event{}), ErrFull)
		for i := uint32(1); i <= cap; i++ {
			e, ok, err = r.Pop()
			require.NoError(t, err)
			require.True(t, ok)
			require.Equal(t, i, e.StreamID)
		}
		_, ok, err = r.Pop()
		require.NoError(t, err)
		require.False(t, ok)
	}
}

// TestCorruptCounters writes impossible head and tail values through the
// byte slice, as a broken peer would: Put and Pop report ErrCorrupt and
// nothing panics.
func TestCorruptCounters(t *testing.T) {
	const cap = 6
	for _, tc := range []struct {
		name       string
		head, tail int64
	}{
		{"negative head", -1, 0},
		{"negative head and tail", -5, -3},
		{"head past tail", 5, 4},
		{"tail more than cap ahead", 10, 10 + cap + 1},
		{"tail far ahead", 0, math.MaxInt64 - 1},
		{"tail at the largest count", math.MaxInt64, math.MaxInt64},
		{"smallest head", math.MinInt64, 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			mem, r, _ := newPair(t, cap)
			binary.NativeEndian.PutUint64(mem[offHead:], uint64(tc.head))
			binary.NativeEndian.PutUint64(mem[offTail:], uint64(tc.tail))
			require.ErrorIs(t, r.Put(Event{StreamID: 1}), ErrCorrupt)
			_, ok, err := r.Pop()
			require.ErrorIs(t, err, ErrCorrupt)
			require.False(t, ok)
			require.False(t, errors.Is(err, ErrFull))
			require.GreaterOrEqual(t, r.len(), 0)
			require.LessOrEqual(t, r.len(), cap)
			r.Empty()
			// Counters left untouched.
			require.Equal(t, uint64(tc.head), binary.NativeEndian.Uint64(mem[offHead:]))
			require.Equal(t, uint64(tc.tail), binary.NativeEndian.Uint64(mem[offTail:]))
		})
	}
	// Large but consistent counters are fine, and index with counter % cap.
	mem, r, _ := newPair(t, cap)
	binary.NativeEndian.PutUint64(mem[offHead:], math.MaxInt64-3)
	binary.NativeEndian.PutUint64(mem[offTail:], math.MaxInt64-3)
	require.NoError(t, r.Put(Event{StreamID: 7}))
	e, ok, err := r.Pop()
	require.NoError(t, err)
	require.True(t, ok)
	require.Equal(t, uint32(7), e.StreamID)
}

func TestWorkingFlag(t *testing.T) {
	mem, r, other := newPair(t, 6)
	require.False(t, r.Working())
	require.True(t, r.MarkWorking(), "first mark sets the flag")
	require.False(t, r.MarkWorking(), "flag already set: no second Polling")
	require.True(t, r.Working())
	require.False(t, other.Working())
	require.Equal(t, uint32(1), binary.NativeEndian.Uint32(mem[offWorking:]))
	r.ClearWorking()
	require.False(t, r.Working())
	require.Zero(t, binary.NativeEndian.Uint32(mem[offWorking:]))
	r.SetWorking()
	require.True(t, r.Working())
	require.False(t, r.MarkWorking())
	// A peer's stray value counts as set.
	binary.NativeEndian.PutUint32(mem[offWorking:], 7)
	require.True(t, r.Working())
	require.False(t, r.MarkWorking())
}

func TestPutPopAllocs(t *testing.T) {
	_, r, _ := newPair(t, defaultCap)
	allocs := testing.AllocsPerRun(1000, func() {
		if err := r.Put(Event{StreamID: 1, Offset: 2, Status: 3}); err != nil {
			t.Fatal(err)
		}
		if _, _, err := r.Pop(); err != nil {
			t.Fatal(err)
		}
		r.MarkWorking()
		r.ClearWorking()
	})
	require.Zero(t, allocs)
}

// produceConsume moves n events from a producer goroutine to a consumer
// goroutine through send and recv (the same half, possibly attached twice)
// and checks they arrive in order. Neither side sleeps: a full or empty
// ring yields the processor. A failing side stops the other.
func produceConsume(t *testing.T, send, recv *Ring, n int) {
	var wg sync.WaitGroup
	var stop atomic.Bool
	errc := make(chan error, 2)
	fail := func(err error) {
		stop.Store(true)
		errc <- err
	}
	event := func(i int) Event { return Event{StreamID: uint32(i), Offset: ^uint32(i), Status: uint32(i) % 3} }
	wg.Add(2)
	go func() {
		defer wg.Done()
		for i := 0; i < n && !stop.Load(); {
			switch err := send.Put(event(i)); err {
			case nil:
				i++
			case ErrFull:
				runtime.Gosched()
			default:
				fail(err)
			}
		}
	}()
	go func() {
		defer wg.Done()
		for i := 0; i < n && !stop.Load(); {
			e, ok, err := recv.Pop()
			switch {
			case err != nil:
				fail(err)
			case !ok:
				runtime.Gosched()
			case e != event(i):
				fail(fmt.Errorf("event %d: got %+v", i, e))
			default:
				i++
			}
		}
	}()
	wg.Wait()
	close(errc)
	require.NoError(t, <-errc)
	require.True(t, recv.Empty())
}

// TestProducerConsumerHeap runs the ring over Go heap memory, where the
// race detector tracks the event bytes: it must see the atomic tail and
// head updates (unaligned on amd64) as synchronization, with no report.
func TestProducerConsumerHeap(t *testing.T) {
	n := 100_000
	if testing.Short() {
		n = 10_000
	}
	for _, cap := range []uint32{defaultCap, testCaps()[1]} {
		first, second := func() (*Ring, *Ring) { _, f, s := newPair(t, cap); return f, s }()
		produceConsume(t, first, first, n)
		produceConsume(t, second, second, n)
	}
}

// TestWorkingFlagConcurrent runs the wakeup protocol of docs/protocol.md
// section 3.3 between two goroutines over a small ring: the producer puts
// and sends a Polling (a channel message) only when MarkWorking succeeds;
// the consumer drains only on a Polling. Every event must be consumed
// by the time the producer is done and every Polling has been handled.
func TestWorkingFlagConcurrent(t *testing.T) {
	n := 100_000
	if testing.Short() {
		n = 10_000
	}
	_, r, _ := newPair(t, testCaps()[2])
	polling := make(chan struct{}, 1<<20)
	var got int
	done := make(chan error, 1)
	go func() {
		for range polling {
			for {
				for {
					e, ok, err := r.Pop()
					if err != nil {
						done <- err
						return
					}
					if !ok {
						break
					}
					if e.StreamID != uint32(got) {
						done <- errors.New("out of order")
						return
					}
					got++
				}
				r.ClearWorking()
				if r.Empty() {
					break
				}
				r.SetWorking()
			}
		}
		done <- nil
	}()
	sent := 0
	for i := 0; i < n; {
		switch err := r.Put(Event{StreamID: uint32(i)}); err {
		case nil:
			i++
		case ErrFull:
			select {
			case err := <-done: // the consumer gave up
				t.Fatalf("consumer: %v", err)
			default:
				runtime.Gosched()
			}
			continue
		default:
			t.Fatal(err)
		}
		if r.MarkWorking() {
			polling <- struct{}{}
			sent++
		}
	}
	close(polling)
	require.NoError(t, <-done)
	require.Equal(t, n, got, "events stranded in the ring")
	require.True(t, r.Empty())
	t.Logf("%d events, %d Polling messages", n, sent)
}

// wakeupState is one state of the wakeup protocol model: the ring's
// memory and where each side is in its program.
type wakeupState struct {
	mem      []byte
	producer int // 2*i: put event i; 2*i+1: mark working, maybe send a Polling
	consumer int // consumerIdle, ...
	polls    int // Polling messages sent and not yet received
	got      int // events popped
}

const (
	consumerIdle = iota
	consumerDrain
	consumerClear
	consumerCheck
)

// TestWorkingFlagModel explores every interleaving of a producer that puts
// k events (each followed by MarkWorking and, if it succeeded, a Polling)
// with a consumer that drains on Polling, clears the flag and re-checks
// (docs/protocol.md section 3.3), each step a single ring operation. In every
// final state all k events were consumed. Without the re-check the model
// must find a stranded event, which shows it can.
func TestWorkingFlagModel(t *testing.T) {
	const k, cap = 3, 4
	for _, recheck := range []bool{true, false} {
		var final, stranded int
		var explore func(s wakeupState)
		explore = func(s wakeupState) {
			step := func(f func(s *wakeupState, r *Ring)) {
				next := s
				next.mem = alignedMem(len(s.mem))
				copy(next.mem, s.mem)
				r, _, err := AttachPair(next.mem)
				require.NoError(t, err)
				f(&next, r)
				explore(next)
			}
			moved := false
			if s.producer < 2*k {
				moved = true
				step(func(s *wakeupState, r *Ring) {
					if s.producer%2 == 0 {
						require.NoError(t, r.Put(Event{StreamID: uint32(s.producer / 2)}))
					} else if r.MarkWorking() {
						s.polls++
					}
					s.producer++
				})
			}
			if s.consumer != consumerIdle || s.polls > 0 {
				moved = true
				step(func(s *wakeupState, r *Ring) {
					switch s.consumer {
					case consumerIdle:
						s.polls--
						s.consumer = consumerDrain
					case consumerDrain:
						e, ok, err := r.Pop()
						require.NoError(t, err)
						if !ok {
							s.consumer = consumerClear
							break
						}
						require.Equal(t, uint32(s.got), e.StreamID)
						s.got++
					case consumerClear:
						r.ClearWorking()
						s.consumer = consumerCheck
						if !recheck {
							s.consumer = consumerIdle
						}
					case consumerCheck:
						s.consumer = consumerIdle
						if !r.Empty() {
							r.SetWorking()
							s.consumer = consumerDrain
						}
					}
				})
			}
			if !moved {
				final++
				if s.got != k {
					stranded++
				}
			}
		}
		mem, _, _ := newPair(t, cap)
		explore(wakeupState{mem: mem})
		t.Logf("recheck %v: %d final states, %d with stranded events", recheck, final, stranded)
		require.Positive(t, final)
		if recheck {
			require.Zero(t, stranded)
		} else {
			require.Positive(t, stranded)
		}
	}
}

func BenchmarkPutPop(b *testing.B) {
	_, r, _ := newPair(b, defaultCap)
	b.SetBytes(eventSize)
	b.ReportAllocs()
	e := Event{StreamID: 2, Offset: 4096, Status: 0}
	for b.Loop() {
		if err := r.Put(e); err != nil {
			b.Fatal(err)
		}
		if _, _, err := r.Pop(); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkChannelBaseline is the in-process baseline for BenchmarkPutPop:
// a send and a receive on a buffered channel of events.
func BenchmarkChannelBaseline(b *testing.B) {
	ch := make(chan Event, defaultCap)
	b.SetBytes(eventSize)
	b.ReportAllocs()
	e := Event{StreamID: 2, Offset: 4096, Status: 0}
	for b.Loop() {
		ch <- e
		<-ch
	}
}
