//go:build linux

package sock

import (
	"net"
	"os"

	"golang.org/x/sys/unix"
)

// maxBacklog is the listen backlog ListenUnix asks for; the kernel caps it
// at net.core.somaxconn, as it does for the net package's listeners.
const maxBacklog = 1<<16 - 1

// PeerCred returns the process id, user id and group id of the process at
// the other end of c, as the kernel recorded them when the connection was
// made (SO_PEERCRED): the connecting process for an accepted connection,
// the listening one for a dialed connection, the creator for a socketpair.
// Ids are as seen from this process's namespaces (the pid is 0 when the
// peer's is not visible). It returns the getsockopt error as an
// *os.SyscallError.
func PeerCred(c *net.UnixConn) (pid, uid, gid int, err error) {
	rc, err := c.SyscallConn()
	if err != nil {
		return 0, 0, 0, err
	}
	var cred *unix.Ucred
	var serr error
	if err := rc.Control(func(fd uintptr) {
		cred, serr = unix.GetsockoptUcred(int(fd), unix.SOL_SOCKET, unix.SO_PEERCRED)
	}); err != nil {
		return 0, 0, 0, err
	}
	if serr != nil {
		return 0, 0, 0, os.NewSyscallError("getsockopt(SO_PEERCRED)", serr)
	}
	return int(cred.Pid), int(cred.Uid), int(cred.Gid), nil
}

// ListenUnix listens on a Unix stream socket at path whose file has exactly
// the permission bits mode, whatever the process's umask, and which no
// client can have connected to before the mode applied.
//
// The umask is process-wide, so it cannot be changed for one socket
// without racing with every other goroutine that creates files. Instead the
// socket is bound (which creates the file, with the umask's mode), then
// chmod-ed, and only then put in the listening state: until listen(2), a
// connect(2) to the path fails with ECONNREFUSED, so no connection can be
// queued under the umask's mode. The chmod goes by path, after an lstat
// that checks the path still names a socket (ErrNotSocket otherwise); only
// someone allowed to rename entries in the socket's directory could swap
// it in between, and such a user controls the address anyway.
//
// A socket file at path on which nobody listens, left by a process that
// died, is removed first; a live listener's socket is never taken: bind
// then fails with EADDRINUSE.
//
// Abstract addresses ("@name") and "" (autobind) have no file: they are
// listened on as by net.ListenUnix and mode does not apply. The listener
// removes the socket file when closed, like one from net.ListenUnix.
// Errors are *net.OpError values, as from net.Listen.
func ListenUnix(path string, mode os.FileMode) (*net.UnixListener, error) {
	addr := &net.UnixAddr{Name: path, Net: "unix"}
	if path == "" || path[0] == '@' {
		return net.ListenUnix("unix", addr)
	}
	opErr := func(err error) error { return &net.OpError{Op: "listen", Net: "unix", Addr: addr, Err: err} }
	fd, err := unix.Socket(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return nil, opErr(os.NewSyscallError("socket", err))
	}
	f := os.NewFile(uintptr(fd), "unix:"+path) // owns fd from here
	defer f.Close()                            // net.FileListener keeps a dup
	err = unix.Bind(fd, &unix.SockaddrUnix{Name: path})
	if err == unix.EADDRINUSE && removeStale(path) {
		err = unix.Bind(fd, &unix.SockaddrUnix{Name: path})
	}
	if err != nil {
		return nil, opErr(os.NewSyscallError("bind", err))
	}
	ok := false
	defer func() {
		if !ok {
			os.Remove(path)
		}
	}()
	// Bound, not listening: nobody can connect yet.
	var st unix.Stat_t
	if err := unix.Lstat(path, &st); err != nil {
		return nil, opErr(os.NewSyscallError("lstat", err))
	}
	if st.Mode&unix.S_IFMT != unix.S_IFSOCK {
		ok = true // not ours to remove
		return nil, opErr(ErrNotSocket)
	}
	if err := unix.Chmod(path, uint32(mode.Perm())); err != nil {
		return nil, opErr(os.NewSyscallError("chmod", err))
	}
	if err := unix.Listen(fd, maxBacklog); err != nil {
		return nil, opErr(os.NewSyscallError("listen", err))
	}
	ln, err := net.FileListener(f)
	if err != nil {
		return nil, opErr(err)
	}
	ul := ln.(*net.UnixListener)
	ul.SetUnlinkOnClose(true)
	ok = true
	return ul, nil
}

// removeStale removes the socket file at path if nobody listens on it: a
// connect(2) is refused. It reports whether it removed it. Anything else
// at path (a live socket, another kind of file) is left alone.
func removeStale(path string) bool {
	var st unix.Stat_t
	if unix.Lstat(path, &st) != nil || st.Mode&unix.S_IFMT != unix.S_IFSOCK {
		return false
	}
	fd, err := unix.Socket(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return false
	}
	err = unix.Connect(fd, &unix.SockaddrUnix{Name: path})
	unix.Close(fd)
	return err == unix.ECONNREFUSED && os.Remove(path) == nil
}
