//go:build linux

package shm

import (
	"fmt"
	"net"
	"os"

	"golang.org/x/sys/unix"
)

// CreateMemfd creates an anonymous memfd named name (the kernel shows it as
// /memfd:name; it is not a path) of size bytes, close-on-exec and mode 0600
// (the kernel creates memfds 0777, which matters to whoever may reopen one
// through /proc/<pid>/fd). The size is sealed against shrinking and growing
// so that the peer that receives the descriptor cannot truncate it under our
// mapping (which would raise SIGBUS). The caller owns the returned file and
// must Close it.
func CreateMemfd(name string, size int) (*os.File, error) {
	if size <= 0 || size > MaxMapSize {
		return nil, fmt.Errorf("%w: %d bytes", ErrBadSize, size)
	}
	fd, err := unix.MemfdCreate(name, unix.MFD_CLOEXEC|unix.MFD_ALLOW_SEALING)
	if err != nil {
		return nil, os.NewSyscallError("memfd_create", err)
	}
	if err := unix.Fchmod(fd, 0o600); err != nil {
		unix.Close(fd)
		return nil, os.NewSyscallError("fchmod", err)
	}
	if err := unix.Ftruncate(fd, int64(size)); err != nil {
		unix.Close(fd)
		return nil, os.NewSyscallError("ftruncate", err)
	}
	seals := unix.F_SEAL_SHRINK | unix.F_SEAL_GROW | unix.F_SEAL_SEAL
	if _, err := unix.FcntlInt(uintptr(fd), unix.F_ADD_SEALS, seals); err != nil {
		unix.Close(fd)
		return nil, os.NewSyscallError("fcntl(F_ADD_SEALS)", err)
	}
	return os.NewFile(uintptr(fd), "memfd:"+name), nil
}

// SealShrink seals the shared-memory file fd against shrinking, unless it
// is sealed so already, and reports whether it is sealed now. Only a memfd
// whose creator allowed sealing (MFD_ALLOW_SEALING, and no F_SEAL_SEAL)
// can be; a file, or another memfd, may still be truncated by its owner
// under our mapping, and an access past the new end then faults (SIGBUS).
func SealShrink(fd int) bool {
	seals, err := unix.FcntlInt(uintptr(fd), unix.F_GET_SEALS, 0)
	if err != nil {
		return false
	}
	if seals&unix.F_SEAL_SHRINK != 0 {
		return true
	}
	_, err = unix.FcntlInt(uintptr(fd), unix.F_ADD_SEALS, unix.F_SEAL_SHRINK)
	return err == nil
}

// CreateFile creates the file at path with O_EXCL, mode 0600 (whatever the
// umask) and close-on-exec, sizes it to size bytes and allocates its blocks.
// It fails with an *os.PathError wrapping fs.ErrExist if the path exists, so
// a file planted by someone else is never used, and with one wrapping
// syscall.ENOSPC (op "fallocate") if the file system cannot hold size more
// bytes; the file is then removed. On a file system without fallocate (not
// tmpfs) the file stays sparse. The caller owns the returned file and must
// Close it and, when it is no longer needed by any peer, Remove the path.
//
// The blocks are allocated up front because a sparse file on a full tmpfs
// (a container's /dev/shm is 64 MB by default) takes its pages at the
// first write to each, and a write that finds no room faults (SIGBUS)
// instead of failing (docs/protocol.md section 13).
//
// The file holds a shared flock from its first moment, before it is sized,
// so that RemoveStale in another process (or goroutine) never takes it for
// a dead owner's. Between the create and the flock a sweep can still take
// the exclusive lock and unlink the new file; it unlinks under that lock,
// so once the shared lock is ours a link count of 0 tells, and the file is
// created again at the same path (at most createTries times).
func CreateFile(path string, size int) (*os.File, error) {
	if size <= 0 || size > MaxMapSize {
		return nil, fmt.Errorf("%w: %d bytes", ErrBadSize, size)
	}
	f, err := createLocked(path)
	if err != nil {
		return nil, err
	}
	// The umask can only have cleared bits of 0600; set them back.
	if err := f.Chmod(0o600); err != nil {
		f.Close()
		os.Remove(path)
		return nil, err
	}
	if err := f.Truncate(int64(size)); err != nil {
		f.Close()
		os.Remove(path)
		return nil, err
	}
	if err := allocate(int(f.Fd()), int64(size)); err != nil {
		f.Close()
		os.Remove(path)
		return nil, &os.PathError{Op: "fallocate", Path: path, Err: err}
	}
	return f, nil
}

