package shmlink

import (
	"encoding/binary"
	"io"
	"sync"
	"sync/atomic"
	"time"

	"github.com/quic-go/quic-go"
)

// The life of a QUIC connection (docs/protocol.md section 17, Ending a
// connection). QUIC has no graceful close: CONNECTION_CLOSE discards what
// is still queued or in flight on every stream, the data and FIN of a
// stream just closed included. So the side that ends a connection with
// its last stream does not close it: it tells the peer that all its
// streams are closed (quicCtlDone, with the number of streams it opened),
// and the peer closes the connection once its own streams are closed and
// every stream of the first side's has arrived, that is once it has read
// what it wanted of them. The first side lingers meanwhile, for the
// connection's idle timeout at most, then closes the connection itself: a
// peer that stops reading, or that is not a shmlink peer, keeps it no
// longer.
//
// Goroutines: a listener runs acceptLoop, and per connection one serve,
// one goroutine per stream until Accept takes it (Config.AcceptBacklog at
// most across the listener; quicListener.reserve), and one readQUICCtl; a
// Dialer runs one trackQUIC per connection, which runs readQUICCtl. A
// connection's idle and linger timers call step from their own goroutines
// (time.AfterFunc).
//
// Locks: quicConn.mu guards the connection's state and counts. It is taken
// after Dialer.mu or quicListener.mu, never before, and is not held across
// a call into quic-go that may wait (CloseWithError, opening a stream).

// quicConnState is where a connection is in its life; step changes it.
type quicConnState uint8

const (
	// quicOpen: the connection takes new streams.
	quicOpen quicConnState = iota
	// quicDraining: it takes no new stream of this side's (the Dialer's),
	// and ends once its last stream is closed: Listener.Close, a hot
	// restart, the Dialer's idle timeout, or the peer's quicCtlDone.
	quicDraining
	// quicLingering: this side's streams are all closed and the peer was
	// told (quicCtlDone): it closes the connection, or this side does when
	// the linger ends.
	quicLingering
	// quicClosed: the connection was closed, or ended.
	quicClosed
)

// quicEvent is what happened to a connection, for step.
type quicEvent uint8

const (
	quicStreamOpened  quicEvent = iota // this side (a Dialer) opened a stream, which tryOpen counted
	quicStreamArrived                  // a stream of the peer's arrived and is served (a listener)
	quicStreamRefused                  // a stream of the peer's arrived and was refused
	quicStreamClosed                   // a stream counted in streams was closed or refused
	quicDrain                          // end the connection with its last stream (closeWhenIdle)
	quicIdle                           // the idle timer fired
	quicPeerDone                       // the peer closed all its streams (quicCtlDone)
	quicLingerEnd                      // the linger timer fired
	quicEnded                          // the connection ended
)

// quicCtlDone is the type of the message that a connection's side sends,
// on a unidirectional stream, once it ends the connection and all its
// streams are closed: 1 byte type, 8 bytes the number of bidirectional
// streams it opened, big-endian (docs/protocol.md section 17).
const quicCtlDone = 0x02

