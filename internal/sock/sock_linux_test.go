//go:build linux

package sock

import (
	"errors"
	"net"
	"os"
	"path/filepath"
	"syscall"
	"testing"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"
)

func TestPeerCred(t *testing.T) {
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	require.NoError(t, err)
	f := os.NewFile(uintptr(fds[0]), "sp")
	c, err := net.FileConn(f)
	f.Close()
	unix.Close(fds[1])
	require.NoError(t, err)
	defer c.Close()
	pid, uid, gid, err := PeerCred(c.(*net.UnixConn))
	require.NoError(t, err)
	require.Equal(t, os.Getpid(), pid)
	require.Equal(t, os.Geteuid(), uid)
	require.Equal(t, os.Getegid(), gid)

	// Over a listener: each side sees the other, here both this process.
	ln, err := ListenUnix(filepath.Join(t.TempDir(), "s"), 0o600)
	require.NoError(t, err)
	defer ln.Close()
	dc, err := net.Dial("unix", ln.Addr().String())
	require.NoError(t, err)
	defer dc.Close()
	ac, err := ln.Accept()
	require.NoError(t, err)
	defer ac.Close()
	for _, c := range []net.Conn{dc, ac} {
		pid, uid, _, err := PeerCred(c.(*net.UnixConn))
		require.NoError(t, err)
		require.Equal(t, os.Getpid(), pid)
		require.Equal(t, os.Geteuid(), uid)
	}
}

// The socket file gets exactly the mode asked for, whatever the umask (the
// only test in this package that changes it), works, and goes at Close.
func TestListenUnixMode(t *testing.T) {
	dir := t.TempDir()
	for _, tc := range []struct {
		umask int
		mode  os.FileMode
	}{
		{0o022, 0o600},
		{0o000, 0o600}, // the umask would leave 0777
		{0o077, 0o660}, // the umask would take the group's bits
		{0o022, 0o666},
	} {
		old := syscall.Umask(tc.umask)
		p := filepath.Join(dir, "s.sock")
		ln, err := ListenUnix(p, tc.mode)
		syscall.Umask(old)
		require.NoError(t, err)
		fi, err := os.Lstat(p)
		require.NoError(t, err)
		require.Equal(t, os.ModeSocket, fi.Mode().Type())
		require.Equal(t, tc.mode, fi.Mode().Perm(), "umask %#o", tc.umask)
		require.Equal(t, p, ln.Addr().String())

		c, err := net.Dial("unix", p)
		require.NoError(t, err)
		ac, err := ln.Accept()
		require.NoError(t, err)
		_, err = c.Write([]byte("x"))
		require.NoError(t, err)
		_, err = ac.Read(make([]byte, 1))
		require.NoError(t, err)
		c.Close()
		ac.Close()
		fd, err := ln.File()
		require.NoError(t, err)
		flags, err := unix.FcntlInt(fd.Fd(), unix.F_GETFD, 0)
		require.NoError(t, err)
		require.NotZero(t, flags&unix.FD_CLOEXEC)
		fd.Close()

		require.NoError(t, ln.Close())
		_, err = os.Lstat(p)
		require.ErrorIs(t, err, os.ErrNotExist, "removed at Close")
	}
}

func TestListenUnixErrors(t *testing.T) {
	p := filepath.Join(t.TempDir(), "s.sock")
	ln, err := ListenUnix(p, 0o600)
	require.NoError(t, err)
	defer ln.Close()
	_, err = ListenUnix(p, 0o600)
	var oe *net.OpError
	require.True(t, errors.As(err, &oe), "got %v", err)
	require.ErrorIs(t, err, unix.EADDRINUSE)
	_, err = os.Lstat(p)
	require.NoError(t, err, "a failed listen does not remove the other listener's socket")

	_, err = ListenUnix(filepath.Join(t.TempDir(), "missing", "s.sock"), 0o600)
	require.ErrorIs(t, err, unix.ENOENT)

	// Abstract sockets have no file.
	ab, err := ListenUnix("@shmlink-sock-test-"+filepath.Base(t.TempDir()), 0o600)
	require.NoError(t, err)
	require.NoError(t, ab.Close())
}
