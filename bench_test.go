package shmlink_test

// Benchmarks of issue #4: shmlink against the kernel's loopback transports
// and two stream multiplexers, client and server in two processes, all in
// one `go test -bench` run so that the ratios are taken side by side.
//
//	make bench     # go test -run '^$' -bench . -benchmem -count 6 . | tee bench.txt
//
// The server is this test binary re-executed (role "bench", see runPeer):
// it listens on every transport at once and serves each connection by the
// 17-byte header the client sends first (benchHeader).

import (
	"bufio"
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
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"runtime/pprof"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/hashicorp/yamux"
	"github.com/quic-go/quic-go"
	"github.com/shmlink/shmlink"
	"github.com/shmlink/shmlink/internal/peertest"
	"github.com/shmlink/shmlink/session"
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

// The transports, by their benchmark names.
const (
	tShmlink   = "shmlink"
	tShmlinkZC = "shmlink-zerocopy"
	tUDS       = "uds"
	tTCP       = "tcp"
	tYamux     = "yamux"
	tQUIC      = "quic"
)

var benchTransports = []string{tShmlink, tShmlinkZC, tUDS, tTCP, tYamux, tQUIC}

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
	fmt.Printf("ready %s %s %s %s %s\n", shmLn.Addr(), udsLn.Addr(), tcpLn.Addr(), yLn.Addr(), qLn.Addr())

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
	shmLn.Close()
	udsLn.Close()
	tcpLn.Close()
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
	cmd   *exec.Cmd
	stdin io.WriteCloser
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
		p.cmd = peertest.Cmd("bench", peertest.Params{Dir: p.dir, CPUProfile: os.Getenv(benchProfileEnv)})
		p.cmd.Env = append(p.cmd.Env, "QUIC_GO_DISABLE_RECEIVE_BUFFER_WARNING=true")
		p.cmd.Stderr = os.Stderr
		if p.stdin, p.err = p.cmd.StdinPipe(); p.err != nil {
			return
		}
		stdout, err := p.cmd.StdoutPipe()
		if err != nil {
			p.err = err
			return
		}
		if p.err = p.cmd.Start(); p.err != nil {
			return
		}
		line, err := bufio.NewReader(stdout).ReadString('\n')
		f := strings.Fields(line)
		if err != nil || len(f) != 6 || f[0] != "ready" {
			p.err = fmt.Errorf("bench server said %q: %v", line, err)
			return
		}
		p.addrs = map[string]string{tShmlink: f[1], tShmlinkZC: f[1], tUDS: f[2], tTCP: f[3], tYamux: f[4], tQUIC: f[5]}
	})
	if benchServer.err != nil {
		b.Fatal(benchServer.err)
	}
	return benchServer
}

// stopBenchServer ends the server process, if a benchmark started it.
func stopBenchServer() {
	if p := benchServer; p != nil && p.cmd != nil && p.cmd.Process != nil {
		p.stdin.Close()
		p.cmd.Wait()
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
		d := &shmlink.Dialer{}
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

// BenchmarkPingPong: one stream, a request and an equal-size response per
// op, client and server in two processes. SetBytes counts both messages.
func BenchmarkPingPong(b *testing.B) {
	sizes := []int{64, 1 << 10, 4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20}
	for _, transport := range benchTransports {
		b.Run(transport, func(b *testing.B) {
			for _, size := range sizes {
				b.Run(sizeName(size), func(b *testing.B) {
					bc := newBenchClient(b, transport)
					defer bc.close()
					rt, c := newPingPonger(b, bc, transport, size)
					defer c.Close()
					for range 10 { // warm up: first slices, buffers, windows
						if err := rt(); err != nil {
							b.Fatal(err)
						}
					}
					b.SetBytes(2 * int64(size))
					b.ReportAllocs()
					b.ResetTimer()
					for b.Loop() {
						if err := rt(); err != nil {
							b.Fatal(err)
						}
					}
				})
			}
		})
	}
}

// benchParallelStreams is the number of concurrent streams (goroutines)
// of BenchmarkPingPongParallel.
const benchParallelStreams = 64

// BenchmarkPingPongParallel: 64 streams on one client, each running round
// trips as fast as it can (uds and tcp use 64 sockets; yamux, QUIC and
// shmlink multiplex them over one connection or session).
func BenchmarkPingPongParallel(b *testing.B) {
	for _, transport := range benchTransports {
		b.Run(transport, func(b *testing.B) {
			for _, size := range []int{64, 4 << 10, 1 << 20} {
				b.Run(sizeName(size), func(b *testing.B) {
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
					b.ResetTimer()
					var failed error
					var mu sync.Mutex
					b.RunParallel(func(pb *testing.PB) {
						var rt pingPonger
						select {
						case rt = <-rts:
						default:
							// More goroutines than streams (GOMAXPROCS not
							// a divisor of 64): the others run the loop.
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
				})
			}
		})
	}
}

// BenchmarkStream: one-way messages of 10KB, 64KB and 1MB on one stream,
// as fast as the writer can go; the op is one message. It reports
// messages/s and, for shmlink, the FallbackData messages sent (backpressure
// keeps it at 0).
func BenchmarkStream(b *testing.B) {
	for _, transport := range benchTransports {
		b.Run(transport, func(b *testing.B) {
			for _, size := range []int{10 << 10, 64 << 10, 1 << 20} {
				name := sizeName(size)
				if size == 10<<10 {
					name = "10KB"
				}
				b.Run(name, func(b *testing.B) {
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
					b.ResetTimer()
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
					b.ReportMetric(float64(n)/b.Elapsed().Seconds(), "msg/s")
					if st != nil {
						stats := st.Session().Stats()
						b.ReportMetric(float64(stats.FallbackWrites-stats0.FallbackWrites), "fallbacks")
						b.ReportMetric(float64(stats.WakeupsSent-stats0.WakeupsSent)/float64(n), "wakeups/op")
						b.ReportMetric(float64(stats.MemoryFull-stats0.MemoryFull)/float64(n), "full/op")
					}
				})
			}
		})
	}
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
		self0, server0 := cpuTime(os.Getpid()), cpuTime(p.cmd.Process.Pid)
		time.Sleep(idle) // the measurement window, not synchronisation
		self1, server1 := cpuTime(os.Getpid()), cpuTime(p.cmd.Process.Pid)
		w0 := sess.Stats().WakeupsSent
		t0 := time.Now()
		if err := rt(); err != nil {
			b.Fatal(err)
		}
		first := time.Since(t0)
		b.ReportMetric(100*float64(self1-self0)/float64(idle), "client-cpu-%")
		b.ReportMetric(100*float64(server1-server0)/float64(idle), "server-cpu-%")
		b.ReportMetric(float64(first.Nanoseconds()), "first-rt-ns")
		b.ReportMetric(float64(sess.Stats().WakeupsSent-w0), "wakeups")
	}
}

// cpuTime returns the user+system CPU time process pid has used, from
// /proc/<pid>/stat (in clock ticks of 10 ms, converted), or 0 on error.
func cpuTime(pid int) time.Duration {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return 0
	}
	// Fields after the command name, which is in parentheses.
	i := strings.LastIndexByte(string(b), ')')
	if i < 0 {
		return 0
	}
	f := strings.Fields(string(b[i+1:]))
	if len(f) < 13 {
		return 0
	}
	utime, _ := strconv.ParseInt(f[11], 10, 64)
	stime, _ := strconv.ParseInt(f[12], 10, 64)
	return time.Duration(utime+stime) * 10 * time.Millisecond
}
