package session

import (
	"sync"
	"sync/atomic"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"
)

// Whether the host has an idle CPU, or none (docs/protocol.md section
// 12.3). A reader that polls gives its CPU up to the peer its session just
// woke only while the host has an idle CPU (Stream.spin,
// Session.peerWaking): with every CPU busy, giving the CPU up hands it to
// whichever process is runnable, for up to a scheduler slice
// (milliseconds), not to the peer. And while the host has none, a reader
// that just woke its peer from a sleep does not poll at all
// (Stream.spinBudget): the peer needs a CPU to answer.
//
// The answer comes from /proc/stat's aggregate idle and iowait time,
// sampled at most once per idleSampleEvery by whichever session's timer
// fires (tick; claimSample keeps one armed for it while readers sleep
// between requests), and shared by the process's sessions. It holds for
// idleValidFor after a sample; without a fresh sample, or where /proc/stat
// cannot be read, the host counts as neither.
//
// /proc/stat counts in clock ticks of 10 ms (USER_HZ = 100), so a sample
// taken 16 ms after the last saw about 3 ticks on 2 CPUs, and the
// thresholds below came down to "no idle tick" and "one". At 40 ms it
// sees 8. And each read costs the timer that makes it about 50 µs of CPU
// on a 2-vCPU VM whose CPU woke for the tick (the kernel formats the whole
// file), a third of the tick's own cost: a longer period reads it less.
const (
	idleSampleEvery = 40 * time.Millisecond
	idleValidFor    = 100 * time.Millisecond
	// idleEnoughPercent is the share of the CPUs' time that must have been
	// idle since the last sample: half a CPU's worth on 2 CPUs (a reader
	// polling in one process keeps one CPU busy by itself).
	idleEnoughPercent = 25
	// idleNonePercent is the share of the CPUs' time below which the host
	// counts as busy (hostBusy): other processes take every CPU that one
	// of ours gives up, or holds by polling.
	idleNonePercent = 5
)

// hostIdle is the process's view of the host's idle CPU time.
var hostIdle hostIdleState

type hostIdleState struct {
	mu          sync.Mutex // held by sample
	at          time.Time  // when the last sample was taken
	idle, total uint64     // /proc/stat counters at that sample, in ticks
	buf         [512]byte

	until     atomic.Int64 // Unix ns until which the host counts as having an idle CPU
	busyUntil atomic.Int64 // Unix ns until which the host counts as busy

	// sampled is when the last sample was taken (monoNow), claim when a
	// session's timer is to take the next one (claimSample).
	sampled atomic.Int64
	claim   atomic.Int64
}

// sampleDelay is how soon after a claim a sample that is already due is
// taken: after the reader that claimed it has gone to sleep.
const sampleDelay = time.Millisecond

// claimSample returns when the timer of a session that holds the claim
// held (0: none) is to take the next sample of the host, from now on:
// held if that claim still stands, else a new claim at the time the next
// sample is due, or 0 if another session's timer holds one.
//
// The sessions' timers run only while something is pending (tick.go),
// which would leave the host without samples while requests come in
// gaps. So a session whose timer would stop keeps it for the next sample,
// unless another one does: one timer of the process fires per
// idleSampleEvery, and none once no session's reader goes to sleep any
// more. A claim whose session ended expires at its time.
func (h *hostIdleState) claimSample(now, held time.Duration) time.Duration {
	c := time.Duration(h.claim.Load())
	if held != 0 && c == held && held > now {
		return held
	}
	if c > now {
		return 0
	}
	next := max(time.Duration(h.sampled.Load())+idleSampleEvery, now+sampleDelay)
	if !h.claim.CompareAndSwap(int64(c), int64(next)) {
		return 0
	}
	return next
}

// hostHasIdleCPU reports whether, as of a recent sample, the host's CPUs
// were idle enough that giving a CPU up reaches the peer.
func hostHasIdleCPU() bool {
	return hostIdle.hasIdle(time.Now())
}

// hostBusy reports whether, as of a recent sample, the host's CPUs were
// all busy: a reader that polls for the answer of a peer it just woke from
// a sleep holds a CPU that the peer needs (Stream.spinBudget). Without a
// fresh sample, or where /proc/stat cannot be read, the answer is no.
func hostBusy() bool {
	return hostIdle.busy(time.Now())
}

// busy reports whether the host counts as busy at now.
func (h *hostIdleState) busy(now time.Time) bool {
	return now.UnixNano() < h.busyUntil.Load()
}

// hasIdle reports whether the host counts as having an idle CPU at now.
func (h *hostIdleState) hasIdle(now time.Time) bool {
	return now.UnixNano() < h.until.Load()
}

