package shmlink_test

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"runtime"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/quic-go/quic-go"
	"github.com/quic-go/quic-go/qlog"
	"github.com/quic-go/quic-go/qlogwriter"
	"github.com/shmlink/shmlink"
	"github.com/shmlink/shmlink/internal/peertest"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/net/nettest"
)

// quicTLS writes TLS material to a temporary directory and returns the
// directory and the server's and client's configs.
func quicTLS(t *testing.T, mutual bool) (dir string, server, client *tls.Config) {
	t.Helper()
	dir = t.TempDir()
	require.NoError(t, peertest.WriteTLS(dir))
	server, client, err := peertest.LoadTLS(dir, mutual)
	require.NoError(t, err)
	return dir, server, client
}

// quicPair listens on 127.0.0.1 over "quic" in this process and returns
// the listener and a Dialer for it, both closed when the test ends.
func quicPair(t *testing.T) (*shmlink.Listener, *shmlink.Dialer) {
	t.Helper()
	_, stls, ctls := quicTLS(t, false)
	lc := shmlink.ListenConfig{TLSConfig: stls}
	ln, err := lc.Listen(t.Context(), "quic", "127.0.0.1:0")
	require.NoError(t, err)
	d := &shmlink.Dialer{TLSConfig: ctls}
	t.Cleanup(func() {
		d.Close()
		ln.CloseSessions()
	})
	return ln, d
}

// The net.Conn contract holds over QUIC as over shared memory (Go's
// nettest conformance suite).
func TestQUICNettest(t *testing.T) {
	ln, d := quicPair(t)
	nettest.TestConn(t, func() (c1, c2 net.Conn, stop func(), err error) {
		type accepted struct {
			c   net.Conn
			err error
		}
		ch := make(chan accepted, 1)
		go func() {
			c, err := ln.Accept()
			ch <- accepted{c, err}
		}()
		c1, err = d.Dial("quic", ln.Addr().String())
		if err != nil {
			return nil, nil, nil, err
		}
		a := <-ch // before any byte is written: the stream's preamble
		if a.err != nil {
			c1.Close()
			return nil, nil, nil, a.err
		}
		return c1, a.c, func() { c1.Close(); a.c.Close() }, nil
	})
}

// A nil TLS config is a *ConfigError on both sides; the zero-copy entry
// points say that a QUIC stream has no shared memory.
func TestQUICConfigErrors(t *testing.T) {
	var ce *shmlink.ConfigError
	_, err := (&shmlink.ListenConfig{}).Listen(t.Context(), "quic", "127.0.0.1:0")
	require.ErrorAs(t, err, &ce)
	require.Contains(t, err.Error(), "TLSConfig")
	_, err = (&shmlink.ListenConfig{TLSConfig: &tls.Config{}}).Listen(t.Context(), "quic", "127.0.0.1:0")
	require.ErrorAs(t, err, &ce, "a server TLS config without a certificate")
	_, err = shmlink.Dial("quic", "127.0.0.1:1")
	require.ErrorAs(t, err, &ce)
	_, err = (&shmlink.Dialer{}).Dial("quic", "127.0.0.1:1")
	require.ErrorAs(t, err, &ce)

	ln, d := quicPair(t)
	_, err = ln.AcceptStream()
	require.ErrorIs(t, err, shmlink.ErrNoSharedMemory)
	_, err = d.DialStream(t.Context(), "quic", ln.Addr().String())
	require.ErrorIs(t, err, shmlink.ErrNoSharedMemory)
}

// QUIC config fields with which shmlink cannot work are a *ConfigError at
// Listen and at the dial, naming the field, rather than dials that hang
// later (docs/protocol.md section 17, Defaults): RequireStreamCreditRelease
// (shmlink releases no credit, so a connection would take MaxIncomingStreams
// streams in all), a negative MaxIncomingStreams on the server (no stream
// at all) and a negative MaxIncomingUniStreams (none of shmlink's
// messages). A negative MaxIncomingStreams on a Dialer, to which servers
// open no stream, works. A config that the listener's GetConfigForClient
// returns is checked too: the connection is refused.
func TestQUICConfigRejected(t *testing.T) {
	_, stls, ctls := quicTLS(t, false)
	for _, c := range []struct {
		cfg   *quic.Config
		field string
	}{
		{&quic.Config{RequireStreamCreditRelease: true}, "RequireStreamCreditRelease"},
		{&quic.Config{MaxIncomingStreams: -1}, "MaxIncomingStreams"},
		{&quic.Config{MaxIncomingUniStreams: -1}, "MaxIncomingUniStreams"},
	} {
		var ce *shmlink.ConfigError
		_, err := (&shmlink.ListenConfig{TLSConfig: stls, QUICConfig: c.cfg}).Listen(t.Context(), "quic", "127.0.0.1:0")
		require.ErrorAs(t, err, &ce, c.field)
		require.Equal(t, "ListenConfig.QUICConfig."+c.field, ce.Field)
		if c.field == "MaxIncomingStreams" {
			continue
		}
		d := &shmlink.Dialer{TLSConfig: ctls, QUICConfig: c.cfg}
		_, err = d.Dial("quic", "127.0.0.1:1")
		require.ErrorAs(t, err, &ce, c.field)
		require.Equal(t, "Dialer.QUICConfig."+c.field, ce.Field)
		require.NoError(t, d.Close())
	}

	get := &quic.Config{GetConfigForClient: func(*quic.ClientInfo) (*quic.Config, error) {
		return &quic.Config{RequireStreamCreditRelease: true}, nil
	}}
	ln, err := (&shmlink.ListenConfig{TLSConfig: stls, QUICConfig: get}).Listen(t.Context(), "quic", "127.0.0.1:0")
	require.NoError(t, err)
	defer ln.CloseSessions()
	d := &shmlink.Dialer{TLSConfig: ctls, QUICConfig: &quic.Config{MaxIncomingStreams: -1}}
	defer d.Close()
	ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
	defer cancel()
	_, err = d.DialContext(ctx, "quic", ln.Addr().String())
	require.ErrorIs(t, err, shmlink.ErrHandshake, "GetConfigForClient's config refuses the connection")
	require.ErrorContains(t, err, "CONNECTION_REFUSED")

	ln2, d2 := quicPair(t)
	d2.QUICConfig = &quic.Config{MaxIncomingStreams: -1}
	c, s := dialAccepted(t, d2, ln2, "quic")
	_, err = c.Write([]byte("x"))
	require.NoError(t, err)
	_, err = io.ReadFull(s, make([]byte, 1))
	require.NoError(t, err, "a Dialer that takes no stream of the server's works")
}

