package shmlink_test

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/shmlink/shmlink"
	"github.com/shmlink/shmlink/internal/peertest"
)

// smallTmpfsSize is the size in bytes of the tmpfs that the "small-tmpfs"
// role mounts: room for one session with a 2 MiB region, not for two.
const smallTmpfsSize = 4 << 20

// runSmallTmpfs is the "small-tmpfs" role. It runs in a mount namespace of
// its own (TestFileRegionFullTmpfs), mounts a tmpfs of smallTmpfsSize bytes
// on p.ShmDir, as a container's small /dev/shm, and there runs a server and
// clients with file-backed regions. It prints "ok <step>" after each check
// and exits 0, or prints what failed on standard error and exits 1.
func runSmallTmpfs(p peertest.Params) int {
	fail := func(format string, args ...any) int {
		fmt.Fprintf(os.Stderr, "small-tmpfs: "+format+"\n", args...)
		return 1
	}
	if err := unix.Mount("tmpfs", p.ShmDir, "tmpfs", unix.MS_NOSUID|unix.MS_NODEV, fmt.Sprintf("size=%d,mode=0700", smallTmpfsSize)); err != nil {
		return fail("mount: %v", err)
	}
	empty := func() error {
		names, err := os.ReadDir(p.ShmDir)
		if err != nil {
			return err
		}
		if len(names) > 0 {
			return fmt.Errorf("%d files left in the tmpfs, %s first", len(names), names[0].Name())
		}
		return nil
	}
	// serve starts a server with its ShmDir in the tmpfs.
	lc := shmlink.ListenConfig{Config: &shmlink.Config{ShmDir: p.ShmDir}}
	serve := func(network, addr string) (*shmlink.Listener, error) {
		ln, err := lc.Listen(context.Background(), network, addr)
		if err != nil {
			return nil, err
		}
		peertest.ServeEach(ln, func(c net.Conn) { peertest.ServeStream(c) })
		return ln, nil
	}
	ln, err := serve("unix", p.Addr)
	if err != nil {
		return fail("listen: %v", err)
	}
	defer ln.Close()

	// dial opens a stream with a file-backed region of size bytes, on a
	// Dialer that wants a session per stream (the "grow" step).
	dial := func(network, addr string, size int) (*shmlink.Dialer, net.Conn, error) {
		d := &shmlink.Dialer{StreamsPerSession: 1, Config: &shmlink.Config{
			MemoryType: shmlink.MemoryFile, ShmDir: p.ShmDir, BufferSize: size,
		}}
		c, err := d.Dial(network, addr)
		if err != nil {
			d.Close()
			return nil, nil, err
		}
		return d, c, nil
	}
	// refused checks that a dial with a region larger than the room left
	// fails with ENOSPC, and leaves no file behind.
	refused := func(network, addr string, size int) error {
		d, c, err := dial(network, addr, size)
		if err == nil {
			c.Close()
			d.Close()
			return fmt.Errorf("a region of %d bytes: dial succeeded", size)
		}
		if !errors.Is(err, syscall.ENOSPC) {
			return fmt.Errorf("a region of %d bytes: %w, not ENOSPC", size, err)
		}
		return empty()
	}
	// echo echoes 6 MiB, three times the regions that fit, so that every
	// slice is written; start asks the server to echo first.
	echo := func(c net.Conn, seed uint64, start bool) error {
		c.SetDeadline(time.Now().Add(20 * time.Second))
		if start {
			if _, err := c.Write(peertest.Command(peertest.CmdEcho, 0)); err != nil {
				return fmt.Errorf("echo command: %w", err)
			}
		}
		return peertest.Echo(c, 6<<20, seed)
	}

	if err := refused("unix", p.Addr, 2*smallTmpfsSize); err != nil {
		return fail("%v", err)
	}
	fmt.Println("ok too-large")

	d1, c1, err := dial("unix", p.Addr, 2<<20)
	if err != nil {
		return fail("a region of 2 MiB: %v", err)
	}
	defer d1.Close()
	if err := echo(c1, 1, true); err != nil {
		return fail("echo in the region that fits: %v", err)
	}
	fmt.Println("ok fits")

	if err := refused("unix", p.Addr, 2<<20); err != nil {
		return fail("second session: %v", err)
	}
	if err := echo(c1, 2, false); err != nil {
		return fail("echo after the second session was refused: %v", err)
	}
	fmt.Println("ok second")

	// A Dialer that wants a session per stream keeps the stream on the
	// session it has when the next one does not fit.
	c3, err := d1.Dial("unix", p.Addr)
	if err != nil {
		return fail("a second stream while the tmpfs is full: %v", err)
	}
	if n := d1.NumSessions(); n != 1 {
		return fail("%d sessions after a second one did not fit, want 1", n)
	}
	if err := echo(c3, 3, true); err != nil {
		return fail("echo on the second stream: %v", err)
	}
	if err := empty(); err != nil {
		return fail("%v", err)
	}
	c3.Close()
	fmt.Println("ok grow")

	tl, err := serve("tcp", "127.0.0.1:0")
	if err != nil {
		return fail("listen tcp: %v", err)
	}
	defer tl.Close()
	if err := refused("tcp", tl.Addr().String(), 2<<20); err != nil {
		return fail("tcp: %v", err)
	}
	fmt.Println("ok tcp")

	// Once both sides of the first session have unmapped its region, the
	// tmpfs has room for another. CloseSessions returns after the
	// server's sessions have ended, and closes its listener.
	c1.Close()
	d1.Close()
	ln.CloseSessions()
	ln2, err := serve("unix", p.Addr+"2")
	if err != nil {
		return fail("listen: %v", err)
	}
	defer ln2.Close()
	d2, c2, err := dial("unix", p.Addr+"2", 2<<20)
	if err != nil {
		return fail("a region of 2 MiB after the first session ended: %v", err)
	}
	defer d2.Close()
	if err := echo(c2, 4, true); err != nil {
		return fail("echo in the second region: %v", err)
	}
	fmt.Println("ok again")
	return 0
}

