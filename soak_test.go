package shmlink_test

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"hash/crc32"
	"io"
	"math/rand/v2"
	"net"
	"os"
	"path/filepath"
	"runtime"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/shmlink/shmlink"
	"github.com/shmlink/shmlink/internal/peertest"
	"github.com/shmlink/shmlink/session"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// Parameters of the soak tests (issue #6). `make soak` runs them for
// SOAKTIME; a plain go test run runs them for soakDefault.
const (
	// soakEnv sets the length of a soak run, all variants together, as a
	// time.Duration ("5m").
	soakEnv = "SHMLINK_SOAK"
	// soakSeedEnv, if set, replaces the random seed of a run; every variant
	// logs the seed it used.
	soakSeedEnv = "SHMLINK_SOAK_SEED"
	// soakStreamsEnv sets how many streams run at once in each variant.
	soakStreamsEnv = "SHMLINK_SOAK_STREAMS"

	// soakDefault is the length of the soak, all variants together, in a
	// plain go test run; soakShort with -short.
	soakDefault = 6 * time.Second
	soakShort   = 2 * time.Second
	// soakVariants is the number of variants that share the length: in
	// one process and against the test server process, each over
	// unix-memfd and tcp-file (see TestSoak).
	soakVariants = 4
	// soakStreams is the default number of streams open at once.
	soakStreams = 64

	// soakMaxWrite and soakMaxRead bound the size of one Write and of one
	// Read's buffer, in bytes; sizes are drawn biased to small ones.
	soakMaxWrite = 1 << 20
	soakMaxRead  = 256 << 10
	// soakMaxWrites bounds the writes of one side of a stream.
	soakMaxWrites = 16
	// soakMaxReserve is the largest Reserve: the smallest default slice
	// size, so that it fits every region the soak draws.
	soakMaxReserve = 8172
	// soakStall is how long the soak may go without any call moving a
	// byte before its watchdog reports a hang (with every goroutine's
	// stack and the seed) and stops the test binary. It is also the
	// sessions' QueueFullTimeout: a full queue is a hang, not a model
	// event.
	soakStall = time.Minute
)

// soakSettings are the knobs of a soak run, from the environment.
type soakSettings struct {
	seed     uint64
	perRun   time.Duration // each variant's share of the length
	parallel int           // streams open at once
}

// soakSetup reads the soak's settings from the environment (soakEnv,
// soakSeedEnv, soakStreamsEnv) and logs them with the way to repeat the
// run.
func soakSetup(t *testing.T) soakSettings {
	t.Helper()
	total := soakDefault
	if testing.Short() {
		total = soakShort
	}
	if s := os.Getenv(soakEnv); s != "" {
		var err error
		total, err = time.ParseDuration(s)
		require.NoError(t, err, soakEnv)
		require.Positive(t, total, soakEnv)
	}
	set := soakSettings{seed: rand.Uint64(), perRun: total / soakVariants, parallel: soakStreams}
	if s := os.Getenv(soakSeedEnv); s != "" {
		var err error
		set.seed, err = strconv.ParseUint(s, 10, 64)
		require.NoError(t, err, soakSeedEnv)
	}
	if s := os.Getenv(soakStreamsEnv); s != "" {
		var err error
		set.parallel, err = strconv.Atoi(s)
		require.NoError(t, err, soakStreamsEnv)
		require.Positive(t, set.parallel, soakStreamsEnv)
	}
	t.Logf("seed %d (set %s=%d to repeat the configurations and every stream's plan), %v per variant, %d streams at once",
		set.seed, soakSeedEnv, set.seed, set.perRun, set.parallel)
	return set
}

// soakMix derives the seed of stream idx of a variant from the run's seed
// (splitmix64's finalizer).
func soakMix(seed, variant, idx uint64) uint64 {
	z := seed ^ variant<<56 ^ idx*0x9E3779B97F4A7C15
	z = (z ^ z>>30) * 0xBF58476D1CE4E5B9
	z = (z ^ z>>27) * 0x94D049BB133111EB
	return z ^ z>>31
}

// soakTransport returns the transport of transports named name.
func soakTransport(t *testing.T, name string) transport {
	for _, tr := range transports {
		if tr.name == name {
			return tr
		}
	}
	t.Fatalf("no transport %q", name)
	return transport{}
}

// soakDialer is how a variant's Dialer pools its sessions, and whether
// the streams come in waves, so that sessions go idle between them.
type soakDialer struct {
	maxSessions, perSession int
	idle                    time.Duration
	waves                   bool
}

// soakConfigs draws the settings of a variant's sessions (region and queue
// size, polling, fallback, memory limits) and of its Dialer, so that runs
// cover backpressure, fallback, spilling to the heap, full queues and
// sessions that come and go.
func soakConfigs(rng *rand.Rand) (client, server shmlink.Config, pool soakDialer) {
	pick := func(v ...int) int { return v[rng.IntN(len(v))] }
	client.BufferSize = pick(2<<20, 4<<20, 0)
	client.QueueCap = uint32(pick(128, 1024, 0))
	for _, c := range []*shmlink.Config{&client, &server} {
		c.Fallback = rng.IntN(3) == 0
		c.PollTime = time.Duration(pick(0, -1, 200_000))
		c.StreamMemoryLimit = pick(0, -1, 64<<10)
		c.StreamHeapLimit = pick(0, -1, 256<<10)
		c.QueueFullTimeout = soakStall
		c.HandshakeTimeout = soakStall / 2 // a loaded machine is no handshake failure
	}
	pool = soakDialer{
		maxSessions: 1 + rng.IntN(4),
		perSession:  pick(1, 8, 32),
		idle:        time.Duration(pick(-1, 0, int(time.Millisecond)+rng.IntN(int(20*time.Millisecond)))),
	}
	pool.waves = pool.idle > 0 && rng.IntN(2) == 0
	return client, server, pool
}

