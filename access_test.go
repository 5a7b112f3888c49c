package shmlink_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/shmlink/shmlink"
	"github.com/shmlink/shmlink/session"
	"github.com/stretchr/testify/require"
)

// requireEcho writes msg on c and reads it back.
func requireEcho(t *testing.T, c net.Conn, msg string) {
	t.Helper()
	_, err := c.Write([]byte(msg))
	require.NoError(t, err)
	got := make([]byte, len(msg))
	_, err = io.ReadFull(c, got)
	require.NoError(t, err)
	require.Equal(t, msg, string(got))
}

// requireRefusedDial checks that a dial refused by the listener's peer
// check fails at once (not by the handshake timeout, a minute here) and
// says why it may have failed.
func requireRefusedDial(t *testing.T, addr string) {
	t.Helper()
	d := &shmlink.Dialer{Config: &shmlink.Config{HandshakeTimeout: time.Minute}}
	defer d.Close()
	_, err := d.Dial("unix", addr)
	require.Error(t, err)
	require.ErrorIs(t, err, session.ErrHandshake)
	require.NotErrorIs(t, err, os.ErrDeadlineExceeded, "refused at once, not timed out")
	require.Contains(t, err.Error(), "the server closed the connection")
	require.Contains(t, err.Error(), "uid "+strconv.Itoa(os.Geteuid()))
}

// A listener whose peer check refuses our uid closes our connection before
// the handshake, logs and counts it, and keeps serving allowed clients.
func TestListenerRefusesPeer(t *testing.T) {
	me := shmlink.PeerCred{PID: os.Getpid(), UID: os.Geteuid(), GID: os.Getegid()}

	t.Run("AllowUIDs", func(t *testing.T) {
		log := &logBuffer{}
		lc := shmlink.ListenConfig{Config: &shmlink.Config{
			AllowUIDs: []int{12345},
			Logger:    slog.New(slog.NewTextHandler(log, nil)),
		}}
		ln, err := lc.Listen(context.Background(), "unix", filepath.Join(t.TempDir(), "s.sock"))
		require.NoError(t, err)
		defer serveEcho(ln, 1)()
		requireRefusedDial(t, ln.Addr().String())
		requireRefusedDial(t, ln.Addr().String())
		require.Eventually(t, func() bool { return ln.PeersRefused() == 2 }, 10*time.Second, time.Millisecond)
		// The count goes up before the refusal is logged.
		require.Eventually(t, func() bool { return strings.Count(log.String(), "shmlink: peer refused") == 2 }, 10*time.Second, time.Millisecond)
		require.Contains(t, log.String(), "level=WARN msg=\"shmlink: peer refused\"")
		require.Contains(t, log.String(), "uid="+strconv.Itoa(me.UID))
		require.Contains(t, log.String(), "not in Config.AllowUIDs [12345]")
		require.Zero(t, ln.NumSessions())
	})

	t.Run("PeerCheck", func(t *testing.T) {
		var refuse atomic.Bool
		var mu sync.Mutex
		var seen []shmlink.PeerCred
		log := &logBuffer{}
		lc := shmlink.ListenConfig{Config: &shmlink.Config{
			PeerCheck: func(c shmlink.PeerCred) error {
				mu.Lock()
				seen = append(seen, c)
				mu.Unlock()
				if refuse.Load() {
					return errors.New("refused by the test's policy")
				}
				return nil
			},
			Logger: slog.New(slog.NewTextHandler(log, nil)),
		}}
		ln, err := lc.Listen(context.Background(), "unix", filepath.Join(t.TempDir(), "s.sock"))
		require.NoError(t, err)
		defer serveEcho(ln, 4)()

		// A client allowed before the refusal keeps working after it.
		before, err := shmlink.Dial("unix", ln.Addr().String())
		require.NoError(t, err)
		defer before.Close()
		requireEcho(t, before, "before")

		refuse.Store(true)
		requireRefusedDial(t, ln.Addr().String())
		require.Eventually(t, func() bool { return ln.PeersRefused() == 1 }, 10*time.Second, time.Millisecond)
		// The count goes up before the refusal is logged.
		require.Eventually(t, func() bool { return strings.Contains(log.String(), "refused by the test's policy") }, 10*time.Second, time.Millisecond)

		requireEcho(t, before, "still served")
		refuse.Store(false)
		after, err := shmlink.Dial("unix", ln.Addr().String())
		require.NoError(t, err)
		defer after.Close()
		requireEcho(t, after, "after")
		require.EqualValues(t, 1, ln.PeersRefused())

		mu.Lock()
		defer mu.Unlock()
		require.Len(t, seen, 3)
		for _, c := range seen {
			require.Equal(t, me, c)
		}
	})
}

