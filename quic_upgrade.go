package shmlink

import (
	"crypto/rand"
	"encoding/binary"
	"errors"
	"net"
	"net/netip"
	"os"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/quic-go/quic-go"
	"github.com/shmlink/shmlink/internal/sock"
	"golang.org/x/sys/unix"
)

// The hot upgrade of a "quic" listener (docs/protocol.md section 17). The
// old and the new process share one UDP socket, and a datagram goes to
// whichever reads it first; but QUIC connection IDs are per process. So
// every generation issues connection IDs that name it, only the newest
// generation reads the socket, and it forwards the packets addressed to
// the draining generation over a Unix datagram socket that the old
// generation handed over beside the UDP socket. Both send on the UDP
// socket directly.

const (
	// cidLen is the length of the connection IDs an upgradable listener
	// issues: [tag, tag^cidCheck, 6 random bytes].
	cidLen = 8
	// cidCheck marks a connection ID as one of ours, so that a client's
	// random initial ID rarely (1 in 65536) names a generation.
	cidCheck = 0xa7
	// quicCtlHotRestart is the type of the message a draining listener
	// sends on a unidirectional stream of each connection: 1 byte type,
	// 8 bytes new epoch, big-endian. The Dialer then dials anew for new
	// streams and closes the connection with its last stream.
	quicCtlHotRestart = 0x01
	// fwdHeader is the bytes before a forwarded packet: the sender's IPv6
	// (or IPv4-mapped) address and port.
	fwdHeader = 18
	// maxPacket bounds a UDP datagram.
	maxPacket = 1 << 16
)

// cidGenerator issues connection IDs tagged with a generation.
type cidGenerator struct{ tag byte }

// GenerateConnectionID returns a fresh tagged connection ID.
func (g cidGenerator) GenerateConnectionID() (quic.ConnectionID, error) {
	var b [cidLen]byte
	if _, err := rand.Read(b[2:]); err != nil {
		return quic.ConnectionID{}, err
	}
	b[0], b[1] = g.tag, g.tag^cidCheck
	return quic.ConnectionIDFromBytes(b[:]), nil
}

// ConnectionIDLen returns cidLen.
func (g cidGenerator) ConnectionIDLen() int { return cidLen }

// packetTag returns the generation tag of the connection ID packet p is
// addressed to, and false if that ID is not a tagged one.
func packetTag(p []byte) (byte, bool) {
	var dcid []byte
	switch {
	case len(p) == 0:
		return 0, false
	case p[0]&0x80 != 0: // long header: flags, version, DCID length, DCID
		if len(p) < 6 || len(p) < 6+int(p[5]) {
			return 0, false
		}
		dcid = p[6 : 6+int(p[5])]
	default: // short header: flags, DCID of the length we issue
		if len(p) < 1+cidLen {
			return 0, false
		}
		dcid = p[1 : 1+cidLen]
	}
	if len(dcid) != cidLen || dcid[1] != dcid[0]^cidCheck {
		return 0, false
	}
	return dcid[0], true
}

// routedConn is the net.PacketConn an upgradable QUIC listener's Transport
// uses: the shared UDP socket, read until the listener hands over and
// then replaced by the packets the next generation forwards; packets for
// the previous generation, while it drains, are forwarded to it.
type routedConn struct {
	udp *net.UDPConn
	tag byte // this generation's

	handedOver atomic.Bool   // reading from fwdIn now
	fwdIn      *net.UnixConn // from the next generation; set (under mu) before handedOver
	inBuf      []byte        // read buffer of fwdIn; one reader (quic-go's)
	outBuf     []byte        // a packet being forwarded; used by that reader only

	mu      sync.Mutex
	fwdOut  *net.UnixConn // to the previous generation while it drains
	prevTag byte
}