// soakDescribe names the settings soakConfigs drew, for the log.
func soakDescribe(client, server shmlink.Config, pool soakDialer) string {
	side := func(c shmlink.Config) string {
		return fmt.Sprintf("fallback=%v poll=%v streamMem=%d heap=%d", c.Fallback, c.PollTime, c.StreamMemoryLimit, c.StreamHeapLimit)
	}
	return fmt.Sprintf("client{buffer=%d queue=%d %s} server{%s} dialer{max=%d per=%d idle=%v waves=%v}",
		client.BufferSize, client.QueueCap, side(client), side(server), pool.maxSessions, pool.perSession, pool.idle, pool.waves)
}

// soakRun is one variant of the soak: its counters for the report, the
// sessions it saw, and its failures.
type soakRun struct {
	seed  uint64 // the run's seed
	index uint64 // the variant's, mixed into every stream's seed

	streams, aborts, halfCloses atomic.Int64
	bytes                       atomic.Int64 // bytes checked by readers
	readTimeouts, writeTimeouts atomic.Int64
	partialWrites               atomic.Int64 // timed out after writing part of their bytes
	zeroCopy                    atomic.Int64 // Reserve/Flush, Peek/ReadBytes calls
	peerGone                    atomic.Int64 // writers stopped by the end of a closed peer's session
	progress                    atomic.Int64 // calls that moved bytes, for the watchdog
	waves                       atomic.Int64 // pauses between waves of streams

	// headerless holds the server's streams that have not got their
	// header yet (*shmlink.Stream -> struct{}): at the end, any left is a
	// stream the client never opened, or no longer has.
	headerless sync.Map

	mu       sync.Mutex
	failures []error
	sessions map[*session.Session]bool // true on the client side
	failed   chan struct{}             // closed at the first failure
	failOnce sync.Once
	stop     func() // ends every session at the first failure, so nothing hangs
}

// newSoakRun returns the run of variant index with the run's seed.
func newSoakRun(seed, index uint64) *soakRun {
	return &soakRun{seed: seed, index: index, sessions: map[*session.Session]bool{}, failed: make(chan struct{})}
}

// fail records err and ends the run: the sessions are closed, so that no
// stream waits for a peer that stopped; the errors that causes are not
// recorded.
func (r *soakRun) fail(err error) {
	r.failOnce.Do(func() {
		r.mu.Lock()
		r.failures = append(r.failures, err)
		r.mu.Unlock()
		close(r.failed)
		if r.stop != nil {
			r.stop()
		}
	})
}

// hasFailed reports whether the run has failed.
func (r *soakRun) hasFailed() bool {
	select {
	case <-r.failed:
		return true
	default:
		return false
	}
}

// printSessions writes, for a hung run, every session the run saw: its
// side, why it ended (nil: alive) and its counters.
func (r *soakRun) printSessions() {
	r.mu.Lock()
	defer r.mu.Unlock()
	for s, client := range r.sessions {
		fmt.Fprintf(os.Stderr, "session %p client=%v err=%v stats=%+v\n", s, client, s.Err(), s.Stats())
	}
}

// track remembers the session of a stream.
func (r *soakRun) track(c net.Conn, client bool) {
	r.mu.Lock()
	r.sessions[c.(*shmlink.Stream).Session()] = client
	r.mu.Unlock()
}

// watchdog stops the test binary, printing the seed and every goroutine's
// stack, if no call moves a byte for soakStall. It returns the function
// that ends it.
func (r *soakRun) watchdog() (stop func()) {
	done := make(chan struct{})
	go func() {
		tick := time.NewTicker(time.Second)
		defer tick.Stop()
		last, since := r.progress.Load(), time.Now()
		for {
			select {
			case <-done:
				return
			case now := <-tick.C:
				if p := r.progress.Load(); p != last {
					last, since = p, now
				} else if now.Sub(since) > soakStall {
					buf := make([]byte, 16<<20)
					fmt.Fprintf(os.Stderr, "soak: no progress for %v (%s=%d)\n%s\n", soakStall, soakSeedEnv, r.seed, buf[:runtime.Stack(buf, true)])
					r.printSessions()
					panic("soak: hung")
				}
			}
		}
	}()
	var once sync.Once
	return func() { once.Do(func() { close(done) }) }
}

// soakFlow is one direction of a stream as the model tracks it: what its
// writer's calls reported written (the n they returned) and what its
// reader got. Every byte is soakPattern(seed) at its offset in the direction.
type soakFlow struct {
	seed    uint64
	written int    // sum of the n of the writer's calls
	wsum    uint32 // CRC-32 of those bytes
	read    int    // bytes the reader got, each checked against the pattern
	rsum    uint32 // CRC-32 of them
	eof     bool   // the reader got io.EOF
}

// wrote accounts bytes the writer handed to the stream.
func (f *soakFlow) wrote(b []byte) {
	f.written += len(b)
	f.wsum = crc32.Update(f.wsum, crc32.IEEETable, b)
}

// got checks bytes the reader got from the call op against the pattern at
// the flow's offset and accounts them.
func (f *soakFlow) got(op string, b []byte) error {
	if i := soakMismatch(b, f.seed, f.read); i >= 0 {
		want := make([]byte, 1)
		soakPattern(want, f.seed, f.read+i)
		return fmt.Errorf("corrupt, lost, duplicated or reordered data: byte %d: got %#x want %#x (%s of %d bytes at %d; %s)",
			f.read+i, b[i], want[0], op, len(b), f.read, f.locate(b[i:], f.read+i))
	}
	f.read += len(b)
	f.rsum = crc32.Update(f.rsum, crc32.IEEETable, b)
	return nil
}

