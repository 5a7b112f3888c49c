package shmlink

import (
	"net"
	"syscall"
)

// forceUDPBuffers asks for quicUDPBuffer bytes of socket buffers past the
// kernel's caps (net.core.rmem_max, wmem_max), which a process with
// CAP_NET_ADMIN may do, as quic-go does; elsewhere it fails silently.
func forceUDPBuffers(c *net.UDPConn) {
	raw, err := c.SyscallConn()
	if err != nil {
		return
	}
	raw.Control(func(fd uintptr) {
		syscall.SetsockoptInt(int(fd), syscall.SOL_SOCKET, syscall.SO_RCVBUFFORCE, quicUDPBuffer)
		syscall.SetsockoptInt(int(fd), syscall.SOL_SOCKET, syscall.SO_SNDBUFFORCE, quicUDPBuffer)
	})
}
