package session

import (
	"encoding/binary"
	"encoding/hex"
	"fmt"
	"io"
	"net"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/shmlink/shmlink/internal/wire"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"
)

// socketPair returns two connected Unix stream sockets.
func socketPair(t testing.TB) (*net.UnixConn, *net.UnixConn) {
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	require.NoError(t, err)
	conns := make([]*net.UnixConn, 2)
	for i, fd := range fds {
		f := os.NewFile(uintptr(fd), "socketpair")
		c, err := net.FileConn(f)
		f.Close()
		require.NoError(t, err)
		conns[i] = c.(*net.UnixConn)
	}
	return conns[0], conns[1]
}

func readN(t *testing.T, r io.Reader, n int) []byte {
	b := make([]byte, n)
	_, err := io.ReadFull(r, b)
	require.NoError(t, err)
	return b
}

// The client's v3 memfd handshake, byte for byte (docs/protocol.md section 1.4), against
// a scripted server.
func TestClientHandshakeV3Bytes(t *testing.T) {
	cc, sc := socketPair(t)
	defer sc.Close()
	type result struct {
		s   *Session
		err error
	}
	done := make(chan result, 1)
	go func() {
		s, err := Client(cc, nil)
		done <- result{s, err}
	}()

	require.Equal(t, "000000087758"+"0304", hex.EncodeToString(readN(t, sc, 8)))
	_, err := sc.Write([]byte{0, 0, 0, 8, 0x77, 0x58, 3, 4})
	require.NoError(t, err)

	hdr := readN(t, sc, 8)
	require.Equal(t, "77580305", hex.EncodeToString(hdr[4:]), "ShareMemoryByMemfd, version 3")
	meta, err := wire.ParseShmMetadata(readN(t, sc, int(binary.BigEndian.Uint32(hdr))-8))
	require.NoError(t, err)
	prefix := fmt.Sprintf("/dev/shm/shmlink_%d_", os.Getpid())
	require.True(t, strings.HasPrefix(meta.QueuePath, prefix) && strings.HasSuffix(meta.QueuePath, "_queue_0"), meta.QueuePath)
	require.True(t, strings.HasPrefix(meta.BufferPath, prefix) && strings.HasSuffix(meta.BufferPath, "_buffer"), meta.BufferPath)

	_, err = sc.Write([]byte{0, 0, 0, 8, 0x77, 0x58, 3, 7}) // AckReadyRecvFD
	require.NoError(t, err)
	data := make([]byte, 16)
	oob := make([]byte, 256)
	n, oobn, _, _, err := sc.ReadMsgUnix(data, oob)
	require.NoError(t, err)
	require.Equal(t, []byte{0}, data[:n], "one data byte 00")
	require.Equal(t, 24, oobn, "one SCM_RIGHTS message with two fds")
	msgs, err := unix.ParseSocketControlMessage(oob[:oobn])
	require.NoError(t, err)
	require.Len(t, msgs, 1)
	fds, err := unix.ParseUnixRights(&msgs[0])
	require.NoError(t, err)
	require.Len(t, fds, 2)
	defer unix.Close(fds[0])
	defer unix.Close(fds[1])

	var st unix.Stat_t
	require.NoError(t, unix.Fstat(fds[0], &st))
	require.EqualValues(t, 32<<20, st.Size, "buffer first")
	require.NoError(t, unix.Fstat(fds[1], &st))
	require.EqualValues(t, 196656, st.Size, "queue second")
	mem, err := unix.Mmap(fds[0], 0, 8, unix.PROT_READ, unix.MAP_SHARED)
	require.NoError(t, err)
	// 3 lists, then their bytes (0x01fde06c) with shmlink's default
	// classes: 819, 307 and 127 slices (docs/protocol.md section 2.2).
	require.Equal(t, "030000006ce0fd01", hex.EncodeToString(mem[:8]), "region header")
	unix.Munmap(mem)
	flags, err := unix.FcntlInt(uintptr(fds[0]), unix.F_GETFD, 0)
	require.NoError(t, err)
	require.NotZero(t, flags&unix.FD_CLOEXEC, "received fds are close-on-exec (MSG_CMSG_CLOEXEC)")

	_, err = sc.Write([]byte{0, 0, 0, 8, 0x77, 0x58, 3, 6}) // AckShareMemory
	require.NoError(t, err)
	r := <-done
	require.NoError(t, r.err)
	require.EqualValues(t, 3, r.s.Version())
	require.NoError(t, r.s.Close())
}

