package session

import (
	"errors"
	"io"
	"net"
	"os"
	"path/filepath"
	"testing"

	"github.com/shmlink/shmlink/buffer"
	"github.com/shmlink/shmlink/internal/shm"
	"github.com/shmlink/shmlink/internal/wire"
	"github.com/shmlink/shmlink/queue"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"
)

// truncClient is a client that keeps the files of its shared memory, so
// that it can truncate them under the server's mapping, as a hostile or
// broken peer may (docs/protocol.md section 13).
type truncClient struct {
	mem    *memory
	files  []*os.File // buffer, queue
	server *Session
	conn   *net.UnixConn
	write  func([]byte) error
}

// memfdUnsealed creates a memfd of size bytes the way a peer that does not
// seal it would; allowSealing leaves the server the choice to.
func memfdUnsealed(t *testing.T, size int, allowSealing bool) *os.File {
	t.Helper()
	flags := unix.MFD_CLOEXEC
	if allowSealing {
		flags |= unix.MFD_ALLOW_SEALING
	}
	fd, err := unix.MemfdCreate("shmlink-test", flags)
	require.NoError(t, err)
	require.NoError(t, unix.Ftruncate(fd, int64(size)))
	return os.NewFile(uintptr(fd), "memfd")
}

// newTruncClient runs a v3 handshake with memory of type mt: files in a
// temporary ShmDir, or memfds made by memfdUnsealed.
func newTruncClient(t *testing.T, mt MemoryType, allowSealing bool) *truncClient {
	t.Helper()
	dir := t.TempDir()
	cfg := (&Config{ShmDir: dir}).withDefaults()
	cc, sc := socketPair(t)
	done := make(chan *Session, 1)
	go func() {
		s, err := Server(sc, &Config{ShmDir: dir})
		if err != nil {
			t.Error(err)
		}
		done <- s
	}()
	meta := wire.ShmMetadata{BufferPath: filepath.Join(dir, "b"), QueuePath: filepath.Join(dir, "q")}
	qsize := queue.Size(cfg.QueueCap)
	var files []*os.File
	if mt == MemoryFile {
		for _, f := range []struct {
			path string
			size int
		}{{meta.BufferPath, cfg.BufferSize}, {meta.QueuePath, qsize}} {
			file, err := shm.CreateFile(f.path, f.size)
			require.NoError(t, err)
			files = append(files, file)
		}
	} else {
		files = []*os.File{memfdUnsealed(t, cfg.BufferSize, allowSealing), memfdUnsealed(t, qsize, allowSealing)}
	}
	mem := &memory{}
	var err error
	mem.bufMem, err = shm.Map(int(files[0].Fd()), cfg.BufferSize)
	require.NoError(t, err)
	mem.queueMem, err = shm.Map(int(files[1].Fd()), qsize)
	require.NoError(t, err)
	mem.region, err = buffer.Format(mem.bufMem, cfg.SizeClasses)
	require.NoError(t, err)
	mem.send, mem.recv, err = queue.FormatPair(mem.queueMem, cfg.QueueCap)
	require.NoError(t, err)
	_, err = shareV3(cc, cc, mt, meta, files)
	require.NoError(t, err)
	server := <-done
	require.NotNil(t, server)
	tc := &truncClient{mem: mem, files: files, server: server, conn: cc,
		write: func(b []byte) error { _, err := cc.Write(b); return err }}
	t.Cleanup(func() {
		server.Close()
		cc.Close()
		// Our own mapping outlives the truncation: unmap without touching it.
		shm.Unmap(mem.bufMem)
		shm.Unmap(mem.queueMem)
		closeFiles(files)
	})
	return tc
}

// put puts a message of n bytes for stream id, without waking the server.
func (tc *truncClient) put(t *testing.T, id uint32, n int) {
	t.Helper()
	var w buffer.ChainWriter
	w.Reset(tc.mem.region)
	_, err := w.Write(make([]byte, n))
	require.NoError(t, err)
	head, _ := w.Finish()
	require.NoError(t, tc.mem.send.Put(queue.Event{StreamID: id, Offset: head}))
}

// wake sends the server a Polling.
func (tc *truncClient) wake(t *testing.T) {
	t.Helper()
	require.NoError(t, tc.write(wire.AppendSimple(nil, 3, wire.TypePolling)))
}

// send puts a message of n bytes for stream id and wakes the server.
func (tc *truncClient) send(t *testing.T, id uint32, n int) {
	t.Helper()
	tc.put(t, id, n)
	tc.wake(t)
}

