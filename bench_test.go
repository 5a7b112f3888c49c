package shmlink_test

// Benchmarks of issue #4: shmlink against the kernel's loopback transports
// and two stream multiplexers, client and server in two processes, all in
// one `go test -bench` run so that the ratios are taken side by side.
//
//	make bench     # bench.txt, and the README's tables in bench.md
//
// The server is this test binary re-executed (role "bench", see runPeer):
// it listens on every transport at once and serves each connection by the
// 17-byte header the client sends first (benchHeader).

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"encoding/binary"
	"fmt"
	"io"
	"math/big"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"runtime"
	"runtime/pprof"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"
	"unsafe"

	"github.com/hashicorp/yamux"
	"github.com/quic-go/quic-go"
	"github.com/shmlink/shmlink"
	"github.com/shmlink/shmlink/internal/peertest"
	"github.com/shmlink/shmlink/session"
	"golang.org/x/sys/unix"
)

// Modes of a benchmark connection: the first byte of its header.
const (
	modePingPong   = 'P' // echo messages of size bytes with Read/Write
	modePingPongZC = 'Z' // the same with ReadChunk/Reserve (shmlink only)
	modeSink       = 'S' // read count messages of size bytes, then ack 1 byte
	modeSinkZC     = 'T' // the same with ReadChunk (shmlink only)
)

// benchHeader is the header of a benchmark connection: mode, then the
// message size and count as big-endian u64.
func benchHeader(mode byte, size, count int) []byte {
	h := make([]byte, 17)
	h[0] = mode
	binary.BigEndian.PutUint64(h[1:], uint64(size))
	binary.BigEndian.PutUint64(h[9:], uint64(count))
	return h
}

// benchProfileEnv names a file for the server process's CPU profile:
// go test's -cpuprofile covers the client process only.
const benchProfileEnv = "SHMLINK_BENCH_SERVER_CPUPROFILE"

// benchBufferSizeEnv, when set, is the Config.BufferSize in bytes of the
// regions that the benchmarks' shmlink clients on Unix sockets create
// (the default is 32 MiB): for cases whose data in flight outgrows the
// default region.
const benchBufferSizeEnv = "SHMLINK_BENCH_BUFFER_SIZE"

// benchConfig returns the Config of the shmlink bench clients: nil (the
// defaults) unless benchBufferSizeEnv is set. A value that is not a
// byte count fails the benchmark.
func benchConfig(b *testing.B) *shmlink.Config {
	v := os.Getenv(benchBufferSizeEnv)
	if v == "" {
		return nil
	}
	n, err := strconv.Atoi(v)
	if err != nil {
		b.Fatalf("%s=%q: want a size in bytes", benchBufferSizeEnv, v)
	}
	return &shmlink.Config{BufferSize: n}
}

// The transports, by their benchmark names.
const (
	tShmlink   = "shmlink"
	tShmlinkZC = "shmlink-zerocopy"
	tUDS       = "uds"
	tTCP       = "tcp"
	tYamux     = "yamux"
	tQUIC      = "quic"
	// tQUICShmlink is shmlink's own "quic" network, over quic-go.
	tQUICShmlink = "quic-shmlink"
)

var benchTransports = []string{tShmlink, tShmlinkZC, tUDS, tTCP, tYamux, tQUIC, tQUICShmlink}

// benchALPN is the TLS application protocol of the QUIC transport.
const benchALPN = "shmlink-bench"

// selfSignedTLS returns a server TLS config with a fresh self-signed
// certificate (the client does not verify it: both ends are this binary).
func selfSignedTLS() (*tls.Config, error) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, err
	}
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(1),
		NotBefore:    time.Now().Add(-time.Hour),
		NotAfter:     time.Now().Add(24 * time.Hour),
		DNSNames:     []string{"localhost"},
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		return nil, err
	}
	cert := tls.Certificate{Certificate: [][]byte{der}, PrivateKey: key}
	return &tls.Config{Certificates: []tls.Certificate{cert}, NextProtos: []string{benchALPN}}, nil
}

// quicStream adapts a QUIC stream and its connection to io.ReadWriteCloser:
// Close ends the stream both ways.
type quicStream struct{ *quic.Stream }

func (q quicStream) Close() error {
	q.CancelRead(0)
	return q.Stream.Close()
}

