//go:build interop

package interop_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"path/filepath"
	"slices"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/shmlink/shmlink"
	"github.com/shmlink/shmlink/buffer"
	"github.com/shmlink/shmlink/session"
	"github.com/stretchr/testify/require"
)

// mode is one way of running a session with the Rust peer.
type mode struct {
	name    string
	network string             // "unix" or "tcp"
	memory  shmlink.MemoryType // what the shmlink client creates
	rustMem string             // what the Rust client creates (--mem)
	// Protocol versions the sessions negotiate with a shmlink client and
	// with a Rust client (the Rust crate speaks v2 for files, v3 for memfd).
	goVersion, rustVersion uint8
}

var modes = []mode{
	{"unix-memfd", "unix", shmlink.MemoryMemfd, "memfd", 3, 3},
	{"unix-file", "unix", shmlink.MemoryFile, "file", 3, 2},
	{"tcp-file", "tcp", shmlink.MemoryFile, "file", 3, 2},
}

// fallback is what a case expects of FallbackData.
type fallback int

const (
	fallbackAny  fallback = iota // whatever the timing gives
	fallbackNone                 // shared memory carries everything
	fallbackBoth                 // both sides must send FallbackData
	fallbackPeer                 // the peer must send FallbackData; ours may not
)

// Payload sizes: 1 B to 4 MiB, around the default slice classes (8172,
// 32748, 131052) and as chains of many slices.
var (
	allSizes     = []int{1, 2, 100, 4096, 8172, 8173, 32748, 32749, 131052, 131053, 300000, 1 << 20, 4 << 20}
	defaultSizes = []int{1, 100, 4096, 65536, 1 << 20, 4 << 20} // the Rust client's default
	closeSizes   = []int{1, 4096, 131053, 1 << 20}
)

// A testCase is the same exchange in both directions: streams opened first
// on one session, then on each concurrently every size rounds times, each
// message echoed and checked byte by byte on both sides, then the streams
// closed (by the client, or by the server first when serverCloses).
type testCase struct {
	name         string
	streams      int
	sizes        []int
	rounds       int
	fallback     fallback
	serverCloses bool
	// tiny: the client's region is small enough to force FallbackData.
	tiny bool
}

var cases = []testCase{
	{name: "sizes-1B-4MiB", streams: 1, sizes: allSizes, rounds: 1, fallback: fallbackNone},
	{name: "sizes-1B-4MiB-10-streams-2-rounds", streams: 10, sizes: allSizes, rounds: 2, fallback: fallbackAny},
	{name: "100-streams", streams: 100, sizes: defaultSizes, rounds: 1, fallback: fallbackAny},
	{name: "tiny-region-fallback", streams: 10, sizes: defaultSizes, rounds: 1, fallback: fallbackBoth, tiny: true},
	// A message the Rust crate sends as one FallbackData of 24 MiB (it
	// accepts up to 32 MiB). Our side writes it in 64 KiB events, which
	// fit the region whenever the Rust reader keeps up: whether we fall
	// back too depends on timing.
	{name: "tiny-region-24MiB-message", streams: 1, sizes: []int{24 << 20}, rounds: 1, fallback: fallbackPeer, tiny: true},
	{name: "server-closes-first", streams: 10, sizes: closeSizes, rounds: 1, fallback: fallbackAny, serverCloses: true},
}

// Tiny regions: the smallest a shmlink client may create, and the smallest
// the Rust crate lets its client create (it refuses less than 1 MiB).
const (
	goTinyRegion   = 64 << 10
	rustTinyRegion = "1M"
	tinySlice      = 4096
)

func checkFallback(t *testing.T, want fallback, st session.Stats) {
	t.Helper()
	switch want {
	case fallbackNone:
		require.Zero(t, st.FallbackWrites, "FallbackData sent")
		require.Zero(t, st.FallbackReads, "FallbackData received")
	case fallbackBoth:
		require.NotZero(t, st.FallbackWrites, "FallbackData sent")
		require.NotZero(t, st.FallbackReads, "FallbackData received")
	case fallbackPeer:
		require.NotZero(t, st.FallbackReads, "FallbackData received")
	}
}

func logStats(t *testing.T, side string, st session.Stats) {
	t.Helper()
	t.Logf("%s session: sent %d B, received %d B, events %d/%d, wakeups %d/%d, fallback writes %d reads %d, queue full %d",
		side, st.BytesSent, st.BytesReceived, st.EventsSent, st.EventsReceived,
		st.WakeupsSent, st.WakeupsReceived, st.FallbackWrites, st.FallbackReads, st.QueueFull)
}

