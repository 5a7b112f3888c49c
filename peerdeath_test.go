package shmlink_test

import (
	"fmt"
	"io"
	"math"
	"math/rand/v2"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/shmlink/shmlink"
	"github.com/shmlink/shmlink/internal/peertest"
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
	// peerDeathBound is how soon after the dead peer was reaped every stream
	// of its session must have failed. The reaping, not the kill, starts
	// the clock: the kernel closes the peer's sockets (all we can see of its
	// death) between the two, after tearing down its address space, and
	// that time is the kernel's (peertest.Proc.Crash). The tests log both.
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

// runPeerClient is the "client" role: it dials p.Addr over p.Network with
// its shared memory in p.ShmDir, of type p.Memory, and runs p.Mode:
// "traffic" opens peerDeathStreams streams and exchanges on all of them
// until killed, printing "ready" once every stream has exchanged once;
// "once" runs a checked exchange on a few streams, prints "ok" and exits
// 0. The server echoes every stream; p.Seed derives the patterns.
func runPeerClient(p peertest.Params) int {
	memory := shmlink.MemoryAuto
	for _, m := range []shmlink.MemoryType{shmlink.MemoryMemfd, shmlink.MemoryFile} {
		if m.String() == p.Memory {
			memory = m
		}
	}
	seed, mode, network, addr := p.Seed, p.Mode, p.Network, p.Addr
	d := &shmlink.Dialer{Config: &shmlink.Config{ShmDir: p.ShmDir, MemoryType: memory}}
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
			if err := peertest.Echo(c, n, seed+uint64(i)); err != nil {
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
					if err := peertest.Echo(c, n, seed^uint64(i)<<32^uint64(round)); err != nil {
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
// reaped, when the dead peer was reaped. It returns the time from reaped
// to the last failure, which is negative when every stream failed before
// the reaping.
func requireAllFailed(t *testing.T, ends <-chan streamEnd, n int, reaped time.Time) time.Duration {
	t.Helper()
	var last time.Time
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
		if e.at.After(last) {
			last = e.at
		}
	}
	require.Len(t, sessions, 1, "the streams were on one session")
	took := last.Sub(reaped)
	require.LessOrEqual(t, took, peerDeathBound, "every stream must fail within %v of the peer's reaping", peerDeathBound)
	return took
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
// the dead client's session fails within a second of its reaping, the
// listener drops the session, goroutines and descriptors come back to
// where they were, and a new client is served at once.
func TestPeerDeathClient(t *testing.T) {
	rng := peerDeathRand(t)
	worst := time.Duration(math.MinInt64)
	for _, tr := range transports {
		t.Run(tr.name, func(t *testing.T) {
			ln, cfg := listen(t, tr.network)
			ends := make(chan streamEnd, 2*peerDeathStreams)
			wait := peertest.ServeEach(ln, func(c net.Conn) {
				_, err := io.Copy(c, c)
				ends <- streamEnd{at: time.Now(), err: err, s: c.(*shmlink.Stream).Session()}
			})
			defer func() {
				ln.CloseSessions()
				wait()
			}()
			base := snapshot(t, cfg.ShmDir)
			params := peertest.Params{Network: tr.network, Addr: ln.Addr().String(),
				ShmDir: cfg.ShmDir, Memory: tr.memory.String()}
			for kill := range peerDeathKills {
				traffic := params
				traffic.Mode, traffic.Seed = "traffic", uint64(kill)
				p := peertest.Start(t, "client", traffic)
				p.Expect(t, "ready")
				require.Equal(t, 1, ln.NumSessions())
				time.Sleep(time.Duration(rng.Int64N(int64(peerDeathMaxDelay)))) // a random point of the traffic
				killed, reaped := p.Crash(t)
				took := requireAllFailed(t, ends, peerDeathStreams, reaped)
				worst = max(worst, took)
				t.Logf("kill %d: reaped %v after the kill; the last of %d streams failed %v after the reaping",
					kill, reaped.Sub(killed), peerDeathStreams, took)

				// A new client is served at once.
				once := params
				once.Mode, once.Seed = "once", 7
				p = peertest.Start(t, "client", once)
				p.Expect(t, "ok")
				require.NoError(t, p.Wait(), "stderr: %s", p.Stderr())
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
	t.Logf("longest time from a reaping to the last stream's failure: %v", worst)
}

// TestPeerDeathServer kills the server peer (with SIGKILL, at random
// points of heavy two-way traffic on many streams of one Dialer) several
// times over each transport, restarting it at the same address. Each time,
// every stream of the dead session fails within a second of its reaping,
// goroutines, descriptors and our shared-memory files are released, and
// the Dialer's next Dial gets a working stream on a new session at once.
func TestPeerDeathServer(t *testing.T) {
	rng := peerDeathRand(t)
	worst := time.Duration(math.MinInt64)
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
			start := func() *peertest.Proc {
				if tr.network == "unix" {
					os.Remove(addr)
				}
				params := peertest.Params{Network: tr.network, Addr: addr, ShmDir: shmDir}
				p := peertest.Start(t, "server", params)
				if line, ok := p.NextLine(); ok {
					addr = strings.TrimPrefix(line, "ready ")
					return p
				}
				err := p.Wait()
				require.Equal(t, "tcp", tr.network, "server peer failed: %v; stderr: %s", err, p.Stderr())
				t.Logf("port of %s taken: %s", addr, p.Stderr())
				params.Addr = "127.0.0.1:0"
				p = peertest.Start(t, "server", params)
				addr = p.Expect(t, "ready ")
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
				command(t, c, peertest.CmdEcho, 0)
				for i, n := range peerDeathSizes {
					require.NoError(t, peertest.Echo(c, n, uint64(i)))
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
					command(t, c, peertest.CmdEcho, 0)
					ready.Add(1)
					go func() {
						defer c.Close()
						var err error
						for round := 0; err == nil; round++ {
							n := peerDeathSizes[(i+round)%len(peerDeathSizes)]
							err = peertest.Echo(c, n, uint64(kill)<<48^uint64(i)<<32^uint64(round))
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
				killed, reaped := p.Crash(t)
				took := requireAllFailed(t, ends, peerDeathStreams, reaped)
				worst = max(worst, took)
				t.Logf("kill %d: reaped %v after the kill; the last of %d streams failed %v after the reaping",
					kill, reaped.Sub(killed), peerDeathStreams, took)

				// The Dialer drops the dead session and dials the restarted
				// server at once.
				p = start()
				s := checkedExchange()
				require.NotSame(t, old, s)
				old = s

				// Stop this server too, so that its session ends and the
				// counts can go back to where they started.
				if kill == peerDeathKills-1 {
					p.Stop(t)
				}
				requireBackTo(t, base, func(c *assert.CollectT) {
					// The new session is idle: the Dialer closes it.
					assert.Zero(c, d.NumSessions(), "the Dialer's sessions")
				}, shmDir)
			}
		})
	}
	t.Logf("longest time from a reaping to the last stream's failure: %v", worst)
}
