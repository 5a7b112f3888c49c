package upgrade

import "errors"

var (
	// ErrInProgress is returned (wrapped) by TakeOver when the process that
	// serves the upgrade socket is already handing over to another new
	// process, or its predecessor is still draining: one upgrade at a time.
	// The running process is unaffected.
	ErrInProgress = errors.New("shmlink: upgrade refused: another upgrade is in progress")

	// ErrHandoverFailed is returned (wrapped) by TakeOver when the process
	// that serves the upgrade socket granted the request but could not
	// make the sockets it hands over beside the listener (the "quic"
	// network's forwarding socket: out of descriptors or memory); its log
	// says why. That process goes on serving, and a later request may
	// succeed (docs/protocol.md section 14, refuse reason 3).
	ErrHandoverFailed = errors.New("shmlink: upgrade refused: the running process could not make the sockets to hand over")

	// ErrClosing is returned (wrapped) by TakeOver when the process that
	// serves the upgrade socket is closing its listener.
	ErrClosing = errors.New("refused: the running listener is closing")

	// ErrNoOwner is returned by TakeOver when no process serves the upgrade
	// socket (no file at its path, or nobody listening on it): the caller
	// listens afresh with Listen.
	ErrNoOwner = errors.New("shmlink: no process serves the upgrade socket")

	// ErrFrame is returned (wrapped) by TakeOver, and logged by the old
	// side, for a malformed frame on the upgrade socket or one with an
	// unexpected op.
	ErrFrame = errors.New("shmlink: bad upgrade frame")
)