// A peer that truncates its shared memory after the handshake ends its
// session with an error; the process lives. Each case truncates the buffer
// or the queue, for memfds the peer did not let us seal and for files,
// and the server faults in its receive loop or in a reader copying out.
func TestTruncatedMemory(t *testing.T) {
	for _, mt := range []MemoryType{MemoryMemfd, MemoryFile} {
		t.Run(mt.String()+"/queue/receive-loop", func(t *testing.T) {
			tc := newTruncClient(t, mt, false)
			require.NoError(t, tc.files[1].Truncate(0))
			tc.wake(t)
			waitDone(t, tc.server.Done(), "the session's end")
			require.ErrorContains(t, tc.server.Err(), "truncated")
		})
		t.Run(mt.String()+"/buffer/receive-loop", func(t *testing.T) {
			tc := newTruncClient(t, mt, false)
			tc.put(t, 2, 100)
			// The event is in the queue, whole; its slice is gone.
			require.NoError(t, tc.files[0].Truncate(0))
			tc.wake(t)
			waitDone(t, tc.server.Done(), "the session's end")
			require.ErrorContains(t, tc.server.Err(), "truncated")
		})
		t.Run(mt.String()+"/buffer/reader", func(t *testing.T) {
			tc := newTruncClient(t, mt, false)
			tc.send(t, 2, 64<<10) // opens stream 2 with 64 KiB in it
			st := accept(t, tc.server)
			waitFor(t, "the message", func() bool { return st.Buffered() == 64<<10 })
			require.NoError(t, tc.files[0].Truncate(0))
			_, err := st.Read(make([]byte, 64<<10))
			require.Error(t, err)
			waitDone(t, tc.server.Done(), "the session's end")
			require.ErrorContains(t, tc.server.Err(), "truncated")
		})
	}
}

// truncatingWriter is the writer of a WriteTo that truncates f, the peer's
// buffer, in its first Write and then reads the bytes it was given, as
// any writer copying them would.
type truncatingWriter struct {
	f   *os.File
	sum byte
}

func (w *truncatingWriter) Write(p []byte) (int, error) {
	if err := w.f.Truncate(0); err != nil {
		return 0, err
	}
	for _, c := range p {
		w.sum += c
	}
	return len(p), nil
}

// truncatingReader is the source of a ReadFrom: its first Read fills p,
// so that ReadFrom would read the next one in place; its second truncates
// f, the peer's buffer, and then fills p too.
type truncatingReader struct {
	f     *os.File
	reads int
}

func (r *truncatingReader) Read(p []byte) (int, error) {
	if r.reads++; r.reads == 2 {
		if err := r.f.Truncate(0); err != nil {
			return 0, err
		}
	}
	for i := range p {
		p[i] = byte(i)
	}
	return len(p), nil
}

// io.Copy hands shared memory to the application's writer or reader
// through WriteTo and ReadFrom. On memory the peer can truncate, a writer
// or reader that copies the bytes itself gets a copy on the heap instead:
// the peer's truncation ends the session with an error, and the process
// lives (it died of SIGBUS in the writer's loop before).
func TestTruncatedMemoryCopy(t *testing.T) {
	for _, mt := range []MemoryType{MemoryMemfd, MemoryFile} {
		t.Run(mt.String()+"/WriteTo", func(t *testing.T) {
			tc := newTruncClient(t, mt, false)
			tc.put(t, 2, 64<<10)
			tc.send(t, 2, 64<<10)
			st := accept(t, tc.server)
			waitFor(t, "the messages", func() bool { return st.Buffered() == 128<<10 })
			n, err := st.WriteTo(&truncatingWriter{f: tc.files[0]})
			require.Error(t, err)
			require.Equal(t, int64(64<<10), n, "the first message, copied before the truncation")
			waitDone(t, tc.server.Done(), "the session's end")
			require.ErrorContains(t, tc.server.Err(), "truncated")
		})
		t.Run(mt.String()+"/ReadFrom", func(t *testing.T) {
			tc := newTruncClient(t, mt, false)
			tc.send(t, 2, 1)
			st := accept(t, tc.server)
			r := &truncatingReader{f: tc.files[0]}
			_, err := st.ReadFrom(r)
			require.Error(t, err)
			require.Equal(t, 2, r.reads)
			waitDone(t, tc.server.Done(), "the session's end")
			require.ErrorContains(t, tc.server.Err(), "truncated")
		})
	}
}

// errStop ends a WriteTo or a ReadFrom of the tests below.
var errStop = errors.New("stop")

// sliceRecorder is the writer of a WriteTo, or the source of a ReadFrom,
// that records whether the bytes it got lie in s's shared memory. As a
// source, its first Read fills p, so that the second may be in place.
type sliceRecorder struct {
	s      *Session
	reads  int
	shared bool
}

func (r *sliceRecorder) Write(p []byte) (int, error) {
	r.shared = inMapping(r.s, p)
	return len(p), errStop
}

func (r *sliceRecorder) Read(p []byte) (int, error) {
	if r.reads++; r.reads == 2 {
		r.shared = inMapping(r.s, p)
		return 0, errStop
	}
	return len(p), nil
}

