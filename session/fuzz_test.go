package session

import (
	"context"
	"encoding/binary"
	"io"
	"net"
	"testing"
	"time"

	"github.com/shmlink/shmlink/buffer"
	"github.com/shmlink/shmlink/internal/wire"
	"github.com/shmlink/shmlink/queue"
	"github.com/stretchr/testify/require"
)

// FuzzServerHandshake feeds arbitrary client bytes to the server side of the
// handshake, over a Unix socket (so the memfd path is reachable) and over a
// pipe. Every input must end in a handshake error or a session, never a
// panic or a hang, and the server's end of the connection is closed after
// either (the session owns it). The input carries no descriptors, so that
// end is all there is to leave open.
func FuzzServerHandshake(f *testing.F) {
	f.Add([]byte{0, 0, 0, 8, 0x77, 0x58, 3, 4}, false)
	f.Add(append([]byte{0, 0, 0, 8, 0x77, 0x58, 3, 4}, wire.AppendShareMemory(nil, 3, wire.TypeShareMemoryByMemfd, wire.ShmMetadata{QueuePath: "q", BufferPath: "b"})...), true)
	f.Add(wire.AppendShareMemory(nil, 2, wire.TypeShareMemoryByFilePath, wire.ShmMetadata{QueuePath: "/dev/shm/q", BufferPath: "/etc/passwd"}), false)
	f.Add(append([]byte{0, 0, 0, 8, 0x77, 0x58, 3, 4}, wire.AppendShareMemory(nil, 3, wire.TypeShareMemoryByFilePath, wire.ShmMetadata{QueuePath: "/dev/shm/../q", BufferPath: "/dev/shm/b"})...), true)
	f.Add([]byte{0xff, 0xff, 0xff, 0xff, 0x77, 0x58, 2, 0}, true)
	f.Add([]byte("GET / HTTP/1.1\r\n\r\n"), false)
	cfg := &Config{ShmDir: "/dev/shm", HandshakeTimeout: 200 * time.Millisecond}
	f.Fuzz(func(t *testing.T, input []byte, unixSocket bool) {
		var cc, sc net.Conn
		if unixSocket {
			cc, sc = socketPair(t)
		} else {
			cc, sc = net.Pipe()
		}
		defer cc.Close()
		go func() {
			cc.Write(input)
			// End of input: half-close where we can, so the server reads EOF
			// and may still answer; a pipe cannot, so the client goes away.
			if uc, ok := cc.(*net.UnixConn); ok {
				uc.CloseWrite()
				io.Copy(io.Discard, io.LimitReader(cc, 1<<16))
			}
			cc.Close()
		}()
		s, err := Server(sc, cfg)
		if err == nil {
			// Only a handshake naming real shared memory can succeed.
			s.Close()
		} else {
			require.ErrorIs(t, err, ErrHandshake)
		}
		_, err = sc.Read(make([]byte, 1))
		if unixSocket {
			require.ErrorIs(t, err, net.ErrClosed, "the server's end is still open")
		} else {
			require.ErrorIs(t, err, io.ErrClosedPipe, "the server's end is still open")
		}
	})
}

// FuzzReceive plays a hostile client: it scribbles over the buffer region
// and the IO queue both sides share and puts arbitrary events, then checks
// that the server session either keeps working or ends with an error, and
// that another session in the process is unaffected. Ops are 12-byte
// records: kind, target offset, value.
func FuzzReceive(f *testing.F) {
	rec := func(kind byte, off, val uint32, extra uint16) []byte {
		b := []byte{kind, 0, 0, 0}
		binary.LittleEndian.PutUint16(b[2:], extra)
		b = binary.LittleEndian.AppendUint32(b, off)
		return binary.LittleEndian.AppendUint32(b, val)
	}
	f.Add(rec(2, 8+36, 0, 2))                                      // event pointing at the first slice
	f.Add(append(rec(0, 8+36+12, 8+36, 0), rec(2, 8+36, 0, 2)...)) // a slice whose next is itself
	f.Add(append(rec(0, 8+36+4, 1<<30, 0), rec(2, 8+36, 0, 3)...)) // size beyond cap
	f.Add(rec(2, 12345, 0, 4))                                     // misaligned offset
	f.Add(rec(1, 4, 1<<31, 0))                                     // head of the queue jumps
	f.Add(append(rec(1, 12, 0xffffffff, 0), rec(3, 0, 0, 0)...))   // tail jumps, then a real write
	f.Add(rec(2, 0, 7, 5))                                         // bad status
	cfg := receiveFuzzConfig()
	f.Fuzz(func(t *testing.T, ops []byte) { fuzzReceive(t, cfg, ops) })
}