// TestGoClientRustServer runs shmlink clients against the Rust echo server,
// which checks every byte it receives as the client checks every byte of
// the echo.
func TestGoClientRustServer(t *testing.T) {
	for _, m := range modes {
		t.Run(m.name, func(t *testing.T) {
			for _, c := range cases {
				t.Run(c.name, func(t *testing.T) { goClientRustServer(t, m, c) })
			}
		})
	}
}

func goClientRustServer(t *testing.T, m mode, c testCase) {
	want := total(c.sizes, c.rounds)
	extra := []string{"--check-sizes", sizeList(c.sizes)}
	if c.serverCloses {
		extra = append(extra, "--close-after", strconv.FormatInt(want, 10))
	}
	srv := startRustServer(t, extra...)
	shmDir := shmDir(t)
	cfg := shmlink.Config{MemoryType: m.memory, ShmDir: shmDir, Fallback: c.tiny}
	if c.tiny {
		cfg.BufferSize = goTinyRegion
		cfg.SizeClasses = []buffer.SizeClass{{SliceSize: tinySlice, Percent: 100}}
	}
	d := &shmlink.Dialer{Config: &cfg}
	defer d.Close()
	ctx, cancel := context.WithTimeout(context.Background(), runTimeout)
	defer cancel()

	addr := srv.addr(m.network)
	ids, sess := exchange(ctx, t, d, m.network, addr, m.goVersion, c)
	// The Rust server saw each stream end after exactly the bytes sent:
	// our close, or its own close that we read as io.EOF.
	srv.waitStreams(t, ids, want, c.serverCloses)
	if c.serverCloses {
		// Both closes were exchanged through the IO queue: a new stream may
		// reuse an id, and the Rust server takes it for a new stream.
		more, again := exchange(ctx, t, d, m.network, addr, m.goVersion, c)
		require.Same(t, sess, again, "one session serves every stream")
		t.Logf("stream ids of the second round: %v", more)
		ids = append(ids, more...)
		srv.waitStreams(t, ids, want, true)
	}

	st := sess.Stats()
	logStats(t, "shmlink client", st)
	require.Equal(t, uint64(want)*uint64(len(ids)), st.BytesSent)
	require.Equal(t, uint64(want)*uint64(len(ids)), st.BytesReceived)
	checkFallback(t, c.fallback, st)
	// The Rust server never answers a close with its own (nor does
	// shmipc-go): streams closed on this side must not stay behind.
	require.Zero(t, sess.NumStreams(), "streams left routed after every stream was closed")

	require.NoError(t, d.Close())
	<-sess.Done()
	srv.stop(t)
	requireNoShmFiles(t, shmDir)
}

// exchange opens c.streams streams on d's session to network/addr, all
// before any data moves (the Rust crate refuses new streams for 30 s once a
// stream fell back), runs exercise on each concurrently, and returns their
// ids and the session.
func exchange(ctx context.Context, t *testing.T, d *shmlink.Dialer, network, addr string, version uint8, c testCase) ([]uint32, *session.Session) {
	t.Helper()
	streams := make([]*shmlink.Stream, c.streams)
	ids := make([]uint32, c.streams)
	for i := range streams {
		conn, err := d.DialContext(ctx, network, addr)
		require.NoError(t, err)
		streams[i] = conn.(*shmlink.Stream)
		ids[i] = streams[i].ID()
		deadline, _ := ctx.Deadline()
		require.NoError(t, streams[i].SetDeadline(deadline))
	}
	sess := streams[0].Session()
	require.Equal(t, version, sess.Version(), "negotiated protocol version")
	require.Equal(t, 1, d.NumSessions())

	errs := make([]error, c.streams)
	var wg sync.WaitGroup
	for i, st := range streams {
		wg.Add(1)
		go func() {
			defer wg.Done()
			errs[i] = exercise(st, c.sizes, c.rounds, c.serverCloses)
		}()
	}
	wg.Wait()
	for i, err := range errs {
		require.NoError(t, err, "stream %d", ids[i])
	}
	return ids, sess
}

