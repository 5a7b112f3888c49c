package sock

import (
	"errors"
	"net"
	"syscall"
)

// errNotStream is PacketListener.Accept's error.
var errNotStream = errors.New("sock: a datagram socket accepts no connection")

// PacketListener carries a datagram socket (UDP, or a Unix datagram
// socket) where a net.Listener is expected: SendListeners sends its
// descriptor, and RecvListeners returns a received datagram socket as
// one. Accept always fails; Close closes the socket.
type PacketListener struct{ net.PacketConn }

// Accept returns an error: a datagram socket has no connections.
func (p PacketListener) Accept() (net.Conn, error) { return nil, errNotStream }

// Addr returns the socket's local address.
func (p PacketListener) Addr() net.Addr { return p.LocalAddr() }

// SyscallConn returns the socket's raw connection, for its descriptor; it
// fails if the PacketConn has none.
func (p PacketListener) SyscallConn() (syscall.RawConn, error) {
	sc, ok := p.PacketConn.(syscall.Conn)
	if !ok {
		return nil, errors.New("sock: the datagram socket has no descriptor")
	}
	return sc.SyscallConn()
}
