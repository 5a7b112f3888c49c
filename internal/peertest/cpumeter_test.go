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
	require.GreaterOrEqual(t, before[tid].run, 30*time.Millisecond, "the thread's run time before Start")

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

// TestThreadTimesWait: two threads that share one CPU and each need 20 ms
// of it wait on the run queue while the other runs, and threadTimes counts
// that wait ("runq-us/op").
func TestThreadTimesWait(t *testing.T) {
	var set unix.CPUSet
	require.NoError(t, unix.SchedGetaffinity(0, &set))
	cpu := -1
	for i := range 1024 {
		if set.IsSet(i) {
			cpu = i
			break
		}
	}
	require.GreaterOrEqual(t, cpu, 0, "no CPU in this process's mask")

	type result struct {
		tid string
		err error
	}
	ready, start := make(chan struct{}), make(chan struct{})
	results := make(chan result, 2)
	exit := make(chan struct{})
	defer close(exit)
	for range 2 {
		go func() {
			runtime.LockOSThread() // never unlocked: the bound thread ends with the goroutine
			var one unix.CPUSet
			one.Set(cpu)
			err := unix.SchedSetaffinity(0, &one)
			ready <- struct{}{}
			<-start
			// The thread may have run before (Go reuses threads): spin for
			// 20 ms more than it has used so far.
			var ts unix.Timespec
			if err == nil {
				err = unix.ClockGettime(unix.CLOCK_THREAD_CPUTIME_ID, &ts)
			}
			for err == nil && spinUntilCPU(time.Duration(ts.Nano())+20*time.Millisecond) {
			}
			results <- result{strconv.Itoa(unix.Gettid()), err}
			<-exit
		}()
	}
	<-ready
	<-ready
	before, err := threadTimes(os.Getpid())
	require.NoError(t, err)
	close(start)
	var tids []string
	for range 2 {
		r := <-results
		require.NoError(t, r.err, "binding the thread to CPU %d", cpu)
		tids = append(tids, r.tid)
	}
	after, err := threadTimes(os.Getpid())
	require.NoError(t, err)
	var run, wait time.Duration
	for _, tid := range tids {
		run += after[tid].run - before[tid].run
		wait += after[tid].wait - before[tid].wait
	}
	// 40 ms of CPU on one CPU: while one thread ran, the other waited, for
	// about 20 ms in all; the scheduler's slices make it no less than the
	// half of that asserted here.
	require.GreaterOrEqual(t, run, 40*time.Millisecond, "the threads' run time")
	require.GreaterOrEqual(t, wait, 10*time.Millisecond, "the threads' wait on the run queue")
}
