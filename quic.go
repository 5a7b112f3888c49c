package shmlink

import (
	"cmp"
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/netip"
	"os"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/quic-go/quic-go"
)

// The QUIC mode: network "quic" carries each stream as one QUIC stream of
// a connection between two hosts (docs/protocol.md section 17). Nothing of
// it touches shared memory.

// quicALPN is the TLS application protocol of shmlink over QUIC; both
// sides set it, so a QUIC peer of another protocol fails the handshake.
const quicALPN = "shmlink/1"

// quicPreamble is the first byte a client writes on every stream it opens.
// A QUIC stream reaches the server only with its first frame: the preamble
// makes Accept return at dial time, as over shared memory, so that servers
// that speak first work. The server checks and drops it.
const quicPreamble byte = 0x01

// Application error codes of the QUIC mode (docs/protocol.md section 17).
const (
	quicCodeClosed      = 0 // Close of a stream or a connection
	quicCodeRefused     = 1 // a stream refused: the listener is closed, or its accept backlog full
	quicCodeBadPreamble = 2 // a stream that did not start with quicPreamble
)

// Defaults of the QUIC mode, for a LAN: windows large enough for bulk
// transfer at a millisecond's round trip, and a keepalive well inside the
// idle timeout so that NAT and firewall state stays fresh.
const (
	defaultQUICKeepAlive      = 15 * time.Second
	defaultQUICIdleTimeout    = time.Minute
	defaultQUICStreams        = 4096     // concurrent streams a peer may open
	defaultQUICStreamWindow   = 16 << 20 // bytes, most per stream
	defaultQUICConnWindow     = 64 << 20 // bytes, most per connection
	quicUDPBuffer             = 7 << 20  // bytes; quic-go's guidance for its socket buffers
	quicHandshakeIdleFallback = 5 * time.Second
	// defaultQUICPreambleTimeout bounds the wait for a new stream's
	// preamble when Config.HandshakeTimeout is zero.
	defaultQUICPreambleTimeout = 3 * time.Second
	// defaultQUICStreamWait bounds a dial's wait for the server's stream
	// limit when Config.QueueFullTimeout is zero: that field's default
	// (package session), which bounds a dial's wait for room over shared
	// memory too.
	defaultQUICStreamWait = 5 * time.Second
	// defaultQUICAcceptBacklog bounds the streams a listener holds that
	// Accept has not returned when Config.AcceptBacklog is zero: that
	// field's default (package session).
	defaultQUICAcceptBacklog = 4096
)

// ErrNoSharedMemory is returned (wrapped) by Listener.AcceptStream and
// Dialer.DialStream on the "quic" network: a QUIC stream has no shared
// memory, so there is no *Stream and no zero-copy call for it. Use Accept
// and DialContext, which return it as a net.Conn.
var ErrNoSharedMemory = errors.New("shmlink: a QUIC stream has no shared memory (no *Stream, no zero-copy calls)")

// quicBufferWarning logs, once per process, that the kernel capped the UDP
// socket buffers below quic-go's guidance.
var quicBufferWarning sync.Once

// quicTLS returns a copy of c for the QUIC mode, or a *ConfigError when c
// is nil or cannot serve (server: no certificate). NextProtos is set to
// shmlink's ALPN, and TLS 1.3 is the minimum, as QUIC requires; so they are
// in the config that c's GetConfigForClient returns for a connection, if
// any (docs/protocol.md section 17).
func quicTLS(c *tls.Config, server bool) (*tls.Config, error) {
	field := "Dialer.TLSConfig"
	if server {
		field = "ListenConfig.TLSConfig"
	}
	if c == nil {
		return nil, &ConfigError{Field: field, Reason: `nil: the "quic" network needs TLS`}
	}
	if server && len(c.Certificates) == 0 && c.GetCertificate == nil && c.GetConfigForClient == nil {
		return nil, &ConfigError{Field: field, Reason: "no certificate to serve"}
	}
	if c.MaxVersion != 0 && c.MaxVersion < tls.VersionTLS13 {
		return nil, &ConfigError{Field: field, Reason: "MaxVersion below TLS 1.3, which QUIC requires"}
	}
	out := c.Clone()
	out.NextProtos = []string{quicALPN}
	out.MinVersion = tls.VersionTLS13
	if get := c.GetConfigForClient; get != nil {
		out.GetConfigForClient = func(hello *tls.ClientHelloInfo) (*tls.Config, error) {
			cc, err := get(hello)
			if cc == nil || err != nil {
				return cc, err // nil: out itself serves the connection
			}
			cc = cc.Clone()
			cc.NextProtos = []string{quicALPN}
			cc.MinVersion = tls.VersionTLS13
			return cc, nil
		}
	}
	return out, nil
}

