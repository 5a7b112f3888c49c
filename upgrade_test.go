package shmlink_test

import (
	"bufio"
	"context"
	"crypto/tls"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"runtime/debug"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/shmlink/shmlink"
	"github.com/shmlink/shmlink/internal/peertest"
	"github.com/shmlink/shmlink/internal/upgrade"
	"github.com/stretchr/testify/require"
)

// upgradeTransports are the transports of the hot-upgrade tests.
var upgradeTransports = []transport{
	{"unix-memfd", "unix", shmlink.MemoryMemfd},
	{"tcp-file", "tcp", shmlink.MemoryFile},
	{"quic", "quic", shmlink.MemoryAuto}, // no shared memory
}

// listenUpgradable listens on tr at addr with the upgrade socket usock,
// and the TLS config of sharedQUICTLS on "quic".
func listenUpgradable(t *testing.T, tr transport, addr, usock string, cfg *shmlink.Config) (*shmlink.Listener, error) {
	t.Helper()
	lc := shmlink.ListenConfig{Config: cfg, UpgradeSocket: usock}
	if tr.network == "quic" {
		lc.TLSConfig, _ = sharedQUICTLS(t)
	}
	return lc.Listen(context.Background(), tr.network, addr)
}

var (
	quicTLSOnce            sync.Once
	quicServerTLS, quicCli *tls.Config
	quicTLSErr             error
)

// sharedQUICTLS returns one server and client TLS config for the
// in-process "quic" tests, made at the first call.
func sharedQUICTLS(t *testing.T) (server, client *tls.Config) {
	quicTLSOnce.Do(func() {
		dir, err := os.MkdirTemp("", "shmlink-tls-")
		if err != nil {
			quicTLSErr = err
			return
		}
		defer os.RemoveAll(dir)
		if quicTLSErr = peertest.WriteTLS(dir); quicTLSErr == nil {
			quicServerTLS, quicCli, quicTLSErr = peertest.LoadTLS(dir, false)
		}
	})
	require.NoError(t, quicTLSErr)
	return quicServerTLS, quicCli
}

// listenWhenFree is listenUpgradable, asking again while the upgrade is
// refused as in progress: the running generation has not seen the end of
// the previous attempt yet, which it learns asynchronously.
func listenWhenFree(t *testing.T, tr transport, addr, usock string, cfg *shmlink.Config) *shmlink.Listener {
	t.Helper()
	var ln *shmlink.Listener
	require.Eventually(t, func() bool {
		var err error
		ln, err = listenUpgradable(t, tr, addr, usock, cfg)
		if err != nil {
			require.ErrorIs(t, err, shmlink.ErrUpgradeInProgress)
			return false
		}
		return true
	}, 10*time.Second, time.Millisecond)
	return ln
}

// waitChan waits up to 10 s for ch.
func waitChan(t *testing.T, ch <-chan struct{}, what string) {
	t.Helper()
	select {
	case <-ch:
	case <-time.After(10 * time.Second):
		t.Fatalf("timed out waiting for %s", what)
	}
}

// socketFiles returns the names of the Unix socket files in dir.
func socketFiles(t *testing.T, dir string) []string {
	t.Helper()
	entries, err := os.ReadDir(dir)
	require.NoError(t, err)
	var names []string
	for _, e := range entries {
		if e.Type()&os.ModeSocket != 0 {
			names = append(names, e.Name())
		}
	}
	return names
}