// WriteTo and ReadFrom hand the application's writer and reader shared
// memory itself (zero copy) where the peer cannot shrink it: a memfd that
// the server sealed. Where it can (files, a memfd the peer did not let us
// seal), they go through the heap.
func TestCopyZeroOnlyOnSealedMemory(t *testing.T) {
	for _, tc := range []struct {
		name         string
		mt           MemoryType
		allowSealing bool
	}{{"memfd-sealed", MemoryMemfd, true}, {"memfd-unsealed", MemoryMemfd, false}, {"file", MemoryFile, false}} {
		t.Run(tc.name, func(t *testing.T) {
			c := newTruncClient(t, tc.mt, tc.allowSealing)
			c.send(t, 2, 64<<10)
			st := accept(t, c.server)
			w := &sliceRecorder{s: c.server}
			_, err := st.WriteTo(w)
			require.ErrorIs(t, err, errStop)
			require.Equal(t, tc.allowSealing, w.shared, "WriteTo's bytes in shared memory")
			r := &sliceRecorder{s: c.server}
			_, err = st.ReadFrom(r)
			require.ErrorIs(t, err, errStop)
			require.Equal(t, 2, r.reads)
			require.Equal(t, tc.allowSealing, r.shared, "ReadFrom's second Read into shared memory")
		})
	}
}

// Between two shmlink sessions, memfds cannot shrink on either side (the
// client seals what it creates) and files can: io.Copy is zero copy over
// the former only.
func TestMemSealed(t *testing.T) {
	for _, mt := range []MemoryType{MemoryMemfd, MemoryFile} {
		t.Run(mt.String(), func(t *testing.T) {
			cfg := &Config{MemoryType: mt, ShmDir: t.TempDir()}
			client, server := pair(t, cfg)
			require.Equal(t, mt == MemoryMemfd, client.memSealed(), "client")
			require.Equal(t, mt == MemoryMemfd, server.memSealed(), "server")
		})
	}
}

// A peer that puts its close of a stream in the IO queue and then closes
// the connection with our bytes unread makes our read fail with
// ECONNRESET, not io.EOF; the close is still delivered. A stream we closed
// first is forgotten with the session, whether the peer's close came
// (queued) or not (dropped), not left tracked by the ended session.
func TestResetAfterQueuedClose(t *testing.T) {
	for _, mt := range []MemoryType{MemoryMemfd, MemoryFile} {
		for _, queued := range []bool{true, false} {
			name := mt.String() + "/queued"
			if !queued {
				name = mt.String() + "/dropped"
			}
			t.Run(name, func(t *testing.T) {
				tc := newTruncClient(t, mt, false)
				tc.send(t, 2, 100)
				st := accept(t, tc.server)
				_, err := st.Read(make([]byte, 100))
				require.NoError(t, err)
				tc.send(t, 4, 10) // stays open on our side
				open := accept(t, tc.server)
				_, err = open.Read(make([]byte, 10))
				require.NoError(t, err)
				// Our close goes out with a Polling the client never
				// reads: that unread byte turns its close into a reset.
				require.NoError(t, st.Close())
				require.Equal(t, 2, tc.server.Stats().ActiveStreams, "2 routed until the client's close")
				if queued {
					require.NoError(t, tc.mem.send.Put(queue.Event{StreamID: 2, Status: 1}))
					require.NoError(t, tc.mem.send.Put(queue.Event{StreamID: 4, Status: 1}))
				}
				raw, err := tc.conn.SyscallConn()
				require.NoError(t, err)
				waitFor(t, "our Polling reaches the client", func() bool {
					n := 0
					require.NoError(t, raw.Control(func(fd uintptr) {
						n, err = unix.IoctlGetInt(int(fd), unix.SIOCINQ)
					}))
					return err == nil && n > 0
				})
				require.NoError(t, tc.conn.Close())
				waitDone(t, tc.server.Done(), "the session's end")
				require.ErrorIs(t, tc.server.Err(), ErrPeerClosed)
				_, err = open.Read(make([]byte, 1))
				if queued {
					require.ErrorIs(t, err, io.EOF, "the peer's close was delivered")
				} else {
					require.ErrorIs(t, err, ErrPeerClosed)
				}
				require.Equal(t, 1, tc.server.Stats().ActiveStreams, "the open stream")
				require.NoError(t, open.Close())
				require.Equal(t, 0, tc.server.Stats().ActiveStreams)
			})
		}
	}
}

// A memfd whose creator allowed sealing is sealed against shrinking by
// the server: the peer can no longer truncate it.
func TestMemfdSealedByServer(t *testing.T) {
	tc := newTruncClient(t, MemoryMemfd, true)
	require.True(t, tc.server.shm.mem.sealed)
	require.Error(t, tc.files[0].Truncate(0), "the buffer is sealed")
	require.Error(t, tc.files[1].Truncate(0), "the queue is sealed")
	tc.send(t, 2, 100)
	st := accept(t, tc.server)
	n, err := st.Read(make([]byte, 100))
	require.NoError(t, err)
	require.Equal(t, 100, n)
}

// A fault without its address (qemu-user delivers SIGBUS so, and the
// runtime reports it as a nil dereference) ends the guarded call with a
// fault error, as one with an address does; any other panic goes on.
func TestGuardAddresslessFault(t *testing.T) {
	var p *[4096]byte
	err := guard(func() error { p[0] = 1; return nil })
	require.True(t, isFault(err), "%v", err)
	require.ErrorIs(t, err, buffer.ErrCorrupt)
	require.PanicsWithValue(t, "not a fault", func() {
		guard(func() error { panic("not a fault") })
	})
}
