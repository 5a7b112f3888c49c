package shmlink_test

import (
	"context"
	"net"
	"os"
	"path/filepath"
	"syscall"
	"testing"

	"github.com/shmlink/shmlink"
	"github.com/stretchr/testify/require"
)

// Every constructor and Accept that fails returns an untyped nil, so that
// `if ln != nil { ln.Close() }` is safe (#15: Listen returned a
// net.Listener holding a nil *Listener).
func TestFailuresReturnUntypedNil(t *testing.T) {
	missing := filepath.Join(t.TempDir(), "no", "such", "dir", "s.sock")

	ln, err := shmlink.Listen("unix", missing)
	require.Error(t, err)
	require.True(t, ln == nil, "Listen returned %#v", ln)

	c, err := shmlink.Dial("unix", missing)
	require.Error(t, err)
	require.True(t, c == nil, "Dial returned %#v", c)

	c, err = shmlink.DialContext(context.Background(), "udp", "127.0.0.1:1")
	require.Error(t, err)
	require.True(t, c == nil, "DialContext returned %#v", c)

	var d shmlink.Dialer
	defer d.Close()
	c, err = d.Dial("unix", missing)
	require.Error(t, err)
	require.True(t, c == nil, "Dialer.Dial returned %#v", c)

	var lc shmlink.ListenConfig
	l, err := lc.Listen(context.Background(), "unix", filepath.Join(t.TempDir(), "s.sock"))
	require.NoError(t, err)
	require.NoError(t, l.Close())
	var nl net.Listener = l
	c, err = nl.Accept()
	require.ErrorIs(t, err, net.ErrClosed)
	require.True(t, c == nil, "Accept returned %#v", c)
}

// Listen takes over a socket file that a dead process left (nobody
// listens on it) instead of failing with "address already in use" (#15),
// and never takes a live listener's socket nor another kind of file.
func TestListenStaleSocket(t *testing.T) {
	dir := t.TempDir()
	stale := filepath.Join(dir, "stale.sock")
	old, err := net.Listen("unix", stale)
	require.NoError(t, err)
	old.(*net.UnixListener).SetUnlinkOnClose(false) // as after kill -9
	require.NoError(t, old.Close())
	ln, err := shmlink.Listen("unix", stale)
	require.NoError(t, err, "a dead process's socket file")
	require.NoError(t, ln.Close())

	live := filepath.Join(dir, "live.sock")
	other, err := net.Listen("unix", live)
	require.NoError(t, err)
	defer other.Close()
	_, err = shmlink.Listen("unix", live)
	require.ErrorIs(t, err, syscall.EADDRINUSE, "a live listener's socket")
	c, err := net.Dial("unix", live)
	require.NoError(t, err, "the live listener still has its socket")
	c.Close()

	file := filepath.Join(dir, "file")
	require.NoError(t, os.WriteFile(file, []byte("mine"), 0o600))
	_, err = shmlink.Listen("unix", file)
	require.ErrorIs(t, err, syscall.EADDRINUSE)
	b, err := os.ReadFile(file)
	require.NoError(t, err)
	require.Equal(t, "mine", string(b))
}