// A second listener in the same process takes the first one's socket
// over: same address, epoch + 1; new streams go to it while a stream in
// flight on the old one keeps working; the old one drains, reports
// Upgraded and returns ErrUpgraded; the socket files stay until the last
// generation is closed, and nothing leaks.
func TestUpgradeHandover(t *testing.T) {
	// Without collections, a descriptor that only a finalizer would close
	// (a net.Conn nobody closed) counts as leaked, every time.
	defer debug.SetGCPercent(debug.SetGCPercent(-1))
	for _, tr := range upgradeTransports {
		t.Run(tr.name, func(t *testing.T) {
			dir := t.TempDir()
			base := snapshot(t, dir)
			addr := "127.0.0.1:0"
			if tr.network == "unix" {
				addr = filepath.Join(dir, "s.sock")
			}
			usock := filepath.Join(dir, "upgrade.sock")
			cfg := &shmlink.Config{ShmDir: dir}
			a, err := listenUpgradable(t, tr, addr, usock, cfg)
			require.NoError(t, err)
			require.Zero(t, a.Epoch())
			stopA := serveEcho(a, 8)
			addr = a.Addr().String()

			d := &shmlink.Dialer{Config: &shmlink.Config{ShmDir: dir, MemoryType: tr.memory}}
			_, d.TLSConfig = sharedQUICTLS(t)
			held, err := d.Dial(tr.network, addr)
			require.NoError(t, err)
			require.NoError(t, peertest.Echo(held, 100<<10, 1))

			b, err := listenUpgradable(t, tr, addr, usock, cfg)
			require.NoError(t, err)
			require.Equal(t, uint64(1), b.Epoch())
			require.Equal(t, addr, b.Addr().String())
			stopB := serveEcho(b, 8)

			// New streams go to b once the Dialer has seen the hot restart;
			// the held stream keeps a's session (and a) alive meanwhile.
			require.Eventually(t, func() bool {
				c, err := d.Dial(tr.network, addr)
				require.NoError(t, err)
				require.NoError(t, peertest.Echo(c, 1000, 2))
				require.NoError(t, c.Close())
				return b.NumSessions() > 0
			}, 10*time.Second, time.Millisecond)
			require.Equal(t, 1, a.NumSessions())
			select {
			case <-a.Upgraded():
				t.Fatal("a drained with a stream in flight")
			default:
			}
			require.NoError(t, peertest.Echo(held, 1<<20, 3), "the stream in flight survives the handover")
			require.NoError(t, held.Close())
			waitChan(t, a.Upgraded(), "a to drain")
			_, err = a.Accept()
			require.ErrorIs(t, err, shmlink.ErrUpgraded)
			require.ErrorIs(t, err, net.ErrClosed)
			stopA()

			c, err := d.Dial(tr.network, addr)
			require.NoError(t, err)
			require.NoError(t, peertest.Echo(c, 300<<10, 4))
			require.NoError(t, c.Close())
			want := []string{"upgrade.sock"}
			if tr.network == "unix" {
				want = []string{"s.sock", "upgrade.sock"}
			}
			require.ElementsMatch(t, want, socketFiles(t, dir), "the live generation's sockets stay")

			require.NoError(t, d.Close())
			stopB()
			require.Empty(t, socketFiles(t, dir), "the last generation removes its sockets")
			requireNoLeaks(t, base, dir)
		})
	}
}

// An upgrade while another is in progress is refused, and the running
// generations go on; once the old one has drained the next upgrade works.
func TestUpgradeRefusedWhileInProgress(t *testing.T) {
	tr := upgradeTransports[0]
	dir := t.TempDir()
	addr, usock := filepath.Join(dir, "s.sock"), filepath.Join(dir, "upgrade.sock")
	cfg := &shmlink.Config{ShmDir: dir}
	a, err := listenUpgradable(t, tr, addr, usock, cfg)
	require.NoError(t, err)
	stopA := serveEcho(a, 4)
	defer stopA()
	d := &shmlink.Dialer{Config: &shmlink.Config{ShmDir: dir}}
	defer d.Close()
	held, err := d.Dial("unix", addr)
	require.NoError(t, err)
	require.NoError(t, peertest.Echo(held, 10, 1))

	b, err := listenUpgradable(t, tr, addr, usock, cfg)
	require.NoError(t, err)
	stopB := serveEcho(b, 4)
	defer stopB()

	// a drains (its stream is held open): b refuses the next generation.
	_, err = listenUpgradable(t, tr, addr, usock, cfg)
	require.ErrorIs(t, err, shmlink.ErrUpgradeInProgress)
	require.ErrorContains(t, err, "another upgrade is in progress")
	require.NoError(t, peertest.Echo(held, 1000, 2), "the old generation still serves")
	c, err := d.Dial("unix", addr)
	require.NoError(t, err)
	require.NoError(t, peertest.Echo(c, 1000, 3), "the new generation serves")
	require.NoError(t, c.Close())

	require.NoError(t, held.Close())
	waitChan(t, a.Upgraded(), "a to drain")
	// b learns that a is done when a closes their connection.
	next := listenWhenFree(t, tr, addr, usock, cfg)
	require.Equal(t, uint64(2), next.Epoch())
	stopNext := serveEcho(next, 4)
	defer stopNext()
	c, err = d.Dial("unix", addr)
	require.NoError(t, err)
	require.NoError(t, peertest.Echo(c, 1000, 4))
	require.NoError(t, c.Close())
}

