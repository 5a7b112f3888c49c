package shmlink_test

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/shmlink/shmlink"
	"github.com/shmlink/shmlink/internal/peertest"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"
)

// acceptRetryLog is how the "emfile-server" role's log reports a retry.
const acceptRetryLog = `level=WARN msg="shmlink: accept failed, retrying"`

// runEMFILEServer is the "emfile-server" role: it listens on p.Addr, logs
// warnings to standard output (no time), prints "ready <addr>", opens
// files until it has no descriptor left and prints "full", waits for a
// line on standard input, closes those files, and serves streams with
// peertest.ServeStream until standard input closes.
func runEMFILEServer(p peertest.Params) int {
	fail := func(err error) int {
		fmt.Fprintln(os.Stderr, "emfile-server:", err)
		return 1
	}
	noTime := func(_ []string, a slog.Attr) slog.Attr {
		if a.Key == slog.TimeKey {
			return slog.Attr{}
		}
		return a
	}
	log := slog.New(slog.NewTextHandler(os.Stdout, &slog.HandlerOptions{Level: slog.LevelWarn, ReplaceAttr: noTime}))
	lc := shmlink.ListenConfig{Config: &shmlink.Config{ShmDir: p.ShmDir, Logger: log}}
	ln, err := lc.Listen(context.Background(), "unix", p.Addr)
	if err != nil {
		return fail(err)
	}
	defer ln.Close()
	fmt.Printf("ready %s\n", ln.Addr())
	if err := unix.Setrlimit(unix.RLIMIT_NOFILE, &unix.Rlimit{Cur: 128, Max: 128}); err != nil {
		return fail(err)
	}
	var hoard []*os.File
	for {
		f, err := os.Open(os.DevNull)
		if err != nil {
			break
		}
		hoard = append(hoard, f)
	}
	fmt.Println("full")
	in := bufio.NewReader(os.Stdin)
	if _, err := in.ReadString('\n'); err != nil {
		return fail(err)
	}
	for _, f := range hoard {
		f.Close()
	}
	go func() {
		in.WriteTo(io.Discard) // until standard input closes
		ln.CloseSessions()
	}()
	peertest.ServeEach(ln, func(c net.Conn) { peertest.ServeStream(c) })()
	return 0
}

// A listener whose process ran out of descriptors keeps accepting once it
// has them again (#14): Accept's EMFILE is retried with backoff and
// logged, not the end of the listener.
func TestAcceptRetriesEMFILE(t *testing.T) {
	dir := t.TempDir()
	proc := peertest.Start(t, "emfile-server", peertest.Params{Addr: filepath.Join(dir, "s.sock"), ShmDir: dir})
	addr := proc.Expect(t, "ready ")
	// The listener's first Accept may come only once the files took every
	// descriptor (it runs on a goroutine of its own), and fail then: its
	// retries may be logged before "full".
	for line := proc.Expect(t, ""); line != "full"; line = proc.Expect(t, "") {
		require.True(t, strings.HasPrefix(line, acceptRetryLog), "the peer said %q before \"full\"", line)
	}
	d := &shmlink.Dialer{Config: &shmlink.Config{ShmDir: dir, HandshakeTimeout: 30 * time.Second}}
	defer d.Close()
	dialed := make(chan net.Conn, 1)
	failed := make(chan error, 1)
	go func() {
		c, err := d.Dial("unix", addr)
		if err != nil {
			failed <- err
			return
		}
		dialed <- c
	}()
	// The connection waits in the backlog while Accept fails with EMFILE.
	proc.Expect(t, acceptRetryLog)
	require.NoError(t, proc.Say("free"))
	var c net.Conn
	select {
	case c = <-dialed:
	case err := <-failed:
		t.Fatalf("dial after the descriptors were freed: %v", err)
	}
	_, err := c.Write(peertest.Command(peertest.CmdEcho, 0))
	require.NoError(t, err)
	require.NoError(t, peertest.Echo(c, 100<<10, 1))
	require.NoError(t, c.Close())
	proc.Stop(t)
}
