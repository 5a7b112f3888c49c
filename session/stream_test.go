package session

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"io"
	"math/rand/v2"
	"net"
	"os"
	"testing"
	"time"
	"unsafe"

	"github.com/shmlink/shmlink/buffer"
	"github.com/shmlink/shmlink/queue"
	"github.com/stretchr/testify/require"
)

// pair returns a connected client and server session in this process, over
// a Unix socketpair with memfds (v3), closed when the test ends.
func pair(t testing.TB, cfg *Config) (client, server *Session) {
	t.Helper()
	return pairWith(t, cfg, cfg)
}

// pairWith is pair with a Config for each side. The two sessions wake
// each other over the connection, as two processes do; localPairWith
// lets them pair as sessions of one process do (local.go).
func pairWith(t testing.TB, ccfg, scfg *Config) (client, server *Session) {
	t.Helper()
	return connectPair(t, socketWakes(ccfg), socketWakes(scfg))
}

// socketWakes returns a copy of cfg (nil: the defaults) whose session
// wakes its peer over the connection even when the peer is this process.
func socketWakes(cfg *Config) *Config {
	c := Config{}
	if cfg != nil {
		c = *cfg
	}
	c.socketWakes = true
	return &c
}

// localPairWith is pairWith for sessions that pair with each other
// (local.go): their wakes skip the connection.
func localPairWith(t testing.TB, ccfg, scfg *Config) (client, server *Session) {
	t.Helper()
	client, server = connectPair(t, ccfg, scfg)
	require.Same(t, server, client.local.Load(), "the client pairs with the server")
	require.Same(t, client, server.local.Load(), "the server pairs with the client")
	return client, server
}

// connectPair connects a client and a server session over a Unix
// socketpair, closed when the test ends.
func connectPair(t testing.TB, ccfg, scfg *Config) (client, server *Session) {
	t.Helper()
	cc, sc := socketPair(t)
	type result struct {
		s   *Session
		err error
	}
	done := make(chan result, 1)
	go func() {
		s, err := Server(sc, scfg)
		done <- result{s, err}
	}()
	client, err := Client(cc, ccfg)
	require.NoError(t, err)
	r := <-done
	require.NoError(t, r.err)
	t.Cleanup(func() {
		client.Close()
		r.s.Close()
	})
	return client, r.s
}

// streamPair opens a stream on client and accepts it on server; the first
// write announces it, so it writes and reads one byte.
func streamPair(t testing.TB, client, server *Session) (*Stream, *Stream) {
	t.Helper()
	ctx := context.Background()
	c, err := client.OpenStream(ctx)
	require.NoError(t, err)
	_, err = c.Write([]byte{'!'})
	require.NoError(t, err)
	s, err := server.AcceptStream(ctx)
	require.NoError(t, err)
	b := make([]byte, 1)
	_, err = io.ReadFull(s, b)
	require.NoError(t, err)
	return c, s
}

