// Command hotupgrade replaces a shmlink server process under load, several
// times, without failing a request.
//
//	go run ./example/hotupgrade
//
// The program starts a copy of itself as the server (-serve), which listens
// on a Unix socket with an upgrade socket (ListenConfig.UpgradeSocket) and
// re-executes itself on SIGHUP: the new process takes the listening socket
// over, and the old one moves its clients to it (HotRestart), drains and
// exits. Meanwhile the client keeps 8 streams busy with echo requests of 1
// byte to 1 MiB, checking every byte, and sends SIGHUP to the current
// server every -interval, -upgrades times. It prints the requests, errors
// and upgrades done, and the request latency during the upgrades, and
// exits with status 1 on any error.
//
// A server can be upgraded by hand as well:
//
//	go run ./example/hotupgrade -serve /tmp/echo.sock -upgrade /tmp/echo.upgrade &
//	kill -HUP <pid printed on "ready">
package main

import (
	"bufio"
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/shmlink/shmlink"
)

func main() {
	serve := flag.String("serve", "", "run as the server on this Unix socket path")
	upgrade := flag.String("upgrade", "", "the server's upgrade socket path (with -serve)")
	upgrades := flag.Int("upgrades", 3, "upgrades to run")
	interval := flag.Duration("interval", time.Second, "time between upgrades")
	workers := flag.Int("workers", 8, "streams kept busy")
	flag.Parse()
	var err error
	if *serve != "" {
		err = runServer(*serve, *upgrade)
	} else {
		err = runClient(*upgrades, *interval, *workers)
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "hotupgrade:", err)
		os.Exit(1)
	}
}

// runServer echoes every stream. It prints "ready <pid> <epoch>" once it
// serves, re-executes itself on SIGHUP, and prints "exit <pid> <epoch>
// <requests>" when it leaves: after it has handed over and drained, or on
// SIGTERM or SIGINT.
func runServer(sock, upgradeSock string) error {
	sig := make(chan os.Signal, 4)
	signal.Notify(sig, syscall.SIGHUP, syscall.SIGTERM, syscall.SIGINT)
	lc := shmlink.ListenConfig{UpgradeSocket: upgradeSock}
	ln, err := lc.Listen(context.Background(), "unix", sock)
	if err != nil {
		return err
	}
	fmt.Printf("ready %d %d\n", os.Getpid(), ln.Epoch())

	var served atomic.Int64
	var handlers sync.WaitGroup
	acceptErr := make(chan error, 1)
	go func() {
		for {
			conn, err := ln.Accept()
			if err != nil {
				if errors.Is(err, net.ErrClosed) { // Close, or ErrUpgraded
					err = nil
				}
				acceptErr <- err
				return
			}
			handlers.Add(1)
			go func() {
				defer handlers.Done()
				defer conn.Close()
				if _, err := io.Copy(conn, conn); err == nil {
					served.Add(1)
				}
			}()
		}
	}()

	childErr := make(chan error, 1)
	for running := true; running; {
		select {
		case s := <-sig:
			if s != syscall.SIGHUP {
				running = false
				break
			}
			// The new process takes the listener over from this one.
			child := exec.Command(os.Args[0], os.Args[1:]...)
			child.Stdout, child.Stderr = os.Stdout, os.Stderr
			if err := child.Start(); err != nil {
				fmt.Fprintln(os.Stderr, "hotupgrade: upgrade:", err)
				break
			}
			go func() { childErr <- child.Wait() }()
		case err := <-childErr:
			// It exited before taking over: this process goes on serving.
			fmt.Fprintln(os.Stderr, "hotupgrade: the new server failed:", err)
		case <-ln.Upgraded():
			running = false
		}
	}
	ln.Close()
	err = <-acceptErr
	handlers.Wait()
	fmt.Printf("exit %d %d %d\n", os.Getpid(), ln.Epoch(), served.Load())
	return err
}

// sizes are the request sizes: within a slice, across slices, and chains
// of many slices.
var sizes = []int{1, 100, 8172, 8173, 65536, 131053, 300 << 10, 1 << 20}

// request is one request: when it ran and how it ended.
type request struct {
	start, end time.Time
	bytes      int
	err        error
}