// A QUIC config that quic-go would reject (here a QUIC version it does not
// know) is a *ConfigError before a new listener takes the upgrade socket
// over, not after the running listener handed its socket over: that one
// keeps serving, new connections included, and a good upgrade then goes
// through as the first (docs/protocol.md section 17, Hot upgrade). A
// Dialer's such config is a *ConfigError too, not a failed handshake.
func TestQUICUpgradeBadConfigKeepsServing(t *testing.T) {
	stls, ctls := sharedQUICTLS(t)
	usock := filepath.Join(t.TempDir(), "upgrade.sock")
	a, err := (&shmlink.ListenConfig{TLSConfig: stls, UpgradeSocket: usock}).Listen(t.Context(), "quic", "127.0.0.1:0")
	require.NoError(t, err)
	stopA := serveEcho(a, 4)
	defer stopA()
	addr := a.Addr().String()

	bad := &quic.Config{Versions: []quic.Version{0x2a2a2a2a}}
	var ce *shmlink.ConfigError
	_, err = (&shmlink.ListenConfig{TLSConfig: stls, UpgradeSocket: usock, QUICConfig: bad}).Listen(t.Context(), "quic", addr)
	require.ErrorAs(t, err, &ce)
	require.Equal(t, "ListenConfig.QUICConfig.Versions", ce.Field)
	select {
	case <-a.Upgraded():
		t.Fatal("the running listener handed over to a listener that failed")
	default:
	}
	d := &shmlink.Dialer{TLSConfig: ctls}
	defer d.Close()
	ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
	defer cancel()
	c, err := d.DialContext(ctx, "quic", addr)
	require.NoError(t, err, "the running listener takes new connections")
	require.NoError(t, peertest.Echo(c, 1000, 1))
	require.NoError(t, c.Close())

	_, err = (&shmlink.Dialer{TLSConfig: ctls, QUICConfig: bad}).DialContext(ctx, "quic", addr)
	require.ErrorAs(t, err, &ce)
	require.Equal(t, "Dialer.QUICConfig.Versions", ce.Field)
	require.NotErrorIs(t, err, shmlink.ErrHandshake)

	b, err := (&shmlink.ListenConfig{TLSConfig: stls, UpgradeSocket: usock}).Listen(t.Context(), "quic", addr)
	require.NoError(t, err)
	stopB := serveEcho(b, 4)
	defer stopB()
	require.Equal(t, uint64(1), b.Epoch(), "the failed listen did not count")
	waitChan(t, a.Upgraded(), "the old listener to drain")
	c, err = d.DialContext(ctx, "quic", addr)
	require.NoError(t, err)
	require.NoError(t, peertest.Echo(c, 1000, 2))
	require.NoError(t, c.Close())
}

// A "quic" dial's name lookup is bounded by the dial's context: with a DNS
// server that never answers (a resolver whose connections wait for their
// context), a dial whose context ends returns the context's error then,
// not the lookup's after its own timeouts (docs/protocol.md section 17,
// Connection). No packet leaves the host.
func TestQUICDialLookupHonoursContext(t *testing.T) {
	_, _, ctls := quicTLS(t, false)
	d := &shmlink.Dialer{TLSConfig: ctls}
	defer d.Close()
	var asked atomic.Int32
	shmlink.SetQUICResolver(d, &net.Resolver{
		PreferGo: true,
		Dial: func(ctx context.Context, _, _ string) (net.Conn, error) {
			asked.Add(1)
			<-ctx.Done() // a DNS server that never answers
			return nil, ctx.Err()
		},
	})
	const name = "shmlink-test.invalid:4433" // not in /etc/hosts: asks DNS
	for _, c := range []struct {
		why  string
		ctx  func() (context.Context, context.CancelFunc)
		want error
	}{
		{"deadline", func() (context.Context, context.CancelFunc) {
			return context.WithTimeout(t.Context(), 100*time.Millisecond)
		}, context.DeadlineExceeded},
		{"cancelled", func() (context.Context, context.CancelFunc) {
			ctx, cancel := context.WithCancel(t.Context())
			cancel()
			return ctx, cancel
		}, context.Canceled},
	} {
		ctx, cancel := c.ctx()
		done := make(chan error, 1)
		go func() {
			_, err := d.DialContext(ctx, "quic", name)
			done <- err
		}()
		select {
		case err := <-done:
			require.ErrorIs(t, err, c.want, c.why)
			require.NotErrorIs(t, err, shmlink.ErrHandshake, c.why)
		case <-time.After(10 * time.Second):
			t.Fatalf("%s: the dial's lookup outlived its context", c.why)
		}
		cancel()
	}
	require.NotZero(t, asked.Load(), "the lookup asked the DNS server")
}

// The error vocabulary of a stream over QUIC: io.EOF at the peer's close,
// net.ErrClosed after our own, os.ErrDeadlineExceeded at a deadline, and
// ECONNRESET when the peer stopped reading; CloseWrite is a half close.
func TestQUICStreamErrors(t *testing.T) {
	ln, d := quicPair(t)
	c, err := d.Dial("quic", ln.Addr().String())
	require.NoError(t, err)
	s, err := ln.Accept()
	require.NoError(t, err)

	require.NoError(t, c.SetReadDeadline(time.Now().Add(10*time.Millisecond)))
	_, err = c.Read(make([]byte, 1))
	require.ErrorIs(t, err, os.ErrDeadlineExceeded)
	require.NoError(t, c.SetReadDeadline(time.Time{}))

	// Half close: the server reads EOF after the data and still writes.
	_, err = c.Write([]byte("ping"))
	require.NoError(t, err)
	require.NoError(t, c.(interface{ CloseWrite() error }).CloseWrite())
	_, err = c.Write([]byte("x"))
	require.ErrorIs(t, err, net.ErrClosed)
	got, err := io.ReadAll(s)
	require.NoError(t, err)
	require.Equal(t, "ping", string(got))
	_, err = s.Write([]byte("pong"))
	require.NoError(t, err)
	buf := make([]byte, 4)
	_, err = io.ReadFull(c, buf)
	require.NoError(t, err)
	require.Equal(t, "pong", string(buf))

	// The client closes: the server's writes find it gone.
	require.NoError(t, c.Close())
	_, err = c.Read(buf)
	require.ErrorIs(t, err, net.ErrClosed)
	require.ErrorIs(t, c.Close(), net.ErrClosed)
	require.Eventually(t, func() bool {
		_, err = s.Write(make([]byte, 1<<10))
		return err != nil
	}, 5*time.Second, time.Millisecond)
	require.ErrorIs(t, err, syscall.ECONNRESET)
	require.ErrorIs(t, err, shmlink.ErrPeerClosed)
	require.NoError(t, s.Close())

	st := d.Stats()
	require.EqualValues(t, 4, st.BytesSent, "the client's ping")
	require.EqualValues(t, 4, st.BytesReceived, "the server's pong")
	require.Zero(t, st.ActiveStreams)
	require.EqualValues(t, 4, ln.Stats().BytesReceived)
}