// ReadFrom returns the next packet for this generation.
func (r *routedConn) ReadFrom(b []byte) (int, net.Addr, error) {
	for !r.handedOver.Load() {
		n, addr, err := r.udp.ReadFromUDP(b)
		if err != nil {
			if r.handedOver.Load() {
				break // the deadline that ended reading the UDP socket
			}
			return n, addr, err
		}
		if r.forwarded(b[:n], addr) {
			continue
		}
		return n, addr, nil
	}
	return r.readForwarded(b)
}

// forwarded sends p to the previous generation if it is addressed to it,
// and reports whether it was (a packet it could not take is lost, as on
// a full socket). Once that generation has gone, it forwards no more.
func (r *routedConn) forwarded(p []byte, from *net.UDPAddr) bool {
	r.mu.Lock()
	out, prev := r.fwdOut, r.prevTag
	r.mu.Unlock()
	if out == nil {
		return false
	}
	if tag, ok := packetTag(p); !ok || tag != prev {
		return false
	}
	ap := from.AddrPort()
	ip := ap.Addr().As16() // an IPv4 address as IPv4-mapped
	msg := append(append(r.outBuf[:0], ip[:]...), 0, 0)
	binary.BigEndian.PutUint16(msg[16:], ap.Port())
	msg = append(msg, p...)
	r.outBuf = msg
	raw, err := out.SyscallConn()
	if err == nil {
		var werr error
		err = raw.Write(func(fd uintptr) bool {
			werr = unix.Send(int(fd), msg, unix.MSG_DONTWAIT)
			return true
		})
		err = errors.Join(err, werr)
	}
	if err != nil && !errors.Is(err, syscall.EAGAIN) {
		// The previous generation has drained and closed its end.
		r.mu.Lock()
		if r.fwdOut == out {
			r.fwdOut = nil
		}
		r.mu.Unlock()
		out.Close()
	}
	return true
}

// readForwarded reads a packet forwarded by the next generation.
func (r *routedConn) readForwarded(b []byte) (int, net.Addr, error) {
	for {
		n, err := r.fwdIn.Read(r.inBuf)
		if err != nil {
			return 0, nil, err
		}
		if n < fwdHeader {
			continue
		}
		ip, _ := netip.AddrFromSlice(r.inBuf[:16])
		addr := net.UDPAddrFromAddrPort(netip.AddrPortFrom(ip.Unmap(), binary.BigEndian.Uint16(r.inBuf[16:])))
		return copy(b, r.inBuf[fwdHeader:n]), addr, nil
	}
}

// WriteTo sends p on the UDP socket, whichever generation reads it.
func (r *routedConn) WriteTo(p []byte, addr net.Addr) (int, error) { return r.udp.WriteTo(p, addr) }

// Close closes this process's descriptors of the sockets.
func (r *routedConn) Close() error {
	r.mu.Lock()
	if r.fwdOut != nil {
		r.fwdOut.Close()
		r.fwdOut = nil
	}
	in := r.fwdIn
	r.mu.Unlock()
	if in != nil {
		in.Close()
	}
	return r.udp.Close()
}

// LocalAddr returns the UDP socket's address.
func (r *routedConn) LocalAddr() net.Addr { return r.udp.LocalAddr() }

// SetDeadline sets the deadlines of the sockets read and written.
func (r *routedConn) SetDeadline(t time.Time) error {
	return errors.Join(r.SetReadDeadline(t), r.SetWriteDeadline(t))
}

// SetReadDeadline sets the read deadline of the socket read.
func (r *routedConn) SetReadDeadline(t time.Time) error {
	if r.handedOver.Load() {
		return r.fwdIn.SetReadDeadline(t)
	}
	return r.udp.SetReadDeadline(t)
}

// SetWriteDeadline sets the UDP socket's write deadline.
func (r *routedConn) SetWriteDeadline(t time.Time) error { return r.udp.SetWriteDeadline(t) }

// SetReadBuffer sets the UDP socket's receive buffer, in bytes.
func (r *routedConn) SetReadBuffer(n int) error { return r.udp.SetReadBuffer(n) }