// runBenchServer is the server process of the benchmarks: it listens on
// every transport in p.Dir (sockets) and on 127.0.0.1 (TCP,
// QUIC), prints "ready" and the addresses, and serves until standard input
// closes.
func runBenchServer(p peertest.Params) int {
	dir := p.Dir
	fail := func(err error) int {
		fmt.Fprintln(os.Stderr, "bench server:", err)
		return 1
	}
	if path := p.CPUProfile; path != "" {
		// The server's half of a profile: go test's -cpuprofile covers
		// the client process only.
		f, err := os.Create(path)
		if err != nil {
			return fail(err)
		}
		if err := pprof.StartCPUProfile(f); err != nil {
			return fail(err)
		}
		defer func() {
			pprof.StopCPUProfile()
			f.Close()
		}()
	}
	shmLn, err := shmlink.Listen("unix", filepath.Join(dir, "shm.sock"))
	if err != nil {
		return fail(err)
	}
	udsLn, err := net.Listen("unix", filepath.Join(dir, "uds.sock"))
	if err != nil {
		return fail(err)
	}
	tcpLn, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return fail(err)
	}
	yLn, err := net.Listen("unix", filepath.Join(dir, "yamux.sock"))
	if err != nil {
		return fail(err)
	}
	tlsConf, err := selfSignedTLS()
	if err != nil {
		return fail(err)
	}
	qLn, err := quic.ListenAddr("127.0.0.1:0", tlsConf, &quic.Config{MaxIncomingStreams: 1 << 12})
	if err != nil {
		return fail(err)
	}
	qsLn, err := (&shmlink.ListenConfig{TLSConfig: tlsConf}).Listen(context.Background(), "quic", "127.0.0.1:0")
	if err != nil {
		return fail(err)
	}
	shmHTTPLn, err := shmlink.Listen("unix", filepath.Join(dir, "shm-http.sock"))
	if err != nil {
		return fail(err)
	}
	udsHTTPLn, err := net.Listen("unix", filepath.Join(dir, "uds-http.sock"))
	if err != nil {
		return fail(err)
	}
	fmt.Printf("ready %s %s %s %s %s %s %s %s\n", shmLn.Addr(), udsLn.Addr(), tcpLn.Addr(), yLn.Addr(), qLn.Addr(), shmHTTPLn.Addr(), udsHTTPLn.Addr(), qsLn.Addr())
	httpSrv := &http.Server{Handler: http.HandlerFunc(serveHTTPBench)}
	go httpSrv.Serve(shmHTTPLn)
	go httpSrv.Serve(udsHTTPLn)

	serveAll := func(ln net.Listener, wrap func(net.Conn)) {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go wrap(c)
		}
	}
	plain := func(c net.Conn) { benchServe(c) }
	go serveAll(shmLn, plain)
	go serveAll(udsLn, plain)
	go serveAll(tcpLn, plain)
	go serveAll(qsLn, plain)
	go serveAll(yLn, func(c net.Conn) {
		cfg := yamux.DefaultConfig()
		cfg.LogOutput = io.Discard
		cfg.EnableKeepAlive = false
		s, err := yamux.Server(c, cfg)
		if err != nil {
			c.Close()
			return
		}
		serveAll(s, plain)
	})
	go func() {
		for {
			c, err := qLn.Accept(context.Background())
			if err != nil {
				return
			}
			go func() {
				for {
					s, err := c.AcceptStream(context.Background())
					if err != nil {
						return
					}
					go benchServe(quicStream{s})
				}
			}()
		}
	}()
	io.Copy(io.Discard, os.Stdin)
	httpSrv.Close()
	shmLn.Close()
	udsLn.Close()
	tcpLn.Close()
	qsLn.CloseSessions()
	yLn.Close()
	qLn.Close()
	return 0
}

// benchServe serves one benchmark connection by its header.
func benchServe(c io.ReadWriteCloser) {
	defer c.Close()
	var h [17]byte
	if _, err := io.ReadFull(c, h[:]); err != nil {
		return
	}
	size := int(binary.BigEndian.Uint64(h[1:]))
	count := int(binary.BigEndian.Uint64(h[9:]))
	if size <= 0 || size > 64<<20 {
		return
	}
	st, _ := c.(*shmlink.Stream)
	switch h[0] {
	case modePingPong:
		buf := make([]byte, size)
		for {
			if _, err := io.ReadFull(c, buf); err != nil {
				return
			}
			if _, err := c.Write(buf); err != nil {
				return
			}
		}
	case modePingPongZC:
		if st == nil {
			return
		}
		// Each chunk is copied from the request's slice straight into the
		// response's slices and its slice released: one copy. (Reserving
		// the response while holding the request's slice could wait for
		// ever once 64 streams hold every slice of the largest class.)
		maxChunk := st.Session().MaxSliceSize()
		for {
			in, err := st.ReadChunk(maxChunk)
			if err != nil {
				return
			}
			_, err = st.Write(in)
			st.ReleasePreviousRead()
			if err != nil {
				return
			}
		}
	case modeSink:
		if _, err := io.CopyBuffer(io.Discard, io.LimitReader(c, int64(size)*int64(count)), make([]byte, 256<<10)); err != nil {
			return
		}
		c.Write([]byte{1})
	case modeSinkZC:
		if st == nil {
			return
		}
		for need := size * count; need > 0; {
			b, err := st.ReadChunk(need)
			if err != nil {
				return
			}
			need -= len(b)
			st.ReleasePreviousRead()
		}
		c.Write([]byte{1})
	}
}

// benchPeer is the running server process and the addresses it listens on.
type benchPeer struct {
	srv   *peertest.BenchServer
	dir   string
	addrs map[string]string // by transport
	err   error
}

var (
	benchOnce   sync.Once
	benchServer *benchPeer
)

// startBenchServer starts the server process once for every benchmark of
// the run; stopBenchServer (from TestMain) ends it.
func startBenchServer(b *testing.B) *benchPeer {
	benchOnce.Do(func() {
		p := &benchPeer{}
		benchServer = p
		p.dir, p.err = os.MkdirTemp("", "shmlink-bench-")
		if p.err != nil {
			return
		}
		var f []string
		p.srv, f, p.err = peertest.StartBenchServer("bench",
			peertest.Params{Dir: p.dir, CPUProfile: os.Getenv(benchProfileEnv)}, 8,
			"QUIC_GO_DISABLE_RECEIVE_BUFFER_WARNING=true")
		if p.err != nil {
			return
		}
		p.addrs = map[string]string{tShmlink: f[0], tShmlinkZC: f[0], tUDS: f[1], tTCP: f[2], tYamux: f[3], tQUIC: f[4],
			httpPrefix + tShmlink: f[5], httpPrefix + tUDS: f[6], tQUICShmlink: f[7]}
	})
	if benchServer.err != nil {
		b.Fatal(benchServer.err)
	}
	return benchServer
}

// stopBenchServer ends the server process, if a benchmark started it.
func stopBenchServer() {
	if p := benchServer; p != nil {
		if p.srv != nil {
			p.srv.Stop()
		}
		os.RemoveAll(p.dir)
	}
}