// quicConfig returns a copy of c (nil: the defaults) with shmlink's
// defaults in the fields left zero; handshake, the Config's
// HandshakeTimeout, is the default HandshakeIdleTimeout when not zero:
// quic-go then gives up a handshake after that long without a packet, and
// after twice that in all.
func quicConfig(c *quic.Config, handshake time.Duration) *quic.Config {
	out := &quic.Config{}
	if c != nil {
		out = c.Clone()
	}
	if out.KeepAlivePeriod == 0 {
		out.KeepAlivePeriod = defaultQUICKeepAlive
	}
	if out.MaxIdleTimeout == 0 {
		out.MaxIdleTimeout = defaultQUICIdleTimeout
	}
	if out.HandshakeIdleTimeout == 0 {
		out.HandshakeIdleTimeout = cmp.Or(handshake, quicHandshakeIdleFallback)
	}
	if out.MaxIncomingStreams == 0 {
		out.MaxIncomingStreams = defaultQUICStreams
	}
	if out.MaxStreamReceiveWindow == 0 {
		out.MaxStreamReceiveWindow = defaultQUICStreamWindow
	}
	if out.MaxConnectionReceiveWindow == 0 {
		out.MaxConnectionReceiveWindow = defaultQUICConnWindow
	}
	return out
}

// checkQUICConfig returns a *ConfigError, its Field under field
// ("ListenConfig.QUICConfig", "Dialer.QUICConfig"), when c (nil: the
// defaults) sets a field with which shmlink's streams or messages cannot
// work (docs/protocol.md section 17, Defaults); server tells which side
// c is for.
func checkQUICConfig(c *quic.Config, field string, server bool) error {
	if c == nil {
		return nil
	}
	switch {
	case c.RequireStreamCreditRelease:
		// Each side would stop taking the peer's streams, or messages,
		// after the first MaxIncomingStreams (MaxIncomingUniStreams) of
		// them in all.
		return &ConfigError{Field: field + ".RequireStreamCreditRelease", Reason: "shmlink never calls ReleaseStreamCredit: the peer could open no more than MaxIncomingStreams streams in all"}
	case server && c.MaxIncomingStreams < 0:
		// A client takes no stream of the server's, which opens none.
		return &ConfigError{Field: field + ".MaxIncomingStreams", Reason: "negative: clients could open no stream"}
	case c.MaxIncomingUniStreams < 0:
		return &ConfigError{Field: field + ".MaxIncomingUniStreams", Reason: "negative: the peer could send none of shmlink's messages (done, hot restart)"}
	}
	// What quic-go's Listen and Dial reject (its validateConfig), checked
	// here first: a listener taking an upgrade socket over must know that
	// its config works before it tells the running process to hand over
	// (docs/protocol.md section 17, Hot upgrade).
	for _, v := range c.Versions {
		if v != quic.Version1 && v != quic.Version2 {
			return &ConfigError{Field: field + ".Versions", Reason: fmt.Sprintf("%v is not a QUIC version that quic-go supports (quic.Version1, quic.Version2)", v)}
		}
	}
	return nil
}