// A server that asks for client certificates (mutual TLS) refuses a
// Dialer without one, which reads ErrHandshake, and serves one with.
func TestQUICMutualTLS(t *testing.T) {
	_, stls, ctls := quicTLS(t, true)
	ln, err := (&shmlink.ListenConfig{TLSConfig: stls}).Listen(t.Context(), "quic", "127.0.0.1:0")
	require.NoError(t, err)
	defer ln.CloseSessions()
	go serveStreams(ln)

	anon := ctls.Clone()
	anon.Certificates = nil
	d := &shmlink.Dialer{TLSConfig: anon}
	defer d.Close()
	ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
	defer cancel()
	c, err := d.DialContext(ctx, "quic", ln.Addr().String())
	if err == nil { // TLS 1.3: the client may learn of the refusal at its first read
		_, err = c.Write(peertest.Command(peertest.CmdEcho, 0))
		if err == nil {
			err = peertest.Echo(c, 10, 1)
		}
		c.Close()
	}
	require.Error(t, err, "a client without a certificate was served")
	require.ErrorIs(t, err, shmlink.ErrHandshake, "the server's TLS alert: %v", err)

	d2 := &shmlink.Dialer{TLSConfig: ctls}
	defer d2.Close()
	c, err = d2.DialContext(ctx, "quic", ln.Addr().String())
	require.NoError(t, err)
	defer c.Close()
	_, err = c.Write(peertest.Command(peertest.CmdEcho, 0))
	require.NoError(t, err)
	require.NoError(t, peertest.Echo(c, 1000, 2))
}

// startQUICPeer starts the test binary as a "quic" server and returns its
// address and a Dialer for it with an idle timeout of idle.
func startQUICPeer(t *testing.T, idle time.Duration) (*peertest.Proc, string, *shmlink.Dialer) {
	t.Helper()
	dir, _, ctls := quicTLS(t, false)
	proc := peertest.Start(t, "server", peertest.Params{Network: "quic", Addr: "127.0.0.1:0", Dir: dir})
	addr := proc.Expect(t, "ready ")
	d := &shmlink.Dialer{TLSConfig: ctls, QUICConfig: &quic.Config{MaxIdleTimeout: idle}}
	t.Cleanup(func() { d.Close() })
	return proc, addr, d
}

// Two processes over QUIC on loopback: every size from 1 B to 8 MiB
// echoed and checked, then 1000 streams at once.
func TestQUICTwoProcesses(t *testing.T) {
	proc, addr, d := startQUICPeer(t, 0)
	echo := func(n int, seed uint64) error {
		c, err := d.Dial("quic", addr)
		if err != nil {
			return err
		}
		defer c.Close()
		c.SetDeadline(time.Now().Add(time.Minute))
		if _, err := c.Write(peertest.Command(peertest.CmdEcho, 0)); err != nil {
			return err
		}
		return peertest.Echo(c, n, seed)
	}
	echoed := 0
	for i, n := range []int{1, 100, 4 << 10, 64 << 10, 1 << 20, 8 << 20} {
		require.NoError(t, echo(n, uint64(i)), "%d bytes", n)
		echoed += n
	}
	var wg sync.WaitGroup
	errs := make(chan error, 1000)
	for i := range 1000 {
		wg.Go(func() {
			if err := echo(1000+i, uint64(i)); err != nil {
				errs <- fmt.Errorf("stream %d: %w", i, err)
			}
		})
	}
	wg.Wait()
	close(errs)
	require.NoError(t, <-errs)
	for i := range 1000 {
		echoed += 1000 + i
	}
	require.Equal(t, 1, d.NumSessions(), "one QUIC connection per address")
	st := d.Stats()
	require.Zero(t, st.ActiveStreams)
	require.EqualValues(t, echoed, st.BytesReceived)
	require.EqualValues(t, echoed+1006*9, st.BytesSent, "the echoed bytes and a command per stream")
	proc.Stop(t)
}

// A server killed with SIGKILL: the client's blocked read returns an
// error that says the peer is gone within the idle timeout, and the next
// dial fails instead of hanging.
func TestQUICPeerKilled(t *testing.T) {
	proc, addr, d := startQUICPeer(t, 2*time.Second)
	c, err := d.Dial("quic", addr)
	require.NoError(t, err)
	defer c.Close()
	_, err = c.Write(peertest.Command(peertest.CmdEcho, 0))
	require.NoError(t, err)
	require.NoError(t, peertest.Echo(c, 100, 1))

	read := make(chan error, 1)
	go func() {
		_, err := c.Read(make([]byte, 1))
		read <- err
	}()
	proc.Crash(t)
	select {
	case err = <-read:
	case <-time.After(30 * time.Second):
		t.Fatal("a read on a stream of a killed peer still blocks after 30 s")
	}
	require.ErrorIs(t, err, syscall.ECONNRESET)
	require.False(t, errors.Is(err, io.EOF))

	ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
	defer cancel()
	_, err = d.DialContext(ctx, "quic", addr)
	require.Error(t, err)
	require.NoError(t, ctx.Err(), "the dial hung until its context ended")
}