// A new process that fails during the handover leaves the old one
// serving, with nothing lost and its epoch unchanged: one that asks for
// another address, one that dies after receiving the listener without
// confirming, one that sends garbage.
func TestUpgradeFailureKeepsServing(t *testing.T) {
	tr := upgradeTransports[0]
	dir := t.TempDir()
	base := snapshot(t, dir)
	addr, usock := filepath.Join(dir, "s.sock"), filepath.Join(dir, "upgrade.sock")
	cfg := &shmlink.Config{ShmDir: dir}
	a, err := listenUpgradable(t, tr, addr, usock, cfg)
	require.NoError(t, err)
	stopA := serveEcho(a, 4)
	d := &shmlink.Dialer{Config: &shmlink.Config{ShmDir: dir}}
	held, err := d.Dial("unix", addr)
	require.NoError(t, err)
	require.NoError(t, peertest.Echo(held, 10, 1))

	serves := func(seed uint64) {
		t.Helper()
		require.NoError(t, peertest.Echo(held, 5000, seed), "the stream in flight")
		c, err := d.Dial("unix", addr)
		require.NoError(t, err)
		require.NoError(t, peertest.Echo(c, 5000, seed+1), "a new stream")
		require.NoError(t, c.Close())
		select {
		case <-a.Upgraded():
			t.Fatal("the old listener drained")
		default:
		}
	}

	t.Run("other address", func(t *testing.T) {
		_, err := listenUpgradable(t, tr, filepath.Join(dir, "other.sock"), usock, cfg)
		require.ErrorContains(t, err, "the running listener is at")
		serves(10)
	})
	t.Run("other network", func(t *testing.T) {
		// Until the old process has seen the last attempt fail, it
		// refuses (busy): ask again then.
		var err error
		for start := time.Now(); ; time.Sleep(time.Millisecond) {
			_, err = listenUpgradable(t, transport{network: "tcp"}, "127.0.0.1:0", usock, cfg)
			if !errors.Is(err, upgrade.ErrInProgress) || time.Since(start) > 10*time.Second {
				break
			}
		}
		require.ErrorContains(t, err, "not tcp")
		serves(20)
	})
	t.Run("dies before ready", func(t *testing.T) {
		// Until the old process has seen the last attempt fail, it
		// refuses (busy): ask again then.
		var grant [16]byte
		require.Eventually(t, func() bool {
			conn, err := net.Dial("unix", usock)
			require.NoError(t, err)
			defer conn.Close() // the descriptors in flight go with it
			var req [16]byte
			binary.BigEndian.PutUint32(req[0:], 0x534c5550) // "SLUP", version 1, request
			req[4], req[5] = 1, 1
			_, err = conn.Write(req[:])
			require.NoError(t, err)
			_, err = io.ReadFull(conn, grant[:])
			require.NoError(t, err)
			if grant[5] == 3 { // refuse
				require.Equal(t, uint64(1), binary.BigEndian.Uint64(grant[8:]), "busy")
				return false
			}
			return true
		}, 10*time.Second, time.Millisecond)
		require.Equal(t, byte(2), grant[5], "grant")
		require.Equal(t, uint64(1), binary.BigEndian.Uint64(grant[8:]), "epoch")
		serves(30)
	})
	t.Run("garbage", func(t *testing.T) {
		conn, err := net.Dial("unix", usock)
		require.NoError(t, err)
		_, err = conn.Write([]byte("GET / HTTP/1.1\r\nHost: x\r\n\r\n"))
		require.NoError(t, err)
		// Closed with our bytes unread, the socket may say ECONNRESET.
		if _, err = io.ReadAll(conn); !errors.Is(err, syscall.ECONNRESET) {
			require.NoError(t, err, "the old process closes the connection")
		}
		conn.Close()
		serves(40)
	})
	t.Run("then a good one", func(t *testing.T) {
		b := listenWhenFree(t, tr, addr, usock, cfg)
		require.Equal(t, uint64(1), b.Epoch(), "failed attempts do not count")
		stopB := serveEcho(b, 4)
		require.NoError(t, peertest.Echo(held, 5000, 50), "the stream in flight")
		require.NoError(t, held.Close())
		waitChan(t, a.Upgraded(), "a to drain")
		stopA()
		c, err := d.Dial("unix", addr)
		require.NoError(t, err)
		require.NoError(t, peertest.Echo(c, 5000, 51))
		require.NoError(t, c.Close())
		require.NoError(t, d.Close())
		stopB()
	})
	require.Empty(t, socketFiles(t, dir))
	requireNoLeaks(t, base, dir)
}