// quicClientConfigs wraps the GetConfigForClient of the listener's QUIC
// config qcfg, if set, so that the config it returns for a connection
// gets shmlink's defaults and checks too, as the listener's did: one that
// fails checkQUICConfig refuses the connection (quic-go's
// CONNECTION_REFUSED), and the first such is logged to logger.
func quicClientConfigs(qcfg *quic.Config, handshake time.Duration, logger *slog.Logger) {
	get := qcfg.GetConfigForClient
	if get == nil {
		return
	}
	var logged sync.Once
	qcfg.GetConfigForClient = func(info *quic.ClientInfo) (*quic.Config, error) {
		c, err := get(info)
		if err != nil {
			return nil, err
		}
		c = quicConfig(c, handshake)
		if err := checkQUICConfig(c, "ListenConfig.QUICConfig.GetConfigForClient", true); err != nil {
			logged.Do(func() {
				logger.Warn("shmlink: QUIC connections refused: GetConfigForClient returned a config shmlink cannot work with (logged once)",
					"remote", info.RemoteAddr, "err", err)
			})
			return nil, err
		}
		return c, nil
	}
}

// quicUDP listens on a UDP socket at address (":0" for a client), whose
// host it resolves under ctx, and sizes its buffers as quic-go advises.
// When the kernel caps them (net.core.rmem_max, wmem_max), it says so once
// through logger instead of quic-go's own print to standard error. It
// returns net.ListenConfig.ListenPacket's errors, which wrap ctx's when
// ctx ended the resolution.
func quicUDP(ctx context.Context, address string, logger *slog.Logger) (*net.UDPConn, error) {
	var lc net.ListenConfig
	pc, err := lc.ListenPacket(ctx, "udp", address)
	if err != nil {
		return nil, err
	}
	c := pc.(*net.UDPConn)
	c.SetReadBuffer(quicUDPBuffer)
	c.SetWriteBuffer(quicUDPBuffer)
	rcv, snd := udpBuffers(c)
	if rcv < quicUDPBuffer || snd < quicUDPBuffer {
		forceUDPBuffers(c)
		rcv, snd = udpBuffers(c)
	}
	if rcv < quicUDPBuffer || snd < quicUDPBuffer {
		quicBufferWarning.Do(func() {
			logger.Warn("shmlink: the kernel capped the QUIC socket buffers; raise net.core.rmem_max and wmem_max for bulk transfer (https://github.com/quic-go/quic-go/wiki/UDP-Buffer-Sizes)",
				"receive", rcv, "send", snd, "want", quicUDPBuffer)
			// quic-go would print the same to standard error: said once here.
			os.Setenv("QUIC_GO_DISABLE_RECEIVE_BUFFER_WARNING", "true")
		})
	}
	return c, nil
}

// resolveUDP resolves address (host:port, the port a number or a service
// name) to a UDP address with r under ctx: an IP address as it is, and of
// a host name's addresses the first IPv4 one, else the first, as
// net.ResolveUDPAddr("udp", address) picks without a context. It returns
// r's errors, which wrap ctx's when ctx ended the lookup, and a
// *net.AddrError for a name without addresses.
func resolveUDP(ctx context.Context, r *net.Resolver, address string) (*net.UDPAddr, error) {
	host, service, err := net.SplitHostPort(address)
	if err != nil {
		return nil, err
	}
	port, err := r.LookupPort(ctx, "udp", service)
	if err != nil {
		return nil, err
	}
	if host == "" {
		return &net.UDPAddr{Port: port}, nil // this host, as ResolveUDPAddr
	}
	if ip, err := netip.ParseAddr(host); err == nil {
		return net.UDPAddrFromAddrPort(netip.AddrPortFrom(ip, uint16(port))), nil
	}
	ips, err := r.LookupNetIP(ctx, "ip", host)
	if err != nil {
		return nil, err
	}
	if len(ips) == 0 {
		return nil, &net.AddrError{Err: "no address found", Addr: host}
	}
	ip := ips[0]
	for _, a := range ips {
		if a.Unmap().Is4() {
			ip = a
			break
		}
	}
	return net.UDPAddrFromAddrPort(netip.AddrPortFrom(ip.Unmap(), uint16(port))), nil
}

// udpBuffers returns the socket buffer sizes of c in bytes, as the kernel
// counts them for data (it reports twice what it grants for bookkeeping).
func udpBuffers(c *net.UDPConn) (rcv, snd int) {
	raw, err := c.SyscallConn()
	if err != nil {
		return 0, 0
	}
	raw.Control(func(fd uintptr) {
		rcv, _ = syscall.GetsockoptInt(int(fd), syscall.SOL_SOCKET, syscall.SO_RCVBUF)
		snd, _ = syscall.GetsockoptInt(int(fd), syscall.SOL_SOCKET, syscall.SO_SNDBUF)
	})
	return rcv / 2, snd / 2
}