func TestZeroCopy(t *testing.T) {
	client, server := pair(t, nil)
	c, s := streamPair(t, client, server)
	require.EqualValues(t, 2, c.ID(), "the client's first stream is 2")

	// Reserve two blocks, fill them in place, flush once.
	a, err := c.Reserve(5000)
	require.NoError(t, err)
	b, err := c.Reserve(3000)
	require.NoError(t, err)
	for i := range a {
		a[i] = byte(i)
	}
	for i := range b {
		b[i] = byte(i * 3)
	}
	require.NoError(t, c.Flush())

	// Peek does not consume; ReadBytes does; both point into shared memory
	// when the bytes lie in one slice.
	p, err := s.Peek(100)
	require.NoError(t, err)
	require.Equal(t, a[:100], p)
	got, err := s.ReadBytes(5000)
	require.NoError(t, err)
	require.Equal(t, a, got)
	require.True(t, inMapping(server, got), "ReadBytes of one slice is zero-copy")
	n, err := s.Discard(1000)
	require.NoError(t, err)
	require.Equal(t, 1000, n)
	rest := make([]byte, 2000)
	_, err = io.ReadFull(s, rest)
	require.NoError(t, err)
	require.Equal(t, b[1000:], rest)
	inUse := sum(server.Stats().SlicesInUse)
	s.ReleasePreviousRead()
	require.Less(t, sum(server.Stats().SlicesInUse), inUse, "release recycles the held slices")

	// A read across two events is a copy owned by the caller.
	_, err = c.Write(make([]byte, 10))
	require.NoError(t, err)
	_, err = c.Write([]byte{1, 2, 3})
	require.NoError(t, err)
	got, err = s.ReadBytes(13)
	require.NoError(t, err)
	require.Equal(t, []byte{1, 2, 3}, got[10:])
	require.False(t, inMapping(server, got))

	// Peek past a close returns what the stream ended with.
	_, err = c.Write([]byte("abc"))
	require.NoError(t, err)
	require.NoError(t, c.Close())
	_, err = s.Peek(4)
	require.ErrorIs(t, err, io.ErrUnexpectedEOF)
	got, err = s.ReadBytes(3)
	require.NoError(t, err)
	require.Equal(t, "abc", string(got))
	_, err = s.ReadBytes(1)
	require.ErrorIs(t, err, io.EOF)
	s.ReleasePreviousRead()
	require.NoError(t, s.Close())
	require.Zero(t, sum(server.Stats().SlicesInUse), "every slice recycled")
}

// ReadChunk hands out every byte in place, one slice at a time, and
// ReleasePreviousRead recycles the slices behind the chunks.
func TestReadChunk(t *testing.T) {
	client, server := pair(t, nil)
	c, s := streamPair(t, client, server)
	data := make([]byte, 300<<10)
	for i := range data {
		data[i] = byte(i * 7)
	}
	go func() {
		c.Write(data)
		c.CloseWrite()
	}()
	var got []byte
	chunks := 0
	for {
		b, err := s.ReadChunk(100 << 10)
		if err == io.EOF {
			break
		}
		require.NoError(t, err)
		require.NotEmpty(t, b)
		require.LessOrEqual(t, len(b), 100<<10)
		require.True(t, inMapping(server, b), "chunk %d is a copy", chunks)
		got = append(got, b...)
		chunks++
		if chunks%3 == 0 {
			s.ReleasePreviousRead()
		}
	}
	require.Equal(t, data, got)
	require.Greater(t, chunks, 2)
	s.ReleasePreviousRead()
	require.Zero(t, sum(server.Stats().SlicesInUse), "every slice recycled")
	_, err := s.ReadChunk(0)
	require.Error(t, err)
}

// releaseWarm pushes the slices that each session keeps warm for its next
// writes (docs/protocol.md section 2.4, "Warm slices") back onto the free
// lists, as a reader that sleeps does, so that a check of the slices in
// use sees every slice that is not leaked as free from either side.
func releaseWarm(sessions ...*Session) {
	for _, s := range sessions {
		s.releaseWarm()
	}
}

func sum(xs []int) int {
	n := 0
	for _, x := range xs {
		n += x
	}
	return n
}

// inMapping reports whether b lies inside s's buffer mapping.
func inMapping(s *Session, b []byte) bool {
	s.shm.mu.RLock()
	defer s.shm.mu.RUnlock()
	m := s.shm.mem.bufMem
	lo, hi := uintptr(unsafe.Pointer(&m[0])), uintptr(unsafe.Pointer(&m[len(m)-1]))
	p := uintptr(unsafe.Pointer(unsafe.SliceData(b)))
	return len(b) > 0 && p >= lo && p+uintptr(len(b))-1 <= hi
}