// createTries bounds how many times createLocked creates its file again
// after a sweep removed it: each try needs another sweep to win a window
// of a few system calls.
const createTries = 8

// createLocked creates the empty file at path (O_EXCL, 0600 before the
// umask, close-on-exec) and returns it holding a shared flock: the owner's
// mark, which outlives pid namespaces (see RemoveStale).
func createLocked(path string) (*os.File, error) {
	for range createTries {
		f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE|os.O_EXCL|unix.O_CLOEXEC|unix.O_NOFOLLOW, 0o600)
		if err != nil {
			return nil, err
		}
		fd := int(f.Fd())
		if err := flock(fd, unix.LOCK_SH); err != nil {
			f.Close()
			os.Remove(path)
			return nil, os.NewSyscallError("flock", err)
		}
		var st unix.Stat_t
		if err := unix.Fstat(fd, &st); err != nil {
			f.Close()
			os.Remove(path)
			return nil, os.NewSyscallError("fstat", err)
		}
		if st.Nlink > 0 {
			return f, nil
		}
		f.Close() // a sweep unlinked it before our lock: the path is free again
	}
	return nil, &os.PathError{Op: "create", Path: path, Err: fmt.Errorf("removed by stale-file sweeps %d times in a row", createTries)}
}

// flock applies how (unix.LOCK_SH, ...) to fd, again while a signal
// interrupts the wait.
func flock(fd, how int) error {
	for {
		if err := unix.Flock(fd, how); err != unix.EINTR {
			return err
		}
	}
}

// allocate allocates the blocks of the first size bytes of the file fd
// (fallocate(2), mode 0, which keeps the file's size). It returns nil on
// a file system that does not support it, and retries while a signal
// interrupts it: tmpfs gives up with EINTR at a pending signal, and the Go
// runtime signals its threads to preempt goroutines.
func allocate(fd int, size int64) error {
	for {
		err := unix.Fallocate(fd, 0, 0, size)
		switch err {
		case unix.EINTR:
			continue
		case unix.EOPNOTSUPP, unix.ENOSYS:
			return nil
		}
		return err
	}
}

// RemoveStale removes the file at path, made by CreateFile, if it is no
// longer anybody's, and reports whether it did. CreateFile's file holds a
// shared flock for as long as it is open, so a file whose exclusive lock
// can be taken has no live owner, whichever pid namespace that owner ran
// in. The file is unlinked while that lock is held, and only if path
// still names the file locked, so that a creator that takes its lock
// afterwards sees its file gone (see CreateFile). A file that cannot be
// opened or locked counts as live.
func RemoveStale(path string) bool {
	fd, err := unix.Open(path, unix.O_RDONLY|unix.O_NOFOLLOW|unix.O_NONBLOCK|unix.O_CLOEXEC, 0)
	if err != nil {
		return false
	}
	defer unix.Close(fd)
	if flock(fd, unix.LOCK_EX|unix.LOCK_NB) != nil {
		return false
	}
	var locked, named unix.Stat_t
	if unix.Fstat(fd, &locked) != nil || unix.Lstat(path, &named) != nil || checkSame(&locked, &named) != nil {
		return false
	}
	return unix.Unlink(path) == nil
}

