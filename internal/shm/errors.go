package shm

import "errors"

var (
	// ErrUnsupported is returned on platforms without memfd, mmap or SCM_RIGHTS.
	ErrUnsupported = errors.New("shm: not supported on this platform")

	// ErrBadSize is returned by CreateMemfd and CreateFile when the size
	// asked for is not 1..MaxMapSize, and by Map when the file's size is
	// zero, larger than MaxMapSize, or not the size the caller expects.
	ErrBadSize = errors.New("shm: bad shared-memory size")

	// ErrBadRights is returned by RecvFds when the peer's control message does
	// not carry exactly the expected number of descriptors. Any descriptors
	// that did arrive are closed before it is returned.
	ErrBadRights = errors.New("shm: bad SCM_RIGHTS message")

	// ErrNotRegular is returned by OpenFile when the path does not name a
	// regular file (a symlink, a directory, a FIFO, a socket, a device).
	ErrNotRegular = errors.New("shm: not a regular file")

	// ErrNotOwner is returned by OpenFile when the file belongs to another
	// user than the one the caller expects.
	ErrNotOwner = errors.New("shm: file of another user")

	// ErrClaimed is returned by Claim when another session of this process
	// maps the same file already.
	ErrClaimed = errors.New("shm: file mapped by another session of this process")

	// ErrChanged is returned by OpenFile when the file it opened is not the
	// one it checked: the name was replaced in between.
	ErrChanged = errors.New("shm: file replaced while being opened")

	// ErrNotShared is returned by CheckMemfd when a descriptor a peer sent
	// is not a regular file of tmpfs or hugetlbfs.
	ErrNotShared = errors.New("shm: not shared memory")
)

// MaxMapSize is the largest mapping this package creates or accepts, in
// bytes. Offsets in shared memory are 32-bit (docs/protocol.md section 2.3), so a
// region cannot usefully exceed 4 GiB.
const MaxMapSize = 1<<32 - 1
