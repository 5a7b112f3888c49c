//go:build interop

package interop_test

import (
	"bufio"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// Bounds of the waits on the Rust processes. They only cap a failing run;
// a passing run never waits for them to pass.
const (
	startTimeout  = 10 * time.Second  // until the server prints "ready"
	runTimeout    = 2 * time.Minute   // one client run, or one test's traffic
	streamTimeout = 30 * time.Second  // until the server reports every stream
	stopTimeout   = 10 * time.Second  // from SIGTERM until the server exits
	rustTimeoutS  = "100"             // the Rust client's own --timeout-s
	bannerPrefix  = "shmipc-interop:" // first line of both Rust binaries
)

// output collects the lines a process prints, for tests to wait on.
type output struct {
	mu      sync.Mutex
	lines   []string
	ended   bool
	changed chan struct{} // cap 1: a line arrived or the output ended
}

func newOutput() *output { return &output{changed: make(chan struct{}, 1)} }

func (o *output) notify() {
	select {
	case o.changed <- struct{}{}:
	default:
	}
}

// collect reads r line by line until it ends.
func (o *output) collect(r io.Reader) {
	sc := bufio.NewScanner(r)
	for sc.Scan() {
		o.mu.Lock()
		o.lines = append(o.lines, sc.Text())
		o.mu.Unlock()
		o.notify()
	}
	o.mu.Lock()
	o.ended = true
	o.mu.Unlock()
	o.notify()
}

// waitFor waits until cond holds for the lines printed so far. It returns
// false if the output ends or timeout passes first.
func (o *output) waitFor(timeout time.Duration, cond func(lines []string) bool) bool {
	timer := time.NewTimer(timeout)
	defer timer.Stop()
	for {
		o.mu.Lock()
		ok, ended := cond(o.lines), o.ended
		o.mu.Unlock()
		if ok {
			return true
		}
		if ended {
			return false
		}
		select {
		case <-o.changed:
		case <-timer.C:
			return false
		}
	}
}

func (o *output) String() string {
	o.mu.Lock()
	defer o.mu.Unlock()
	return strings.Join(o.lines, "\n")
}

// rustServer is a running Rust echo server (interop/rust/src/bin/server.rs).
type rustServer struct {
	cmd    *exec.Cmd
	stdout *output
	stderr *output
	exited chan struct{} // closed when the process has been waited for
	err    error         // exit error, once exited is closed
	unix   string        // socket path
	tcp    string        // host:port it bound
}

// startRustServer starts the Rust echo server on a Unix socket in a fresh
// directory and on a free TCP port of 127.0.0.1, waits for its "ready"
// line, and stops it when the test ends (stop checks its exit).
func startRustServer(t *testing.T, extra ...string) *rustServer {
	t.Helper()
	s := &rustServer{
		unix:   filepath.Join(t.TempDir(), "s.sock"),
		stdout: newOutput(),
		stderr: newOutput(),
		exited: make(chan struct{}),
	}
	args := append([]string{"--unix", s.unix, "--tcp", "127.0.0.1:0"}, extra...)
	s.cmd = exec.Command(rustServerBin, args...)
	stdout, err := s.cmd.StdoutPipe()
	require.NoError(t, err)
	stderr, err := s.cmd.StderrPipe()
	require.NoError(t, err)
	require.NoError(t, s.cmd.Start())
	var pipes sync.WaitGroup
	pipes.Add(2)
	go func() { defer pipes.Done(); s.stdout.collect(stdout) }()
	go func() { defer pipes.Done(); s.stderr.collect(stderr) }()
	go func() {
		pipes.Wait() // Wait closes the pipes: read them to the end first
		s.err = s.cmd.Wait()
		close(s.exited)
	}()
	t.Cleanup(func() { s.stop(t) })

	ready := s.stdout.waitFor(startTimeout, func(lines []string) bool {
		return len(lines) > 0 && lines[len(lines)-1] == "ready"
	})
	require.True(t, ready, "Rust server did not print ready\nstdout:\n%s\nstderr:\n%s", s.stdout, s.stderr)
	for _, line := range strings.Split(s.stdout.String(), "\n") {
		if strings.HasPrefix(line, bannerPrefix) {
			t.Log("Rust server:", line)
		}
		if addr, ok := strings.CutPrefix(line, "listening tcp "); ok {
			s.tcp = addr
		}
	}
	require.NotEmpty(t, s.tcp, "Rust server did not name its TCP address")
	return s
}

// addr returns the server's address on network ("unix" or "tcp").
func (s *rustServer) addr(network string) string {
	if network == "unix" {
		return s.unix
	}
	return s.tcp
}

var streamLine = regexp.MustCompile(`^stream (\d+) (closed|closed by server|aborted by session close) after echoing (\d+) bytes`)

// waitStreams waits until the server has reported every stream in ids as
// ended (an id listed twice, reused for a second stream, must be reported
// twice) and checks how: closed by the peer (or, with byServer, by the
// server itself) after echoing exactly want bytes.
func (s *rustServer) waitStreams(t *testing.T, ids []uint32, want int64, byServer bool) {
	t.Helper()
	type report struct {
		how   string
		bytes int64
	}
	count := make(map[uint32]int)
	for _, id := range ids {
		count[id]++
	}
	reports := make(map[uint32][]report)
	all := s.stdout.waitFor(streamTimeout, func(lines []string) bool {
		clear(reports)
		for _, line := range lines {
			if m := streamLine.FindStringSubmatch(line); m != nil {
				id, _ := strconv.ParseUint(m[1], 10, 32)
				n, _ := strconv.ParseInt(m[3], 10, 64)
				reports[uint32(id)] = append(reports[uint32(id)], report{m[2], n})
			}
		}
		for id, n := range count {
			if len(reports[id]) < n {
				return false
			}
		}
		return true
	})
	require.True(t, all, "Rust server did not report every stream\nstdout:\n%s\nstderr:\n%s", s.stdout, s.stderr)
	how := "closed"
	if byServer {
		how = "closed by server"
	}
	for id := range count {
		for _, r := range reports[id] {
			require.Equal(t, report{how, want}, r, "Rust server's report of stream %d", id)
		}
	}
}

// stop ends the server with SIGTERM (once) and checks that it exits 0 with
// no stream error, none cut short by a session close, and nothing on
// stderr.
func (s *rustServer) stop(t *testing.T) {
	t.Helper()
	select {
	case <-s.exited:
	default:
		s.cmd.Process.Signal(syscall.SIGTERM)
		select {
		case <-s.exited:
		case <-time.After(stopTimeout):
			s.cmd.Process.Kill()
			<-s.exited
			t.Fatalf("Rust server did not exit on SIGTERM\nstdout:\n%s", s.stdout)
		}
	}
	out := s.stdout.String()
	require.NoError(t, s.err, "Rust server exit\nstdout:\n%s\nstderr:\n%s", out, s.stderr)
	require.Empty(t, s.stderr.String(), "Rust server stderr")
	require.Regexp(t, `(?m)^server: done streams=\d+ bytes=\d+ errors=0 aborted_by_session_close=0$`, out,
		"Rust server's summary")
}

// runRustClient runs the Rust checking client with args and returns its
// standard output. It fails the test unless the client exits 0 and says OK.
func runRustClient(t *testing.T, args ...string) string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), runTimeout)
	defer cancel()
	cmd := exec.CommandContext(ctx, rustClientBin, append([]string{"--timeout-s", rustTimeoutS}, args...)...)
	var stdout, stderr strings.Builder
	cmd.Stdout = &stdout
	cmd.Stderr = &stderr
	start := time.Now()
	err := cmd.Run()
	out := stdout.String()
	var exit *exec.ExitError
	if errors.As(err, &exit) || err == nil {
		t.Logf("Rust client %s: exit %d in %v", strings.Join(args, " "), cmd.ProcessState.ExitCode(),
			time.Since(start).Round(time.Millisecond))
	}
	require.NoError(t, err, "Rust client\nstdout:\n%s\nstderr:\n%s", out, stderr.String())
	require.Empty(t, stderr.String(), "Rust client stderr")
	require.Contains(t, out, "\nclient: OK\n", "Rust client")
	for _, line := range strings.Split(out, "\n") {
		if strings.HasPrefix(line, bannerPrefix) || strings.HasPrefix(line, "client: stats") {
			t.Log("Rust client:", line)
		}
	}
	return out
}