// benchClient opens connections of one transport to the server; close
// ends every connection and the session (shmlink, yamux, QUIC) behind
// them.
type benchClient struct {
	dial  func() (io.ReadWriteCloser, error)
	close func()
	// shmlink's Dialer, for its sessions' Stats.
	dialer *shmlink.Dialer
}

func newBenchClient(b *testing.B, transport string) *benchClient {
	p := startBenchServer(b)
	addr := p.addrs[transport]
	switch transport {
	case tShmlink, tShmlinkZC:
		d := &shmlink.Dialer{Config: benchConfig(b)}
		return &benchClient{
			dial:   func() (io.ReadWriteCloser, error) { return d.Dial("unix", addr) },
			close:  func() { d.Close() },
			dialer: d,
		}
	case tUDS, tTCP:
		network := map[string]string{tUDS: "unix", tTCP: "tcp"}[transport]
		return &benchClient{
			dial:  func() (io.ReadWriteCloser, error) { return net.Dial(network, addr) },
			close: func() {},
		}
	case tYamux:
		conn, err := net.Dial("unix", addr)
		if err != nil {
			b.Fatal(err)
		}
		cfg := yamux.DefaultConfig()
		cfg.LogOutput = io.Discard
		cfg.EnableKeepAlive = false
		s, err := yamux.Client(conn, cfg)
		if err != nil {
			b.Fatal(err)
		}
		return &benchClient{
			dial:  func() (io.ReadWriteCloser, error) { return s.Open() },
			close: func() { s.Close() },
		}
	case tQUICShmlink:
		d := &shmlink.Dialer{TLSConfig: &tls.Config{InsecureSkipVerify: true}}
		return &benchClient{
			dial:  func() (io.ReadWriteCloser, error) { return d.Dial("quic", addr) },
			close: func() { d.Close() },
		}
	case tQUIC:
		tlsConf := &tls.Config{InsecureSkipVerify: true, NextProtos: []string{benchALPN}}
		c, err := quic.DialAddr(context.Background(), addr, tlsConf, &quic.Config{})
		if err != nil {
			b.Fatal(err)
		}
		return &benchClient{
			dial: func() (io.ReadWriteCloser, error) {
				s, err := c.OpenStreamSync(context.Background())
				if err != nil {
					return nil, err
				}
				return quicStream{s}, nil
			},
			close: func() { c.CloseWithError(0, "") },
		}
	}
	b.Fatalf("unknown transport %q", transport)
	return nil
}

// open dials one connection and sends its header.
func (bc *benchClient) open(b *testing.B, mode byte, size, count int) io.ReadWriteCloser {
	c, err := bc.dial()
	if err != nil {
		b.Fatal(err)
	}
	if _, err := c.Write(benchHeader(mode, size, count)); err != nil {
		b.Fatal(err)
	}
	return c
}

// pingPonger runs one round trip of a request and an equal-size response
// per call.
type pingPonger func() error

// newPingPonger opens a ping-pong connection of transport and returns its
// round trip. The zero-copy transport reserves the request in place and
// reads the response in place, without copying either.
func newPingPonger(b *testing.B, bc *benchClient, transport string, size int) (pingPonger, io.Closer) {
	if transport == tShmlinkZC {
		st := bc.open(b, modePingPongZC, size, 0).(*shmlink.Stream)
		maxChunk := st.Session().MaxSliceSize()
		return func() error {
			if err := reserveMessage(st, size); err != nil {
				return err
			}
			for left := size; left > 0; {
				in, err := st.ReadChunk(min(left, maxChunk))
				if err != nil {
					return err
				}
				left -= len(in)
				st.ReleasePreviousRead()
			}
			return nil
		}, st
	}
	c := bc.open(b, modePingPong, size, 0)
	buf := make([]byte, size)
	return func() error {
		if _, err := c.Write(buf); err != nil {
			return err
		}
		_, err := io.ReadFull(c, buf)
		return err
	}, c
}

// sizeName names a message size the way the issue does: 64B, 1KB, 1MB.
func sizeName(n int) string {
	switch {
	case n >= 1<<20:
		return strconv.Itoa(n>>20) + "MB"
	case n >= 1<<10:
		return strconv.Itoa(n>>10) + "KB"
	}
	return strconv.Itoa(n) + "B"
}

// benchCPU returns a meter of the CPU time of both processes of the
// benchmarks: this one and the server.
func benchCPU(b *testing.B) *peertest.CPUMeter {
	return peertest.NewCPUMeter(os.Getpid(), startBenchServer(b).srv.Pid())
}

// contended runs f twice as sub-benchmarks: "idle", as the machine is, and
// "contended", while another process keeps every core busy
// (peertest.StartHog): a shared host's other tenants.
func contended(b *testing.B, f func(b *testing.B)) {
	b.Run("idle", f)
	b.Run("contended", func(b *testing.B) {
		peertest.StartHog(b)
		f(b)
	})
}

// BenchmarkPingPong: one stream, a request and an equal-size response per
// op, client and server in two processes. SetBytes counts both messages;
// cpu-us/op is the CPU time of both processes per round trip, srv-cpu-us/op
// the server's part of it.
func BenchmarkPingPong(b *testing.B) {
	sizes := []int{64, 1 << 10, 4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20}
	for _, transport := range benchTransports {
		b.Run(transport, func(b *testing.B) {
			for _, size := range sizes {
				b.Run(sizeName(size), func(b *testing.B) { pingPong(b, transport, size) })
			}
		})
	}
}

// waitStats reports, for a shmlink client, how its reader's waits ended
// per op since stats0: "hits/op" (a spin got the data), "miss/op" (a spin
// gave up), "parks/op" (it slept until a wakeup came), "self/op" (it read
// the control connection itself while asleep), and the Pollings the
// client sent ("wsent/op") and received ("wrecv/op").
type waitStats struct {
	sess   *session.Session
	stats0 session.Stats
}

