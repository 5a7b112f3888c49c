package session

import (
	"io"
	"net"
	"os"
	"syscall"
	"unsafe"

	"golang.org/x/sys/unix"
)

// System calls on the control connection that do not wake the Go
// runtime's monitor thread (docs/protocol.md section 12.4).
//
// A system call made through package syscall, as net.Conn's Read and
// Write make them, tells the scheduler that the thread may block. When
// every P of the process was idle, the runtime's monitor thread (sysmon)
// sleeps until woken, and that notice wakes it: a futex wake, then sysmon
// runs, sleeps 20 µs, finds every P idle again and goes back to sleep.
// A process that wakes for each request pays that on every one: on a
// 2-vCPU VM whose idle vCPUs halt it was about 40 % of a server's CPU
// time per request with requests 1 ms apart.
//
// The reads and writes of a Polling need none of it: on a nonblocking
// socket they return at once. So they are made as raw system calls, with
// MSG_DONTWAIT, so that they cannot block even if somebody switched the
// socket to blocking mode (through a dup of its descriptor, which shares
// the flag). Waiting for the socket still goes through the runtime's
// network poller (syscall.RawConn), with the connection's deadlines. Reads
// take this path on a *net.UnixConn or *net.TCPConn only; writes of a
// Polling on any conn that has a descriptor (syscall.Conn), as before.

// recvDontWait receives into b from the socket fd without blocking and
// without telling the scheduler: a raw recvfrom(2) with MSG_DONTWAIT. It
// returns the byte count and the call's errno (0 on success).
func recvDontWait(fd uintptr, b []byte) (int, unix.Errno) {
	return recvRaw(fd, b, unix.MSG_DONTWAIT)
}

// peekDontWait is recvDontWait leaving the bytes in the socket
// (MSG_PEEK); its byte count is 0 at the end of a stream.
func peekDontWait(fd uintptr, b []byte) (int, unix.Errno) {
	return recvRaw(fd, b, unix.MSG_PEEK|unix.MSG_DONTWAIT)
}

// recvRaw is a raw recvfrom(2) of the socket fd into b with flags, which
// must hold MSG_DONTWAIT: the scheduler is not told of the call.
func recvRaw(fd uintptr, b []byte, flags int) (int, unix.Errno) {
	n, _, errno := unix.RawSyscall6(unix.SYS_RECVFROM, fd,
		uintptr(unsafe.Pointer(unsafe.SliceData(b))), uintptr(len(b)),
		uintptr(flags), 0, 0)
	return int(n), errno
}

// sendDontWait sends b on the socket fd without blocking and without
// telling the scheduler: a raw sendto(2) with MSG_DONTWAIT and
// MSG_NOSIGNAL (a closed peer is EPIPE, not SIGPIPE). It returns the byte
// count and the call's errno (0 on success).
func sendDontWait(fd uintptr, b []byte) (int, unix.Errno) {
	n, _, errno := unix.RawSyscall6(unix.SYS_SENDTO, fd,
		uintptr(unsafe.Pointer(unsafe.SliceData(b))), uintptr(len(b)),
		unix.MSG_DONTWAIT|unix.MSG_NOSIGNAL, 0, 0)
	return int(n), errno
}

// ctlReader reads the control connection with recvDontWait, waiting for
// it in the network poller. Its errors are those of conn.Read: io.EOF at
// the peer's end, a *net.OpError ("read") wrapping os.ErrDeadlineExceeded
// at the read deadline (which kicks use), net.ErrClosed after Close, or
// the system call's error. One goroutine reads at a time (ctlIn.tok).
type ctlReader struct {
	rc      syscall.RawConn
	network string // for errors: "unix" or "tcp"

	// The state of one Read, made once so that a read allocates nothing.
	p   []byte
	n   int
	err error
	fn  func(fd uintptr) bool
}

// newCtlReader returns a ctlReader for a *net.UnixConn or *net.TCPConn,
// whose Read is exactly a read of its socket, and conn itself for any
// other net.Conn: a wrapper may hold bytes of its own (a peeked prefix, a
// TLS record) that a read of the descriptor would skip.
func newCtlReader(conn net.Conn) io.Reader {
	var network string
	var sc syscall.Conn
	switch c := conn.(type) {
	case *net.UnixConn:
		network, sc = "unix", c
	case *net.TCPConn:
		network, sc = "tcp", c
	default:
		return conn
	}
	rc, err := sc.SyscallConn()
	if err != nil {
		return conn
	}
	r := &ctlReader{rc: rc, network: network}
	r.fn = r.readFD
	return r
}

// Read reads into p what the socket has, waiting for at least one byte.
func (r *ctlReader) Read(p []byte) (int, error) {
	if len(p) == 0 {
		return 0, nil
	}
	r.p, r.n, r.err = p, 0, nil
	err := r.rc.Read(r.fn)
	n, rerr := r.n, r.err
	r.p, r.err = nil, nil
	if err != nil {
		// net names a raw read "raw-read"; this is the connection's read.
		if oe, ok := err.(*net.OpError); ok {
			oe.Op = "read"
		}
		return 0, err
	}
	return n, rerr
}

// readFD is the function Read passes to RawConn.Read: it reports false to
// wait for the socket in the poller, true when the read is done.
func (r *ctlReader) readFD(fd uintptr) bool {
	for {
		n, errno := recvDontWait(fd, r.p)
		switch errno {
		case 0:
			r.n = n
			if n == 0 {
				r.err = io.EOF
			}
			return true
		case unix.EINTR:
			continue
		case unix.EAGAIN:
			return false
		}
		r.err = &net.OpError{Op: "read", Net: r.network, Err: os.NewSyscallError("read", errno)}
		return true
	}
}

// errnoOf returns err's errno: 0 for nil, EIO for an error that is not one.
func errnoOf(err error) unix.Errno {
	if err == nil {
		return 0
	}
	if errno, ok := err.(unix.Errno); ok {
		return errno
	}
	return unix.EIO
}