// A client whose file-backed region does not fit in ShmDir's tmpfs gets
// an error wrapping ENOSPC from Dial, leaves no file behind and lives on;
// before, formatting the region faulted on a page the tmpfs had no room
// for (SIGBUS), which killed the process and left the files in ShmDir
// (docs/protocol.md section 13). The client runs in a child process with a
// mount namespace of its own, in which it mounts a small tmpfs.
func TestFileRegionFullTmpfs(t *testing.T) {
	dir := t.TempDir()
	shmDir := dir + "/shm"
	require.NoError(t, os.Mkdir(shmDir, 0o700))
	cmd := peertest.Cmd("small-tmpfs", peertest.Params{Addr: dir + "/s.sock", ShmDir: shmDir})
	// Go makes the new mount namespace's mounts private, so the tmpfs
	// is never seen outside the child.
	cmd.SysProcAttr = &syscall.SysProcAttr{Unshareflags: syscall.CLONE_NEWNS}
	if os.Geteuid() != 0 {
		// A user namespace in which the child is root may mount a tmpfs.
		cmd.SysProcAttr.Cloneflags = syscall.CLONE_NEWUSER
		cmd.SysProcAttr.UidMappings = []syscall.SysProcIDMap{{ContainerID: 0, HostID: os.Geteuid(), Size: 1}}
		cmd.SysProcAttr.GidMappings = []syscall.SysProcIDMap{{ContainerID: 0, HostID: os.Getegid(), Size: 1}}
	}
	var out, stderr strings.Builder
	cmd.Stdout, cmd.Stderr = &out, &stderr
	if err := cmd.Start(); err != nil {
		if errors.Is(err, syscall.EPERM) || errors.Is(err, syscall.EINVAL) {
			t.Skipf("needs root or unprivileged user namespaces to mount a tmpfs: %v", err)
		}
		t.Fatal(err)
	}
	kill := time.AfterFunc(time.Minute, func() { cmd.Process.Kill() })
	err := cmd.Wait()
	kill.Stop()
	require.NoError(t, err, "stdout:\n%s\nstderr:\n%s", out.String(), stderr.String())
	require.Equal(t, "ok too-large\nok fits\nok second\nok grow\nok tcp\nok again\n", out.String())
	entries, err := os.ReadDir(shmDir)
	require.NoError(t, err)
	require.Empty(t, entries, "the tmpfs was seen outside the child")
}
