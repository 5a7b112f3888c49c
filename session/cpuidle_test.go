package session

import (
	"os"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"
)

func TestParseCPULine(t *testing.T) {
	for _, tc := range []struct {
		in          string
		idle, total uint64
		ok          bool
	}{
		// user nice system idle iowait irq softirq steal guest guest_nice
		{"cpu  100 2 30 400 5 0 7 8 9 10\ncpu0 1 2 3 4\n", 405, 552, true},
		{"cpu  100 2 30 400\n", 400, 532, true}, // an old kernel: 4 fields
		{"cpu 1 2 3", 0, 0, false},              // too few fields
		{"cpu0 1 2 3 4 5 6 7 8\n", 0, 0, false}, // not the aggregate line
		{"intr 1 2 3 4 5\n", 0, 0, false},
		{"cpu  1 x 3 4 5\n", 0, 0, false},
		{"cpu  99999999999999999999999 1 1 1\n", 0, 0, false}, // overflows
		{"", 0, 0, false},
	} {
		idle, total, ok := parseCPULine([]byte(tc.in))
		require.Equal(t, tc.ok, ok, "%q", tc.in)
		if ok {
			require.Equal(t, tc.idle, idle, "%q", tc.in)
			require.Equal(t, tc.total, total, "%q", tc.in)
		}
	}
}

// The host counts as having an idle CPU for idleValidFor after a sample
// whose idle share reached idleEnoughPercent, and not after one below it.
func TestHostIdleRecord(t *testing.T) {
	var h hostIdleState
	t0 := time.Now()
	h.record(t0, 1000, 4000)
	require.False(t, h.hasIdle(t0), "one sample says nothing")

	require.False(t, h.busy(t0))

	h.record(t0.Add(20*time.Millisecond), 1000+50, 4000+100) // 50% idle
	require.True(t, h.hasIdle(t0.Add(20*time.Millisecond)))
	require.False(t, h.busy(t0.Add(20*time.Millisecond)))
	require.False(t, h.hasIdle(t0.Add(20*time.Millisecond+idleValidFor)), "a sample goes stale")

	h.record(t0.Add(40*time.Millisecond), 1050+10, 4100+100) // 10% idle
	require.False(t, h.hasIdle(t0.Add(40*time.Millisecond)), "less than idleEnoughPercent")
	require.False(t, h.busy(t0.Add(40*time.Millisecond)), "not below idleNonePercent")

	h.record(t0.Add(60*time.Millisecond), 1060, 4200+100) // no idle time at all
	require.False(t, h.hasIdle(t0.Add(60*time.Millisecond)))
	require.True(t, h.busy(t0.Add(60*time.Millisecond)), "every CPU busy")
	require.False(t, h.busy(t0.Add(60*time.Millisecond+idleValidFor)), "a sample goes stale")

	h.record(t0.Add(80*time.Millisecond), 1060+4, 4300+100) // 4% idle
	require.True(t, h.busy(t0.Add(80*time.Millisecond)))
	h.record(t0.Add(100*time.Millisecond), 1064+5, 4400+100) // 5% idle
	require.False(t, h.busy(t0.Add(100*time.Millisecond)))
}

// This host's /proc/stat parses, and a sample is taken at most once per
// idleSampleEvery.
func TestSampleHostIdle(t *testing.T) {
	var buf [512]byte
	idle, total, ok := readProcStat(&buf)
	require.True(t, ok)
	require.Greater(t, total, idle)

	h := &hostIdle
	h.mu.Lock()
	saved := struct {
		at          time.Time
		idle, total uint64
	}{h.at, h.idle, h.total}
	h.at = time.Time{} // no sample yet: the next one decides nothing
	h.mu.Unlock()
	until, busyUntil := h.until.Load(), h.busyUntil.Load()
	t.Cleanup(func() {
		h.mu.Lock()
		h.at, h.idle, h.total = saved.at, saved.idle, saved.total
		h.mu.Unlock()
		h.until.Store(until)
		h.busyUntil.Store(busyUntil)
	})

	now := time.Now()
	sampleHostIdle(now)
	h.mu.Lock()
	at := h.at
	h.mu.Unlock()
	require.Equal(t, now, at)
	sampleHostIdle(now.Add(idleSampleEvery / 2))
	h.mu.Lock()
	at = h.at
	h.mu.Unlock()
	require.Equal(t, now, at, "sampled again within idleSampleEvery")
}

// A session whose timer would stop keeps it for the process's next host
// sample, unless another session's timer is to take it; a claim stands
// until its time, and the next one is due idleSampleEvery after the last
// sample, or sampleDelay from now if that is later.
func TestClaimSample(t *testing.T) {
	var h hostIdleState
	ms := time.Millisecond
	h.sampled.Store(int64(100 * ms))

	a := h.claimSample(110*ms, 0)
	require.Equal(t, 140*ms, a, "the next sample is due 40 ms after the last")
	require.Zero(t, h.claimSample(110*ms, 0), "another session's timer is to take it")
	require.Equal(t, a, h.claimSample(120*ms, a), "the claim stands for its holder")

	// The claimer's session ended before its time: the claim expires.
	b := h.claimSample(150*ms, 0)
	require.Equal(t, 150*ms+sampleDelay, b, "a sample already due is taken after sampleDelay")
	require.Zero(t, h.claimSample(150*ms, a), "an expired claim is not its holder's any more")

	h.sampled.Store(int64(152 * ms)) // b's timer took it
	require.Equal(t, 192*ms, h.claimSample(160*ms, 0))
}

// TestMain pins the host's state for the package's tests: neither busy
// nor with an idle CPU, and never sampled (the last sample is dated a
// century ahead), so that how a test's readers poll does not depend on
// what else the machine runs. Tests of the host-dependent paths force a
// state (forceHost) or sample explicitly (TestSampleHostIdle).
func TestMain(m *testing.M) {
	hostIdle.mu.Lock()
	hostIdle.at = time.Now().AddDate(100, 0, 0)
	hostIdle.mu.Unlock()
	hostIdle.until.Store(0)
	hostIdle.busyUntil.Store(0)
	hostIdle.sampled.Store(int64(monoNow() + 100*365*24*time.Hour)) // no timer waits for a sample
	os.Exit(m.Run())
}

// rawProcRead reads what a plain read of the file gives, fails on a path
// that does not exist, and closes what it opened.
func TestRawProcRead(t *testing.T) {
	fds := func() int {
		ents, err := os.ReadDir("/proc/self/fd")
		require.NoError(t, err)
		return len(ents)
	}
	before := fds()
	var buf [512]byte
	for range 100 {
		n, ok := rawProcRead(procStatPath, buf[:])
		require.True(t, ok)
		require.Equal(t, len(buf), n, "/proc/stat is longer than the buffer")
		require.Equal(t, "cpu ", string(buf[:4]))
	}
	require.Equal(t, before, fds(), "descriptors left open")

	want, err := os.ReadFile("/proc/self/comm") // the same at every read
	require.NoError(t, err)
	comm, err := unix.BytePtrFromString("/proc/self/comm")
	require.NoError(t, err)
	n, ok := rawProcRead(comm, buf[:])
	require.True(t, ok)
	require.Equal(t, string(want), string(buf[:n]))

	missing, err := unix.BytePtrFromString("/proc/no-such-file")
	require.NoError(t, err)
	_, ok = rawProcRead(missing, buf[:])
	require.False(t, ok)
	require.Equal(t, before, fds())
}
