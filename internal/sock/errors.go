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

	// ErrNotListening is returned (wrapped) by RecvListeners for a stream
	// socket received that is not in the listening state (SO_ACCEPTCONN is
	// 0), such as a connected one: accepting on it would fail with EINVAL.
	ErrNotListening = errors.New("sock: the socket received is not listening")

	// ErrBadRights is returned by RecvListeners when the peer's message
	// does not carry exactly the expected number of descriptors. Any
	// descriptors that did arrive are closed before it is returned.
	ErrBadRights = shm.ErrBadRights
)
