package shmlink

import (
	"cmp"
	"context"
	"crypto/tls"
	"errors"
	"net"
	"sync"
	"sync/atomic"
	"time"

	"github.com/quic-go/quic-go"
	"github.com/shmlink/shmlink/internal/sock"
	"github.com/shmlink/shmlink/internal/upgrade"
)

// quicListener is a Listener's side on the "quic" network: one UDP socket,
// a quic-go Transport on it, and the connections it accepted, each with
// the streams their peers open (docs/protocol.md section 17).
type quicListener struct {
	udp *net.UDPConn
	rc  *routedConn // the Transport's socket when upgradable, else nil
	tr  *quic.Transport
	ln  *quic.Listener
	cfg Config
	up  *upgrade.Upgrader // hot upgrade; nil without ListenConfig.UpgradeSocket
	// linger is the most a connection that ends with its last stream
	// waits for its client to close it: the idle timeout (quic_conn.go).
	linger time.Duration

	accepts chan *quicStream
	// backlog is the most streams the listener holds that Accept has not
	// returned (Config.AcceptBacklog); pending counts them: those waiting
	// for their preamble, each in a goroutine of its own, and those waiting
	// for Accept. A stream beyond it is refused (serve).
	backlog int64
	pending atomic.Int64
	ctx     context.Context // done once the listener stops accepting
	stop    context.CancelFunc
	// closeHook, nil outside tests, runs in close between stopping the
	// listener and closing quic-go's, where tests hold it
	// (export_quic_test.go).
	closeHook func()
	// wg counts acceptLoop and one serve per connection. On a closed
	// listener the last of them closes the socket before it is done, so
	// that wg.Wait returning means the port is free (exit).
	wg       sync.WaitGroup
	sockOnce sync.Once
	sockErr  error // of closing the socket; set in sockOnce

	mu       sync.Mutex
	conns    map[*quicConn]struct{}
	running  int   // the goroutines wg counts
	ended    Stats // the counters of the connections that ended
	closed   bool
	err      error  // why Accept fails, if not Close
	handedTo uint64 // the new process's epoch once handed over, else 0
	upgraded bool   // handed over and drained: Accept fails with ErrUpgraded
}

// listenQUIC listens for QUIC connections at address (host:port, UDP) with
// the listener's TLS and QUIC configs; with an UpgradeSocket it takes the
// UDP socket over from the process that owns it, or listens afresh.
func (lc *ListenConfig) listenQUIC(ctx context.Context, address string, cfg Config) (*Listener, error) {
	tlsConf, err := quicTLS(lc.TLSConfig, true)
	if err != nil {
		return nil, err
	}
	cfg = withLogger(cfg)
	qcfg := quicConfig(lc.QUICConfig, cfg.HandshakeTimeout)
	// Everything that can fail without the socket fails here, before
	// TakeOver commits the running process to hand over: after that,
	// startQUICListener must not fail (docs/protocol.md section 17, Hot
	// upgrade).
	if err := checkQUICConfig(qcfg, "ListenConfig.QUICConfig", true); err != nil {
		return nil, err
	}
	quicClientConfigs(qcfg, cfg.HandshakeTimeout, cfg.Logger)
	if lc.UpgradeSocket == "" {
		udp, err := quicUDP(ctx, address, cfg.Logger)
		if err != nil {
			return nil, err
		}
		return startQUICListener(&quic.Transport{Conn: udp}, udp, nil, nil, tlsConf, qcfg, cfg)
	}
	if lc.DrainTimeout < 0 {
		return nil, &ConfigError{Field: "ListenConfig.DrainTimeout", Reason: "negative"}
	}
	ucfg := upgrade.Config{
		Path:         lc.UpgradeSocket,
		Network:      "quic",
		Address:      address,
		DrainTimeout: cmp.Or(lc.DrainTimeout, defaultDrainTimeout),
		Logger:       cfg.Logger,
		Extras:       1, // the socket to forward the draining generation's packets into
	}
	ln, up, err := upgrade.TakeOver(ctx, ucfg, nil)
	if errors.Is(err, upgrade.ErrNoOwner) {
		ln, up, err = upgrade.Listen(ucfg, func() (net.Listener, error) {
			udp, err := quicUDP(ctx, address, cfg.Logger)
			if err != nil {
				return nil, err
			}
			return sock.PacketListener{PacketConn: udp}, nil
		})
	}
	if err != nil {
		return nil, err
	}
	udp := ln.(sock.PacketListener).PacketConn.(*net.UDPConn)
	rc := &routedConn{udp: udp, tag: byte(up.Epoch())}
	for _, x := range up.Received() {
		if pl, ok := x.(sock.PacketListener); ok {
			if uc, ok := pl.PacketConn.(*net.UnixConn); ok && rc.fwdOut == nil {
				rc.fwdOut, rc.prevTag = uc, byte(up.Epoch()-1)
				continue
			}
		}
		x.Close()
	}
	tr := &quic.Transport{Conn: rc, ConnectionIDGenerator: cidGenerator{tag: rc.tag}}
	l, err := startQUICListener(tr, udp, rc, up, tlsConf, qcfg, cfg)
	if err != nil {
		up.Close()
		return nil, err
	}
	up.Start(quicHandover{l.q})
	return l, nil
}