// newWaitStats starts counting the waits of c's session, if c is a
// shmlink stream.
func newWaitStats(c any) *waitStats {
	st, ok := c.(*shmlink.Stream)
	if !ok {
		return nil
	}
	return &waitStats{sess: st.Session(), stats0: st.Session().Stats()}
}

// report reports the waits per op since newWaitStats.
func (w *waitStats) report(b *testing.B, ops int) {
	if w == nil || ops <= 0 {
		return
	}
	st := w.sess.Stats()
	b.ReportMetric(float64(st.SpinHits-w.stats0.SpinHits)/float64(ops), "hits/op")
	b.ReportMetric(float64(st.Parks-w.stats0.Parks)/float64(ops), "parks/op")
	b.ReportMetric(float64(st.SelfWakes-w.stats0.SelfWakes)/float64(ops), "self/op")
	b.ReportMetric(float64(st.SpinMisses-w.stats0.SpinMisses)/float64(ops), "miss/op")
	b.ReportMetric(float64(st.WakeupsSent-w.stats0.WakeupsSent)/float64(ops), "wsent/op")
	b.ReportMetric(float64(st.WakeupsReceived-w.stats0.WakeupsReceived)/float64(ops), "wrecv/op")
}

// pingPong is one case of BenchmarkPingPong.
func pingPong(b *testing.B, transport string, size int) {
	bc := newBenchClient(b, transport)
	defer bc.close()
	rt, c := newPingPonger(b, bc, transport, size)
	defer c.Close()
	measureRoundTrips(b, rt, c, size, benchCPU(b))
}

// measureRoundTrips warms rt up with 10 round trips (first slices,
// buffers, windows), then runs it b.N times, reporting 2*size bytes and
// the allocations per round trip, the CPU time of cpu's processes per
// round trip, and how the reader of c (a shmlink stream) waited
// (waitStats).
func measureRoundTrips(b *testing.B, rt pingPonger, c any, size int, cpu *peertest.CPUMeter) {
	for range 10 {
		if err := rt(); err != nil {
			b.Fatal(err)
		}
	}
	b.SetBytes(2 * int64(size))
	b.ReportAllocs()
	waits := newWaitStats(c)
	b.ResetTimer()
	cpu.Start(b)
	for b.Loop() {
		if err := rt(); err != nil {
			b.Fatal(err)
		}
	}
	cpu.ReportCPU(b, b.N)
	waits.report(b, b.N)
}

// benchParallelStreams is the number of concurrent streams (goroutines)
// of BenchmarkPingPongParallel.
const benchParallelStreams = 64

// BenchmarkPingPongParallel: 64 streams on one client, each running round
// trips as fast as it can (uds and tcp use 64 sockets; yamux, QUIC and
// shmlink multiplex them over one connection or session). Over shmlink it
// also reports spill-KB/op and memfull/op (memoryStats).
func BenchmarkPingPongParallel(b *testing.B) {
	for _, transport := range benchTransports {
		b.Run(transport, func(b *testing.B) {
			for _, size := range []int{64, 4 << 10, 1 << 20} {
				b.Run(sizeName(size), func(b *testing.B) { pingPongParallel(b, transport, size) })
			}
		})
	}
}

// pingPongParallel is one case of BenchmarkPingPongParallel.
func pingPongParallel(b *testing.B, transport string, size int) {
	bc := newBenchClient(b, transport)
	defer bc.close()
	rts := make(chan pingPonger, benchParallelStreams)
	for range benchParallelStreams {
		rt, c := newPingPonger(b, bc, transport, size)
		defer c.Close()
		if err := rt(); err != nil {
			b.Fatal(err)
		}
		rts <- rt
	}
	b.SetBytes(2 * int64(size))
	b.ReportAllocs()
	procs := runtime.GOMAXPROCS(0)
	b.SetParallelism((benchParallelStreams + procs - 1) / procs)
	cpu := benchCPU(b)
	mem := newMemoryStats(bc)
	b.ResetTimer()
	cpu.Start(b)
	var failed error
	var mu sync.Mutex
	b.RunParallel(func(pb *testing.PB) {
		var rt pingPonger
		select {
		case rt = <-rts:
		default:
			// More goroutines than streams (GOMAXPROCS not a divisor
			// of 64): the others run the loop.
			return
		}
		for pb.Next() {
			if err := rt(); err != nil {
				mu.Lock()
				failed = err
				mu.Unlock()
				return
			}
		}
	})
	if failed != nil {
		b.Fatal(failed)
	}
	cpu.ReportCPU(b, b.N)
	mem.report(b, b.N)
}

// memoryStats reports, for a shmlink client, how short its buffer regions
// ran per op since stats0 (all its sessions): "spill-KB/op", the KiB of
// received data copied out of shared memory for stalled readers
// (docs/protocol.md section 13), and "memfull/op", the writes that found
// the region exhausted and waited for space (or fell back).
type memoryStats struct {
	dialer *shmlink.Dialer
	stats0 shmlink.Stats
}

// newMemoryStats starts counting for bc's Dialer, if it is shmlink's.
func newMemoryStats(bc *benchClient) *memoryStats {
	if bc.dialer == nil {
		return nil
	}
	return &memoryStats{dialer: bc.dialer, stats0: bc.dialer.Stats()}
}

// report reports the counts per op since newMemoryStats.
func (m *memoryStats) report(b *testing.B, ops int) {
	if m == nil || ops <= 0 {
		return
	}
	st := m.dialer.Stats()
	b.ReportMetric(float64(st.Spilled-m.stats0.Spilled)/1024/float64(ops), "spill-KB/op")
	b.ReportMetric(float64(st.MemoryFull-m.stats0.MemoryFull)/float64(ops), "memfull/op")
}

