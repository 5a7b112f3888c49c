package sock

import "errors"

var (
	// ErrUnsupported is returned by PeerCred on platforms without
	// SO_PEERCRED.
	ErrUnsupported = errors.New("sock: not supported on this platform")

	// ErrNotSocket is returned by ListenUnix when, between bind and chmod,
	// the socket's path was replaced by something that is not a socket: the
	// mode is then not applied to it.
	ErrNotSocket = errors.New("sock: path is no longer a socket")
)