// quicStream is a QUIC stream as a net.Conn (docs/protocol.md section 17).
// quic-go forbids a stream's Close concurrently with its Write, which a
// net.Conn allows: wmu serializes them, and Close and CloseWrite first end
// a blocked Write through its deadline (closeDeadline), which a concurrent
// SetDeadline or SetWriteDeadline then sets again rather than undo
// (setDeadlines).
type quicStream struct {
	s  *quic.Stream
	qc *quicConn

	wmu     sync.Mutex
	wclosed bool // CloseWrite or Close sent the FIN; guarded by wmu
	closing atomic.Bool
	// wclosing is set by CloseWrite before it sets closeDeadline to end a
	// blocked Write, and stays set: writes fail with ErrWriteClosed.
	wclosing  atomic.Bool
	closeOnce sync.Once

	// hooks, nil outside tests, run where tests interleave a deadline
	// setter with Close (export_quic_test.go).
	hooks *quicStreamHooks
}

// quicStreamHooks are the points of a quicStream that tests hold.
type quicStreamHooks struct {
	setDeadline func() // in setDeadlines, after its check of closing
	closed      func() // in Close, after it set closeDeadline
}

// closeDeadline is the write deadline, long past, with which Close ends a
// Write blocked on flow control.
var closeDeadline = time.Unix(1, 0)

// Read reads what the peer wrote, as net.Conn's Read. At the end of what
// the peer wrote (its CloseWrite or Close) it returns io.EOF. It returns
// ErrStreamClosed after Close, an error satisfying errors.Is(err,
// os.ErrDeadlineExceeded) at the read deadline, ErrStreamRefused when the
// server refused the stream (its listener is closed), ErrSessionClosed
// when this side closed the connection, and one wrapping ErrPeerClosed
// (errors.Is(err, syscall.ECONNRESET)) when the peer reset the stream or
// the connection ended otherwise; see quicErr.
func (q *quicStream) Read(b []byte) (int, error) {
	if q.closing.Load() {
		return 0, ErrStreamClosed
	}
	n, err := q.s.Read(b)
	q.qc.bytesRecv.Add(uint64(n))
	if err != nil && err != io.EOF {
		err = q.mapErr("read", err)
	}
	return n, err
}

// Write writes b to the stream, as net.Conn's Write, waiting while the
// peer's flow-control window is full. It returns ErrStreamClosed after
// Close, ErrWriteClosed after CloseWrite or when a CloseWrite ends it
// while it waits (then n counts the bytes written before, which the peer
// reads before io.EOF), an error satisfying
// errors.Is(err, os.ErrDeadlineExceeded) at the write deadline, the
// errors of Read for a refused stream or a connection's end, and one
// wrapping ErrPeerClosed when the peer stopped reading (closed the
// stream).
func (q *quicStream) Write(b []byte) (int, error) {
	q.wmu.Lock()
	defer q.wmu.Unlock()
	switch {
	case q.closing.Load():
		return 0, ErrStreamClosed
	case q.wclosed:
		return 0, ErrWriteClosed
	}
	n, err := q.s.Write(b)
	q.qc.bytesSent.Add(uint64(n))
	if err != nil {
		err = q.mapErr("write", err)
		if q.wclosing.Load() && !errors.Is(err, ErrStreamClosed) {
			err = ErrWriteClosed // CloseWrite's closeDeadline ended it
		}
	}
	return n, err
}