// BenchmarkMemoryCopy measures the memory's side of BenchmarkPingPongParallel
// at 1 MB over Read/Write (issue #16, "bulk at the memory's speed"): per
// op, the four copies of 1 MiB that one round trip makes (the request into
// the transport, out of it into the server's buffer, the response into the
// transport, out of it into the client's buffer), in pieces of 64 KiB, one
// event's most (docs/protocol.md section 3.2), with the best case for the
// transport's own memory: each piece goes through a 64 KiB buffer that stays
// in the CPU's cache. The applications' buffers are laid out as in that
// case, 64 client and 64 server buffers of 1 MiB (128 MiB, far beyond the
// caches). GOMAXPROCS goroutines copy at once, each through its own share
// of the streams. Nothing else happens: no queue, no wakeup, no lock, no
// line fetched from the other CPU's cache. Its ns/op is therefore a bound
// under that case's time per round trip over any transport that copies
// each byte four times, the kernel's sockets included; the README's tables
// compare against it.
func BenchmarkMemoryCopy(b *testing.B) {
	b.Run("PingPongParallel/1MB", func(b *testing.B) {
		const size, piece = 1 << 20, 64 << 10
		procs := runtime.GOMAXPROCS(0)
		streams := max(benchParallelStreams/procs, 1)
		type lane struct{ client, server [][]byte }
		lanes := make(chan lane, procs)
		for range procs {
			var l lane
			for range streams {
				l.client = append(l.client, make([]byte, size))
				l.server = append(l.server, make([]byte, size))
			}
			// Every page touched, as the transports' buffers are after
			// their warm-up round trips.
			for _, p := range append(l.client, l.server...) {
				for i := range p {
					p[i] = byte(i)
				}
			}
			lanes <- l
		}
		b.SetBytes(2 * size)
		b.ReportAllocs()
		b.ResetTimer()
		b.RunParallel(func(pb *testing.PB) {
			l := <-lanes
			stage := make([]byte, piece)
			move := func(dst, src []byte) { // in and out of the transport
				for o := 0; o < size; o += piece {
					copy(stage, src[o:o+piece])
					copy(dst[o:o+piece], stage)
				}
			}
			for s := 0; pb.Next(); s = (s + 1) % len(l.client) {
				move(l.server[s], l.client[s])
				move(l.client[s], l.server[s])
			}
		})
	})
}

// BenchmarkStream: one-way messages of 10KB, 64KB and 1MB on one stream,
// as fast as the writer can go; the op is one message. It reports
// messages/s and, for shmlink, the FallbackData messages sent (backpressure
// keeps it at 0).
func BenchmarkStream(b *testing.B) {
	for _, transport := range benchTransports {
		b.Run(transport, func(b *testing.B) {
			for _, size := range []int{10 << 10, 64 << 10, 1 << 20} {
				b.Run(streamSizeName(size), func(b *testing.B) { oneWay(b, transport, size) })
			}
		})
	}
}

// streamSizeName names BenchmarkStream's sizes: 10KB is not a power of 2.
func streamSizeName(size int) string {
	if size == 10<<10 {
		return "10KB"
	}
	return sizeName(size)
}

// oneWay is one case of BenchmarkStream.
func oneWay(b *testing.B, transport string, size int) {
	bc := newBenchClient(b, transport)
	defer bc.close()
	n := b.N
	mode := byte(modeSink)
	if transport == tShmlinkZC {
		mode = modeSinkZC
	}
	c := bc.open(b, mode, size, n)
	defer c.Close()
	var stats0 session.Stats
	st, _ := c.(*shmlink.Stream)
	if st != nil {
		stats0 = st.Session().Stats()
	}
	buf := make([]byte, size)
	b.SetBytes(int64(size))
	b.ReportAllocs()
	cpu := benchCPU(b)
	b.ResetTimer()
	cpu.Start(b)
	for range n {
		var err error
		if transport == tShmlinkZC {
			err = reserveMessage(st, size)
		} else {
			_, err = c.Write(buf)
		}
		if err != nil {
			b.Fatal(err)
		}
	}
	var ack [1]byte
	if _, err := io.ReadFull(c, ack[:]); err != nil {
		b.Fatal(err)
	}
	b.StopTimer()
	cpu.ReportCPU(b, n)
	b.ReportMetric(float64(n)/b.Elapsed().Seconds(), "msg/s")
	if st != nil {
		stats := st.Session().Stats()
		b.ReportMetric(float64(stats.FallbackWrites-stats0.FallbackWrites), "fallbacks")
		b.ReportMetric(float64(stats.WakeupsSent-stats0.WakeupsSent)/float64(n), "wakeups/op")
		b.ReportMetric(float64(stats.MemoryFull-stats0.MemoryFull)/float64(n), "full/op")
	}
}

// The transports of the benchmarks of busy hosts, paced requests and
// HTTP: shmlink against the plain Unix socket it replaces.
var localTransports = []string{tShmlink, tShmlinkZC, tUDS}

// BenchmarkContended runs the ping-pong, 64-stream ping-pong and one-way
// cases of 64 B and 1 MB (one-way: 64 KB and 1 MB), on idle cores and while
// another process keeps every core busy (see contended), for shmlink and
// a Unix socket: what a sidecar on a shared host sees.
func BenchmarkContended(b *testing.B) {
	contended(b, func(b *testing.B) {
		for _, size := range []int{64, 1 << 20} {
			b.Run("PingPong/"+sizeName(size), func(b *testing.B) {
				for _, transport := range localTransports {
					b.Run(transport, func(b *testing.B) { pingPong(b, transport, size) })
				}
			})
		}
		for _, size := range []int{64, 1 << 20} {
			b.Run("PingPongParallel/"+sizeName(size), func(b *testing.B) {
				for _, transport := range localTransports {
					b.Run(transport, func(b *testing.B) { pingPongParallel(b, transport, size) })
				}
			})
		}
		for _, size := range []int{64 << 10, 1 << 20} {
			b.Run("Stream/"+sizeName(size), func(b *testing.B) {
				for _, transport := range localTransports {
					b.Run(transport, func(b *testing.B) { oneWay(b, transport, size) })
				}
			})
		}
	})
}