func TestDeadlines(t *testing.T) {
	client, server := pair(t, nil)
	c, s := streamPair(t, client, server)

	// A deadline set while Read is blocked wakes it.
	errc := make(chan error, 1)
	go func() {
		_, err := s.Read(make([]byte, 1))
		errc <- err
	}()
	require.NoError(t, s.SetReadDeadline(time.Now().Add(20*time.Millisecond)))
	err := <-errc
	var ne net.Error
	require.True(t, errors.As(err, &ne) && ne.Timeout(), "got %v", err)
	require.ErrorIs(t, err, os.ErrDeadlineExceeded)

	// Clearing it makes reads work again.
	require.NoError(t, s.SetReadDeadline(time.Time{}))
	_, err = c.Write([]byte("x"))
	require.NoError(t, err)
	b := make([]byte, 1)
	_, err = s.Read(b)
	require.NoError(t, err)

	// A past write deadline fails writes at once.
	require.NoError(t, c.SetWriteDeadline(time.Now().Add(-time.Second)))
	_, err = c.Write([]byte("x"))
	require.ErrorIs(t, err, os.ErrDeadlineExceeded)

	// Close wakes a blocked Read with net.ErrClosed.
	go func() {
		_, err := s.Read(make([]byte, 1))
		errc <- err
	}()
	require.NoError(t, s.Close())
	require.ErrorIs(t, <-errc, net.ErrClosed)
	_, err = s.Write([]byte("x"))
	require.ErrorIs(t, err, net.ErrClosed)
}

// Closing the session wakes every blocked call and fails later ones with
// net.ErrClosed; the peer's streams end with an error, not silently.
func TestSessionClose(t *testing.T) {
	client, server := pair(t, nil)
	c, s := streamPair(t, client, server)
	errc := make(chan error, 1)
	go func() {
		_, err := c.Read(make([]byte, 1))
		errc <- err
	}()
	require.NoError(t, client.Close())
	require.ErrorIs(t, <-errc, net.ErrClosed)
	_, err := client.OpenStream(context.Background())
	require.ErrorIs(t, err, net.ErrClosed)
	_, err = s.Read(make([]byte, 1))
	require.ErrorIs(t, err, ErrPeerClosed)
	<-server.Done()
	_, err = server.AcceptStream(context.Background())
	require.ErrorIs(t, err, ErrPeerClosed)
	require.NoError(t, s.Close())
	require.Nil(t, server.Stats().SlicesInUse, "released with its last stream")
}

// Data written just before a close, and before the whole session ends,
// is still delivered (docs/protocol.md section 7: peers drop it).
func TestDataBeforeSessionEnd(t *testing.T) {
	client, server := pair(t, nil)
	ctx := context.Background()
	c, err := client.OpenStream(ctx)
	require.NoError(t, err)
	msg := make([]byte, 300<<10)
	for i := range msg {
		msg[i] = byte(i % 251)
	}
	_, err = c.Write(msg)
	require.NoError(t, err)
	require.NoError(t, c.Close())
	require.NoError(t, client.Close())
	s, err := server.AcceptStream(ctx)
	require.NoError(t, err)
	got, err := io.ReadAll(s)
	require.NoError(t, err)
	require.Equal(t, msg, got)
	require.NoError(t, s.Close())
}

func TestConfigValidate(t *testing.T) {
	cases := []struct {
		cfg   Config
		field string
	}{
		{Config{BufferSize: -1}, "BufferSize"},
		{Config{BufferSize: 1000}, "BufferSize"},
		{Config{QueueCap: 1 << 30}, "QueueCap"},
		{Config{MemoryType: 9}, "MemoryType"},
		{Config{ShmDir: "relative"}, "ShmDir"},
		{Config{HandshakeTimeout: -1}, "HandshakeTimeout"},
		{Config{MaxMessageSize: 10}, "MaxMessageSize"},
		{Config{AcceptBacklog: -1}, "AcceptBacklog"},
		{Config{QueueFullTimeout: -1}, "QueueFullTimeout"},
		// #15: these passed Validate and then failed the handshake.
		{Config{BufferSize: 64 << 10}, "BufferSize"},                                                  // the default classes need more
		{Config{BufferSize: 512 << 10}, "BufferSize"},                                                 // 2 slices of 128 KiB need 50 % of 512 KiB + headers
		{Config{BufferSize: 1 << 20, SizeClasses: buffer.PeerSizeClasses()}, "SizeClasses"},           // 20 %: 1 slice of 128 KiB
		{Config{SizeClasses: []buffer.SizeClass{{SliceSize: 4094, Percent: 100}}}, "SizeClasses"},     // not a multiple of 4
		{Config{SizeClasses: []buffer.SizeClass{{SliceSize: 16 << 20, Percent: 100}}}, "SizeClasses"}, // one slice
		{Config{PollTime: time.Hour}, "PollTime"},
	}
	for _, tc := range cases {
		err := tc.cfg.Validate()
		var ce *ConfigError
		require.True(t, errors.As(err, &ce), "%+v: %v", tc.cfg, err)
		require.Equal(t, tc.field, ce.Field)
	}
	require.NoError(t, (&Config{}).Validate())
	require.NoError(t, (&Config{BufferSize: 1 << 20}).Validate(), "the default classes fit 1 MiB")
}

