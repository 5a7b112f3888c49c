package session

import (
	"net"
	"os"
	"path/filepath"
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
// (docs/protocol.md section 9). The victim, a v2 client too (shmlink's
// own client speaks v3, whose files are gone once acknowledged), keeps
// its session.
func TestV2HijackRefused(t *testing.T) {
	dir := t.TempDir()
	cfg := (&Config{ShmDir: dir}).withDefaults()
	meta := wire.ShmMetadata{QueuePath: filepath.Join(dir, "victim_queue_0"), BufferPath: filepath.Join(dir, "victim_buffer")}
	mem, files, err := createShared(&cfg, MemoryFile, meta)
	require.NoError(t, err)
	closeFiles(files)
	defer mem.release()
	cc, sc := tcpPair(t)
	defer cc.Close()
	_, err = cc.Write(wire.AppendShareMemory(nil, 2, wire.TypeShareMemoryByFilePath, meta))
	require.NoError(t, err)
	server, err := Server(sc, &cfg)
	require.NoError(t, err)
	defer server.Close()

	ac, asc := tcpPair(t)
	defer ac.Close()
	_, err = ac.Write(wire.AppendShareMemory(nil, 2, wire.TypeShareMemoryByFilePath, meta))
	require.NoError(t, err)
	attacker, err := Server(asc, &cfg)
	if err == nil {
		attacker.Close()
		t.Fatal("a second session mapped the files of a live one")
	}
	require.ErrorIs(t, err, ErrPathRefused)

	// The victim's session still serves its queue.
	announceRaw(t, mem, 2, func(b []byte) error { _, err := cc.Write(b); return err })
	st := accept(t, server)
	require.EqualValues(t, 2, st.ID())
	require.NoError(t, server.Err())
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