// A socket file left by a generation that died (kill -9) does not keep
// the next one from listening afresh.
func TestUpgradeStaleSockets(t *testing.T) {
	dir := t.TempDir()
	addr, usock := filepath.Join(dir, "s.sock"), filepath.Join(dir, "upgrade.sock")
	for _, p := range []string{addr, usock} {
		ln, err := net.Listen("unix", p)
		require.NoError(t, err)
		ln.(*net.UnixListener).SetUnlinkOnClose(false)
		require.NoError(t, ln.Close())
	}
	a, err := listenUpgradable(t, upgradeTransports[0], addr, usock, nil)
	require.NoError(t, err)
	require.Zero(t, a.Epoch())
	stop := serveEcho(a, 1)
	c, err := shmlink.Dial("unix", addr)
	require.NoError(t, err)
	require.NoError(t, peertest.Echo(c, 100, 1))
	require.NoError(t, c.Close())
	stop()
	require.Empty(t, socketFiles(t, dir))

	// A file that is not a socket is not removed.
	require.NoError(t, os.WriteFile(usock, []byte("x"), 0o600))
	_, err = listenUpgradable(t, upgradeTransports[0], addr, usock, nil)
	require.Error(t, err)
	require.FileExists(t, usock)
}

// Parameters of the two-process hot-upgrade test (issue #5).
const (
	// upgradeWorkers is the number of streams kept busy with requests.
	upgradeWorkers = 8
	// upgradeCount is the number of successive upgrades.
	upgradeCount = 3
	// upgradeBatch is how many requests complete between upgrades (and
	// before the first and after the last).
	upgradeBatch = 40
	// upgradeWait bounds every wait of the test on the server processes.
	upgradeWait = 30 * time.Second
)

// upgradeSizes are the request sizes: within a slice, across slice
// boundaries, and chains of many slices, up to 1 MiB.
var upgradeSizes = []int{1, 100, 8172, 8173, 32748, 65536, 131053, 300 << 10, 1 << 20}

// runUpgradeServer is the "upgrade-server" role: it listens as the
// environment says with the upgrade socket, printing "ready <pid> <epoch>
// <addr>", and echoes peertest.CmdCounted requests. SIGHUP makes it start a copy of
// itself, which takes the listener over. Once it has drained (or on
// SIGTERM) it closes the listener, waits for its requests and prints
// "exit <pid> <epoch> <requests served> <status>" as its last words.
// Errors go to standard error, which the test requires to stay empty.
func runUpgradeServer(p peertest.Params) int {
	code := 0
	fail := func(format string, args ...any) {
		fmt.Fprintf(os.Stderr, "upgrade-server %d: "+format+"\n", append([]any{os.Getpid()}, args...)...)
		code = 1
	}
	sig := make(chan os.Signal, 4)
	signal.Notify(sig, syscall.SIGHUP, syscall.SIGTERM)
	lc := shmlink.ListenConfig{
		Config:        &shmlink.Config{ShmDir: p.ShmDir},
		UpgradeSocket: p.UpgradeSocket,
	}
	if p.Network == "quic" { // TLS material from peertest.WriteTLS in p.Dir
		var err error
		if lc.TLSConfig, _, err = peertest.LoadTLS(p.Dir, false); err != nil {
			fail("tls: %v", err)
			return code
		}
	}
	ln, err := lc.Listen(context.Background(), p.Network, p.Addr)
	if err != nil {
		fail("listen: %v", err)
		return code
	}
	fmt.Printf("ready %d %d %s\n", os.Getpid(), ln.Epoch(), ln.Addr())

	var (
		mu      sync.Mutex // guards code via fail
		served  atomic.Int64
		streams sync.WaitGroup
	)
	acceptDone := make(chan struct{})
	go func() {
		defer close(acceptDone)
		for {
			c, err := ln.Accept()
			if err != nil {
				if !errors.Is(err, net.ErrClosed) {
					mu.Lock()
					fail("accept: %v", err)
					mu.Unlock()
				}
				return
			}
			streams.Add(1)
			go func() {
				defer streams.Done()
				defer c.Close()
				if err := peertest.ServeStream(c); err != nil {
					mu.Lock()
					fail("serve: %v", err)
					mu.Unlock()
					return
				}
				served.Add(1)
			}()
		}
	}()

	childDone := make(chan error, 1)
	for running := true; running; {
		select {
		case s := <-sig:
			if s == syscall.SIGTERM {
				running = false
				break
			}
			child := exec.Command(os.Args[0], os.Args[1:]...)
			child.Stdout, child.Stderr = os.Stdout, os.Stderr
			if err := child.Start(); err != nil {
				mu.Lock()
				fail("start the next generation: %v", err)
				mu.Unlock()
				break
			}
			go func() { childDone <- child.Wait() }()
		case err := <-childDone:
			// The next generation exited before taking over.
			mu.Lock()
			fail("the next generation failed: %v", err)
			mu.Unlock()
		case <-ln.Upgraded():
			running = false
		}
	}
	ln.Close()
	<-acceptDone
	streams.Wait()
	mu.Lock()
	defer mu.Unlock()
	fmt.Printf("exit %d %d %d %d\n", os.Getpid(), ln.Epoch(), served.Load(), code)
	return code
}

