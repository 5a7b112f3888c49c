package shmlink

import "net"

// SetQUICDeadlineHooks makes the QUIC stream c call onSet in its deadline
// setters after their check that c is not closing, and onClose in Close
// after it set the past write deadline that ends a blocked Write. Call it
// before using c from other goroutines.
func SetQUICDeadlineHooks(c net.Conn, onSet, onClose func()) {
	c.(*quicStream).hooks = &quicStreamHooks{setDeadline: onSet, closed: onClose}
}

// QUICIdleExpiring puts d's QUIC connection to address in the state that
// its idle timeout leaves it in before the connection is closed: it takes
// no new stream, and has not ended yet.
func QUICIdleExpiring(d *Dialer, address string) {
	d.mu.Lock()
	qc := d.quic.conns[address]
	d.mu.Unlock()
	qc.mu.Lock()
	qc.state = quicDraining
	qc.mu.Unlock()
}

// SetQUICCloseHook makes the QUIC listener l call hook in Close after it
// stopped accepting streams and before it closes quic-go's listener: a
// connection whose handshake completes meanwhile reaches quic-go's accept
// queue. Call it before Close.
func SetQUICCloseHook(l *Listener, hook func()) {
	l.q.closeHook = hook
}

// QUICErr is quicErr: quic-go's error of a stream or connection call
// (op: "read", "write", "open") in shmlink's vocabulary.
func QUICErr(op string, err error) error { return quicErr(op, err) }

// SetQUICResolver makes d look "quic" addresses up with r. Call it before
// d's first Dial.
func SetQUICResolver(d *Dialer, r *net.Resolver) {
	d.resolver = r
}

// QUICPendingStreams returns the number of streams that the QUIC listener
// l holds and Accept has not returned: those waiting for their preamble,
// each in a goroutine of its own, and those waiting for Accept.
func QUICPendingStreams(l *Listener) int { return int(l.q.pending.Load()) }
