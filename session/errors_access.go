package session

import (
	"errors"
	"fmt"
)

var (
	// ErrPeerRefused is wrapped by the handshake error of Client and Server
	// when the process at the other end of a Unix socket or a loopback TCP
	// connection fails Config.AllowUIDs or Config.PeerCheck (see
	// PeerError), or when its credentials (over TCP: its socket's owner)
	// cannot be read. The connection is closed before any
	// handshake byte is sent or read.
	ErrPeerRefused = errors.New("shmlink: peer refused")

	// ErrPathRefused is wrapped by the handshake error of Server when a
	// client's file-path handshake (ShareMemoryByFilePath, docs/protocol.md
	// section 1.4; the rules: section 9, "Paths" and "One session per file")
	// names anything but a regular file directly inside Config.ShmDir that
	// belongs to the client's uid: a path outside ShmDir or with "." or
	// ".." in it, a symlink, a directory, a FIFO, a device, a socket, a file
	// of another user. Such a path is refused before it is opened.
	ErrPathRefused = errors.New("shmlink: shared-memory path refused")
)

// PeerError is the cause of a handshake refused because of the credentials
// of the process at the other end of a Unix socket or a loopback TCP
// connection: its uid is not in Config.AllowUIDs (by default, not this
// process's effective uid), or Config.PeerCheck returned an error. It
// matches ErrPeerRefused with errors.Is, and Err too.
type PeerError struct {
	Cred PeerCred // the refused peer, as the kernel reports it
	Err  error    // why: not an allowed uid, or PeerCheck's error
}

// Error returns "shmlink: peer refused: pid <PID> uid <UID> gid <GID>:
// <Err>".
func (e *PeerError) Error() string {
	return fmt.Sprintf("%v: pid %d uid %d gid %d: %v", ErrPeerRefused, e.Cred.PID, e.Cred.UID, e.Cred.GID, e.Err)
}

// Unwrap returns ErrPeerRefused and Err.
func (e *PeerError) Unwrap() []error { return []error{ErrPeerRefused, e.Err} }
