package session

import (
	"io"
	"net"
	"os"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"
)

// setBlocking switches c's descriptor to blocking mode, as a dup of it
// passed to os.File.Fd would (the flag belongs to the open file, which
// the dup shares).
func setBlocking(t *testing.T, c syscall.Conn) {
	t.Helper()
	rc, err := c.SyscallConn()
	require.NoError(t, err)
	var serr error
	require.NoError(t, rc.Control(func(fd uintptr) { serr = unix.SetNonblock(int(fd), false) }))
	require.NoError(t, serr)
}

// readWithin runs r.Read(p), failing the test (result, ctlread_test.go)
// if it still waits after 10 s: a read that blocks in the kernel would
// never return.
func readWithin(t *testing.T, r io.Reader, p []byte) (int, error) {
	t.Helper()
	var n int
	done := make(chan error, 1)
	go func() {
		var err error
		n, err = r.Read(p)
		done <- err
	}()
	err := result(t, done)
	return n, err
}

// ctlReader reads what the socket has, reports the peer's end as io.EOF,
// and its errors are conn.Read's: a deadline is os.ErrDeadlineExceeded in
// a "read" *net.OpError, and a closed connection net.ErrClosed
// (docs/protocol.md section 12.4).
func TestCtlReader(t *testing.T) {
	a, b := socketPair(t)
	defer a.Close()
	r := newCtlReader(a)
	require.IsType(t, &ctlReader{}, r)

	_, err := b.Write([]byte("hello"))
	require.NoError(t, err)
	p := make([]byte, 3)
	n, err := r.Read(p)
	require.NoError(t, err)
	require.Equal(t, "hel", string(p[:n]))
	n, err = r.Read(p)
	require.NoError(t, err)
	require.Equal(t, "lo", string(p[:n]))

	// A read waits in the poller for the next bytes.
	go b.Write([]byte("x"))
	n, err = readWithin(t, r, p)
	require.NoError(t, err)
	require.Equal(t, "x", string(p[:n]))

	require.NoError(t, a.SetReadDeadline(time.Now().Add(10*time.Millisecond)))
	_, err = readWithin(t, r, p)
	require.ErrorIs(t, err, os.ErrDeadlineExceeded)
	var oe *net.OpError
	require.ErrorAs(t, err, &oe)
	require.Equal(t, "read", oe.Op)
	require.NoError(t, a.SetReadDeadline(time.Time{}))

	b.Close()
	_, err = readWithin(t, r, p)
	require.ErrorIs(t, err, io.EOF)

	a.Close()
	_, err = r.Read(p)
	require.ErrorIs(t, err, net.ErrClosed)
}

// A socket switched to blocking mode behind the session's back still never
// blocks a thread in the kernel: ctlReader's reads honour the deadline,
// and a write to a full socket returns EAGAIN (docs/protocol.md section
// 12.4).
func TestCtlReaderBlockingSocket(t *testing.T) {
	a, b := socketPair(t)
	defer a.Close()
	defer b.Close()
	setBlocking(t, a)
	r := newCtlReader(a)
	p := make([]byte, 16)
	require.NoError(t, a.SetReadDeadline(time.Now().Add(20*time.Millisecond)))
	_, err := readWithin(t, r, p)
	require.ErrorIs(t, err, os.ErrDeadlineExceeded)

	rc, err := a.SyscallConn()
	require.NoError(t, err)
	chunk := make([]byte, 64<<10)
	sent, full := 0, false
	require.NoError(t, rc.Control(func(fd uintptr) {
		for range 1 << 12 { // the kernel's buffer is far smaller than 256 MB
			n, errno := sendDontWait(fd, chunk)
			if errno == unix.EAGAIN {
				full = true
				return
			}
			require.Zero(t, errno)
			sent += n
		}
	}))
	require.True(t, full, "sent %d bytes without EAGAIN", sent)
	require.Positive(t, sent)
}

// pipeConn is a net.Conn over a pipe: a descriptor that is not a socket.
type pipeConn struct {
	*os.File
}

func (pipeConn) LocalAddr() net.Addr  { return nil }
func (pipeConn) RemoteAddr() net.Addr { return nil }

// A conn that is not a *net.UnixConn or *net.TCPConn is read through its
// own Read, even when it has a descriptor: a wrapper may hold bytes of
// its own. The Polling writer falls back to write(2) on a descriptor that
// is not a socket (ENOTSOCK).
func TestCtlRawNotSocket(t *testing.T) {
	pr, pw, err := os.Pipe()
	require.NoError(t, err)
	defer pr.Close()
	defer pw.Close()

	w := newCtlWriter(pipeConn{pw}, 3, time.Second)
	require.NotNil(t, w.raw)
	w.rawBuf, w.rawN, w.rawErr = []byte("polling!"), 0, nil
	require.NoError(t, w.raw.Write(w.rawFunc))
	require.NoError(t, w.rawErr)
	require.Equal(t, 8, w.rawN)
	require.True(t, w.notSock)

	r := newCtlReader(pipeConn{pr})
	require.Equal(t, pipeConn{pr}, r)
	p := make([]byte, 16)
	n, err := readWithin(t, r, p)
	require.NoError(t, err)
	require.Equal(t, "polling!", string(p[:n]))

	tc, ts := tcpPair(t)
	defer tc.Close()
	defer ts.Close()
	require.IsType(t, &ctlReader{}, newCtlReader(tc))
}