// OpenFile opens an existing shared-memory file that a peer named,
// read-write and close-on-exec, if it is a regular file that belongs to
// uid (any owner if uid < 0).
//
// The path is checked with lstat first, so a symlink, a directory, a FIFO,
// a socket, a device or a file of another user is refused without ever
// being opened. The file is then opened with O_NOFOLLOW (and O_NONBLOCK, so
// that a FIFO swapped in meanwhile cannot block the open; neither flag
// changes anything for a regular file), and the opened descriptor, not the
// path, is checked again with fstat: it must be the file that was checked
// (same device and inode), still regular and still owned by uid. So the file
// returned is always the file checked, even if the name is replaced between
// the two steps; a replacement is only ever opened, never returned.
//
// A refused file gets an *os.PathError wrapping ErrNotRegular, ErrNotOwner
// or ErrChanged; a path that cannot be looked up or opened gets the lstat or
// open error. The caller owns the file.
func OpenFile(path string, uid int) (*os.File, error) {
	var want unix.Stat_t
	if err := unix.Lstat(path, &want); err != nil {
		return nil, &os.PathError{Op: "lstat", Path: path, Err: err}
	}
	if err := checkShared(&want, uid); err != nil {
		return nil, &os.PathError{Op: "open", Path: path, Err: err}
	}
	f, err := os.OpenFile(path, os.O_RDWR|unix.O_CLOEXEC|unix.O_NOFOLLOW|unix.O_NONBLOCK, 0)
	if err != nil {
		return nil, err
	}
	var got unix.Stat_t
	err = unix.Fstat(int(f.Fd()), &got)
	if err != nil {
		err = os.NewSyscallError("fstat", err)
	} else if err = checkSame(&want, &got); err == nil {
		err = checkShared(&got, uid)
	}
	if err != nil {
		f.Close()
		return nil, &os.PathError{Op: "open", Path: path, Err: err}
	}
	return f, nil
}

// checkShared returns nil if st is a regular file owned by uid (any owner if
// uid < 0), else an error wrapping ErrNotRegular or ErrNotOwner.
func checkShared(st *unix.Stat_t, uid int) error {
	if kind := st.Mode & unix.S_IFMT; kind != unix.S_IFREG {
		return fmt.Errorf("%w (%s)", ErrNotRegular, kindName(kind))
	}
	if uid >= 0 && int64(st.Uid) != int64(uid) {
		return fmt.Errorf("%w: owned by uid %d, not %d", ErrNotOwner, st.Uid, uid)
	}
	return nil
}

// checkSame returns ErrChanged unless want and got are the same file.
func checkSame(want, got *unix.Stat_t) error {
	if want.Dev != got.Dev || want.Ino != got.Ino {
		return fmt.Errorf("%w: inode %d on device %#x became inode %d on device %#x",
			ErrChanged, want.Ino, want.Dev, got.Ino, got.Dev)
	}
	return nil
}

// kindName names a file type (the S_IFMT bits of a mode).
func kindName(kind uint32) string {
	switch kind {
	case unix.S_IFREG:
		return "regular file"
	case unix.S_IFLNK:
		return "symbolic link"
	case unix.S_IFDIR:
		return "directory"
	case unix.S_IFIFO:
		return "FIFO"
	case unix.S_IFSOCK:
		return "socket"
	case unix.S_IFCHR:
		return "character device"
	case unix.S_IFBLK:
		return "block device"
	}
	return fmt.Sprintf("file type %#o", kind)
}

// Size returns the size of the file behind fd, in bytes.
func Size(fd int) (int, error) {
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		return 0, os.NewSyscallError("fstat", err)
	}
	return int(st.Size), nil
}