// countedRequest dials a stream with d and runs one checked request of n
// bytes: every byte of the echo is checked, then the server's EOF.
func countedRequest(d *shmlink.Dialer, network, addr string, n int, seed uint64) error {
	c, err := d.Dial(network, addr)
	if err != nil {
		return fmt.Errorf("dial: %w", err)
	}
	defer c.Close()
	var hdr [9]byte
	hdr[0] = peertest.CmdCounted
	binary.BigEndian.PutUint64(hdr[1:], seed)
	if _, err := c.Write(hdr[:]); err != nil {
		return fmt.Errorf("write command: %w", err)
	}
	if err := peertest.Echo(c, n, seed); err != nil {
		return err
	}
	if err := c.(interface{ CloseWrite() error }).CloseWrite(); err != nil {
		return fmt.Errorf("close write: %w", err)
	}
	if k, err := c.Read(make([]byte, 1)); k != 0 || !errors.Is(err, io.EOF) {
		return fmt.Errorf("after the response: %d bytes, %v; want EOF", k, err)
	}
	return nil
}

// request is one request of the load: when it ran and how it ended.
type request struct {
	start, end time.Time
	err        error
}

// serverLines reads the lines the server processes print.
type serverLines struct {
	ch      <-chan string
	pending []string
}

// wait returns the fields of the first line, past or future, whose fields
// satisfy match, failing the test after upgradeWait.
func (s *serverLines) wait(t *testing.T, what string, match func(f []string) bool) []string {
	t.Helper()
	for i, l := range s.pending {
		if f := strings.Fields(l); match(f) {
			s.pending = append(s.pending[:i], s.pending[i+1:]...)
			return f
		}
	}
	timeout := time.After(upgradeWait)
	for {
		select {
		case l, ok := <-s.ch:
			if !ok {
				t.Fatalf("the servers' output ended before %s; lines: %q", what, s.pending)
			}
			if f := strings.Fields(l); match(f) {
				return f
			}
			s.pending = append(s.pending, l)
		case <-timeout:
			t.Fatalf("timed out waiting for %s; lines: %q", what, s.pending)
		}
	}
}

// The acceptance test: under continuous load (upgradeWorkers
// streams of requests of up to 1 MiB, every byte checked) the server
// process is replaced upgradeCount times, by re-executing itself on
// SIGHUP and by a supervisor (the test) starting a new one, alternately.
// No request fails or is refused; the requests the servers count add up
// to those the client completed (none lost or duplicated); every old
// process exits; after each upgrade no socket or shared-memory file of an
// earlier generation is left, and after the last none at all. Request
// latency during the upgrades is logged.
func TestHotUpgrade(t *testing.T) {
	if testing.Short() {
		t.Skip("starts 4 server processes per transport")
	}
	for _, tr := range upgradeTransports {
		t.Run(tr.name, func(t *testing.T) { testHotUpgrade(t, tr) })
	}
}

