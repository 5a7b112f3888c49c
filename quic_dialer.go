package shmlink

import (
	"cmp"
	"context"
	"errors"
	"log/slog"
	"net"
	"time"

	"github.com/quic-go/quic-go"
)

// quicDialer is a Dialer's side on the "quic" network: one UDP socket and
// quic-go Transport for all its connections, and one connection per
// address, opened at the first dial and again after it ended
// (docs/protocol.md section 17). Guarded by Dialer.mu.
type quicDialer struct {
	udp   *net.UDPConn
	tr    *quic.Transport
	conns map[string]*quicConn   // by address
	dials map[string]*dialCall   // dials in progress, by address
	live  map[*quicConn]struct{} // every connection until it ends
	ended Stats                  // the counters of the connections that ended
}

// dialQUIC opens a stream to address on the Dialer's QUIC connection to
// it, dialing one first if there is none or it ended.
func (d *Dialer) dialQUIC(ctx context.Context, address string) (net.Conn, error) {
	if err := d.validate(); err != nil {
		return nil, err
	}
	if err := checkQUICConfig(d.QUICConfig, "Dialer.QUICConfig", false); err != nil {
		return nil, err
	}
	wait := defaultQUICStreamWait
	if d.Config != nil && d.Config.QueueFullTimeout > 0 {
		wait = d.Config.QueueFullTimeout
	}
	var err error
	for ended, draining := 0, 0; ended < 3 && draining < maxDrainingPicks; {
		var qc *quicConn
		if qc, err = d.quicConnTo(ctx, address); err != nil {
			return nil, err
		}
		var st *quicStream
		if st, err = openQUICStream(ctx, qc, wait); err == nil {
			return st, nil
		}
		switch {
		case ctx.Err() != nil:
			return nil, err
		case errors.Is(err, errQUICDraining):
			// The connection takes no new stream since it was picked (its
			// idle timeout, a hot restart): pick again, which dials anew.
			draining++
		case qc.conn.Context().Err() != nil:
			// The connection ended since it was picked: pick again.
			ended++
		default:
			return nil, err
		}
	}
	if errors.Is(err, errQUICDraining) {
		// Every connection dialed was draining before its first stream:
		// the server takes no new stream.
		err = ErrStreamRefused
	}
	return nil, err
}

// quicConnTo returns the live connection to address that takes new
// streams, dialing one if there is none; concurrent dials to one address
// share one handshake. A connection that takes no new stream stays in
// q.live until it ends, and its successor replaces it in q.conns.
func (d *Dialer) quicConnTo(ctx context.Context, address string) (*quicConn, error) {
	tlsConf, err := quicTLS(d.TLSConfig, false)
	if err != nil {
		return nil, err
	}
	if tlsConf.ServerName == "" {
		if host, _, err := net.SplitHostPort(address); err == nil {
			tlsConf.ServerName = host
		}
	}
	for {
		d.mu.Lock()
		if d.closed {
			d.mu.Unlock()
			return nil, errDialerClosed
		}
		q, err := d.quicSide()
		if err != nil {
			d.mu.Unlock()
			return nil, err
		}
		if qc := q.conns[address]; qc != nil && qc.conn.Context().Err() == nil && qc.takesStreams() {
			d.mu.Unlock()
			return qc, nil
		}
		if call := q.dials[address]; call != nil {
			d.mu.Unlock()
			if err := call.wait(ctx); err != nil {
				return nil, err
			}
			continue
		}
		call := &dialCall{done: make(chan struct{})}
		q.dials[address] = call
		d.mu.Unlock()

		var conn *quic.Conn
		var handshake time.Duration
		if d.Config != nil {
			handshake = d.Config.HandshakeTimeout
		}
		qcfg := quicConfig(d.QUICConfig, handshake)
		// The name's lookup is the dial's too: ctx bounds it
		// (docs/protocol.md section 17, Connection).
		ua, err := resolveUDP(ctx, cmp.Or(d.resolver, net.DefaultResolver), address)
		if err == nil {
			if conn, err = q.tr.Dial(ctx, ua, tlsConf, qcfg); err != nil && ctx.Err() == nil {
				err = quicHandshakeErr(err)
			}
		}
		if err != nil && ctx.Err() != nil {
			// The context ended the lookup or the dial, or ended as they
			// failed for another reason: the dial's error is the
			// context's either way, as net.Dialer's is.
			err = ctx.Err()
		}
		var qc *quicConn
		d.mu.Lock()
		delete(q.dials, address)
		switch {
		case d.closed:
			if conn != nil {
				conn.CloseWithError(quicCodeClosed, "dialer closed")
			}
			err = errDialerClosed // the Close that failed the dial, if it did
		case err != nil:
		default:
			qc = &quicConn{
				conn:        conn,
				idleTimeout: cmp.Or(d.IdleTimeout, defaultIdleTimeout),
				linger:      qcfg.MaxIdleTimeout, // quic_conn.go
			}
			q.conns[address] = qc
			q.live[qc] = struct{}{}
			go d.trackQUIC(q, address, qc)
		}
		call.err = err
		d.mu.Unlock()
		close(call.done)
		if err != nil {
			return nil, err
		}
		qc.armIdle()
		return qc, nil
	}
}

