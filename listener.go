package shmlink

import (
	"cmp"
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"sync"
	"time"

	"github.com/quic-go/quic-go"
	"github.com/shmlink/shmlink/internal/sock"
	"github.com/shmlink/shmlink/internal/upgrade"
	"github.com/shmlink/shmlink/session"
)

// Stream is one net.Conn stream of a session, with the zero-copy API
// (Reserve/Flush, Peek/ReadBytes/Discard/ReleasePreviousRead). Accept and
// Dial return *Stream values as net.Conn, except on "quic", whose streams
// are QUIC streams (docs/protocol.md section 17).
type Stream = session.Stream

// defaultDrainTimeout is how long, by default, a listener that handed its
// socket over waits for its sessions to end (ListenConfig.DrainTimeout).
const defaultDrainTimeout = 10 * time.Second

// checkNetwork returns nil for the networks shmlink runs on, else an error
// wrapping ErrNetwork.
func checkNetwork(network string) error {
	switch network {
	case "unix", "tcp", "tcp4", "tcp6", "quic":
		return nil
	}
	return fmt.Errorf("%w: %q", ErrNetwork, network)
}

// Listen listens for shmlink clients on a Unix socket path or a TCP address
// and returns a listener whose Accept returns their streams, using the
// default Config. See ListenConfig.Listen. On "quic" it returns a
// *ConfigError: that network needs a ListenConfig with TLSConfig.
func Listen(network, address string) (net.Listener, error) {
	var lc ListenConfig
	ln, err := lc.Listen(context.Background(), network, address)
	if err != nil {
		return nil, err // an untyped nil: a nil *Listener would not be == nil
	}
	return ln, nil
}

// ListenConfig holds the options of a listener.
type ListenConfig struct {
	// Config is used for every session the listener accepts; nil means the
	// defaults. It is copied by Listen. Its AllowUIDs or PeerCheck decide
	// which clients of a "unix" listener are served (by default: processes
	// of this process's uid); a refused client's connection is closed,
	// logged and counted (Listener.PeersRefused).
	Config *Config

	// SocketMode is the permission bits of a "unix" listener's socket file;
	// a client needs write permission on it to connect. Zero means
	// 0600: the owner only; bits other than 0777 are a
	// *ConfigError. The mode is set exactly, whatever the umask, and before
	// the socket listens, so that no client can connect under another mode.
	// Abstract sockets ("@name") have no file and ignore it.
	SocketMode os.FileMode

	// AllowNonLoopback lets a "tcp" listener bind an address that is not a
	// loopback address, such as "0.0.0.0:0", ":0" or a LAN address. By
	// default Listen refuses those with ErrNotLoopback: between hosts TCP
	// tells nothing of the peer's uid (over loopback the kernel does, and
	// the peer check applies), and shared memory needs both processes on
	// one host.
	AllowNonLoopback bool

	// UpgradeSocket, if set, is the path of a Unix socket through which
	// generations of the server hand the listener over (hot upgrade;
	// docs/protocol.md section 14). If a live process owns it, Listen takes
	// that process's listening socket over instead of listening afresh,
	// and that process drains its sessions and then reports Upgraded.
	// Otherwise Listen listens afresh. Either way the listener then serves
	// UpgradeSocket for the next generation.
	UpgradeSocket string

	// DrainTimeout is how long a listener that handed its socket over
	// waits for its sessions to acknowledge the hot restart and end before
	// it closes those left, counted from the moment the new process took
	// the socket over (docs/protocol.md section 14). Zero means 10 s;
	// negative is invalid. Only used with UpgradeSocket.
	DrainTimeout time.Duration

	// TLSConfig is the server's TLS configuration on the "quic" network,
	// where it is required (nil is a *ConfigError), with a certificate
	// (Certificates, GetCertificate or GetConfigForClient). Listen copies
	// it, sets NextProtos to shmlink's ALPN and the minimum version to
	// TLS 1.3, as QUIC requires. Set ClientAuth and ClientCAs for mutual
	// TLS. Other networks ignore it.
	TLSConfig *tls.Config

	// QUICConfig tunes the "quic" network's connections; nil, or a field
	// left zero, means shmlink's defaults for a LAN: keepalive every 15 s,
	// idle timeout 1 min, 4096 concurrent streams per connection, receive
	// windows growing up to 16 MiB per stream and 64 MiB per connection
	// (docs/protocol.md section 17). Listen copies it. Fields with which
	// shmlink cannot work make Listen return a *ConfigError naming the
	// field: RequireStreamCreditRelease (shmlink never releases stream
	// credit) and a negative MaxIncomingStreams or MaxIncomingUniStreams.
	// The config that GetConfigForClient returns for a connection gets the
	// same defaults and checks; one that fails them refuses the connection
	// (the first is logged to the Config's Logger). Other networks ignore
	// it.
	QUICConfig *quic.Config
}