// A client checks its server's uid the same way, before it creates any
// shared memory.
func TestDialerChecksServer(t *testing.T) {
	ln, _ := listen(t, "unix")
	defer serveEcho(ln, 1)()
	dir := t.TempDir()
	d := &shmlink.Dialer{Config: &shmlink.Config{ShmDir: dir, MemoryType: shmlink.MemoryFile, AllowUIDs: []int{12345}}}
	defer d.Close()
	_, err := d.Dial("unix", ln.Addr().String())
	require.ErrorIs(t, err, session.ErrPeerRefused)
	var pe *session.PeerError
	require.ErrorAs(t, err, &pe)
	require.Equal(t, os.Getpid(), pe.Cred.PID, "the server is this process")
	require.Equal(t, os.Geteuid(), pe.Cred.UID)
	entries, err := os.ReadDir(dir)
	require.NoError(t, err)
	require.Empty(t, entries, "no shared memory created")
	require.Zero(t, ln.PeersRefused(), "the server refused nobody")

	var server shmlink.PeerCred
	d2 := &shmlink.Dialer{Config: &shmlink.Config{ShmDir: dir, PeerCheck: func(c shmlink.PeerCred) error {
		server = c
		return nil
	}}}
	defer d2.Close()
	c, err := d2.Dial("unix", ln.Addr().String())
	require.NoError(t, err)
	defer c.Close()
	requireEcho(t, c, "hello")
	require.Equal(t, shmlink.PeerCred{PID: os.Getpid(), UID: os.Geteuid(), GID: os.Getegid()}, server)
}

// The socket file is 0600 by default and gets exactly the configured mode
// otherwise, whatever the umask; it goes when the listener closes.
func TestSocketMode(t *testing.T) {
	for _, tc := range []struct {
		mode, want os.FileMode
	}{
		{0, 0o600},
		{0o660, 0o660},
		{0o666, 0o666},
		{0o700, 0o700},
	} {
		t.Run(tc.want.String(), func(t *testing.T) {
			p := filepath.Join(t.TempDir(), "s.sock")
			lc := shmlink.ListenConfig{SocketMode: tc.mode}
			ln, err := lc.Listen(context.Background(), "unix", p)
			require.NoError(t, err)
			stop := serveEcho(ln, 1)
			fi, err := os.Lstat(p)
			require.NoError(t, err)
			require.Equal(t, os.ModeSocket|tc.want, fi.Mode())
			c, err := shmlink.Dial("unix", p)
			require.NoError(t, err)
			requireEcho(t, c, "mode")
			c.Close()
			stop()
			_, err = os.Lstat(p)
			require.ErrorIs(t, err, os.ErrNotExist, "removed at Close")
			// The path is free again.
			ln, err = lc.Listen(context.Background(), "unix", p)
			require.NoError(t, err)
			require.NoError(t, ln.Close())
		})
	}
	for _, bad := range []os.FileMode{os.ModeSetuid | 0o600, os.ModeSticky | 0o600, 0o1600} {
		lc := shmlink.ListenConfig{SocketMode: bad}
		p := filepath.Join(t.TempDir(), "s.sock")
		_, err := lc.Listen(context.Background(), "unix", p)
		var ce *session.ConfigError
		require.ErrorAs(t, err, &ce, "%v", bad)
		require.Equal(t, "ListenConfig.SocketMode", ce.Field)
		_, err = os.Lstat(p)
		require.ErrorIs(t, err, os.ErrNotExist, "nothing created")
	}
}