// exercise is the Rust client's exchange on one shmlink stream: per round
// and size, write one message of the tagged pattern, read its echo and
// check every byte; then close (after reading the server's close, if it
// closes first).
func exercise(st *shmlink.Stream, sizes []int, rounds int, serverCloses bool) error {
	idx := uint64(st.ID() - 2) // what the Rust server checks
	var msg uint64
	buf := make([]byte, 0, slices.Max(sizes))
	for range rounds {
		for _, n := range sizes {
			buf = buf[:n]
			fillTagged(buf, idx, msg)
			if _, err := st.Write(buf); err != nil {
				return fmt.Errorf("message %d (%d B): write: %w", msg, n, err)
			}
			clear(buf)
			if k, err := io.ReadFull(st, buf); err != nil {
				return fmt.Errorf("message %d (%d B): read after %d B: %w", msg, n, k, err)
			}
			if err := checkTagged(buf, idx, msg); err != nil {
				return err
			}
			msg++
		}
	}
	if serverCloses {
		k, err := st.Read(buf[:cap(buf)])
		if k != 0 || err != io.EOF {
			return fmt.Errorf("after the last echo: read %d B, %v; want the server's close (io.EOF)", k, err)
		}
	}
	return st.Close()
}

// TestDialRustServer checks that the session shmlink.Dial opens for one
// stream ends when that stream is closed, also against a server that never
// answers a close (the Rust crate's).
func TestDialRustServer(t *testing.T) {
	srv := startRustServer(t, "--check-sizes", sizeList(closeSizes))
	conn, err := shmlink.Dial("unix", srv.unix)
	require.NoError(t, err)
	st := conn.(*shmlink.Stream)
	sess := st.Session()
	require.NoError(t, st.SetDeadline(time.Now().Add(runTimeout)))
	require.NoError(t, exercise(st, closeSizes, 1, false))
	select {
	case <-sess.Done():
	case <-time.After(streamTimeout):
		t.Fatalf("the session did not end with its only stream (%d streams routed)", sess.NumStreams())
	}
	srv.waitStreams(t, []uint32{st.ID()}, total(closeSizes, 1), false)
	srv.stop(t)
}

// TestRustClientGoServer runs the Rust checking client against a shmlink
// echo server that checks every byte too.
func TestRustClientGoServer(t *testing.T) {
	for _, m := range modes {
		t.Run(m.name, func(t *testing.T) {
			for _, c := range cases {
				t.Run(c.name, func(t *testing.T) { rustClientGoServer(t, m, c) })
			}
		})
	}
}

func rustClientGoServer(t *testing.T, m mode, c testCase) {
	shmDir := shmDir(t)
	srv := startEchoServer(t, m.network, shmDir, c)
	args := []string{
		"--mem", m.rustMem, "--shm-dir", shmDir, "--" + m.network, srv.addr(),
		"--streams", strconv.Itoa(c.streams), "--sizes", sizeList(c.sizes), "--rounds", strconv.Itoa(c.rounds),
	}
	switch c.fallback {
	case fallbackNone:
		args = append(args, "--expect-no-fallback")
	case fallbackBoth:
		args = append(args, "--expect-fallback")
	}
	if c.tiny {
		args = append(args, "--buffer-size", rustTinyRegion, "--slices", fmt.Sprintf("%d:100", tinySlice))
	}
	if c.serverCloses {
		args = append(args, "--expect-eof")
	}
	runRustClient(t, args...)
	// The Rust client removed its files when it closed its session.
	requireNoShmFiles(t, shmDir)

	want := total(c.sizes, c.rounds)
	results := srv.results(t, c.streams)
	for id := uint32(2); id < uint32(c.streams+2); id++ {
		r, ok := results[id]
		require.True(t, ok, "no stream %d reached the server", id)
		require.NoError(t, r.err, "stream %d", id)
		require.Equal(t, want, r.bytes, "stream %d: bytes echoed", id)
	}
	sess := results[2].session
	require.Equal(t, m.rustVersion, sess.Version(), "negotiated protocol version")
	// The Rust client ends its session right after closing its streams.
	select {
	case <-sess.Done():
	case <-time.After(streamTimeout):
		t.Fatal("the session did not end when the Rust client exited")
	}
	st := sess.Stats()
	logStats(t, "shmlink server", st)
	require.Equal(t, uint64(want)*uint64(c.streams), st.BytesSent)
	require.Equal(t, uint64(want)*uint64(c.streams), st.BytesReceived)
	checkFallback(t, c.fallback, st)
	if !c.serverCloses {
		// We answered each of the Rust client's closes: nothing is left. (A
		// stream this side closed first stays routed until the client's
		// close, which the Rust crate never sends; it goes with the
		// session, which has ended.)
		require.Zero(t, sess.NumStreams(), "streams left routed after both sides closed them")
	}
	require.NoError(t, srv.ln.Close())
	requireNoShmFiles(t, shmDir)
}