// Listen listens on network ("unix", "tcp" or "quic") at address. On
// "quic" (docs/protocol.md section 17) it listens on a UDP address with
// TLSConfig, for peers on other hosts, and nothing goes through shared
// memory; a nil TLSConfig is a *ConfigError, UpgradeSocket hands the UDP
// socket over (section 17 says how), and SocketMode and AllowNonLoopback
// do not apply. Every client
// connection runs its handshake in its own goroutine, bounded by
// Config.HandshakeTimeout, so a slow or silent client never delays others;
// a failed handshake closes that connection and is logged to
// Config.Logger. On "quic", quic-go runs the TLS handshake before shmlink
// sees the connection: a failed one is not logged, and
// Config.HandshakeTimeout bounds it as quic-go's handshake idle timeout
// (5 s when both are zero). A "unix" socket file gets SocketMode; a "tcp" address must
// be loopback unless AllowNonLoopback. It returns an error wrapping
// ErrNetwork for other networks, a *ConfigError for a bad Config,
// SocketMode or QUICConfig, a negative DrainTimeout or an UpgradeSocket
// that is the listening address itself, ErrNotLoopback
// (wrapped) for a refused TCP address, and net.Listen's errors. With
// UpgradeSocket it takes the listener of a running process over
// (docs/protocol.md section 14), and returns ErrUpgradeInProgress (wrapped)
// if that process is busy with another upgrade, and the handover's errors
// (wrapped), in which case the running process goes on serving. A bad
// Config, TLSConfig, QUICConfig or DrainTimeout is reported before the
// running process is asked to hand over.
func (lc *ListenConfig) Listen(ctx context.Context, network, address string) (*Listener, error) {
	if err := checkNetwork(network); err != nil {
		return nil, err
	}
	var cfg Config
	if lc.Config != nil {
		if err := lc.Config.Validate(); err != nil {
			return nil, err
		}
		cfg = *lc.Config
	}
	if network == "quic" {
		return lc.listenQUIC(ctx, address, cfg)
	}
	if lc.UpgradeSocket != "" {
		return lc.listenUpgradable(ctx, network, address, cfg)
	}
	ln, err := lc.listen(ctx, network, address)
	if err != nil {
		return nil, err
	}
	return newListener(ln, cfg, nil), nil
}

// listenUpgradable is Listen with an UpgradeSocket: take the listener over
// from the process that owns the socket, or listen afresh if none does.
func (lc *ListenConfig) listenUpgradable(ctx context.Context, network, address string, cfg Config) (*Listener, error) {
	switch {
	case lc.DrainTimeout < 0:
		return nil, &session.ConfigError{Field: "ListenConfig.DrainTimeout", Reason: "negative"}
	case network == "unix" && address == lc.UpgradeSocket:
		return nil, &session.ConfigError{Field: "ListenConfig.UpgradeSocket", Reason: "the listening address itself"}
	}
	ucfg := upgrade.Config{
		Path:         lc.UpgradeSocket,
		Network:      network,
		Address:      address,
		DrainTimeout: cmp.Or(lc.DrainTimeout, defaultDrainTimeout),
		Logger:       cfg.Logger,
	}
	ln, up, err := upgrade.TakeOver(ctx, ucfg, lc.checkTakenOver)
	if errors.Is(err, upgrade.ErrNoOwner) {
		ln, up, err = upgrade.Listen(ucfg, func() (net.Listener, error) {
			return lc.listen(ctx, network, address)
		})
	}
	if err != nil {
		return nil, err
	}
	l := newListener(ln, cfg, up)
	up.Start(handover{l})
	return l, nil
}

// checkTakenOver refuses a TCP listener taken over that is not on a
// loopback address, unless AllowNonLoopback.
func (lc *ListenConfig) checkTakenOver(ln net.Listener) error {
	if ta, ok := ln.Addr().(*net.TCPAddr); ok && !lc.AllowNonLoopback && !ta.IP.IsLoopback() {
		return fmt.Errorf("%w: the running listener is at %v", ErrNotLoopback, ta)
	}
	return nil
}