// Validate refuses every config the handshake would refuse (#15): for
// random configs around the limits, one that Validate passes makes a
// session pair that carries a message both ways, and one it refuses
// gets a *ConfigError.
func TestConfigValidateProperty(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	pick := func(v ...int) int { return v[rng.IntN(len(v))] }
	var passed, refused int
	for i := range 300 {
		cfg := &Config{
			BufferSize: pick(0, 64<<10, 256<<10, 1<<20, 4<<20, 64<<10+rng.IntN(8<<20)),
			QueueCap:   uint32(pick(0, 1, 2, 3, 5, 64, 1000, 8191, rng.IntN(1<<16))),
			PollTime:   time.Duration(pick(0, -1, int(time.Microsecond), int(10*time.Millisecond), int(time.Second))),
		}
		if rng.IntN(2) == 0 {
			n := 1 + rng.IntN(4)
			size, left := uint32(0), uint32(100)
			for k := range n {
				size += uint32(4 * (1 + rng.IntN(2048)))
				if rng.IntN(8) == 0 {
					size += 2 // not a multiple of 4
				}
				pct := left
				if k < n-1 {
					pct = uint32(rng.IntN(int(left) + 1))
				}
				left -= pct
				cfg.SizeClasses = append(cfg.SizeClasses, buffer.SizeClass{SliceSize: size, Percent: pct})
			}
		}
		if err := cfg.Validate(); err != nil {
			var ce *ConfigError
			require.ErrorAs(t, err, &ce, "config %d", i)
			refused++
			continue
		}
		passed++
		client, server := pairWith(t, cfg, nil) // fails the test if the handshake fails
		c, err := client.OpenStream(t.Context())
		require.NoError(t, err)
		st := accept(t, server)
		msg := bytes.Repeat([]byte{byte(i)}, 1+rng.IntN(100<<10))
		for _, dir := range [][2]*Stream{{c, st}, {st, c}} {
			go dir[0].Write(msg)
			got := make([]byte, len(msg))
			require.NoError(t, dir[1].SetReadDeadline(time.Now().Add(10*time.Second)))
			_, err := io.ReadFull(dir[1], got)
			require.NoError(t, err, "config %d: %+v", i, cfg)
			require.Equal(t, msg, got)
		}
		require.NoError(t, client.Close())
		require.NoError(t, server.Close())
	}
	t.Logf("%d configs passed Validate and worked, %d were refused", passed, refused)
	require.Positive(t, passed)
	require.Positive(t, refused)
}

// TestEmptyFirstSlice sends a chain whose first slice holds no bytes, as a
// peer may (docs/protocol.md section 2.3): ReadChunk and Read skip it and
// return the bytes of the next slice, not (0 bytes, nil) for ever.
func TestEmptyFirstSlice(t *testing.T) {
	client, server := pair(t, tinyConfig())
	c, err := client.OpenStream(t.Context())
	require.NoError(t, err)
	s := accept(t, server)
	mem := client.shm.mem
	want := bytes.Repeat([]byte("x"), mem.region.MaxSliceSize()+10) // two slices
	var w buffer.ChainWriter
	w.Reset(mem.region)
	_, err = w.Write(want)
	require.NoError(t, err)
	head, _ := w.Finish()
	// Empty the first slice: its size field is at +4 of the slice header.
	binary.LittleEndian.PutUint32(mem.bufMem[head+4:], 0)
	full, err := client.put(mem, queue.Event{StreamID: c.ID(), Offset: head})
	require.NoError(t, err)
	require.False(t, full)
	require.NoError(t, client.writeCtl(client.ctl.pollMsg))

	require.NoError(t, s.SetReadDeadline(time.Now().Add(5*time.Second)))
	b, err := s.ReadChunk(len(want))
	require.NoError(t, err)
	require.Equal(t, want[len(want)-10:], b, "the second slice's bytes")
	s.ReleasePreviousRead()
}

