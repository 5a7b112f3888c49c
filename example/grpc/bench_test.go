package main

// BenchmarkGRPC: gRPC over shmlink against gRPC over a Unix socket and
// TCP loopback, client and server in two processes, all transports in one
// run so that the ratios are taken side by side (issue #16). It lives in
// this module, not the main one, so that only this module depends on gRPC.
//
//	go test -run '^$' -bench BenchmarkGRPC -count 5 .
//
// The server is this test binary re-executed in the role benchRole.

import (
	"context"
	"fmt"
	"io"
	"net"
	"os"
	"path/filepath"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/shmlink/shmlink"
	"github.com/shmlink/shmlink/internal/peertest"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/protobuf/types/known/wrapperspb"
)

// benchRole is the peertest role of the benchmarks' server process (see
// TestMain).
const benchRole = "grpc-bench"

// The transports, by their benchmark names.
var grpcTransports = []string{"shmlink", "uds", "tcp"}

// runBenchServer serves the Echo service on a shmlink listener, a Unix
// socket and TCP loopback, prints "ready <shmlink> <uds> <tcp>" and serves
// until its standard input closes. It returns the process's exit code.
func runBenchServer(peertest.Params) int {
	fail := func(err error) int {
		fmt.Fprintln(os.Stderr, "grpc bench server:", err)
		return 1
	}
	dir, err := os.MkdirTemp("", "shmlink-grpc-bench-")
	if err != nil {
		return fail(err)
	}
	defer os.RemoveAll(dir)
	srv, lns, err := serveEcho(dir)
	if err != nil {
		return fail(err)
	}
	fmt.Printf("ready %s %s %s\n", lns[0].Addr(), lns[1].Addr(), lns[2].Addr())
	io.Copy(io.Discard, os.Stdin)
	srv.Stop()
	return 0
}

// serveEcho serves the Echo service, on a new grpc.Server, from listeners
// of grpcTransports in that order: shmlink and a Unix socket with their
// socket files in dir, and TCP loopback. On error it closes what it
// opened.
func serveEcho(dir string) (*grpc.Server, []net.Listener, error) {
	var lns []net.Listener
	for _, listen := range []func() (net.Listener, error){
		func() (net.Listener, error) { return shmlink.Listen("unix", filepath.Join(dir, "shm.sock")) },
		func() (net.Listener, error) { return net.Listen("unix", filepath.Join(dir, "uds.sock")) },
		func() (net.Listener, error) { return net.Listen("tcp", "127.0.0.1:0") },
	} {
		ln, err := listen()
		if err != nil {
			for _, ln := range lns {
				ln.Close()
			}
			return nil, nil, err
		}
		lns = append(lns, ln)
	}
	srv := grpc.NewServer()
	srv.RegisterService(&echoServiceDesc, &echoService{})
	for _, ln := range lns {
		go srv.Serve(ln)
	}
	return srv, lns, nil
}

// grpcBench is a running Echo server and its addresses by transport: in a
// process of its own (startBenchServer), or in the test process
// (startInProcessServer).
type grpcBench struct {
	srv   *peertest.BenchServer // the server process; nil in the test process
	addrs map[string]string
	pids  []int // the processes whose CPU time a benchmark counts
	err   error
	stop  func() // ends the in-process server
}

var (
	benchOnce, inProcOnce sync.Once
	benchSrv, inProcSrv   grpcBench
)

// startBenchServer starts the server process once per run; stopBenchServer
// (from TestMain) ends it.
func startBenchServer(b *testing.B) *grpcBench {
	benchOnce.Do(func() {
		var f []string
		benchSrv.srv, f, benchSrv.err = peertest.StartBenchServer(benchRole, peertest.Params{}, 3)
		if benchSrv.err == nil {
			benchSrv.addrs = addrsOf(f)
			benchSrv.pids = []int{os.Getpid(), benchSrv.srv.Pid()}
		}
	})
	if benchSrv.err != nil {
		b.Fatal(benchSrv.err)
	}
	return &benchSrv
}

// startInProcessServer starts the Echo server in the test process, once
// per run, for BenchmarkInProcessGRPC; stopBenchServer ends it.
func startInProcessServer(b *testing.B) *grpcBench {
	inProcOnce.Do(func() {
		dir, err := os.MkdirTemp("", "shmlink-grpc-bench-")
		if err != nil {
			inProcSrv.err = err
			return
		}
		srv, lns, err := serveEcho(dir)
		if err != nil {
			os.RemoveAll(dir)
			inProcSrv.err = err
			return
		}
		var f []string
		for _, ln := range lns {
			f = append(f, ln.Addr().String())
		}
		inProcSrv.addrs = addrsOf(f)
		inProcSrv.pids = []int{os.Getpid()}
		inProcSrv.stop = func() { srv.Stop(); os.RemoveAll(dir) }
	})
	if inProcSrv.err != nil {
		b.Fatal(inProcSrv.err)
	}
	return &inProcSrv
}

