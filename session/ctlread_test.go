package session

import (
	"os"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/shmlink/shmlink/internal/wire"
	"github.com/shmlink/shmlink/queue"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// putRaw puts data for stream id on the raw client's send queue, without
// a Polling.
func putRaw(t *testing.T, mem *memory, id uint32, data string) {
	t.Helper()
	off, err := mem.region.Alloc(len(data))
	require.NoError(t, err)
	require.NoError(t, mem.region.SetPayload(off, uint32(len(data))))
	p, _, _, err := mem.region.Payload(off)
	require.NoError(t, err)
	copy(p, data)
	require.NoError(t, mem.send.Put(queue.Event{StreamID: id, Offset: off}))
}

// result returns what the read behind done returned, failing the test if
// it still waits after 10 s.
func result(t *testing.T, done <-chan error) error {
	t.Helper()
	select {
	case err := <-done:
		return err
	case <-time.After(10 * time.Second):
		// The goroutines' stacks say where a rare hang waits.
		buf := make([]byte, 1<<20)
		t.Fatalf("the read still waits after 10 s; goroutines:\n%s", buf[:runtime.Stack(buf, true)])
		return nil
	}
}

// waitPumping waits until st's reader reads the control connection itself
// and is blocked there (docs/protocol.md section 12.1).
func waitPumping(t *testing.T, st *Stream) {
	t.Helper()
	waitFor(t, "the reader reads the connection", func() bool { return st.s.rx.in.pumping.Load() == st })
}

// pumpRead has st's reader wait for msg reading the connection itself (a
// pump), then puts msg on the raw client's queue and writes the Polling
// that wakes the reader; it returns once the read got msg.
func pumpRead(t *testing.T, mem *memory, write func([]byte) error, st *Stream, msg string) {
	t.Helper()
	got := make([]byte, len(msg))
	done := readAsync(st, got)
	waitPumping(t, st)
	putRaw(t, mem, st.id, msg)
	require.NoError(t, write(wire.AppendSimple(nil, 3, wire.TypePolling)))
	require.NoError(t, result(t, done))
	require.Equal(t, msg, string(got))
}

// A reader that sleeps reads the Polling that wakes it itself: with
// polling off, every wait whose data comes while the reader reads the
// connection is a self-wake, one Polling each. A wait may also end once
// early: every delivery signals the stream's readCh, even one by the
// reader's own pump, and a wait that finds the receive loop holding the
// connection (the first one here) takes such a signal as a wakeup, finds
// no data and waits again, one more park.
func TestSelfWakes(t *testing.T) {
	client, server := pair(t, &Config{PollTime: -1})
	client.rx.in.handBackAfter = time.Hour // the loop never takes it back here
	c, s := streamPair(t, client, server)
	before := client.Stats()
	got := make([]byte, 1)
	for i := range 20 {
		done := readAsync(c, got)
		waitPumping(t, c)
		_, err := s.Write([]byte{byte(i)})
		require.NoError(t, err)
		require.NoError(t, result(t, done))
		require.Equal(t, byte(i), got[0])
	}
	st := client.Stats()
	require.GreaterOrEqual(t, st.Parks, before.Parks+20, "%+v", st)
	require.LessOrEqual(t, st.Parks, before.Parks+21, "more than one early wakeup: %+v", st)
	require.Equal(t, before.SelfWakes+20, st.SelfWakes, "%+v", st)
	require.Equal(t, before.WakeupsReceived+20, st.WakeupsReceived, "one Polling per byte")
}

// A stream whose data usually comes within a poll leaves the connection to
// the receive loop; one whose waits run long reads it itself.
func TestSelfWakeChoice(t *testing.T) {
	st := &Stream{s: &Session{cfg: Config{PollTime: stretchPolls * 50 * time.Microsecond}}}
	require.False(t, st.selfWake(st.spinBudget(false, false)), "nothing learned: polls, then sleeps")
	for range 30 {
		st.recordWait(time.Second)
	}
	require.True(t, st.selfWake(st.spinBudget(false, false)), "long waits: no poll, reads the connection")
	off := &Stream{s: &Session{cfg: Config{PollTime: -1}}}
	require.True(t, off.selfWake(off.spinBudget(false, false)), "polling off")

	// On a busy host, a stream whose last busyMisses waits each outlasted
	// PollTime reads it itself; one wait within a poll ends the run.
	busy := &Stream{s: &Session{cfg: Config{PollTime: stretchPolls * 50 * time.Microsecond}}}
	forceHost(t, true)
	for i := range busyMisses {
		require.False(t, busy.selfWake(busy.spinBudget(false, false)), "after %d missed polls", i)
		busy.recordWait(120 * time.Microsecond)
	}
	require.Equal(t, busy.s.basePoll(), busy.spinBudget(false, false), "waits this short still poll")
	require.True(t, busy.selfWake(busy.spinBudget(false, false)), "busy host, polls that keep missing")
	busy.recordWait(10 * time.Microsecond)
	require.False(t, busy.selfWake(busy.spinBudget(false, false)), "a poll that caught its data")
	for range busyMisses {
		busy.recordWait(120 * time.Microsecond)
	}
	forceHost(t, false)
	require.False(t, busy.selfWake(busy.spinBudget(false, false)), "a host with a CPU to spare")
}

// On a host whose CPUs are all busy, a reader whose polls keep missing
// (requests that come a little more than a base poll apart) reads the
// control connection itself once busyMisses waits in a row have outlasted
// their poll, instead of being woken by the receive loop (docs/protocol.md
// section 12.1): each of the receive loop's wakeups would be another round
// of the scheduler against the other processes.
func TestBusyHostSelfWake(t *testing.T) {
	cfg := &Config{PollTime: time.Millisecond}
	client, server := pair(t, cfg)
	c, s := streamPair(t, client, server)
	forceHost(t, true)
	got := make([]byte, 1)
	for i := range busyMisses + 1 {
		// Mean waits of one base poll, so every wait polls first
		// (spinBudget), and a read that ended just now, so no wait
		// follows a cold wakeup of the server (coldWake).
		c.waitEWMA = client.basePoll()
		c.lastRead.Store(int64(monoNow()))
		before := client.Stats()
		done := readAsync(c, got)
		if i < busyMisses {
			waitFor(t, "the reader sleeps", func() bool { return client.rx.waiters.Load() == 1 })
		} else {
			waitPumping(t, c)
		}
		_, err := s.Write([]byte{byte(i)})
		require.NoError(t, err)
		require.NoError(t, result(t, done))
		require.Equal(t, byte(i), got[0])
		after := client.Stats()
		require.Greater(t, after.Parks, before.Parks, "wait %d did not sleep", i)
		want := before.SelfWakes
		if i == busyMisses {
			want++
		}
		require.Equal(t, want, after.SelfWakes, "wait %d, after %d missed polls", i, i)
	}
}

// A reader blocked on the connection is kicked when its data comes by
// another way: here another stream's reader, spinning on the receive
// queue (so the peer sends no Polling), harvests it.
func TestPumpKickedByHarvest(t *testing.T) {
	mem, server, write := rawClient(t, nil, &Config{PollTime: endlessPolls(t)})
	announceRaw(t, mem, 2, write)
	announceRaw(t, mem, 4, write)
	a, b := accept(t, server), accept(t, server)
	if a.ID() != 2 {
		a, b = b, a
	}
	gotB := make([]byte, 2)
	doneB := readAsync(b, gotB)
	waitFor(t, "b spins", func() bool { return server.rx.spinning.Load() })
	gotA := make([]byte, 2)
	a.waitEWMA = 8 * time.Hour // a's waits run long: it reads the connection itself
	doneA := readAsync(a, gotA)
	waitPumping(t, a)

	putRaw(t, mem, 2, "aa") // no Polling: the server's working flag is 1
	require.NoError(t, result(t, doneA))
	require.Equal(t, "aa", string(gotA))
	putRaw(t, mem, 4, "bb")
	require.NoError(t, result(t, doneB))
	require.Equal(t, "bb", string(gotB))
	require.NoError(t, server.Err())
}

// A reader blocked on the connection sees a new read deadline, and Close;
// then the connection goes back to the receive loop.
func TestPumpDeadlineAndClose(t *testing.T) {
	mem, server, write := rawClient(t, nil, &Config{PollTime: -1})
	announceRaw(t, mem, 2, write)
	st := accept(t, server)
	done := readAsync(st, make([]byte, 1))
	waitPumping(t, st)
	require.NoError(t, st.SetReadDeadline(time.Now()))
	require.ErrorIs(t, result(t, done), os.ErrDeadlineExceeded)

	require.NoError(t, st.SetReadDeadline(time.Time{}))
	done = readAsync(st, make([]byte, 1))
	waitPumping(t, st)
	require.NoError(t, st.Close())
	require.ErrorIs(t, result(t, done), ErrStreamClosed)

	announceRaw(t, mem, 4, write)
	require.EqualValues(t, 4, accept(t, server).ID())
	require.NoError(t, server.Err())
}

// A message a reader does not read itself (FallbackData) goes to the
// receive loop, which delivers it; a message cut short by the reader's
// deadline stays for the next read; the connection's end reaches a reader
// blocked on it as the session's error.
func TestPumpHandsOver(t *testing.T) {
	mem, server, cc := rawClientConn(t, nil, &Config{PollTime: -1})
	write := func(b []byte) error { _, err := cc.Write(b); return err }
	announceRaw(t, mem, 2, write)
	st := accept(t, server)
	got := make([]byte, 5)
	done := readAsync(st, got)
	waitPumping(t, st)
	msg := wire.AppendFallbackHeader(nil, 3, 2, stateOpen, 5)
	require.NoError(t, write(append(msg, "hello"...)))
	require.NoError(t, result(t, done))
	require.Equal(t, "hello", string(got))
	require.EqualValues(t, 1, server.Stats().FallbackReads)

	// Half a Polling, then the reader's deadline: the rest comes later.
	poll := wire.AppendSimple(nil, 3, wire.TypePolling)
	require.NoError(t, write(poll[:3]))
	require.NoError(t, st.SetReadDeadline(time.Now().Add(50*time.Millisecond)))
	_, err := st.Read(make([]byte, 1))
	require.ErrorIs(t, err, os.ErrDeadlineExceeded)
	require.NoError(t, st.SetReadDeadline(time.Time{}))
	putRaw(t, mem, 2, "x")
	done = readAsync(st, got[:1])
	require.NoError(t, write(poll[3:]))
	require.NoError(t, result(t, done))
	require.Equal(t, "x", string(got[:1]))
	require.NoError(t, server.Err())

	done = readAsync(st, got[:1])
	waitPumping(t, st)
	require.NoError(t, cc.Close())
	require.ErrorIs(t, result(t, done), ErrPeerClosed)
}

// A reader that got its data leaves the connection free; the receive loop
// takes it back after handBackAfter, so a stream announced meanwhile is
// accepted although no reader reads.
func TestHandBack(t *testing.T) {
	mem, server, write := rawClient(t, nil, &Config{PollTime: -1})
	announceRaw(t, mem, 2, write)
	st := accept(t, server)
	pumpRead(t, mem, write, st, "hi")
	require.EqualValues(t, 1, server.Stats().SelfWakes)

	announceRaw(t, mem, 4, write) // nobody reads the connection now
	require.EqualValues(t, 4, accept(t, server).ID())
	loopReads := func() bool {
		in := &server.rx.in
		in.kickMu.Lock()
		defer in.kickMu.Unlock()
		return in.loopHas
	}
	require.True(t, loopReads(), "the receive loop reads the connection again")

	// Again while the session's timer runs on its standby period (it
	// stops only after a period without work): the reader's release does
	// not arm it, and the next tick hands the connection back.
	pumpRead(t, mem, write, st, "ho")
	announceRaw(t, mem, 6, write)
	require.EqualValues(t, 6, accept(t, server).ID())
	require.True(t, loopReads(), "the receive loop reads the connection again")
}

// A read deadline changed after a pump set the connection's deadline from
// its stream's, but before the pump waited on the connection, when no kick
// can reach it, still takes effect: the pump brings the connection's
// deadline up to date before each wait (ctlIn.beginIdle). Before, the
// connection kept the old deadline; once that passed, every read of it
// failed at once, and the pump spun without reading the Polling of the
// byte written later, which never arrived.
func TestPumpDeadlineChangedBeforeWait(t *testing.T) {
	client, server := pair(t, &Config{PollTime: -1})
	client.rx.in.handBackAfter = time.Hour // the loop never takes it back here
	c, s := streamPair(t, client, server)
	old := time.Now().Add(20 * time.Millisecond)
	require.NoError(t, c.SetReadDeadline(old))
	var once sync.Once
	client.pumpHook = func(st *Stream) {
		if st == c {
			once.Do(func() { c.SetReadDeadline(time.Time{}) })
		}
	}
	got := make([]byte, 1)
	done := readAsync(c, got)
	waitPumping(t, c)
	// The old deadline must pass: on the connection, it is what failed
	// every read.
	<-time.After(time.Until(old) + 10*time.Millisecond)
	_, err := s.Write([]byte{'x'})
	require.NoError(t, err)
	require.NoError(t, result(t, done))
	require.Equal(t, byte('x'), got[0])
}

// goroutineWaits reports whether some goroutine is blocked in state (as a
// traceback names it: "select", "chan receive") with fn on its stack.
func goroutineWaits(fn, state string) bool {
	buf := make([]byte, 1<<20)
	buf = buf[:runtime.Stack(buf, true)]
	for _, g := range strings.Split(string(buf), "\n\n") {
		header, _, _ := strings.Cut(g, "\n")
		if strings.Contains(header, "["+state) && strings.Contains(g, fn) {
			return true
		}
	}
	return false
}

// A pump that got its data and found no other reader waiting lets the
// connection go for its next wait. A reader that begins to wait after
// that check, while the pump still holds the connection, finds it held:
// one that would read it itself sleeps (nobody holds it for it to ask),
// and one that leaves it to the receive loop wakes a loop that cannot
// take it. The pump, once it lets go, sees that reader and hands the
// connection back, so the reader's Polling is read at once rather than
// at the timer's hand-back (docs/protocol.md section 12.1).
func TestPumpLetGoSeesLaterReader(t *testing.T) {
	for _, tc := range []struct {
		name  string
		poll  time.Duration
		state string // the second reader's, asleep
	}{
		{"self", -1, "select"},
		{"loop", 50 * time.Microsecond, "chan receive"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			client, server := pair(t, &Config{PollTime: tc.poll})
			in := &client.rx.in
			in.handBackAfter = time.Hour // the timer never hands it back here
			c1, s1 := streamPair(t, client, server)
			c2, s2 := streamPair(t, client, server)
			c1.waitEWMA = 8 * time.Hour // c1's waits run long: it reads the connection itself
			got := make([]byte, 1)
			var done2 <-chan error
			client.pumpDoneHook = func(st *Stream) {
				if st != c1 || done2 != nil {
					return
				}
				done2 = readAsync(c2, got)
				// Not require: a FailNow here, on c1's reader, would
				// leave the connection held for ever, and the test's
				// cleanup with it.
				assert.Eventually(t, func() bool {
					if !goroutineWaits("(*Stream).waitForData", tc.state) {
						return false
					}
					// The loop that c2 woke (needReader) tried, and
					// failed, to take the connection.
					return tc.poll < 0 || (len(in.bgWake) == 0 && goroutineWaits("(*Session).recvLoop", "select"))
				}, 10*time.Second, 100*time.Microsecond, "the second reader sleeps")
			}
			// The receive loop has started and read the connection: c1's
			// pump below then takes it from the loop, which waits for
			// bgWake (on a busy host the loop may start late, and would
			// wait for the connection in tok.Lock instead).
			waitFor(t, "the receive loop reads the connection", func() bool {
				in.kickMu.Lock()
				defer in.kickMu.Unlock()
				return in.loopHas
			})
			done1 := readAsync(c1, make([]byte, 1))
			waitPumping(t, c1)
			_, err := s1.Write([]byte{'a'})
			require.NoError(t, err)
			require.NoError(t, result(t, done1))
			require.NotNil(t, done2, "the pump got its data without the hook")

			_, err = s2.Write([]byte{'b'})
			require.NoError(t, err)
			require.NoError(t, result(t, done2), "the second reader waits for a Polling that nobody reads")
			require.Equal(t, byte('b'), got[0])
		})
	}
}