// shmDir returns a fresh directory for file-backed shared memory and removes
// it when the test ends. It lies in /dev/shm (tmpfs), where such files
// belong: a region on a disk file system can stall a handshake under load
// past the Rust crate's 1 s handshake timeout.
func shmDir(t *testing.T) string {
	t.Helper()
	dir, err := os.MkdirTemp("/dev/shm", "shmlink-interop-")
	require.NoError(t, err)
	t.Cleanup(func() { os.RemoveAll(dir) })
	return dir
}

// requireNoShmFiles checks that dir holds nothing but the entries in keep:
// every shared-memory file either side created there was removed.
func requireNoShmFiles(t *testing.T, dir string, keep ...string) {
	t.Helper()
	entries, err := os.ReadDir(dir)
	require.NoError(t, err)
	var left []string
	for _, e := range entries {
		if !contains(keep, e.Name()) {
			left = append(left, e.Name())
		}
	}
	require.Empty(t, left, "files left in the shm directory %s", dir)
}

func contains(list []string, s string) bool {
	for _, x := range list {
		if x == s {
			return true
		}
	}
	return false
}

// patternByte is byte i of message msg on the stream opened stream-th (from
// 0) of a session: the Rust client's pattern (interop/rust/src/lib.rs).
// 251 is prime, so a shifted or misplaced chunk does not match.
func patternByte(stream, msg, i uint64) byte {
	return byte((i*31 + i>>8 + stream*7 + msg*13) % 251)
}

