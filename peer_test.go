package shmlink_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"sync/atomic"
	"testing"

	"github.com/shmlink/shmlink"
	"github.com/shmlink/shmlink/internal/peertest"
)

func TestMain(m *testing.M) {
	peertest.Main(map[string]func(peertest.Params) int{
		"server":         runServer,
		"client":         runPeerClient,
		"upgrade-server": runUpgradeServer,
		"bench":          runBenchServer,
		"emfile-server":  runEMFILEServer,
		"small-tmpfs":    runSmallTmpfs,
	})
	code := m.Run()
	stopBenchServer()
	os.Exit(code)
}

// runServer is the "server" role: it listens on p.Network and p.Addr with
// its shared memory in p.ShmDir, prints "ready <addr>", serves streams with
// peertest.ServeStream until standard input closes, then ends the
// listener and its sessions (CloseSessions), prints "closed", and exits 0
// (1 on any error). p.Config, if set, holds the fields of its Config beside ShmDir.
// On the "quic" network it serves with the TLS material in p.Dir
// (peertest.WriteTLS), requiring client certificates in Mode "mtls".
func runServer(p peertest.Params) int {
	var cfg shmlink.Config
	if len(p.Config) > 0 {
		if err := json.Unmarshal(p.Config, &cfg); err != nil {
			fmt.Fprintln(os.Stderr, "config:", err)
			return 1
		}
	}
	cfg.ShmDir = p.ShmDir
	lc := shmlink.ListenConfig{Config: &cfg}
	if p.Network == "quic" { // TLS material from WriteTLS in p.Dir
		var err error
		if lc.TLSConfig, _, err = peertest.LoadTLS(p.Dir, p.Mode == "mtls"); err != nil {
			fmt.Fprintln(os.Stderr, "tls:", err)
			return 1
		}
	}
	ln, err := lc.Listen(context.Background(), p.Network, p.Addr)
	if err != nil {
		fmt.Fprintln(os.Stderr, "listen:", err)
		return 1
	}
	fmt.Printf("ready %s\n", ln.Addr())
	var failed atomic.Bool
	wait := peertest.ServeEach(ln, func(c net.Conn) {
		if err := peertest.ServeStream(c); err != nil && !errors.Is(err, net.ErrClosed) && !failed.Swap(true) {
			fmt.Fprintln(os.Stderr, "serve:", err)
		}
	})
	io.Copy(io.Discard, os.Stdin)
	ln.CloseSessions()
	fmt.Println("closed") // its sessions ended
	wait()
	if failed.Load() {
		return 1
	}
	return 0
}

// serveStreams serves streams on ln with peertest.ServeStream until it is
// closed; wait waits for every stream.
func serveStreams(ln net.Listener) (wait func()) {
	return peertest.ServeEach(ln, func(c net.Conn) { peertest.ServeStream(c) })
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

// startPeer starts the test binary as a server ("server" role) listening
// on tr.network, and stops it, checking its exit, when the test ends.
func startPeer(t *testing.T, tr transport) *peer {
	t.Helper()
	dir := t.TempDir()
	addr := "127.0.0.1:0"
	if tr.network == "unix" {
		addr = dir + "/s.sock"
	}
	proc := peertest.Start(t, "server", peertest.Params{Network: tr.network, Addr: addr, ShmDir: dir})
	got := proc.Expect(t, "ready ")
	t.Cleanup(func() { proc.Stop(t) })
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