// CloseWrite half-closes the stream: the peer reads io.EOF after every
// byte written, while this side goes on reading. It does not wait for a
// Write blocked on flow control: it ends it through a write deadline in
// the past (closeDeadline), as Close does, and that Write returns
// ErrWriteClosed with the count of the bytes it wrote, which still reach
// the peer before the FIN (a TCPConn's returns EPIPE there; shmlink keeps
// the error of its later writes, docs/protocol.md section 17, Closing).
// Later writes fail with ErrWriteClosed. It returns nil when called
// again, ErrStreamClosed after Close, and an error wrapping ErrPeerClosed
// when the peer had stopped reading.
func (q *quicStream) CloseWrite() error {
	if q.closing.Load() {
		return ErrStreamClosed
	}
	q.wclosing.Store(true)              // before closeDeadline: see setDeadlines
	q.s.SetWriteDeadline(closeDeadline) // ends a Write blocked on flow control
	q.wmu.Lock()
	defer q.wmu.Unlock()
	if q.closing.Load() {
		return ErrStreamClosed
	}
	if q.wclosed {
		return nil
	}
	q.wclosed = true
	if err := q.s.Close(); err != nil {
		return q.mapErr("close", err)
	}
	return nil
}

// CloseRead stops reading: what the peer writes from now on is refused
// (its writes fail with an error wrapping ErrPeerClosed). It returns
// ErrStreamClosed after Close.
func (q *quicStream) CloseRead() error {
	if q.closing.Load() {
		return ErrStreamClosed
	}
	q.s.CancelRead(quicCodeClosed)
	return nil
}

// Close ends the stream both ways: the bytes written so far still reach
// the peer, which then reads io.EOF, even when the connection ends with
// this stream (quic_conn.go); what the peer writes after is refused.
// Blocked Read and Write calls return ErrStreamClosed. Later calls return
// ErrStreamClosed too.
func (q *quicStream) Close() error {
	err := ErrStreamClosed
	q.closeOnce.Do(func() {
		err = nil
		q.closing.Store(true) // before closeDeadline: see setDeadlines
		q.s.CancelRead(quicCodeClosed)
		q.s.SetWriteDeadline(closeDeadline) // ends a Write blocked on flow control
		if q.hooks != nil {
			q.hooks.closed()
		}
		q.wmu.Lock()
		if !q.wclosed {
			q.wclosed = true
			q.s.Close()
		}
		q.wmu.Unlock()
		q.qc.closed()
	})
	return err
}

// refuse resets, both ways with quicCodeRefused, a stream that Accept
// never returned because the listener closed: its client reads
// ErrStreamRefused, as over shared memory (Stream.Refuse).
func (q *quicStream) refuse() {
	q.closeOnce.Do(func() {
		q.closing.Store(true)
		q.qc.refused.Add(1)
		q.s.CancelRead(quicCodeRefused)
		q.s.CancelWrite(quicCodeRefused)
		q.qc.closed()
	})
}

// LocalAddr returns the local UDP address of the stream's connection.
func (q *quicStream) LocalAddr() net.Addr { return q.qc.conn.LocalAddr() }

// RemoteAddr returns the peer's UDP address.
func (q *quicStream) RemoteAddr() net.Addr { return q.qc.conn.RemoteAddr() }

// SetDeadline sets the read and write deadlines, as net.Conn's; it returns
// ErrStreamClosed after Close.
func (q *quicStream) SetDeadline(t time.Time) error { return q.setDeadlines(t, true, true) }

// SetReadDeadline sets the read deadline, as net.Conn's; it returns
// ErrStreamClosed after Close.
func (q *quicStream) SetReadDeadline(t time.Time) error { return q.setDeadlines(t, true, false) }

// SetWriteDeadline sets the write deadline, as net.Conn's; it returns
// ErrStreamClosed after Close.
func (q *quicStream) SetWriteDeadline(t time.Time) error { return q.setDeadlines(t, false, true) }

// setDeadlines sets the read deadline, the write deadline or both to t,
// unless Close began. A Close or CloseWrite concurrent with it may have
// set closeDeadline before this sets t: then this sees closing (wclosing)
// once it has set t (they set it first, and quic-go orders the two
// deadline writes), and sets closeDeadline again, or a Write blocked on
// flow control would stay blocked, and Close or CloseWrite behind it.
// After CloseWrite the write deadline stays closeDeadline, which no Write
// waits for any more.
func (q *quicStream) setDeadlines(t time.Time, read, write bool) error {
	if q.closing.Load() {
		return ErrStreamClosed
	}
	if q.hooks != nil {
		q.hooks.setDeadline()
	}
	if read {
		q.s.SetReadDeadline(t)
	}
	if write {
		q.s.SetWriteDeadline(t)
		if q.closing.Load() {
			q.s.SetWriteDeadline(closeDeadline)
			return ErrStreamClosed
		}
		if q.wclosing.Load() {
			q.s.SetWriteDeadline(closeDeadline)
		}
	}
	return nil
}

