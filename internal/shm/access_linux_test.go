//go:build linux

package shm

import (
	"io/fs"
	"net"
	"os"
	"path/filepath"
	"syscall"
	"testing"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"
)

// OpenFile refuses everything but a regular file of the expected owner,
// before opening it.
func TestOpenFileRefuses(t *testing.T) {
	dir := t.TempDir()
	uid := os.Geteuid()
	regular := filepath.Join(dir, "regular")
	require.NoError(t, os.WriteFile(regular, []byte("data"), 0o600))
	require.NoError(t, os.Symlink(regular, filepath.Join(dir, "symlink")))
	require.NoError(t, os.Mkdir(filepath.Join(dir, "directory"), 0o700))
	require.NoError(t, unix.Mkfifo(filepath.Join(dir, "fifo"), 0o600))
	ln, err := net.Listen("unix", filepath.Join(dir, "socket"))
	require.NoError(t, err)
	defer ln.Close()

	for _, tc := range []struct {
		name string
		uid  int
		want error
		why  string
	}{
		{"symlink", uid, ErrNotRegular, "symbolic link"},
		{"directory", uid, ErrNotRegular, "directory"},
		{"fifo", uid, ErrNotRegular, "FIFO"}, // and no hang: it is never opened
		{"socket", uid, ErrNotRegular, "socket"},
		{"regular", uid + 1, ErrNotOwner, "owned by uid"},
		{"missing", uid, fs.ErrNotExist, "no such file"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f, err := OpenFile(filepath.Join(dir, tc.name), tc.uid)
			require.Nil(t, f)
			require.ErrorIs(t, err, tc.want)
			require.Contains(t, err.Error(), tc.why)
			var pe *fs.PathError
			require.ErrorAs(t, err, &pe)
		})
	}
	f, err := OpenFile(regular, uid)
	require.NoError(t, err)
	require.True(t, cloexec(t, int(f.Fd())))
	require.NoError(t, f.Close())
	f, err = OpenFile(regular, -1)
	require.NoError(t, err)
	require.NoError(t, f.Close())
}

// The descriptor is checked after opening: another inode than the one
// checked by path is ErrChanged.
func TestCheckSame(t *testing.T) {
	var a, b unix.Stat_t
	require.NoError(t, unix.Stat("/", &a))
	require.NoError(t, unix.Stat("/proc", &b))
	require.NoError(t, checkSame(&a, &a))
	require.ErrorIs(t, checkSame(&a, &b), ErrChanged)
	c := a
	c.Dev++
	require.ErrorIs(t, checkSame(&a, &c), ErrChanged)
}

// Files and memfds are created 0600 and close-on-exec, whatever the umask
// (the only test in this package that changes it).
func TestCreateModes(t *testing.T) {
	mode := func(fd int) os.FileMode {
		var st unix.Stat_t
		require.NoError(t, unix.Fstat(fd, &st))
		return os.FileMode(st.Mode & 0o7777)
	}
	for _, umask := range []int{0, 0o022, 0o277} {
		old := syscall.Umask(umask)
		m, merr := CreateMemfd("shmlink-mode-test", 4096)
		f, ferr := CreateFile(filepath.Join(t.TempDir(), "f"), 4096)
		syscall.Umask(old)
		require.NoError(t, merr)
		require.NoError(t, ferr)
		for _, g := range []*os.File{m, f} {
			require.Equal(t, os.FileMode(0o600), mode(int(g.Fd())), "%s, umask %#o", g.Name(), umask)
			require.True(t, cloexec(t, int(g.Fd())), g.Name())
			g.Close()
		}
	}
}