func fillPattern(b []byte, stream, msg uint64) {
	for i := range b {
		b[i] = patternByte(stream, msg, uint64(i))
	}
}

// checkPattern checks b as the bytes of message msg from offset off.
func checkPattern(b []byte, stream, msg, off uint64) error {
	for i, c := range b {
		if want := patternByte(stream, msg, off+uint64(i)); c != want {
			return fmt.Errorf("message %d byte %d: got %#02x, want %#02x (from there: % x)",
				msg, off+uint64(i), c, want, b[i:min(len(b), i+16)])
		}
	}
	return nil
}

// sizeList formats sizes for the Rust binaries' --sizes.
func sizeList(sizes []int) string {
	s := make([]string, len(sizes))
	for i, n := range sizes {
		s[i] = strconv.Itoa(n)
	}
	return strings.Join(s, ",")
}

// total returns the bytes one stream sends: every size, rounds times.
func total(sizes []int, rounds int) int64 {
	var n int64
	for _, s := range sizes {
		n += int64(s)
	}
	return n * int64(rounds)
}

// fillTagged fills b with message msg of the stream opened stream-th in the
// tagged pattern that shmlink clients send (the Rust server checks it too,
// see tagged_byte in interop/rust/src/lib.rs): every aligned 8 bytes are
// stream (u16), msg (u16) and their offset (u32), little-endian, so bytes
// that arrive in the wrong place say where they belong.
func fillTagged(b []byte, stream, msg uint64) {
	var tag [8]byte
	binary.LittleEndian.PutUint16(tag[0:], uint16(stream))
	binary.LittleEndian.PutUint16(tag[2:], uint16(msg))
	for i := 0; i < len(b); i += 8 {
		binary.LittleEndian.PutUint32(tag[4:], uint32(i))
		copy(b[i:], tag[:])
	}
}

// checkTagged checks b as message msg of stream in the tagged pattern.
func checkTagged(b []byte, stream, msg uint64) error {
	want := make([]byte, len(b))
	fillTagged(want, stream, msg)
	i := 0
	for i < len(b) && b[i] == want[i] {
		i++
	}
	if i == len(b) {
		return nil
	}
	at := i &^ 7
	got, exp := b[at:min(len(b), at+8)], want[at:min(len(b), at+8)]
	bad := 0
	for j := i; j < len(b); j++ {
		if b[j] != want[j] {
			bad++
		}
	}
	where := ""
	if len(got) == 8 {
		where = fmt.Sprintf(" (a tag of stream %d message %d offset %d)", binary.LittleEndian.Uint16(got[0:]),
			binary.LittleEndian.Uint16(got[2:]), binary.LittleEndian.Uint32(got[4:]))
	}
	return fmt.Errorf("message %d (%d B) byte %d: got % x%s, want % x; %d bytes from there differ",
		msg, len(b), i, got, where, exp, bad)
}