// While the largest slices run short, a large Write goes out in events of
// whole 32 KiB slices and takes none of the large ones, which a zero-copy
// Reserve needs (docs/protocol.md section 2.4); the reader gets every
// byte in order, and every slice comes back.
func TestWriteSparesLargestSlicesWhenShort(t *testing.T) {
	client, server := pair(t, nil)
	c, s := streamPair(t, client, server)
	region := client.shm.mem.region
	largest := len(region.InUse()) - 1
	large := region.MaxSliceSize()
	var held []uint32
	// Take every large slice, then give back fewer than a quarter of them:
	// with the one a list may keep unpoppable, under a quarter are free.
	for {
		off, err := region.Alloc(large)
		if errors.Is(err, buffer.ErrNoSpace) {
			break
		}
		require.NoError(t, err)
		held = append(held, off)
	}
	for range (len(held)+1)/4 - 1 {
		require.NoError(t, region.Free(held[len(held)-1]))
		held = held[:len(held)-1]
	}
	before := region.InUse()

	msg := make([]byte, 1<<20)
	for i := range msg {
		msg[i] = byte(i * 7)
	}
	n, err := c.Write(msg)
	require.NoError(t, err)
	require.Equal(t, len(msg), n)
	during := region.InUse()
	require.Equal(t, before[largest], during[largest], "the write took large slices")
	event := 2 * (32<<10 - 20) // two 32 KiB slices' data
	require.Equal(t, 2*(len(msg)/event), during[largest-1]-before[largest-1],
		"32 KiB slices: two per event of 65,496 bytes")
	require.Equal(t, 1, during[0]-before[0], "one small slice for the last %d bytes", len(msg)%event)

	got := make([]byte, len(msg))
	_, err = io.ReadFull(s, got)
	require.NoError(t, err)
	require.True(t, bytes.Equal(msg, got), "the bytes differ")
	for _, off := range held {
		require.NoError(t, region.Free(off))
	}
	releaseWarm(client, server)
	require.Equal(t, []int{0, 0, 0}, region.InUse())
}

// Zero-copy calls given a length they cannot serve fail with ErrBadLength,
// reserve or consume nothing, and leave the stream usable. A stream whose
// bytes go over the socket (the region was full, Config.Fallback) reserves
// on the heap: the bound holds there too.
func TestZeroCopyBadLength(t *testing.T) {
	ccfg := tinyConfig()
	ccfg.Fallback = true
	scfg := tinyConfig()
	scfg.StreamMemoryLimit, scfg.StreamHeapLimit = -1, -1
	client, server := pairWith(t, ccfg, scfg)
	c, s := streamPair(t, client, server)
	max := client.MaxSliceSize()
	require.Positive(t, max)

	data := randomBytes(128<<10, 3) // twice the region: the rest goes over the socket
	_, err := c.Write(data)
	require.NoError(t, err)
	require.NotZero(t, client.Stats().FallbackWrites)
	for _, n := range []int{0, -1, max + 1, 1 << 40} {
		_, err := c.Reserve(n)
		require.ErrorIs(t, err, ErrBadLength, "Reserve(%d)", n)
	}
	b, err := c.Reserve(max)
	require.NoError(t, err)
	copy(b, "tail")
	require.NoError(t, c.Flush())
	require.NoError(t, c.CloseWrite())

	for _, n := range []int{0, -1} {
		_, err := s.Peek(n)
		require.ErrorIs(t, err, ErrBadLength, "Peek(%d)", n)
		_, err = s.ReadChunk(n)
		require.ErrorIs(t, err, ErrBadLength, "ReadChunk(%d)", n)
	}
	got, err := io.ReadAll(s)
	require.NoError(t, err)
	require.Len(t, got, len(data)+max)
	require.True(t, bytes.Equal(data, got[:len(data)]), "the bytes differ")
	require.Equal(t, "tail", string(got[len(data):len(data)+4]))
}