// Stats and slog work over QUIC as over shared memory: the listener's
// Logger hears of each connection's start and end, and a stream that
// does not start with the preamble is reset and logged.
func TestQUICLogsAndStats(t *testing.T) {
	var log logBuffer
	_, stls, ctls := quicTLS(t, false)
	cfg := &shmlink.Config{Logger: slog.New(slog.NewTextHandler(&log, &slog.HandlerOptions{Level: slog.LevelDebug}))}
	ln, err := (&shmlink.ListenConfig{Config: cfg, TLSConfig: stls}).Listen(t.Context(), "quic", "127.0.0.1:0")
	require.NoError(t, err)
	defer ln.CloseSessions()
	go serveStreams(ln)

	d := &shmlink.Dialer{TLSConfig: ctls}
	c, err := d.Dial("quic", ln.Addr().String())
	require.NoError(t, err)
	_, err = c.Write(peertest.Command(peertest.CmdEcho, 0))
	require.NoError(t, err)
	require.NoError(t, peertest.Echo(c, 5000, 1))
	require.NoError(t, c.Close())
	// The server counts its bytes once its writes return, which may be
	// after the client has read them.
	require.EventuallyWithT(t, func(c *assert.CollectT) {
		st := ln.Stats()
		assert.EqualValues(c, 5009, st.BytesReceived, "the command and the echo")
		assert.EqualValues(c, 5000, st.BytesSent)
	}, 10*time.Second, time.Millisecond)
	require.Equal(t, 1, ln.NumSessions())

	// A QUIC peer of the same ALPN whose stream skips the preamble.
	tc := ctls.Clone()
	tc.NextProtos = []string{"shmlink/1"}
	raw, err := quic.DialAddr(t.Context(), ln.Addr().String(), tc, nil)
	require.NoError(t, err)
	s, err := raw.OpenStreamSync(t.Context())
	require.NoError(t, err)
	_, err = s.Write([]byte{0x7f, 1, 2, 3})
	require.NoError(t, err)
	_, err = s.Read(make([]byte, 1))
	var se *quic.StreamError
	require.ErrorAs(t, err, &se, "the server resets a stream without the preamble")
	require.EqualValues(t, 2, se.ErrorCode)
	raw.CloseWithError(0, "")

	require.NoError(t, d.Close())
	require.Eventually(t, func() bool { return ln.NumSessions() == 0 }, 10*time.Second, time.Millisecond)
	out := log.String()
	require.Contains(t, out, "QUIC connection started")
	require.Contains(t, out, "QUIC connection ended")
	require.Contains(t, out, "preamble 0x7f")
}

// A QUIC connection without a stream for Dialer.IdleTimeout is closed,
// at the server too, and the next dial opens another.
func TestQUICDialerIdleTimeout(t *testing.T) {
	ln, d := quicPair(t)
	d.IdleTimeout = 20 * time.Millisecond
	go serveStreams(ln)
	echo := func(seed uint64) {
		c, err := d.Dial("quic", ln.Addr().String())
		require.NoError(t, err)
		defer c.Close()
		_, err = c.Write(peertest.Command(peertest.CmdEcho, 0))
		require.NoError(t, err)
		require.NoError(t, peertest.Echo(c, 100, seed))
	}
	echo(1)
	require.Eventually(t, func() bool { return d.NumSessions() == 0 && ln.NumSessions() == 0 },
		10*time.Second, time.Millisecond, "the idle connection stays")
	echo(2)
	require.Equal(t, 1, d.NumSessions())
}

// dialAccepted dials ln with d on network and accepts the stream; both
// ends are closed when the test ends.
func dialAccepted(t *testing.T, d *shmlink.Dialer, ln *shmlink.Listener, network string) (c, s net.Conn) {
	t.Helper()
	c, err := d.Dial(network, ln.Addr().String())
	require.NoError(t, err)
	t.Cleanup(func() { c.Close() })
	s, err = ln.Accept()
	require.NoError(t, err)
	t.Cleanup(func() { s.Close() })
	return c, s
}

// A peer's end of the connection (here the server's CloseSessions) reads
// as ErrPeerClosed (ECONNRESET), as over shared memory, and not as a local
// close: net.ErrClosed stays for this side's own Close. Guards the error
// mapping of quic-go's connection errors, which all unwrap to
// net.ErrClosed (docs/protocol.md section 17, Errors).
func TestQUICPeerEndIsNotLocalClose(t *testing.T) {
	run := func(t *testing.T, ln *shmlink.Listener, d *shmlink.Dialer, network string) {
		c, s := dialAccepted(t, d, ln, network)
		require.Equal(t, 1, ln.CloseSessions())
		c.SetReadDeadline(time.Now().Add(10 * time.Second))
		_, err := c.Read(make([]byte, 1))
		require.ErrorIs(t, err, shmlink.ErrPeerClosed)
		require.ErrorIs(t, err, syscall.ECONNRESET)
		require.NotErrorIs(t, err, net.ErrClosed, "the peer's close reads as a local one")
		var se *shmlink.SessionError
		require.ErrorAs(t, err, &se, "the session's end, as over shared memory")
		_, err = s.Read(make([]byte, 1))
		require.ErrorIs(t, err, net.ErrClosed, "the server's own end is a local close")
	}
	t.Run("unix", func(t *testing.T) {
		ln, err := (&shmlink.ListenConfig{}).Listen(t.Context(), "unix", filepath.Join(t.TempDir(), "s.sock"))
		require.NoError(t, err)
		d := &shmlink.Dialer{}
		defer d.Close()
		run(t, ln, d, "unix")
	})
	t.Run("quic", func(t *testing.T) {
		ln, d := quicPair(t)
		run(t, ln, d, "quic")
	})
}

// Streams refused because the listener closed read ErrStreamRefused
// (ECONNREFUSED), as Listener.Close promises and as over shared memory:
// one that reached the server but that Accept never returned, and one
// opened after Close on a connection that a live stream keeps. Guards
// the mapping of quicCodeRefused (docs/protocol.md section 17).
func TestQUICRefusedAfterListenerClose(t *testing.T) {
	ln, d := quicPair(t)
	c1, err := d.Dial("quic", ln.Addr().String())
	require.NoError(t, err)
	defer c1.Close()
	s1, err := ln.Accept()
	require.NoError(t, err)
	defer s1.Close() // keeps the QUIC connection

	// Reaches the server, which reads its preamble, but is never accepted.
	pending, err := d.Dial("quic", ln.Addr().String())
	require.NoError(t, err)
	defer pending.Close()
	require.NoError(t, ln.Close())
	late, err := d.Dial("quic", ln.Addr().String())
	require.NoError(t, err)
	defer late.Close()

	for _, c := range []net.Conn{pending, late} {
		c.SetReadDeadline(time.Now().Add(10 * time.Second))
		_, err = c.Read(make([]byte, 1))
		require.ErrorIs(t, err, shmlink.ErrStreamRefused)
		require.ErrorIs(t, err, syscall.ECONNREFUSED)
	}
	require.EqualValues(t, 2, ln.Stats().StreamsRefused)
}

