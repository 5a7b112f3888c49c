package session

import (
	"bytes"
	"errors"
	"fmt"
	"hash/crc32"
	"io"
	"net"
	"os"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// oddReader returns data in reads of varying sizes, some of them empty,
// and hides any WriterTo, so that io.Copy calls the stream's ReadFrom.
type oddReader struct {
	data []byte
	i    int
}

func (r *oddReader) Read(p []byte) (int, error) {
	r.i++
	if len(r.data) == 0 {
		return 0, io.EOF
	}
	if r.i%5 == 0 {
		return 0, nil // allowed, and must send nothing
	}
	n := copy(p[:min(len(p), 1+r.i*7919%(70<<10))], r.data)
	r.data = r.data[n:]
	return n, nil
}

// crcWriter checks what it is given and keeps no reference to it: what
// WriteTo hands it is shared memory, released once Write returns.
type crcWriter struct {
	n   int
	sum uint32
}

func (w *crcWriter) Write(p []byte) (int, error) {
	w.n += len(p)
	w.sum = crc32.Update(w.sum, crc32.IEEETable, p)
	return len(p), nil
}

// io.Copy into a stream goes through ReadFrom, reading straight into
// shared memory, and out of one through WriteTo, writing the slices as
// they are (#15); every byte arrives in order, and no slice is left in
// use. With a tiny region and Fallback, reservations also go to the heap.
func TestIOCopyReadFromWriteTo(t *testing.T) {
	for _, tc := range []struct {
		name string
		cfg  *Config
	}{
		{"default", nil},
		{"tiny-fallback", &Config{BufferSize: 64 << 10, SizeClasses: tinyConfig().SizeClasses, Fallback: true}},
		{"tiny-backpressure", tinyConfig()},
	} {
		t.Run(tc.name, func(t *testing.T) {
			client, server := pair(t, tc.cfg)
			c, s := streamPair(t, client, server)
			data := randomBytes(3<<20+17, 7)
			sent := make(chan error, 1)
			go func() {
				n, err := io.Copy(c, &oddReader{data: data})
				if err == nil && n != int64(len(data)) {
					err = errors.New("short copy")
				}
				if err == nil {
					err = c.CloseWrite()
				}
				sent <- err
			}()
			var w crcWriter
			n, err := io.Copy(&w, s)
			require.NoError(t, err)
			require.NoError(t, <-sent)
			require.EqualValues(t, len(data), n)
			require.Equal(t, crc32.ChecksumIEEE(data), w.sum)
			require.NoError(t, c.Close())
			require.NoError(t, s.Close())
			eventually(t, func() bool { return sum(client.Stats().SlicesInUse) == 0 }, "every slice freed")
		})
	}
}

// WriteTo stops at the writer's error and at a short write.
func TestWriteToWriterErrors(t *testing.T) {
	client, server := pair(t, nil)
	c, s := streamPair(t, client, server)
	_, err := c.Write(bytes.Repeat([]byte("x"), 100))
	require.NoError(t, err)
	boom := errors.New("boom")
	n, err := s.WriteTo(writerFunc(func(p []byte) (int, error) { return 3, boom }))
	require.ErrorIs(t, err, boom)
	require.EqualValues(t, 3, n)
	_, err = c.Write([]byte("y"))
	require.NoError(t, err)
	_, err = s.WriteTo(writerFunc(func(p []byte) (int, error) { return 0, nil }))
	require.ErrorIs(t, err, io.ErrShortWrite)
}

type writerFunc func([]byte) (int, error)

func (f writerFunc) Write(p []byte) (int, error) { return f(p) }

// blockedReadFrom starts st.ReadFrom on a pipe and waits until it waits
// in the pipe's Read; it returns the pipe's writer, closed when the test
// ends, and the channel of ReadFrom's error.
func blockedReadFrom(t *testing.T, st *Stream) (*io.PipeWriter, <-chan error) {
	t.Helper()
	pr, pw := io.Pipe()
	t.Cleanup(func() { pw.Close() })
	copied := make(chan error, 1)
	go func() {
		_, err := st.ReadFrom(pr)
		copied <- err
	}()
	waitFor(t, "ReadFrom waits in its reader", func() bool {
		st.mu.Lock()
		defer st.mu.Unlock()
		return st.srcRead
	})
	return pw, copied
}

// Close does not wait for a ReadFrom blocked in its reader's Read (a
// proxy's io.Copy(stream, conn) torn down from another goroutine): the
// peer reads the end of the stream at once, ReadFrom returns
// ErrStreamClosed once the Read returns, dropping what it read, and no
// slice stays in use. Before, Close waited on the write side that
// ReadFrom held until its reader returned.
func TestCloseDuringReadFrom(t *testing.T) {
	client, server := pair(t, nil)
	c, s := streamPair(t, client, server)
	pw, copied := blockedReadFrom(t, c)
	closed := make(chan error, 1)
	go func() { closed <- c.Close() }()
	require.NoError(t, result(t, closed))
	_, err := s.Read(make([]byte, 1))
	require.ErrorIs(t, err, io.EOF, "the peer reads the end of the stream")
	go pw.Write([]byte("late")) // the Read returns; its bytes are dropped
	require.ErrorIs(t, result(t, copied), ErrStreamClosed)
	require.NoError(t, s.Close())
	releaseWarm(server)
	eventually(t, func() bool { return sum(client.Stats().SlicesInUse) == 0 }, "every slice freed")
}

// The session's Close does not wait for such a ReadFrom either; the
// session keeps its memory mapped until the Read returns, and unmaps it
// then.
func TestSessionCloseDuringReadFrom(t *testing.T) {
	client, server := pair(t, nil)
	c, _ := streamPair(t, client, server)
	pw, copied := blockedReadFrom(t, c)
	closed := make(chan error, 1)
	go func() { closed <- client.Close() }()
	require.NoError(t, result(t, closed))
	require.False(t, client.shm.unmapped.Load(), "unmapped under the Read")
	pw.Close()
	require.ErrorIs(t, result(t, copied), ErrStreamClosed)
	eventually(t, func() bool { return client.shm.unmapped.Load() }, "the memory is unmapped once ReadFrom returned")
}

// closingSource returns one byte per Read until st is closed; a Read that
// finds st closed blocks until release is closed, as a connection with
// nothing more to say would.
type closingSource struct {
	st      *Stream
	reads   atomic.Int64
	release chan struct{}
}

func (r *closingSource) Read(p []byte) (int, error) {
	if r.st.closed() {
		<-r.release
		return 0, io.EOF
	}
	r.reads.Add(1)
	p[0] = 'x'
	return 1, nil
}

// A Close that comes between two of ReadFrom's Reads finds no Read under
// way and waits for the write side to
// end the close itself: ReadFrom must then not begin the next Read, which
// could hold that Close for ever. The window is a few instructions wide,
// so the test tries it many times, at varying points of the copy.
func TestCloseBetweenReadFromReads(t *testing.T) {
	client, server := pair(t, nil)
	for trial := range 200 {
		c, s := streamPair(t, client, server)
		go io.Copy(io.Discard, s)
		src := &closingSource{st: c, release: make(chan struct{})}
		copied := make(chan error, 1)
		go func() {
			_, err := c.ReadFrom(src)
			copied <- err
		}()
		waitFor(t, "ReadFrom copies", func() bool { return src.reads.Load() > int64(trial%7) })
		closed := make(chan struct{})
		go func() {
			c.Close()
			close(closed)
		}()
		select {
		case <-closed:
		case <-time.After(10 * time.Second):
			close(src.release)
			t.Fatalf("trial %d: Close waited 10 s for a ReadFrom's reader", trial)
		}
		close(src.release)
		require.ErrorIs(t, result(t, copied), ErrStreamClosed)
		require.NoError(t, s.Close())
	}
}

// io.Copy(stream, r) from readers that are not sockets (pipes here; a
// proxy's tls.Conn) holds no shared memory while they say nothing:
// ReadFrom reads them into a heap buffer until a Read fills it. Before,
// each such copy held a slice of up to 64 KiB in its Read, and 40 of them
// held more than a 1 MiB region: the later ones, and every other
// writer, waited for space. Bytes still arrive in order, a Read that
// fills the buffer sends the next ones straight through slices, and the
// reader's end ends ReadFrom with nil.
func TestReadFromIdleReaderHoldsNoSlice(t *testing.T) {
	client, server := pair(t, &Config{BufferSize: 1 << 20})
	const idle = 40
	type idleCopy struct {
		c, s *Stream
		pw   *io.PipeWriter
		done chan error
		n    int64
	}
	copies := make([]*idleCopy, idle)
	for i := range copies {
		c, s := streamPair(t, client, server)
		pr, pw := io.Pipe()
		t.Cleanup(func() { pw.Close() })
		cp := &idleCopy{c: c, s: s, pw: pw, done: make(chan error, 1)}
		go func() {
			n, err := c.ReadFrom(pr)
			cp.n = n
			cp.done <- err
		}()
		waitsInSource(t, c)
		copies[i] = cp
	}
	releaseWarm(client, server)
	eventually(t, func() bool { return sum(client.Stats().SlicesInUse) == 0 }, "no slice in use while the readers say nothing")

	// Another stream writes through shared memory meanwhile.
	c, s := streamPair(t, client, server)
	msg := randomBytes(512<<10, 3)
	full := client.Stats().MemoryFull
	wrote := make(chan error, 1)
	go func() {
		_, err := c.Write(msg)
		wrote <- err
	}()
	got := make([]byte, len(msg))
	_, err := io.ReadFull(s, got)
	require.NoError(t, err)
	require.NoError(t, result(t, wrote))
	require.Equal(t, msg, got)
	require.Equal(t, full, client.Stats().MemoryFull, "the write found the region full")

	// Small writes, then bulk, then the end, through each source.
	for i, cp := range copies {
		small := []byte(fmt.Sprintf("copy %d", i))
		bulk := randomBytes(200<<10, uint64(i))
		go func() {
			cp.pw.Write(small)
			cp.pw.Write(bulk)
			cp.pw.Close()
		}()
		want := append(small, bulk...)
		got := make([]byte, len(want))
		_, err := io.ReadFull(cp.s, got)
		require.NoError(t, err)
		require.Equal(t, want, got, "copy %d", i)
		require.NoError(t, result(t, cp.done))
		require.EqualValues(t, len(want), cp.n)
	}
}

// srcSockets returns the two ends of a connected pair of sockets of the
// given kind ("unix" or "tcp"), closed when the test ends: ReadFrom reads
// the second, the test writes into the first.
func srcSockets(t *testing.T, kind string) (net.Conn, net.Conn) {
	t.Helper()
	if kind == "unix" {
		a, b := socketPair(t)
		t.Cleanup(func() { a.Close(); b.Close() })
		return a, b
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	defer ln.Close()
	a, err := net.Dial("tcp", ln.Addr().String())
	require.NoError(t, err)
	b, err := ln.Accept()
	require.NoError(t, err)
	t.Cleanup(func() { a.Close(); b.Close() })
	return a, b
}

// waitsInSource waits until st's ReadFrom waits on its source.
func waitsInSource(t *testing.T, st *Stream) {
	t.Helper()
	waitFor(t, "ReadFrom waits on its source", func() bool {
		st.mu.Lock()
		defer st.mu.Unlock()
		return st.srcRead
	})
}

// io.Copy(stream, conn) from a socket that says nothing holds no shared
// memory (a proxy's idle connections): ReadFrom waits for the socket's
// bytes before it takes a slice for them, and hands every byte over in
// order. Before, each waiting ReadFrom held a slice of up to 64 KiB, and a
// few hundred idle connections held the whole region. Its source's read
// deadline still ends it, with the source's error.
func TestReadFromIdleSocketHoldsNoSlice(t *testing.T) {
	for _, kind := range []string{"unix", "tcp"} {
		t.Run(kind, func(t *testing.T) {
			client, server := pair(t, nil)
			c, s := streamPair(t, client, server)
			in, src := srcSockets(t, kind)
			type copied struct {
				n   int64
				err error
			}
			done := make(chan copied, 1)
			go func() {
				// As a proxy copies: for TCP, TCPConn.WriteTo calls ReadFrom
				// with a wrapper of the connection.
				n, err := io.Copy(c, src)
				done <- copied{n, err}
			}()
			idle := func(what string) {
				t.Helper()
				waitsInSource(t, c)
				releaseWarm(client, server)
				eventually(t, func() bool { return sum(client.Stats().SlicesInUse) == 0 }, what)
			}
			idle("no slice in use before the source's first bytes")

			var sent []byte
			for round := range 3 {
				msg := bytes.Repeat([]byte{byte('a' + round)}, 1000+round*70000)
				_, err := in.Write(msg)
				require.NoError(t, err)
				sent = append(sent, msg...)
				got := make([]byte, len(msg))
				_, err = io.ReadFull(s, got)
				require.NoError(t, err)
				require.Equal(t, msg, got)
				idle("no slice in use while the source is idle again")
			}

			// The source's read deadline ends ReadFrom with its error.
			require.NoError(t, src.SetReadDeadline(time.Now()))
			var r copied
			select {
			case r = <-done:
			case <-time.After(10 * time.Second):
				t.Fatal("ReadFrom still waits after its source's read deadline")
			}
			require.ErrorIs(t, r.err, os.ErrDeadlineExceeded)
			require.EqualValues(t, len(sent), r.n)
			releaseWarm(client, server)
			eventually(t, func() bool { return sum(client.Stats().SlicesInUse) == 0 }, "no slice left reserved")

			// Then the source's end ends it with nil.
			require.NoError(t, src.SetReadDeadline(time.Time{}))
			go func() {
				n, err := io.Copy(c, src)
				done <- copied{n, err}
			}()
			waitsInSource(t, c)
			_, err := in.Write([]byte("end"))
			require.NoError(t, err)
			require.NoError(t, in.Close())
			r = <-done
			require.NoError(t, r.err)
			require.EqualValues(t, 3, r.n)
			got := make([]byte, 3)
			_, err = io.ReadFull(s, got)
			require.NoError(t, err)
			require.Equal(t, "end", string(got))
		})
	}
}

// A Close while ReadFrom waits for its socket's bytes returns at once, as
// one while it waits in any reader's Read: the peer reads the end of the
// stream, and ReadFrom returns ErrStreamClosed when the socket has
// something to say, leaving those bytes in the socket.
func TestCloseDuringReadFromSocket(t *testing.T) {
	client, server := pair(t, nil)
	c, s := streamPair(t, client, server)
	in, src := srcSockets(t, "unix")
	copied := make(chan error, 1)
	go func() {
		_, err := c.ReadFrom(src)
		copied <- err
	}()
	waitsInSource(t, c)
	closed := make(chan error, 1)
	go func() { closed <- c.Close() }()
	require.NoError(t, result(t, closed))
	_, err := s.Read(make([]byte, 1))
	require.ErrorIs(t, err, io.EOF, "the peer reads the end of the stream")
	_, err = in.Write([]byte("late"))
	require.NoError(t, err)
	require.ErrorIs(t, result(t, copied), ErrStreamClosed)
	got := make([]byte, 4)
	require.NoError(t, src.SetReadDeadline(time.Now().Add(10*time.Second)))
	_, err = io.ReadFull(src, got)
	require.NoError(t, err, "the bytes stay in the socket")
	require.Equal(t, "late", string(got))
	require.NoError(t, s.Close())
	releaseWarm(client, server)
	eventually(t, func() bool { return sum(client.Stats().SlicesInUse) == 0 }, "every slice freed")
}
