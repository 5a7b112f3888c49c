package shmlink_test

import (
	"errors"
	"fmt"
	"io"
	"net"
	"sync"
	"testing"
	"time"

	"github.com/shmlink/shmlink"
	"github.com/shmlink/shmlink/session"
	"github.com/stretchr/testify/require"
)

// serveEcho accepts streams on ln and echoes each until EOF with at most
// workers handler goroutines (streams wait in the accept queue meanwhile);
// the returned function ends ln and its sessions (CloseSessions), which
// ends the streams, and waits for the handlers.
func serveEcho(ln net.Listener, workers int) (stop func()) {
	var wg sync.WaitGroup
	for range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				c, err := ln.Accept()
				if err != nil {
					return
				}
				io.Copy(c, c)
				c.Close()
			}
		}()
	}
	return func() {
		ln.(*shmlink.Listener).CloseSessions() // the handlers' streams end too
		wg.Wait()
	}
}

// The pool grows to MaxSessions when every session has StreamsPerSession
// streams, then spreads further streams over those, and shrinks back when
// sessions stay idle.
func TestDialerPool(t *testing.T) {
	ln, cfg := listen(t, "unix")
	defer serveEcho(ln, 64)()
	d := &shmlink.Dialer{Config: cfg, MaxSessions: 3, StreamsPerSession: 4, IdleTimeout: 20 * time.Millisecond}
	defer d.Close()
	var conns []net.Conn
	sessions := map[*session.Session]int{}
	for range 20 {
		c, err := d.Dial("unix", ln.Addr().String())
		require.NoError(t, err)
		conns = append(conns, c)
		sessions[c.(*shmlink.Stream).Session()]++
	}
	require.Len(t, sessions, 3, "grown to MaxSessions")
	require.Equal(t, 3, d.NumSessions())
	for s, n := range sessions {
		require.True(t, n >= 6 && n <= 7, "streams spread evenly, got %d on %p", n, s)
	}
	for i, c := range conns {
		msg := fmt.Sprint("stream ", i)
		_, err := c.Write([]byte(msg))
		require.NoError(t, err)
		got := make([]byte, len(msg))
		_, err = io.ReadFull(c, got)
		require.NoError(t, err)
		require.Equal(t, msg, string(got))
	}
	for _, c := range conns {
		require.NoError(t, c.Close())
	}
	require.Eventually(t, func() bool { return d.NumSessions() == 0 }, 5*time.Second, time.Millisecond,
		"idle sessions are closed")
	require.Eventually(t, func() bool { return ln.NumSessions() == 0 }, 5*time.Second, time.Millisecond,
		"and end on the server too")

	// The Dialer dials afresh afterwards.
	c, err := d.Dial("unix", ln.Addr().String())
	require.NoError(t, err)
	require.NoError(t, c.Close())
	require.Equal(t, 1, d.NumSessions())
}

// A session that dies (here: the server closed it) is replaced on the
// next Dial.
func TestDialerReplacesDeadSession(t *testing.T) {
	ln, cfg := listen(t, "unix")
	d := &shmlink.Dialer{Config: cfg}
	defer d.Close()
	c, err := d.DialStream(t.Context(), "unix", ln.Addr().String())
	require.NoError(t, err)
	s := c.Session()
	ln.CloseSessions()
	<-s.Done()
	lc := shmlink.ListenConfig{Config: cfg}
	ln2, err := lc.Listen(t.Context(), "unix", ln.Addr().String())
	require.NoError(t, err)
	defer ln2.Close()
	defer serveEcho(ln2, 1)()
	c2, err := d.DialStream(t.Context(), "unix", ln.Addr().String())
	require.NoError(t, err)
	require.NotSame(t, s, c2.Session())
	require.Equal(t, 1, d.NumSessions())
	_, err = c2.Write([]byte("hi"))
	require.NoError(t, err)
	_, err = io.ReadFull(c2, make([]byte, 2))
	require.NoError(t, err)
	require.NoError(t, c2.Close())
}

func TestDialerConfigErrors(t *testing.T) {
	for _, tc := range []struct {
		d     *shmlink.Dialer
		field string
	}{
		{&shmlink.Dialer{MaxSessions: -1}, "Dialer.MaxSessions"},
		{&shmlink.Dialer{StreamsPerSession: -1}, "Dialer.StreamsPerSession"},
		{&shmlink.Dialer{Config: &shmlink.Config{QueueCap: 1 << 30}}, "QueueCap"},
	} {
		_, err := tc.d.Dial("unix", "/nonexistent")
		var ce *session.ConfigError
		require.True(t, errors.As(err, &ce), "got %v", err)
		require.Equal(t, tc.field, ce.Field)
		require.Contains(t, err.Error(), tc.field)
	}
}
