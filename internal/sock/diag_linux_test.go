package sock

import (
	"net"
	"os"
	"testing"

	"github.com/shmlink/shmlink/internal/peertest"
	"github.com/stretchr/testify/require"
)

// The kernel names our own uid as the owner of the other end of a
// loopback TCP connection, over IPv4 and IPv6, from either end.
func TestTCPPeerUID(t *testing.T) {
	for _, addr := range []string{"127.0.0.1:0", "[::1]:0"} {
		ln, err := net.Listen("tcp", addr)
		if err != nil && addr[0] == '[' {
			t.Logf("no IPv6 loopback here: %v", err)
			continue
		}
		require.NoError(t, err)
		c, err := net.Dial("tcp", ln.Addr().String())
		require.NoError(t, err)
		s, err := ln.Accept()
		require.NoError(t, err)
		for _, conn := range []net.Conn{c, s} {
			uid, err := TCPPeerUID(conn.LocalAddr().(*net.TCPAddr), conn.RemoteAddr().(*net.TCPAddr))
			require.NoError(t, err, addr)
			require.Equal(t, os.Geteuid(), uid, addr)
		}
		// A client socket made under another uid is reported as that
		// uid's: the kernel records the creator's fsuid, which this
		// thread can change for the moment of the dial.
		if os.Geteuid() == 0 {
			other := peertest.DialTCPAs(t, 65534, ln.Addr().String())
			s2, err := ln.Accept()
			require.NoError(t, err)
			uid, err := TCPPeerUID(s2.LocalAddr().(*net.TCPAddr), s2.RemoteAddr().(*net.TCPAddr))
			require.NoError(t, err)
			require.Equal(t, 65534, uid, addr)
			other.Close()
			s2.Close()
		}
		// A connection that does not exist has no owner.
		_, err = TCPPeerUID(c.LocalAddr().(*net.TCPAddr), &net.TCPAddr{IP: net.IPv4(127, 0, 0, 1), Port: 1})
		require.Error(t, err)
		c.Close()
		s.Close()
		ln.Close()
	}
}