// runClient starts the server, keeps workers streams busy, and upgrades
// the server upgrades times.
func runClient(upgrades int, interval time.Duration, workers int) error {
	dir, err := os.MkdirTemp("", "shmlink-hotupgrade-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)
	sock := filepath.Join(dir, "echo.sock")
	g, pid, err := startGenerations(sock, filepath.Join(dir, "echo.upgrade"))
	if err != nil {
		return err
	}
	fmt.Printf("client pid %d, server pid %d, socket %s\n", os.Getpid(), pid, sock)

	d := &shmlink.Dialer{StreamsPerSession: 2}
	l := startLoad(d, sock, workers)
	var windows [][2]time.Time
	for i := 1; i <= upgrades && err == nil; i++ {
		time.Sleep(interval) // load on the current generation
		from := time.Now()
		var next int
		if next, err = g.upgrade(pid, i); err != nil {
			break
		}
		windows = append(windows, [2]time.Time{from, time.Now()})
		n, errs := l.count()
		fmt.Printf("upgrade %d: server pid %d -> %d (epoch %d) in %v; %d requests so far, %d errors\n",
			i, pid, next, i, time.Since(from).Round(time.Millisecond), n, errs)
		pid = next
	}
	if err == nil {
		time.Sleep(interval) // load on the last generation
	}
	requests := l.stop()
	d.Close()
	if werr := g.stop(pid); err == nil {
		err = werr
	}
	errs := report(requests, windows)
	if err == nil && errs > 0 {
		err = fmt.Errorf("%d requests failed", errs)
	}
	if err == nil && len(windows) < upgrades {
		err = fmt.Errorf("only %d of %d upgrades done", len(windows), upgrades)
	}
	return err
}

// generations is the first server process and the generations that
// follow it, as seen through the pipe they all print their events to.
type generations struct {
	first *exec.Cmd
	outW  *os.File // the pipe's write end, closed by stop
	*servers
}

// startGenerations starts the first server generation on sock with the
// upgrade socket usock, and returns it and its pid once it is ready.
func startGenerations(sock, usock string) (*generations, int, error) {
	exe, err := os.Executable()
	if err != nil {
		return nil, 0, err
	}
	// Every generation writes to this pipe; it ends when all have exited.
	outR, outW, err := os.Pipe()
	if err != nil {
		return nil, 0, err
	}
	server := exec.Command(exe, "-serve", sock, "-upgrade", usock)
	server.Stdout, server.Stderr = outW, os.Stderr
	if err := server.Start(); err != nil {
		outR.Close()
		outW.Close()
		return nil, 0, err
	}
	lines := make(chan []string, 16)
	go func() {
		defer close(lines)
		defer outR.Close()
		sc := bufio.NewScanner(outR)
		for sc.Scan() {
			lines <- strings.Fields(sc.Text())
		}
	}()
	g := &generations{first: server, outW: outW, servers: &servers{lines: lines}}
	pid, err := g.wait("ready", 0)
	if err != nil {
		outW.Close()
		server.Process.Kill()
		server.Wait()
		for range lines {
		}
		return nil, 0, err
	}
	return g, pid, nil
}

// upgrade sends SIGHUP to the server of pid and waits until the
// generation of epoch is ready and pid has exited; it returns the new pid.
func (g *generations) upgrade(pid, epoch int) (int, error) {
	if err := syscall.Kill(pid, syscall.SIGHUP); err != nil {
		return 0, err
	}
	next, err := g.wait("ready", epoch)
	if err != nil {
		return 0, err
	}
	_, err = g.wait("exit", pid)
	return next, err
}

// stop ends the last generation, of pid, and waits until every
// generation has exited.
func (g *generations) stop(pid int) error {
	syscall.Kill(pid, syscall.SIGTERM)
	_, err := g.wait("exit", pid)
	g.outW.Close()
	for range g.lines { // until every generation has exited
	}
	if werr := g.first.Wait(); err == nil {
		err = werr
	}
	return err
}

// load is the client's workers, each sending echo requests one after the
// other until stop.
type load struct {
	quit chan struct{}
	wg   sync.WaitGroup

	mu       sync.Mutex
	requests []request
}

// startLoad starts workers workers sending requests of random sizes to
// sock through d.
func startLoad(d *shmlink.Dialer, sock string, workers int) *load {
	l := &load{quit: make(chan struct{})}
	for w := range workers {
		l.wg.Add(1)
		go func() {
			defer l.wg.Done()
			rng := rand.New(rand.NewPCG(uint64(w), uint64(time.Now().UnixNano())))
			for {
				select {
				case <-l.quit:
					return
				default:
				}
				n := sizes[rng.IntN(len(sizes))]
				r := request{start: time.Now(), bytes: n}
				r.err = exchange(d, sock, n, rng.Uint64())
				r.end = time.Now()
				l.mu.Lock()
				l.requests = append(l.requests, r)
				l.mu.Unlock()
			}
		}()
	}
	return l
}

// count returns the number of requests done so far, and of those failed.
func (l *load) count() (n, errs int) {
	l.mu.Lock()
	defer l.mu.Unlock()
	for _, r := range l.requests {
		if r.err != nil {
			errs++
		}
	}
	return len(l.requests), errs
}

// stop stops the workers, waits for their last requests and returns all.
func (l *load) stop() []request {
	close(l.quit)
	l.wg.Wait()
	return l.requests
}

// report prints the requests done, the bytes echoed, the first errors and
// the latency during the upgrade windows and overall, and returns the
// number of failed requests.
func report(requests []request, windows [][2]time.Time) (errs int) {
	var during, all []time.Duration
	total := 0
	for _, r := range requests {
		if r.err != nil {
			if errs < 10 {
				fmt.Fprintln(os.Stderr, "request failed:", r.err)
			}
			errs++
			continue
		}
		total += 2 * r.bytes
		lat := r.end.Sub(r.start)
		all = append(all, lat)
		for _, w := range windows {
			if r.start.Before(w[1]) && r.end.After(w[0]) {
				during = append(during, lat)
				break
			}
		}
	}
	fmt.Printf("%d requests (%d MiB echoed, every byte checked), %d errors, %d upgrades\n",
		len(requests), total>>20, errs, len(windows))
	fmt.Printf("latency during upgrades: %s\n", stats(during))
	fmt.Printf("latency overall:         %s\n", stats(all))
	return errs
}

// exchange runs one request of n bytes on a new stream: it sends a
// pattern derived from seed while reading the echo, checks every byte and
// then the server's EOF.
func exchange(d *shmlink.Dialer, sock string, n int, seed uint64) error {
	c, err := d.DialStream(context.Background(), "unix", sock)
	if err != nil {
		return err
	}
	defer c.Close()
	werr := make(chan error, 1)
	go func() {
		buf := make([]byte, min(n, 64<<10))
		for off := 0; off < n; off += len(buf) {
			b := buf[:min(len(buf), n-off)]
			fill(b, seed, off)
			if _, err := c.Write(b); err != nil {
				werr <- err
				return
			}
		}
		werr <- c.CloseWrite()
	}()
	buf := make([]byte, 64<<10)
	want := make([]byte, len(buf))
	for got := 0; ; {
		k, err := c.Read(buf)
		fill(want[:k], seed, got)
		if string(buf[:k]) != string(want[:k]) {
			return fmt.Errorf("echo differs at bytes %d..%d", got, got+k)
		}
		got += k
		if errors.Is(err, io.EOF) {
			if got != n {
				return fmt.Errorf("echo of %d bytes, want %d", got, n)
			}
			return <-werr
		}
		if err != nil {
			return err
		}
	}
}

// fill writes the bytes of the pattern of seed at offsets off.. into b.
func fill(b []byte, seed uint64, off int) {
	for i := range b {
		b[i] = byte((uint64(off+i)*0x9E3779B97F4A7C15 + seed) >> 56)
	}
}

// stats returns the count, median and worst of ds.
func stats(ds []time.Duration) string {
	if len(ds) == 0 {
		return "no requests"
	}
	slices.Sort(ds)
	return fmt.Sprintf("median %v, worst %v (%d requests)",
		ds[len(ds)/2].Round(time.Microsecond), ds[len(ds)-1].Round(time.Microsecond), len(ds))
}

// servers reads the lines the server generations print.
type servers struct {
	lines   <-chan []string
	pending [][]string
}

// wait returns the pid on the first line "<what> <pid> <epoch> ..." whose
// epoch (for "ready") or pid (for "exit") is key, within 30 s.
func (s *servers) wait(what string, key int) (int, error) {
	match := func(f []string) (int, bool) {
		if len(f) < 3 || f[0] != what {
			return 0, false
		}
		pid, err := strconv.Atoi(f[1])
		if err != nil {
			return 0, false
		}
		k := f[2] // epoch
		if what == "exit" {
			k = f[1]
		}
		return pid, k == strconv.Itoa(key)
	}
	for i, f := range s.pending {
		if pid, ok := match(f); ok {
			s.pending = slices.Delete(s.pending, i, i+1)
			return pid, nil
		}
	}
	timeout := time.After(30 * time.Second)
	for {
		select {
		case f, ok := <-s.lines:
			if !ok {
				return 0, fmt.Errorf("the servers exited before %q %d", what, key)
			}
			if pid, ok := match(f); ok {
				return pid, nil
			}
			s.pending = append(s.pending, f)
		case <-timeout:
			return 0, fmt.Errorf("no %q %d from the servers within 30 s", what, key)
		}
	}
}