// addrsOf maps grpcTransports to the addresses f, in that order.
func addrsOf(f []string) map[string]string {
	m := make(map[string]string, len(f))
	for i, a := range f {
		m[grpcTransports[i]] = a
	}
	return m
}

// stopBenchServer ends the servers that benchmarks started.
func stopBenchServer() {
	if benchSrv.srv != nil {
		benchSrv.srv.Stop()
	}
	if inProcSrv.stop != nil {
		inProcSrv.stop()
	}
}

// dialBench returns a client connection to the server p over transport, a
// function that closes it (and the shmlink Dialer behind it), and the
// waitStats of its shmlink Dialer (nil for the other transports).
func dialBench(b *testing.B, p *grpcBench, transport string) (echoClient, func(), *waitStats) {
	addr := p.addrs[transport]
	var dial func(ctx context.Context, _ string) (net.Conn, error)
	closeDialer := func() {}
	var ws *waitStats
	switch transport {
	case "shmlink":
		d := &shmlink.Dialer{}
		dial = func(ctx context.Context, _ string) (net.Conn, error) { return d.DialContext(ctx, "unix", addr) }
		closeDialer = func() { d.Close() }
		ws = &waitStats{d: d}
	default:
		network := map[string]string{"uds": "unix", "tcp": "tcp"}[transport]
		var d net.Dialer
		dial = func(ctx context.Context, _ string) (net.Conn, error) { return d.DialContext(ctx, network, addr) }
	}
	cc, err := grpc.NewClient("passthrough:///bench", grpc.WithContextDialer(dial),
		grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		b.Fatal(err)
	}
	return echoClient{cc}, func() { cc.Close(); closeDialer() }, ws
}

// waitStats reports how the shmlink client's reads waited, per op, like
// the main module's benchmarks: "hits/op" (a spin got the data),
// "miss/op" (a spin gave up), "parks/op" (the reader slept until a
// wakeup came), "self/op" (of those, it read the control connection
// itself), and the Pollings the client sent ("wsent/op") and received
// ("wrecv/op"). docs/protocol.md section 12 describes the waits.
type waitStats struct {
	d      *shmlink.Dialer
	stats0 shmlink.Stats
}

// start takes the counters that report subtracts. A nil waitStats (not
// shmlink) does nothing.
func (w *waitStats) start() {
	if w != nil {
		w.stats0 = w.d.Stats()
	}
}

// report reports the waits per op over ops ops since start.
func (w *waitStats) report(b *testing.B, ops int) {
	if w == nil || ops <= 0 {
		return
	}
	st, s0 := w.d.Stats(), w.stats0
	per := func(n, n0 uint64) float64 { return float64(n-n0) / float64(ops) }
	b.ReportMetric(per(st.SpinHits, s0.SpinHits), "hits/op")
	b.ReportMetric(per(st.SpinMisses, s0.SpinMisses), "miss/op")
	b.ReportMetric(per(st.Parks, s0.Parks), "parks/op")
	b.ReportMetric(per(st.SelfWakes, s0.SelfWakes), "self/op")
	b.ReportMetric(per(st.WakeupsSent, s0.WakeupsSent), "wsent/op")
	b.ReportMetric(per(st.WakeupsReceived, s0.WakeupsReceived), "wrecv/op")
}

// BenchmarkGRPC: unary Echo calls of 64 B, 4 KB and 64 KB from 1 and 16
// concurrent callers on one connection, and a bidirectional stream echoing
// 64 B messages one at a time; each on idle cores and contended (another
// process keeping every core busy). An op is one call or one echoed
// message. It reports calls/s, the CPU time of both processes per op
// (cpu-us/op; the server's part srv-cpu-us/op), with one caller the p50 and
// p99 of a call, and over shmlink how the client's reads waited
// (waitStats: hits/op, miss/op, parks/op, ...).
func BenchmarkGRPC(b *testing.B) {
	for _, load := range []string{"idle", "contended"} {
		b.Run(load, func(b *testing.B) {
			if load == "contended" {
				peertest.StartHog(b)
			}
			for _, size := range []int{64, 4 << 10, 64 << 10} {
				for _, callers := range []int{1, 16} {
					if load == "contended" && size != 64 {
						continue // the contended set: 64 B, enough to see the wakeups
					}
					b.Run(fmt.Sprintf("unary/%s/c%d", sizeName(size), callers), func(b *testing.B) {
						for _, transport := range grpcTransports {
							b.Run(transport, func(b *testing.B) { benchUnary(b, startBenchServer(b), transport, size, callers) })
						}
					})
				}
			}
			b.Run("bidi/64B", func(b *testing.B) {
				for _, transport := range grpcTransports {
					b.Run(transport, func(b *testing.B) { benchBidi(b, startBenchServer(b), transport) })
				}
			})
		})
	}
}

