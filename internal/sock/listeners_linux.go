//go:build linux

package sock

import (
	"fmt"
	"net"
	"os"
	"syscall"

	"github.com/shmlink/shmlink/internal/shm"
	"golang.org/x/sys/unix"
)

// SendListeners sends the descriptors of lns over c in one sendmsg: one
// data byte 0x00 and one SCM_RIGHTS control message listing them in order.
// The listeners stay open and owned by the caller; the receiver gets its
// own descriptors of the same sockets. It returns an error for a listener
// without a descriptor (not a syscall.Conn), and the sendmsg error.
func SendListeners(c *net.UnixConn, lns ...net.Listener) error {
	fds := make([]int, 0, len(lns))
	// Each descriptor is only valid inside its listener's Control callback,
	// so the callbacks nest and the message goes out from the innermost.
	var send func(i int) error
	send = func(i int) error {
		if i == len(lns) {
			_, _, err := c.WriteMsgUnix([]byte{0}, unix.UnixRights(fds...), nil)
			return err
		}
		sc, ok := lns[i].(syscall.Conn)
		if !ok {
			return fmt.Errorf("sock: a %T has no descriptor to send", lns[i])
		}
		rc, err := sc.SyscallConn()
		if err != nil {
			return err
		}
		var serr error
		if err := rc.Control(func(fd uintptr) {
			fds = append(fds, int(fd))
			serr = send(i + 1)
		}); err != nil {
			return err
		}
		return serr
	}
	return send(0)
}

// RecvListeners receives one message of at least one data byte carrying
// exactly n descriptors of listening sockets over c, as SendListeners
// sends it, and returns them as listeners in the order sent; a datagram
// socket comes as a PacketListener. The caller
// owns the listeners and must Close them; the received descriptors are
// closed (net.FileListener keeps its own). A message with another number
// of descriptors, or several control messages, gets ErrBadRights; a
// stream socket that is not listening (SO_ACCEPTCONN is 0: a connected
// one, say) gets ErrNotListening, and a descriptor that is no socket
// net.FileListener's error, both wrapped with the descriptor's index. On
// any error, everything received is closed.
func RecvListeners(c *net.UnixConn, n int) ([]net.Listener, error) {
	fds, err := shm.RecvFds(c, n)
	if err != nil {
		return nil, err
	}
	lns := make([]net.Listener, 0, n)
	for i, fd := range fds {
		f := os.NewFile(uintptr(fd), fmt.Sprintf("listener %d", i))
		var ln net.Listener
		var err error
		switch typ, terr := unix.GetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_TYPE); {
		case terr == nil && typ == unix.SOCK_DGRAM:
			var pc net.PacketConn
			if pc, err = net.FilePacketConn(f); err == nil {
				ln = PacketListener{pc}
			}
		case terr == nil && !listening(fd):
			// net.FileListener takes a connected socket too, whose
			// Accept then fails with EINVAL for ever.
			err = ErrNotListening
		default:
			ln, err = net.FileListener(f)
		}
		f.Close()
		if err != nil {
			for _, fd := range fds[i+1:] {
				unix.Close(fd)
			}
			for _, ln := range lns {
				ln.Close()
			}
			return nil, fmt.Errorf("sock: descriptor %d received: %w", i, err)
		}
		lns = append(lns, ln)
	}
	return lns, nil
}

// listening reports whether the socket fd is in the listening state
// (SO_ACCEPTCONN).
func listening(fd int) bool {
	v, err := unix.GetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_ACCEPTCONN)
	return err == nil && v == 1
}
