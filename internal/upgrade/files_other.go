//go:build !linux

package upgrade

import "os"

// fileRef names one socket file, the one a path named when it was made,
// so that a file bound later at the same path is told from it, by device
// and inode. Without O_PATH nothing keeps the inode's number from going to
// a new file; but a handover never succeeds here (sock.SendListeners is
// not supported), so the case hardly arises.
type fileRef struct{ fi os.FileInfo }

// refFile returns a fileRef of the socket file at path, and false if path
// names no socket file.
func refFile(path string) (fileRef, bool) {
	fi, err := os.Lstat(path)
	if err != nil || fi.Mode()&os.ModeSocket == 0 {
		return fileRef{}, false
	}
	return fileRef{fi}, true
}

// names reports whether path still names r's file.
func (r fileRef) names(path string) bool {
	fi, err := os.Lstat(path)
	return err == nil && os.SameFile(fi, r.fi)
}

// release does nothing: r holds no descriptor.
func (r fileRef) release() {}