// soakPattern fills b with the bytes of the pattern of seed from offset
// off: byte j of splitmix64's finalizer of seed and the 8-byte word's
// index. Unlike peertest.Pattern, whose bytes at one offset look like its
// bytes at many others, any 16 bytes of it tell their offset and seed
// (locate).
func soakPattern(b []byte, seed uint64, off int) {
	for i := 0; i < len(b); {
		w := soakMix(seed, 0, uint64((off+i)/8))
		for j := (off + i) % 8; j < 8 && i < len(b); j, i = j+1, i+1 {
			b[i] = byte(w >> (8 * j))
		}
	}
}

// soakMismatch returns the index of the first byte of b that differs
// from soakPattern(seed) at off, or -1.
func soakMismatch(b []byte, seed uint64, off int) int {
	var want [4096]byte
	for i := 0; i < len(b); i += len(want) {
		k := min(len(b)-i, len(want))
		soakPattern(want[:k], seed, off+i)
		for j := range k {
			if b[i+j] != want[j] {
				return i + j
			}
		}
	}
	return -1
}

// locate says where wrong bytes b, read at offset at, belong: at another
// offset of this flow, up to what its writer wrote (lost, duplicated or
// reordered data), or nowhere in it (another stream's bytes, or memory
// overwritten while the reader held it). It tells the soak's failures
// apart.
func (f *soakFlow) locate(b []byte, at int) string {
	probe := b[:min(len(b), 16)]
	if len(probe) < 16 {
		return fmt.Sprintf("too few wrong bytes (%d) to locate", len(probe))
	}
	for off := 0; off <= f.written; off++ {
		if soakMismatch(probe, f.seed, off) < 0 {
			return fmt.Sprintf("the bytes from %d are this flow's bytes at %d (%+d); %d written so far", at, off, off-at, f.written)
		}
	}
	return fmt.Sprintf("the bytes from %d are none of the %d bytes written so far: another stream's, or overwritten", at, f.written)
}

// soakCheck compares what the reader of a direction got (got) with what
// its writer wrote (wrote; the same flow but for the echo of the
// two-process variant). A reader that saw EOF must have got exactly the
// bytes written; one whose side closed the stream early got a prefix (its
// bytes were checked as they came).
func soakCheck(name string, wrote, got *soakFlow) error {
	switch {
	case got.eof && (got.read != wrote.written || got.rsum != wrote.wsum):
		return fmt.Errorf("%s: EOF after %d bytes (crc %08x), but %d were written (crc %08x)",
			name, got.read, got.rsum, wrote.written, wrote.wsum)
	case got.read > wrote.written:
		return fmt.Errorf("%s: read %d bytes, but only %d were written", name, got.read, wrote.written)
	}
	return nil
}

// soakEnd is how a side ends its stream.
type soakEnd int

const (
	endHalfClose soakEnd = iota // write, CloseWrite, read to EOF, Close
	endLinger                   // write, read to EOF, Close (its EOF for the peer)
	endAbort                    // Close at a random point while writing and reading
)

// String names the end for messages.
func (e soakEnd) String() string {
	return [...]string{"half-close", "linger", "abort"}[e]
}

// soakPlan is what one side does with its stream.
type soakPlan struct {
	writes     int // Write (or Reserve/Flush) calls
	end        soakEnd
	closeWrite bool // CloseWrite after the writes: always for endHalfClose, sometimes for endAbort (racing its Close)
	abortAt    int  // endAbort: the Close comes after this many writes
	zeroCopy   bool // Reserve/Flush and Peek/ReadBytes too (never with endAbort)
}

// String describes the plan for messages.
func (p soakPlan) String() string {
	return fmt.Sprintf("%d writes, %v (CloseWrite %v, abort after %d writes), zero copy %v",
		p.writes, p.end, p.closeWrite, p.abortAt, p.zeroCopy)
}

// drawPlan draws one side's plan; linger is allowed only when the peer
// does not linger too (each would wait for the other's EOF).
func drawPlan(rng *rand.Rand, linger bool) soakPlan {
	p := soakPlan{writes: rng.IntN(soakMaxWrites + 1)}
	switch r := rng.IntN(20); {
	case r < 9:
		p.end = endHalfClose
	case r < 15 && linger:
		p.end = endLinger
	case r < 15:
		p.end = endHalfClose
	default:
		p.end = endAbort
	}
	p.closeWrite = p.end == endHalfClose || p.end == endAbort && rng.IntN(2) == 0
	p.abortAt = rng.IntN(p.writes + 1)
	p.zeroCopy = p.end != endAbort && rng.IntN(2) == 0
	return p
}

// soakSide is one end of a stream under test: its plan and the model of
// the directions it writes (out) and reads (in).
type soakSide struct {
	run     *soakRun
	conn    net.Conn
	st      *shmlink.Stream
	name    string // for errors: stream, seed and side
	seed    uint64 // of the side's random choices
	plan    soakPlan
	out, in *soakFlow
	closing atomic.Bool // Close was called: net.ErrClosed is expected from here on
	// peerClosed reports whether the other side, when it runs in this
	// process, has closed the stream. Its session may then end under us (a
	// Dialer closes an idle session, and a stream its client closed does
	// not count), and writes, whose bytes nobody reads, fail with the
	// session's *SessionError (ErrPeerClosed, or the control connection's
	// write error, such as EPIPE).
	peerClosed func() bool
}

// soakSize draws a size in [1, max] biased to small ones: the exponent is
// the smaller of two uniform draws.
func soakSize(rng *rand.Rand, max int) int {
	k := min(rng.IntN(21), rng.IntN(21))
	return min(1<<k+rng.IntN(1<<k), max)
}

// soakPause shapes the load with random yields and, rarely, a tiny sleep;
// nothing waits on it.
func soakPause(rng *rand.Rand) {
	switch r := rng.IntN(64); {
	case r < 12:
		runtime.Gosched()
	case r == 12:
		time.Sleep(time.Duration(rng.IntN(200)) * time.Microsecond)
	}
}

