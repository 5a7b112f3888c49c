package session

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// Stats counts how a reader's waits ended: with polling off every wait
// sleeps, none spins; with an endless PollTime every wait ends in its spin.
func TestWaitStats(t *testing.T) {
	for _, tc := range []struct {
		name   string
		cfg    func(t *testing.T) *Config
		spins  bool
		sleeps bool
	}{
		{"polling off", func(*testing.T) *Config { return &Config{PollTime: -1} }, false, true},
		{"endless polls", func(t *testing.T) *Config { return &Config{PollTime: endlessPolls(t)} }, true, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			client, server := pair(t, tc.cfg(t))
			c, s := streamPair(t, client, server)
			before := client.Stats()
			got := make([]byte, 1)
			for i := range 20 {
				done := readAsync(c, got)
				// Write only once the reader waits, so that every read
				// call waits once.
				waitFor(t, "the reader waits", func() bool {
					return client.rx.spinning.Load() || client.rx.waiters.Load() > 0
				})
				_, err := s.Write([]byte{byte(i)})
				require.NoError(t, err)
				require.NoError(t, <-done)
				require.Equal(t, byte(i), got[0])
			}
			st := client.Stats()
			if tc.spins {
				require.Equal(t, before.SpinHits+20, st.SpinHits, "%+v", st)
				require.Equal(t, before.Parks, st.Parks)
			}
			if tc.sleeps {
				// Every read slept at least once. A wait may end without
				// the data and sleep again (waitForData may return when
				// something only may have changed: a wakeup left from the
				// read before, while the receive loop held the connection).
				require.GreaterOrEqual(t, st.Parks, before.Parks+20, "%+v", st)
				require.Equal(t, before.SpinHits, st.SpinHits)
				require.Equal(t, before.SpinMisses, st.SpinMisses)
			}
		})
	}
}

// spinBudget polls for PollTime unless the stream's waits ran longer than
// longWaits PollTimes: then only one wait in probeEvery polls, and the
// mean comes back down within a dozen quick waits. Waits that slept for a
// wakeup's time keep polling by this rule; on a host known to have an idle
// CPU, a run of them stops it (vainPolls, TestVainPolls), and the package's
// tests run with no such host (TestMain).
func TestSpinBudget(t *testing.T) {
	const limit = 50 * time.Microsecond
	st := &Stream{s: &Session{cfg: Config{PollTime: stretchPolls * limit}}}
	require.Equal(t, limit, st.spinBudget(false, false), "nothing learned yet")
	for range 50 {
		st.recordWait(150 * time.Microsecond) // both sides asleep: a wakeup each way
	}
	require.Equal(t, limit, st.spinBudget(false, false), "waits of a wakeup's time keep polling")

	for range 30 {
		st.recordWait(time.Second) // requests in gaps
	}
	require.LessOrEqual(t, st.waitEWMA, 2*longWaits*limit, "a long wait counts as 2*longWaits PollTimes at most")
	polls := 0
	for range 4 * probeEvery {
		if st.spinBudget(false, false) > 0 {
			polls++
		}
	}
	require.Equal(t, 4, polls, "one probe in probeEvery waits")

	waits := 0
	for st.spinBudget(false, false) == 0 || st.waitEWMA > longWaits*limit {
		st.recordWait(3 * time.Microsecond)
		waits++
		require.Less(t, waits, 12, "the mean stays up after traffic sped up")
	}

	off := &Stream{s: &Session{cfg: Config{PollTime: -1}}}
	off.recordWait(time.Second)
	require.LessOrEqual(t, off.spinBudget(false, false), time.Duration(0), "PollTime < 0: no polling")
}

