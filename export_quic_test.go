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