// sampleHostIdle reads /proc/stat if the last sample is older than
// idleSampleEvery and updates hostHasIdleCPU's answer. Called from session
// timers: never on the path of a message.
func sampleHostIdle(now time.Time) {
	h := &hostIdle
	if !h.mu.TryLock() {
		return
	}
	defer h.mu.Unlock()
	if now.Sub(h.at) < idleSampleEvery {
		return
	}
	h.sampled.Store(int64(monoNow()))
	idle, total, ok := readProcStat(&h.buf)
	if !ok {
		h.until.Store(0)
		h.busyUntil.Store(0)
		return
	}
	h.record(now, idle, total)
}

// record takes a sample of the CPUs' idle and total time (ticks) at now:
// for idleValidFor, the host counts as having an idle CPU if at least
// idleEnoughPercent of the time since the last sample was idle, and as
// busy if less than idleNonePercent was. The caller holds mu.
func (h *hostIdleState) record(now time.Time, idle, total uint64) {
	if !h.at.IsZero() && total > h.total && idle >= h.idle {
		idleShare, span := (idle-h.idle)*100, total-h.total
		valid := now.Add(idleValidFor).UnixNano()
		if idleShare >= span*idleEnoughPercent {
			h.until.Store(valid)
		} else {
			h.until.Store(0)
		}
		if idleShare < span*idleNonePercent {
			h.busyUntil.Store(valid)
		} else {
			h.busyUntil.Store(0)
		}
	}
	h.at, h.idle, h.total = now, idle, total
}

// readProcStat returns the idle (idle + iowait) and total time of all
// CPUs from the first line of /proc/stat, in clock ticks. It allocates
// nothing: a session's timer calls it while benchmarks count allocations.
// Its open, read and close are raw system calls (rawProcRead): made
// through package syscall, they would wake the runtime's monitor thread
// on every tick (docs/protocol.md section 12.4).
func readProcStat(buf *[512]byte) (idle, total uint64, ok bool) {
	n, ok := rawProcRead(procStatPath, buf[:])
	if !ok || n <= 0 {
		return 0, 0, false
	}
	return parseCPULine(buf[:n])
}

// procStatPath is "/proc/stat", NUL-terminated for openat(2).
var procStatPath, _ = unix.BytePtrFromString("/proc/stat")

// rawProcRead opens the file at path (NUL-terminated) read-only and
// close-on-exec, reads once into b and closes it, all as raw system
// calls, which do not tell the scheduler that the thread may block: a
// read of a file in /proc returns without waiting for a device. It
// returns the byte count and whether all three calls succeeded.
func rawProcRead(path *byte, b []byte) (int, bool) {
	fd, _, errno := unix.RawSyscall6(unix.SYS_OPENAT, atFDCWD, uintptr(unsafe.Pointer(path)),
		unix.O_RDONLY|unix.O_CLOEXEC, 0, 0, 0)
	if errno != 0 {
		return 0, false
	}
	n, _, errno := unix.RawSyscall(unix.SYS_READ, fd, uintptr(unsafe.Pointer(unsafe.SliceData(b))), uintptr(len(b)))
	_, _, cerr := unix.RawSyscall(unix.SYS_CLOSE, fd, 0, 0)
	if errno != 0 || cerr != 0 {
		return 0, false
	}
	return int(n), true
}

// atFDCWD is AT_FDCWD (-100) as a system call argument.
const atFDCWD = ^uintptr(99)

// parseCPULine parses the aggregate "cpu" line at the start of b: user,
// nice, system, idle, iowait, irq, softirq, steal (guest time is counted
// in user already).
func parseCPULine(b []byte) (idle, total uint64, ok bool) {
	const prefix = "cpu "
	if len(b) < len(prefix) || string(b[:len(prefix)]) != prefix {
		return 0, 0, false
	}
	b = b[len(prefix):]
	field := 0
	for field < 8 {
		for len(b) > 0 && b[0] == ' ' {
			b = b[1:]
		}
		if len(b) == 0 || b[0] < '0' || b[0] > '9' {
			break // the line ended: older kernels have fewer fields
		}
		var v uint64
		for len(b) > 0 && b[0] >= '0' && b[0] <= '9' {
			if v > (1<<64-1)/10-1 {
				return 0, 0, false
			}
			v = v*10 + uint64(b[0]-'0')
			b = b[1:]
		}
		total += v
		if field == 3 || field == 4 {
			idle += v
		}
		field++
	}
	return idle, total, field >= 4
}