// BenchmarkPaced: 64 B requests and responses on one stream with a pause
// between them (100 us, 1 ms, 10 ms), as requests arrive at a service
// that is not saturated: the reader has gone to sleep (or spun in vain)
// by the time each request comes. It reports the round trip's p50 and p99
// (the pause is not counted; ns/op is) and the CPU time of both processes
// per request, on idle cores and contended.
func BenchmarkPaced(b *testing.B) {
	contended(b, func(b *testing.B) {
		for _, gap := range []time.Duration{100 * time.Microsecond, time.Millisecond, 10 * time.Millisecond} {
			b.Run("gap="+gap.String(), func(b *testing.B) {
				for _, transport := range localTransports {
					b.Run(transport, func(b *testing.B) { paced(b, transport, gap) })
				}
			})
		}
	})
}

// paced is one case of BenchmarkPaced.
func paced(b *testing.B, transport string, gap time.Duration) {
	bc := newBenchClient(b, transport)
	defer bc.close()
	rt, c := newPingPonger(b, bc, transport, 64)
	defer c.Close()
	measurePaced(b, rt, c, gap, benchCPU(b))
}

// measurePaced warms rt up with 10 round trips, then runs it b.N times,
// each after a pause of gap (pauser), and reports the round trips' p50
// and p99 (the pauses not counted), the CPU time of cpu's processes per
// round trip, and how the reader of c (a shmlink stream) waited
// (waitStats).
func measurePaced(b *testing.B, rt pingPonger, c any, gap time.Duration, cpu *peertest.CPUMeter) {
	for range 10 {
		if err := rt(); err != nil {
			b.Fatal(err)
		}
	}
	lat := make(peertest.Latencies, 0, b.N)
	b.ReportAllocs()
	waits := newWaitStats(c)
	b.ResetTimer()
	cpu.Start(b)
	p := newPauser(b, gap)
	for b.Loop() {
		if err := p.pause(); err != nil { // the workload's pause, not synchronisation
			b.Fatal(err)
		}
		t0 := time.Now()
		if err := rt(); err != nil {
			b.Fatal(err)
		}
		lat = append(lat, time.Since(t0))
	}
	cpu.ReportCPU(b, b.N)
	lat.Report(b)
	waits.report(b, b.N)
}

// pauser makes the pauses of the paced benchmarks. A goroutine that
// pauses waits in the runtime's network poller for a timer file
// (timerfd_create(2), CLOCK_MONOTONIC, one-shot), as a service's goroutine
// waits for its next request on a socket: it parks, and its thread and P
// go idle. The timer's resolution is the kernel's (Go's own timers round a
// pause of 100 µs up to about 1 ms here). Its system calls are raw ones,
// like the control connection's (docs/protocol.md section 12.4), so that
// the pause itself does not wake the runtime's monitor thread.
//
// A thread's sleep (nanosleep(2) through package unix) was the pause
// before. It holds the goroutine's P in a system call for the whole gap,
// which keeps the runtime's monitor thread (sysmon) awake, polling every
// 20 µs to 10 ms, until it retakes the P: traced with 10 ms gaps and a
// busy loop on every CPU, 55 sysmon wakeups in one gap. Whether sysmon
// retook the P early, and slept, depended on what the process's other P
// was doing, so the cost fell on one transport's client and not on the
// other's: CPU per request, both processes, shmlink 3.3 times uds's with
// the thread's sleep and 0.97 times with this pause (3 alternating rounds,
// medians). No Go service waits for its next request that way.
type pauser struct {
	f    *os.File
	rc   syscall.RawConn
	spec unix.ItimerSpec
	buf  [8]byte
}

// newPauser returns a pauser whose pauses last gap; the benchmark's
// cleanup closes its timer file.
func newPauser(b *testing.B, gap time.Duration) *pauser {
	fd, err := unix.TimerfdCreate(unix.CLOCK_MONOTONIC, unix.TFD_NONBLOCK|unix.TFD_CLOEXEC)
	if err != nil {
		b.Fatal("timerfd_create:", err)
	}
	p := &pauser{f: os.NewFile(uintptr(fd), "timerfd")}
	b.Cleanup(func() { p.f.Close() })
	if p.rc, err = p.f.SyscallConn(); err != nil {
		b.Fatal(err)
	}
	p.spec.Value = unix.NsecToTimespec(gap.Nanoseconds())
	return p
}

// pause arms the timer and parks the goroutine until it expires. Its
// error is that of a failed system call.
func (p *pauser) pause() error {
	var errno syscall.Errno
	err := p.rc.Control(func(fd uintptr) {
		_, _, errno = unix.RawSyscall6(unix.SYS_TIMERFD_SETTIME, fd, 0,
			uintptr(unsafe.Pointer(&p.spec)), 0, 0, 0)
	})
	if err == nil && errno == 0 {
		err = p.rc.Read(func(fd uintptr) bool {
			_, _, errno = unix.RawSyscall(unix.SYS_READ, fd,
				uintptr(unsafe.Pointer(&p.buf[0])), uintptr(len(p.buf)))
			return errno != unix.EAGAIN
		})
	}
	if err == nil && errno != 0 {
		err = os.NewSyscallError("timerfd", errno)
	}
	return err
}

