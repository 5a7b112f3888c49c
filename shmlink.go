package shmlink

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"sync"
	"time"

	"github.com/shmlink/shmlink/session"
)

// Config tunes sessions; the zero value works. See session.Config for the
// fields, their units and defaults.
type Config = session.Config

// Stream is one net.Conn stream of a session, with the zero-copy API
// (Reserve/Flush, Peek/ReadBytes/Discard/ReleasePreviousRead). Accept and
// Dial return *Stream values as net.Conn.
type Stream = session.Stream

// ErrNetwork is returned by Listen and Dial for a network other than "unix"
// and "tcp" (and "tcp4", "tcp6").
var ErrNetwork = errors.New("shmlink: network must be unix or tcp")

func checkNetwork(network string) error {
	switch network {
	case "unix", "tcp", "tcp4", "tcp6":
		return nil
	}
	return fmt.Errorf("%w: %q", ErrNetwork, network)
}

// Listen listens for shmlink clients on a Unix socket path or a TCP address
// and returns a listener whose Accept returns their streams, using the
// default Config. See ListenConfig.Listen.
func Listen(network, address string) (net.Listener, error) {
	var lc ListenConfig
	return lc.Listen(context.Background(), network, address)
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
	// DefaultSocketMode (0600: the owner only); bits other than 0777 are a
	// *ConfigError. The mode is set exactly, whatever the umask, and before
	// the socket listens, so that no client can connect under another mode.
	// Abstract sockets ("@name") have no file and ignore it.
	SocketMode os.FileMode

	// AllowNonLoopback lets a "tcp" listener bind an address that is not a
	// loopback address, such as "0.0.0.0:0", ":0" or a LAN address. By
	// default Listen refuses those with ErrNotLoopback: TCP carries no peer
	// credentials, and shared memory needs both processes on one host.
	AllowNonLoopback bool

	// UpgradeSocket, if set, is the path of a Unix socket through which
	// generations of the server hand the listener over (hot upgrade; see
	// upgrade.go). If a live process owns it, Listen takes that process's
	// listening socket over instead of listening afresh, and that process
	// drains its sessions and then reports Upgraded. Otherwise Listen
	// listens afresh. Either way the listener then serves UpgradeSocket
	// for the next generation.
	UpgradeSocket string

	// DrainTimeout is how long a listener that handed its socket over
	// waits for its sessions to acknowledge the hot restart and end before
	// it closes those left. Zero means DefaultDrainTimeout (10 s);
	// negative is invalid. Only used with UpgradeSocket.
	DrainTimeout time.Duration
}

// Listen listens on network ("unix" or "tcp") at address. Every client
// connection runs its handshake in its own goroutine, bounded by
// Config.HandshakeTimeout, so a slow or silent client never delays others;
// a failed handshake closes that connection and is logged to
// Config.Logger. A "unix" socket file gets SocketMode; a "tcp" address must
// be loopback unless AllowNonLoopback. It returns ErrNetwork for other
// networks, a *ConfigError for a bad Config or SocketMode, ErrNotLoopback
// (wrapped) for a refused TCP address, and net.Listen's errors. With
// UpgradeSocket it takes the listener of a running process over (see
// upgrade.go), and returns ErrUpgradeInProgress (wrapped) if that process
// is busy with another upgrade, and the handover's errors (wrapped), in
// which case the running process goes on serving.
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
	if lc.UpgradeSocket != "" {
		return lc.listenUpgradable(ctx, network, address, cfg)
	}
	ln, err := lc.listen(ctx, network, address)
	if err != nil {
		return nil, err
	}
	return newListener(ln, cfg, nil), nil
}

// newListener starts a Listener accepting on ln; up is its hot-upgrade
// state, nil without ListenConfig.UpgradeSocket.
func newListener(ln net.Listener, cfg Config, up *upgrader) *Listener {
	l := &Listener{
		ln:       ln,
		cfg:      cfg,
		up:       up,
		sessions: make(map[*session.Session]struct{}),
		accepts:  make(chan *Stream),
		done:     make(chan struct{}),
	}
	l.wg.Add(1)
	go l.acceptLoop()
	return l
}

// Listener accepts streams from any number of client processes. It is a
// net.Listener; Accept returns *Stream values.
type Listener struct {
	ln  net.Listener
	cfg Config
	up  *upgrader // hot upgrade (upgrade.go); nil without UpgradeSocket

	mu       sync.Mutex
	sessions map[*session.Session]struct{}
	err      error // why acceptLoop stopped, if not Close

	accepts   chan *Stream
	done      chan struct{} // closed when Accept must stop: Close, or a failed listener
	doneOnce  sync.Once
	closeOnce sync.Once
	wg        sync.WaitGroup
	access    listenerAccess
}