// BenchmarkInProcessGRPC: BenchmarkGRPC's unary calls of 64 B from 1 and
// 16 callers, with client and server in the test process, over shmlink
// and a Unix socket: what the transports cost when both ends share one Go
// scheduler, against the two processes of BenchmarkGRPC (docs/benchmarks.md,
// "Where shmlink lost"). cpu-us/op is the test process's CPU time per call.
func BenchmarkInProcessGRPC(b *testing.B) {
	for _, callers := range []int{1, 16} {
		b.Run(fmt.Sprintf("unary/64B/c%d", callers), func(b *testing.B) {
			for _, transport := range []string{"shmlink", "uds"} {
				b.Run(transport, func(b *testing.B) { benchUnary(b, startInProcessServer(b), transport, 64, callers) })
			}
		})
	}
}

// sizeName names a payload size: 64B, 4KB, 64KB.
func sizeName(n int) string {
	if n >= 1<<10 {
		return fmt.Sprintf("%dKB", n>>10)
	}
	return fmt.Sprintf("%dB", n)
}

// benchUnary is one unary case of BenchmarkGRPC.
func benchUnary(b *testing.B, p *grpcBench, transport string, size, callers int) {
	c, closeConn, ws := dialBench(b, p, transport)
	defer closeConn()
	ctx := context.Background()
	call := func(req *wrapperspb.BytesValue) error {
		resp, err := c.Echo(ctx, req)
		if err != nil {
			return err
		}
		if len(resp.Value) != size {
			return fmt.Errorf("echo of %d bytes came back as %d bytes", size, len(resp.Value))
		}
		if resp.Value[0] != req.Value[0] || resp.Value[size-1] != req.Value[size-1] {
			return fmt.Errorf("echo of %d bytes: first and last bytes %d, %d, want %d, %d",
				size, resp.Value[0], resp.Value[size-1], req.Value[0], req.Value[size-1])
		}
		return nil
	}
	newReq := func(seed byte) *wrapperspb.BytesValue {
		v := make([]byte, size)
		for i := range v {
			v[i] = seed + byte(i)
		}
		return &wrapperspb.BytesValue{Value: v}
	}
	for i := range 20 { // warm up: the connection, HTTP/2 windows, buffers
		if err := call(newReq(byte(i))); err != nil {
			b.Fatal(err)
		}
	}
	b.ReportAllocs()
	cpu := peertest.NewCPUMeter(p.pids...)
	var lat peertest.Latencies
	if callers == 1 {
		lat = make(peertest.Latencies, 0, b.N)
	}
	var next atomic.Int64
	var failed atomic.Pointer[error]
	b.ResetTimer()
	ws.start()
	cpu.Start(b)
	var wg sync.WaitGroup
	for w := range callers {
		req := newReq(byte(w))
		wg.Go(func() {
			for next.Add(1) <= int64(b.N) {
				var t0 time.Time
				if callers == 1 { // the clock only where latencies are kept
					t0 = time.Now()
				}
				if err := call(req); err != nil {
					failed.CompareAndSwap(nil, &err)
					return
				}
				if callers == 1 {
					lat = append(lat, time.Since(t0))
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
	ws.report(b, b.N)
	b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "calls/s")
	if callers == 1 {
		lat.Report(b)
	}
}

// benchBidi is the bidirectional case of BenchmarkGRPC: one EchoStream
// call, a 64-byte message sent and its echo received per op.
func benchBidi(b *testing.B, p *grpcBench, transport string) {
	c, closeConn, ws := dialBench(b, p, transport)
	defer closeConn()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	stream, err := c.EchoStream(ctx)
	if err != nil {
		b.Fatal(err)
	}
	msg := &wrapperspb.BytesValue{Value: make([]byte, 64)}
	roundTrip := func(i int) error {
		msg.Value[0] = byte(i)
		if err := stream.Send(msg); err != nil {
			return err
		}
		resp, err := stream.Recv()
		if err != nil {
			return err
		}
		if len(resp.Value) != 64 {
			return fmt.Errorf("echo %d: got %d bytes, want 64", i, len(resp.Value))
		}
		if resp.Value[0] != byte(i) {
			return fmt.Errorf("echo %d: first byte %d, want %d", i, resp.Value[0], byte(i))
		}
		return nil
	}
	for i := range 20 {
		if err := roundTrip(i); err != nil {
			b.Fatal(err)
		}
	}
	b.ReportAllocs()
	cpu := peertest.NewCPUMeter(p.pids...)
	lat := make(peertest.Latencies, 0, b.N)
	b.ResetTimer()
	ws.start()
	cpu.Start(b)
	for i := range b.N {
		t0 := time.Now()
		if err := roundTrip(i); err != nil {
			b.Fatal(err)
		}
		lat = append(lat, time.Since(t0))
	}
	b.StopTimer()
	cpu.ReportCPU(b, b.N)
	ws.report(b, b.N)
	b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "calls/s")
	lat.Report(b)
	stream.CloseSend()
}