// startQUICListener serves QUIC on tr, whose socket is udp (read through
// rc when upgradable), and returns the Listener.
func startQUICListener(tr *quic.Transport, udp *net.UDPConn, rc *routedConn, up *upgrade.Upgrader, tlsConf *tls.Config, qcfg *quic.Config, cfg Config) (*Listener, error) {
	ln, err := tr.Listen(tlsConf, qcfg)
	if err != nil {
		tr.Close()
		closeSockets(udp, rc)
		return nil, err
	}
	q := &quicListener{
		udp:     udp,
		rc:      rc,
		tr:      tr,
		ln:      ln,
		cfg:     cfg,
		up:      up,
		linger:  qcfg.MaxIdleTimeout,
		accepts: make(chan *quicStream),
		backlog: int64(cmp.Or(cfg.AcceptBacklog, defaultQUICAcceptBacklog)),
		conns:   make(map[*quicConn]struct{}),
	}
	q.ctx, q.stop = context.WithCancel(context.Background())
	q.running = 1
	q.wg.Add(1)
	go q.acceptLoop()
	return &Listener{q: q, up: up}, nil
}

// acceptLoop accepts connections until quic-go's listener is closed
// (close, HandOver) or fails. It does not stop at q.ctx: quic-go's Accept
// returns the connections still in its accept queue before it reports
// the close (ErrServerClosed), and those that complete their handshake
// while the listener closes get there too; a closed listener refuses each
// with quicCodeRefused, so that its client reads ErrStreamRefused instead
// of waiting on a connection that no one serves (docs/protocol.md section
// 17, The listener's socket).
func (q *quicListener) acceptLoop() {
	defer q.exit()
	for {
		conn, err := q.ln.Accept(context.Background())
		if err != nil {
			q.mu.Lock()
			if !q.closed && q.ctx.Err() == nil && q.handedTo == 0 { // else closed, or the new process accepts now
				q.err = err
				q.stop()
			}
			q.mu.Unlock()
			return
		}
		qc := &quicConn{conn: conn, linger: q.linger}
		q.mu.Lock()
		if q.closed {
			q.mu.Unlock()
			conn.CloseWithError(quicCodeRefused, "listener closed")
			continue
		}
		q.conns[qc] = struct{}{}
		q.running++
		q.wg.Add(1)
		epoch := q.handedTo
		q.mu.Unlock()
		if epoch != 0 {
			sendHotRestart(qc, epoch) // handed over meanwhile: its client must move too
		}
		go q.serve(qc)
	}
}

// serve hands the streams of qc to Accept until the connection ends, and
// reads the client's messages (readQUICCtl); once the listener is closed
// it refuses new streams, and the connection ends with its last stream.
// It refuses a stream at once, too, when the listener already holds
// q.backlog streams that Accept has not returned, of all its connections
// (docs/protocol.md section 17, Streams): so the goroutines and stream
// state that peers make the listener hold stay bounded.
func (q *quicListener) serve(qc *quicConn) {
	defer q.exit()
	defer func() {
		q.mu.Lock()
		delete(q.conns, qc)
		addEnded(&q.ended, qc.stats())
		q.mu.Unlock()
	}()
	ctx := qc.conn.Context()
	log := q.cfg.Logger
	log.Debug("shmlink: QUIC connection started", "client", false, "remote", qc.conn.RemoteAddr())
	defer func() {
		log.Debug("shmlink: QUIC connection ended", "remote", qc.conn.RemoteAddr(), "err", context.Cause(ctx))
	}()
	var streams sync.WaitGroup
	defer streams.Wait()
	streams.Go(func() { readQUICCtl(qc, nil) })
	for {
		s, err := qc.conn.AcceptStream(ctx)
		if err != nil {
			return // the connection ended
		}
		if q.ctx.Err() != nil || !q.reserve() {
			qc.refused.Add(1)
			s.CancelRead(quicCodeRefused)
			s.CancelWrite(quicCodeRefused)
			qc.step(quicStreamRefused, 0)
			continue
		}
		qc.step(quicStreamArrived, 0)
		streams.Add(1)
		go func() {
			defer streams.Done()
			defer q.pending.Add(-1) // returned by Accept, refused or reset
			st, err := acceptQUICStream(s, qc, cmp.Or(q.cfg.HandshakeTimeout, defaultQUICPreambleTimeout))
			if err != nil {
				log.Debug("shmlink: QUIC stream reset", "remote", qc.conn.RemoteAddr(), "stream", s.StreamID(), "err", err)
				return
			}
			select {
			case q.accepts <- st:
			case <-q.ctx.Done():
				st.refuse()
			case <-ctx.Done():
				st.Close()
			}
		}()
	}
}

