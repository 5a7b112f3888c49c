package shmlink

import (
	"cmp"
	"context"
	"crypto/tls"
	"errors"
	"net"
	"slices"
	"sync"
	"time"

	"github.com/quic-go/quic-go"
	"github.com/shmlink/shmlink/session"
)

// Dial connects to a shmlink listener with a new session of the default
// Config and returns one stream on it; closing the stream ends the session.
// Use a Dialer to reuse sessions for many streams.
func Dial(network, address string) (net.Conn, error) {
	return DialContext(context.Background(), network, address)
}

// DialContext is Dial with a context that bounds the connection and the
// handshake: once ctx is done, it returns an error wrapping ctx.Err(). It
// returns an error wrapping ErrNetwork for a network other than "unix" or
// "tcp" (errors.Is), the dial error, the handshake error (a
// *session.SessionError wrapping ErrHandshake), and the errors of opening
// the stream: ErrQueueFull when the server leaves the IO queue full for
// Config.QueueFullTimeout, session.ErrDraining when it hands over to a new process
// meanwhile (docs/protocol.md section 5), or the session's error if it
// ended. The "quic" network needs a Dialer with TLSConfig: here it
// returns a *ConfigError.
func DialContext(ctx context.Context, network, address string) (net.Conn, error) {
	if network == "quic" {
		_, err := quicTLS(nil, false) // the "quic" network needs a Dialer with TLSConfig
		return nil, err
	}
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

// dialSession connects to network and address and runs the client
// handshake with cfg (nil: the defaults), both bounded by ctx too. It
// returns the session, owned by the caller, or ErrNetwork (wrapped), the
// dial error or the handshake error; when ctx ended the dial or the
// handshake, the error wraps ctx.Err().
func dialSession(ctx context.Context, cfg *Config, network, address string) (*session.Session, error) {
	if err := checkNetwork(network); err != nil {
		return nil, err
	}
	var nd net.Dialer
	conn, err := nd.DialContext(ctx, network, address)
	if err != nil {
		return nil, err
	}
	return session.ClientContext(ctx, conn, cfg)
}

// Defaults of a Dialer's session pool (docs/protocol.md section 18).
const (
	// defaultMaxSessions is the most sessions a Dialer keeps per address.
	defaultMaxSessions = 4
	// defaultStreamsPerSession is the number of streams on each of its
	// sessions at which a Dialer opens another session to the address.
	defaultStreamsPerSession = 256
	// defaultIdleTimeout is how long a Dialer keeps a session without any
	// stream before closing it.
	defaultIdleTimeout = 90 * time.Second

	// maxDrainingPicks bounds how often one Dialer.DialContext picks again
	// after its session turned out to be draining.
	maxDrainingPicks = 8

	// dialingLoadFactor bounds the streams a session takes while the
	// Dialer dials another session to its address: up to this many times
	// StreamsPerSession; later dials wait for the new session. A burst of
	// dials then cannot pile onto one session beyond its server's accept
	// backlog (Config.AcceptBacklog, 4096 by default), where the server
	// refuses streams (docs/protocol.md section 11).
	dialingLoadFactor = 2

	// growRetryAfter is how long a Dialer keeps to the sessions it has
	// after a dial to grow their pool failed, before it tries to grow the
	// pool again.
	growRetryAfter = time.Second
)

// Dialer opens streams to shmlink listeners over a small pool of sessions
// per address, so that many dials share a few handshakes and buffer
// regions, and dialing and closing a stream costs no system call beyond
// the wakeups. A Dial uses the session with the fewest streams; once every
// session has StreamsPerSession streams or more it opens another, up to
// MaxSessions, and then keeps spreading over those. While the new session
// is being dialed, streams keep going to the others until they carry twice
// StreamsPerSession; dials beyond that wait for the new session, so that a
// burst of dials does not fill one session past its server's accept
// backlog. If the new session cannot be dialed, the streams go to the
// sessions the Dialer has, and it tries to grow the pool again a second
// later (the failure is logged to Config.Logger). Stream ids are reused:
// a closed stream's id returns to its session by itself once the server
// closed the stream too. A session idle for IdleTimeout is closed.
// docs/protocol.md section 18 describes the pool.
//
// A session whose server announces a hot restart (docs/protocol.md
// sections 5 and 14; ListenConfig.UpgradeSocket) takes no new stream and no longer
// counts against MaxSessions: the next dial opens a session to the new
// server process, with the epoch in its shared-memory names, while the
// streams in flight finish on the old one, which then acknowledges and
// ends.
//
// On "quic" the Dialer keeps one QUIC connection per address, not a pool:
// MaxSessions and StreamsPerSession do not apply; IdleTimeout, TLSConfig,
// QUICConfig and the Config's HandshakeTimeout, QueueFullTimeout (the
// longest a dial waits for the server's stream limit) and Logger do, the
// rest of Config (shared memory) does not.
//
// The zero value is ready to use. A Dialer is safe for concurrent use; its
// fields must not change after the first Dial. Close it to end its
// sessions.
type Dialer struct {
	// Config is used for every session the Dialer creates; nil means the
	// defaults.
	Config *Config

	// MaxSessions is the most sessions the Dialer keeps per network and
	// address. Zero means 4; negative is invalid.
	MaxSessions int

	// StreamsPerSession is the number of streams (Session.NumStreams: on a
	// client, those the application has not closed) on every session at
	// which a Dial opens another session, while there are fewer than
	// MaxSessions. It is a threshold, not a cap: at MaxSessions, streams
	// keep going to the least loaded session. Zero means 256; negative is
	// invalid.
	StreamsPerSession int

	// IdleTimeout is how long a session without any stream is kept before
	// the Dialer closes it. Zero means 90 s; negative
	// means sessions are kept until Close.
	IdleTimeout time.Duration

	// TLSConfig is the client's TLS configuration on the "quic" network,
	// where it is required (nil is a *ConfigError): RootCAs to verify the
	// server (or InsecureSkipVerify, for tests only), and Certificates
	// when the server asks for a client certificate (mutual TLS). The
	// Dialer copies it for each connection, sets NextProtos to shmlink's
	// ALPN, the minimum version to TLS 1.3, and ServerName to the
	// address's host when empty. Other networks ignore it.
	TLSConfig *tls.Config

	// QUICConfig tunes the "quic" network's connections; nil, or a field
	// left zero, means shmlink's defaults (see ListenConfig.QUICConfig).
	// RequireStreamCreditRelease and a negative MaxIncomingUniStreams make
	// every dial fail with a *ConfigError naming the field (shmlink could
	// not take the server's messages); a negative MaxIncomingStreams is
	// fine, since servers open no stream. Other networks ignore it.
	QUICConfig *quic.Config

	mu     sync.Mutex
	quic   *quicDialer             // the "quic" network's side, from its first dial
	pools  map[string]*sessionPool // by network + " " + address
	closed bool
	// dialSession dials a session for the pool, growRetry replaces
	// growRetryAfter when not zero, and onWait runs when a dial starts
	// waiting for another's; tests set them to hold or fail a dial
	// (export_test.go). nil means the package's dialSession.
	dialSession func(ctx context.Context, cfg *Config, network, address string) (*session.Session, error)
	growRetry   time.Duration
	onWait      func()
	// resolver looks "quic" addresses up; nil means net.DefaultResolver.
	// Tests set it (export_quic_test.go).
	resolver *net.Resolver
	live     map[*session.Session]struct{} // every session until it ends
	ended    Stats                         // the counters of the sessions that ended
	// opening counts, per session, the dials that picked it and have not
	// yet opened their stream: they count in its load (leastLoaded), so
	// that concurrent dials see each other's picks.
	opening map[*session.Session]int
}

// sessionPool is a Dialer's sessions to one address.
type sessionPool struct {
	sessions []*session.Session
	dial     *dialCall // the dial in progress, if any
	// draining holds the sessions whose server announced a hot restart:
	// no new stream goes to them, and they end by themselves once their
	// last stream is done; epoch is the last such epoch, which new
	// sessions name their shared memory with (Config.Epoch).
	draining []*session.Session
	epoch    uint64
	// growAfter is when the pool may try to grow again after a dial to
	// grow it failed (growRetryAfter).
	growAfter time.Time
}

// dialCall is one dial of a new session, shared by the dials waiting on it.
type dialCall struct {
	done chan struct{} // closed when err is set
	err  error
}

// wait waits until the dial is done and returns its error, or nil if it
// succeeded or failed only for its own context (the waiter dials again),
// or ctx's error if ctx ends first.
func (c *dialCall) wait(ctx context.Context) error {
	select {
	case <-c.done:
	case <-ctx.Done():
		return ctx.Err()
	}
	if errors.Is(c.err, context.Canceled) || errors.Is(c.err, context.DeadlineExceeded) {
		return nil
	}
	return c.err
}

// leastLoaded drops the sessions that ended, sets those draining for a hot
// restart aside, and returns the one with the fewest streams of the others
// (opening counts the streams being opened) and that number, or nil when
// none is left.
func (p *sessionPool) leastLoaded(opening map[*session.Session]int) (*session.Session, int) {
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
		if n := s.NumStreams() + opening[s]; best == nil || n < load {
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

// DialContext opens a stream to network ("unix", "tcp" or "quic") and
// address. On "quic" (docs/protocol.md section 17) it opens a QUIC stream
// on the Dialer's one QUIC connection to address, dialed with TLSConfig
// at the first dial and again once it ended; the server's Accept returns
// the stream at once (a 1-byte preamble announces it). Otherwise it
// opens the stream on
// one of the Dialer's sessions, dialing and handshaking a new session when
// the pool calls for one (see Dialer, docs/protocol.md section 18).
// Concurrent dials share one handshake. A shmlink server's Accept returns
// the stream before any byte is written (it is announced,
// docs/protocol.md section 11); other servers see it at its first byte.
// network is "unix", "tcp", "tcp4", "tcp6" or "quic"; each network and
// address string has a pool of its own. It returns an error wrapping
// ErrNetwork (errors.Is) for other networks, a *ConfigError for a bad field, an error
// satisfying errors.Is(err, net.ErrClosed) after Close, an error wrapping
// ctx.Err() when ctx is done first (also in the middle of a handshake,
// which it then ends), and the dial or handshake error; a failed
// handshake, on "quic" too, wraps ErrHandshake. Opening the stream on a
// session can fail with ErrQueueFull (the server left the IO queue full
// for Config.QueueFullTimeout). A session that turned out to be draining
// for a hot upgrade is passed over for another, and so is one that ended or
// whose stream ids ran out (session.ErrStreamIDs; it is set aside and ends
// after its last stream): the 8th draining session, or the 3rd of the
// others, ends the dial with its session.ErrDraining or error. On
// "quic", when every connection dialed was draining, it returns
// ErrStreamRefused, and a dial that finds the server's limit of streams
// on the connection reached (its QUICConfig.MaxIncomingStreams: streams
// its application has not accepted or closed) waits for one of them to
// end, for Config.QueueFullTimeout at most (5 s when zero), and then
// returns an error wrapping ErrQueueFull. A dial that waits for another's
// handshake dials again if that one ended for its own context.
func (d *Dialer) DialContext(ctx context.Context, network, address string) (net.Conn, error) {
	if network == "quic" {
		return d.dialQUIC(ctx, address)
	}
	st, err := d.DialStream(ctx, network, address)
	if err != nil {
		return nil, err // an untyped nil
	}
	return st, nil
}

// DialStream is DialContext returning the *Stream, whose zero-copy calls
// (Reserve, Peek, ReadBytes, ReadChunk) then need no type assertion. It
// returns the errors DialContext returns, and on "quic", whose streams are
// not shmlink streams, a *net.OpError wrapping ErrNoSharedMemory.
func (d *Dialer) DialStream(ctx context.Context, network, address string) (*Stream, error) {
	if err := checkNetwork(network); err != nil {
		return nil, err
	}
	if network == "quic" {
		return nil, &net.OpError{Op: "dial", Net: network, Err: ErrNoSharedMemory}
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
		st, err = s.OpenStream(ctx)
		d.opened(s)
		if err == nil {
			return st, nil
		}
		switch {
		case ctx.Err() != nil:
			return nil, err
		case errors.Is(err, session.ErrDraining):
			// The server handed over to a new process since the session
			// was picked: pick again, which dials the new process.
			draining++
		case errors.Is(err, session.ErrStreamIDs):
			// The session has used up its stream ids (a server that never
			// answers closes, so that no id comes back): set it aside and
			// pick again, which dials a new session.
			d.retireSpent(key, s)
			ended++
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
// the pool has none or all its sessions are loaded and it may grow
// (docs/protocol.md section 18, "Picking a session"). The
// session counts as opening a stream (Dialer.opening) until the caller
// calls opened.
func (d *Dialer) pick(ctx context.Context, key, network, address string) (*session.Session, error) {
	maxSessions := cmp.Or(d.MaxSessions, defaultMaxSessions)
	perSession := cmp.Or(d.StreamsPerSession, defaultStreamsPerSession)
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
		best, load := p.leastLoaded(d.opening)
		if best != nil && (load < perSession || len(p.sessions) >= maxSessions) {
			return d.openingLocked(best), nil
		}
		if call := p.dial; call != nil {
			if best != nil && load < dialingLoadFactor*perSession {
				return d.openingLocked(best), nil
			}
			// No session yet, or the least loaded one is full enough
			// while another is dialed: wait for that dial.
			onWait := d.onWait
			d.mu.Unlock()
			if onWait != nil {
				onWait()
			}
			err := call.wait(ctx)
			switch {
			case err == nil:
				continue // it succeeded, or failed for its own context
			case best != nil && ctx.Err() == nil:
				d.mu.Lock()
				return d.openingLocked(best), nil // the pool could not grow: keep to what it has
			}
			return nil, err
		}
		if best != nil && time.Now().Before(p.growAfter) {
			return d.openingLocked(best), nil // the last dial to grow the pool failed just now
		}
		call := &dialCall{done: make(chan struct{})}
		p.dial = call
		cfg := withEpoch(d.Config, p.epoch)
		dial := d.dialSession
		if dial == nil {
			dial = dialSession
		}
		d.mu.Unlock()

		s, err := dial(ctx, cfg, network, address)
		d.mu.Lock()
		p.dial = nil
		switch {
		case err != nil:
		case d.closed:
			err = errDialerClosed
		default:
			s.SetIdleTimeout(cmp.Or(d.IdleTimeout, defaultIdleTimeout))
			p.sessions = append(p.sessions, s)
			d.track(s)
		}
		growFailed := best != nil && err != nil && !d.closed && ctx.Err() == nil
		if growFailed {
			p.growAfter = time.Now().Add(d.growRetryDelay())
		}
		if len(p.sessions) == 0 && len(p.draining) == 0 && d.pools[key] == p {
			delete(d.pools, key)
		}
		call.err = err
		if err == nil {
			d.addOpening(s) // before the waiters see s
		} else if growFailed {
			d.addOpening(best)
		}
		d.mu.Unlock()
		close(call.done)
		if err != nil {
			if s != nil {
				s.Close()
			}
			if growFailed {
				d.logGrowFailed(network, address, err)
				return best, nil
			}
			return nil, err
		}
		return s, nil
	}
}

// openingLocked counts a stream being opened on s (addOpening), unlocks
// d.mu and returns s. The caller holds d.mu.
func (d *Dialer) openingLocked(s *session.Session) *session.Session {
	d.addOpening(s)
	d.mu.Unlock()
	return s
}

// addOpening counts a stream being opened on s. The caller holds d.mu.
func (d *Dialer) addOpening(s *session.Session) {
	if d.opening == nil {
		d.opening = make(map[*session.Session]int)
	}
	d.opening[s]++
}

// opened ends the count pick started for a stream opened on s, or that
// failed to open.
func (d *Dialer) opened(s *session.Session) {
	d.mu.Lock()
	if d.opening[s]--; d.opening[s] <= 0 {
		delete(d.opening, s)
	}
	d.mu.Unlock()
}

// logGrowFailed logs, to Config.Logger, a failed dial of a session that
// would have grown a pool that has sessions already.
func (d *Dialer) logGrowFailed(network, address string, err error) {
	if d.Config == nil || d.Config.Logger == nil {
		return
	}
	d.Config.Logger.Warn("shmlink: dialer: could not add a session; streams stay on the sessions it has",
		"network", network, "address", address, "retry_after", d.growRetryDelay(), "err", err)
}

// growRetryDelay is how long after a failed dial to grow a pool the pool
// tries again: growRetryAfter, or the tests' growRetry.
func (d *Dialer) growRetryDelay() time.Duration {
	return cmp.Or(d.growRetry, growRetryAfter)
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
	d.closeQUIC()
	return nil
}

// track counts s in the Dialer's Stats until it ends, and its final
// counters after. The caller holds d.mu.
func (d *Dialer) track(s *session.Session) {
	if d.live == nil {
		d.live = make(map[*session.Session]struct{})
	}
	d.live[s] = struct{}{}
	go func() {
		<-s.Done()
		d.mu.Lock()
		delete(d.live, s)
		addEnded(&d.ended, s.Stats())
		d.mu.Unlock()
	}()
}

// Stats returns the counters of every session the Dialer dialed, live and
// ended, summed over all addresses; ActiveStreams counts the streams of
// the live ones, and SlicesInUse is nil (each session has a region of its
// own). On "quic" only BytesSent, BytesReceived (without the preamble),
// StreamsRefused and ActiveStreams count.
func (d *Dialer) Stats() Stats {
	d.mu.Lock()
	defer d.mu.Unlock()
	t := sumStats(d.ended, d.live)
	if q := d.quic; q != nil {
		sumQUICStats(&t, q.ended, q.live)
	}
	return t
}

// NumSessions returns the number of live sessions the Dialer holds, over
// all addresses. On "quic" it counts QUIC connections, a draining one
// until it ends.
func (d *Dialer) NumSessions() int {
	d.mu.Lock()
	defer d.mu.Unlock()
	n := 0
	for key, p := range d.pools {
		p.leastLoaded(d.opening)
		if len(p.sessions) == 0 && len(p.draining) == 0 && p.dial == nil {
			delete(d.pools, key)
		}
		n += len(p.sessions) + len(p.draining)
	}
	if d.quic != nil {
		n += len(d.quic.live)
	}
	return n
}

// withEpoch returns cfg with Epoch set to epoch, copying it if needed.
func withEpoch(cfg *Config, epoch uint64) *Config {
	if epoch == 0 {
		return cfg
	}
	var c Config
	if cfg != nil {
		c = *cfg
	}
	c.Epoch = epoch
	return &c
}

// retireDraining sets s aside in p.draining if its server announced a hot
// restart, and reports whether it did: no new stream goes to s.
func (p *sessionPool) retireDraining(s *session.Session) bool {
	epoch, ok := s.HotRestartEpoch()
	if !ok {
		return false
	}
	p.epoch = max(p.epoch, epoch)
	p.draining = append(p.draining, s)
	return true
}

// retireSpent sets s, a session of key's pool whose stream ids are
// exhausted, aside with the draining sessions: no new stream goes to it,
// it no longer counts against MaxSessions, and it ends once its last
// stream is done (Session.CloseWhenIdle), or at Close.
func (d *Dialer) retireSpent(key string, s *session.Session) {
	d.mu.Lock()
	if p := d.pools[key]; p != nil {
		if i := slices.Index(p.sessions, s); i >= 0 {
			p.sessions = slices.Delete(p.sessions, i, i+1)
			p.draining = append(p.draining, s)
		}
	}
	d.mu.Unlock()
	s.CloseWhenIdle()
}

// pruneDraining forgets the draining sessions that have ended.
func (p *sessionPool) pruneDraining() {
	live := p.draining[:0]
	for _, s := range p.draining {
		if s.Err() == nil {
			live = append(live, s)
		}
	}
	clear(p.draining[len(live):])
	p.draining = live
}
