//go:build linux

package upgrade

import "golang.org/x/sys/unix"

// fileRef names one socket file, the one a path named when it was made,
// so that a file bound later at the same path is told from it. It holds
// an O_PATH descriptor of the file: while it is open the inode stays
// allocated, and no new file can get its number (ext4 hands a freed
// inode's number to the next file at once).
type fileRef struct{ fd int }

// refFile returns a fileRef of the socket file at path, and false if path
// names no socket file or it cannot be opened (out of descriptors).
func refFile(path string) (fileRef, bool) {
	fd, err := unix.Open(path, unix.O_PATH|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		return fileRef{}, false
	}
	var st unix.Stat_t
	if unix.Fstat(fd, &st) != nil || st.Mode&unix.S_IFMT != unix.S_IFSOCK {
		unix.Close(fd)
		return fileRef{}, false
	}
	return fileRef{fd}, true
}

// names reports whether path still names r's file (same device and
// inode).
func (r fileRef) names(path string) bool {
	var held, now unix.Stat_t
	return unix.Fstat(r.fd, &held) == nil && unix.Lstat(path, &now) == nil &&
		held.Dev == now.Dev && held.Ino == now.Ino
}

// release closes r's descriptor.
func (r fileRef) release() { unix.Close(r.fd) }
