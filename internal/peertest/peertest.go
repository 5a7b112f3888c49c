// Package peertest runs the test binary as a peer process for shmlink's
// two-process tests and benchmarks, and holds the in-stream protocol they
// speak. It is test tooling: nothing outside tests imports it.
//
// A test starts a peer with Start (or builds its command with Cmd); the
// child finds its role in SHMLINK_PEER and its Params, as JSON, in
// SHMLINK_PEER_PARAMS, and TestMain hands over to it with Main (the
// pattern of go/src/internal/fuzz/worker_test.go). A peer reports on
// standard output, one line at a time ("ready <addr>"...), and ends when
// its standard input closes or it is killed.
package peertest

import (
	"bufio"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"os/exec"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// The environment of a peer process: its role and its Params.
const (
	roleEnv   = "SHMLINK_PEER"
	paramsEnv = "SHMLINK_PEER_PARAMS"
)

// Params configure a peer process; each role reads the fields it needs.
type Params struct {
	Network       string `json:",omitempty"` // "unix" or "tcp"
	Addr          string `json:",omitempty"` // to listen on, or to dial
	ShmDir        string `json:",omitempty"` // Config.ShmDir
	Memory        string `json:",omitempty"` // a shmlink.MemoryType's String; "" for MemoryAuto
	Mode          string `json:",omitempty"` // the role's variant
	Seed          uint64 `json:",omitempty"` // derives the traffic's patterns
	UpgradeSocket string `json:",omitempty"` // ListenConfig.UpgradeSocket
	Dir           string `json:",omitempty"` // a directory of the role's own
	CPUProfile    string `json:",omitempty"` // a file for the peer's CPU profile
	// Config holds fields of the role's shmlink.Config as a JSON object
	// (durations in nanoseconds), for roles that take one.
	Config json.RawMessage `json:",omitempty"`
}

// EmulatorEnv names the environment variable that, when set, names an
// emulator (qemu-aarch64-static) through which peers run the test binary:
// a binary of another architecture run under qemu-user without
// binfmt_misc cannot exec itself directly.
const EmulatorEnv = "SHMLINK_TEST_EMULATOR"

// Main runs the role the process was started in, if any, and exits with
// the code the role returns; roles maps role names to their functions.
// In the test process itself it returns at once. Call it first in
// TestMain.
func Main(roles map[string]func(Params) int) {
	role := os.Getenv(roleEnv)
	if role == "" {
		return
	}
	if role == hogRole {
		os.Exit(runHog())
	}
	var p Params
	if err := json.Unmarshal([]byte(os.Getenv(paramsEnv)), &p); err != nil {
		fmt.Fprintf(os.Stderr, "peer %s: bad %s: %v\n", role, paramsEnv, err)
		os.Exit(2)
	}
	run, ok := roles[role]
	if !ok {
		fmt.Fprintln(os.Stderr, "unknown peer role", role)
		os.Exit(2)
	}
	os.Exit(run(p))
}

// Cmd returns the command that runs the test binary as a peer in role with
// p, running no test nor benchmark of its own. The caller sets its
// standard streams and starts it.
func Cmd(role string, p Params) *exec.Cmd {
	js, err := json.Marshal(p)
	if err != nil {
		panic(err) // Params holds only strings, numbers and valid JSON
	}
	args := []string{os.Args[0], "-test.run=^$", "-test.bench=^$"}
	if em := os.Getenv(EmulatorEnv); em != "" {
		args = append([]string{em}, args...) // see EmulatorEnv
	}
	cmd := exec.Command(args[0], args[1:]...)
	cmd.Env = append(os.Environ(), roleEnv+"="+role, paramsEnv+"="+string(js))
	return cmd
}

// A Proc is a peer process started by Start.
type Proc struct {
	cmd    *exec.Cmd
	stdin  io.WriteCloser
	lines  chan string // standard output, line by line; closed at its end
	stderr strings.Builder
	waited bool
	err    error // of Wait
}

// Start starts the test binary as a peer in role with p. The test's end
// kills it if it still runs.
func Start(tb testing.TB, role string, p Params) *Proc {
	tb.Helper()
	pr := &Proc{cmd: Cmd(role, p), lines: make(chan string, 16)}
	pr.cmd.Stderr = &pr.stderr
	var err error
	pr.stdin, err = pr.cmd.StdinPipe()
	require.NoError(tb, err)
	stdout, err := pr.cmd.StdoutPipe()
	require.NoError(tb, err)
	require.NoError(tb, pr.cmd.Start())
	go func() {
		defer close(pr.lines)
		r := bufio.NewScanner(stdout)
		for r.Scan() {
			pr.lines <- r.Text()
		}
	}()
	tb.Cleanup(func() {
		if !pr.waited {
			pr.cmd.Process.Kill()
			pr.Wait()
		}
	})
	return pr
}

// Pid returns the peer's process id.
func (p *Proc) Pid() int { return p.cmd.Process.Pid }

// Signal sends sig to the peer.
func (p *Proc) Signal(sig syscall.Signal) error { return p.cmd.Process.Signal(sig) }

// Stderr returns what the peer wrote to its standard error so far; call
// it after Wait for all of it.
func (p *Proc) Stderr() string { return p.stderr.String() }

// Say writes line and a newline to the peer's standard input.
func (p *Proc) Say(line string) error {
	_, err := io.WriteString(p.stdin, line+"\n")
	return err
}

// CloseInput closes the peer's standard input, which asks it to end.
func (p *Proc) CloseInput() error { return p.stdin.Close() }

// Wait reaps the peer once its standard output is read to the end and
// returns its exit error.
func (p *Proc) Wait() error {
	if !p.waited {
		for range p.lines {
		}
		p.err = p.cmd.Wait()
		p.waited = true
	}
	return p.err
}

// Kill kills the peer with SIGKILL and reaps it.
func (p *Proc) Kill() {
	p.cmd.Process.Kill()
	p.Wait()
}

// Crash kills the peer with SIGKILL, as a crash would, and reaps it. It
// returns when the signal was sent (killed) and when the reaping returned
// (reaped). The kernel closes a dying process's descriptors (its sockets:
// what its peers see of the death) before its parent can reap it, so
// reaped bounds the moment its peers could know. The time from killed to
// there is the kernel's (it tears down the address space first, which
// takes long for a large one on a busy host), not the peers'. The peer
// must have died of the signal, with nothing on its standard error before.
func (p *Proc) Crash(tb testing.TB) (killed, reaped time.Time) {
	tb.Helper()
	killed = time.Now()
	require.NoError(tb, p.cmd.Process.Signal(syscall.SIGKILL))
	err := p.Wait()
	reaped = time.Now()
	var ee *exec.ExitError
	require.ErrorAs(tb, err, &ee)
	ws, ok := ee.Sys().(syscall.WaitStatus)
	require.True(tb, ok && ws.Signaled() && ws.Signal() == syscall.SIGKILL, "peer exit: %v; stderr: %s", err, p.Stderr())
	require.Empty(tb, p.Stderr(), "peer stderr before the kill")
	return killed, reaped
}

// NextLine waits for the peer's next line of output; ok is false when the
// output ended (the peer exited).
func (p *Proc) NextLine() (line string, ok bool) {
	line, ok = <-p.lines
	return line, ok
}

// Stop closes the peer's standard input and requires that it exits 0 with
// nothing on its standard error.
func (p *Proc) Stop(tb testing.TB) {
	tb.Helper()
	p.CloseInput()
	require.NoError(tb, p.Wait(), "peer exit; stderr: %s", p.Stderr())
	require.Empty(tb, p.Stderr(), "peer stderr")
}

// Expect waits up to 30 s for the peer's next line of output and requires
// it to start with prefix; it returns the rest of the line, trimmed.
func (p *Proc) Expect(tb testing.TB, prefix string) string {
	tb.Helper()
	select {
	case line, ok := <-p.lines:
		if ok && strings.HasPrefix(line, prefix) {
			return strings.TrimSpace(strings.TrimPrefix(line, prefix))
		}
		p.Kill()
		tb.Fatalf("peer said %q (output ended: %v), want %q; exit: %v; stderr: %s", line, !ok, prefix, p.err, p.Stderr())
	case <-time.After(30 * time.Second):
		p.Kill()
		tb.Fatalf("peer did not say %q in 30 s; stderr: %s", prefix, p.Stderr())
	}
	return ""
}
