package session

import (
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/shmlink/shmlink/internal/peertest"
	"github.com/shmlink/shmlink/internal/wire"
	"github.com/stretchr/testify/require"
)

// tcpPair returns both ends of a loopback TCP connection.
func tcpPair(t *testing.T) (client, server net.Conn) {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	defer ln.Close()
	client, err = net.Dial("tcp", ln.Addr().String())
	require.NoError(t, err)
	server, err = ln.Accept()
	require.NoError(t, err)
	return client, server
}

// A v2 client over TCP that names the files of another live session of
// the server is refused (#14): its session would pop the victim's events
// (docs/protocol.md section 9). The victim goes on working.
func TestV2HijackRefused(t *testing.T) {
	dir := t.TempDir()
	cfg := &Config{ShmDir: dir}
	cc, sc := tcpPair(t)
	done := make(chan *Session, 1)
	go func() {
		s, err := Server(sc, cfg)
		require.NoError(t, err)
		done <- s
	}()
	victim, err := Client(cc, cfg)
	require.NoError(t, err)
	defer victim.Close()
	server := <-done
	defer server.Close()

	// The victim's files stay in ShmDir until its server speaks.
	var meta wire.ShmMetadata
	ents, err := os.ReadDir(dir)
	require.NoError(t, err)
	for _, e := range ents {
		switch p := filepath.Join(dir, e.Name()); {
		case strings.HasSuffix(p, "_buffer"):
			meta.BufferPath = p
		case strings.HasSuffix(p, "_queue_0"):
			meta.QueuePath = p
		}
	}
	require.NotEmpty(t, meta.BufferPath)
	require.NotEmpty(t, meta.QueuePath)

	ac, asc := tcpPair(t)
	defer ac.Close()
	_, err = ac.Write(wire.AppendShareMemory(nil, 2, wire.TypeShareMemoryByFilePath, meta))
	require.NoError(t, err)
	attacker, err := Server(asc, cfg)
	if err == nil {
		attacker.Close()
		t.Fatal("a second session mapped the files of a live one")
	}
	require.ErrorIs(t, err, ErrPathRefused)

	c, err := victim.OpenStream(t.Context())
	require.NoError(t, err)
	s := accept(t, server)
	_, err = c.Write([]byte("still mine"))
	require.NoError(t, err)
	b := make([]byte, 10)
	_, err = s.Read(b)
	require.NoError(t, err)
	require.Equal(t, "still mine", string(b))
}

// Over loopback TCP the server learns the client's uid from the kernel
// (socket diagnostics) and applies Config.AllowUIDs to it, as over a Unix
// socket: a client of another uid is refused (#14).
func TestTCPPeerOfAnotherUIDRefused(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root to create a socket owned by another uid")
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	defer ln.Close()
	c := peertest.DialTCPAs(t, 65534, ln.Addr().String())
	defer c.Close()
	sc, err := ln.Accept()
	require.NoError(t, err)
	_, err = Server(sc, &Config{ShmDir: t.TempDir()})
	require.ErrorIs(t, err, ErrPeerRefused)
	var pe *PeerError
	require.ErrorAs(t, err, &pe)
	require.Equal(t, 65534, pe.Cred.UID)
}
