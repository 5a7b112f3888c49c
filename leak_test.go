package shmlink_test

import (
	"context"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/shmlink/shmlink"
	"github.com/shmlink/shmlink/internal/peertest"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// resources counts what a process can leak: goroutines, open descriptors
// and files in the shared-memory directories named by this process's pid.
type resources struct {
	goroutines int
	fds        int
	shmFiles   []string
}

func snapshot(t require.TestingT, dirs ...string) resources {
	fds, err := os.ReadDir("/proc/self/fd")
	require.NoError(t, err)
	r := resources{goroutines: runtime.NumGoroutine(), fds: len(fds)}
	prefix := fmt.Sprintf("shmlink_%d_", os.Getpid())
	for _, dir := range append(dirs, "/dev/shm") {
		entries, _ := os.ReadDir(dir)
		for _, e := range entries {
			if strings.HasPrefix(e.Name(), prefix) {
				r.shmFiles = append(r.shmFiles, filepath.Join(dir, e.Name()))
			}
		}
	}
	return r
}

// requireNoLeaks waits until goroutines and descriptors are back to base
// and no shared-memory file of this process is left (see requireBackTo).
func requireNoLeaks(t *testing.T, base resources, dirs ...string) {
	t.Helper()
	requireBackTo(t, base, nil, dirs...)
}

// requireBackTo waits until goroutines, descriptors and shared-memory
// files of this process are back to base and every assertion of extra (if
// not nil) holds. Sessions end asynchronously (and the runtime's own
// goroutines settle), so it polls for up to 10 s; it never passes on time
// alone. On failure it prints every goroutine's stack.
func requireBackTo(t *testing.T, base resources, extra func(c *assert.CollectT), dirs ...string) {
	t.Helper()
	ok := assert.EventuallyWithT(t, func(c *assert.CollectT) {
		now := snapshot(c, dirs...)
		// This condition runs on a goroutine of its own.
		assert.LessOrEqual(c, now.goroutines-1, base.goroutines, "goroutines")
		assert.LessOrEqual(c, now.fds, base.fds, "descriptors")
		assert.LessOrEqual(c, len(now.shmFiles), len(base.shmFiles), "shared-memory files: %v", now.shmFiles)
		if extra != nil {
			extra(c)
		}
	}, 10*time.Second, time.Millisecond)
	if !ok {
		buf := make([]byte, 1<<20)
		t.Fatalf("leak; descriptors: %v\ngoroutines:\n%s", openFiles(), buf[:runtime.Stack(buf, true)])
	}
}

// Both sides in one process, so that the checks see both: after Close on
// both sides no goroutine, descriptor or shared-memory file is left.
func TestCloseLeavesNothing(t *testing.T) {
	for _, tr := range transports {
		t.Run(tr.name, func(t *testing.T) {
			dir := t.TempDir()
			addr := "127.0.0.1:0"
			if tr.network == "unix" {
				addr = filepath.Join(dir, "s.sock")
			}
			base := snapshot(t, dir)
			cfg := &shmlink.Config{ShmDir: dir, MemoryType: tr.memory}
			lc := shmlink.ListenConfig{Config: cfg}
			ln, err := lc.Listen(context.Background(), tr.network, addr)
			require.NoError(t, err)
			wait := serveStreams(ln)
			d := &shmlink.Dialer{Config: cfg}
			for i, n := range []int{10, 200 << 10, 2 << 20} {
				c, err := d.Dial(tr.network, ln.Addr().String())
				require.NoError(t, err)
				command(t, c, peertest.CmdEcho, 0)
				require.NoError(t, peertest.Echo(c, n, uint64(i)))
				require.NoError(t, c.Close())
			}
			// A stream left open is closed by the Dialer's Close.
			c, err := d.Dial(tr.network, ln.Addr().String())
			require.NoError(t, err)
			command(t, c, peertest.CmdEcho, 0)
			require.NoError(t, d.Close())
			_, err = c.Write([]byte("x"))
			require.ErrorIs(t, err, net.ErrClosed)
			require.NoError(t, ln.Close())
			wait()
			requireNoLeaks(t, base, dir)
		})
	}
}

// A package-level Dial owns its session: closing the stream ends it.
func TestDialOwnsSession(t *testing.T) {
	dir := t.TempDir()
	ln, err := shmlink.Listen("unix", filepath.Join(dir, "s.sock"))
	require.NoError(t, err)
	serveStreams(ln)
	base := snapshot(t)
	c, err := shmlink.Dial("unix", ln.Addr().String())
	require.NoError(t, err)
	command(t, c, peertest.CmdEcho, 0)
	require.NoError(t, peertest.Echo(c, 70000, 7))
	require.NoError(t, c.Close())
	requireNoLeaks(t, base)
	require.NoError(t, ln.Close())
}

// openFiles names what each open descriptor of this process refers to,
// for failure messages.
func openFiles() []string {
	entries, _ := os.ReadDir("/proc/self/fd")
	var names []string
	for _, e := range entries {
		target, _ := os.Readlink(filepath.Join("/proc/self/fd", e.Name()))
		names = append(names, e.Name()+"="+target)
	}
	return names
}