// soakDeadline draws the deadline of a call, one time in oneIn (else
// none): one that has passed, or one microseconds to milliseconds away
// that the call may or may not beat.
func soakDeadline(rng *rand.Rand, oneIn int) time.Time {
	if rng.IntN(oneIn) != 0 {
		return time.Time{}
	}
	switch rng.IntN(4) {
	case 0:
		return time.Now().Add(-time.Second)
	case 1:
		return time.Now().Add(time.Duration(rng.IntN(100)) * time.Microsecond)
	case 2:
		return time.Now().Add(time.Duration(rng.IntN(2000)) * time.Microsecond)
	}
	return time.Now().Add(time.Duration(rng.IntN(20)) * time.Millisecond)
}

// isTimeout reports whether err is a deadline error as package net has
// them; one that is only half of it (a net.Error timeout that does not
// unwrap to os.ErrDeadlineExceeded, or the reverse) is an error.
func isTimeout(err error) (bool, error) {
	var ne net.Error
	timeout := errors.As(err, &ne) && ne.Timeout()
	if exceeded := errors.Is(err, os.ErrDeadlineExceeded); timeout != exceeded {
		return false, fmt.Errorf("half a deadline error (Timeout %v, ErrDeadlineExceeded %v): %w", timeout, exceeded, err)
	}
	return timeout, nil
}

// expected sorts an error of a call: (false, nil) means a deadline passed
// and the side goes on; (true, nil) that the stream ended as the model
// allows (this side closed it; or, for a write, the peer closed it and its
// session ended) and the goroutine ends; otherwise the error is a failure.
func (sd *soakSide) expected(op string, err error, write bool) (end bool, failure error) {
	timeout, ferr := isTimeout(err)
	switch {
	case ferr != nil:
		return true, fmt.Errorf("%s: %w", op, ferr)
	case timeout:
		return false, nil
	case errors.Is(err, net.ErrClosed) && sd.closing.Load():
		return true, nil
	case write && errors.As(err, new(*session.SessionError)) && sd.peerClosed != nil && sd.peerClosed():
		sd.run.peerGone.Add(1)
		return true, nil
	}
	return true, fmt.Errorf("%s: %w", op, err)
}

// write runs the side's writes: random sizes of soakPattern(out.seed) at the
// flow's offset, random pauses and deadlines, counting exactly the n each
// call returns; then a CloseWrite for endHalfClose. It closes abort after
// plan.abortAt writes, or when it returns.
func (sd *soakSide) write(abort chan struct{}) error {
	var once sync.Once
	signal := func() { once.Do(func() { close(abort) }) }
	defer signal()
	rng := rand.New(rand.NewPCG(sd.seed, 1))
	var buf []byte
	deadline := false
	for i := range sd.plan.writes {
		if i == sd.plan.abortAt {
			signal()
		}
		soakPause(rng)
		size := soakSize(rng, soakMaxWrite)
		if sd.plan.zeroCopy && rng.IntN(6) == 0 {
			if deadline {
				if err := sd.conn.SetWriteDeadline(time.Time{}); err != nil {
					return fmt.Errorf("SetWriteDeadline: %w", err)
				}
				deadline = false
			}
			if stop, err := sd.reserve(rng, size); stop {
				return err
			}
			continue
		}
		if dl := soakDeadline(rng, 6); deadline || !dl.IsZero() {
			if err := sd.conn.SetWriteDeadline(dl); err != nil {
				if end, failure := sd.expected("SetWriteDeadline", err, true); end {
					return failure
				}
			}
			deadline = !dl.IsZero()
		}
		if cap(buf) < size {
			buf = make([]byte, size)
		}
		b := buf[:size]
		soakPattern(b, sd.out.seed, sd.out.written)
		n, err := sd.conn.Write(b)
		if n < 0 || n > size {
			return fmt.Errorf("write of %d bytes returned n=%d", size, n)
		}
		sd.out.wrote(b[:n])
		sd.run.progress.Add(1)
		if err == nil {
			if n != size {
				return fmt.Errorf("write of %d bytes returned n=%d and no error", size, n)
			}
			continue
		}
		if end, failure := sd.expected(fmt.Sprintf("write of %d bytes at %d (n=%d)", size, sd.out.written-n, n), err, true); end {
			return failure
		}
		sd.run.writeTimeouts.Add(1)
		if n > 0 {
			sd.run.partialWrites.Add(1)
		}
	}
	if sd.plan.closeWrite {
		if err := sd.conn.(interface{ CloseWrite() error }).CloseWrite(); err != nil {
			end, failure := sd.expected("CloseWrite", err, true)
			if !end {
				failure = fmt.Errorf("CloseWrite: %w", err)
			}
			return failure
		}
		sd.run.halfCloses.Add(1)
		if _, err := sd.conn.Write([]byte{0}); !errors.Is(err, net.ErrClosed) {
			return fmt.Errorf("write after CloseWrite: %v, want net.ErrClosed", err)
		}
	}
	return nil
}

// reserve writes size bytes of the pattern in place with Reserve calls of
// random sizes and one Flush. The plan allows it only on sides that do not
// abort, with no write deadline, so that the bytes count whole: the only
// error the model allows is the end of a closed peer's session, and then
// all size bytes count as written (the peer, which stopped reading, may
// have read any prefix of them; the flow ends without EOF). It reports
// whether the writer must stop.
func (sd *soakSide) reserve(rng *rand.Rand, size int) (stop bool, err error) {
	sum, off := sd.out.wsum, sd.out.written
	fail := func(op string, err error) (bool, error) {
		if end, failure := sd.expected(op, err, true); !end || failure != nil {
			return true, fmt.Errorf("%s: %w", op, err)
		}
		sd.out.written += size
		return true, nil
	}
	for done := 0; done < size; {
		k := min(size-done, 1+rng.IntN(soakMaxReserve))
		b, err := sd.st.Reserve(k)
		if err != nil {
			return fail(fmt.Sprintf("Reserve(%d) at %d", k, off+done), err)
		}
		if len(b) != k {
			return true, fmt.Errorf("Reserve(%d) returned %d bytes", k, len(b))
		}
		soakPattern(b, sd.out.seed, off+done)
		sum = crc32.Update(sum, crc32.IEEETable, b)
		done += k
		sd.run.zeroCopy.Add(1)
	}
	if err := sd.st.Flush(); err != nil {
		return fail(fmt.Sprintf("Flush of %d reserved bytes at %d", size, off), err)
	}
	sd.out.written += size
	sd.out.wsum = sum
	sd.run.progress.Add(1)
	return false, nil
}