// mapErr turns quic-go's error of a stream call (op: "read", "write",
// "close") into the net.Conn vocabulary of shmlink's streams: see quicErr.
func (q *quicStream) mapErr(op string, err error) error {
	if q.closing.Load() {
		return ErrStreamClosed
	}
	return quicErr(op, err)
}

// errReadClosed is a stream's Read error after its own CloseRead, as a
// closed socket's.
var errReadClosed = fmt.Errorf("shmlink: stream closed for reading: %w", net.ErrClosed)

// quicErr turns an error of quic-go, from a stream or its connection, into
// shmlink's vocabulary (docs/protocol.md section 17, Errors); op names the
// call ("read", "write", "open"). quic-go's errors of a connection's end
// unwrap to net.ErrClosed whichever side ended it, which shmlink keeps for
// a local close: quicErr keeps their text, not their chain. It returns
// deadline and context errors as they are; errReadClosed after CloseRead;
// ErrStreamRefused for a stream the server refused (quicCodeRefused);
// ErrSessionClosed when this side closed the connection; and otherwise a
// *SessionError when the connection ended, or a *quicError for a stream
// the peer reset, unwrapping to ErrPeerClosed (syscall.ECONNRESET), to
// ErrStreamRefused for a connection that a closed listener refused (with
// quicCodeRefused, or quic-go's CONNECTION_REFUSED), or to ErrHandshake
// for a failed TLS handshake.
func quicErr(op string, err error) error {
	var (
		se *quic.StreamError
		ae *quic.ApplicationError
		te *quic.TransportError
	)
	switch {
	case errors.Is(err, os.ErrDeadlineExceeded), errors.Is(err, context.Canceled), errors.Is(err, context.DeadlineExceeded):
		return err
	case errors.As(err, &se):
		switch {
		case !se.Remote:
			return errReadClosed // our own CancelRead: CloseRead
		case se.ErrorCode == quicCodeRefused:
			return ErrStreamRefused // as a shared-memory session's refusal
		}
		return &quicError{sentinel: ErrPeerClosed, cause: err}
	case errors.As(err, &ae) && !ae.Remote, errors.Is(err, quic.ErrTransportClosed):
		return ErrSessionClosed
	case !errors.Is(err, net.ErrClosed):
		// Not an end of the connection: closing a send side the peer
		// stopped reading.
		return &quicError{sentinel: ErrPeerClosed, cause: err}
	}
	sentinel := ErrPeerClosed // the peer's close, its idle timeout, a stateless reset
	switch {
	case ae != nil && ae.ErrorCode == quicCodeRefused:
		sentinel = ErrStreamRefused // a connection that a closed listener refused
	case errors.As(err, &te) && te.Remote && te.ErrorCode == quic.ConnectionRefused:
		// quic-go's listener, closing, refused a connection whose
		// handshake it had not completed, which the client had.
		sentinel = ErrStreamRefused
	case te != nil && te.ErrorCode.IsCryptoError():
		sentinel = ErrHandshake
	}
	return &SessionError{Op: op, Err: &quicError{sentinel: sentinel, cause: err}}
}

// quicError is an error of quic-go as shmlink returns it: the text of
// both, and the chain of the shmlink sentinel only (and of the TLS error
// of a failed handshake), not of quic-go's error, which unwraps to
// net.ErrClosed whichever side ended the connection.
type quicError struct {
	sentinel error // ErrPeerClosed, ErrStreamRefused or ErrHandshake
	cause    error // quic-go's error
}

// Error returns the sentinel's text and the cause's.
func (e *quicError) Error() string { return e.sentinel.Error() + ": " + e.cause.Error() }

