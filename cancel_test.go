package shmlink_test

import (
	"context"
	"fmt"
	"io"
	"net"
	"path/filepath"
	"testing"
	"time"

	"github.com/shmlink/shmlink"
	"github.com/shmlink/shmlink/internal/wire"
	"github.com/shmlink/shmlink/session"
	"github.com/stretchr/testify/require"
)

// These tests check that a context or a Close ends a handshake in flight
// at once, rather than after Config.HandshakeTimeout: each sets that
// timeout to an hour, so a handshake that ignored them would hold the test
// until mustReturn gives up.

// silentUnix listens on a Unix socket whose connections are accepted and
// never answered; each is sent on the returned channel and closed at the
// test's end.
func silentUnix(t *testing.T) (string, <-chan net.Conn) {
	addr := filepath.Join(t.TempDir(), "silent.sock")
	ln, err := net.Listen("unix", addr)
	require.NoError(t, err)
	t.Cleanup(func() { ln.Close() })
	conns := make(chan net.Conn, 16)
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			t.Cleanup(func() { c.Close() })
			conns <- c
		}
	}()
	return addr, conns
}

// mustReturn waits for done, and fails the test if it takes a minute: far
// beyond what a prompt return takes, far below the hour-long handshake
// timeouts of these tests.
func mustReturn[T any](t *testing.T, done <-chan T, what string) T {
	t.Helper()
	select {
	case v := <-done:
		return v
	case <-time.After(time.Minute):
		t.Fatalf("%s did not return", what)
		panic("unreachable")
	}
}

// A context cancelled while the server has not answered the handshake ends
// Dialer.DialContext with an error wrapping context.Canceled and
// ErrHandshake, and leaves no descriptor, goroutine or file.
func TestDialContextCancelDuringHandshake(t *testing.T) {
	shm := t.TempDir()
	addr, conns := silentUnix(t)
	base := snapshot(t, shm)
	d := &shmlink.Dialer{Config: &shmlink.Config{ShmDir: shm, HandshakeTimeout: time.Hour}}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	done := make(chan error, 1)
	go func() {
		_, err := d.DialContext(ctx, "unix", addr)
		done <- err
	}()
	c := <-conns
	var h [wire.HeaderSize]byte
	_, err := io.ReadFull(c, h[:]) // the client is in its handshake
	require.NoError(t, err)
	cancel()
	err = mustReturn(t, done, "DialContext")
	require.ErrorIs(t, err, context.Canceled)
	require.ErrorIs(t, err, shmlink.ErrHandshake)
	c.Close()
	require.NoError(t, d.Close())
	requireNoLeaks(t, base, shm)
}

// The package-level DialContext is bounded by its context the same way.
func TestPackageDialContextCancelDuringHandshake(t *testing.T) {
	addr, conns := silentUnix(t)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	done := make(chan error, 1)
	go func() {
		_, err := shmlink.DialContext(ctx, "unix", addr)
		done <- err
	}()
	<-conns
	cancel()
	require.ErrorIs(t, mustReturn(t, done, "DialContext"), context.Canceled)
}

// A context deadline that passes during the handshake: the error wraps
// context.DeadlineExceeded, as Dialer.DialContext documents, not the
// socket's i/o timeout.
func TestDialContextDeadlineDuringHandshake(t *testing.T) {
	addr, _ := silentUnix(t)
	d := &shmlink.Dialer{Config: &shmlink.Config{ShmDir: t.TempDir(), HandshakeTimeout: time.Hour}}
	defer d.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
	defer cancel()
	done := make(chan error, 1)
	go func() {
		_, err := d.DialContext(ctx, "unix", addr)
		done <- err
	}()
	require.ErrorIs(t, mustReturn(t, done, "DialContext"), context.DeadlineExceeded)
}