// CheckMemfd checks that fd, which a peer sent in place of a memfd
// (docs/protocol.md section 1.4; the rule: section 9, "What a descriptor
// must be"), is a regular file of tmpfs or hugetlbfs:
// a memfd, or a file of /dev/shm. Anything else gets an error wrapping
// ErrNotShared: a device, or a file on a disk, on NFS or on a FUSE file
// system that the peer itself serves, where a page fault on our mapping
// would wait for I/O, or for the peer, in the kernel, beyond the reach of
// any deadline.
func CheckMemfd(fd int) error {
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		return os.NewSyscallError("fstat", err)
	}
	if st.Mode&unix.S_IFMT != unix.S_IFREG {
		return fmt.Errorf("%w: not a regular file (mode %#o)", ErrNotShared, st.Mode)
	}
	var fs unix.Statfs_t
	if err := unix.Fstatfs(fd, &fs); err != nil {
		return os.NewSyscallError("fstatfs", err)
	}
	switch uint32(fs.Type) {
	case unix.TMPFS_MAGIC, unix.HUGETLBFS_MAGIC:
		return nil
	}
	return fmt.Errorf("%w: a file of file system %#x, not tmpfs", ErrNotShared, uint32(fs.Type))
}

// Map maps the whole file behind fd shared and read-write. If want is not 0,
// the file must be exactly want bytes; otherwise any size from 1 byte to
// MaxMapSize is accepted. It returns ErrBadSize otherwise. The returned
// memory belongs to the caller, stays valid after fd is closed, and must be
// released with Unmap exactly once; touching it afterwards faults.
func Map(fd int, want int) ([]byte, error) {
	size, err := Size(fd)
	if err != nil {
		return nil, err
	}
	if size <= 0 || size > MaxMapSize || (want != 0 && size != want) {
		return nil, fmt.Errorf("%w: file is %d bytes, want %d", ErrBadSize, size, want)
	}
	mem, err := unix.Mmap(fd, 0, size, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		return nil, os.NewSyscallError("mmap", err)
	}
	return mem, nil
}

// Unmap releases memory returned by Map.
func Unmap(mem []byte) error {
	if mem == nil {
		return nil
	}
	return os.NewSyscallError("munmap", unix.Munmap(mem))
}

// SendFds sends fds over c in one sendmsg: one data byte 0x00 and one
// SCM_RIGHTS control message (docs/protocol.md section 1.4, step 5). The
// descriptors stay owned by the caller.
func SendFds(c *net.UnixConn, fds ...int) error {
	_, _, err := c.WriteMsgUnix([]byte{0}, unix.UnixRights(fds...), nil)
	return err
}

// RecvFds receives one message of at least one data byte carrying exactly
// want descriptors over c. The descriptors are close-on-exec (the net
// package receives with MSG_CMSG_CLOEXEC) and owned by the caller. A message
// with a different number of descriptors, or several control messages, gets
// ErrBadRights and every descriptor that arrived is closed.
func RecvFds(c *net.UnixConn, want int) ([]int, error) {
	var data [1]byte
	oob := make([]byte, unix.CmsgSpace(4*(want+8)))
	n, oobn, flags, _, err := c.ReadMsgUnix(data[:], oob)
	if err != nil {
		return nil, err
	}
	msgs, perr := unix.ParseSocketControlMessage(oob[:oobn])
	var fds []int
	for _, m := range msgs {
		got, err := unix.ParseUnixRights(&m)
		if err == nil {
			fds = append(fds, got...)
		}
	}
	if n != 1 || perr != nil || flags&unix.MSG_CTRUNC != 0 || len(msgs) != 1 || len(fds) != want {
		for _, fd := range fds {
			unix.Close(fd)
		}
		return nil, fmt.Errorf("%w: %d data bytes, %d control messages, %d descriptors, want 1 and %d",
			ErrBadRights, n, len(msgs), len(fds), want)
	}
	return fds, nil
}

// CloseFd closes a raw descriptor, ignoring errors (for cleanup paths).
func CloseFd(fd int) { unix.Close(fd) }
