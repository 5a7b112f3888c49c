package shmlink_test

import (
	"bufio"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/shmlink/shmlink"
	"github.com/shmlink/shmlink/session"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// Parameters of the peer-death tests (issue #6).
const (
	// peerDeathKills is the number of times each test kills its peer, per
	// transport.
	peerDeathKills = 5
	// peerDeathStreams is the number of streams carrying traffic when the
	// peer is killed.
	peerDeathStreams = 24
	// peerDeathMaxDelay bounds the random delay between the moment every
	// stream has carried traffic and the kill.
	peerDeathMaxDelay = 150 * time.Millisecond
	// peerDeathBound is how soon after the kill every stream of the dead
	// peer's session must have failed.
	peerDeathBound = time.Second
	// peerDeathWait is how long the tests wait for a stream to fail before
	// declaring it hung.
	peerDeathWait = 10 * time.Second
	// peerDeathSeedEnv, if set, replaces the random seed of the kill delays
	// (every test logs the seed it used).
	peerDeathSeedEnv = "SHMLINK_TEST_PEERDEATH_SEED"
)

// peerDeathSizes are the message sizes of the traffic: within a slice, at
// and across slice boundaries, and chains of many slices.
var peerDeathSizes = []int{1, 100, 8172, 8173, 32748, 65536, 131053, 300 << 10, 1 << 20}

// Environment of the client peer process (role "client" of TestMain).
const (
	// peerClientEnv selects the client peer's mode: "traffic" (open
	// peerDeathStreams streams, exchange on all of them until killed,
	// printing "ready" once every stream has exchanged once) or "once" (a
	// checked exchange on a few streams, then "ok" and exit 0).
	peerClientEnv = "SHMLINK_TEST_PEER_CLIENT"
	// peerClientSeedEnv derives the traffic patterns of the client peer.
	peerClientSeedEnv = "SHMLINK_TEST_PEER_SEED"
)

// runPeerClient is the client peer: it dials SHMLINK_TEST_ADDR over
// SHMLINK_TEST_NET with its shared memory in SHMLINK_TEST_SHMDIR, of the
// SHMLINK_TEST_MEMORY type, and runs mode (see peerClientEnv). The server
// echoes every stream.
func runPeerClient(mode string) int {
	memory := shmlink.MemoryAuto
	for _, m := range []shmlink.MemoryType{shmlink.MemoryMemfd, shmlink.MemoryFile} {
		if m.String() == os.Getenv("SHMLINK_TEST_MEMORY") {
			memory = m
		}
	}
	seed, _ := strconv.ParseUint(os.Getenv(peerClientSeedEnv), 10, 64)
	network, addr := os.Getenv("SHMLINK_TEST_NET"), os.Getenv("SHMLINK_TEST_ADDR")
	d := &shmlink.Dialer{Config: &shmlink.Config{ShmDir: os.Getenv("SHMLINK_TEST_SHMDIR"), MemoryType: memory}}
	defer d.Close()
	fail := func(err error) int {
		fmt.Fprintln(os.Stderr, "client peer:", err)
		return 1
	}
	switch mode {
	case "once":
		for i, n := range []int{1, 8173, 131053, 1 << 20} {
			c, err := d.Dial(network, addr)
			if err != nil {
				return fail(err)
			}
			if err := echo(c, n, seed+uint64(i)); err != nil {
				return fail(err)
			}
			if err := c.Close(); err != nil {
				return fail(err)
			}
		}
		fmt.Println("ok")
		return 0
	case "traffic":
		var ready sync.WaitGroup
		for i := range peerDeathStreams {
			c, err := d.Dial(network, addr)
			if err != nil {
				return fail(err)
			}
			ready.Add(1)
			go func() {
				for round := 0; ; round++ {
					n := peerDeathSizes[(i+round)%len(peerDeathSizes)]
					if err := echo(c, n, seed^uint64(i)<<32^uint64(round)); err != nil {
						// Only the test's side can end the traffic; it never
						// does before the kill, so this is a failure.
						fmt.Fprintf(os.Stderr, "client peer: stream %d round %d: %v\n", i, round, err)
						os.Exit(1)
					}
					if round == 0 {
						ready.Done()
					}
				}
			}()
		}
		ready.Wait()
		fmt.Println("ready")
		// Exchange until killed, or until the test closes standard input.
		io.Copy(io.Discard, os.Stdin)
		return 0
	}
	return fail(fmt.Errorf("unknown mode %q", mode))
}

// peerProc is a peer process run by the peer-death tests.
type peerProc struct {
	cmd    *exec.Cmd
	stdin  io.WriteCloser
	lines  chan string // standard output, line by line; closed at EOF
	stderr strings.Builder
	waited bool
	err    error // of Wait
}

// startPeerProc starts the test binary as a peer with env added to the
// environment; the test's end kills it if it still runs.
func startPeerProc(t *testing.T, args []string, env ...string) *peerProc {
	t.Helper()
	p := &peerProc{lines: make(chan string, 16)}
	p.cmd = exec.Command(os.Args[0], args...)
	p.cmd.Env = append(os.Environ(), env...)
	p.cmd.Stderr = &p.stderr
	var err error
	p.stdin, err = p.cmd.StdinPipe()
	require.NoError(t, err)
	stdout, err := p.cmd.StdoutPipe()
	require.NoError(t, err)
	require.NoError(t, p.cmd.Start())
	go func() {
		defer close(p.lines)
		r := bufio.NewScanner(stdout)
		for r.Scan() {
			p.lines <- r.Text()
		}
	}()
	t.Cleanup(func() {
		if !p.waited {
			p.cmd.Process.Kill()
			p.wait()
		}
	})
	return p
}

// wait reaps the process once its standard output is read to the end.
func (p *peerProc) wait() error {
	if !p.waited {
		for range p.lines {
		}
		p.err = p.cmd.Wait()
		p.waited = true
	}
	return p.err
}

// expect waits for the next line of the peer's output and checks that it
// starts with prefix; it returns the rest of the line.
func (p *peerProc) expect(t *testing.T, prefix string) string {
	t.Helper()
	select {
	case line, ok := <-p.lines:
		if ok && strings.HasPrefix(line, prefix) {
			return strings.TrimSpace(strings.TrimPrefix(line, prefix))
		}
		p.cmd.Process.Kill()
		err := p.wait()
		t.Fatalf("peer said %q (output ended: %v), want %q; exit: %v; stderr: %s", line, !ok, prefix, err, p.stderr.String())
	case <-time.After(30 * time.Second):
		p.cmd.Process.Kill()
		p.wait()
		t.Fatalf("peer did not say %q in 30 s; stderr: %s", prefix, p.stderr.String())
	}
	return ""
}

// kill kills the peer with SIGKILL, reaps it, and returns when the signal
// was sent. The peer must not have complained on its standard error.
func (p *peerProc) kill(t *testing.T) time.Time {
	t.Helper()
	at := time.Now()
	require.NoError(t, p.cmd.Process.Signal(syscall.SIGKILL))
	err := p.wait()
	var ee *exec.ExitError
	require.ErrorAs(t, err, &ee)
	ws, ok := ee.Sys().(syscall.WaitStatus)
	require.True(t, ok && ws.Signaled() && ws.Signal() == syscall.SIGKILL, "peer exit: %v; stderr: %s", err, p.stderr.String())
	require.Empty(t, p.stderr.String(), "peer stderr before the kill")
	return at
}

// stop closes the peer's standard input and checks that it exits cleanly.
func (p *peerProc) stop(t *testing.T) {
	t.Helper()
	p.stdin.Close()
	require.NoError(t, p.wait(), "peer exit; stderr: %s", p.stderr.String())
	require.Empty(t, p.stderr.String(), "peer stderr")
}

// peerDeathRand returns the random source of the kill delays and logs its
// seed, taken from peerDeathSeedEnv if set.
func peerDeathRand(t *testing.T) *rand.Rand {
	seed := uint64(time.Now().UnixNano())
	if s := os.Getenv(peerDeathSeedEnv); s != "" {
		var err error
		seed, err = strconv.ParseUint(s, 10, 64)
		require.NoError(t, err, peerDeathSeedEnv)
	}
	t.Logf("seed %d (set %s=%d to repeat the kill delays)", seed, peerDeathSeedEnv, seed)
	return rand.New(rand.NewPCG(seed, 0))
}

// streamEnd is how one stream of the traffic ended: when, and with what
// error, on which session.
type streamEnd struct {
	at  time.Time
	err error
	s   *session.Session
}

// requireAllFailed collects the ends of n streams of one session that the
// peer's death must have failed, and checks that each failed with the
// session's error, not io.EOF or a timeout, within peerDeathBound of
// killedAt. It returns the longest time from the kill to a failure.
func requireAllFailed(t *testing.T, ends <-chan streamEnd, n int, killedAt time.Time) time.Duration {
	t.Helper()
	var worst time.Duration
	sessions := map[*session.Session]bool{}
	for i := range n {
		var e streamEnd
		select {
		case e = <-ends:
		case <-time.After(peerDeathWait):
			t.Fatalf("%d of %d streams still running %v after the kill", n-i, n, peerDeathWait)
		}
		sessions[e.s] = true
		require.Error(t, e.err, "a stream ended cleanly although its peer was killed")
		var se *session.SessionError
		require.ErrorAs(t, e.err, &se, "the peer's death is a session error: %v", e.err)
		require.NotErrorIs(t, e.err, os.ErrDeadlineExceeded)
		worst = max(worst, e.at.Sub(killedAt))
	}
	require.Len(t, sessions, 1, "the streams were on one session")
	require.LessOrEqual(t, worst, peerDeathBound, "every stream must fail within %v of the kill", peerDeathBound)
	return worst
}

// shmFiles returns the names in dir of shared-memory files created by
// process pid, or by any process if pid is 0.
func shmFiles(t require.TestingT, dir string, pid int) []string {
	prefix := "shmlink_"
	if pid != 0 {
		prefix = fmt.Sprintf("shmlink_%d_", pid)
	}
	entries, err := os.ReadDir(dir)
	require.NoError(t, err)
	var names []string
	for _, e := range entries {
		if strings.HasPrefix(e.Name(), prefix) {
			names = append(names, e.Name())
		}
	}
	return names
}

// TestPeerDeathClient kills the client peer (with SIGKILL, at random
// points of heavy two-way traffic on many streams) of an in-process
// listener, several times over each transport. Each time, every stream of
// the dead client's session fails within a second, the listener drops the
// session, goroutines and descriptors come back to where they were, and a
// new client is served at once.
func TestPeerDeathClient(t *testing.T) {
	rng := peerDeathRand(t)
	var worst time.Duration
	for _, tr := range transports {
		t.Run(tr.name, func(t *testing.T) {
			ln, cfg := listen(t, tr.network)
			ends := make(chan streamEnd, 2*peerDeathStreams)
			wait := serveEach(ln, func(c net.Conn) {
				_, err := io.Copy(c, c)
				ends <- streamEnd{at: time.Now(), err: err, s: c.(*shmlink.Stream).Session()}
			})
			defer func() {
				ln.Close()
				wait()
			}()
			base := snapshot(t, cfg.ShmDir)
			env := []string{"SHMLINK_TEST_NET=" + tr.network, "SHMLINK_TEST_ADDR=" + ln.Addr().String(),
				"SHMLINK_TEST_SHMDIR=" + cfg.ShmDir, "SHMLINK_TEST_MEMORY=" + tr.memory.String()}
			args := []string{"-test.run=^$"}
			for kill := range peerDeathKills {
				p := startPeerProc(t, args, append(env, peerEnv+"=client", peerClientEnv+"=traffic",
					fmt.Sprintf("%s=%d", peerClientSeedEnv, kill))...)
				p.expect(t, "ready")
				require.Equal(t, 1, ln.NumSessions())
				time.Sleep(time.Duration(rng.Int64N(int64(peerDeathMaxDelay)))) // a random point of the traffic
				killedAt := p.kill(t)
				took := requireAllFailed(t, ends, peerDeathStreams, killedAt)
				worst = max(worst, took)
				t.Logf("kill %d: all %d streams failed within %v", kill, peerDeathStreams, took)

				// A new client is served at once.
				p = startPeerProc(t, args, append(env, peerEnv+"=client", peerClientEnv+"=once", peerClientSeedEnv+"=7")...)
				p.expect(t, "ok")
				require.NoError(t, p.wait(), "stderr: %s", p.stderr.String())
				for range 4 {
					e := <-ends
					require.NoError(t, e.err, "the new client's streams end cleanly")
				}

				requireBackTo(t, base, func(c *assert.CollectT) {
					assert.Zero(c, ln.NumSessions(), "the listener's sessions")
				}, cfg.ShmDir)
			}
			// A v2 client (TCP) unlinks its files as soon as the server
			// speaks, so even the killed ones leave nothing behind.
			require.Empty(t, shmFiles(t, cfg.ShmDir, 0), "shared-memory files left")
		})
	}
	t.Logf("longest time from a kill to the last stream's failure: %v", worst)
}

// TestPeerDeathServer kills the server peer (with SIGKILL, at random
// points of heavy two-way traffic on many streams of one Dialer) several
// times over each transport, restarting it at the same address. Each time,
// every stream of the dead session fails within a second, goroutines,
// descriptors and our shared-memory files are released, and the Dialer's
// next Dial gets a working stream on a new session at once.
func TestPeerDeathServer(t *testing.T) {
	rng := peerDeathRand(t)
	var worst time.Duration
	for _, tr := range transports {
		t.Run(tr.name, func(t *testing.T) {
			shmDir, sockDir := t.TempDir(), t.TempDir()
			addr := "127.0.0.1:0"
			if tr.network == "unix" {
				addr = filepath.Join(sockDir, "s.sock")
			}
			// start runs the server peer at addr, replacing the socket file
			// of a killed one. A TCP port taken meanwhile by another process
			// moves the server to a new port.
			start := func() *peerProc {
				if tr.network == "unix" {
					os.Remove(addr)
				}
				env := []string{peerEnv + "=server", "SHMLINK_TEST_NET=" + tr.network,
					"SHMLINK_TEST_SHMDIR=" + shmDir}
				p := startPeerProc(t, []string{"-test.run=^$"}, append(env, "SHMLINK_TEST_ADDR="+addr)...)
				if line, ok := <-p.lines; ok {
					addr = strings.TrimPrefix(line, "ready ")
					return p
				}
				err := p.wait()
				require.Equal(t, "tcp", tr.network, "server peer failed: %v; stderr: %s", err, p.stderr.String())
				t.Logf("port of %s taken: %s", addr, p.stderr.String())
				p = startPeerProc(t, []string{"-test.run=^$"}, append(env, "SHMLINK_TEST_ADDR=127.0.0.1:0")...)
				addr = p.expect(t, "ready ")
				return p
			}
			d := &shmlink.Dialer{Config: &shmlink.Config{ShmDir: shmDir, MemoryType: tr.memory}, IdleTimeout: 20 * time.Millisecond}
			defer d.Close()
			// checkedExchange dials and runs an echo of every size on one
			// stream.
			checkedExchange := func() *session.Session {
				c, err := d.Dial(tr.network, addr)
				require.NoError(t, err)
				defer c.Close()
				s := c.(*shmlink.Stream).Session()
				require.NoError(t, s.Err())
				command(t, c, cmdEcho, 0)
				for i, n := range peerDeathSizes {
					require.NoError(t, echo(c, n, uint64(i)))
				}
				return s
			}

			// The base counts one server peer (its pipes and the goroutines
			// that read them) and no session.
			p := start()
			checkedExchange()
			require.Eventually(t, func() bool { return d.NumSessions() == 0 }, 10*time.Second, time.Millisecond)
			base := snapshot(t, shmDir)
			var old *session.Session
			for kill := range peerDeathKills {
				ends := make(chan streamEnd, peerDeathStreams)
				var ready sync.WaitGroup
				for i := range peerDeathStreams {
					c, err := d.Dial(tr.network, addr)
					require.NoError(t, err)
					command(t, c, cmdEcho, 0)
					ready.Add(1)
					go func() {
						defer c.Close()
						var err error
						for round := 0; err == nil; round++ {
							n := peerDeathSizes[(i+round)%len(peerDeathSizes)]
							err = echo(c, n, uint64(kill)<<48^uint64(i)<<32^uint64(round))
							if round == 0 {
								ready.Done()
							}
						}
						ends <- streamEnd{at: time.Now(), err: err, s: c.(*shmlink.Stream).Session()}
					}()
				}
				ready.Wait()
				select {
				case e := <-ends:
					t.Fatalf("a stream failed before the kill: %v", e.err)
				default:
				}
				time.Sleep(time.Duration(rng.Int64N(int64(peerDeathMaxDelay)))) // a random point of the traffic
				killedAt := p.kill(t)
				took := requireAllFailed(t, ends, peerDeathStreams, killedAt)
				worst = max(worst, took)
				t.Logf("kill %d: all %d streams failed within %v", kill, peerDeathStreams, took)

				// The Dialer drops the dead session and dials the restarted
				// server at once.
				p = start()
				s := checkedExchange()
				require.NotSame(t, old, s)
				old = s

				// Stop this server too, so that its session ends and the
				// counts can go back to where they started.
				if kill == peerDeathKills-1 {
					p.stop(t)
				}
				requireBackTo(t, base, func(c *assert.CollectT) {
					// The new session is idle: the Dialer closes it.
					assert.Zero(c, d.NumSessions(), "the Dialer's sessions")
				}, shmDir)
			}
		})
	}
	t.Logf("longest time from a kill to the last stream's failure: %v", worst)
}