// A connection whose handshake completes while Listener.Close runs, and
// that therefore waits in quic-go's accept queue, is refused: its client
// reads ErrStreamRefused, as Close promises for the streams Accept never
// returned, instead of waiting for ever on a connection that no one
// serves and that keepalives keep alive (docs/protocol.md section 17).
// The hook holds Close where it has stopped accepting streams and not yet
// closed quic-go's listener; a live stream keeps the listener's socket
// open meanwhile.
func TestQUICCloseRefusesQueuedConnection(t *testing.T) {
	_, stls, ctls := quicTLS(t, false)
	ln, err := (&shmlink.ListenConfig{TLSConfig: stls}).Listen(t.Context(), "quic", "127.0.0.1:0")
	require.NoError(t, err)
	defer ln.CloseSessions()
	d := &shmlink.Dialer{TLSConfig: ctls}
	defer d.Close()
	dialAccepted(t, d, ln, "quic") // held: the socket stays open after Close

	held, release := make(chan struct{}), make(chan struct{})
	shmlink.SetQUICCloseHook(ln, func() {
		close(held)
		<-release
	})
	closed := make(chan error, 1)
	go func() { closed <- ln.Close() }()
	waitChan(t, held, "Close to stop accepting")

	// A connection of its own, whose dial returns once the client's side
	// of the handshake completed: the server's completes when the client's
	// last handshake message arrives, and puts the connection in the accept
	// queue; it then confirms the handshake to the client, or closes the
	// connection, which the tracer reports. Until then, the close of
	// quic-go's listener would refuse the handshake instead (quic-go's
	// CONNECTION_REFUSED, TestQUICConnectionRefusedIsStreamRefused).
	trace := &handshakeTrace{settled: make(chan struct{})}
	late := &shmlink.Dialer{TLSConfig: ctls, QUICConfig: &quic.Config{
		Tracer: func(context.Context, bool, quic.ConnectionID) qlogwriter.Trace { return trace },
	}}
	defer late.Close()
	c, err := late.Dial("quic", ln.Addr().String())
	require.NoError(t, err, "the handshake completes: the listener is still open")
	defer c.Close()
	waitChan(t, trace.settled, "the server to complete the handshake")
	close(release)
	select {
	case err := <-closed:
		require.NoError(t, err)
	case <-time.After(10 * time.Second):
		t.Fatal("Close did not return")
	}

	c.SetReadDeadline(time.Now().Add(10 * time.Second))
	_, err = c.Read(make([]byte, 1))
	require.ErrorIs(t, err, shmlink.ErrStreamRefused, "the queued connection is refused, not left waiting")
	require.ErrorIs(t, err, syscall.ECONNREFUSED)
}

// A connection that quic-go's closing listener refused in its handshake
// (CONNECTION_REFUSED), after the client's side of the handshake had
// completed, reads ErrStreamRefused, as one that shmlink's closed
// listener refused with code 1 (docs/protocol.md section 17, Errors):
// which of the two a connection gets depends on when its handshake
// completes on the server.
func TestQUICConnectionRefusedIsStreamRefused(t *testing.T) {
	err := shmlink.QUICErr("read", &quic.TransportError{Remote: true, ErrorCode: quic.ConnectionRefused})
	require.ErrorIs(t, err, shmlink.ErrStreamRefused)
	require.ErrorIs(t, err, syscall.ECONNREFUSED)
	require.NotErrorIs(t, err, net.ErrClosed, "the peer's refusal reads as a local close")
	var se *shmlink.SessionError
	require.ErrorAs(t, err, &se, "the connection's end, as a refused connection's")
	require.Contains(t, err.Error(), "CONNECTION_REFUSED")
}

// handshakeTrace is a client connection's qlog trace that closes settled
// once the server's side of the handshake is known to have ended: the
// handshake is confirmed (the server completed it), or the connection
// closed (the server refused it, before or after completing it). It
// records nothing else.
type handshakeTrace struct {
	settled chan struct{}
	once    sync.Once
}

func (h *handshakeTrace) AddProducer() qlogwriter.Recorder { return h }
func (h *handshakeTrace) Close() error                     { return nil }

func (h *handshakeTrace) RecordEvent(ev qlogwriter.Event) {
	switch e := ev.(type) {
	case qlog.ConnectionStateUpdated:
		if e.State != qlog.ConnectionStateHandshakeConfirmed {
			return
		}
	case qlog.ConnectionClosed:
	default:
		return
	}
	h.once.Do(func() { close(h.settled) })
}

// A dial that finds the server's stream limit reached on its connection
// (here MaxIncomingStreams 1, and a stream the application has not
// accepted) waits for Config.QueueFullTimeout, not for ever, and fails
// with ErrQueueFull, as a dial that finds the IO queue full over shared
// memory; a context that ends first ends it with its error. Once a stream
// ends, the connection takes the next one (docs/protocol.md section 17,
// Streams).
func TestQUICDialAtStreamLimit(t *testing.T) {
	_, stls, ctls := quicTLS(t, false)
	lc := shmlink.ListenConfig{TLSConfig: stls, QUICConfig: &quic.Config{MaxIncomingStreams: 1}}
	ln, err := lc.Listen(t.Context(), "quic", "127.0.0.1:0")
	require.NoError(t, err)
	defer ln.CloseSessions()
	const wait = 300 * time.Millisecond
	d := &shmlink.Dialer{TLSConfig: ctls, Config: &shmlink.Config{QueueFullTimeout: wait}}
	defer d.Close()
	addr := ln.Addr().String()
	parked, err := d.Dial("quic", addr) // the server holds it for Accept
	require.NoError(t, err)

	type result struct {
		c   net.Conn
		err error
		in  time.Duration
	}
	dial := func(ctx context.Context) result {
		t.Helper()
		done := make(chan result, 1)
		go func() {
			start := time.Now()
			c, err := d.DialContext(ctx, "quic", addr)
			done <- result{c, err, time.Since(start)}
		}()
		select {
		case r := <-done:
			return r
		case <-time.After(10 * time.Second):
			t.Fatal("a dial at the server's stream limit did not return")
			return result{}
		}
	}
	r := dial(context.Background())
	require.ErrorIs(t, r.err, shmlink.ErrQueueFull)
	require.ErrorContains(t, r.err, "MaxIncomingStreams")
	require.GreaterOrEqual(t, r.in, wait, "it waited for Config.QueueFullTimeout")

	ctx, cancel := context.WithTimeout(t.Context(), wait/10)
	defer cancel()
	r = dial(ctx)
	require.ErrorIs(t, r.err, context.DeadlineExceeded, "the context ends the wait first")
	require.NotErrorIs(t, r.err, shmlink.ErrQueueFull)

	// The parked stream ends: the connection takes a new one once the
	// server has seen both sides closed and raised its limit.
	s, err := ln.Accept()
	require.NoError(t, err)
	require.NoError(t, s.Close())
	require.NoError(t, parked.Close())
	for start := time.Now(); ; {
		if r = dial(context.Background()); !errors.Is(r.err, shmlink.ErrQueueFull) || time.Since(start) > 10*time.Second {
			break
		}
	}
	require.NoError(t, r.err)
	defer r.c.Close()
	s, err = ln.Accept()
	require.NoError(t, err)
	defer s.Close()
	_, err = r.c.Write([]byte("x"))
	require.NoError(t, err)
	buf := make([]byte, 1)
	_, err = io.ReadFull(s, buf)
	require.NoError(t, err)
	require.Equal(t, "x", string(buf))
	require.Equal(t, 1, ln.NumSessions(), "one connection: the dials did not open more")
}