// read reads the side's direction to EOF (or until the side closes),
// with random buffer sizes, pauses and deadlines, and zero-copy reads when
// the plan allows, checking every byte; after EOF a Read must give EOF
// again.
func (sd *soakSide) read() error {
	rng := rand.New(rand.NewPCG(sd.seed, 2))
	buf := make([]byte, soakMaxRead)
	deadline := false
	for {
		soakPause(rng)
		if dl := soakDeadline(rng, 12); deadline || !dl.IsZero() {
			if err := sd.conn.SetReadDeadline(dl); err != nil {
				if end, failure := sd.expected("SetReadDeadline", err, false); end {
					return failure
				}
			}
			deadline = !dl.IsZero()
		}
		var (
			b       []byte
			err     error
			release bool
			op      = "Read"
		)
		if buffered := sd.st.Buffered(); sd.plan.zeroCopy && buffered > 0 && rng.IntN(4) == 0 {
			// Zero copy: the bytes are there, so neither call waits.
			n := 1 + rng.IntN(min(buffered, soakMaxRead))
			op = "ReadBytes"
			if rng.IntN(2) == 0 {
				b, err = sd.st.ReadBytes(n)
			} else {
				op = "Peek"
				b, err = sd.st.Peek(n)
			}
			if err == nil && len(b) != n {
				return fmt.Errorf("%s(%d) returned %d bytes", op, n, len(b))
			}
			if op == "Peek" && err == nil {
				if err := sd.in.got(op, b); err != nil {
					return err
				}
				sd.run.bytes.Add(int64(n))
				b = nil
				if k, err := sd.st.Discard(n); k != n || err != nil {
					return fmt.Errorf("Discard(%d) after Peek: %d, %v", n, k, err)
				}
			}
			release = true
			sd.run.zeroCopy.Add(1)
		} else {
			var n int
			n, err = sd.conn.Read(buf[:soakSize(rng, soakMaxRead)])
			b = buf[:n]
		}
		if gerr := sd.in.got(op, b); gerr != nil {
			return gerr
		}
		sd.run.bytes.Add(int64(len(b)))
		sd.run.progress.Add(1)
		if release {
			sd.st.ReleasePreviousRead()
		}
		switch {
		case err == nil:
			continue
		case err == io.EOF:
			sd.in.eof = true
			n, err := sd.conn.Read(buf[:1])
			if errors.Is(err, net.ErrClosed) && sd.closing.Load() {
				return nil // this side's abort closed the stream meanwhile
			}
			if n != 0 || err != io.EOF {
				return fmt.Errorf("read after EOF at %d: %d, %v", sd.in.read, n, err)
			}
			return nil
		}
		if end, failure := sd.expected(fmt.Sprintf("read at %d", sd.in.read), err, false); end {
			return failure
		}
		sd.run.readTimeouts.Add(1)
	}
}

// play runs the side's plan: writer and reader at once, and the Close:
// once both are done for endHalfClose and endLinger, at a random point of
// the writes for endAbort. After the Close, Write and Read must fail with
// net.ErrClosed.
func (sd *soakSide) play() error {
	var (
		wg         sync.WaitGroup
		werr, rerr error
	)
	abort := make(chan struct{})
	wg.Add(2)
	go func() {
		defer wg.Done()
		werr = sd.write(abort)
	}()
	go func() {
		defer wg.Done()
		rerr = sd.read()
	}()
	var cerr error
	if sd.plan.end == endAbort {
		<-abort
		rng := rand.New(rand.NewPCG(sd.seed, 3))
		for range rng.IntN(8) {
			runtime.Gosched()
		}
		sd.closing.Store(true)
		sd.run.aborts.Add(1)
		cerr = sd.conn.Close()
		wg.Wait()
	} else {
		wg.Wait()
		if werr == nil && rerr == nil {
			sd.closing.Store(true)
			cerr = sd.conn.Close()
		}
	}
	if cerr != nil {
		cerr = fmt.Errorf("Close: %w", cerr)
	} else if sd.closing.Load() {
		if _, err := sd.conn.Write([]byte{0}); !errors.Is(err, net.ErrClosed) {
			cerr = fmt.Errorf("write after Close: %v, want net.ErrClosed", err)
		} else if _, err := sd.conn.Read(make([]byte, 1)); !errors.Is(err, net.ErrClosed) {
			cerr = fmt.Errorf("read after Close: %v, want net.ErrClosed", err)
		}
	}
	if err := errors.Join(werr, rerr, cerr); err != nil {
		if !sd.closing.Load() {
			sd.conn.Close()
		}
		return fmt.Errorf("%s (plan: %v): %w", sd.name, sd.plan, err)
	}
	return nil
}

