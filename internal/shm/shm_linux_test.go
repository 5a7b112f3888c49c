//go:build linux

package shm

import (
	"errors"
	"io/fs"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"
)

func cloexec(t *testing.T, fd int) bool {
	flags, err := unix.FcntlInt(uintptr(fd), unix.F_GETFD, 0)
	require.NoError(t, err)
	return flags&unix.FD_CLOEXEC != 0
}

func TestCreateMemfd(t *testing.T) {
	f, err := CreateMemfd("shmlink-test", 1<<20)
	require.NoError(t, err)
	defer f.Close()
	fd := int(f.Fd())
	require.True(t, cloexec(t, fd))
	size, err := Size(fd)
	require.NoError(t, err)
	require.Equal(t, 1<<20, size)
	// Sealed: nobody holding the fd can shrink it under a mapping.
	require.Error(t, unix.Ftruncate(fd, 4096))
	mem, err := Map(fd, 1<<20)
	require.NoError(t, err)
	mem[len(mem)-1] = 7
	require.NoError(t, Unmap(mem))
	_, err = Map(fd, 4096)
	require.ErrorIs(t, err, ErrBadSize)
	_, err = CreateMemfd("x", 0)
	require.ErrorIs(t, err, ErrBadSize)
}

func TestCreateFile(t *testing.T) {
	p := filepath.Join(t.TempDir(), "region")
	f, err := CreateFile(p, 8192)
	require.NoError(t, err)
	defer f.Close()
	fi, err := os.Stat(p)
	require.NoError(t, err)
	require.Equal(t, os.FileMode(0o600), fi.Mode().Perm())
	require.EqualValues(t, 8192, fi.Size())
	require.True(t, cloexec(t, int(f.Fd())))
	_, err = CreateFile(p, 8192)
	require.ErrorIs(t, err, fs.ErrExist, "O_EXCL: an existing path is never reused")

	g, err := OpenFile(p, os.Geteuid())
	require.NoError(t, err)
	require.True(t, cloexec(t, int(g.Fd())))
	g.Close()
	link := p + ".link"
	require.NoError(t, os.Symlink(p, link))
	_, err = OpenFile(link, -1)
	require.Error(t, err, "symlinks are not followed")
	_, err = OpenFile(t.TempDir(), -1)
	require.Error(t, err)
	_, err = OpenFile("/dev/null", -1)
	require.ErrorIs(t, err, ErrNotRegular)
}

// CreateFile allocates a file's blocks, so that a write into a mapping of
// it cannot find its tmpfs full and fault (SIGBUS). /dev/shm is the
// default ShmDir, and tmpfs supports fallocate.
func TestCreateFileAllocates(t *testing.T) {
	dir, err := os.MkdirTemp("/dev/shm", "shmlink-test-")
	require.NoError(t, err)
	defer os.RemoveAll(dir)
	p := filepath.Join(dir, "region")
	f, err := CreateFile(p, 1<<20)
	require.NoError(t, err)
	defer f.Close()
	var st unix.Stat_t
	require.NoError(t, unix.Fstat(int(f.Fd()), &st))
	require.EqualValues(t, 1<<20, st.Size)
	require.GreaterOrEqual(t, st.Blocks*512, int64(1<<20), "blocks allocated")
}

// RemoveStale removes the file of a closed owner and keeps that of an open
// one; a path with no file is nothing to remove.
func TestRemoveStale(t *testing.T) {
	dir := t.TempDir()
	live, dead := filepath.Join(dir, "live"), filepath.Join(dir, "dead")
	f, err := CreateFile(live, 4096)
	require.NoError(t, err)
	defer f.Close()
	g, err := CreateFile(dead, 4096)
	require.NoError(t, err)
	require.NoError(t, g.Close())

	require.False(t, RemoveStale(live), "its owner holds it open")
	_, err = os.Stat(live)
	require.NoError(t, err)
	require.True(t, RemoveStale(dead))
	_, err = os.Stat(dead)
	require.ErrorIs(t, err, fs.ErrNotExist)
	require.False(t, RemoveStale(dead), "nothing left to remove")
	require.False(t, RemoveStale(filepath.Join(dir, "never")))
}