// Listener accepts streams from any number of client processes. It is a
// net.Listener; Accept returns *Stream values, except on "quic", where its
// net.Conn values are not *Stream.
type Listener struct {
	q *quicListener // the "quic" network's side; nil on the others

	ln  net.Listener
	cfg Config
	up  *upgrade.Upgrader // hot upgrade; nil without ListenConfig.UpgradeSocket

	mu       sync.Mutex
	sessions map[*session.Session]struct{}
	ended    Stats  // the counters of the sessions that ended
	err      error  // why Accept fails, if not Close: the socket's error, or ErrUpgraded
	handedTo uint64 // the new process's epoch once the socket was handed over, else 0

	accepts    chan *Stream
	acceptDone chan struct{} // closed when acceptLoop has returned
	// ctx is done when Accept must stop (Close, a failed socket, or
	// drained after a handover); stop cancels it.
	ctx       context.Context
	stop      context.CancelFunc
	closeOnce sync.Once
	wg        sync.WaitGroup // acceptLoop and serve
	access    listenerAccess
}

// newListener starts a Listener accepting on ln; up is its hot-upgrade
// side, nil without ListenConfig.UpgradeSocket, which the caller starts.
func newListener(ln net.Listener, cfg Config, up *upgrade.Upgrader) *Listener {
	cfg = withLogger(cfg)
	l := &Listener{
		ln:         ln,
		cfg:        cfg,
		up:         up,
		sessions:   make(map[*session.Session]struct{}),
		accepts:    make(chan *Stream),
		acceptDone: make(chan struct{}),
	}
	l.ctx, l.stop = context.WithCancel(context.Background())
	l.wg.Add(1)
	go l.acceptLoop()
	return l
}

// withLogger returns cfg with a Logger that discards if it had none.
func withLogger(cfg Config) Config {
	cfg.Logger = cmp.Or(cfg.Logger, slog.New(slog.DiscardHandler))
	return cfg
}

// Addr returns the listener's network address: a *net.UDPAddr on the
// "quic" network.
func (l *Listener) Addr() net.Addr {
	if l.q != nil {
		return l.q.udp.LocalAddr()
	}
	return l.ln.Addr()
}

// Accept waits for the next stream opened by any client and returns it. It
// returns an error satisfying errors.Is(err, net.ErrClosed) after Close,
// or wrapping ErrUpgraded (which satisfies it too) once the listener has
// handed over to a new process and drained, and the underlying listener's
// error if that failed.
func (l *Listener) Accept() (net.Conn, error) {
	if l.q != nil {
		return l.q.accept(l)
	}
	st, err := l.AcceptStream()
	if err != nil {
		return nil, err // an untyped nil
	}
	return st, nil
}

