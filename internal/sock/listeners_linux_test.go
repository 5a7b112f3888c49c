//go:build linux

package sock

import (
	"fmt"
	"net"
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"
)

// socketPair returns two connected Unix stream sockets.
func socketPair(t *testing.T) (a, b *net.UnixConn) {
	t.Helper()
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	require.NoError(t, err)
	conns := make([]*net.UnixConn, 2)
	for i, fd := range fds {
		f := os.NewFile(uintptr(fd), "sp")
		c, err := net.FileConn(f)
		f.Close()
		require.NoError(t, err)
		t.Cleanup(func() { c.Close() })
		conns[i] = c.(*net.UnixConn)
	}
	return conns[0], conns[1]
}

// Listeners arrive in order, of their kind, and accept on the same socket.
func TestSendRecvListeners(t *testing.T) {
	a, b := socketPair(t)
	uln, err := ListenUnix(filepath.Join(t.TempDir(), "s.sock"), 0o600)
	require.NoError(t, err)
	defer uln.Close()
	tln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	defer tln.Close()

	require.NoError(t, SendListeners(a, uln, tln))
	got, err := RecvListeners(b, 2)
	require.NoError(t, err)
	defer got[0].Close()
	defer got[1].Close()
	require.IsType(t, &net.UnixListener{}, got[0])
	require.IsType(t, &net.TCPListener{}, got[1])
	require.Equal(t, uln.Addr().String(), got[0].Addr().String())
	require.Equal(t, tln.Addr().String(), got[1].Addr().String())

	// The received listener accepts on the sender's socket.
	c, err := net.Dial("tcp", tln.Addr().String())
	require.NoError(t, err)
	defer c.Close()
	tln.Close()
	ac, err := got[1].Accept()
	require.NoError(t, err)
	ac.Close()
}

// The wrong count is refused and what arrived is closed, not leaked.
func TestRecvListenersBadRights(t *testing.T) {
	a, b := socketPair(t)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	defer ln.Close()
	before := openFds(t)
	require.NoError(t, SendListeners(a, ln, ln, ln))
	_, err = RecvListeners(b, 2)
	require.ErrorIs(t, err, ErrBadRights)
	require.Equal(t, before, openFds(t))

	// A descriptor that is no listener is refused, and closed too.
	f, err := os.CreateTemp(t.TempDir(), "f")
	require.NoError(t, err)
	defer f.Close()
	_, _, err = a.WriteMsgUnix([]byte{0}, unix.UnixRights(int(f.Fd())), nil)
	require.NoError(t, err)
	_, err = RecvListeners(b, 1)
	require.Error(t, err)
	require.Equal(t, before+1, openFds(t))
}

// openFds counts this process's open descriptors.
func openFds(t *testing.T) int {
	entries, err := os.ReadDir("/proc/self/fd")
	require.NoError(t, err)
	return len(entries)
}

// A connected stream socket sent in place of a listening one is refused
// (net.FileListener takes it, and its Accept then fails with EINVAL), and
// every descriptor received is closed.
func TestRecvListenersNotListening(t *testing.T) {
	a, b := socketPair(t)
	conn, _ := socketPair(t) // a connected socket
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	defer ln.Close()
	raw, err := conn.SyscallConn()
	require.NoError(t, err)
	before := openFds(t)
	for i, order := range [][]int{{1}, {0, 1}, {1, 0}} {
		var werr error
		require.NoError(t, raw.Control(func(fd uintptr) {
			// fds: [ln, the connected socket], valid inside the
			// Control callbacks only.
			rc, err := ln.(*net.TCPListener).SyscallConn()
			require.NoError(t, err)
			require.NoError(t, rc.Control(func(lfd uintptr) {
				fds := []int{int(lfd), int(fd)}
				var send []int
				for _, k := range order {
					send = append(send, fds[k])
				}
				_, _, werr = a.WriteMsgUnix([]byte{0}, unix.UnixRights(send...), nil)
			}))
		}))
		require.NoError(t, werr)
		_, err = RecvListeners(b, len(order))
		require.ErrorIs(t, err, ErrNotListening, "case %d", i)
		bad := 0
		for k, v := range order {
			if v == 1 {
				bad = k
			}
		}
		require.ErrorContains(t, err, fmt.Sprintf("descriptor %d received", bad))
		require.Equal(t, before, openFds(t), "case %d: descriptors received and not closed", i)
	}
}