// The client's file handshake over a connection that is not a Unix socket
// (TCP): v3 with a file path, queue path first, and the client returns
// only once the server's AckShareMemory says it mapped the files (#15: it
// sent v2, which has no reply, and Dial returned before the server had
// answered at all). The files go once acknowledged.
func TestClientHandshakeFileBytes(t *testing.T) {
	dir := t.TempDir()
	cc, sc := net.Pipe()
	defer sc.Close()
	done := make(chan error, 1)
	var s *Session
	go func() {
		var err error
		s, err = Client(cc, &Config{ShmDir: dir})
		done <- err
	}()
	require.Equal(t, "0000000877580304", hex.EncodeToString(readN(t, sc, 8)), "ExchangeProtoVersion")
	_, err := sc.Write([]byte{0, 0, 0, 8, 0x77, 0x58, 3, 4})
	require.NoError(t, err)
	hdr := readN(t, sc, 8)
	require.Equal(t, "77580300", hex.EncodeToString(hdr[4:]), "ShareMemoryByFilePath, version 3")
	payload := readN(t, sc, int(binary.BigEndian.Uint32(hdr))-8)
	meta, err := wire.ParseShmMetadata(payload)
	require.NoError(t, err)
	require.Equal(t, uint16(len(meta.QueuePath)), binary.BigEndian.Uint16(payload), "queue path first")
	require.True(t, strings.HasSuffix(meta.QueuePath, "_queue_0"))
	for _, p := range []string{meta.QueuePath, meta.BufferPath} {
		fi, err := os.Stat(p)
		require.NoError(t, err)
		require.Equal(t, os.FileMode(0o600), fi.Mode().Perm(), p)
	}
	select {
	case err := <-done:
		t.Fatalf("the client returned before AckShareMemory: %v", err)
	default:
	}
	_, err = sc.Write([]byte{0, 0, 0, 8, 0x77, 0x58, 3, 6}) // AckShareMemory
	require.NoError(t, err)
	require.NoError(t, <-done)
	defer s.Close()
	require.EqualValues(t, 3, s.Version())
	for _, p := range []string{meta.QueuePath, meta.BufferPath} {
		_, err := os.Stat(p)
		require.ErrorIs(t, err, os.ErrNotExist, "removed once acknowledged: %s", p)
	}
}

// A client whose server does not answer fails within HandshakeTimeout; one
// whose server closes the connection is told that the likely cause, with
// file memory, is a different ShmDir (#15: it got "connection reset by
// peer" and nothing else). Neither leaves a file behind.
func TestClientHandshakeNoAnswer(t *testing.T) {
	t.Run("silent", func(t *testing.T) {
		dir := t.TempDir()
		cc, sc := tcpPair(t)
		defer sc.Close()
		_, err := Client(cc, &Config{ShmDir: dir, HandshakeTimeout: 100 * time.Millisecond})
		require.ErrorIs(t, err, os.ErrDeadlineExceeded)
		requireEmptyDir(t, dir)
	})
	t.Run("closed", func(t *testing.T) {
		dir := t.TempDir()
		cc, sc := tcpPair(t)
		go func() {
			readN(t, sc, 8) // ExchangeProtoVersion
			sc.Write([]byte{0, 0, 0, 8, 0x77, 0x58, 3, 4})
			readN(t, sc, 8) // the metadata's header, then away
			sc.Close()
		}()
		_, err := Client(cc, &Config{ShmDir: dir})
		require.Error(t, err)
		require.ErrorContains(t, err, "same Config.ShmDir")
		require.ErrorContains(t, err, dir)
		requireEmptyDir(t, dir)
	})
}

// requireEmptyDir requires that dir holds no file.
func requireEmptyDir(t *testing.T, dir string) {
	t.Helper()
	ents, err := os.ReadDir(dir)
	require.NoError(t, err)
	require.Empty(t, ents)
}

// A server fed a handshake that sends the wrong number of fds refuses it
// and leaks none of them.
func TestServerRejectsWrongFdCount(t *testing.T) {
	cc, sc := socketPair(t)
	defer cc.Close()
	done := make(chan error, 1)
	go func() {
		_, err := Server(sc, nil)
		done <- err
	}()
	_, err := cc.Write(wire.AppendSimple(nil, 3, wire.TypeExchangeProtoVersion))
	require.NoError(t, err)
	readN(t, cc, 8)
	_, err = cc.Write(wire.AppendShareMemory(nil, 3, wire.TypeShareMemoryByMemfd, wire.ShmMetadata{QueuePath: "/dev/shm/q", BufferPath: "/dev/shm/b"}))
	require.NoError(t, err)
	require.Equal(t, "0000000877580307", hex.EncodeToString(readN(t, cc, 8)))
	f, err := os.CreateTemp(t.TempDir(), "fd")
	require.NoError(t, err)
	defer f.Close()
	fd := int(f.Fd())
	require.Equal(t, 1, fdsOpenOn(t, f.Name()))
	_, _, err = cc.WriteMsgUnix([]byte{0}, unix.UnixRights(fd, fd, fd), nil)
	require.NoError(t, err)
	err = <-done
	require.ErrorIs(t, err, ErrHandshake)
	require.Contains(t, err.Error(), "descriptors")
	// The server closed its side: we read EOF, not a hang.
	_, err = cc.Read(make([]byte, 1))
	require.ErrorIs(t, err, io.EOF)
	// The three descriptors it received (in this process) are closed:
	// only ours is left on the file.
	require.Equal(t, 1, fdsOpenOn(t, f.Name()), "received descriptors left open")
}

// fdsOpenOn returns how many of this process's descriptors are open on the
// file at path.
func fdsOpenOn(t *testing.T, path string) int {
	t.Helper()
	entries, err := os.ReadDir("/proc/self/fd")
	require.NoError(t, err)
	n := 0
	for _, e := range entries {
		if target, err := os.Readlink("/proc/self/fd/" + e.Name()); err == nil && target == path {
			n++
		}
	}
	return n
}