func receiveFuzzConfig() *Config {
	return &Config{
		BufferSize:       64 << 10,
		SizeClasses:      []buffer.SizeClass{{SliceSize: 1020, Percent: 60}, {SliceSize: 4092, Percent: 40}},
		QueueCap:         16,
		QueueFullTimeout: 100 * time.Millisecond,
	}
}

func fuzzReceive(t *testing.T, cfg *Config, ops []byte) {
	{
		client, server := pair(t, cfg)
		healthyC, healthyS := pair(t, nil)
		ctx := context.Background()
		for len(ops) >= 12 && !isClosedChan(server.dead) {
			// Touch the client's memory only while it is mapped: a session
			// that ended with no stream left unmaps it.
			client.shm.mu.RLock()
			if client.shm.mem == nil {
				client.shm.mu.RUnlock()
				break
			}
			mem := *client.shm.mem
			client.shm.mu.RUnlock()
			kind, extra := ops[0]%4, binary.LittleEndian.Uint16(ops[2:])
			off, val := binary.LittleEndian.Uint32(ops[4:]), binary.LittleEndian.Uint32(ops[8:])
			ops = ops[12:]
			switch kind {
			case 0, 1, 2:
				client.shm.mu.RLock()
				if client.shm.mem != nil {
					hostile(client, &mem, kind, extra, off, val)
				}
				client.shm.mu.RUnlock()
			case 3: // a well-formed write on a new stream
				if st, err := client.OpenStream(ctx); err == nil {
					st.SetWriteDeadline(time.Now().Add(time.Second))
					st.Write(make([]byte, 1+int(val%20000)))
				}
			}
		}
		probe(t, client, server)
		closed := make(chan struct{})
		go func() {
			client.Close()
			server.Close()
			close(closed)
		}()
		select {
		case <-closed:
		case <-time.After(10 * time.Second):
			t.Fatal("Close hung after hostile input")
		}
		// Another session in the process is unaffected: a byte goes through.
		st, err := healthyC.OpenStream(ctx)
		require.NoError(t, err)
		_, err = st.Write([]byte{'h'})
		require.NoError(t, err)
		ss, err := healthyS.AcceptStream(ctx)
		require.NoError(t, err)
		b := make([]byte, 1)
		_, err = io.ReadFull(ss, b)
		require.NoError(t, err)
		require.NoError(t, st.Close())
		require.NoError(t, ss.Close())
	}
}

// hostile applies one op of FuzzReceive to the client's mapped memory.
func hostile(client *Session, mem *memory, kind byte, extra uint16, off, val uint32) {
	switch kind {
	case 0: // write into the buffer region
		o := int(off) % (len(mem.bufMem) - 3) &^ 3
		binary.LittleEndian.PutUint32(mem.bufMem[o:], val)
	case 1: // write into the IO queue
		o := int(off) % (len(mem.queueMem) - 3) &^ 3
		binary.LittleEndian.PutUint32(mem.queueMem[o:], val)
	case 2: // put an arbitrary event and wake the server
		client.putMu.Lock()
		err := mem.send.Put(queue.Event{StreamID: uint32(extra), Offset: off, Status: val})
		client.putMu.Unlock()
		if err == nil && mem.send.MarkWorking() {
			client.writeCtl(client.ctl.pollMsg)
		}
	}
}

// probe opens a stream, writes a byte and reads it on the server, with
// deadlines: it returns when the byte arrived, either session ended, or
// 500 ms passed. The last is legitimate after a hostile peer overwrote its
// own send queue (say, left the working flag set, so it never wakes us):
// the protocol cannot tell that from an idle peer, and nothing of ours is
// harmed; what must hold is that Close stays prompt and other sessions
// work, which the callers check.
func probe(t *testing.T, client, server *Session) {
	st, err := client.OpenStream(context.Background())
	if err != nil {
		return
	}
	defer st.Close()
	st.SetWriteDeadline(time.Now().Add(2 * time.Second))
	if _, err := st.Write([]byte{'p'}); err != nil {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), 500*time.Millisecond)
	defer cancel()
	for {
		ss, err := server.AcceptStream(ctx)
		if err != nil {
			return
		}
		if ss.ID() == st.ID() {
			ss.SetReadDeadline(time.Now().Add(500 * time.Millisecond))
			b := make([]byte, 1)
			_, err := io.ReadFull(ss, b)
			if err == nil {
				require.Equal(t, byte('p'), b[0])
			}
			ss.Close()
			return
		}
		ss.Close()
	}
}