// quicConn is one QUIC connection of a listener or a Dialer, with the
// counters of its streams for Stats.
type quicConn struct {
	conn                 *quic.Conn
	bytesSent, bytesRecv atomic.Uint64
	refused              atomic.Uint64
	idleTimeout          time.Duration // a Dialer's connection: closed after this long without a stream; 0 never
	linger               time.Duration // the most a lingering connection waits for the peer to close it

	mu         sync.Mutex
	state      quicConnState
	streams    int    // streams counted until closed: opened (tryOpen) or arrived and served
	opened     uint64 // bidirectional streams this side opened
	arrived    uint64 // bidirectional streams of the peer's that arrived
	peerDone   bool   // the peer closed all its streams (quicCtlDone) ...
	peerOpened uint64 // ... after opening this many
	idleTimer  *time.Timer
	lingerEnd  *time.Timer
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

// tryOpen counts a stream that this side is about to open, unless the
// connection takes no new stream: then it reports false, and the stream
// must not be opened. The caller reports the stream opened
// (quicStreamOpened), or closed if opening failed.
func (qc *quicConn) tryOpen() bool {
	qc.mu.Lock()
	defer qc.mu.Unlock()
	if qc.state != quicOpen {
		return false
	}
	qc.streams++
	if qc.idleTimer != nil {
		qc.idleTimer.Stop()
	}
	return true
}

// takesStreams reports whether the connection takes new streams of this
// side's: false once it is to end with its last stream.
func (qc *quicConn) takesStreams() bool {
	qc.mu.Lock()
	defer qc.mu.Unlock()
	return qc.state == quicOpen
}

// closed counts the end of a stream counted in streams.
func (qc *quicConn) closed() { qc.step(quicStreamClosed, 0) }

// closeWhenIdle ends the connection with its last stream, or now if it
// has none: the peer is told, and the connection closes once it has
// read what it wanted (see the top of this file).
func (qc *quicConn) closeWhenIdle() { qc.step(quicDrain, 0) }

// armIdle starts the idle timer if the connection has no stream.
func (qc *quicConn) armIdle() {
	qc.mu.Lock()
	defer qc.mu.Unlock()
	if qc.state == quicOpen {
		qc.armIdleLocked()
	}
}

// armIdleLocked is armIdle with qc.mu held, on an open connection.
func (qc *quicConn) armIdleLocked() {
	if qc.streams > 0 || qc.idleTimeout <= 0 {
		return
	}
	if qc.idleTimer == nil {
		qc.idleTimer = time.AfterFunc(qc.idleTimeout, func() { qc.step(quicIdle, 0) })
	} else {
		qc.idleTimer.Reset(qc.idleTimeout)
	}
}

// step applies ev to the connection (n is the peer's count of opened
// streams for quicPeerDone) and then does what its new state calls for.
// It is the one place where the state changes.
func (qc *quicConn) step(ev quicEvent, n uint64) {
	qc.mu.Lock()
	switch ev {
	case quicStreamOpened:
		qc.opened++
	case quicStreamArrived:
		qc.arrived++
		qc.streams++
		if qc.state == quicLingering {
			// A stream that the peer opened before it was told: serve
			// it, and tell the peer again once it is closed.
			qc.state = quicDraining
			qc.lingerEnd.Stop()
		}
	case quicStreamRefused:
		qc.arrived++
	case quicStreamClosed:
		qc.streams--
	case quicDrain:
		qc.drainLocked()
	case quicIdle:
		if qc.streams == 0 { // else a stream was opened as the timer fired
			qc.drainLocked()
		}
	case quicPeerDone:
		qc.peerDone, qc.peerOpened = true, n
		qc.drainLocked()
	case quicLingerEnd:
		if qc.state != quicLingering {
			qc.mu.Unlock()
			return
		}
		qc.state = quicClosed
		qc.mu.Unlock()
		qc.conn.CloseWithError(quicCodeClosed, "")
		return
	case quicEnded:
		qc.state = quicClosed
		if qc.idleTimer != nil {
			qc.idleTimer.Stop()
		}
		if qc.lingerEnd != nil {
			qc.lingerEnd.Stop()
		}
	}
	act := qc.settleLocked()
	qc.mu.Unlock()
	if act != nil {
		act()
	}
}

// drainLocked makes an open connection take no new stream.
func (qc *quicConn) drainLocked() {
	if qc.state != quicOpen {
		return
	}
	qc.state = quicDraining
	if qc.idleTimer != nil {
		qc.idleTimer.Stop()
	}
}

// settleLocked moves a connection without streams on, with qc.mu held,
// and returns what to do once it is released (nil: nothing):
//   - once the peer has closed all its streams and all of them arrived,
//     nothing that either side still reads is in flight: close now;
//   - a draining connection lingers, and tells the peer that all its
//     streams are closed (sendDone), unless the peer said so first: then
//     some of the peer's streams are still on their way, and the peer
//     would close the connection under them;
//   - an open one arms its idle timer.
func (qc *quicConn) settleLocked() func() {
	if qc.streams > 0 || qc.state == quicClosed {
		return nil
	}
	switch {
	case qc.peerDone && qc.arrived >= qc.peerOpened:
		qc.state = quicClosed
		if qc.lingerEnd != nil {
			qc.lingerEnd.Stop()
		}
		return func() { qc.conn.CloseWithError(quicCodeClosed, "") }
	case qc.state == quicDraining:
		qc.state = quicLingering
		if qc.lingerEnd == nil {
			qc.lingerEnd = time.AfterFunc(qc.linger, func() { qc.step(quicLingerEnd, 0) })
		} else {
			qc.lingerEnd.Reset(qc.linger)
		}
		if qc.peerDone {
			return nil
		}
		opened := qc.opened
		return func() { qc.sendDone(opened) }
	case qc.state == quicOpen:
		qc.armIdleLocked()
	}
	return nil
}

// sendDone tells the peer that this side's streams are all closed after
// it opened opened of them (quicCtlDone), on a unidirectional stream. It
// does not wait: a message that quic-go cannot queue at once (the peer's
// connection-level window is full: it is not reading) is not sent, and
// the linger's end closes the connection.
func (qc *quicConn) sendDone(opened uint64) {
	s, err := qc.conn.OpenUniStream()
	if err != nil {
		return // the connection ended, or the peer takes no more
	}
	var msg [9]byte
	msg[0] = quicCtlDone
	binary.BigEndian.PutUint64(msg[1:], opened)
	if err := s.TryWriteAll(msg[:]); err != nil {
		s.CancelWrite(quicCodeClosed)
		return
	}
	s.Close()
}

// readQUICCtl reads the messages that the peer sends on unidirectional
// streams, one per stream (docs/protocol.md section 17), until the
// connection ends, which it then reports (quicEnded). quicCtlDone moves
// the connection on; quicCtlHotRestart calls onHotRestart with the new
// epoch, if not nil (a server ignores it). Messages of other types, or
// that do not arrive within defaultQUICPreambleTimeout, are ignored: a
// later version may send more.
func readQUICCtl(qc *quicConn, onHotRestart func(epoch uint64)) {
	defer qc.step(quicEnded, 0)
	ctx := qc.conn.Context()
	for {
		s, err := qc.conn.AcceptUniStream(ctx)
		if err != nil {
			return // the connection ended
		}
		var msg [9]byte
		s.SetReadDeadline(time.Now().Add(defaultQUICPreambleTimeout))
		_, err = io.ReadFull(s, msg[:])
		s.CancelRead(quicCodeClosed)
		if err != nil {
			continue
		}
		switch msg[0] {
		case quicCtlDone:
			qc.step(quicPeerDone, binary.BigEndian.Uint64(msg[1:]))
		case quicCtlHotRestart:
			if onHotRestart != nil {
				onHotRestart(binary.BigEndian.Uint64(msg[1:]))
			}
		}
	}
}
