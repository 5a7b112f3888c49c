package session

import (
	"context"
	"encoding/binary"
	"fmt"
	"io"
	"net"
	"os"
	"runtime"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/shmlink/shmlink/internal/wire"
)

// The tests here play a client that stops reading its control connection
// (docs/protocol.md section 13). A write of ours that falls back to the
// socket then waits for the connection, held by another stream's blocked
// write, or blocks in its own write: its stream's Close, its write
// deadline (also one set meanwhile) and OpenStream's context must end that
// wait, as they end a socket's, and not Config.WriteTimeout, set to a
// minute here. What was written of a message is completed, so the peer
// still reads whole messages, each stream's close after its data.

// ctlLog reads the client's end of the connection from the moment it is
// started, as the peer would, and records each stream's FallbackData bytes
// and whether its StreamClose came, and after what.
type ctlLog struct {
	conn   net.Conn
	bytes  map[uint32]int
	closed map[uint32]bool
	late   map[uint32]bool   // FallbackData after the stream's StreamClose
	last   map[uint32]string // the stream's last FallbackData bytes, if under 16
	done   chan error
}

// startCtlLog reads cc on a goroutine until stop returns true for a
// message just read, or the connection fails.
func startCtlLog(cc net.Conn, stop func(l *ctlLog) bool) *ctlLog {
	l := &ctlLog{conn: cc, bytes: map[uint32]int{}, closed: map[uint32]bool{},
		late: map[uint32]bool{}, last: map[uint32]string{}, done: make(chan error, 1)}
	go func() {
		for {
			h, payload, err := readCtlMsg(cc)
			if err != nil {
				l.done <- err
				return
			}
			switch h.Type {
			case wire.TypeFallbackData:
				id, _, data, err := wire.ParseFallback(payload)
				if err != nil {
					l.done <- err
					return
				}
				l.bytes[id] += len(data)
				l.late[id] = l.late[id] || l.closed[id]
				l.last[id] = ""
				if len(data) < 16 {
					l.last[id] = string(data)
				}
			case wire.TypeStreamClose:
				l.closed[binary.BigEndian.Uint32(payload)] = true
			}
			if stop(l) {
				l.done <- nil
				return
			}
		}
	}()
	return l
}

// silentClient starts a server with Fallback on, against a raw client
// with a 64 KiB region of 4 KiB slices that it never frees, and opens n
// streams, whose server ends it returns; cc is the client's socket, which
// nobody reads until the test does.
func silentClient(t *testing.T, n int) (server *Session, cc net.Conn, sts []*Stream) {
	t.Helper()
	mem, server, cc := rawClientConn(t,
		&Config{BufferSize: 64 << 10, SizeClasses: tinyConfig().SizeClasses},
		&Config{Fallback: true, WriteTimeout: time.Minute})
	write := func(b []byte) error { _, err := cc.Write(b); return err }
	for i := range n {
		announceRaw(t, mem, uint32(2+i), write)
		sts = append(sts, accept(t, server))
	}
	return server, cc, sts
}

// blockedWrite starts a write of n bytes on st and waits until some write
// blocks in the socket, which the client does not read: st's, or one of
// another stream that holds the connection.
func blockedWrite(t *testing.T, st *Stream, n int) <-chan error {
	t.Helper()
	done := make(chan error, 1)
	go func() {
		_, err := st.Write(make([]byte, n))
		done <- err
	}()
	waitFor(t, "a write blocks in the socket", func() bool { return goroutineWaits("(*Session).writeTimed", "IO wait") })
	return done
}

