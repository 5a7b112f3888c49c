package session

import (
	"net"
	"os"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/shmlink/shmlink/internal/sock"
)

// sharesOneCPU reports whether this process and the one at the other end
// of conn may run only on one and the same CPU: the sets of CPUs that the
// scheduler allows them (sched_getaffinity) are the same single CPU. The
// peer's set is known over a Unix socket whose peer's pid we can see
// (SO_PEERCRED); where it is not, a host with a single CPU online still
// counts. Where nothing can be read, it reports false. This process's set
// is the calling thread's, which is the process's unless a thread was
// bound on its own.
//
// A session for which it holds does not poll (docs/protocol.md section
// 12.8): the peer cannot run while a reader polls for its answer, so every
// poll runs out, and the answer comes only once the reader sleeps. With
// client and server bound to one CPU, 64 B round trips took 73 to 78 µs
// polling, against 28 µs with polling off and a Unix socket's 36 to 41 µs.
func sharesOneCPU(conn net.Conn) bool {
	var own unix.CPUSet
	if unix.SchedGetaffinity(0, &own) != nil {
		return false
	}
	peer, known := peerCPUs(conn)
	return oneCPU(own, peer, known, onlineCPUs)
}

// oneCPU is sharesOneCPU's rule, given this process's CPU set own, the
// peer's set peer if known, and a function that counts the host's online
// CPUs (0: unknown).
func oneCPU(own, peer unix.CPUSet, known bool, online func() int) bool {
	if own.Count() != 1 {
		return false
	}
	if known {
		return peer == own
	}
	return online() == 1
}

// peerCPUs returns the set of CPUs that the process at the other end of
// conn may run on, if conn is a Unix socket and that process is visible
// from ours.
func peerCPUs(conn net.Conn) (set unix.CPUSet, ok bool) {
	uc, isUnix := conn.(*net.UnixConn)
	if !isUnix {
		return set, false
	}
	pid, _, _, err := sock.PeerCred(uc)
	if err != nil || pid <= 0 {
		return set, false
	}
	return set, unix.SchedGetaffinity(pid, &set) == nil
}

// onlineCPUs returns how many CPUs the host has online, from
// /sys/devices/system/cpu/online ("0", "0-3", "0,2-5"), or 0 if it cannot
// be read or parsed.
func onlineCPUs() int {
	b, err := os.ReadFile("/sys/devices/system/cpu/online")
	if err != nil {
		return 0
	}
	return countCPUList(strings.TrimSpace(string(b)))
}

// countCPUList counts the CPUs in a kernel CPU list such as "0,2-5" (5), or
// returns 0 if list is malformed.
func countCPUList(list string) int {
	n := 0
	for part := range strings.SplitSeq(list, ",") {
		lo, hi, isRange := strings.Cut(part, "-")
		if !isRange {
			hi = lo
		}
		a, okA := parseCPU(lo)
		b, okB := parseCPU(hi)
		if !okA || !okB || b < a {
			return 0
		}
		n += b - a + 1
	}
	return n
}

// parseCPU parses a CPU number: decimal digits only, below 2^20.
func parseCPU(s string) (int, bool) {
	n, err := strconv.ParseUint(s, 10, 20)
	return int(n), err == nil
}