// reserve counts a stream that Accept has not returned yet, unless the
// listener holds q.backlog of them: then it reports false, and the
// stream must be refused.
func (q *quicListener) reserve() bool {
	if q.pending.Add(1) > q.backlog {
		q.pending.Add(-1)
		return false
	}
	return true
}

// accept returns the next stream, or the listener's error once it stopped.
func (q *quicListener) accept(l *Listener) (net.Conn, error) {
	select {
	case <-q.ctx.Done():
	default:
		select {
		case st := <-q.accepts:
			return st, nil
		case <-q.ctx.Done():
		}
	}
	q.mu.Lock()
	defer q.mu.Unlock()
	switch {
	case q.upgraded:
		return nil, l.closedError("accept", ErrUpgraded)
	case q.err != nil && !q.closed:
		return nil, l.closedError("accept", q.err)
	}
	return nil, l.closedError("accept", net.ErrClosed)
}

// exit ends one of the goroutines that wg counts; the last one of a
// closed listener closes the socket first.
func (q *quicListener) exit() {
	q.mu.Lock()
	q.running--
	last := q.running == 0 && q.closed
	q.mu.Unlock()
	if last {
		q.closeSocket()
	}
	q.wg.Done()
}

// closeSocket closes the Transport and the UDP socket (and the
// forwarding sockets of an upgrade), once, and keeps the error.
func (q *quicListener) closeSocket() {
	q.sockOnce.Do(func() {
		q.tr.Close() // which leaves the sockets it did not open to us
		q.sockErr = closeSockets(q.udp, q.rc)
	})
}

// close stops accepting connections and streams; each connection ends
// with its last stream, and one that acceptLoop had not taken yet is
// refused. The UDP socket stays open while a connection
// lives: with none, close returns once it closed the socket, and returns
// that error; otherwise the last connection to end closes it (exit).
// It returns net.ErrClosed when called again.
func (q *quicListener) close() error {
	q.mu.Lock()
	already := q.closed
	q.closed = true
	conns := q.liveLocked()
	idle := q.running == 0 // acceptLoop failed, and no connection is left
	q.mu.Unlock()
	if already {
		return net.ErrClosed
	}
	q.stop()
	if q.up != nil {
		q.up.Stop()
	}
	if q.closeHook != nil {
		q.closeHook()
	}
	// acceptLoop refuses what quic-go's accept queue still holds, and
	// returns once it is empty.
	err := q.ln.Close()
	if errors.Is(err, quic.ErrServerClosed) {
		err = nil
	}
	for _, qc := range conns {
		qc.closeWhenIdle()
	}
	if q.up != nil {
		q.up.Close() // removes the upgrade socket's file if this generation still owns it
	}
	if idle {
		q.closeSocket()
	}
	if len(conns) == 0 {
		// acceptLoop returns at once, as do the serve goroutines of the
		// connections that ended; the last of them closes the socket.
		q.wg.Wait()
		err = errors.Join(err, q.sockErr)
	}
	return err
}

// closeSockets closes a QUIC listener's sockets: udp, or all that rc
// reads and writes (the forwarding sockets of an upgrade too) if not nil.
func closeSockets(udp *net.UDPConn, rc *routedConn) error {
	if rc != nil {
		return rc.Close()
	}
	return udp.Close()
}

// liveLocked returns the live connections; the caller holds q.mu.
func (q *quicListener) liveLocked() []*quicConn {
	conns := make([]*quicConn, 0, len(q.conns))
	for qc := range q.conns {
		conns = append(conns, qc)
	}
	return conns
}

// closeConns ends every connection at once and returns how many. On a
// closed listener, the last serve goroutine then closes the socket, which
// CloseSessions waits for (wg).
func (q *quicListener) closeConns() int {
	q.mu.Lock()
	conns := q.liveLocked()
	q.mu.Unlock()
	for _, qc := range conns {
		qc.conn.CloseWithError(quicCodeClosed, "listener closed")
	}
	return len(conns)
}

// stats sums the counters of the live and ended connections.
func (q *quicListener) stats() Stats {
	q.mu.Lock()
	defer q.mu.Unlock()
	var t Stats
	sumQUICStats(&t, q.ended, q.conns)
	return t
}

// numConns returns the number of live connections.
func (q *quicListener) numConns() int {
	q.mu.Lock()
	defer q.mu.Unlock()
	return len(q.conns)
}

// sumQUICStats adds to t the counters of the connections that ended and
// of those in live.
func sumQUICStats(t *Stats, ended Stats, live map[*quicConn]struct{}) {
	addQUICStats(t, ended)
	for qc := range live {
		addQUICStats(t, qc.stats())
	}
}

// addQUICStats adds a QUIC connection's counters to t.
func addQUICStats(t *Stats, s Stats) {
	t.BytesSent += s.BytesSent
	t.BytesReceived += s.BytesReceived
	t.StreamsRefused += s.StreamsRefused
	t.ActiveStreams += s.ActiveStreams
}