func TestCloseEndsSocketWrite(t *testing.T) {
	for _, tc := range []struct {
		name    string
		waiting bool // b waits for the connection behind a, else b writes
	}{
		{"waiting", true},
		{"writing", false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			server, cc, sts := silentClient(t, 2)
			a, b := sts[0], sts[1]

			var aDone, bDone <-chan error
			if tc.waiting {
				aDone = blockedWrite(t, a, 8<<20)
				done := make(chan error, 1)
				go func() { _, err := b.Write(make([]byte, 1<<20)); done <- err }()
				bDone = done
				waitFor(t, "b waits for the connection", func() bool { return goroutineWaits("(*Session).acquireCtl", "select") })
			} else {
				bDone = blockedWrite(t, b, 8<<20)
			}
			closed := make(chan error, 1)
			go func() { closed <- b.Close() }()
			require.NoError(t, result(t, closed), "Close waits for the peer to read")
			require.ErrorIs(t, result(t, bDone), ErrStreamClosed)

			// The peer reads again: everything arrives whole, b's close
			// after b's data.
			l := startCtlLog(cc, func(l *ctlLog) bool { return l.closed[3] && (!tc.waiting || l.bytes[2] > 0) })
			require.NoError(t, result(t, l.done))
			require.False(t, l.late[3], "b's data came after its close")
			go io.Copy(io.Discard, cc)
			if aDone != nil {
				require.NoError(t, result(t, aDone))
			}
			require.NoError(t, server.Err())
		})
	}
}

// A write deadline set while the write blocks in the socket ends it then.
func TestWriteDeadlineSetDuringSocketWrite(t *testing.T) {
	server, cc, sts := silentClient(t, 1)
	a := sts[0]
	var n int
	done := make(chan error, 1)
	go func() {
		var err error
		n, err = a.Write(make([]byte, 8<<20))
		done <- err
	}()
	waitFor(t, "a write blocks in the socket", func() bool { return goroutineWaits("(*Session).writeTimed", "IO wait") })
	require.NoError(t, a.SetWriteDeadline(time.Now()))
	require.ErrorIs(t, result(t, done), os.ErrDeadlineExceeded)
	require.NoError(t, server.Err(), "a caller's deadline does not end the session")

	// The rest of the message cut short still goes out, then a's next
	// one: the peer reads whole messages.
	require.NoError(t, a.SetWriteDeadline(time.Time{}))
	l := startCtlLog(cc, func(l *ctlLog) bool { return l.last[2] == "!" })
	_, err := a.Write([]byte("!"))
	require.NoError(t, err)
	require.NoError(t, result(t, l.done))
	require.LessOrEqual(t, l.bytes[2], n+1, "the peer got bytes that Write did not count")
	require.NoError(t, server.Err())
}

// OpenStream's context ends its announcement when that goes as
// FallbackData (no slice is free) and waits for the connection or blocks
// in the socket, which the server does not read.
func TestOpenStreamContextEndsSocketWrite(t *testing.T) {
	for _, tc := range []struct {
		name  string
		state string // where the announcement waits
		fn    string
	}{
		{"waiting", "select", "(*Session).acquireCtl"},
		{"writing", "IO wait", "(*Session).writeTimed"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cc, sc := socketPair(t)
			handshaken := make(chan error, 1)
			var smem *memory
			go func() {
				cfg := (&Config{}).withDefaults()
				var err error
				smem, _, err = serverHandshakeMarking(sc, &cfg, true) // and then never reads sc
				handshaken <- err
			}()
			client, err := Client(cc, tinyConfig())
			require.NoError(t, err)
			require.NoError(t, <-handshaken)
			t.Cleanup(func() { client.Close(); sc.Close(); smem.release() })

			// No slice is free, and another writer holds the connection.
			client.shm.mu.RLock()
			region := client.shm.mem.region
			for {
				if _, err := region.Alloc(0); err != nil {
					break
				}
			}
			client.shm.mu.RUnlock()
			client.ctl.sem <- struct{}{}
			if tc.state == "IO wait" {
				// It fills the socket and lets go: past a large write, the
				// socket may still take a small one.
				for _, n := range []int{16 << 20, 1} {
					require.NoError(t, cc.SetWriteDeadline(time.Now().Add(20*time.Millisecond)))
					for err == nil {
						_, err = cc.Write(make([]byte, n))
					}
					require.ErrorIs(t, err, os.ErrDeadlineExceeded)
					err = nil
				}
				require.NoError(t, cc.SetWriteDeadline(time.Time{}))
				<-client.ctl.sem
			}

			ctx, cancel := context.WithCancel(context.Background())
			done := make(chan error, 1)
			go func() {
				_, err := client.OpenStream(ctx)
				done <- err
			}()
			waitFor(t, "the announcement waits", func() bool { return goroutineWaits(tc.fn, tc.state) })
			cancel()
			require.ErrorIs(t, result(t, done), context.Canceled)
			require.NoError(t, client.Err(), "a caller's context does not end the session")
			if tc.state == "select" {
				<-client.ctl.sem
			}
		})
	}
}

