package peertest

import (
	"bufio"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"
)

// Tools of the benchmarks (bench_test.go, example/grpc's benchmarks): the
// server process, the CPU time of a process, a process that keeps every
// core busy, and the percentiles of round-trip times.

// threadTime is what the scheduler counted for a thread so far: the time
// it ran, and the time it waited on a run queue, runnable but not running
// (the first two fields of /proc/<pid>/task/<tid>/schedstat).
type threadTime struct {
	run, wait time.Duration
}

// threadTimes returns the run and run-queue wait times of each live thread
// of process pid so far, by thread id, in nanoseconds as the scheduler
// counts them (schedstat): unlike /proc/<pid>/stat, whose clock ticks are
// 10 ms, they resolve one round trip. A thread that already exited is not
// listed. It returns an error when /proc cannot be read or a schedstat
// file is malformed.
func threadTimes(pid int) (map[string]threadTime, error) {
	dir := fmt.Sprintf("/proc/%d/task", pid)
	tasks, err := os.ReadDir(dir)
	if err != nil {
		return nil, err
	}
	ts := make(map[string]threadTime, len(tasks))
	for _, t := range tasks {
		b, err := os.ReadFile(dir + "/" + t.Name() + "/schedstat")
		if err != nil {
			continue // the thread exited meanwhile
		}
		f := strings.Fields(string(b))
		if len(f) < 2 {
			return nil, fmt.Errorf("%s/%s/schedstat: %q: want its run and wait times", dir, t.Name(), b)
		}
		run, err1 := strconv.ParseInt(f[0], 10, 64)
		wait, err2 := strconv.ParseInt(f[1], 10, 64)
		if err := errors.Join(err1, err2); err != nil {
			return nil, fmt.Errorf("%s/%s/schedstat: %q: %w", dir, t.Name(), b, err)
		}
		ts[t.Name()] = threadTime{time.Duration(run), time.Duration(wait)}
	}
	return ts, nil
}

// A CPUMeter measures the CPU time a set of processes uses between its
// Start and Stop.
type CPUMeter struct {
	pids []int
	at   []map[string]threadTime // per process, each thread's times at Start
	// dist is the CPUs' distance (CPUDistance) when the meter was made; 0
	// if not measured.
	dist time.Duration
}

// NewCPUMeter returns a meter of the processes pids (this process is
// os.Getpid()). A benchmark's meter lists the client first and its server
// second: ReportCPU then reports the server's share too, and the placement
// of the CPUs ("xcpu-ns"), which NewCPUMeter measures a first time. Make
// the meter before the benchmark's timer starts: the measurement holds two
// CPUs for up to 2 ms.
func NewCPUMeter(pids ...int) *CPUMeter {
	m := &CPUMeter{pids: pids}
	if len(pids) == 2 {
		m.dist = placement()
	}
	return m
}

// placement returns the distance (CPUDistance) between the first two CPUs
// of this process's mask; 0 when there are fewer, when another process
// keeps the CPUs busy (StartHog: the measurement would wait for time
// slices), or when it fails.
func placement() time.Duration {
	if hogs.Load() > 0 {
		return 0
	}
	cpus := allowedCPUs()
	if len(cpus) < 2 {
		return 0
	}
	d, err := CPUDistance(cpus[0], cpus[1])
	if err != nil {
		return 0
	}
	return d
}

// times returns the run and wait times of each thread of each process so
// far.
func (m *CPUMeter) times(tb testing.TB) []map[string]threadTime {
	ts := make([]map[string]threadTime, len(m.pids))
	for i, pid := range m.pids {
		t, err := threadTimes(pid)
		if err != nil {
			tb.Fatal(err)
		}
		ts[i] = t
	}
	return ts
}

// Start records the processes' CPU time now.
func (m *CPUMeter) Start(tb testing.TB) { m.at = m.times(tb) }

// since returns the CPU time each process used since Start, and the time
// its threads waited on a run queue: what each of its live threads added
// since then (all of it for a thread started since). A thread that exited
// since Start counts nothing, rather than take its time at Start off the
// sum (which made "cpu-us/op" negative): its time after Start is lost, a
// slight undercount.
func (m *CPUMeter) since(tb testing.TB) (run, wait []time.Duration) {
	run = make([]time.Duration, len(m.pids))
	wait = make([]time.Duration, len(m.pids))
	for i, now := range m.times(tb) {
		for tid, t := range now {
			run[i] += t.run - m.at[i][tid].run
			wait[i] += t.wait - m.at[i][tid].wait
		}
	}
	return run, wait
}

// Stop returns the CPU time the processes used since Start, summed.
func (m *CPUMeter) Stop(tb testing.TB) time.Duration {
	run, _ := m.since(tb)
	return total(run)
}

// total returns the sum of ds.
func total(ds []time.Duration) time.Duration {
	var sum time.Duration
	for _, d := range ds {
		sum += d
	}
	return sum
}