// A sweep of stale files that runs while files are being created never
// removes one: CreateFile holds its lock from the file's first moment, and
// a file swept in the instant before that lock is created again. Before,
// the lock came after the file was sized, and sweeps by concurrent dials
// removed files being created (docs/protocol.md section 9, "Files of dead
// clients").
func TestCreateFileBesideRemoveStale(t *testing.T) {
	dir, err := os.MkdirTemp("/dev/shm", "shmlink-test-")
	require.NoError(t, err)
	defer os.RemoveAll(dir)
	done := make(chan struct{})
	var swept atomic.Int64
	var wg sync.WaitGroup
	for range 2 { // the sweepers: other dials' removeStale
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				select {
				case <-done:
					return
				default:
				}
				entries, _ := os.ReadDir(dir)
				for _, e := range entries {
					if RemoveStale(filepath.Join(dir, e.Name())) {
						swept.Add(1)
					}
				}
			}
		}()
	}
	stop := sync.OnceFunc(func() { close(done); wg.Wait() })
	defer stop()
	for i := range 300 {
		p := filepath.Join(dir, "f"+strconv.Itoa(i))
		f, err := CreateFile(p, 256<<10)
		require.NoError(t, err)
		var opened, named unix.Stat_t
		require.NoError(t, unix.Fstat(int(f.Fd()), &opened))
		require.NoError(t, unix.Lstat(p, &named), "file %d was removed while it was created", i)
		require.NoError(t, checkSame(&opened, &named))
		require.EqualValues(t, 1, opened.Nlink)
		require.EqualValues(t, 256<<10, opened.Size)
		// Closed, the file is stale, and the sweepers must find it so.
		require.NoError(t, f.Close())
	}
	stop()
	for i := range 300 {
		RemoveStale(filepath.Join(dir, "f"+strconv.Itoa(i))) // what the sweepers left
	}
	entries, err := os.ReadDir(dir)
	require.NoError(t, err)
	require.Empty(t, entries)
	require.Positive(t, swept.Load(), "the sweepers removed closed files")
}

// CheckMemfd takes memfds and tmpfs files, and refuses other files and
// anything that is not a regular file.
func TestCheckMemfd(t *testing.T) {
	m, err := CreateMemfd("shmlink-test", 4096)
	require.NoError(t, err)
	defer m.Close()
	require.NoError(t, CheckMemfd(int(m.Fd())))

	dir, err := os.MkdirTemp("/dev/shm", "shmlink-test-")
	require.NoError(t, err)
	defer os.RemoveAll(dir)
	f, err := CreateFile(filepath.Join(dir, "region"), 4096)
	require.NoError(t, err)
	defer f.Close()
	require.NoError(t, CheckMemfd(int(f.Fd())))

	r, w, err := os.Pipe()
	require.NoError(t, err)
	defer r.Close()
	defer w.Close()
	require.ErrorIs(t, CheckMemfd(int(r.Fd())), ErrNotShared)

	// The package's directory, in the checkout: a disk's file system,
	// unless the checkout is on tmpfs.
	d, err := os.CreateTemp(".", "disk-")
	require.NoError(t, err)
	os.Remove(d.Name())
	defer d.Close()
	var fs unix.Statfs_t
	require.NoError(t, unix.Fstatfs(int(d.Fd()), &fs))
	if fs.Type != unix.TMPFS_MAGIC {
		require.ErrorIs(t, CheckMemfd(int(d.Fd())), ErrNotShared)
	}
}

func TestSendRecvFds(t *testing.T) {
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	require.NoError(t, err)
	conns := make([]*net.UnixConn, 2)
	for i, fd := range fds {
		f := os.NewFile(uintptr(fd), "sp")
		c, err := net.FileConn(f)
		f.Close()
		require.NoError(t, err)
		defer c.Close()
		conns[i] = c.(*net.UnixConn)
	}
	a, err := CreateMemfd("a", 4096)
	require.NoError(t, err)
	defer a.Close()
	b, err := CreateMemfd("b", 8192)
	require.NoError(t, err)
	defer b.Close()

	require.NoError(t, SendFds(conns[0], int(a.Fd()), int(b.Fd())))
	got, err := RecvFds(conns[1], 2)
	require.NoError(t, err)
	for i, want := range []int{4096, 8192} {
		size, err := Size(got[i])
		require.NoError(t, err)
		require.Equal(t, want, size, "order is kept")
		require.True(t, cloexec(t, got[i]))
		CloseFd(got[i])
	}

	// The wrong count is refused and what arrived is closed, not leaked.
	before := openFds(t)
	require.NoError(t, SendFds(conns[0], int(a.Fd()), int(a.Fd()), int(a.Fd())))
	_, err = RecvFds(conns[1], 2)
	require.True(t, errors.Is(err, ErrBadRights), "got %v", err)
	require.Equal(t, before, openFds(t))
}

func openFds(t *testing.T) int {
	entries, err := os.ReadDir("/proc/self/fd")
	require.NoError(t, err)
	return len(entries)
}
