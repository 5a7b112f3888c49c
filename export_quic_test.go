package shmlink

import "net"

// SetQUICDeadlineHooks makes the QUIC stream c call onSet in its deadline
// setters after their check that c is not closing, and onClose in Close
// after it set the past write deadline that ends a blocked Write. Call it
// before using c from other goroutines.
func SetQUICDeadlineHooks(c net.Conn, onSet, onClose func()) {
	c.(*quicStream).hooks = &quicStreamHooks{setDeadline: onSet, closed: onClose}
}