// AcceptStream is Accept returning the *Stream, whose zero-copy calls
// (Reserve, Peek, ReadBytes, ReadChunk) then need no type assertion. It
// returns the errors Accept returns, and ErrNoSharedMemory (wrapped) on
// the "quic" network, whose streams only Accept returns.
func (l *Listener) AcceptStream() (*Stream, error) {
	if l.q != nil {
		return nil, l.closedError("accept", ErrNoSharedMemory)
	}
	select {
	case <-l.ctx.Done():
	default:
		select {
		case st := <-l.accepts:
			return st, nil
		case <-l.ctx.Done():
		}
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.err != nil {
		return nil, l.err
	}
	return nil, l.closedError("accept", net.ErrClosed)
}

// closedError is the error of op on a listener closed for err.
func (l *Listener) closedError(op string, err error) error {
	nw := "quic"
	if l.q == nil {
		nw = l.ln.Addr().Network()
	}
	return &net.OpError{Op: op, Net: nw, Addr: l.Addr(), Err: err}
}

// Close stops listening, as a net.Listener's Close does, and nothing
// more: Accept returns an error satisfying errors.Is(err, net.ErrClosed),
// streams already accepted live on, and each session ends when its last
// stream does. New streams on those sessions, and streams that Accept has
// not returned, are refused: a shmlink client gets ErrStreamRefused on
// them, a client of another implementation reads io.EOF (on "quic", a
// reset with code 1). Close returns the error of closing the socket. On
// "quic" the connections share the UDP socket: Close closes it before
// returning only when no connection is left; otherwise the last
// connection's end closes it, and a connection ends once its client has
// read its last stream, or after the QUIC idle timeout (docs/protocol.md
// section 17). Later calls return an error satisfying errors.Is(err,
// net.ErrClosed). Shutdown waits for the sessions to end;
// CloseSessions ends them at once. Handshakes in flight end at once, and
// their connections are closed. With ListenConfig.UpgradeSocket, a Close
// while a new process takes the listener over waits for that process's
// answer, which decides who keeps the socket files, for up to 10 s
// (docs/protocol.md section 14).
func (l *Listener) Close() error {
	if l.q != nil {
		if err := l.q.close(); errors.Is(err, net.ErrClosed) {
			return l.closedError("close", err)
		} else {
			return err
		}
	}
	err := l.closedError("close", net.ErrClosed)
	l.closeOnce.Do(func() {
		l.stop()
		if l.up != nil {
			l.up.Stop() // before ln.Close: it removes the socket files while they are ours (docs/protocol.md section 14)
		}
		err = l.ln.Close()
		l.mu.Lock()
		if l.handedTo != 0 {
			err = nil // closed by the handover already: no error
		}
		l.mu.Unlock()
		<-l.acceptDone
		for _, s := range l.liveSessions() {
			s.CloseWhenIdle()
		}
		if l.up != nil {
			l.up.Close()
		}
	})
	return err
}

// Shutdown closes the listener (see Close) and waits until every session
// it accepted has ended, that is until their streams are closed, or until
// ctx is done; then it ends the sessions left (CloseSessions) and returns
// ctx.Err(). It returns nil once all ended by themselves, as
// net/http.Server.Shutdown does. Call it after the server's own shutdown
// (http.Server.Shutdown, grpc.Server.GracefulStop) has begun, or instead
// of Close when no such server runs on the listener.
func (l *Listener) Shutdown(ctx context.Context) error {
	l.Close()
	ended := make(chan struct{})
	go func() {
		if l.q != nil {
			l.q.wg.Wait()
		} else {
			l.wg.Wait()
		}
		close(ended)
	}()
	select {
	case <-ended:
		return nil
	case <-ctx.Done():
		l.CloseSessions()
		return ctx.Err()
	}
}

// CloseSessions closes the listener (see Close) and ends every session it
// accepted at once, with all their streams, which then fail with an error
// satisfying errors.Is(err, net.ErrClosed); the clients read that the
// session ended. It waits for the listener's goroutines, and on "quic"
// for its UDP socket to close, and returns the number of sessions (QUIC
// connections) it ended.
func (l *Listener) CloseSessions() int {
	l.Close()
	if l.q != nil {
		n := l.q.closeConns()
		l.q.wg.Wait()
		return n
	}
	n := l.closeSessions()
	l.wg.Wait()
	return n
}

// liveSessions returns the sessions the listener tracks.
func (l *Listener) liveSessions() []*session.Session {
	l.mu.Lock()
	defer l.mu.Unlock()
	sessions := make([]*session.Session, 0, len(l.sessions))
	for s := range l.sessions {
		sessions = append(sessions, s)
	}
	return sessions
}

// closeSessions closes every session the listener tracks, all at once,
// and returns how many once every Close has returned. Each Close may wait
// up to min(HandshakeTimeout, 1 s) for its client to take the events
// queued (Session.Close), so one at a time, k clients that stopped
// reading took k times that.
func (l *Listener) closeSessions() int {
	sessions := l.liveSessions()
	var wg sync.WaitGroup
	for _, s := range sessions {
		wg.Add(1)
		go func() {
			defer wg.Done()
			s.Close()
		}()
	}
	wg.Wait()
	return len(sessions)
}

// Stats returns the counters of every session the listener accepted,
// live and ended, summed; ActiveStreams counts the streams of the live
// ones, and SlicesInUse is nil (each session has a region of its own).
// On "quic" only BytesSent, BytesReceived (without the preamble),
// StreamsRefused and ActiveStreams count. Publish it with expvar.Func for
// a /debug/vars page (see the example).
func (l *Listener) Stats() Stats {
	if l.q != nil {
		return l.q.stats()
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	return sumStats(l.ended, l.sessions)
}

// NumSessions returns the number of live sessions the listener tracks. On
// "quic" it counts QUIC connections, a draining one until it ends.
func (l *Listener) NumSessions() int {
	if l.q != nil {
		return l.q.numConns()
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	return len(l.sessions)
}

// Upgraded returns a channel that is closed once a new process has taken
// the listener over through ListenConfig.UpgradeSocket and this listener
// has drained: every session acknowledged the hot restart and ended, or
// DrainTimeout passed and the rest were closed (or Close was called
// meanwhile). Accept then returns ErrUpgraded, and the process may Close
// the listener and exit. Without UpgradeSocket it returns nil, a channel
// that never fires.
func (l *Listener) Upgraded() <-chan struct{} {
	if l.up == nil {
		return nil
	}
	return l.up.Upgraded()
}

// Epoch returns the listener's generation: 0 for a listener that listened
// afresh (or without UpgradeSocket), and its predecessor's plus one for a
// listener that took one over. Sessions dialed after the hot restart name
// their shared memory with it (Config.Epoch).
func (l *Listener) Epoch() uint64 {
	if l.up == nil {
		return 0
	}
	return l.up.Epoch()
}

// acceptLoop accepts connections and serves each in its own goroutine
// until the socket fails, is closed, or is handed over.
func (l *Listener) acceptLoop() {
	defer l.wg.Done()
	defer close(l.acceptDone)
	retry := func(err error, wait time.Duration) { // EMFILE and the like: back off, log
		l.cfg.Logger.Warn("shmlink: accept failed, retrying", "err", err, "in", wait)
	}
	for {
		conn, err := sock.Accept(l.ctx, l.ln, retry)
		if err != nil {
			l.mu.Lock()
			if l.ctx.Err() == nil && l.handedTo == 0 { // else closed, or the new process accepts now
				l.err = err
				l.stop()
			}
			l.mu.Unlock()
			return
		}
		l.wg.Add(1)
		go l.serve(conn)
	}
}

// serve runs the handshake on conn and then hands the session's streams to
// Accept until the session ends or the listener closes.
func (l *Listener) serve(conn net.Conn) {
	defer l.wg.Done()
	// Close ends a handshake in flight: its session would be closed
	// below anyway, and Shutdown and CloseSessions wait for this goroutine.
	s, err := session.ServerContext(l.ctx, conn, &l.cfg)
	if err != nil {
		if l.ctx.Err() == nil { // else ended by Close: not the peer's failure
			l.handshakeFailed(conn, err)
		}
		return
	}
	l.mu.Lock()
	if l.ctx.Err() != nil {
		l.mu.Unlock()
		s.Close() // a connection of the closed listener's backlog
		return
	}
	l.sessions[s] = struct{}{}
	epoch := l.handedTo
	l.mu.Unlock()
	if epoch != 0 {
		s.SendHotRestart(epoch) // handed over meanwhile: its client must move too
	}
	defer func() {
		l.mu.Lock()
		delete(l.sessions, s)
		addEnded(&l.ended, s.Stats())
		l.mu.Unlock()
	}()
	for {
		st, err := s.AcceptStream(l.ctx)
		if err != nil {
			break // the session ended, or the listener closed
		}
		select {
		case l.accepts <- st:
			continue
		case <-l.ctx.Done():
			st.Refuse() // Accept never returned it
		}
		break
	}
	// A closed listener's session ends with its last stream (Close,
	// Shutdown), or when CloseSessions ends it; the session stays in the
	// set until then. A Close that collected the sessions before this one
	// joined the set leaves it to this goroutine.
	s.CloseWhenIdle()
	<-s.Done()
}

// handover is a Listener as its Upgrader drives it (upgrade.Listener).
type handover struct{ l *Listener }

// HandOver stops accepting and sends HotRestart{epoch} on every session,
// and on every later one (serve). Each session's goes out on a goroutine
// of its own, which wg counts, and HandOver does not wait for them: a
// client that stopped reading holds its write for up to WriteTimeout, and
// must hold neither the other clients' nor the drain (docs/protocol.md
// section 14).
func (h handover) HandOver(epoch uint64) <-chan struct{} {
	l := h.l
	l.mu.Lock()
	l.handedTo = epoch
	l.mu.Unlock()
	l.ln.Close() // our descriptor: the socket lives on in the new process
	<-l.acceptDone
	l.mu.Lock()
	for s := range l.sessions {
		// s's serve goroutine leaves the set before it leaves wg, so wg
		// is not zero here: Add cannot race a Wait that returns.
		l.wg.Add(1)
		go func() {
			defer l.wg.Done()
			s.SendHotRestart(epoch) // an error means it has ended anyway
		}()
	}
	l.mu.Unlock()
	// acceptLoop has returned: wg counts the serve goroutines and those
	// above only, and no more start. The goroutine ends with the last of
	// them, at the latest when Close has closed them all.
	idle := make(chan struct{})
	go func() { l.wg.Wait(); close(idle) }()
	return idle
}

// Drained closes the sessions left, all at once (closeSessions), and
// makes Accept return ErrUpgraded.
func (h handover) Drained() int {
	l := h.l
	l.mu.Lock()
	if l.err == nil {
		l.err = l.closedError("accept", ErrUpgraded)
	}
	l.mu.Unlock()
	// Stopped first, so that a session whose handshake completes from
	// here on closes itself (serve), and every other one is in the set
	// that closeSessions takes: none outlives the drain.
	l.stop()
	return l.closeSessions()
}