// SetWriteBuffer sets the UDP socket's send buffer, in bytes.
func (r *routedConn) SetWriteBuffer(n int) error { return r.udp.SetWriteBuffer(n) }

// forwardPair returns a connected pair of Unix datagram sockets,
// close-on-exec: the old generation reads the first, and hands the second
// over.
func forwardPair() (in, out *net.UnixConn, err error) {
	// SOCK_CLOEXEC is Linux's; under ForkLock, as package net does, no
	// exec sees the descriptors before they are close-on-exec.
	syscall.ForkLock.RLock()
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_DGRAM, 0)
	if err == nil {
		unix.CloseOnExec(fds[0])
		unix.CloseOnExec(fds[1])
	}
	syscall.ForkLock.RUnlock()
	if err != nil {
		return nil, nil, os.NewSyscallError("socketpair", err)
	}
	conn := func(fd int) (*net.UnixConn, error) {
		f := os.NewFile(uintptr(fd), "shmlink-quic-forward")
		defer f.Close()
		c, err := net.FileConn(f)
		if err != nil {
			return nil, err
		}
		return c.(*net.UnixConn), nil
	}
	if in, err = conn(fds[0]); err != nil {
		unix.Close(fds[1])
		return nil, nil, err
	}
	if out, err = conn(fds[1]); err != nil {
		in.Close()
		return nil, nil, err
	}
	in.SetReadBuffer(quicUDPBuffer)
	out.SetWriteBuffer(quicUDPBuffer)
	return in, out, nil
}

// quicHandover is a QUIC listener as its Upgrader drives it.
type quicHandover struct{ q *quicListener }

// Extras makes the forwarding socket pair and returns the end to hand
// over; done keeps the other end for HandOver if the handover succeeded.
func (h quicHandover) Extras() ([]net.Listener, func(bool), error) {
	in, out, err := forwardPair()
	if err != nil {
		return nil, nil, err
	}
	return []net.Listener{sock.PacketListener{PacketConn: out}}, func(ok bool) {
		out.Close() // the new process has its own
		if !ok {
			in.Close()
			return
		}
		h.q.rc.mu.Lock()
		h.q.rc.fwdIn = in
		h.q.rc.mu.Unlock()
	}, nil
}

// HandOver stops accepting connections, moves reading to the packets the
// new process forwards, and tells every connection's client to dial anew
// for new streams (quicCtlHotRestart); the streams in flight finish here.
func (h quicHandover) HandOver(epoch uint64) <-chan struct{} {
	q := h.q
	q.rc.inBuf = make([]byte, fwdHeader+maxPacket)
	q.rc.handedOver.Store(true)
	q.rc.udp.SetReadDeadline(time.Unix(1, 0)) // ends the read of the UDP socket
	q.mu.Lock()
	q.handedTo = epoch
	conns := q.liveLocked()
	q.mu.Unlock()
	q.ln.Close()
	for _, qc := range conns {
		sendHotRestart(qc, epoch)
	}
	idle := make(chan struct{})
	go func() { q.wg.Wait(); close(idle) }()
	return idle
}

// Drained closes the connections left and makes Accept fail with
// ErrUpgraded.
func (h quicHandover) Drained() int {
	q := h.q
	n := q.closeConns()
	q.mu.Lock()
	q.upgraded = true
	q.mu.Unlock()
	q.stop()
	return n
}

// sendHotRestart tells qc's client that the listener moved to the process
// of epoch; an error means the connection is ending anyway.
func sendHotRestart(qc *quicConn, epoch uint64) {
	s, err := qc.conn.OpenUniStream()
	if err != nil {
		return
	}
	var msg [9]byte
	msg[0] = quicCtlHotRestart
	binary.BigEndian.PutUint64(msg[1:], epoch)
	s.Write(msg[:])
	s.Close()
}