// A QUIC dial whose TLS handshake fails (here: the server's certificate
// is signed by an unknown authority) wraps ErrHandshake, as every
// handshake failure does, and keeps the TLS error, but is not a local
// close; a dial that its context ends returns the context's error.
func TestQUICHandshakeErrorWrapped(t *testing.T) {
	ln, _ := quicPair(t)
	d := &shmlink.Dialer{TLSConfig: &tls.Config{}} // system roots: the test CA is unknown
	defer d.Close()
	ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
	defer cancel()
	_, err := d.DialContext(ctx, "quic", ln.Addr().String())
	require.ErrorIs(t, err, shmlink.ErrHandshake)
	require.NotErrorIs(t, err, net.ErrClosed)
	var ce *tls.CertificateVerificationError
	require.ErrorAs(t, err, &ce)

	ctx, cancel = context.WithCancel(t.Context())
	cancel()
	_, err = d.DialContext(ctx, "quic", ln.Addr().String())
	require.ErrorIs(t, err, context.Canceled)
	require.NotErrorIs(t, err, shmlink.ErrHandshake)
}

// quicSmallWindow returns a "quic" listener on 127.0.0.1 whose streams'
// receive windows are 64 KiB, so that a Write of more blocks while the
// server does not read, and a Dialer for it; both close at the test's end.
func quicSmallWindow(t *testing.T) (*shmlink.Listener, *shmlink.Dialer) {
	t.Helper()
	_, stls, ctls := quicTLS(t, false)
	window := &quic.Config{InitialStreamReceiveWindow: 64 << 10, MaxStreamReceiveWindow: 64 << 10}
	ln, err := (&shmlink.ListenConfig{TLSConfig: stls, QUICConfig: window}).Listen(t.Context(), "quic", "127.0.0.1:0")
	require.NoError(t, err)
	t.Cleanup(func() { ln.CloseSessions() })
	d := &shmlink.Dialer{TLSConfig: ctls}
	t.Cleanup(func() { d.Close() })
	return ln, d
}

// Close ends a Write blocked on flow control even when a SetWriteDeadline
// that began before Close sets its deadline after Close set the past one
// that ends the Write: the setter sets the past deadline again. Without
// that, the Write would stay blocked, and Close behind it. The hooks hold
// the setter and Close at the interleaving.
func TestQUICCloseRacesSetWriteDeadline(t *testing.T) {
	ln, d := quicSmallWindow(t)

	for range 10 {
		c, err := d.Dial("quic", ln.Addr().String())
		require.NoError(t, err)
		s, err := ln.Accept()
		require.NoError(t, err)
		checked, closeSet, setDone := make(chan struct{}), make(chan struct{}), make(chan struct{})
		shmlink.SetQUICDeadlineHooks(c,
			func() { close(checked); <-closeSet },
			func() { close(closeSet); <-setDone })

		wrote := make(chan error, 1)
		go func() {
			_, err := c.Write(make([]byte, 1<<20)) // past the server's window: blocks
			wrote <- err
		}()
		// The server reads nothing past the first bytes: the Write is under way.
		_, err = io.ReadFull(s, make([]byte, 1))
		require.NoError(t, err)
		go func() {
			c.SetWriteDeadline(time.Time{})
			close(setDone)
		}()
		<-checked
		closed := make(chan error, 1)
		go func() { closed <- c.Close() }()
		select {
		case err = <-closed:
		case <-time.After(10 * time.Second):
			t.Fatal("Close still waits for a blocked Write after 10 s")
		}
		require.NoError(t, err)
		require.ErrorIs(t, <-wrote, net.ErrClosed)
		s.Close()
	}
}

// A dial that picks the Dialer's connection while its idle timeout is
// closing it (it takes no new stream but has not ended yet) dials a new
// connection, rather than failing with the internal error of a draining
// connection.
func TestQUICIdleDialRace(t *testing.T) {
	ln, d := quicPair(t)
	go serveStreams(ln)
	c, err := d.Dial("quic", ln.Addr().String())
	require.NoError(t, err)
	require.NoError(t, c.Close())
	shmlink.QUICIdleExpiring(d, ln.Addr().String())
	c, err = d.Dial("quic", ln.Addr().String())
	require.NoError(t, err, "a dial during the idle close dials anew")
	defer c.Close()
	_, err = c.Write(peertest.Command(peertest.CmdEcho, 0))
	require.NoError(t, err)
	require.NoError(t, peertest.Echo(c, 100, 1))
	require.Equal(t, 2, d.NumSessions(), "the draining connection and the new one")
}

// Close of a QUIC listener without a connection frees its UDP port before
// it returns, as a net.Listener's Close does; CloseSessions, which ends
// the connections, frees it before it returns too. Guards the socket's
// closing, which waits for the listener's goroutines.
func TestQUICCloseFreesPort(t *testing.T) {
	rebind := func(t *testing.T, addr string) {
		t.Helper()
		u, err := net.ListenPacket("udp", addr)
		require.NoError(t, err, "the port is still bound")
		u.Close()
	}
	t.Run("Close", func(t *testing.T) {
		_, stls, _ := quicTLS(t, false)
		ln, err := (&shmlink.ListenConfig{TLSConfig: stls}).Listen(t.Context(), "quic", "127.0.0.1:0")
		require.NoError(t, err)
		require.NoError(t, ln.Close())
		rebind(t, ln.Addr().String())
		require.ErrorIs(t, ln.Close(), net.ErrClosed)
	})
	t.Run("CloseSessions", func(t *testing.T) {
		ln, d := quicPair(t)
		dialAccepted(t, d, ln, "quic")
		require.Equal(t, 1, ln.CloseSessions())
		rebind(t, ln.Addr().String())
	})
}

// After Listener.Close, the last accepted stream's Close ends the
// connection, but not before the stream's data and FIN reached the
// client: the server tells the client that its streams are closed, and
// the client closes the connection once it has read them (the stream's
// Close promises that "the bytes written so far still reach the peer").
// Closing the connection at once lost most responses.
func TestQUICCloseDeliversLastStream(t *testing.T) {
	response := pattern(256<<10, 7)
	for range 20 {
		ln, d := quicPair(t)
		c, err := d.Dial("quic", ln.Addr().String())
		require.NoError(t, err)
		s, err := ln.Accept()
		require.NoError(t, err)
		require.NoError(t, ln.Close()) // the accepted stream lives on
		lastStreamArrives(t, s, c, response)
		shutdownWithin(t, ln, "the client closes the connection once it has read")
		d.Close()
	}
}

