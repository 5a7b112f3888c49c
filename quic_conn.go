package shmlink

import (
	"sync"
	"sync/atomic"
	"time"

	"github.com/quic-go/quic-go"
)

// quicConn is one QUIC connection of a listener or a Dialer, with the
// counters of its streams for Stats.
type quicConn struct {
	conn                 *quic.Conn
	bytesSent, bytesRecv atomic.Uint64
	refused              atomic.Uint64
	mu                   sync.Mutex
	streams              int  // open streams (not yet Closed)
	closeIdle            bool // close the connection with its last stream
	idleTimeout          time.Duration
	idleTimer            *time.Timer
}

// stats returns the connection's counters as Stats; the shared-memory
// counters stay zero.
func (qc *quicConn) stats() Stats {
	qc.mu.Lock()
	active := qc.streams
	qc.mu.Unlock()
	return Stats{
		BytesSent:      qc.bytesSent.Load(),
		BytesReceived:  qc.bytesRecv.Load(),
		StreamsRefused: qc.refused.Load(),
		ActiveStreams:  active,
	}
}

// tryOpen counts a new stream, unless the connection is to end with its
// last stream (closeWhenIdle): then it reports false, and the stream must
// not be used.
func (qc *quicConn) tryOpen() bool {
	qc.mu.Lock()
	defer qc.mu.Unlock()
	if qc.closeIdle {
		return false
	}
	qc.streams++
	if qc.idleTimer != nil {
		qc.idleTimer.Stop()
	}
	return true
}

// takesStreams reports whether the connection takes new streams: false
// once it is to end with its last stream (closeWhenIdle, idleExpired).
func (qc *quicConn) takesStreams() bool {
	qc.mu.Lock()
	defer qc.mu.Unlock()
	return !qc.closeIdle
}

// closed counts the end of a stream: the connection closes with its last
// stream once closeWhenIdle was called, or after idleTimeout if set.
func (qc *quicConn) closed() {
	qc.mu.Lock()
	defer qc.mu.Unlock()
	qc.streams--
	if qc.streams == 0 && qc.closeIdle {
		go qc.conn.CloseWithError(quicCodeClosed, "")
		return
	}
	qc.armIdleLocked()
}

// armIdle starts the idle timer if the connection has no stream.
func (qc *quicConn) armIdle() {
	qc.mu.Lock()
	defer qc.mu.Unlock()
	qc.armIdleLocked()
}

// armIdleLocked is armIdle with qc.mu held.
func (qc *quicConn) armIdleLocked() {
	if qc.streams > 0 || qc.idleTimeout <= 0 {
		return
	}
	if qc.idleTimer == nil {
		qc.idleTimer = time.AfterFunc(qc.idleTimeout, qc.idleExpired)
	} else {
		qc.idleTimer.Reset(qc.idleTimeout)
	}
}

// idleExpired closes the connection if it still has no stream; a dial
// that picked it meanwhile finds it closing (tryOpen) and picks again,
// which dials anew (Dialer.quicConnTo skips it).
func (qc *quicConn) idleExpired() {
	qc.mu.Lock()
	idle := qc.streams == 0
	if idle {
		qc.closeIdle = true
	}
	qc.mu.Unlock()
	if idle {
		qc.conn.CloseWithError(quicCodeClosed, "idle")
	}
}

// closeWhenIdle closes the connection now if it has no stream, else with
// its last one.
func (qc *quicConn) closeWhenIdle() {
	qc.mu.Lock()
	qc.closeIdle = true
	idle := qc.streams == 0
	qc.mu.Unlock()
	if idle {
		qc.conn.CloseWithError(quicCodeClosed, "")
	}
}