// TestSoak runs many streams at once (soakStreams, hundreds over the run)
// over a Dialer's pooled sessions, with drawn session settings, against a
// Listener in this process and against the test server process, each over
// unix-memfd and tcp-file. Each side of each stream writes checksummed
// pattern data of random sizes (1 B to 1 MiB, mostly small) with random
// pauses and deadlines, sometimes zero copy, while it reads the other
// direction, and ends with CloseWrite, Close after EOF, or Close at a
// random point. Checked against the model: a reader that reached EOF got
// exactly the bytes the peer's calls reported written (n counted, every
// byte at its offset, CRC of the whole) and EOF again after that, one
// whose side closed early got a prefix of them, and deadline errors are
// proper net.Errors; nothing else may fail. At the end every session on
// both sides has no stream and no slice in use, and goroutines,
// descriptors and shared-memory files are back to where they were. The
// seed and length come from SHMLINK_SOAK_SEED and SHMLINK_SOAK (see
// soakSetup); `make soak` runs it long.
func TestSoak(t *testing.T) {
	set := soakSetup(t)
	for i, name := range []string{"unix-memfd", "tcp-file"} {
		t.Run(name, func(t *testing.T) {
			soakInProcess(t, soakTransport(t, name), set, uint64(i))
		})
	}
	for i, name := range []string{"unix-memfd", "tcp-file"} {
		t.Run("two-process/"+name, func(t *testing.T) {
			soakTwoProcess(t, soakTransport(t, name), set, uint64(2+i))
		})
	}
}

// soakPair is one stream of the in-process variant: both plans and both
// directions.
type soakPair struct {
	seed           uint64
	c2s, s2c       soakFlow
	client, server soakPlan
	clientSide     *soakSide
	serverSide     atomic.Pointer[soakSide]
	serverDone     chan struct{} // closed when the server side is done
}

// soakHeader is what a client writes first on a stream of the in-process
// variant: the stream's index, by which the server finds its pair.
const soakHeader = 8

// soakInProcess runs the in-process variant: a Dialer and a Listener in
// this process, so that the checks see both sides.
func soakInProcess(t *testing.T, tr transport, set soakSettings, variant uint64) {
	run := newSoakRun(set.seed, variant)
	ccfg, scfg, pool := soakConfigs(rand.New(rand.NewPCG(set.seed, variant)))
	t.Logf("seed %d, %s", set.seed, soakDescribe(ccfg, scfg, pool))
	dir := t.TempDir()
	addr := "127.0.0.1:0"
	if tr.network == "unix" {
		addr = filepath.Join(dir, "s.sock")
	}
	ccfg.ShmDir, scfg.ShmDir, ccfg.MemoryType = dir, dir, tr.memory
	base := snapshot(t, dir)

	// The listener as listen (conn_test.go) makes it, with drawn settings.
	lc := shmlink.ListenConfig{Config: &scfg}
	ln, err := lc.Listen(context.Background(), tr.network, addr)
	require.NoError(t, err)
	t.Cleanup(func() { ln.CloseSessions() })
	d := &shmlink.Dialer{Config: &ccfg, MaxSessions: pool.maxSessions, StreamsPerSession: pool.perSession, IdleTimeout: pool.idle}
	t.Cleanup(func() { d.Close() })
	run.stop = func() {
		d.Close()
		ln.CloseSessions()
	}
	stopWatchdog := run.watchdog()
	defer stopWatchdog()

	var pairs sync.Map // stream index -> *soakPair
	var handlers sync.WaitGroup
	handlers.Add(1)
	go func() {
		defer handlers.Done()
		for {
			conn, err := ln.Accept()
			if err != nil {
				if !errors.Is(err, net.ErrClosed) {
					run.fail(fmt.Errorf("accept: %w", err))
				}
				return
			}
			run.track(conn, false)
			handlers.Add(1)
			go func() {
				defer handlers.Done()
				soakServe(run, conn, &pairs)
			}()
		}
	}()

	var pause time.Duration // between waves
	if pool.waves {
		pause = 2 * pool.idle
	}
	elapsed := soakLoad(run, set, pause, func(idx uint64) error {
		return soakStream(run, d, tr.network, ln.Addr().String(), idx, &pairs)
	})
	soakRequireNoFailure(t, run, handlers.Wait)
	soakRequireSettled(t, run)
	stopWatchdog()
	soakReport(t, run, tr.name, elapsed, set)

	derr, lerr := d.Close(), ln.Close()
	handlers.Wait()
	soakRequireNoFailure(t, run, func() {}) // a failure meanwhile closed them first
	require.NoError(t, derr)
	require.NoError(t, lerr)
	requireBackTo(t, base, func(c *assert.CollectT) {
		assert.Zero(c, d.NumSessions(), "Dialer sessions")
		assert.Zero(c, ln.NumSessions(), "listener sessions")
	}, dir)
}

// soakLoad runs stream(1), stream(2), ... set.parallel at a time until
// the variant's time is up or the run fails, and returns how long that
// took. With pause zero a stream starts as soon as one ends; otherwise
// they run in waves of set.parallel, with a random pause of up to pause
// after each wave (load shaping: the sessions may or may not go idle).
func soakLoad(run *soakRun, set soakSettings, pause time.Duration, stream func(idx uint64) error) time.Duration {
	t0 := time.Now()
	end := t0.Add(set.perRun)
	var next atomic.Uint64
	slot := func(once bool) {
		for time.Now().Before(end) && !run.hasFailed() {
			if err := stream(next.Add(1)); err != nil && !run.hasFailed() {
				run.fail(err)
			}
			if once {
				return
			}
		}
	}
	rng := rand.New(rand.NewPCG(run.seed, run.index))
	for {
		var slots sync.WaitGroup
		for range set.parallel {
			slots.Add(1)
			go func() {
				defer slots.Done()
				slot(pause > 0)
			}()
		}
		slots.Wait()
		if pause == 0 || !time.Now().Before(end) || run.hasFailed() {
			return time.Since(t0)
		}
		run.waves.Add(1)
		time.Sleep(time.Duration(rng.Int64N(int64(pause))))
	}
}