// pattern returns n bytes of i*mul.
func pattern(n, mul int) []byte {
	b := make([]byte, n)
	for i := range b {
		b[i] = byte(i * mul)
	}
	return b
}

// lastStreamArrives writes data on w and closes it, and checks that r
// reads all of it, then io.EOF, within 10 s; then it closes r.
func lastStreamArrives(t *testing.T, w, r net.Conn, data []byte) {
	t.Helper()
	_, err := w.Write(data)
	require.NoError(t, err)
	require.NoError(t, w.Close())
	r.SetReadDeadline(time.Now().Add(10 * time.Second))
	got, err := io.ReadAll(r)
	require.NoError(t, err)
	require.Equal(t, data, got)
	require.NoError(t, r.Close())
}

// shutdownWithin checks that ln's Shutdown returns nil within 10 s: its
// connections ended by themselves.
func shutdownWithin(t *testing.T, ln *shmlink.Listener, why string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
	defer cancel()
	require.NoError(t, ln.Shutdown(ctx), why)
}

// The Dialer's side of the same: a connection that its idle timeout ends
// right after its last stream's Close (here at once) still delivers that
// stream's data and FIN to the server.
func TestQUICIdleCloseDeliversLastStream(t *testing.T) {
	request := pattern(256<<10, 3)
	for range 20 {
		ln, d := quicPair(t)
		d.IdleTimeout = time.Nanosecond
		c, err := d.Dial("quic", ln.Addr().String())
		require.NoError(t, err)
		s, err := ln.Accept()
		require.NoError(t, err)
		lastStreamArrives(t, c, s, request)
		shutdownWithin(t, ln, "the server closes the connection once its stream is closed")
		d.Close()
	}
}

// A client that never reads or closes its stream does not keep a closed
// listener's connection, and its socket, beyond the linger, which is the
// QUIC idle timeout: Shutdown returns nil once the connection ended.
func TestQUICLingerBounded(t *testing.T) {
	_, stls, ctls := quicTLS(t, false)
	lc := shmlink.ListenConfig{TLSConfig: stls, QUICConfig: &quic.Config{MaxIdleTimeout: 300 * time.Millisecond}}
	ln, err := lc.Listen(t.Context(), "quic", "127.0.0.1:0")
	require.NoError(t, err)
	defer ln.CloseSessions()
	d := &shmlink.Dialer{TLSConfig: ctls}
	defer d.Close()
	c, err := d.Dial("quic", ln.Addr().String())
	require.NoError(t, err)
	defer c.Close() // only at the end
	s, err := ln.Accept()
	require.NoError(t, err)
	require.NoError(t, ln.Close())
	_, err = s.Write([]byte("unread"))
	require.NoError(t, err)
	require.NoError(t, s.Close())
	ctx, cancel := context.WithTimeout(t.Context(), 20*time.Second)
	defer cancel()
	require.NoError(t, ln.Shutdown(ctx), "the connection outlived the linger")
}

// Config.HandshakeTimeout bounds a QUIC dial's TLS handshake too, as
// quic-go's HandshakeIdleTimeout when QUICConfig leaves that zero: a
// server that never answers fails the dial with ErrHandshake after about
// that long (twice it at most), not after the 5 s fallback.
func TestQUICHandshakeTimeout(t *testing.T) {
	_, _, ctls := quicTLS(t, false)
	silent, err := net.ListenPacket("udp", "127.0.0.1:0") // reads nothing, answers nothing
	require.NoError(t, err)
	defer silent.Close()
	d := &shmlink.Dialer{TLSConfig: ctls, Config: &shmlink.Config{HandshakeTimeout: 100 * time.Millisecond}}
	defer d.Close()
	ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
	defer cancel()
	start := time.Now()
	_, err = d.DialContext(ctx, "quic", silent.LocalAddr().String())
	require.ErrorIs(t, err, shmlink.ErrHandshake)
	require.Less(t, time.Since(start), 3*time.Second, "the handshake outlived Config.HandshakeTimeout")
}

// CloseWrite does not wait behind a Write blocked on flow control (the
// peer does not read, and its stream window is small): it ends that
// Write, which returns ErrWriteClosed (net.ErrClosed) with the count of
// the bytes it wrote, and sends FIN; the peer reads every byte written
// before, then io.EOF, and later writes fail with ErrWriteClosed
// (docs/protocol.md section 17, Closing).
func TestQUICCloseWriteEndsBlockedWrite(t *testing.T) {
	ln, d := quicSmallWindow(t)
	c, s := dialAccepted(t, d, ln, "quic")

	const first = 1000
	data := pattern(first+1<<20, 7)
	n0, err := c.Write(data[:first])
	require.NoError(t, err)
	require.Equal(t, first, n0)
	type result struct {
		n   int
		err error
	}
	wrote := make(chan result, 1)
	go func() {
		n, err := c.Write(data[first:]) // past the server's window: blocks
		wrote <- result{n, err}
	}()
	// The server reads the first bytes, and more: the Write is under way.
	_, err = io.ReadFull(s, make([]byte, first+1))
	require.NoError(t, err)

	closed := make(chan error, 1)
	go func() { closed <- c.(interface{ CloseWrite() error }).CloseWrite() }()
	select {
	case err = <-closed:
	case <-time.After(10 * time.Second):
		t.Fatal("CloseWrite still waits for a blocked Write after 10 s")
	}
	require.NoError(t, err)
	var r result
	select {
	case r = <-wrote:
	case <-time.After(10 * time.Second):
		t.Fatal("the blocked Write did not return after CloseWrite")
	}
	require.ErrorIs(t, r.err, shmlink.ErrWriteClosed)
	require.ErrorIs(t, r.err, net.ErrClosed)
	require.Less(t, r.n, len(data)-first, "the Write was blocked")
	_, err = c.Write([]byte("x"))
	require.ErrorIs(t, err, shmlink.ErrWriteClosed)

	// The peer reads what was written, to the byte, then io.EOF.
	require.NoError(t, s.SetReadDeadline(time.Now().Add(10*time.Second)))
	rest, err := io.ReadAll(s)
	require.NoError(t, err, "io.EOF after the bytes written")
	require.Equal(t, data[first+1:first+r.n], rest)

	// The stream still reads: the server's reply arrives.
	_, err = s.Write([]byte("reply"))
	require.NoError(t, err)
	buf := make([]byte, 5)
	require.NoError(t, c.SetReadDeadline(time.Now().Add(10*time.Second)))
	_, err = io.ReadFull(c, buf)
	require.NoError(t, err)
	require.Equal(t, "reply", string(buf))
}

