package shmlink_test

import (
	"context"
	"errors"
	"io"
	"net"
	"os"
	"path/filepath"
	"syscall"
	"testing"
	"time"

	"github.com/shmlink/shmlink"
	"github.com/stretchr/testify/require"
	"golang.org/x/net/nettest"
)

// listen starts a listener on network with its shared memory in a
// temporary directory, closed when the test ends.
func listen(t *testing.T, network string) (*shmlink.Listener, *shmlink.Config) {
	t.Helper()
	dir := t.TempDir()
	addr := "127.0.0.1:0"
	if network == "unix" {
		addr = filepath.Join(dir, "s.sock")
	}
	cfg := &shmlink.Config{ShmDir: dir}
	lc := shmlink.ListenConfig{Config: cfg}
	ln, err := lc.Listen(context.Background(), network, addr)
	require.NoError(t, err)
	t.Cleanup(func() { ln.CloseSessions() })
	return ln, cfg
}

// pipeMaker returns a nettest.MakePipe whose pipes are a client stream,
// dialed by dial, and the server stream ln accepted for it.
func pipeMaker(ln *shmlink.Listener, dial func() (net.Conn, error)) nettest.MakePipe {
	return func() (c1, c2 net.Conn, stop func(), err error) {
		c1, err = dial()
		if err != nil {
			return nil, nil, nil, err
		}
		// Accept returns at once: the stream was announced by the dial.
		c2, err = ln.Accept()
		if err != nil {
			c1.Close()
			return nil, nil, nil, err
		}
		stop = func() {
			c1.Close()
			c2.Close()
		}
		return c1, c2, stop, nil
	}
}

// TestConn runs golang.org/x/net/nettest's net.Conn conformance suite on
// streams over each transport, both ways round (client stream first and
// server stream first), through a Dialer's pooled sessions and through
// package-level Dial's one-stream sessions.
func TestConn(t *testing.T) {
	for _, network := range []string{"unix", "tcp"} {
		t.Run(network, func(t *testing.T) {
			ln, cfg := listen(t, network)
			d := &shmlink.Dialer{Config: cfg}
			t.Cleanup(func() { d.Close() })
			addr := ln.Addr().String()
			dialer := pipeMaker(ln, func() (net.Conn, error) { return d.Dial(network, addr) })
			t.Run("Dialer", func(t *testing.T) { nettest.TestConn(t, dialer) })
			t.Run("ServerFirst", func(t *testing.T) {
				nettest.TestConn(t, func() (net.Conn, net.Conn, func(), error) {
					c1, c2, stop, err := dialer()
					return c2, c1, stop, err
				})
			})
			if network == "unix" {
				// One session per stream; its default Config maps memfds.
				t.Run("Dial", func(t *testing.T) {
					nettest.TestConn(t, pipeMaker(ln, func() (net.Conn, error) { return shmlink.Dial(network, addr) }))
				})
			}
		})
	}
}

// The error contract beyond nettest: timeouts unwrap to
// os.ErrDeadlineExceeded, calls after Close give net.ErrClosed, the peer's
// close reads as io.EOF after its data, CloseWrite half-closes, and a
// listener's Accept after Close gives net.ErrClosed.
func TestConnErrors(t *testing.T) {
	for _, network := range []string{"unix", "tcp"} {
		t.Run(network, func(t *testing.T) {
			ln, cfg := listen(t, network)
			d := &shmlink.Dialer{Config: cfg}
			defer d.Close()
			c, err := d.Dial(network, ln.Addr().String())
			require.NoError(t, err)
			s, err := ln.Accept()
			require.NoError(t, err)

			require.NoError(t, c.SetReadDeadline(time.Now().Add(time.Millisecond)))
			_, err = c.Read(make([]byte, 1))
			var ne net.Error
			require.True(t, errors.As(err, &ne) && ne.Timeout(), "got %v", err)
			require.ErrorIs(t, err, os.ErrDeadlineExceeded)
			require.NoError(t, c.SetReadDeadline(time.Time{}))

			// Half-close: the server reads the data then EOF, and answers.
			_, err = c.Write([]byte("request"))
			require.NoError(t, err)
			require.NoError(t, c.(interface{ CloseWrite() error }).CloseWrite())
			got, err := io.ReadAll(s)
			require.NoError(t, err)
			require.Equal(t, "request", string(got))
			_, err = s.Write([]byte("response"))
			require.NoError(t, err)
			require.NoError(t, s.Close())
			got, err = io.ReadAll(c)
			require.NoError(t, err)
			require.Equal(t, "response", string(got), "data before the close, then EOF")

			require.NoError(t, c.Close())
			_, err = c.Read(make([]byte, 1))
			require.ErrorIs(t, err, net.ErrClosed)
			_, err = c.Write([]byte("x"))
			require.ErrorIs(t, err, net.ErrClosed)
			require.ErrorIs(t, c.Close(), net.ErrClosed)

			require.NoError(t, ln.Close())
			_, err = ln.Accept()
			require.ErrorIs(t, err, net.ErrClosed)
			require.ErrorIs(t, ln.Close(), net.ErrClosed)

			require.NoError(t, d.Close())
			_, err = d.Dial(network, ln.Addr().String())
			require.ErrorIs(t, err, net.ErrClosed)
		})
	}
}

