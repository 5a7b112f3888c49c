package shmlink_test

import (
	"context"
	"io"
	"net"
	"os"
	"path/filepath"
	"syscall"
	"testing"
	"time"

	"github.com/shmlink/shmlink"
	"github.com/shmlink/shmlink/internal/peertest"
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

// Dial over TCP returns only after the server's handshake reply (#15: it
// returned a connection from anything that accepted, and the first Read
// failed at its deadline): a server that is not shmlink fails the dial
// within HandshakeTimeout, and a shmlink server that cannot open the
// client's files, for want of the same ShmDir, fails it with an error
// that says so.
func TestDialTCPWaitsForServer(t *testing.T) {
	t.Run("not-shmlink", func(t *testing.T) {
		other, err := net.Listen("tcp", "127.0.0.1:0")
		require.NoError(t, err)
		defer other.Close()
		go func() {
			for {
				c, err := other.Accept()
				if err != nil {
					return
				}
				defer c.Close() // accepts, says nothing
			}
		}()
		dir := t.TempDir()
		d := &shmlink.Dialer{Config: &shmlink.Config{ShmDir: dir, HandshakeTimeout: 200 * time.Millisecond}}
		defer d.Close()
		c, err := d.Dial("tcp", other.Addr().String())
		require.ErrorIs(t, err, os.ErrDeadlineExceeded)
		require.True(t, c == nil)
		requireDirEmpty(t, dir)
	})
	t.Run("other-shmdir", func(t *testing.T) {
		ln, _ := listen(t, "tcp")
		dir := t.TempDir()
		d := &shmlink.Dialer{Config: &shmlink.Config{ShmDir: dir}}
		defer d.Close()
		_, err := d.Dial("tcp", ln.Addr().String())
		require.ErrorContains(t, err, "same Config.ShmDir")
		requireDirEmpty(t, dir)
	})
}

// requireDirEmpty requires that dir holds no file.
func requireDirEmpty(t *testing.T, dir string) {
	t.Helper()
	ents, err := os.ReadDir(dir)
	require.NoError(t, err)
	require.Empty(t, ents)
}

// The zero-copy calls with one import and no type assertion (#15):
// Dialer.DialStream and Listener.AcceptStream return *Stream, and the
// root package names the errors and types a user touches.
func TestZeroCopyOneImport(t *testing.T) {
	ln, cfg := listen(t, "unix")
	d := &shmlink.Dialer{Config: cfg}
	defer d.Close()
	c, err := d.DialStream(context.Background(), "unix", ln.Addr().String())
	require.NoError(t, err)
	s, err := ln.AcceptStream()
	require.NoError(t, err)
	b, err := c.Reserve(5)
	require.NoError(t, err)
	copy(b, "hello")
	require.NoError(t, c.Flush())
	got, err := s.Peek(5)
	require.NoError(t, err)
	require.Equal(t, "hello", string(got))
	_, err = s.Discard(5)
	require.NoError(t, err)
	s.ReleasePreviousRead()
	require.NoError(t, c.Close())

	_, err = c.Write([]byte("x"))
	require.ErrorIs(t, err, shmlink.ErrStreamClosed)
	var ce *shmlink.ConfigError
	_, err = (&shmlink.Dialer{Config: &shmlink.Config{BufferSize: -1}}).DialStream(context.Background(), "unix", ln.Addr().String())
	require.ErrorAs(t, err, &ce)
	require.Equal(t, "BufferSize", ce.Field)
}

// Listener.Stats and Dialer.Stats sum the counters of all their sessions,
// live and ended (#15: stats were per session only).
func TestListenerDialerStats(t *testing.T) {
	ln, cfg := listen(t, "unix")
	defer serveEcho(ln, 4)()
	d := &shmlink.Dialer{Config: cfg, StreamsPerSession: 1, MaxSessions: 2}
	defer d.Close()
	const streams, size = 4, 1000
	var conns []net.Conn
	for range streams { // open at once: they spread over two sessions
		c, err := d.Dial("unix", ln.Addr().String())
		require.NoError(t, err)
		conns = append(conns, c)
	}
	require.Equal(t, 2, d.NumSessions())
	for _, c := range conns {
		_, err := c.Write(make([]byte, size))
		require.NoError(t, err)
		_, err = io.ReadFull(c, make([]byte, size))
		require.NoError(t, err)
		require.NoError(t, c.Close())
	}
	ds := d.Stats()
	require.EqualValues(t, streams*size, ds.BytesSent)
	require.EqualValues(t, streams*size, ds.BytesReceived)
	require.Nil(t, ds.SlicesInUse)
	require.Eventually(t, func() bool { return ln.Stats().BytesSent == streams*size }, 10*time.Second, time.Millisecond,
		"the server's echoes are counted")
	require.EqualValues(t, streams*size, ln.Stats().BytesReceived)

	require.NoError(t, d.Close()) // the sessions end; their counts stay
	require.Eventually(t, func() bool { return ln.NumSessions() == 0 }, 10*time.Second, time.Millisecond)
	require.EqualValues(t, streams*size, ln.Stats().BytesReceived)
	require.Eventually(t, func() bool { return d.Stats().BytesSent == streams*size && d.Stats().ActiveStreams == 0 },
		10*time.Second, time.Millisecond)
}

// A session that ended with streams its application never closed adds
// its counters to the ended sessions' sums, but not its streams: those
// are not active any more. Listener.Stats after Shutdown used to count
// them.
func TestStatsEndedSessionsHaveNoActiveStreams(t *testing.T) {
	ln, cfg := listen(t, "unix")
	d := &shmlink.Dialer{Config: cfg}
	defer d.Close()
	c, err := d.Dial("unix", ln.Addr().String())
	require.NoError(t, err)
	_, err = c.Write([]byte("x"))
	require.NoError(t, err)
	sc, err := ln.Accept() // the server's stream, left open
	require.NoError(t, err)
	_, err = io.ReadFull(sc, make([]byte, 1))
	require.NoError(t, err)
	require.Equal(t, 1, ln.Stats().ActiveStreams)
	require.Equal(t, 1, d.Stats().ActiveStreams)

	require.NoError(t, d.Close()) // ends the session under both streams
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	require.NoError(t, ln.Shutdown(ctx), "the session ended by itself")
	ls := ln.Stats()
	require.Zero(t, ls.ActiveStreams, "streams of ended sessions")
	require.EqualValues(t, 1, ls.BytesReceived, "the ended session's counters stay")
	require.Zero(t, d.Stats().ActiveStreams)
	sc.Close()
}

// A client with Config.KeepAlive notices a server process that froze
// (SIGSTOP): a Read with no deadline fails within about twice KeepAlive,
// with an error naming it (#15: a frozen peer was noticed only through
// deadlines).
func TestKeepAliveStoppedServer(t *testing.T) {
	proc, addr, dir := startServerPeerWith(t, "unix", nil)
	d := &shmlink.Dialer{Config: &shmlink.Config{ShmDir: dir, KeepAlive: 100 * time.Millisecond}}
	defer d.Close()
	c, err := d.Dial("unix", addr)
	require.NoError(t, err)
	command(t, c, peertest.CmdEcho, 0)
	require.NoError(t, peertest.Echo(c, 1000, 1))
	require.NoError(t, proc.Signal(syscall.SIGSTOP))
	defer proc.Signal(syscall.SIGCONT)                                 // so that the test's end can stop it
	require.NoError(t, c.SetReadDeadline(time.Now().Add(time.Minute))) // a safety net only
	_, err = c.Read(make([]byte, 1))
	require.ErrorContains(t, err, "KeepAlive")
	require.NotErrorIs(t, err, os.ErrDeadlineExceeded)
}