// soakStream runs stream idx of the in-process variant, client side: it
// dials, registers the pair for the server, sends the header, plays the
// client's plan, waits for the server side and checks both directions.
func soakStream(run *soakRun, d *shmlink.Dialer, network, addr string, idx uint64, pairs *sync.Map) error {
	seed := soakMix(run.seed, run.index, idx)
	rng := rand.New(rand.NewPCG(seed, 0))
	p := &soakPair{seed: seed, c2s: soakFlow{seed: seed}, s2c: soakFlow{seed: ^seed}, serverDone: make(chan struct{})}
	p.client = drawPlan(rng, true)
	p.server = drawPlan(rng, p.client.end != endLinger)
	name := fmt.Sprintf("stream %d (seed %d)", idx, seed)
	conn, err := d.Dial(network, addr)
	if err != nil {
		return fmt.Errorf("%s: dial: %w", name, err)
	}
	run.track(conn, true)
	p.clientSide = &soakSide{run: run, conn: conn, st: conn.(*shmlink.Stream), name: name + " client",
		seed: seed ^ 1, plan: p.client, out: &p.c2s, in: &p.s2c,
		peerClosed: func() bool {
			ss := p.serverSide.Load()
			return ss != nil && ss.closing.Load()
		}}
	pairs.Store(idx, p)
	defer pairs.Delete(idx)
	var hdr [soakHeader]byte
	binary.BigEndian.PutUint64(hdr[:], idx)
	if _, err := conn.Write(hdr[:]); err != nil {
		conn.Close()
		return fmt.Errorf("%s: header: %w", name, err)
	}
	cerr := p.clientSide.play()
	select {
	case <-p.serverDone:
	case <-run.failed:
		return cerr
	}
	run.streams.Add(1)
	return errors.Join(cerr,
		soakCheck(name+" client to server", &p.c2s, &p.c2s),
		soakCheck(name+" server to client", &p.s2c, &p.s2c))
}

// soakServe plays the server side of an accepted stream of the in-process
// variant.
func soakServe(run *soakRun, conn net.Conn, pairs *sync.Map) {
	var hdr [soakHeader]byte
	run.headerless.Store(conn, struct{}{})
	_, err := io.ReadFull(conn, hdr[:])
	run.headerless.Delete(conn)
	if err != nil {
		conn.Close()
		if !run.hasFailed() {
			run.fail(fmt.Errorf("server: header: %w", err))
		}
		return
	}
	idx := binary.BigEndian.Uint64(hdr[:])
	v, ok := pairs.Load(idx)
	if !ok {
		conn.Close()
		run.fail(fmt.Errorf("server: header names stream %d, which is not running", idx))
		return
	}
	p := v.(*soakPair)
	defer close(p.serverDone)
	side := &soakSide{run: run, conn: conn, st: conn.(*shmlink.Stream),
		name: fmt.Sprintf("stream %d (seed %d) server", idx, p.seed),
		seed: p.seed ^ 2, plan: p.server, out: &p.s2c, in: &p.c2s,
		peerClosed: p.clientSide.closing.Load}
	p.serverSide.Store(side)
	if err := side.play(); err != nil && !run.hasFailed() {
		run.fail(err)
	}
}

// soakRequireNoFailure fails the test with the run's failure, if any,
// after waiting (wait) for what the run's stop ended.
func soakRequireNoFailure(t *testing.T, run *soakRun, wait func()) {
	t.Helper()
	if !run.hasFailed() {
		return
	}
	wait()
	run.mu.Lock()
	defer run.mu.Unlock()
	for _, err := range run.failures {
		t.Error(err)
	}
	t.Fatalf("soak failed (%s=%d repeats the configurations and plans)", soakSeedEnv, run.seed)
}

// soakRequireSettled waits until every session the run saw, on either
// side, has no stream and no slice in use (closes and frees travel
// asynchronously, so it polls, like requireBackTo).
func soakRequireSettled(t *testing.T, run *soakRun) {
	t.Helper()
	run.mu.Lock()
	sessions := make(map[*session.Session]bool, len(run.sessions))
	for s, client := range run.sessions {
		sessions[s] = client
	}
	run.mu.Unlock()
	settled := assert.EventuallyWithT(t, func(c *assert.CollectT) {
		for s, client := range sessions {
			st := s.Stats()
			assert.Zero(c, st.ActiveStreams, "streams of a session (client %v, %v)", client, s.Err())
			for list, n := range st.SlicesInUse { // nil once the session released its memory
				assert.Zero(c, n, "slices in use in buffer list %d (client %v)", list, client)
			}
		}
	}, 10*time.Second, time.Millisecond)
	if !settled {
		run.headerless.Range(func(k, _ any) bool {
			st := k.(*shmlink.Stream)
			t.Errorf("the server accepted stream %d (session %p), which never got its first byte: no client stream of the test has it", st.ID(), st.Session())
			return true
		})
		t.FailNow()
	}
}

// soakReport logs what the run did, with the sum of its sessions'
// counters.
func soakReport(t *testing.T, run *soakRun, name string, elapsed time.Duration, set soakSettings) {
	t.Helper()
	var clients, servers int
	var sum session.Stats
	run.mu.Lock()
	for s, client := range run.sessions {
		st := s.Stats()
		if client {
			clients++
		} else {
			servers++
		}
		sum.BytesSent += st.BytesSent
		sum.MemoryFull += st.MemoryFull
		sum.FallbackWrites += st.FallbackWrites
		sum.Spilled += st.Spilled
		sum.QueueFull += st.QueueFull
		sum.WakeupsSent += st.WakeupsSent
	}
	run.mu.Unlock()
	streams := run.streams.Load()
	mib := float64(run.bytes.Load()) / (1 << 20)
	t.Logf("%s: %v, seed %d: %d streams (%d at once, %d pauses), %.1f MiB moved and checked (%.1f MiB/s); "+
		"sides: %d half-closes, %d aborts, %d writers stopped by a closed peer's session end; "+
		"deadlines hit: %d writes (%d after part of their bytes), %d reads; %d zero-copy calls; "+
		"sessions: %d client, %d server; their counters: %.1f MiB sent, %d memory full, %d fallback writes, %.1f MiB spilled, %d queue full, %d wakeups",
		name, elapsed.Round(time.Millisecond), set.seed, streams, set.parallel, run.waves.Load(), mib, mib/elapsed.Seconds(),
		run.halfCloses.Load(), run.aborts.Load(), run.peerGone.Load(),
		run.writeTimeouts.Load(), run.partialWrites.Load(), run.readTimeouts.Load(), run.zeroCopy.Load(),
		clients, servers, float64(sum.BytesSent)/(1<<20), sum.MemoryFull, sum.FallbackWrites, float64(sum.Spilled)/(1<<20), sum.QueueFull, sum.WakeupsSent)
	require.Positive(t, streams, "no stream completed")
}