// quicHandshakeErr is the error of a QUIC dial that failed for another
// reason than its context: a *SessionError wrapping ErrHandshake, as a
// failed handshake over shared memory, with quic-go's text and the TLS
// error, if any, but not quic-go's chain, which unwraps to net.ErrClosed
// (see quicErr).
func quicHandshakeErr(err error) error {
	return &SessionError{Op: "handshake", Err: &quicError{sentinel: ErrHandshake, cause: err}}
}

// logger returns the Config's Logger, or one that discards.
func (d *Dialer) logger() *slog.Logger {
	var cfg Config
	if d.Config != nil {
		cfg = *d.Config
	}
	return withLogger(cfg).Logger
}

// quicSide returns the Dialer's QUIC side, creating its socket at the
// first use. The caller holds d.mu.
func (d *Dialer) quicSide() (*quicDialer, error) {
	if d.quic != nil {
		return d.quic, nil
	}
	// Dual-stack, for IPv4 and IPv6 servers; ":0" needs no lookup.
	udp, err := quicUDP(context.Background(), ":0", d.logger())
	if err != nil {
		return nil, err
	}
	d.quic = &quicDialer{
		udp:   udp,
		tr:    &quic.Transport{Conn: udp},
		conns: make(map[string]*quicConn),
		dials: make(map[string]*dialCall),
		live:  make(map[*quicConn]struct{}),
	}
	return d.quic, nil
}

// trackQUIC forgets qc once its connection ended, keeping its counters.
// Meanwhile it reads the server's messages (readQUICCtl; docs/protocol.md
// section 17): on quicCtlHotRestart, new streams go to a new connection,
// and qc ends with its last stream.
func (d *Dialer) trackQUIC(q *quicDialer, address string, qc *quicConn) {
	log := d.logger()
	log.Debug("shmlink: QUIC connection started", "client", true, "remote", qc.conn.RemoteAddr())
	readQUICCtl(qc, func(epoch uint64) {
		log.Debug("shmlink: hot restart: draining", "remote", qc.conn.RemoteAddr(), "epoch", epoch)
		qc.closeWhenIdle() // quicConnTo dials anew for the next stream
	})
	log.Debug("shmlink: QUIC connection ended", "remote", qc.conn.RemoteAddr(), "err", context.Cause(qc.conn.Context()))
	d.mu.Lock()
	defer d.mu.Unlock()
	delete(q.live, qc)
	addEnded(&q.ended, qc.stats())
	if q.conns[address] == qc {
		delete(q.conns, address)
	}
}

// closeQUIC ends the Dialer's QUIC connections and closes its socket.
func (d *Dialer) closeQUIC() {
	d.mu.Lock()
	q := d.quic
	var conns []*quicConn
	if q != nil {
		for qc := range q.live {
			conns = append(conns, qc)
		}
	}
	d.mu.Unlock()
	if q == nil {
		return
	}
	for _, qc := range conns {
		// CONNECTION_CLOSE, so that the server ends the connection now,
		// not after its idle timeout.
		qc.conn.CloseWithError(quicCodeClosed, "dialer closed")
	}
	q.tr.Close() // closes what is left of the transport's connections
	q.udp.Close()
}