// Waits after a pause poll or sleep at once by what such waits took:
// when sleeping costs no more than polling, the stream sleeps, and polls
// once in probeEvery waits; when polling catches the answer sooner, it
// polls, and sleeps once in probeEvery. Other waits are not affected.
func TestPauseBudget(t *testing.T) {
	const limit = 50 * time.Microsecond
	// run makes n waits after a pause, each taking polled or slept by the
	// way chosen, and returns how many slept at once.
	run := func(st *Stream, n int, polled, slept time.Duration) (sleeps int) {
		for range n {
			if st.spinBudget(true, true) == 0 {
				sleeps++
				st.recordWait(slept)
			} else {
				st.recordWait(polled)
			}
		}
		return sleeps
	}
	forceHost(t, false) // a host with a CPU to spare: a busy one never polls here
	st := &Stream{s: &Session{cfg: Config{PollTime: stretchPolls * limit}}}
	require.Equal(t, 1, run(st, probeEvery, 42*time.Microsecond, 43*time.Microsecond),
		"nothing learned: polls, and tries sleeping once")
	// A VM whose idle CPUs poll: a reader that slept wakes as fast.
	sleeps := run(st, 4*probeEvery, 42*time.Microsecond, 43*time.Microsecond)
	require.Equal(t, 4*probeEvery-4, sleeps, "sleeping costs no more: sleeps, polls once in probeEvery")
	require.Equal(t, st.stretched(limit), st.spinBudget(false, false), "a wait that is not after a pause still polls")

	// Sleeping now costs a wakeup of 40 µs more: back to polling within
	// a few probes.
	waits := 0
	for st.prefersSleep() {
		run(st, 1, 42*time.Microsecond, 80*time.Microsecond)
		waits++
		require.Less(t, waits, 4*probeEvery, "still sleeping after %d waits", waits)
	}
	sleeps = run(st, 4*probeEvery, 42*time.Microsecond, 80*time.Microsecond)
	require.Equal(t, 4, sleeps, "polling pays: polls, sleeps once in probeEvery")
	forceHost(t, true)
	require.Zero(t, st.spinBudget(true, true), "busy host: a cold wakeup never polls")
	require.Equal(t, wayNone, st.pauseWay, "and does not count as a way tried")

	off := &Stream{s: &Session{cfg: Config{PollTime: -1}}}
	require.LessOrEqual(t, off.spinBudget(true, true), time.Duration(0), "PollTime < 0: no polling")
	require.Equal(t, wayNone, off.pauseWay)
}

// forceIdleCPU makes the host count as having an idle CPU for the rest of
// the test, whatever /proc/stat says (pinHostSample).
func forceIdleCPU(t *testing.T) {
	pinHostSample(t)
	until := hostIdle.until.Swap(time.Now().Add(time.Hour).UnixNano())
	t.Cleanup(func() { hostIdle.until.Store(until) })
}

// On a host with an idle CPU, a stream whose last vainPolls waits each
// outlasted PollTime (answers a few PollTimes away, whose mean alone keeps
// it polling) sleeps at once, and polls once in probeEvery waits; a wait
// within PollTime ends that. Where the host is not known to have an idle
// CPU, the same waits keep polling until busyVainPolls of them.
func TestVainPolls(t *testing.T) {
	const limit = 50 * time.Microsecond
	pinHostSample(t) // no idle CPU known, whatever /proc/stat says
	until := hostIdle.until.Swap(0)
	t.Cleanup(func() { hostIdle.until.Store(until) })
	st := &Stream{s: &Session{cfg: Config{PollTime: stretchPolls * limit}}}
	for i := range busyVainPolls {
		require.Equal(t, limit, st.spinBudget(false, false), "no idle CPU known: polls after %d waits", i)
		st.recordWait(3 * limit)
	}
	polls := 0
	for range 4 * probeEvery {
		if st.spinBudget(false, false) > 0 {
			polls++
		}
		st.recordWait(3 * limit)
	}
	require.Equal(t, 4, polls, "no idle CPU known, after busyVainPolls waits: one probe in probeEvery")
	st.recordWait(limit / 2)
	require.Equal(t, st.stretched(limit), st.spinBudget(false, false), "a probe caught its answer: polls again")

	forceIdleCPU(t)
	st = &Stream{s: &Session{cfg: Config{PollTime: stretchPolls * limit}}}
	for i := range vainPolls {
		require.Equal(t, limit, st.spinBudget(false, false), "after %d waits of 3 PollTimes", i)
		st.recordWait(3 * limit)
	}
	require.LessOrEqual(t, st.waitEWMA, longWaits*limit, "the mean alone would keep polling")
	polls = 0
	for range 4 * probeEvery {
		if st.spinBudget(false, false) > 0 {
			polls++
		}
		st.recordWait(3 * limit)
	}
	require.Equal(t, 4, polls, "one probe in probeEvery waits")
	require.True(t, st.selfWake(st.spinBudget(false, false)), "a wait that does not poll reads the connection itself")

	st.recordWait(limit / 2) // a probe caught its answer
	require.Equal(t, limit, st.spinBudget(false, false), "polls again")
}