// soakTwoProcess runs the two-process variant: the streams echo in the test
// server process (peertest.CmdEcho), so the client side of each stream half-closes
// or aborts (an echo cannot linger), and what it reads back must be
// exactly what its calls reported written, or a prefix when it closed
// early. The client's sessions are checked (the region is shared, so
// their slices in use count the server's too), then the server is stopped
// first (the tail of an aborted echo may still be under way, and its
// end must look like a close to the server, not a failure) and must exit
// cleanly with nothing on stderr; then this process must be back to its
// goroutines, descriptors and files.
func soakTwoProcess(t *testing.T, tr transport, set soakSettings, variant uint64) {
	run := newSoakRun(set.seed, variant)
	ccfg, _, pool := soakConfigs(rand.New(rand.NewPCG(set.seed, variant)))
	if pool.idle > 0 {
		// A session closed for idleness while the server still echoes the
		// tail of an aborted stream fails that echo, on the server's stderr.
		pool.idle = -1
	}
	pool.waves = false
	t.Logf("seed %d, %s (server: the test server's defaults)", set.seed, soakDescribe(ccfg, shmlink.Config{}, pool))
	dir := t.TempDir()
	addr := "127.0.0.1:0"
	if tr.network == "unix" {
		addr = filepath.Join(dir, "s.sock")
	}
	proc := peertest.Start(t, "server", peertest.Params{Network: tr.network, Addr: addr, ShmDir: dir})
	addr = proc.Expect(t, "ready ")
	base := snapshot(t, dir)
	ccfg.ShmDir, ccfg.MemoryType = dir, tr.memory
	d := &shmlink.Dialer{Config: &ccfg, MaxSessions: pool.maxSessions, StreamsPerSession: pool.perSession, IdleTimeout: pool.idle}
	t.Cleanup(func() { d.Close() })
	run.stop = func() { d.Close() }
	stopWatchdog := run.watchdog()
	defer stopWatchdog()

	elapsed := soakLoad(run, set, 0, func(idx uint64) error {
		return soakEcho(run, d, tr.network, addr, idx)
	})
	soakRequireNoFailure(t, run, func() {})
	soakRequireSettled(t, run)
	stopWatchdog()
	soakReport(t, run, "two-process "+tr.name, elapsed, set)

	proc.Stop(t)
	require.NoError(t, d.Close())
	soakRequireNoFailure(t, run, func() {})
	requireBackTo(t, base, func(c *assert.CollectT) {
		assert.Zero(c, d.NumSessions(), "Dialer sessions")
	}, dir)
}

// soakEcho runs stream idx of the two-process variant: an echo stream of
// the test server, whose direction back must carry exactly what the
// client wrote.
func soakEcho(run *soakRun, d *shmlink.Dialer, network, addr string, idx uint64) error {
	seed := soakMix(run.seed, run.index, idx)
	plan := drawPlan(rand.New(rand.NewPCG(seed, 0)), false)
	name := fmt.Sprintf("stream %d (seed %d)", idx, seed)
	conn, err := d.Dial(network, addr)
	if err != nil {
		return fmt.Errorf("%s: dial: %w", name, err)
	}
	run.track(conn, true)
	var hdr [9]byte
	hdr[0] = peertest.CmdEcho
	if _, err := conn.Write(hdr[:]); err != nil {
		conn.Close()
		return fmt.Errorf("%s: command: %w", name, err)
	}
	out, in := &soakFlow{seed: seed}, &soakFlow{seed: seed}
	side := &soakSide{run: run, conn: conn, st: conn.(*shmlink.Stream), name: name + " client",
		seed: seed ^ 1, plan: plan, out: out, in: in}
	err = side.play()
	run.streams.Add(1)
	return errors.Join(err, soakCheck(name+" echo", out, in))
}

// TestSoakLocate checks the soak's diagnosis of wrong bytes: bytes of the
// flow from another offset are found there, foreign bytes are not.
func TestSoakLocate(t *testing.T) {
	f := &soakFlow{seed: 42, read: 1000, written: 5000}
	b := make([]byte, 100)
	soakPattern(b[:10], f.seed, 1000)
	soakPattern(b[10:], f.seed, 4000) // 2990 bytes skipped
	err := f.got("Read", b)
	require.ErrorContains(t, err, "byte 1010:")
	require.ErrorContains(t, err, "this flow's bytes at 4000 (+2990)")
	soakPattern(b[10:], f.seed, 21) // a duplicate from before
	require.ErrorContains(t, f.got("Read", b), "this flow's bytes at 21 (-989)")
	soakPattern(b[10:], f.seed+1, 1010) // another stream's
	require.ErrorContains(t, f.got("Peek", b), "none of the 5000 bytes")
	require.Equal(t, 1000, f.read, "failed checks account nothing")
	require.NoError(t, f.got("Read", b[:10]))
	require.Equal(t, 1010, f.read)
}
