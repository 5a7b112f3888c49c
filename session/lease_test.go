package session

import (
	"context"
	"io"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// readAsync starts a read of len(buf) bytes from st and returns the channel
// that receives its error.
func readAsync(st *Stream, buf []byte) <-chan error {
	done := make(chan error, 1)
	go func() {
		_, err := io.ReadFull(st, buf)
		done <- err
	}()
	return done
}

// waitFor polls cond until it holds; the test fails after 10 s.
func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	require.Eventually(t, cond, 10*time.Second, 100*time.Microsecond, what)
}

// leaseOnce waits until the server has handled every wakeup the client
// sent, makes st's reader poll (PollTime must be long), sends it one byte
// from c, and returns once the read got it: the poll ended with a lease of
// the server's working flag.
func leaseOnce(t *testing.T, server *Session, c, st *Stream) {
	t.Helper()
	// A wakeup still on its way (from opening the stream) would settle
	// the flag after the lease: wait until the server handled them all.
	client := c.Session()
	waitFor(t, "the wakeups are handled", func() bool {
		return server.Stats().WakeupsReceived == client.Stats().WakeupsSent
	})
	buf := make([]byte, 1)
	done := readAsync(st, buf)
	waitFor(t, "the reader polls", server.rx.spinning.Load)
	_, err := c.Write([]byte{'a'})
	require.NoError(t, err)
	require.NoError(t, <-done)
	require.Equal(t, byte('a'), buf[0])
}

// leaseHeld runs leaseOnce until a poll has ended with a lease: on a
// loaded machine the reader may stop polling before the byte comes.
func leaseHeld(t *testing.T, server *Session, c, st *Stream) {
	t.Helper()
	for i := 0; server.rx.leaseSeq.Load() == 0; i++ {
		require.Less(t, i, 100, "no poll ended with a lease")
		leaseOnce(t, server, c, st)
	}
}

// A reader that got its data and comes back for more keeps the working
// flag leased in between: the writer's messages meanwhile cost no wakeup.
func TestLeaseSkipsWakeups(t *testing.T) {
	cfg := &Config{PollTime: endlessPolls(t)} // no poll or lease ends by time here
	client, server := pair(t, cfg)
	c, s := streamPair(t, client, server)
	// leaseOnce's write may set the flag and send a Polling just before the
	// reader's poll sets it; the harvest that Polling causes then settles
	// the flag after the lease (seen under qemu-user, 1 run in 40). Lease
	// again until the flag outlives every wakeup sent.
	for i := 0; ; i++ {
		require.Less(t, i, 100, "no lease outlived the wakeups")
		leaseOnce(t, server, c, s)
		waitFor(t, "the wakeups are handled", func() bool {
			return server.Stats().WakeupsReceived == client.Stats().WakeupsSent
		})
		working := false
		require.NoError(t, client.withMem(func(m *memory) error { working = m.send.Working(); return nil }))
		if working {
			break
		}
	}

	buf := make([]byte, 1)
	for i := range 50 {
		before := client.Stats().WakeupsSent
		// The server is between two reads: nobody polls its queue.
		require.False(t, server.rx.spinning.Load())
		_, err := c.Write([]byte{byte(i)})
		require.NoError(t, err)
		require.Equal(t, before, client.Stats().WakeupsSent, "message %d woke the server", i)
		_, err = io.ReadFull(s, buf)
		require.NoError(t, err)
		require.Equal(t, byte(i), buf[0])
	}
}