func testHotUpgrade(t *testing.T, tr transport) {
	dir := t.TempDir()
	base := snapshot(t, dir)
	addr := "127.0.0.1:0"
	if tr.network == "unix" {
		addr = filepath.Join(dir, "s.sock")
	}
	outR, outW, err := os.Pipe()
	require.NoError(t, err)
	errR, errW, err := os.Pipe()
	require.NoError(t, err)
	defer outR.Close()
	defer errR.Close()
	lineCh := make(chan string, 64)
	go func() {
		defer close(lineCh)
		sc := bufio.NewScanner(outR)
		for sc.Scan() {
			lineCh <- sc.Text()
		}
	}()
	var stderr strings.Builder
	stderrDone := make(chan struct{})
	go func() {
		defer close(stderrDone)
		io.Copy(&stderr, errR)
	}()
	lines := &serverLines{ch: lineCh}

	params := peertest.Params{Network: tr.network, Addr: addr, ShmDir: dir, UpgradeSocket: filepath.Join(dir, "upgrade.sock")}
	var clientTLS *tls.Config
	if tr.network == "quic" {
		params.Dir = t.TempDir()
		require.NoError(t, peertest.WriteTLS(params.Dir))
		_, clientTLS, err = peertest.LoadTLS(params.Dir, false)
		require.NoError(t, err)
	}
	var started []*exec.Cmd
	waits := make(chan error, upgradeCount+1)
	alive := map[int]bool{} // pids that printed ready and not yet exit
	defer func() {
		// On failure, leave no server behind.
		for pid := range alive {
			syscall.Kill(pid, syscall.SIGKILL)
		}
	}()
	start := func() {
		cmd := peertest.Cmd("upgrade-server", params)
		cmd.Stdout, cmd.Stderr = outW, errW
		require.NoError(t, cmd.Start())
		started = append(started, cmd)
		go func() { waits <- cmd.Wait() }()
	}
	ready := func(epoch int) (pid int, addr string) {
		f := lines.wait(t, fmt.Sprintf("generation %d to be ready", epoch), func(f []string) bool {
			return len(f) == 4 && f[0] == "ready" && f[2] == strconv.Itoa(epoch)
		})
		pid, err := strconv.Atoi(f[1])
		require.NoError(t, err)
		alive[pid] = true
		return pid, f[3]
	}
	served := 0
	exited := func(pid int) {
		f := lines.wait(t, fmt.Sprintf("pid %d to exit", pid), func(f []string) bool {
			return len(f) == 5 && f[0] == "exit" && f[1] == strconv.Itoa(pid)
		})
		n, err := strconv.Atoi(f[3])
		require.NoError(t, err)
		served += n
		require.Equal(t, "0", f[4], "exit status of pid %d", pid)
		delete(alive, pid)
	}

	start()
	pid, addr := ready(0)

	// The load: upgradeWorkers streams, each one request after another.
	d := &shmlink.Dialer{
		Config:            &shmlink.Config{ShmDir: dir, MemoryType: tr.memory},
		StreamsPerSession: 2, // several sessions per generation
		TLSConfig:         clientTLS,
	}
	defer d.Close()
	var (
		mu       sync.Mutex
		requests []request
		failures []error
	)
	progress := make(chan struct{}, 1)
	stop := make(chan struct{})
	var workers sync.WaitGroup
	for w := range upgradeWorkers {
		workers.Add(1)
		go func() {
			defer workers.Done()
			rng := rand.New(rand.NewPCG(uint64(w), 5))
			for seq := uint64(0); ; seq++ {
				select {
				case <-stop:
					return
				default:
				}
				n := upgradeSizes[rng.IntN(len(upgradeSizes))]
				r := request{start: time.Now()}
				r.err = countedRequest(d, tr.network, addr, n, uint64(w)<<32|seq)
				r.end = time.Now()
				mu.Lock()
				requests = append(requests, r)
				if r.err != nil {
					failures = append(failures, fmt.Errorf("worker %d request %d (%d bytes): %w", w, seq, n, r.err))
				}
				mu.Unlock()
				select {
				case progress <- struct{}{}:
				default:
				}
			}
		}()
	}
	var stopOnce sync.Once
	stopLoad := func() {
		stopOnce.Do(func() {
			close(stop)
			workers.Wait()
		})
	}
	defer stopLoad()
	// awaitRequests waits until n more requests have completed.
	awaitRequests := func(n int) {
		mu.Lock()
		target := len(requests) + n
		mu.Unlock()
		timeout := time.After(upgradeWait)
		for {
			mu.Lock()
			done, failed := len(requests), len(failures)
			mu.Unlock()
			require.Zero(t, failed, "failed requests: %v", failures)
			if done >= target {
				return
			}
			select {
			case <-progress:
			case <-timeout:
				t.Fatalf("only %d of %d requests done", done, target)
			}
		}
	}

	var windows []struct{ from, to time.Time }
	awaitRequests(upgradeBatch)
	for epoch := 1; epoch <= upgradeCount; epoch++ {
		from := time.Now()
		how := "SIGHUP (re-exec)"
		if epoch%2 == 1 {
			require.NoError(t, syscall.Kill(pid, syscall.SIGHUP))
		} else {
			how = "supervisor start"
			start()
		}
		next, nextAddr := ready(epoch)
		require.Equal(t, addr, nextAddr, "the same address")
		exited(pid)
		windows = append(windows, struct{ from, to time.Time }{from, time.Now()})
		t.Logf("upgrade %d by %s: pid %d -> %d in %v", epoch, how, pid, next, time.Since(from).Round(time.Millisecond))
		pid = next
		awaitRequests(upgradeBatch)
		requireLiveOnly(t, tr, dir, epoch)
	}
	stopLoad()
	require.NoError(t, d.Close())
	require.NoError(t, syscall.Kill(pid, syscall.SIGTERM))
	exited(pid)

	// Every server process is gone when the last copy of their standard
	// output is closed.
	outW.Close()
	errW.Close()
	for range started {
		require.NoError(t, <-waits)
	}
	timeout := time.After(upgradeWait)
	for closed := false; !closed; {
		select {
		case l, ok := <-lines.ch:
			if ok {
				lines.pending = append(lines.pending, l)
			}
			closed = !ok
		case <-timeout:
			t.Fatalf("a server process is still running; alive: %v", alive)
		}
	}
	<-stderrDone
	outR.Close()
	errR.Close()
	require.Empty(t, stderr.String(), "servers' standard error")
	require.Empty(t, lines.pending, "unexpected server output")

	mu.Lock()
	defer mu.Unlock()
	require.Empty(t, failures)
	require.Equal(t, len(requests), served, "requests the servers served vs. completed by the client")
	require.Empty(t, socketFiles(t, dir), "socket files left")
	requireNoLeaks(t, base, dir)
	logLatency(t, requests, windows)
}