// Dials with file-backed regions at the same time, in one process, all
// succeed. Each sweeps ShmDir for the files of dead clients before it
// creates its own, and those sweeps used to remove files that another dial
// was still creating: the server then failed the handshake with "no such
// file" (docs/protocol.md section 9, "Files of dead clients"). Two test
// processes dialing over loopback TCP at once failed that way.
func TestConcurrentFileDials(t *testing.T) {
	dir, err := os.MkdirTemp("/dev/shm", "shmlink-test-")
	require.NoError(t, err)
	defer os.RemoveAll(dir)
	lc := shmlink.ListenConfig{Config: &shmlink.Config{ShmDir: dir}}
	ln, err := lc.Listen(context.Background(), "unix", filepath.Join(t.TempDir(), "s.sock"))
	require.NoError(t, err)
	defer ln.Close()
	defer serveEcho(ln, 4)()

	const dialers, dials = 4, 10
	errs := make(chan error, dialers*dials)
	var wg sync.WaitGroup
	for g := range dialers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range dials {
				d := &shmlink.Dialer{Config: &shmlink.Config{ShmDir: dir, MemoryType: shmlink.MemoryFile, BufferSize: 4 << 20}}
				c, err := d.Dial("unix", ln.Addr().String())
				if err == nil {
					msg := fmt.Sprintf("dialer %d dial %d", g, i)
					if _, err = c.Write([]byte(msg)); err == nil {
						got := make([]byte, len(msg))
						if _, err = io.ReadFull(c, got); err == nil && string(got) != msg {
							err = fmt.Errorf("echo %q, want %q", got, msg)
						}
					}
					c.Close()
				}
				d.Close()
				if err != nil {
					errs <- fmt.Errorf("dialer %d dial %d: %w", g, i, err)
				}
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	ln.CloseSessions()
	entries, err := os.ReadDir(dir)
	require.NoError(t, err)
	require.Empty(t, entries, "files left in ShmDir")
}

// TCP listeners stay on loopback unless AllowNonLoopback says otherwise.
func TestListenLoopback(t *testing.T) {
	var lan []string // this host's own non-loopback addresses, if any
	if addrs, err := net.InterfaceAddrs(); err == nil {
		for _, a := range addrs {
			if ipn, ok := a.(*net.IPNet); ok && !ipn.IP.IsLoopback() && !ipn.IP.IsLinkLocalUnicast() {
				lan = append(lan, net.JoinHostPort(ipn.IP.String(), "0"))
			}
		}
	}
	for _, tc := range []struct {
		network, addr string
	}{
		{"tcp", "127.0.0.1:0"},
		{"tcp", "127.1.2.3:0"},
		{"tcp", "[::1]:0"},
		{"tcp", "localhost:0"},
		{"tcp4", "127.0.0.1:0"},
		{"tcp4", "localhost:0"},
		{"tcp6", "[::1]:0"},
	} {
		t.Run("ok "+tc.network+" "+tc.addr, func(t *testing.T) {
			ln, err := shmlink.Listen(tc.network, tc.addr)
			require.NoError(t, err)
			defer serveEcho(ln, 1)()
			c, err := shmlink.Dial("tcp", ln.Addr().String())
			require.NoError(t, err)
			defer c.Close()
			requireEcho(t, c, "loopback")
		})
	}
	refused := []struct {
		network, addr string
	}{
		{"tcp", "0.0.0.0:0"},
		{"tcp", ":0"},
		{"tcp", "[::]:0"},
		{"tcp", "192.0.2.1:0"}, // TEST-NET-1: refused before any bind
		{"tcp", "10.1.2.3:0"},
		{"tcp4", ":0"},
		{"tcp6", "[::]:0"},
	}
	for _, a := range lan {
		refused = append(refused, struct{ network, addr string }{"tcp", a})
	}
	for _, tc := range refused {
		t.Run("refused "+tc.network+" "+tc.addr, func(t *testing.T) {
			ln, err := shmlink.Listen(tc.network, tc.addr)
			require.ErrorIs(t, err, shmlink.ErrNotLoopback)
			require.Nil(t, ln)
			require.Contains(t, err.Error(), "AllowNonLoopback")
		})
	}
	for _, addr := range []string{"0.0.0.0:0", ":0"} {
		t.Run("opt-in "+addr, func(t *testing.T) {
			lc := shmlink.ListenConfig{AllowNonLoopback: true}
			ln, err := lc.Listen(context.Background(), "tcp", addr)
			require.NoError(t, err)
			defer serveEcho(ln, 1)()
			port := ln.Addr().(*net.TCPAddr).Port
			c, err := shmlink.Dial("tcp", net.JoinHostPort("127.0.0.1", strconv.Itoa(port)))
			require.NoError(t, err)
			defer c.Close()
			requireEcho(t, c, "opt-in")
		})
	}
	_, err := shmlink.Listen("tcp", "0.0.0.0:0")
	require.True(t, strings.HasPrefix(err.Error(), "shmlink: "), err.Error())
}