// BenchmarkPacedSessions: 64 B requests 10 ms apart from 8 clients at
// once, each with a session (shmlink) or a socket (uds) of its own: a
// sidecar serving several processes whose requests come in gaps. Each
// session has a housekeeping timer (docs/protocol.md section 12.2), and
// each of its firings wakes the process. It reports the round trip's p50 and p99 (the pause is not
// counted; ns/op is, divided by the clients) and the CPU time of both
// processes per request.
func BenchmarkPacedSessions(b *testing.B) {
	for _, transport := range []string{tShmlink, tUDS} {
		b.Run(transport, func(b *testing.B) { pacedSessions(b, transport, 10*time.Millisecond, 8) })
	}
}

// pacedSessions is one case of BenchmarkPacedSessions: clients round
// trips, gap apart on each, over a session or socket each.
func pacedSessions(b *testing.B, transport string, gap time.Duration, clients int) {
	var bc *benchClient
	if transport == tShmlink { // a session per client
		d := &shmlink.Dialer{MaxSessions: clients, StreamsPerSession: 1, Config: benchConfig(b)}
		addr := startBenchServer(b).addrs[transport]
		bc = &benchClient{
			dial:   func() (io.ReadWriteCloser, error) { return d.Dial("unix", addr) },
			close:  func() { d.Close() },
			dialer: d,
		}
	} else {
		bc = newBenchClient(b, transport)
	}
	defer bc.close()
	rts := make([]pingPonger, clients)
	for i := range rts {
		rt, c := newPingPonger(b, bc, transport, 64)
		defer c.Close()
		if err := rt(); err != nil {
			b.Fatal(err)
		}
		rts[i] = rt
	}
	if bc.dialer != nil && bc.dialer.NumSessions() != clients {
		b.Fatalf("%d sessions for %d clients", bc.dialer.NumSessions(), clients)
	}
	lats := make([]peertest.Latencies, clients)
	for i := range lats {
		lats[i] = make(peertest.Latencies, 0, b.N) // any client may run them all
	}
	b.ReportAllocs()
	cpu := benchCPU(b)
	var left atomic.Int64
	left.Store(int64(b.N))
	errs := make(chan error, clients)
	start := make(chan struct{}) // the clients' goroutines start outside the timing
	for i, rt := range rts {
		p := newPauser(b, gap)
		go func() {
			<-start
			for left.Add(-1) >= 0 {
				if err := p.pause(); err != nil { // the workload's pause, as in paced
					errs <- err
					return
				}
				t0 := time.Now()
				if err := rt(); err != nil {
					errs <- err
					return
				}
				lats[i] = append(lats[i], time.Since(t0))
			}
			errs <- nil
		}()
	}
	b.ResetTimer()
	cpu.Start(b)
	close(start)
	for range clients {
		if err := <-errs; err != nil {
			b.Fatal(err)
		}
	}
	b.StopTimer()
	cpu.ReportCPU(b, b.N)
	var all peertest.Latencies
	for _, l := range lats {
		all = append(all, l...)
	}
	all.Report(b)
}

// httpPrefix marks the addresses of the HTTP servers in benchPeer.addrs.
const httpPrefix = "http-"

// serveHTTPBench answers GET /<n> with n bytes (at most 1 MiB).
func serveHTTPBench(w http.ResponseWriter, r *http.Request) {
	n, err := strconv.Atoi(strings.TrimPrefix(r.URL.Path, "/"))
	if err != nil || n < 0 || n > 1<<20 {
		http.Error(w, "bad size", http.StatusBadRequest)
		return
	}
	w.Header().Set("Content-Length", strconv.Itoa(n))
	w.Write(httpBody[:n])
}

// httpBody is what serveHTTPBench answers, a prefix of it.
var httpBody = make([]byte, 1<<20)

// BenchmarkHTTP: HTTP/1.1 GETs of 64 B and 64 KB bodies through net/http
// on both ends, from 1 and 16 concurrent clients (kept-alive connections,
// one per client), over shmlink and a Unix socket, on idle cores and
// contended (see contended); reports requests/s and the CPU time of both
// processes per request.
func BenchmarkHTTP(b *testing.B) {
	contended(b, func(b *testing.B) {
		for _, size := range []int{64, 64 << 10} {
			for _, clients := range []int{1, 16} {
				b.Run(fmt.Sprintf("GET-%s/c%d", sizeName(size), clients), func(b *testing.B) {
					for _, transport := range []string{tShmlink, tUDS} {
						b.Run(transport, func(b *testing.B) { httpGets(b, transport, size, clients) })
					}
				})
			}
		}
	})
}

// httpGets is one case of BenchmarkHTTP.
func httpGets(b *testing.B, transport string, size, clients int) {
	p := startBenchServer(b)
	addr := p.addrs[httpPrefix+transport]
	tr := &http.Transport{MaxIdleConnsPerHost: clients, DisableCompression: true}
	if transport == tShmlink {
		d := &shmlink.Dialer{Config: benchConfig(b)}
		defer d.Close()
		tr.DialContext = func(ctx context.Context, _, _ string) (net.Conn, error) { return d.DialContext(ctx, "unix", addr) }
	} else {
		var d net.Dialer
		tr.DialContext = func(ctx context.Context, _, _ string) (net.Conn, error) { return d.DialContext(ctx, "unix", addr) }
	}
	defer tr.CloseIdleConnections()
	client := &http.Client{Transport: tr}
	url := "http://bench/" + strconv.Itoa(size)
	// get GETs url and checks the body, read into buf (one per client).
	get := func(buf []byte) error {
		resp, err := client.Get(url)
		if err != nil {
			return err
		}
		defer resp.Body.Close()
		n, err := io.ReadFull(resp.Body, buf)
		if err != io.ErrUnexpectedEOF || n != size || resp.StatusCode != http.StatusOK {
			return fmt.Errorf("GET %s: status %d, %d bytes (%v), want %d", url, resp.StatusCode, n, err, size)
		}
		return nil
	}
	for range clients { // warm up: a connection per client
		if err := get(make([]byte, size+1)); err != nil {
			b.Fatal(err)
		}
	}
	b.ReportAllocs()
	cpu := benchCPU(b)
	var next atomic.Int64
	var failed atomic.Pointer[error]
	b.ResetTimer()
	cpu.Start(b)
	var wg sync.WaitGroup
	for range clients {
		wg.Go(func() {
			buf := make([]byte, size+1)
			for next.Add(1) <= int64(b.N) {
				if err := get(buf); err != nil {
					failed.CompareAndSwap(nil, &err)
					return
				}
			}
		})
	}
	wg.Wait()
	b.StopTimer()
	if err := failed.Load(); err != nil {
		b.Fatal(*err)
	}
	cpu.ReportCPU(b, b.N)
	b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "req/s")
}