// On a host not known to be busy, a stream whose polls caught answers that
// took on average more than a quarter of a base poll polls for
// stretchFactor times that mean, up to PollTime (docs/protocol.md section
// 12.7). A wait within its stretched poll is no miss, and the probes of a
// stream that stopped polling poll that long too. A busy host, and waits
// after a pause, poll for a base poll.
func TestStretch(t *testing.T) {
	const base = 50 * time.Microsecond
	forceHost(t, false)
	st := &Stream{s: &Session{cfg: Config{PollTime: stretchPolls * base}}}
	require.Equal(t, base, st.s.basePoll())
	for i := range 50 {
		require.Equal(t, base, st.spinBudget(false, false), "answers within 5 µs, wait %d", i)
		st.recordWait(5 * time.Microsecond)
	}

	// Answers now come in 40 µs: the poll stretches to about 160 µs.
	for range 50 {
		require.Positive(t, st.spinBudget(false, false))
		st.recordWait(40 * time.Microsecond)
	}
	b := st.spinBudget(false, false)
	require.Equal(t, stretchFactor*st.hitEWMA, b)
	require.InDelta(t, float64(stretchFactor*40*time.Microsecond), float64(b), float64(time.Microsecond))
	got, want := st.spinBudget(true, true), base
	if got == 0 {
		want = 0 // pauseBudget tried sleeping at once
	}
	require.Equal(t, want, got, "a wait after a pause polls for a base poll")

	// Answers in 100 µs: caught by the stretched poll, so no misses, and
	// the poll grows to PollTime, no further.
	for i := range 50 {
		b := st.spinBudget(false, false)
		require.GreaterOrEqual(t, b, 100*time.Microsecond, "wait %d", i)
		st.recordWait(100 * time.Microsecond)
		require.Zero(t, st.missRun, "wait %d was caught", i)
	}
	require.Equal(t, st.s.cfg.PollTime, st.spinBudget(false, false), "at most PollTime")
	forceHost(t, true)
	require.Equal(t, base, st.spinBudget(false, false), "busy host: a base poll")
	forceHost(t, false)

	// Answers later than PollTime: on a host with an idle CPU, vainPolls
	// misses stop polling; the probes poll for the stretched time.
	forceIdleCPU(t)
	for i := range vainPolls {
		require.Equal(t, st.s.cfg.PollTime, st.spinBudget(false, false), "wait %d", i)
		st.recordWait(300 * time.Microsecond)
	}
	probes := 0
	for range 4 * probeEvery {
		if b := st.spinBudget(false, false); b > 0 {
			require.Equal(t, st.s.cfg.PollTime, b, "a probe's poll")
			probes++
		}
		st.recordWait(300 * time.Microsecond)
	}
	require.Equal(t, 4, probes, "one probe in probeEvery waits")
}

// A stream whose stretched polls miss more than twice for each answer they
// catch polls for a base poll again, and stretches in one wait of
// probeEvery, until those catch answers again: gRPC calls of 64 KB, whose
// frames come within a poll of each other and whose answers come later
// than PollTime.
func TestStretchScore(t *testing.T) {
	const base = 50 * time.Microsecond
	forceHost(t, false)
	st := &Stream{s: &Session{cfg: Config{PollTime: stretchPolls * base}}}
	for range 50 {
		st.spinBudget(false, false)
		st.recordWait(40 * time.Microsecond)
	}
	require.Greater(t, st.spinBudget(false, false), base, "answers in 40 µs: stretched")

	// Frames 30 µs apart, answers in 300 µs: every stretched poll misses.
	frames := func(n int) (stretched int) {
		for i := range 2 * n {
			b := st.spinBudget(false, false)
			require.GreaterOrEqual(t, b, base, "wait %d: the caught frames keep it polling", i)
			if b > base {
				stretched++
			}
			if i%2 == 0 {
				st.recordWait(30 * time.Microsecond)
			} else {
				st.recordWait(300 * time.Microsecond)
			}
		}
		return stretched
	}
	frames(3 * stretchCap)
	require.Negative(t, st.stretchScore)
	require.Equal(t, 4, frames(2*probeEvery), "one stretched wait in probeEvery")

	// Answers in 100 µs again: the probes catch them, and it stretches.
	waits := 0
	for st.stretchScore < 0 {
		st.spinBudget(false, false)
		st.recordWait(100 * time.Microsecond)
		waits++
		require.Less(t, waits, (stretchCap/stretchWin+1)*probeEvery, "still not stretching")
	}
	require.Greater(t, st.spinBudget(false, false), base)
}
