package session

import (
	"encoding/binary"
	"errors"
	"io"
	"net"
	"syscall"
	"testing"
	"time"

	"github.com/shmlink/shmlink/buffer"
	"github.com/shmlink/shmlink/internal/wire"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"
)

// goServerDouble plays a server that behaves like shmipc-go's where
// shmlink must care (#18): it harvests its receive queue when a Polling
// arrives, but acts on the connection's end first when that is already
// there, dropping the events still queued. It records what it harvested.
type goServerDouble struct {
	mem     *memory
	conn    *net.UnixConn
	data    map[uint32][]byte // bytes harvested per stream
	closed  map[uint32]bool   // closes harvested
	dropped bool              // it saw the end with events still queued
	empties int               // events whose first slice held 0 bytes
	acks    chan uint64       // the epochs of the HotRestartAcks it got
}

// dialGoServerDouble makes a shmlink client session against a new
// double, which serves it on its own goroutine until the connection ends;
// served reports run's result. sc is the double's end of the connection.
func dialGoServerDouble(t *testing.T) (client *Session, g *goServerDouble, sc *net.UnixConn, served <-chan error) {
	t.Helper()
	cc, sc := socketPair(t)
	doubled := make(chan error, 1)
	g = &goServerDouble{conn: sc, data: map[uint32][]byte{}, closed: map[uint32]bool{}, acks: make(chan uint64, 4)}
	go func() {
		cfg := (&Config{}).withDefaults()
		var err error
		g.mem, _, err = serverHandshakeMarking(sc, &cfg, false) // no shmlink marker
		doubled <- err
	}()
	client, err := Client(cc, &Config{})
	require.NoError(t, err)
	require.NoError(t, <-doubled)
	t.Cleanup(g.mem.release)
	done := make(chan error, 1)
	go func() { done <- g.run() }()
	return client, g, sc, done
}

// eofPending reports whether the peer's end of the connection is already
// readable as the end, with nothing before it.
func (g *goServerDouble) eofPending() bool {
	raw, _ := g.conn.SyscallConn()
	eof := false
	raw.Control(func(fd uintptr) {
		var b [1]byte
		n, _, err := unix.Recvfrom(int(fd), b[:], unix.MSG_PEEK|unix.MSG_DONTWAIT)
		eof = n == 0 && err == nil
	})
	return eof
}

// followsEmptyFirst does what shmipc-go does with a chain whose first
// slice at off holds 0 bytes (docs/protocol.md section 8, item 1): it
// takes that slice's next field as the absolute offset of the next slice
// without looking at flag 0x01, and appends that slice's bytes to the
// stream. It reports false, doing nothing, for a first slice with bytes.
func (g *goServerDouble) followsEmptyFirst(id, off uint32) bool {
	b := g.mem.bufMem
	word := func(at uint32) uint32 { return binary.NativeEndian.Uint32(b[at:]) }
	if uint64(off)+20 > uint64(len(b)) || word(off+4) != 0 {
		return false
	}
	g.empties++
	next := word(off + 12)
	g.mem.region.Free(off)
	if uint64(next)+20 <= uint64(len(b)) {
		size, start := word(next+4), word(next+8)
		if end := uint64(next) + 20 + uint64(start) + uint64(size); size > 0 && end <= uint64(len(b)) {
			g.data[id] = append(g.data[id], b[uint64(next)+20+uint64(start):end]...)
		}
	}
	return true
}

func (g *goServerDouble) run() error {
	for {
		h, payload, err := readCtlMsg(g.conn)
		if err != nil {
			if errors.Is(err, io.EOF) {
				g.dropped = !g.mem.recv.Empty()
				return nil
			}
			return err
		}
		if h.Type == wire.TypeHotRestartAck {
			epoch, err := wire.ParseEpoch(payload)
			if err != nil {
				return err
			}
			g.acks <- epoch
		}
		if h.Type != wire.TypePolling {
			continue
		}
		if g.eofPending() { // the end is there: shmipc-go acts on it first
			g.dropped = !g.mem.recv.Empty()
			return nil
		}
		for {
			ev, ok, err := g.mem.recv.Pop()
			if err != nil {
				return err
			}
			if !ok {
				// Done: clear the working flag, so that the client's
				// next event comes with a Polling, and look once more.
				g.mem.recv.ClearWorking()
				if g.mem.recv.Empty() {
					break
				}
				continue
			}
			if ev.Offset != 0 && g.followsEmptyFirst(ev.StreamID, ev.Offset) {
				// shmipc-go's reading of an empty first slice (above).
			} else if ev.Offset != 0 {
				var cr buffer.ChainReader
				if err := cr.Reset(g.mem.region, ev.Offset); err != nil {
					return err
				}
				for {
					p, _, err := cr.Next()
					if err == io.EOF {
						break
					}
					if err != nil {
						return err
					}
					g.data[ev.StreamID] = append(g.data[ev.StreamID], p...)
				}
				g.mem.region.FreeChain(ev.Offset)
			}
			if ev.Status&0xff == stateClosed {
				g.closed[ev.StreamID] = true
			}
		}
	}
}