// requireLiveOnly checks that, after the upgrade to epoch, only the live
// generation's files exist in dir: its socket files, and no
// shared-memory file named with an earlier epoch.
func requireLiveOnly(t *testing.T, tr transport, dir string, epoch int) {
	t.Helper()
	want := []string{"upgrade.sock"}
	if tr.network == "unix" {
		want = append(want, "s.sock")
	}
	require.ElementsMatch(t, want, socketFiles(t, dir), "socket files")
	entries, err := os.ReadDir(dir)
	require.NoError(t, err)
	for _, e := range entries {
		// shmlink_<pid>_e<epoch>_<random>_...
		f := strings.Split(e.Name(), "_")
		if len(f) < 3 || f[0] != "shmlink" {
			continue
		}
		require.Equal(t, "e"+strconv.Itoa(epoch), f[2], "shared-memory file %s of another generation", e.Name())
	}
}

// logLatency logs the median and worst latency of the requests that
// overlapped an upgrade window, and of all requests for comparison.
func logLatency(t *testing.T, requests []request, windows []struct{ from, to time.Time }) {
	var during, all []time.Duration
	for _, r := range requests {
		d := r.end.Sub(r.start)
		all = append(all, d)
		for _, w := range windows {
			if r.start.Before(w.to) && r.end.After(w.from) {
				during = append(during, d)
				break
			}
		}
	}
	stats := func(ds []time.Duration) string {
		if len(ds) == 0 {
			return "none"
		}
		slices.Sort(ds)
		return fmt.Sprintf("%d requests, median %v, worst %v", len(ds),
			ds[len(ds)/2].Round(time.Microsecond), ds[len(ds)-1].Round(time.Microsecond))
	}
	t.Logf("latency during the %d upgrades: %s", len(windows), stats(during))
	t.Logf("latency over the whole run: %s", stats(all))
}