// Closes that find the connection held (here by the test, as by another
// stream's write that the peer does not take) do not wait, and cost one
// closer goroutine between them, not one each; they reach the peer once
// the connection is free.
func TestClosesOwedWhileConnectionHeld(t *testing.T) {
	client, server := pair(t, nil)
	const n = 200
	var cs, ss []*Stream
	for range n {
		c, s := streamPair(t, client, server)
		cs, ss = append(cs, c), append(ss, s)
		s.wmu.Lock()
		s.viaSocket = true // as after FallbackData: its close goes as StreamClose
		s.wmu.Unlock()
	}
	server.ctl.sem <- struct{}{}
	before := runtime.NumGoroutine()
	for _, s := range ss {
		require.NoError(t, s.Close())
	}
	require.Less(t, runtime.NumGoroutine()-before, 10, "a goroutine per close")
	server.releaseCtl()
	for _, c := range cs {
		require.NoError(t, c.SetReadDeadline(time.Now().Add(10*time.Second)))
		_, err := c.Read(make([]byte, 1))
		require.ErrorIs(t, err, io.EOF, "stream %d", c.ID())
	}
}

// A session's Close lets the connection's owed writes finish first: the
// rest of a message cut by its stream's Close (a flusher's) and the
// StreamClose owed behind it. Closing the connection under them would end
// it inside a message, and the peer's session would end with an error
// instead of reading every message whole. Found by TestSoak: a Dialer
// closed a session that had gone idle while such a rest was owed.
func TestSessionCloseFinishesOwedWrites(t *testing.T) {
	mem, server, cc := rawClientConn(t,
		&Config{BufferSize: 64 << 10, SizeClasses: tinyConfig().SizeClasses},
		&Config{Fallback: true, WriteTimeout: time.Minute})
	announceRaw(t, mem, 2, func(b []byte) error { _, err := cc.Write(b); return err })
	a := accept(t, server)
	aDone := blockedWrite(t, a, 8<<20)
	require.NoError(t, a.Close(), "Close waits for the peer to read")
	require.ErrorIs(t, result(t, aDone), ErrStreamClosed)
	// The peer took every event, as a live one does: Close's wait for the
	// send queue (drainSend) has nothing to wait for there.
	for {
		_, ok, err := mem.recv.Pop()
		require.NoError(t, err)
		if !ok {
			break
		}
	}

	closed := make(chan error, 1)
	go func() { closed <- server.Close() }()
	// The old code closed the connection at once; the new one waits for the
	// peer to take the owed bytes (for at most a second, drainSend).
	waitFor(t, "Close closes the connection or waits for the owed writes", func() bool {
		return len(closed) > 0 || goroutineWaits("(*Session).drainSend", "select")
	})

	// The peer reads again: whole messages, a's close among them, then
	// the connection's end between two messages.
	var closes int
	var err error
	for {
		var hdr [wire.HeaderSize]byte
		if _, err = io.ReadFull(cc, hdr[:]); err != nil {
			break
		}
		h, perr := wire.ParseHeader(hdr[:], 1<<20)
		require.NoError(t, perr)
		payload := make([]byte, int(h.Length)-wire.HeaderSize)
		if _, err = io.ReadFull(cc, payload); err != nil {
			err = fmt.Errorf("%d-byte message of type %d cut after its header: %v", h.Length, h.Type, err) // not io.EOF
			break
		}
		if h.Type == wire.TypeStreamClose && binary.BigEndian.Uint32(payload) == a.ID() {
			closes++
		}
	}
	require.ErrorIs(t, err, io.EOF, "the connection ended inside a message")
	require.NotErrorIs(t, err, io.ErrUnexpectedEOF, "the connection ended inside a message")
	require.Equal(t, 1, closes, "the stream's close reached the peer")
	require.NoError(t, result(t, closed))
}