// A client that writes a stream, closes it and closes its session at once
// lets a shmipc-go server take the data and the close before the
// connection ends (#18: the server acted on the end first and read
// "stream closed" instead of the data and EOF, 3 times in 18).
func TestCloseDrainsForGoServer(t *testing.T) {
	for i := range 20 {
		client, g, _, served := dialGoServerDouble(t)
		c, err := client.OpenStream(t.Context())
		require.NoError(t, err)
		_, err = c.Write([]byte("last request"))
		require.NoError(t, err)
		require.NoError(t, c.Close())
		require.NoError(t, client.Close())
		require.NoError(t, <-served)
		require.False(t, g.dropped, "run %d: events left in the queue at the end", i)
		require.Equal(t, "last request", string(g.data[c.ID()]), "run %d", i)
		require.True(t, g.closed[c.ID()], "run %d: the close", i)
	}
}

// A shmlink client sends no stream announcement to a server that did not
// mark its region (shmipc-go's, the Rust crate's): such a server learns of
// a stream at its first byte, as from its own clients (#18: shmipc-go
// followed the empty slice's stale link, and the first bytes of every
// stream arrived as zeros or garbage; five streams opened without a write
// broke the next exchange). Against a shmlink server the announcement
// stays (TestAnnounce...).
func TestNoAnnouncementToGoServer(t *testing.T) {
	client, g, _, served := dialGoServerDouble(t)
	require.False(t, client.announces, "the double did not mark the region")
	var idle []*Stream
	for range 5 {
		c, err := client.OpenStream(t.Context())
		require.NoError(t, err)
		idle = append(idle, c)
	}
	c, err := client.OpenStream(t.Context())
	require.NoError(t, err)
	_, err = c.Write([]byte("request"))
	require.NoError(t, err)
	require.NoError(t, c.Close())
	require.NoError(t, client.Close())
	require.NoError(t, <-served)
	require.Zero(t, g.empties, "events with an empty first slice, which shmipc-go misreads")
	require.Equal(t, "request", string(g.data[c.ID()]))
	for _, st := range idle {
		require.Empty(t, g.data[st.ID()], "stream %d, never written", st.ID())
	}
}

// A shmlink server marks the region; its client announces streams.
func TestShmlinkServerMarksRegion(t *testing.T) {
	client, _ := pair(t, nil)
	require.True(t, client.announces)
}

// Against a shmipc-go server a hot restart ends the client's long-lived
// streams (#18, item 4; docs/protocol.md section 8): a shmlink client
// acknowledges only once its streams on the old session are done, and
// that server gives up after 2 s without the ack and closes the old
// session. Here the double sends HotRestart and then either closes the
// session, as after its 2 s, while a stream is open (the stream fails
// with the peer's end), or waits while the client closes its stream (the
// ack comes then).
func TestHotRestartAgainstGoServer(t *testing.T) {
	for _, how := range []string{"server-gives-up", "stream-ends-first"} {
		t.Run(how, func(t *testing.T) {
			client, g, sc, served := dialGoServerDouble(t)
			defer client.Close()
			c, err := client.OpenStream(t.Context())
			require.NoError(t, err)
			_, err = c.Write([]byte("long-lived"))
			require.NoError(t, err)

			_, err = sc.Write(wire.AppendHotRestart(nil, 3, wire.TypeHotRestart, 7))
			require.NoError(t, err)
			// A Dialer sends no new stream to a session draining so.
			eventually(t, func() bool { _, ok := client.HotRestartEpoch(); return ok }, "the client drains")
			select {
			case e := <-g.acks:
				t.Fatalf("ack %d while a stream is open", e)
			default:
			}
			if how == "server-gives-up" {
				require.NoError(t, sc.Close())
				<-served
				require.NoError(t, c.SetReadDeadline(time.Now().Add(10*time.Second)))
				_, err = c.Read(make([]byte, 1))
				require.ErrorIs(t, err, syscall.ECONNRESET, "the long-lived stream ends with the old session")
				return
			}
			require.NoError(t, c.Close())
			select {
			case e := <-g.acks:
				require.EqualValues(t, 7, e)
			case <-time.After(10 * time.Second):
				t.Fatal("no HotRestartAck once the stream was done")
			}
			sc.Close()
			<-served
		})
	}
}
