package shmlink

import (
	"errors"
	"fmt"
	"net"

	"github.com/shmlink/shmlink/internal/upgrade"
)

var (
	// ErrNetwork is returned by Listen and Dial for a network other than
	// "unix" and "tcp" (and "tcp4", "tcp6").
	ErrNetwork = errors.New("shmlink: network must be unix or tcp")

	// ErrNotLoopback is returned by Listen for a "tcp", "tcp4" or "tcp6"
	// address that is not, or does not resolve only to, a loopback address
	// ("0.0.0.0:0", ":0", "[::]:0", a LAN address), unless
	// ListenConfig.AllowNonLoopback is set. Shared memory only works
	// between processes on one host, and TCP carries no peer credentials,
	// so a listener reachable from other hosts only widens who can knock.
	ErrNotLoopback = errors.New("shmlink: TCP listen address is not a loopback address")

	// ErrUpgradeInProgress is returned (wrapped) by ListenConfig.Listen
	// with an UpgradeSocket when the process that owns it is already
	// handing over to another new process, or its predecessor is still
	// draining: one upgrade at a time. The running process is unaffected;
	// try again once it has finished.
	ErrUpgradeInProgress = upgrade.ErrInProgress

	// ErrUpgraded is returned (in a *net.OpError) by Accept once the
	// listener has handed its socket over to a new process and drained
	// (see Listener.Upgraded). It satisfies errors.Is(err, net.ErrClosed).
	ErrUpgraded = fmt.Errorf("shmlink: listener handed over to a new process: %w", net.ErrClosed)

	// errDialerClosed is returned by a Dialer's dials after Close.
	errDialerClosed = fmt.Errorf("shmlink: dialer closed: %w", net.ErrClosed)
)
