package shmlink_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math"
	"net"
	"sync"
	"testing"
	"time"

	"github.com/shmlink/shmlink"
	"github.com/shmlink/shmlink/internal/testhook"
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
		requireEcho(t, c, fmt.Sprint("stream ", i))
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

// A session whose stream ids ran out (against a server that never answers
// closes, no id comes back for reuse) is set aside: the dial that found it
// so opens its stream on a new session, and the spent session serves its
// streams until the last one closes, and then ends. docs/protocol.md
// section 18.
func TestDialerSessionOutOfIDs(t *testing.T) {
	testhook.FirstStreamID.Store(math.MaxUint32 - 1) // two ids per session
	defer testhook.FirstStreamID.Store(0)
	ln, cfg := listen(t, "unix")
	defer serveEcho(ln, 3)()
	d := &shmlink.Dialer{Config: cfg, IdleTimeout: -1} // no idle timeout: the spent session must end by itself
	defer d.Close()
	var conns []*shmlink.Stream
	for range 3 {
		c, err := d.DialStream(t.Context(), "unix", ln.Addr().String())
		require.NoError(t, err)
		conns = append(conns, c)
	}
	spent := conns[0].Session()
	require.Same(t, spent, conns[1].Session())
	require.NotSame(t, spent, conns[2].Session(), "the third stream went to a new session")
	require.Equal(t, 2, d.NumSessions(), "the spent session is kept while it has streams")
	for i, c := range conns {
		requireEcho(t, c, fmt.Sprint("stream ", i))
	}
	require.NoError(t, conns[0].Close())
	require.NoError(t, spent.Err(), "one stream is left on the spent session")
	require.NoError(t, conns[1].Close())
	select {
	case <-spent.Done():
	case <-time.After(10 * time.Second):
		t.Fatal("the spent session did not end after its last stream closed")
	}
	require.ErrorIs(t, spent.Err(), session.ErrSessionClosed)
	require.Equal(t, 1, d.NumSessions())
	requireEcho(t, conns[2], "the new session is unaffected")
	require.NoError(t, conns[2].Close())
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

// While a Dialer dials a new session, dials keep going to the loaded
// session only up to twice StreamsPerSession; later ones wait for the new
// session, or, when its dial fails, take the loaded one after all. Without
// the bound a burst lands on one session, and past its server's accept
// backlog the server refuses streams that the dials returned.
func TestDialerBurstWhileDialing(t *testing.T) {
	for _, fail := range []bool{false, true} {
		t.Run(fmt.Sprint("dial fails=", fail), func(t *testing.T) {
			ln, cfg := listen(t, "unix")
			defer serveEcho(ln, 32)()
			const perSession, waiters = 4, 3
			d := &shmlink.Dialer{Config: cfg, MaxSessions: 2, StreamsPerSession: perSession}
			defer d.Close()
			dialing, release := make(chan struct{}), make(chan struct{})
			var releaseOnce sync.Once
			defer releaseOnce.Do(func() { close(release) }) // a failed test leaves no dial blocked
			calls := 0
			shmlink.SetDialHook(d, time.Hour, func(real shmlink.SessionDialer) shmlink.SessionDialer {
				return func(ctx context.Context, cfg *shmlink.Config, network, address string) (*session.Session, error) {
					calls++ // under the pool's one dial at a time
					if calls == 1 {
						return real(ctx, cfg, network, address)
					}
					close(dialing)
					<-release
					if fail {
						return nil, errors.New("test: dial refused")
					}
					return real(ctx, cfg, network, address)
				}
			})
			waiting := make(chan struct{}, waiters)
			shmlink.SetWaitHook(d, func() { waiting <- struct{}{} })
			addr := ln.Addr().String()
			ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second) // a dial that should not wait fails
			defer cancel()
			dial := func() (*shmlink.Stream, error) { return d.DialStream(ctx, "unix", addr) }

			var conns []*shmlink.Stream
			for range perSession {
				c, err := dial()
				require.NoError(t, err)
				conns = append(conns, c)
			}
			first := conns[0].Session()

			// One dial starts the second session and is held; meanwhile the
			// first session takes streams up to twice perSession.
			results := make(chan *shmlink.Stream, 1+waiters)
			errs := make(chan error, 1+waiters)
			async := func() {
				go func() {
					if c, err := dial(); err != nil {
						errs <- err
					} else {
						results <- c
					}
				}()
			}
			async()
			<-dialing
			for range perSession {
				c, err := dial()
				require.NoError(t, err)
				require.Same(t, first, c.Session())
				conns = append(conns, c)
			}
			require.Equal(t, 2*perSession, first.NumStreams())
			// The next dials wait for the second session.
			for range waiters {
				async()
			}
			for range waiters {
				select {
				case <-waiting:
				case c := <-results:
					t.Fatalf("a dial went to %p while the first session was full", c.Session())
				case err := <-errs:
					t.Fatal(err)
				}
			}
			releaseOnce.Do(func() { close(release) })
			for range 1 + waiters {
				select {
				case c := <-results:
					if fail {
						require.Same(t, first, c.Session(), "the pool could not grow")
					} else {
						require.NotSame(t, first, c.Session(), "waited for the new session")
					}
					conns = append(conns, c)
				case err := <-errs:
					t.Fatal(err)
				}
			}
			for i, c := range conns {
				requireEcho(t, c, fmt.Sprint("stream ", i))
				require.NoError(t, c.Close())
			}
			require.Zero(t, ln.Stats().StreamsRefused)
			require.Equal(t, 2, calls)
		})
	}
}

// A dial that would grow a pool and fails leaves the stream on a session
// the pool has, and is logged; the pool tries to grow again only after
// the retry delay.
func TestDialerGrowFailureKeepsSessions(t *testing.T) {
	ln, cfg := listen(t, "unix")
	defer serveEcho(ln, 8)()
	for _, retry := range []time.Duration{time.Hour, time.Nanosecond} {
		t.Run("retry="+retry.String(), func(t *testing.T) {
			var logged logBuffer // each case's own: the log checks are its
			lcfg := *cfg
			lcfg.Logger = slog.New(slog.NewTextHandler(&logged, nil))
			d := &shmlink.Dialer{Config: &lcfg, MaxSessions: 2, StreamsPerSession: 2}
			defer d.Close()
			calls := 0
			shmlink.SetDialHook(d, retry, func(real shmlink.SessionDialer) shmlink.SessionDialer {
				return func(ctx context.Context, cfg *shmlink.Config, network, address string) (*session.Session, error) {
					calls++
					if calls == 2 {
						return nil, errors.New("test: dial refused")
					}
					return real(ctx, cfg, network, address)
				}
			})
			sessions := map[*session.Session]int{}
			for range 6 {
				c, err := d.DialStream(t.Context(), "unix", ln.Addr().String())
				require.NoError(t, err)
				defer c.Close()
				sessions[c.Session()]++
			}
			if retry == time.Hour {
				require.Equal(t, 2, calls, "no second try within the retry delay")
				require.Len(t, sessions, 1)
			} else {
				require.Equal(t, 3, calls, "the next dial after the delay grew the pool")
				require.Len(t, sessions, 2)
			}
			require.Contains(t, logged.String(), "could not add a session")
			require.Contains(t, logged.String(), "test: dial refused")
		})
	}
}