// A write that wakes the peer leases our own working flag first, so that
// the answer comes without a wakeup; not while a reader of ours sleeps,
// since that reader counts on one.
func TestExpectReply(t *testing.T) {
	cfg := &Config{PollTime: endlessPolls(t)}
	client, server := pair(t, cfg)
	c, s := streamPair(t, client, server)
	buf := make([]byte, 1)

	// Nobody waits on either side: the client's write wakes the server and
	// leases the client's flag; the server's answer wakes nobody.
	client.settle()
	server.settle()
	before := client.Stats().WakeupsSent
	_, err := c.Write([]byte{'q'})
	require.NoError(t, err)
	require.Equal(t, before+1, client.Stats().WakeupsSent, "the write woke the server")
	require.True(t, client.shm.mem.recv.Working(), "the client's flag is leased")
	require.True(t, client.rx.leased.Load())
	_, err = io.ReadFull(s, buf)
	require.NoError(t, err)
	serverWakes := server.Stats().WakeupsSent
	_, err = s.Write([]byte{'a'})
	require.NoError(t, err)
	require.Equal(t, serverWakes, server.Stats().WakeupsSent, "the answer woke the client")
	_, err = io.ReadFull(c, buf)
	require.NoError(t, err)
	require.Equal(t, byte('a'), buf[0])

	// A goroutine of the client's waits for the session's events (as a
	// sleeping reader counts itself): no lease, since it counts on the
	// server's wakeup.
	client.settle()
	client.rx.waiters.Add(1)
	server.settle()
	seq := client.rx.leaseSeq.Load()
	_, err = c.Write([]byte{'r'})
	client.rx.waiters.Add(-1)
	require.NoError(t, err)
	require.Equal(t, seq, client.rx.leaseSeq.Load(), "leased while a goroutine waited")
	require.False(t, client.shm.mem.recv.Working())
	_, err = io.ReadFull(s, buf)
	require.NoError(t, err)
	require.Equal(t, byte('r'), buf[0])
}

// pinHostSample dates the last host sample an hour ahead for the rest of
// the test, so that no session's timer samples meanwhile and a state the
// test forces (forceHost, forceIdleCPU) stays.
func pinHostSample(t *testing.T) {
	h := &hostIdle
	h.mu.Lock()
	at := h.at
	h.at = time.Now().Add(time.Hour)
	h.mu.Unlock()
	t.Cleanup(func() {
		h.mu.Lock()
		h.at = at
		h.mu.Unlock()
	})
}

// forceHost makes the host count as busy (no idle CPU) or not for the rest
// of the test, whatever /proc/stat says (pinHostSample).
func forceHost(t *testing.T, busy bool) {
	pinHostSample(t)
	until := int64(0)
	if busy {
		until = time.Now().Add(time.Hour).UnixNano()
	}
	hostIdle.busyUntil.Store(until)
	t.Cleanup(func() { hostIdle.busyUntil.Store(0) })
}

// A reader that has just woken its peer from a sleep (a request after a
// pause) does not poll for the answer while the host has no idle CPU: it
// sleeps at once, so that the peer can have its CPU (docs/protocol.md
// section 12.3). It polls when the host
// has an idle CPU, and when its last read ended a moment ago (a turn of a
// ping-pong: polling brings both back to traffic without wakeups).
func TestColdWakeSleeps(t *testing.T) {
	cfg := &Config{PollTime: endlessPolls(t)}
	client, server := pair(t, cfg)
	c, s := streamPair(t, client, server)
	buf := make([]byte, 1)

	exchange := func(busy, warm bool) (spun, slept bool) {
		forceHost(t, busy)
		server.settle() // asleep: the request costs a Polling
		last := monoNow() - 2*cfg.PollTime
		if warm {
			last = monoNow()
		}
		c.lastRead.Store(int64(last))
		before := client.Stats()
		_, err := c.Write([]byte{'q'})
		require.NoError(t, err)
		require.Equal(t, before.WakeupsSent+1, client.Stats().WakeupsSent, "the request woke the server")
		done := readAsync(c, buf)
		waitFor(t, "the client waits", func() bool {
			return client.rx.spinning.Load() || client.rx.waiters.Load() == 1
		})
		req := make([]byte, 1)
		_, err = io.ReadFull(s, req)
		require.NoError(t, err)
		_, err = s.Write([]byte{'a'})
		require.NoError(t, err)
		require.NoError(t, result(t, done))
		require.Equal(t, byte('a'), buf[0])
		after := client.Stats()
		// A sleep reads the connection itself, or is woken by the
		// receive loop when that held the connection just then.
		return after.SpinHits > before.SpinHits, after.Parks > before.Parks
	}

	spun, slept := exchange(true, false)
	require.False(t, spun, "polled after a cold wakeup on a busy host")
	require.True(t, slept, "did not sleep")
	spun, slept = exchange(false, false)
	require.True(t, spun, "an idle CPU: polls")
	require.False(t, slept)
	spun, slept = exchange(true, true)
	require.True(t, spun, "a ping-pong's turn: polls")
	require.False(t, slept)
}

