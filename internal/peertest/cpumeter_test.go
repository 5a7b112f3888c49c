package peertest

import (
	"os"
	"runtime"
	"strconv"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"
)

// TestCPUMeterThreadExit: a thread that ran before Start and exits before
// Stop takes nothing off the measurement. Summing the live threads at each
// end took its run time at Start off instead, which made "cpu-us/op"
// negative in BenchmarkPaced.
func TestCPUMeterThreadExit(t *testing.T) {
	m := NewCPUMeter(os.Getpid())
	// The goroutine's thread exits with it, unless it is the main thread,
	// which Go keeps (wedged): then another goroutine tries.
	var tid string
	exit := make(chan struct{})
	for tid == "" {
		tids := make(chan int)
		go func() {
			// Locked and never unlocked: the thread ends with the goroutine.
			runtime.LockOSThread()
			for spinUntilCPU(30 * time.Millisecond) {
			}
			tids <- unix.Gettid()
			<-exit
		}()
		if id := <-tids; id != os.Getpid() {
			tid = strconv.Itoa(id)
		}
	}
	before, err := threadTimes(os.Getpid())
	require.NoError(t, err)
	require.GreaterOrEqual(t, before[tid], 30*time.Millisecond, "the thread's run time before Start")

	m.Start(t)
	close(exit)
	require.Eventually(t, func() bool {
		ts, err := threadTimes(os.Getpid())
		_, live := ts[tid]
		return err == nil && !live
	}, 10*time.Second, time.Millisecond, "thread %s did not exit", tid)
	used := m.Stop(t)
	require.GreaterOrEqual(t, used, time.Duration(0), "CPU time since Start")
	require.Less(t, used, 10*time.Second, "CPU time since Start")
}

// spinUntilCPU reports whether the calling thread has used less than d of
// CPU time (false also if the clock cannot be read: the test's check of
// the thread's run time then fails).
func spinUntilCPU(d time.Duration) bool {
	var ts unix.Timespec
	return unix.ClockGettime(unix.CLOCK_THREAD_CPUTIME_ID, &ts) == nil && time.Duration(ts.Nano()) < d
}
