package upgrade

import "errors"

var (
	// ErrInProgress is returned (wrapped) by TakeOver when the process that
	// serves the upgrade socket is already handing over to another new
	// process, or its predecessor is still draining: one upgrade at a time.
	// The running process is unaffected.
	ErrInProgress = errors.New("shmlink: upgrade refused: another upgrade is in progress")

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
