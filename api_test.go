package shmlink_test

import (
	"context"
	"net"
	"path/filepath"
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