// stop closes done once.
func (l *Listener) stop() { l.doneOnce.Do(func() { close(l.done) }) }

// Addr returns the listener's network address.
func (l *Listener) Addr() net.Addr { return l.ln.Addr() }

// Accept waits for the next stream opened by any client and returns it. It
// returns an error satisfying errors.Is(err, net.ErrClosed) after Close,
// or wrapping ErrUpgraded (which satisfies it too) once the listener has
// handed over to a new process and drained, and the underlying listener's
// error if that failed.
func (l *Listener) Accept() (net.Conn, error) {
	select {
	case <-l.done:
	default:
		select {
		case st := <-l.accepts:
			return st, nil
		case <-l.done:
		}
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.err != nil {
		return nil, l.err
	}
	return nil, l.closedError("accept")
}

// closedError is the error of op on a closed listener.
func (l *Listener) closedError(op string) error {
	return &net.OpError{Op: op, Net: l.ln.Addr().Network(), Addr: l.ln.Addr(), Err: net.ErrClosed}
}

// Close stops listening and closes every session the listener accepted,
// with all their streams; it waits for the listener's goroutines and
// returns the error of closing the socket. Later calls return an error
// satisfying errors.Is(err, net.ErrClosed), like a net.Listener's.
func (l *Listener) Close() error {
	err := l.closedError("close")
	l.closeOnce.Do(func() {
		l.stop()
		err = l.closeSocket()
		l.mu.Lock()
		sessions := make([]*session.Session, 0, len(l.sessions))
		for s := range l.sessions {
			sessions = append(sessions, s)
		}
		l.mu.Unlock()
		for _, s := range sessions {
			s.Close()
		}
		l.wg.Wait()
		l.up.closed()
	})
	return err
}

// NumSessions returns the number of live sessions the listener tracks.
func (l *Listener) NumSessions() int {
	l.mu.Lock()
	defer l.mu.Unlock()
	return len(l.sessions)
}

func (l *Listener) acceptLoop() {
	defer l.wg.Done()
	defer l.up.acceptStopped()
	for {
		conn, err := l.ln.Accept()
		if err != nil {
			if l.up.handedOver() {
				return // the next generation accepts on the socket now
			}
			select {
			case <-l.done:
			default:
				l.mu.Lock()
				l.err = err
				l.mu.Unlock()
				l.stop()
			}
			return
		}
		l.up.connStarted()
		l.wg.Add(1)
		go l.serve(conn)
	}
}

// serve runs the handshake on conn and then hands the session's streams to
// Accept until the session ends or the listener closes.
func (l *Listener) serve(conn net.Conn) {
	defer l.wg.Done()
	defer l.up.connEnded()
	s, err := session.Server(conn, &l.cfg)
	if err != nil {
		l.handshakeFailed(conn, err)
		return
	}
	l.mu.Lock()
	select {
	case <-l.done:
		l.mu.Unlock()
		s.Close()
		return
	default:
	}
	l.sessions[s] = struct{}{}
	l.mu.Unlock()
	l.up.sessionStarted(s)
	defer func() {
		l.mu.Lock()
		delete(l.sessions, s)
		l.mu.Unlock()
		// Close may have collected the sessions after this one left the
		// set: a listener that is done ends the session here too.
		select {
		case <-l.done:
			s.Close()
		default:
		}
	}()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go func() {
		select {
		case <-l.done:
		case <-s.Done():
		}
		cancel()
	}()
	for {
		st, err := s.AcceptStream(ctx)
		if err != nil {
			// The session ended (its streams live on until closed) or the
			// listener closed (Close closes the session).
			return
		}
		select {
		case l.accepts <- st:
		case <-l.done:
			st.Close()
			return
		}
	}
}

// Dial connects to a shmlink listener with a new session of the default
// Config and returns one stream on it; closing the stream ends the session.
// Use a Dialer to reuse sessions for many streams.
func Dial(network, address string) (net.Conn, error) {
	return DialContext(context.Background(), network, address)
}

// DialContext is Dial with a context that bounds the connection and the
// handshake.
func DialContext(ctx context.Context, network, address string) (net.Conn, error) {
	s, err := dialSession(ctx, nil, network, address)
	if err != nil {
		return nil, err
	}
	st, err := s.OpenStream(ctx)
	if err != nil {
		s.Close()
		return nil, err
	}
	s.CloseWhenIdle()
	return st, nil
}

func dialSession(ctx context.Context, cfg *Config, network, address string) (*session.Session, error) {
	if err := checkNetwork(network); err != nil {
		return nil, err
	}
	var nd net.Dialer
	conn, err := nd.DialContext(ctx, network, address)
	if err != nil {
		return nil, err
	}
	if dl, ok := ctx.Deadline(); ok {
		c := session.Config{}
		if cfg != nil {
			c = *cfg
		}
		if d := time.Until(dl); c.HandshakeTimeout == 0 || d < c.HandshakeTimeout {
			c.HandshakeTimeout = max(d, 1)
		}
		cfg = &c
	}
	return session.Client(conn, cfg)
}

// Defaults of a Dialer's session pool.
const (
	// DefaultMaxSessions is the most sessions a Dialer keeps per address.
	DefaultMaxSessions = 4
	// DefaultStreamsPerSession is the number of streams on each of its
	// sessions at which a Dialer opens another session to the address.
	DefaultStreamsPerSession = 256
	// DefaultIdleTimeout is how long a Dialer keeps a session without any
	// stream before closing it.
	DefaultIdleTimeout = 90 * time.Second
)

// errDialerClosed is returned by a Dialer's dials after Close.
var errDialerClosed = fmt.Errorf("shmlink: dialer closed: %w", net.ErrClosed)

// Dialer opens streams to shmlink listeners over a small pool of sessions
// per address, so that many dials share a few handshakes and buffer
// regions, and dialing and closing a stream costs no system call beyond
// the wakeups. A Dial uses the session with the fewest streams; once every
// session has StreamsPerSession streams or more it opens another, up to
// MaxSessions, and then keeps spreading over those. Stream ids are reused:
// a closed stream's id returns to its session by itself once the server
// closed the stream too. A session idle for IdleTimeout is closed.
//
// A session whose server announces a hot restart (PROTOCOL.md section 5;
// ListenConfig.UpgradeSocket) takes no new stream and no longer counts
// against MaxSessions: the next dial opens a session to the new server
// process, with the epoch in its shared-memory names, while the streams
// in flight finish on the old one, which then acknowledges and ends.
//
// The zero value is ready to use. A Dialer is safe for concurrent use; its
// fields must not change after the first Dial. Close it to end its
// sessions.
type Dialer struct {
	// Config is used for every session the Dialer creates; nil means the
	// defaults.
	Config *Config

	// MaxSessions is the most sessions the Dialer keeps per network and
	// address. Zero means DefaultMaxSessions (4); negative is invalid.
	MaxSessions int

	// StreamsPerSession is the number of open streams (including ones
	// waiting for the server's close) on every session at which a Dial
	// opens another session, while there are fewer than MaxSessions. It is
	// a threshold, not a cap: at MaxSessions, streams keep going to the
	// least loaded session. Zero means DefaultStreamsPerSession (256);
	// negative is invalid.
	StreamsPerSession int

	// IdleTimeout is how long a session without any stream is kept before
	// the Dialer closes it. Zero means DefaultIdleTimeout (90 s); negative
	// means sessions are kept until Close.
	IdleTimeout time.Duration

	mu     sync.Mutex
	pools  map[string]*sessionPool // by network + " " + address
	closed bool
}

// sessionPool is a Dialer's sessions to one address.
type sessionPool struct {
	sessions []*session.Session
	dial     *dialCall // the dial in progress, if any
	// draining holds the sessions whose server announced a hot restart:
	// no new stream goes to them, and they end by themselves once their
	// last stream is done (see upgrade.go); epoch is the last such epoch.
	draining []*session.Session
	epoch    uint64
}

// dialCall is one dial of a new session, shared by the dials waiting on it.
type dialCall struct {
	done chan struct{} // closed when err is set
	err  error
}

// leastLoaded drops the sessions that ended, sets those draining for a hot
// restart aside, and returns the one with the fewest streams of the others
// and that number, or nil when none is left.
func (p *sessionPool) leastLoaded() (*session.Session, int) {
	p.pruneDraining()
	live := p.sessions[:0]
	var best *session.Session
	load := 0
	for _, s := range p.sessions {
		if s.Err() != nil {
			continue
		}
		if p.retireDraining(s) {
			continue
		}
		live = append(live, s)
		if n := s.NumStreams(); best == nil || n < load {
			best, load = s, n
		}
	}
	clear(p.sessions[len(live):])
	p.sessions = live
	return best, load
}

// validate checks the Dialer's fields and its Config.
func (d *Dialer) validate() error {
	switch {
	case d.MaxSessions < 0:
		return &session.ConfigError{Field: "Dialer.MaxSessions", Reason: "negative"}
	case d.StreamsPerSession < 0:
		return &session.ConfigError{Field: "Dialer.StreamsPerSession", Reason: "negative"}
	}
	if d.Config != nil {
		return d.Config.Validate()
	}
	return nil
}

// Dial opens a stream to address; see DialContext.
func (d *Dialer) Dial(network, address string) (net.Conn, error) {
	return d.DialContext(context.Background(), network, address)
}

// DialContext opens a stream to network ("unix" or "tcp") and address on
// one of the Dialer's sessions, dialing and handshaking a new session when
// the pool calls for one (see Dialer). Concurrent dials share one
// handshake. The stream is announced to the server, whose Accept returns
// it before any byte is written. It returns ErrNetwork for other networks,
// a *ConfigError for a bad field, an error satisfying errors.Is(err,
// net.ErrClosed) after Close, ctx.Err() when ctx is done first, and the
// dial or handshake error.
func (d *Dialer) DialContext(ctx context.Context, network, address string) (net.Conn, error) {
	if err := checkNetwork(network); err != nil {
		return nil, err
	}
	if err := d.validate(); err != nil {
		return nil, err
	}
	key := network + " " + address
	var err error
	for ended, draining := 0, 0; ended < 3 && draining < maxDrainingPicks; {
		var s *session.Session
		if s, err = d.pick(ctx, key, network, address); err != nil {
			return nil, err
		}
		var st *Stream
		if st, err = s.OpenStream(ctx); err == nil {
			return st, nil
		}
		switch {
		case ctx.Err() != nil:
			return nil, err
		case errors.Is(err, session.ErrDraining):
			// The server handed over to a new process since the session
			// was picked: pick again, which dials the new process.
			draining++
		case s.Err() != nil:
			// The session ended since it was picked (idle timeout, peer
			// gone): pick again.
			ended++
		default:
			return nil, err
		}
	}
	return nil, err
}

// pick returns the session for the next stream to key, dialing one when
// the pool has none or all its sessions are loaded and it may grow.
func (d *Dialer) pick(ctx context.Context, key, network, address string) (*session.Session, error) {
	maxSessions := cmp.Or(d.MaxSessions, DefaultMaxSessions)
	perSession := cmp.Or(d.StreamsPerSession, DefaultStreamsPerSession)
	for {
		d.mu.Lock()
		if d.closed {
			d.mu.Unlock()
			return nil, errDialerClosed
		}
		if d.pools == nil {
			d.pools = make(map[string]*sessionPool)
		}
		p := d.pools[key]
		if p == nil {
			p = &sessionPool{}
			d.pools[key] = p
		}
		best, load := p.leastLoaded()
		if best != nil && (load < perSession || p.dial != nil || len(p.sessions) >= maxSessions) {
			d.mu.Unlock()
			return best, nil
		}
		if call := p.dial; call != nil {
			// No session yet: wait for the dial in progress.
			d.mu.Unlock()
			select {
			case <-call.done:
			case <-ctx.Done():
				return nil, ctx.Err()
			}
			if call.err != nil && !errors.Is(call.err, context.Canceled) && !errors.Is(call.err, context.DeadlineExceeded) {
				return nil, call.err
			}
			continue // it succeeded, or failed for its own context
		}
		call := &dialCall{done: make(chan struct{})}
		p.dial = call
		cfg := withEpoch(d.Config, p.epoch)
		d.mu.Unlock()

		s, err := dialSession(ctx, cfg, network, address)
		d.mu.Lock()
		p.dial = nil
		switch {
		case err != nil:
		case d.closed:
			err = errDialerClosed
		default:
			s.SetIdleTimeout(cmp.Or(d.IdleTimeout, DefaultIdleTimeout))
			p.sessions = append(p.sessions, s)
		}
		if len(p.sessions) == 0 && len(p.draining) == 0 && d.pools[key] == p {
			delete(d.pools, key)
		}
		call.err = err
		d.mu.Unlock()
		close(call.done)
		if err != nil {
			if s != nil {
				s.Close()
			}
			return nil, err
		}
		return s, nil
	}
}

// Close ends every session of the Dialer, with all their streams, and makes
// later dials fail with an error satisfying errors.Is(err, net.ErrClosed).
// A dial in progress closes its session when it completes. Close returns
// nil.
func (d *Dialer) Close() error {
	d.mu.Lock()
	d.closed = true
	pools := d.pools
	d.pools = nil
	d.mu.Unlock()
	for _, p := range pools {
		for _, s := range p.sessions {
			s.Close()
		}
		for _, s := range p.draining {
			s.Close()
		}
	}
	return nil
}

// NumSessions returns the number of live sessions the Dialer holds, over
// all addresses.
func (d *Dialer) NumSessions() int {
	d.mu.Lock()
	defer d.mu.Unlock()
	n := 0
	for key, p := range d.pools {
		p.leastLoaded()
		if len(p.sessions) == 0 && len(p.draining) == 0 && p.dial == nil {
			delete(d.pools, key)
		}
		n += len(p.sessions) + len(p.draining)
	}
	return n
}

// MemoryType selects memfd or file-backed shared memory; see
// session.MemoryType.
type MemoryType = session.MemoryType

// Memory types, as in package session.
const (
	MemoryAuto  = session.MemoryAuto
	MemoryMemfd = session.MemoryMemfd
	MemoryFile  = session.MemoryFile
)