// ReportCPU reports the CPU time of m's processes since Start per
// operation of b, in microseconds, as the metric "cpu-us/op": what both
// ends of a transport spent on each operation, spinning included; and the
// time their threads waited for a CPU while runnable, as "runq-us/op":
// on a busy host, how long the scheduler kept them from running. A meter
// of two processes (client, server) also reports the server's part as
// "srv-cpu-us/op", so that a change shows which end it moved, and, unless
// a StartHog process runs, "xcpu-ns": the farther of the CPUs' placements
// measured when the meter was made and now (CPUDistance, in ns per round
// trip of a cache line), so that a result can be told from one taken with
// the host's vCPUs placed differently. Call it after the timed loop: it
// stops b's timer before it measures the placement.
func (m *CPUMeter) ReportCPU(b *testing.B, ops int) {
	if ops <= 0 {
		return
	}
	ts, waits := m.since(b)
	perOp := func(d time.Duration) float64 { return float64(d.Nanoseconds()) / 1e3 / float64(ops) }
	b.ReportMetric(perOp(total(ts)), "cpu-us/op")
	b.ReportMetric(perOp(total(waits)), "runq-us/op")
	if len(ts) != 2 {
		return
	}
	b.ReportMetric(perOp(ts[1]), "srv-cpu-us/op")
	if m.dist > 0 {
		b.StopTimer()
		if d := placement(); d > 0 {
			b.ReportMetric(float64(max(d, m.dist).Nanoseconds()), "xcpu-ns")
		}
	}
}

// ErrDistanceTimeout is returned by CPUDistance when its round trips did
// not complete within 200 ms: one of the CPUs is busy with other threads.
var ErrDistanceTimeout = errors.New("peertest: CPU distance: round trips did not complete in time (a CPU is busy)")

// hogs counts the StartHog processes running.
var hogs atomic.Int32

// hogRole is the role of a process started by StartHog; Main runs it
// whatever roles its caller knows.
const hogRole = "cpu-hog"

// StartHog starts a process that keeps every core busy, a busy loop per
// core (runtime.NumCPU), at normal priority: the "contended" case of the
// benchmarks, another tenant of a shared host. The test's end stops it.
func StartHog(tb testing.TB) {
	tb.Helper()
	hogs.Add(1)
	tb.Cleanup(func() { hogs.Add(-1) })
	cmd := Cmd(hogRole, Params{})
	cmd.Stdout, cmd.Stderr = nil, os.Stderr
	stdin, err := cmd.StdinPipe()
	if err != nil {
		tb.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() {
		stdin.Close()
		cmd.Process.Kill() // a busy loop does not look at its input
		cmd.Wait()
	})
}

// runHog is the hog process: runtime.NumCPU busy loops until killed or
// its standard input closes.
func runHog() int {
	n := runtime.NumCPU()
	runtime.GOMAXPROCS(n + 1)
	for range n {
		go func() {
			x := uint64(1)
			for {
				x = x*6364136223846793005 + 1442695040888963407
			}
		}()
	}
	var b [1]byte
	os.Stdin.Read(b[:])
	return 0
}

// Latencies collects round-trip times; Report adds their percentiles to
// a benchmark's metrics.
type Latencies []time.Duration

// Percentile returns the p-th percentile (0 < p <= 100) of l, nearest
// rank; zero when l is empty. It sorts l.
func (l Latencies) Percentile(p float64) time.Duration {
	if len(l) == 0 {
		return 0
	}
	slices.Sort(l)
	i := int(float64(len(l))*p/100+0.5) - 1
	return l[max(0, min(i, len(l)-1))]
}

// Report reports the 50th and 99th percentiles of l to b, in
// microseconds, as "p50-us" and "p99-us".
func (l Latencies) Report(b *testing.B) {
	b.ReportMetric(float64(l.Percentile(50).Nanoseconds())/1e3, "p50-us")
	b.ReportMetric(float64(l.Percentile(99).Nanoseconds())/1e3, "p99-us")
}

// A BenchServer is the server process of a run of benchmarks: the test
// binary re-executed in a role that listens, prints "ready" and its
// addresses on one line, and serves until its standard input closes.
type BenchServer struct {
	cmd   *exec.Cmd
	stdin io.WriteCloser
}

// StartBenchServer starts the test binary as a peer in role with p, plus
// the environment variables env ("NAME=value"), and waits for its first
// line of output, which must be "ready" and n addresses; it returns them.
// The peer's standard error is this process's. Stop ends it.
func StartBenchServer(role string, p Params, n int, env ...string) (*BenchServer, []string, error) {
	cmd := Cmd(role, p)
	cmd.Env = append(cmd.Env, env...)
	cmd.Stderr = os.Stderr
	stdin, err := cmd.StdinPipe()
	if err != nil {
		return nil, nil, err
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		return nil, nil, err
	}
	if err := cmd.Start(); err != nil {
		return nil, nil, err
	}
	s := &BenchServer{cmd: cmd, stdin: stdin}
	line, err := bufio.NewReader(stdout).ReadString('\n')
	f := strings.Fields(line)
	if err != nil || len(f) != n+1 || f[0] != "ready" {
		s.Stop()
		return nil, nil, fmt.Errorf("bench server %s said %q, want ready and %d addresses: %v", role, line, n, err)
	}
	return s, f[1:], nil
}

// Pid returns the server's process id.
func (s *BenchServer) Pid() int { return s.cmd.Process.Pid }

// Stop closes the server's standard input and waits for it to exit.
func (s *BenchServer) Stop() {
	s.stdin.Close()
	s.cmd.Wait()
}
