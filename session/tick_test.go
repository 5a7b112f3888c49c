package session

import (
	"errors"
	"testing"
	"time"

	"github.com/shmlink/shmlink/internal/wire"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"
)

// timerIdle reports whether s's timer is disarmed, or armed only for a
// host sample (docs/protocol.md section 12.2).
func timerIdle(s *Session) bool {
	tk := &s.tk
	tk.mu.Lock()
	defer tk.mu.Unlock()
	return !tk.early.Load() && (tk.due == 0 || tk.due == tk.claimAt)
}

// withGoTimer makes the sessions that the test creates use a Go timer, as
// where no timerfd can be made.
func withGoTimer(t *testing.T) {
	saved := timerfdCreate
	timerfdCreate = func(int, int) (int, error) { return -1, errors.New("no timerfd here") }
	t.Cleanup(func() { timerfdCreate = saved })
}

// Requests that come in gaps leave the timer disarmed between them: a
// reader's let-go arms it, and the same reader's next wait, which takes
// the connection again, disarms it. The timer looks after nothing then.
func TestTimerQuietBetweenRequests(t *testing.T) {
	for _, goTimer := range []bool{false, true} {
		name := map[bool]string{false: "timerfd", true: "go-timer"}[goTimer]
		t.Run(name, func(t *testing.T) {
			if goTimer {
				withGoTimer(t)
			}
			mem, server, write := rawClient(t, nil, &Config{PollTime: -1})
			require.Equal(t, goTimer, server.tk.tfd == nil)
			announceRaw(t, mem, 2, write)
			st := accept(t, server)
			got := make([]byte, 2)
			for i := range 20 {
				// Requests that come in gaps: denseLetGap apart at least
				// (a pace, not a synchronisation).
				time.Sleep(denseLetGap)
				done := readAsync(st, got)
				waitPumping(t, st)
				require.True(t, timerIdle(server), "request %d: the timer runs while the reader waits", i)
				putRaw(t, mem, 2, "hi")
				require.NoError(t, write(wire.AppendSimple(nil, 3, wire.TypePolling)))
				require.NoError(t, result(t, done))
				require.Equal(t, "hi", string(got))
			}
			require.EqualValues(t, 20, server.Stats().SelfWakes)
		})
	}
}

// While let-goes come less than denseLetGap apart, a reader that takes
// the connection again leaves the timer armed; once they come further
// apart, it disarms it.
func TestTimerStaysArmedWhileDense(t *testing.T) {
	_, server := pair(t, &Config{PollTime: -1})
	in := &server.rx.in
	in.letGap.Store(int64(denseLetGap / 2))
	server.tk.poke(time.Hour)
	require.True(t, server.tk.early.Load())
	in.taken(server)
	require.True(t, server.tk.early.Load(), "disarmed between requests that come close together")
	in.letGap.Store(int64(denseLetGap))
	in.taken(server)
	require.True(t, timerIdle(server), "armed between requests that come in gaps")
}

// The connection that a reader let go goes back to the receive loop when
// the timer fires, with a Go timer as with a timerfd; and a lease that no
// poll renews ends.
func TestTimerGoFallback(t *testing.T) {
	withGoTimer(t)
	mem, server, write := rawClient(t, nil, &Config{PollTime: -1})
	require.Nil(t, server.tk.tfd)
	announceRaw(t, mem, 2, write)
	st := accept(t, server)
	pumpRead(t, mem, write, st, "hi")
	announceRaw(t, mem, 4, write) // nobody reads the connection now
	require.EqualValues(t, 4, accept(t, server).ID())
	require.NotZero(t, server.tk.ticks.Load(), "the timer handed the connection back")
	waitFor(t, "the timer stops", func() bool { return timerIdle(server) })
}

// A firing of an earlier setting than the timer's last (it expired while a
// poke re-armed it) leaves the timerfd set as the ticker says: here
// disarmed, since nothing is pending.
func TestTickSetsTimerfd(t *testing.T) {
	_, server := pair(t, nil)
	tk := &server.tk
	tk.poke(time.Hour)
	server.tick() // as if an earlier setting had fired
	tk.mu.Lock()
	due := tk.due
	tk.mu.Unlock()
	var cur unix.ItimerSpec
	var err error
	require.NoError(t, tk.rc.Control(func(fd uintptr) { err = unix.TimerfdGettime(int(fd), &cur) }))
	require.NoError(t, err)
	require.Equal(t, due != 0, cur.Value.Sec != 0 || cur.Value.Nsec != 0,
		"the ticker's due (%v) and the timerfd's setting (%v) disagree", due, cur.Value)
}

// A session's end closes its timerfd and ends the goroutine that reads
// it; a poke afterwards arms nothing.
func TestTimerStops(t *testing.T) {
	client, server := pair(t, nil)
	require.NotNil(t, server.tk.tfd)
	require.NoError(t, client.Close())
	select {
	case <-server.Done():
	case <-time.After(10 * time.Second):
		t.Fatal("the server did not see the close")
	}
	server.tk.poke(time.Millisecond)
	require.True(t, server.tk.stopped.Load())
	waitFor(t, "the timer's file is closed", func() bool {
		return server.tk.rc.Write(func(uintptr) bool { return true }) != nil
	})
}

// A tick that ends a lease harvests what the lease held back, which may
// end the session: here the peer's close of the last stream of a session
// marked CloseWhenIdle. The session's end stops the timer from inside the
// tick; it must not wait for the tick. (On a loaded machine the lease may
// end before the close comes, which then comes with a Polling for the
// receive loop; the session must end either way. Before the fix, the
// test hung in its first run on an idle machine.)
func TestTickEndsSession(t *testing.T) {
	cfg := &Config{PollTime: pollWindow(t)}
	client, server := pair(t, cfg)
	c, s := streamPair(t, client, server)
	leaseHeld(t, server, c, s)
	server.CloseWhenIdle()
	require.NoError(t, s.Close())
	require.NoError(t, c.Close())
	select {
	case <-server.Done():
	case <-time.After(10 * time.Second):
		t.Fatal("the session did not end: its timer's tick is stuck")
	}
}

// Arming and disarming the timerfd, which a request that comes in a gap
// does once each, allocates nothing.
func TestTimerArmsWithoutAllocating(t *testing.T) {
	_, server := pair(t, nil)
	tk := &server.tk
	require.NotNil(t, tk.tfd)
	allocs := testing.AllocsPerRun(100, func() {
		tk.mu.Lock()
		tk.setLocked(tk.now(), tk.now()+time.Hour)
		tk.setLocked(tk.now(), 0)
		tk.mu.Unlock()
	})
	require.Zero(t, allocs)
}