// echoServer is a shmlink listener whose streams echo every byte and check
// it against the Rust client's pattern.
type echoServer struct {
	ln      *shmlink.Listener
	c       testCase
	done    chan streamResult
	serving sync.WaitGroup
}

type streamResult struct {
	id      uint32
	bytes   int64 // bytes received, checked and echoed
	err     error
	session *session.Session
}

func startEchoServer(t *testing.T, network, shmDir string, c testCase) *echoServer {
	t.Helper()
	addr := "127.0.0.1:0"
	if network == "unix" {
		addr = filepath.Join(t.TempDir(), "s.sock")
	}
	lc := shmlink.ListenConfig{Config: &shmlink.Config{ShmDir: shmDir, Fallback: c.tiny}}
	ln, err := lc.Listen(context.Background(), network, addr)
	require.NoError(t, err)
	s := &echoServer{ln: ln, c: c, done: make(chan streamResult, c.streams)}
	s.serving.Add(1)
	go s.accept()
	t.Cleanup(func() {
		ln.Close()
		s.serving.Wait()
	})
	return s
}

func (s *echoServer) addr() string { return s.ln.Addr().String() }

func (s *echoServer) accept() {
	defer s.serving.Done()
	for {
		conn, err := s.ln.Accept()
		if err != nil {
			return
		}
		s.serving.Add(1)
		go func() {
			defer s.serving.Done()
			st := conn.(*shmlink.Stream)
			n, err := s.echo(st)
			if cerr := st.Close(); err == nil {
				err = cerr
			}
			select {
			case s.done <- streamResult{st.ID(), n, err, st.Session()}:
			default: // more streams than expected: results reports it
			}
		}()
	}
}

// echo checks and echoes what the Rust client sends on st: message m of
// stream index id-2 has size sizes[m % len(sizes)]. With serverCloses it
// returns after echoing every expected byte, without waiting for the
// client's close; otherwise it reads on to io.EOF.
func (s *echoServer) echo(st *shmlink.Stream) (int64, error) {
	if err := st.SetDeadline(time.Now().Add(runTimeout)); err != nil {
		return 0, err
	}
	idx := uint64(st.ID() - 2)
	want := total(s.c.sizes, s.c.rounds)
	var got int64
	var msg, off uint64
	buf := make([]byte, 1<<20)
	for {
		if s.c.serverCloses && got == want {
			return got, nil
		}
		k, err := st.Read(buf)
		for b := buf[:k]; len(b) > 0; {
			if msg >= uint64(len(s.c.sizes)*s.c.rounds) {
				return got, fmt.Errorf("%d bytes more than the client sends", len(b))
			}
			size := uint64(s.c.sizes[msg%uint64(len(s.c.sizes))])
			part := b[:min(uint64(len(b)), size-off)]
			if err := checkPattern(part, idx, msg, off); err != nil {
				return got, err
			}
			b = b[len(part):]
			if off += uint64(len(part)); off == size {
				msg, off = msg+1, 0
			}
		}
		if k > 0 {
			if _, err := st.Write(buf[:k]); err != nil {
				return got, fmt.Errorf("echo after %d B: %w", got, err)
			}
			got += int64(k)
		}
		if errors.Is(err, io.EOF) {
			if got != want {
				return got, fmt.Errorf("client closed after %d B, want %d", got, want)
			}
			return got, nil
		}
		if err != nil {
			return got, fmt.Errorf("read after %d B: %w", got, err)
		}
	}
}

// results waits for n streams to finish and returns them by id.
func (s *echoServer) results(t *testing.T, n int) map[uint32]streamResult {
	t.Helper()
	out := make(map[uint32]streamResult, n)
	timer := time.NewTimer(streamTimeout)
	defer timer.Stop()
	for len(out) < n {
		select {
		case r := <-s.done:
			require.NotContains(t, out, r.id, "stream %d twice", r.id)
			out[r.id] = r
		case <-timer.C:
			t.Fatalf("%d of %d streams finished on the server", len(out), n)
		}
	}
	select {
	case r := <-s.done:
		t.Fatalf("unexpected stream %d on the server", r.id)
	default:
	}
	return out
}
