package shmlink

import (
	"cmp"
	"context"
	"errors"
	"net"
	"sync"

	"github.com/quic-go/quic-go"
)

// quicListener is a Listener's side on the "quic" network: one UDP socket,
// a quic-go Transport on it, and the connections it accepted, each with
// the streams their peers open (docs/protocol.md section 17).
type quicListener struct {
	udp *net.UDPConn
	tr  *quic.Transport
	ln  *quic.Listener
	cfg Config

	accepts chan *quicStream
	ctx     context.Context // done once the listener stops accepting
	stop    context.CancelFunc
	wg      sync.WaitGroup // acceptLoop and one serve per connection

	mu     sync.Mutex
	conns  map[*quicConn]struct{}
	ended  Stats // the counters of the connections that ended
	closed bool
	err    error // why Accept fails, if not Close
}

// listenQUIC listens for QUIC connections at address (host:port, UDP) with
// the listener's TLS and QUIC configs.
func (lc *ListenConfig) listenQUIC(address string, cfg Config) (*Listener, error) {
	if lc.UpgradeSocket != "" {
		return nil, &ConfigError{Field: "ListenConfig.UpgradeSocket", Reason: `not supported on the "quic" network yet`}
	}
	tlsConf, err := quicTLS(lc.TLSConfig, true)
	if err != nil {
		return nil, err
	}
	cfg = withLogger(cfg)
	udp, err := quicUDP(address, cfg.Logger)
	if err != nil {
		return nil, err
	}
	tr := &quic.Transport{Conn: udp}
	ln, err := tr.Listen(tlsConf, quicConfig(lc.QUICConfig))
	if err != nil {
		tr.Close()
		udp.Close()
		return nil, err
	}
	q := &quicListener{
		udp:     udp,
		tr:      tr,
		ln:      ln,
		cfg:     cfg,
		accepts: make(chan *quicStream),
		conns:   make(map[*quicConn]struct{}),
	}
	q.ctx, q.stop = context.WithCancel(context.Background())
	q.wg.Add(1)
	go q.acceptLoop()
	return &Listener{q: q}, nil
}

// acceptLoop accepts connections until the listener closes.
func (q *quicListener) acceptLoop() {
	defer q.wg.Done()
	for {
		conn, err := q.ln.Accept(q.ctx)
		if err != nil {
			q.mu.Lock()
			if q.ctx.Err() == nil {
				q.err = err
				q.stop()
			}
			q.mu.Unlock()
			return
		}
		qc := &quicConn{conn: conn}
		q.mu.Lock()
		if q.closed {
			q.mu.Unlock()
			conn.CloseWithError(quicCodeRefused, "listener closed")
			continue
		}
		q.conns[qc] = struct{}{}
		q.mu.Unlock()
		q.wg.Add(1)
		go q.serve(qc)
	}
}

// serve hands the streams of qc to Accept until the connection ends; once
// the listener is closed it refuses new ones, and the connection ends with
// its last stream.
func (q *quicListener) serve(qc *quicConn) {
	defer q.wg.Done()
	defer func() {
		q.mu.Lock()
		delete(q.conns, qc)
		addQUICStats(&q.ended, qc.stats())
		q.mu.Unlock()
	}()
	ctx := qc.conn.Context()
	var streams sync.WaitGroup
	defer streams.Wait()
	for {
		s, err := qc.conn.AcceptStream(ctx)
		if err != nil {
			return // the connection ended
		}
		if q.ctx.Err() != nil {
			qc.refused.Add(1)
			s.CancelRead(quicCodeRefused)
			s.CancelWrite(quicCodeRefused)
			continue
		}
		streams.Add(1)
		go func() {
			defer streams.Done()
			st := acceptQUICStream(s, qc, cmp.Or(q.cfg.HandshakeTimeout, defaultQUICPreambleTimeout))
			if st == nil {
				return
			}
			select {
			case q.accepts <- st:
			case <-q.ctx.Done():
				qc.refused.Add(1)
				st.Close()
			case <-ctx.Done():
				st.Close()
			}
		}()
	}
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
	if q.err != nil && !q.closed {
		return nil, l.closedError("accept", q.err)
	}
	return nil, l.closedError("accept", net.ErrClosed)
}

// close stops accepting connections and streams; each connection ends
// with its last stream. The UDP socket stays open until every connection
// has ended (wait).
func (q *quicListener) close() error {
	q.mu.Lock()
	already := q.closed
	q.closed = true
	conns := q.liveLocked()
	q.mu.Unlock()
	if already {
		return net.ErrClosed
	}
	q.stop()
	err := q.ln.Close()
	for _, qc := range conns {
		qc.closeWhenIdle()
	}
	go func() {
		q.wg.Wait()
		q.tr.Close()
		q.udp.Close()
	}()
	if errors.Is(err, quic.ErrServerClosed) {
		err = nil
	}
	return err
}

// liveLocked returns the live connections; the caller holds q.mu.
func (q *quicListener) liveLocked() []*quicConn {
	conns := make([]*quicConn, 0, len(q.conns))
	for qc := range q.conns {
		conns = append(conns, qc)
	}
	return conns
}

// closeConns ends every connection at once and returns how many.
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
	t := q.ended
	for qc := range q.conns {
		addQUICStats(&t, qc.stats())
	}
	return t
}

// numConns returns the number of live connections.
func (q *quicListener) numConns() int {
	q.mu.Lock()
	defer q.mu.Unlock()
	return len(q.conns)
}

// addQUICStats adds a QUIC connection's counters to t.
func addQUICStats(t *Stats, s Stats) {
	t.BytesSent += s.BytesSent
	t.BytesReceived += s.BytesReceived
	t.StreamsRefused += s.StreamsRefused
	t.ActiveStreams += s.ActiveStreams
}
