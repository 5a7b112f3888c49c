package shmlink

import (
	"context"
	"errors"
	"fmt"
	"net"
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
	// defaults. It is copied by Listen.
	Config *Config
}

// Listen listens on network ("unix" or "tcp") at address. Every client
// connection runs its handshake in its own goroutine, bounded by
// Config.HandshakeTimeout, so a slow or silent client never delays others;
// a failed handshake closes that connection and is logged to
// Config.Logger. It returns ErrNetwork for other networks, a *ConfigError
// for a bad Config, and net.Listen's errors.
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
	var nlc net.ListenConfig
	ln, err := nlc.Listen(ctx, network, address)
	if err != nil {
		return nil, err
	}
	l := &Listener{
		ln:       ln,
		cfg:      cfg,
		sessions: make(map[*session.Session]struct{}),
		accepts:  make(chan *Stream),
		done:     make(chan struct{}),
	}
	l.wg.Add(1)
	go l.acceptLoop()
	return l, nil
}

// Listener accepts streams from any number of client processes. It is a
// net.Listener; Accept returns *Stream values.
type Listener struct {
	ln  net.Listener
	cfg Config

	mu       sync.Mutex
	sessions map[*session.Session]struct{}
	err      error // why acceptLoop stopped, if not Close

	accepts   chan *Stream
	done      chan struct{} // closed when Accept must stop: Close, or a failed listener
	doneOnce  sync.Once
	closeOnce sync.Once
	wg        sync.WaitGroup
}

// stop closes done once.
func (l *Listener) stop() { l.doneOnce.Do(func() { close(l.done) }) }

// Addr returns the listener's network address.
func (l *Listener) Addr() net.Addr { return l.ln.Addr() }

// Accept waits for the next stream opened by any client and returns it. It
// returns an error satisfying errors.Is(err, net.ErrClosed) after Close,
// and the underlying listener's error if that failed.
func (l *Listener) Accept() (net.Conn, error) {
	select {
	case st := <-l.accepts:
		return st, nil
	case <-l.done:
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.err != nil {
		return nil, l.err
	}
	return nil, &net.OpError{Op: "accept", Net: l.ln.Addr().Network(), Addr: l.ln.Addr(), Err: net.ErrClosed}
}

// Close stops listening and closes every session the listener accepted,
// with all their streams; it waits for the listener's goroutines and
// returns the error of closing the socket.
func (l *Listener) Close() error {
	var err error
	l.closeOnce.Do(func() {
		l.stop()
		err = l.ln.Close()
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
	for {
		conn, err := l.ln.Accept()
		if err != nil {
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
		l.wg.Add(1)
		go l.serve(conn)
	}
}

// serve runs the handshake on conn and then hands the session's streams to
// Accept until the session ends or the listener closes.
func (l *Listener) serve(conn net.Conn) {
	defer l.wg.Done()
	s, err := session.Server(conn, &l.cfg)
	if err != nil {
		if l.cfg.Logger != nil {
			l.cfg.Logger.Info("shmlink: handshake failed", "remote", conn.RemoteAddr(), "err", err)
		}
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
	defer func() {
		l.mu.Lock()
		delete(l.sessions, s)
		l.mu.Unlock()
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

// Dialer opens streams to shmlink listeners and keeps one session per
// address, so that many Dial calls share one handshake and one buffer
// region. Its zero value is ready to use; Close it to end its sessions.
type Dialer struct {
	// Config is used for every session the Dialer creates; nil means the
	// defaults.
	Config *Config

	mu       sync.Mutex
	sessions map[string]*dialEntry
	closed   bool
}

// dialEntry is one address's session, or the dial in progress for it.
type dialEntry struct {
	ready chan struct{} // closed when s or err is set
	s     *session.Session
	err   error
}

// Dial opens a stream to address; see DialContext.
func (d *Dialer) Dial(network, address string) (net.Conn, error) {
	return d.DialContext(context.Background(), network, address)
}

// DialContext opens a stream on the Dialer's session to network/address,
// dialing and handshaking a new session first if there is none or the last
// one ended. Concurrent calls for one address share one dial. It returns
// ErrNetwork for networks other than "unix" and "tcp", net.ErrClosed after
// Close, ctx.Err() when ctx is done first, and the dial or handshake error.
func (d *Dialer) DialContext(ctx context.Context, network, address string) (net.Conn, error) {
	for attempt := 0; ; attempt++ {
		s, err := d.session(ctx, network, address)
		if err != nil {
			return nil, err
		}
		st, err := s.OpenStream(ctx)
		if err == nil {
			return st, nil
		}
		if attempt > 0 || s.Err() == nil {
			return nil, err
		}
		// The session died since it was dialed: drop it and dial afresh once.
		d.forget(network+" "+address, s)
	}
}

func (d *Dialer) session(ctx context.Context, network, address string) (*session.Session, error) {
	key := network + " " + address
	d.mu.Lock()
	if d.closed {
		d.mu.Unlock()
		return nil, fmt.Errorf("shmlink: dialer closed: %w", net.ErrClosed)
	}
	if d.sessions == nil {
		d.sessions = make(map[string]*dialEntry)
	}
	e := d.sessions[key]
	if e != nil {
		d.mu.Unlock()
		select {
		case <-e.ready:
		case <-ctx.Done():
			return nil, ctx.Err()
		}
		if e.err == nil && e.s.Err() == nil {
			return e.s, nil
		}
		d.mu.Lock()
		if d.sessions[key] == e {
			delete(d.sessions, key)
		}
		d.mu.Unlock()
		if e.err != nil {
			return nil, e.err
		}
		return d.session(ctx, network, address)
	}
	e = &dialEntry{ready: make(chan struct{})}
	d.sessions[key] = e
	d.mu.Unlock()

	e.s, e.err = dialSession(ctx, d.Config, network, address)
	close(e.ready)
	if e.err != nil {
		d.forget(key, nil)
		return nil, e.err
	}
	d.mu.Lock()
	closed := d.closed
	d.mu.Unlock()
	if closed {
		e.s.Close()
		return nil, fmt.Errorf("shmlink: dialer closed: %w", net.ErrClosed)
	}
	return e.s, nil
}

// forget drops the entry for key if it still holds s (or failed, s nil).
func (d *Dialer) forget(key string, s *session.Session) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if e := d.sessions[key]; e != nil && (e.s == s || e.err != nil) {
		delete(d.sessions, key)
		if s != nil {
			go s.Close()
		}
	}
}

// Close ends every session of the Dialer, with all their streams, and makes
// later dials fail with net.ErrClosed. It returns nil.
func (d *Dialer) Close() error {
	d.mu.Lock()
	d.closed = true
	entries := d.sessions
	d.sessions = nil
	d.mu.Unlock()
	for _, e := range entries {
		<-e.ready
		if e.s != nil {
			e.s.Close()
		}
	}
	return nil
}

// NumSessions returns the number of sessions the Dialer holds.
func (d *Dialer) NumSessions() int {
	d.mu.Lock()
	defer d.mu.Unlock()
	return len(d.sessions)
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