// A poll that ends while another reader sleeps waiting for the session's
// events settles the flag instead of leasing it, so that the peer's next
// event wakes the sleeper.
func TestLeaseYieldsToBlockedReader(t *testing.T) {
	cfg := &Config{PollTime: endlessPolls(t)}
	client, server := pair(t, cfg)
	ca, sa := streamPair(t, client, server)
	cb, sb := streamPair(t, client, server)
	leaseOnce(t, server, ca, sa)

	// A polls again; B, finding a poller, sleeps.
	bufA, bufB := make([]byte, 1), make([]byte, 1)
	doneA := readAsync(sa, bufA)
	waitFor(t, "A polls", server.rx.spinning.Load)
	require.NoError(t, sb.SetReadDeadline(time.Now().Add(10*time.Second)))
	doneB := readAsync(sb, bufB)
	waitFor(t, "B sleeps", func() bool { return server.rx.waiters.Load() == 1 })

	_, err := ca.Write([]byte{'A'})
	require.NoError(t, err)
	require.NoError(t, <-doneA)

	before := client.Stats().WakeupsSent
	_, err = cb.Write([]byte{'B'})
	require.NoError(t, err)
	require.NoError(t, <-doneB, "B's data waited for a lease to end")
	require.Equal(t, byte('B'), bufB[0])
	require.Equal(t, before+1, client.Stats().WakeupsSent, "B's data came with a wakeup")
}

// A lease that no poll renews ends by itself: the flag goes back to 0, the
// events that came meanwhile are delivered without a reader, and the
// session's timer stops.
func TestLeaseExpires(t *testing.T) {
	cfg := &Config{PollTime: pollWindow(t)}
	client, server := pair(t, cfg)
	c, s := streamPair(t, client, server)
	leaseHeld(t, server, c, s)
	_, err := c.Write([]byte("late"))
	require.NoError(t, err)
	waitFor(t, "the flag is settled", func() bool {
		return !server.shm.mem.recv.Working() && !server.rx.leased.Load()
	})
	waitFor(t, "the late bytes are delivered", func() bool { return s.Buffered() == 4 })
	waitFor(t, "the timer stops", func() bool { return timerIdle(server) })
	buf := make([]byte, 4)
	_, err = io.ReadFull(s, buf)
	require.NoError(t, err)
	require.Equal(t, "late", string(buf))
}

// A new stream's announcement wakes the server even while its flag is
// leased: AcceptStream does not wait for the lease to end.
func TestAnnounceWakesLeasedServer(t *testing.T) {
	cfg := &Config{PollTime: endlessPolls(t)}
	client, server := pair(t, cfg)
	c, s := streamPair(t, client, server)
	// The client's write may see the flag still 0, just before the spin
	// sets it (slow under an emulator), and send a Polling whose harvest
	// settles the flag after the lease: wait for every wakeup to be
	// handled, and lease again if one settled it.
	for i := 0; ; i++ {
		require.Less(t, i, 100, "no lease outlived the client's wakeups")
		leaseOnce(t, server, c, s)
		waitFor(t, "the wakeups are handled", func() bool {
			return server.Stats().WakeupsReceived == client.Stats().WakeupsSent
		})
		if server.shm.mem.recv.Working() {
			break
		}
	}

	before := client.Stats().WakeupsSent
	st, err := client.OpenStream(t.Context())
	require.NoError(t, err)
	defer st.Close()
	require.Equal(t, before+1, client.Stats().WakeupsSent)
	ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
	defer cancel()
	acc, err := server.AcceptStream(ctx)
	require.NoError(t, err)
	require.Equal(t, st.ID(), acc.ID())
}

// pollWindow lifts the bound on PollTime for the test and returns a
// PollTime whose base poll (basePoll) is 10 ms: a reader polls long
// enough for the test to see it poll on a loaded machine, and a lease
// still ends by the session's timer (at least PollTime after it began).
// With a base poll of 2.5 ms (PollTime 10 ms) the window was missed in 1
// of 3 runs of make test beside a busy loop.
func pollWindow(t *testing.T) time.Duration {
	const p = stretchPolls * 10 * time.Millisecond
	old := maxPollTime.Swap(int64(p))
	t.Cleanup(func() { maxPollTime.Store(old) })
	return p
}

// endlessPolls lifts the bound on PollTime for the test and returns a
// PollTime (an hour) by which no poll or lease ends.
func endlessPolls(t *testing.T) time.Duration {
	old := maxPollTime.Swap(int64(time.Hour))
	t.Cleanup(func() { maxPollTime.Store(old) })
	return time.Hour
}