// reserveMessage sends one message of size bytes built in place, a slice
// at a time: the application writes each part into shared memory (here
// only its first byte) and flushes it.
func reserveMessage(st *shmlink.Stream, size int) error {
	maxChunk := st.Session().MaxSliceSize()
	for left := size; left > 0; {
		out, err := st.Reserve(min(left, maxChunk))
		if err != nil {
			return err
		}
		out[0] = byte(left)
		left -= len(out)
		if err := st.Flush(); err != nil {
			return err
		}
	}
	return nil
}

// BenchmarkIdle measures what an idle shmlink session costs: the CPU time
// both processes use over 5 s after traffic stops (as a percentage of one
// core), and, for the first message after the pause, its round trip and
// the wakeup messages it took (1: the receiver sleeps, and one socket
// message wakes it, not a timer).
func BenchmarkIdle(b *testing.B) {
	const idle = 5 * time.Second
	p := startBenchServer(b)
	bc := newBenchClient(b, tShmlink)
	defer bc.close()
	rt, c := newPingPonger(b, bc, tShmlink, 64)
	defer c.Close()
	sess := c.(*shmlink.Stream).Session()
	for b.Loop() {
		for range 1000 {
			if err := rt(); err != nil {
				b.Fatal(err)
			}
		}
		cpu := peertest.NewCPUMeter(os.Getpid())
		server := peertest.NewCPUMeter(p.srv.Pid())
		cpu.Start(b)
		server.Start(b)
		time.Sleep(idle) // the measurement window, not synchronisation
		self, srv := cpu.Stop(b), server.Stop(b)
		w0 := sess.Stats().WakeupsSent
		t0 := time.Now()
		if err := rt(); err != nil {
			b.Fatal(err)
		}
		first := time.Since(t0)
		b.ReportMetric(100*float64(self)/float64(idle), "client-cpu-%")
		b.ReportMetric(100*float64(srv)/float64(idle), "server-cpu-%")
		b.ReportMetric(float64(first.Nanoseconds()), "first-rt-ns")
		b.ReportMetric(float64(sess.Stats().WakeupsSent-w0), "wakeups")
	}
}

// BenchmarkInProcess: BenchmarkPingPong's round trips with client and
// server in the test process (an echo goroutine per connection), over
// shmlink and a Unix socket, idle and contended: the path of two sessions
// of one process (docs/protocol.md section 12.9). SetBytes counts both
// messages; cpu-us/op is the process's CPU time per round trip. Paced is
// BenchmarkPaced's case in one process: 64 B round trips with a pause of
// 1 ms before each, reporting p50 and p99.
func BenchmarkInProcess(b *testing.B) {
	contended(b, func(b *testing.B) {
		for _, size := range []int{64, 4 << 10, 64 << 10} {
			b.Run("PingPong/"+sizeName(size), func(b *testing.B) {
				for _, transport := range []string{tShmlink, tUDS} {
					b.Run(transport, func(b *testing.B) {
						rt, c := inProcessPingPonger(b, transport, size)
						measureRoundTrips(b, rt, c, size, peertest.NewCPUMeter(os.Getpid()))
					})
				}
			})
		}
		gap := time.Millisecond
		b.Run("Paced/gap="+gap.String(), func(b *testing.B) {
			for _, transport := range []string{tShmlink, tUDS} {
				b.Run(transport, func(b *testing.B) {
					rt, c := inProcessPingPonger(b, transport, 64)
					measurePaced(b, rt, c, gap, peertest.NewCPUMeter(os.Getpid()))
				})
			}
		})
	})
}

// inProcessPingPonger returns the round trip of size bytes of a case of
// BenchmarkInProcess and its client connection: a listener in the test
// process, an echo goroutine per accepted connection, and a dialed
// client, all closed when the benchmark ends.
func inProcessPingPonger(b *testing.B, transport string, size int) (pingPonger, net.Conn) {
	path := filepath.Join(b.TempDir(), "s")
	var ln net.Listener
	var err error
	if transport == tShmlink {
		ln, err = shmlink.Listen("unix", path)
	} else {
		ln, err = net.Listen("unix", path)
	}
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { ln.Close() })
	go func() {
		for {
			conn, err := ln.Accept()
			if err != nil {
				return
			}
			go func() {
				defer conn.Close()
				io.Copy(conn, conn)
			}()
		}
	}()
	dial := net.Dial
	if transport == tShmlink {
		dial = shmlink.Dial
	}
	c, err := dial("unix", path)
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { c.Close() })
	buf := make([]byte, size)
	rt := func() error {
		if _, err := c.Write(buf); err != nil {
			return err
		}
		_, err := io.ReadFull(c, buf)
		return err
	}
	return rt, c
}