// Unwrap returns the sentinel and, when the cause is a local TLS failure,
// the TLS error (a *tls.CertificateVerificationError, say).
func (e *quicError) Unwrap() []error {
	errs := []error{e.sentinel}
	var te *quic.TransportError
	if errors.As(e.cause, &te) {
		for _, c := range te.Unwrap() {
			if c != nil && !errors.Is(c, net.ErrClosed) {
				errs = append(errs, c)
			}
		}
	}
	return errs
}

// acceptQUICStream reads and checks the preamble of a stream the peer
// opened, which the caller counted (quicStreamArrived), within timeout,
// and returns it as a net.Conn. A stream without the preamble is reset
// with quicCodeBadPreamble and counted closed; then it returns why.
func acceptQUICStream(s *quic.Stream, qc *quicConn, timeout time.Duration) (*quicStream, error) {
	var b [1]byte
	s.SetReadDeadline(time.Now().Add(timeout))
	if _, err := io.ReadFull(s, b[:]); err != nil || b[0] != quicPreamble {
		s.CancelRead(quicCodeBadPreamble)
		s.CancelWrite(quicCodeBadPreamble)
		qc.closed()
		if err == nil {
			err = fmt.Errorf("%w: preamble %#x", ErrProtocol, b[0])
		}
		return nil, err
	}
	s.SetReadDeadline(time.Time{})
	return &quicStream{s: s, qc: qc}, nil
}

// errQUICDraining is openQUICStream's error on a connection that takes no
// new stream: it ends with its last stream (quicDraining).
var errQUICDraining = errors.New("shmlink: QUIC connection takes no new stream")

// openQUICStream opens a stream on qc and writes its preamble. When the
// connection has as many streams open as the server allows (its
// MaxIncomingStreams), it waits for one of them to end, for wait at most
// (docs/protocol.md section 17, Streams): then it returns an error
// wrapping ErrQueueFull, and ctx's error if ctx ends first.
func openQUICStream(ctx context.Context, qc *quicConn, wait time.Duration) (*quicStream, error) {
	if !qc.tryOpen() {
		return nil, errQUICDraining
	}
	s, err := qc.conn.OpenStream()
	if isStreamLimit(err) {
		s, err = openQUICStreamWait(ctx, qc, wait)
	}
	if err == nil {
		qc.step(quicStreamOpened, 0) // its id is taken: it reaches the peer, if only reset
		if _, err = s.Write([]byte{quicPreamble}); err != nil {
			s.CancelRead(quicCodeClosed)
			s.CancelWrite(quicCodeClosed)
		}
	}
	if err != nil {
		qc.closed()
		if errors.Is(err, ErrQueueFull) {
			return nil, err
		}
		return nil, quicErr("open", err)
	}
	return &quicStream{s: s, qc: qc}, nil
}

// errQUICStreamLimit ends openQUICStreamWait's wait.
var errQUICStreamLimit = errors.New("shmlink: the QUIC stream limit stayed reached")

// openQUICStreamWait opens a stream on qc once the server allows one more,
// waiting for wait at most: then it returns an error wrapping
// ErrQueueFull. It returns ctx's error if ctx ends first, and quic-go's
// if the connection ends.
func openQUICStreamWait(ctx context.Context, qc *quicConn, wait time.Duration) (*quic.Stream, error) {
	wctx, cancel := context.WithTimeoutCause(ctx, wait, errQUICStreamLimit)
	defer cancel()
	s, err := qc.conn.OpenStreamSync(wctx)
	if err != nil && ctx.Err() == nil && context.Cause(wctx) == errQUICStreamLimit {
		return nil, fmt.Errorf("%w: the server's limit of streams on the QUIC connection (its QUICConfig.MaxIncomingStreams) stayed reached for %v (Config.QueueFullTimeout)", ErrQueueFull, wait)
	}
	return s, err
}

// isStreamLimit reports whether err is quic-go's StreamLimitReachedError:
// the peer allows no more streams for now.
func isStreamLimit(err error) bool {
	var p *quic.StreamLimitReachedError
	var v quic.StreamLimitReachedError
	return err != nil && (errors.As(err, &p) || errors.As(err, &v))
}

// Compile-time checks of the interfaces a quicStream provides.
var (
	_ net.Conn                        = (*quicStream)(nil)
	_ interface{ CloseWrite() error } = (*quicStream)(nil)
)
