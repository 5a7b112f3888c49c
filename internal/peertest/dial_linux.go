package peertest

import (
	"net"
	"runtime"
	"testing"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"
)

// DialTCPAs dials addr over TCP from a socket that the kernel records as
// uid's (its creator's fsuid), as a process of that user would: the
// calling thread's fsuid is uid for the moment of the dial. It needs root.
func DialTCPAs(tb testing.TB, uid int, addr string) net.Conn {
	tb.Helper()
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	old, _, _ := unix.RawSyscall(unix.SYS_SETFSUID, uintptr(uid), 0, 0)
	c, err := net.Dial("tcp", addr)
	unix.RawSyscall(unix.SYS_SETFSUID, old, 0, 0)
	require.NoError(tb, err)
	return c
}
