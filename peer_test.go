package shmlink_test

import (
	"bufio"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"strings"
	"sync"
	"testing"

	"github.com/shmlink/shmlink"
	"github.com/stretchr/testify/require"
)

// The test binary re-executes itself as the peer process when this
// variable names a role (the pattern of go/src/internal/fuzz/worker_test.go).
const peerEnv = "SHMLINK_TEST_PEER"

func TestMain(m *testing.M) {
	if role := os.Getenv(peerEnv); role != "" {
		os.Exit(runPeer(role))
	}
	code := m.Run()
	stopBenchServer()
	os.Exit(code)
}

// Stream commands of the test server: the first 9 bytes of every stream are
// a command byte and a big-endian u64 argument.
const (
	cmdEcho     = 'E' // echo every byte until EOF, then close
	cmdGenerate = 'G' // write arg bytes of pattern(arg), then close
)

// pattern fills b with a sequence that depends on seed and position, so that
// bytes of another stream or at another offset are caught.
func pattern(b []byte, seed uint64, off int) {
	for i := range b {
		x := uint64(off+i)*0x9E3779B97F4A7C15 + seed
		b[i] = byte(x >> 56)
	}
}

// checkPattern returns the first offset at which b differs from pattern.
func checkPattern(b []byte, seed uint64, off int) error {
	for i, got := range b {
		x := uint64(off+i)*0x9E3779B97F4A7C15 + seed
		if want := byte(x >> 56); got != want {
			return fmt.Errorf("byte %d: got %#x want %#x", off+i, got, want)
		}
	}
	return nil
}

// runPeer runs a peer role. "client" is runPeerClient (peerdeath_test.go);
// "upgrade-server" is runUpgradeServer (upgrade_test.go);
// "server" listens as the environment says, prints "ready <addr>", serves
// streams until standard input closes, then closes the listener and exits
// 0 (1 on any error).
func runPeer(role string) int {
	switch role {
	case "client":
		return runPeerClient(os.Getenv(peerClientEnv))
	case "bench":
		return runBenchServer()
	case "upgrade-server":
		return runUpgradeServer()
	case "server":
	default:
		fmt.Fprintln(os.Stderr, "unknown role", role)
		return 2
	}
	cfg := &shmlink.Config{ShmDir: os.Getenv("SHMLINK_TEST_SHMDIR")}
	lc := shmlink.ListenConfig{Config: cfg}
	ln, err := lc.Listen(context.Background(), os.Getenv("SHMLINK_TEST_NET"), os.Getenv("SHMLINK_TEST_ADDR"))
	if err != nil {
		fmt.Fprintln(os.Stderr, "listen:", err)
		return 1
	}
	fmt.Printf("ready %s\n", ln.Addr())
	var wg sync.WaitGroup
	var failed sync.Once
	code := 0
	go func() {
		io.Copy(io.Discard, os.Stdin)
		ln.Close()
	}()
	for {
		conn, err := ln.Accept()
		if err != nil {
			if !errors.Is(err, net.ErrClosed) {
				fmt.Fprintln(os.Stderr, "accept:", err)
				code = 1
			}
			break
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			defer conn.Close()
			if err := serveStream(conn); err != nil && !errors.Is(err, net.ErrClosed) {
				failed.Do(func() { fmt.Fprintln(os.Stderr, "serve:", err) })
			}
		}()
	}
	wg.Wait()
	return code
}

// serveEach accepts streams on ln until it is closed and runs handle on
// each in a goroutine of its own, closing the stream after; wait waits for
// the accept loop and every handler.
func serveEach(ln net.Listener, handle func(net.Conn)) (wait func()) {
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			wg.Add(1)
			go func() {
				defer wg.Done()
				defer c.Close()
				handle(c)
			}()
		}
	}()
	return wg.Wait
}

// serveStreams is serveEach with serveStream as the handler.
func serveStreams(ln net.Listener) (wait func()) {
	return serveEach(ln, func(c net.Conn) { serveStream(c) })
}

func serveStream(conn net.Conn) error {
	var hdr [9]byte
	if _, err := io.ReadFull(conn, hdr[:]); err != nil {
		return fmt.Errorf("read command: %w", err)
	}
	arg := binary.BigEndian.Uint64(hdr[1:])
	switch hdr[0] {
	case cmdEcho:
		_, err := io.Copy(conn, conn)
		return err
	case cmdGenerate:
		buf := make([]byte, 64<<10)
		for off := 0; off < int(arg); off += len(buf) {
			b := buf[:min(len(buf), int(arg)-off)]
			pattern(b, arg, off)
			if _, err := conn.Write(b); err != nil {
				return err
			}
		}
		return nil
	}
	return fmt.Errorf("unknown command %q", hdr[0])
}

// transport is one way of running a session: network and memory type.
type transport struct {
	name    string
	network string
	memory  shmlink.MemoryType
}

var transports = []transport{
	{"unix-memfd", "unix", shmlink.MemoryMemfd},
	{"unix-file", "unix", shmlink.MemoryFile},
	{"tcp-file", "tcp", shmlink.MemoryFile},
}

// peer is a server process started by startPeer.
type peer struct {
	addr   string
	shmDir string
}

// startPeer starts the test binary as a server listening on tr.network and
// stops it (checking its exit status) when the test ends.
func startPeer(t *testing.T, tr transport) *peer {
	t.Helper()
	dir := t.TempDir()
	addr := "127.0.0.1:0"
	if tr.network == "unix" {
		addr = dir + "/s.sock"
	}
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), peerEnv+"=server", "SHMLINK_TEST_NET="+tr.network,
		"SHMLINK_TEST_ADDR="+addr, "SHMLINK_TEST_SHMDIR="+dir)
	stdin, err := cmd.StdinPipe()
	require.NoError(t, err)
	stdout, err := cmd.StdoutPipe()
	require.NoError(t, err)
	var stderr strings.Builder
	cmd.Stderr = &stderr
	require.NoError(t, cmd.Start())
	line, err := bufio.NewReader(stdout).ReadString('\n')
	if err != nil {
		cmd.Process.Kill()
		cmd.Wait()
		t.Fatalf("peer did not start: %v; stderr: %s", err, stderr.String())
	}
	var got string
	_, err = fmt.Sscanf(line, "ready %s", &got)
	require.NoError(t, err, "peer said %q", line)
	t.Cleanup(func() {
		stdin.Close()
		err := cmd.Wait()
		require.NoError(t, err, "peer exit; stderr: %s", stderr.String())
		require.Empty(t, stderr.String(), "peer stderr")
	})
	return &peer{addr: got, shmDir: dir}
}

// dialer returns a Dialer for p over tr, closed when the test ends.
func (p *peer) dialer(t *testing.T, tr transport, cfg shmlink.Config) *shmlink.Dialer {
	cfg.MemoryType = tr.memory
	cfg.ShmDir = p.shmDir
	d := &shmlink.Dialer{Config: &cfg}
	t.Cleanup(func() { d.Close() })
	return d
}