// A "quic" listener holds at most Config.AcceptBacklog streams that Accept
// has not returned, across its connections: a client that opens more,
// with nobody calling Accept, gets the extra ones refused at once
// (ErrStreamRefused on read and write, counted in StreamsRefused), and
// the listener keeps no goroutine for them; the first ones are served
// once Accept is called, and the freed room takes new streams
// (docs/protocol.md section 17, Streams).
func TestQUICAcceptBacklogBound(t *testing.T) {
	const backlog, n = 4, 256
	base := runtime.NumGoroutine()
	_, stls, ctls := quicTLS(t, false)
	// A small stream window, so that a write larger than it waits for the
	// server's refusal (STOP_SENDING) if it has not arrived yet.
	window := &quic.Config{InitialStreamReceiveWindow: 64 << 10, MaxStreamReceiveWindow: 64 << 10}
	lc := shmlink.ListenConfig{TLSConfig: stls, QUICConfig: window, Config: &shmlink.Config{AcceptBacklog: backlog}}
	ln, err := lc.Listen(t.Context(), "quic", "127.0.0.1:0")
	require.NoError(t, err)
	d := &shmlink.Dialer{TLSConfig: ctls}
	defer func() {
		d.Close()
		ln.CloseSessions()
	}()
	accept := func() net.Conn {
		t.Helper()
		type result struct {
			c   net.Conn
			err error
		}
		done := make(chan result, 1)
		go func() {
			c, err := ln.Accept()
			done <- result{c, err}
		}()
		select {
		case r := <-done:
			require.NoError(t, r.err)
			t.Cleanup(func() { r.c.Close() })
			return r.c
		case <-time.After(10 * time.Second):
			t.Fatal("Accept did not return a stream in 10 s")
			return nil
		}
	}

	conns := make([]net.Conn, n)
	for i := range conns {
		c, err := d.Dial("quic", ln.Addr().String())
		require.NoError(t, err)
		defer c.Close()
		conns[i] = c
	}
	// The server takes the streams in the order they were opened: the
	// first backlog ones wait for Accept, the rest are refused.
	for _, c := range conns[backlog:] {
		require.NoError(t, c.SetReadDeadline(time.Now().Add(10*time.Second)))
		_, err := c.Read(make([]byte, 1))
		require.ErrorIs(t, err, shmlink.ErrStreamRefused, "a stream beyond the backlog is refused at once")
		require.NoError(t, c.SetWriteDeadline(time.Now().Add(10*time.Second)))
		_, err = c.Write(make([]byte, 128<<10))
		require.ErrorIs(t, err, shmlink.ErrStreamRefused)
	}
	require.Equal(t, uint64(n-backlog), ln.Stats().StreamsRefused)
	require.Equal(t, backlog, shmlink.QUICPendingStreams(ln))
	// One goroutine per pending stream, and a few per connection and
	// listener (shmlink's and quic-go's, both sides): none per refused one.
	require.Less(t, runtime.NumGoroutine()-base, backlog+50, "goroutines grow with the streams refused")

	// Accept returns the first streams, which work both ways.
	got := map[byte]net.Conn{}
	for range backlog {
		s := accept()
		var b [1]byte
		require.NoError(t, s.SetReadDeadline(time.Now().Add(10*time.Second)))
		for i, c := range conns[:backlog] {
			if _, ok := got[byte(i)]; !ok {
				_, err := c.Write([]byte{byte(i)})
				require.NoError(t, err)
			}
		}
		_, err := io.ReadFull(s, b[:])
		require.NoError(t, err)
		got[b[0]] = s
	}
	require.Len(t, got, backlog)
	for i, c := range conns[:backlog] {
		_, err := got[byte(i)].Write([]byte{byte(i) + 100})
		require.NoError(t, err)
		var b [1]byte
		require.NoError(t, c.SetReadDeadline(time.Now().Add(10*time.Second)))
		_, err = io.ReadFull(c, b[:])
		require.NoError(t, err)
		require.Equal(t, byte(i)+100, b[0])
	}
	require.Zero(t, shmlink.QUICPendingStreams(ln))

	// The room is free again: a new stream is served.
	c, err := d.Dial("quic", ln.Addr().String())
	require.NoError(t, err)
	defer c.Close()
	s := accept()
	_, err = c.Write([]byte("y"))
	require.NoError(t, err)
	var b [1]byte
	require.NoError(t, s.SetReadDeadline(time.Now().Add(10*time.Second)))
	_, err = io.ReadFull(s, b[:])
	require.NoError(t, err)
	require.Equal(t, "y", string(b[:]))
}

// A listener whose TLSConfig picks each connection's config
// (GetConfigForClient) still speaks only shmlink's ALPN over TLS 1.3: the
// config returned gets them, whatever its NextProtos, so a QUIC client of
// another protocol fails its handshake and shmlink's Dialer gets in
// (docs/protocol.md section 17).
func TestQUICConfigForClientKeepsALPN(t *testing.T) {
	_, stls, ctls := quicTLS(t, false)
	var picked atomic.Int32
	base := &tls.Config{GetConfigForClient: func(*tls.ClientHelloInfo) (*tls.Config, error) {
		picked.Add(1)
		c := stls.Clone()
		c.NextProtos = []string{"h3"}
		return c, nil
	}}
	ln, err := (&shmlink.ListenConfig{TLSConfig: base}).Listen(t.Context(), "quic", "127.0.0.1:0")
	require.NoError(t, err)
	defer ln.CloseSessions()
	defer serveEcho(ln, 1)()

	h3 := ctls.Clone()
	h3.NextProtos = []string{"h3"}
	ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
	defer cancel()
	_, err = quic.DialAddr(ctx, ln.Addr().String(), h3, nil)
	require.Error(t, err, "a client of another ALPN is refused")
	require.ErrorContains(t, err, "no application protocol")
	require.EqualValues(t, 1, picked.Load(), "the listener's GetConfigForClient served it")

	d := &shmlink.Dialer{TLSConfig: ctls}
	defer d.Close()
	c, err := d.DialContext(ctx, "quic", ln.Addr().String())
	require.NoError(t, err)
	requireEcho(t, c, "shmlink/1")
	require.NoError(t, c.Close())
}
