package sock

import (
	"encoding/binary"
	"fmt"
	"net"
	"os"

	"golang.org/x/sys/unix"
)

// Sizes of the inet_diag structures of linux/inet_diag.h and of a netlink
// message header: inet_diag_sockid is 48 bytes, inet_diag_req_v2 56, and
// inet_diag_msg carries idiag_uid at byte 64.
const (
	nlHeaderSize   = 16
	diagReqSize    = 56
	diagMsgUIDOff  = 64
	diagMsgMinSize = 72
)

// TCPPeerUID returns the uid of the process that owns the other end of a
// TCP connection on this host: local and remote are the connection's
// addresses as this end sees them. It asks the kernel's socket
// diagnostics (NETLINK_SOCK_DIAG, inet_diag) for the socket whose source
// is remote and whose destination is local. It fails when there is no such
// socket on this host (the peer is on another host, or gone) or netlink
// answers with an error.
func TCPPeerUID(local, remote *net.TCPAddr) (int, error) {
	req, err := diagRequest(local, remote)
	if err != nil {
		return 0, err
	}
	fd, err := unix.Socket(unix.AF_NETLINK, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, unix.NETLINK_SOCK_DIAG)
	if err != nil {
		return 0, os.NewSyscallError("socket", err)
	}
	defer unix.Close(fd)
	if err := unix.Sendto(fd, req, 0, &unix.SockaddrNetlink{Family: unix.AF_NETLINK}); err != nil {
		return 0, os.NewSyscallError("sendto", err)
	}
	buf := make([]byte, 4096)
	n, _, err := unix.Recvfrom(fd, buf, 0)
	if err != nil {
		return 0, os.NewSyscallError("recvfrom", err)
	}
	for b := buf[:n]; len(b) >= nlHeaderSize; {
		size := int(binary.NativeEndian.Uint32(b))
		if size < nlHeaderSize || size > len(b) {
			break
		}
		data := b[nlHeaderSize:size]
		switch binary.NativeEndian.Uint16(b[4:]) {
		case unix.NLMSG_ERROR:
			if len(data) >= 4 {
				if errno := int32(binary.NativeEndian.Uint32(data)); errno != 0 {
					return 0, fmt.Errorf("sock diag: peer of %v at %v: %w", local, remote, unix.Errno(-errno))
				}
			}
		case unix.SOCK_DIAG_BY_FAMILY:
			if len(data) >= diagMsgMinSize {
				return int(binary.NativeEndian.Uint32(data[diagMsgUIDOff:])), nil
			}
		}
		b = b[min((size+3)&^3, len(b)):] // messages are 4-byte aligned
	}
	return 0, fmt.Errorf("sock diag: no answer for the peer of %v at %v", local, remote)
}

// diagRequest encodes the netlink request for the socket whose source is
// remote and whose destination is local.
func diagRequest(local, remote *net.TCPAddr) ([]byte, error) {
	family := uint8(unix.AF_INET)
	src, dst := remote.IP.To4(), local.IP.To4()
	if src == nil || dst == nil {
		family, src, dst = unix.AF_INET6, remote.IP.To16(), local.IP.To16()
		if src == nil || dst == nil {
			return nil, fmt.Errorf("sock diag: %v and %v are not IP addresses", local, remote)
		}
	}
	b := make([]byte, nlHeaderSize+diagReqSize)
	binary.NativeEndian.PutUint32(b[0:], uint32(len(b)))
	binary.NativeEndian.PutUint16(b[4:], unix.SOCK_DIAG_BY_FAMILY)
	binary.NativeEndian.PutUint16(b[6:], unix.NLM_F_REQUEST)
	r := b[nlHeaderSize:]
	r[0], r[1] = family, unix.IPPROTO_TCP
	binary.NativeEndian.PutUint32(r[4:], 0xffffffff) // every state
	id := r[8:]                                      // inet_diag_sockid
	binary.BigEndian.PutUint16(id[0:], uint16(remote.Port))
	binary.BigEndian.PutUint16(id[2:], uint16(local.Port))
	copy(id[4:20], src)
	copy(id[20:36], dst)
	binary.NativeEndian.PutUint32(id[40:], 0xffffffff) // INET_DIAG_NOCOOKIE
	binary.NativeEndian.PutUint32(id[44:], 0xffffffff)
	return b, nil
}
