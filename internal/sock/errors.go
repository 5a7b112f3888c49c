package sock

import (
	"errors"

	"github.com/shmlink/shmlink/internal/shm"
)

var (
	// ErrUnsupported is returned by PeerCred, SendListeners and
	// RecvListeners on platforms without SO_PEERCRED or SCM_RIGHTS.
	ErrUnsupported = errors.New("sock: not supported on this platform")

	// ErrNotSocket is returned by ListenUnix when, between bind and chmod,
	// the socket's path was replaced by something that is not a socket: the
	// mode is then not applied to it.
	ErrNotSocket = errors.New("sock: path is no longer a socket")

	// ErrBadRights is returned by RecvListeners when the peer's message
	// does not carry exactly the expected number of descriptors. Any
	// descriptors that did arrive are closed before it is returned.
	ErrBadRights = shm.ErrBadRights
)