// Closing the listener stops accepting and nothing more, as for a TCP or
// Unix listener (#15: it ended every session, failing requests in
// flight): Accept fails, an accepted stream goes on working, a
// stream not yet accepted and a new stream on the same session are
// refused (ErrStreamRefused, ECONNREFUSED), and the session ends with its
// last stream.
func TestListenerCloseKeepsStreams(t *testing.T) {
	ln, cfg := listen(t, "unix")
	d := &shmlink.Dialer{Config: cfg}
	defer d.Close()
	c, err := d.Dial("unix", ln.Addr().String())
	require.NoError(t, err)
	s, err := ln.Accept()
	require.NoError(t, err)
	waiting, err := d.Dial("unix", ln.Addr().String()) // never accepted
	require.NoError(t, err)
	require.NoError(t, ln.Close())
	_, err = ln.Accept()
	require.ErrorIs(t, err, net.ErrClosed)
	requireRefused := func(c net.Conn, what string) {
		t.Helper()
		require.NoError(t, c.SetReadDeadline(time.Now().Add(10*time.Second)))
		_, err := c.Read(make([]byte, 1))
		require.ErrorIs(t, err, shmlink.ErrStreamRefused, what)
		require.ErrorIs(t, err, syscall.ECONNREFUSED, what)
		require.NoError(t, c.Close())
	}
	requireRefused(waiting, "a stream Accept never returned")
	late, err := d.Dial("unix", ln.Addr().String()) // the pooled session
	require.NoError(t, err)
	requireRefused(late, "a stream opened after Close")

	// The accepted stream still works both ways.
	_, err = c.Write([]byte("ping"))
	require.NoError(t, err)
	b := make([]byte, 4)
	_, err = io.ReadFull(s, b)
	require.NoError(t, err)
	_, err = s.Write([]byte("pong"))
	require.NoError(t, err)
	_, err = io.ReadFull(c, b)
	require.NoError(t, err)
	require.Equal(t, "pong", string(b))
	require.Equal(t, 1, ln.NumSessions())

	require.NoError(t, s.Close())
	require.NoError(t, c.Close())
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	require.NoError(t, ln.Shutdown(ctx), "the session ends with its last stream")
	require.Zero(t, ln.NumSessions())
}

// CloseSessions ends the listener's sessions at once: a blocked Accept
// returns, and streams on both sides fail promptly, with net.ErrClosed on
// the server's.
func TestListenerCloseSessions(t *testing.T) {
	ln, cfg := listen(t, "unix")
	d := &shmlink.Dialer{Config: cfg}
	defer d.Close()
	c, err := d.Dial("unix", ln.Addr().String())
	require.NoError(t, err)
	s, err := ln.Accept()
	require.NoError(t, err)
	accepted := make(chan error, 1)
	go func() {
		_, err := ln.Accept()
		accepted <- err
	}()
	require.Equal(t, 1, ln.CloseSessions())
	require.ErrorIs(t, <-accepted, net.ErrClosed, "a blocked Accept returns")
	_, err = s.Read(make([]byte, 1))
	require.ErrorIs(t, err, net.ErrClosed)
	require.NoError(t, c.SetReadDeadline(time.Now().Add(10*time.Second)))
	_, err = c.Read(make([]byte, 1))
	require.Error(t, err)
	require.False(t, errors.Is(err, os.ErrDeadlineExceeded), "the session's end, not the deadline: %v", err)
	require.Zero(t, ln.NumSessions())
}

// Shutdown waits for the streams in flight, and past its context ends
// the sessions left and returns the context's error.
func TestListenerShutdownDeadline(t *testing.T) {
	ln, cfg := listen(t, "unix")
	d := &shmlink.Dialer{Config: cfg}
	defer d.Close()
	c, err := d.Dial("unix", ln.Addr().String())
	require.NoError(t, err)
	defer c.Close()
	_, err = ln.Accept()
	require.NoError(t, err)
	ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer cancel()
	require.ErrorIs(t, ln.Shutdown(ctx), context.DeadlineExceeded)
	require.Zero(t, ln.NumSessions(), "Shutdown ended the session left")
}