// Two dials share one handshake. The first dial's context ends during it;
// the second, whose context lives on, dials again rather than fail with
// the first one's error.
func TestSharedDialOutlivesFirstContext(t *testing.T) {
	dir := t.TempDir()
	addr := filepath.Join(dir, "s.sock")
	ln, err := net.Listen("unix", addr)
	require.NoError(t, err)
	first := make(chan net.Conn, 1)
	served := make(chan struct{})
	go func() {
		defer close(served)
		for n := 0; ; n++ {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			if n == 0 {
				first <- c // stays silent
				continue
			}
			go func() { // a real server for every later connection
				s, err := session.Server(c, &session.Config{ShmDir: dir})
				if err != nil {
					return
				}
				defer s.Close()
				for {
					st, err := s.AcceptStream(context.Background())
					if err != nil {
						return
					}
					st.Close()
				}
			}()
		}
	}()
	defer func() { ln.Close(); <-served }()

	d := &shmlink.Dialer{Config: &shmlink.Config{ShmDir: dir, HandshakeTimeout: time.Hour}}
	defer d.Close()
	waiting := make(chan struct{}, 1)
	shmlink.SetWaitHook(d, func() { waiting <- struct{}{} })

	ctxA, cancelA := context.WithCancel(context.Background())
	defer cancelA()
	errA := make(chan error, 1)
	go func() {
		_, err := d.DialContext(ctxA, "unix", addr)
		errA <- err
	}()
	c := <-first
	defer c.Close()
	errB := make(chan error, 1)
	go func() {
		st, err := d.DialContext(context.Background(), "unix", addr)
		if st != nil {
			st.Close()
		}
		errB <- err
	}()
	<-waiting // B waits for A's handshake
	cancelA()
	require.ErrorIs(t, mustReturn(t, errA, "the first dial"), context.Canceled)
	require.NoError(t, mustReturn(t, errB, "the second dial"))
}

// halfHandshake connects to addr, sends the first v3 handshake message and
// reads the server's answer: the server is then inside its handshake,
// waiting for the metadata, which never comes.
func halfHandshake(t *testing.T, addr string) net.Conn {
	c, err := net.Dial("unix", addr)
	require.NoError(t, err)
	_, err = c.Write(wire.AppendSimple(nil, wire.ProtocolVersion, wire.TypeExchangeProtoVersion))
	require.NoError(t, err)
	var b [wire.HeaderSize]byte
	_, err = io.ReadFull(c, b[:])
	require.NoError(t, err)
	return c
}

// A client stalled in its handshake holds up neither Shutdown, which waits
// for the sessions the listener accepted (there are none), nor
// CloseSessions, which ends everything at once; Close, Shutdown and
// CloseSessions all close the stalled connection.
func TestListenerCloseEndsHandshakes(t *testing.T) {
	for _, how := range []string{"Shutdown", "CloseSessions", "Close"} {
		t.Run(how, func(t *testing.T) {
			dir := t.TempDir()
			base := snapshot(t, dir)
			lc := shmlink.ListenConfig{Config: &shmlink.Config{ShmDir: dir, HandshakeTimeout: time.Hour}}
			ln, err := lc.Listen(context.Background(), "unix", filepath.Join(dir, "s.sock"))
			require.NoError(t, err)
			c := halfHandshake(t, ln.Addr().String())
			done := make(chan error, 1)
			go func() {
				switch how {
				case "Shutdown":
					done <- ln.Shutdown(context.Background())
				case "CloseSessions":
					if n := ln.CloseSessions(); n != 0 {
						done <- fmt.Errorf("CloseSessions ended %d sessions, want 0", n)
						return
					}
					done <- nil
				default:
					done <- ln.Close()
				}
			}()
			require.NoError(t, mustReturn(t, done, how))
			// The server closed the stalled connection: its reader sees EOF.
			_, err = c.Read(make([]byte, 1))
			require.ErrorIs(t, err, io.EOF)
			c.Close()
			requireNoLeaks(t, base, dir)
		})
	}
}
