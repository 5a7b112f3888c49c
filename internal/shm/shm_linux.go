//go:build linux

package shm

import (
	"fmt"
	"net"
	"os"

	"golang.org/x/sys/unix"
)

// CreateMemfd creates an anonymous memfd named name (the kernel shows it as
// /memfd:name; it is not a path) of size bytes, close-on-exec. The size is
// sealed against shrinking and growing so that the peer that receives the
// descriptor cannot truncate it under our mapping (which would raise SIGBUS).
// The caller owns the returned file and must Close it.
func CreateMemfd(name string, size int) (*os.File, error) {
	if size <= 0 || size > MaxMapSize {
		return nil, fmt.Errorf("%w: %d bytes", ErrBadSize, size)
	}
	fd, err := unix.MemfdCreate(name, unix.MFD_CLOEXEC|unix.MFD_ALLOW_SEALING)
	if err != nil {
		return nil, os.NewSyscallError("memfd_create", err)
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

// CreateFile creates the file at path with O_EXCL, mode 0600 and
// close-on-exec, and sizes it to size bytes. It fails with an *os.PathError
// wrapping fs.ErrExist if the path exists, so a file planted by someone else
// is never used. The caller owns the returned file and must Close it and,
// when it is no longer needed by any peer, Remove the path.
func CreateFile(path string, size int) (*os.File, error) {
	if size <= 0 || size > MaxMapSize {
		return nil, fmt.Errorf("%w: %d bytes", ErrBadSize, size)
	}
	f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE|os.O_EXCL|unix.O_CLOEXEC|unix.O_NOFOLLOW, 0o600)
	if err != nil {
		return nil, err
	}
	if err := f.Truncate(int64(size)); err != nil {
		f.Close()
		os.Remove(path)
		return nil, err
	}
	return f, nil
}

// OpenFile opens an existing shared-memory file read-write, close-on-exec,
// without following a final symlink. It returns ErrNotRegular (wrapped in an
// *os.PathError) for anything but a regular file. The caller owns the file.
func OpenFile(path string) (*os.File, error) {
	f, err := os.OpenFile(path, os.O_RDWR|unix.O_CLOEXEC|unix.O_NOFOLLOW|unix.O_NONBLOCK, 0)
	if err != nil {
		return nil, err
	}
	st, err := f.Stat()
	if err != nil {
		f.Close()
		return nil, err
	}
	if !st.Mode().IsRegular() {
		f.Close()
		return nil, &os.PathError{Op: "open", Path: path, Err: ErrNotRegular}
	}
	return f, nil
}

// Size returns the size of the file behind fd, in bytes.
func Size(fd int) (int, error) {
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		return 0, os.NewSyscallError("fstat", err)
	}
	return int(st.Size), nil
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
// SCM_RIGHTS control message (PROTOCOL.md section 1.4, step 5). The
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
