package shmlink

import (
	"errors"
	"fmt"
	"net"

	"github.com/shmlink/shmlink/internal/upgrade"
	"github.com/shmlink/shmlink/session"
)

var (
	// ErrNetwork is returned by Listen and Dial for a network other than
	// "unix", "tcp" (and "tcp4", "tcp6") and "quic".
	ErrNetwork = errors.New("shmlink: network must be unix, tcp or quic")

	// ErrNotLoopback is returned by Listen for a "tcp", "tcp4" or "tcp6"
	// address that is not, or does not resolve only to, a loopback address
	// ("0.0.0.0:0", ":0", "[::]:0", a LAN address), unless
	// ListenConfig.AllowNonLoopback is set. Shared memory only works
	// between processes on one host, and between hosts TCP tells nothing
	// of the peer's uid (docs/protocol.md section 9), so a listener
	// reachable from other hosts only widens who can knock.
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

	// The errors of sessions and streams, from package session, so that a
	// user of this package needs no other: see there for when each is
	// returned. On "quic": a stream the peer reset, or whose connection
	// the peer ended, wraps ErrPeerClosed and never satisfies
	// net.ErrClosed; a failed TLS handshake wraps ErrHandshake; a stream
	// refused by a closed listener reads ErrStreamRefused; this side's
	// close of the connection is ErrSessionClosed.
	ErrSessionClosed = session.ErrSessionClosed // errors.Is(err, net.ErrClosed)
	ErrStreamClosed  = session.ErrStreamClosed  // errors.Is(err, net.ErrClosed)
	ErrWriteClosed   = session.ErrWriteClosed   // errors.Is(err, net.ErrClosed)
	ErrStreamRefused = session.ErrStreamRefused // errors.Is(err, syscall.ECONNREFUSED)
	ErrPeerClosed    = session.ErrPeerClosed    // errors.Is(err, syscall.ECONNRESET)
	ErrQueueFull     = session.ErrQueueFull     // a write or a dial found the IO queue full for Config.QueueFullTimeout; on "quic", a dial found the server's stream limit reached that long
	ErrHandshake     = session.ErrHandshake     // wrapped by a failed handshake's *SessionError
	ErrProtocol      = session.ErrProtocol      // wrapped by the *SessionError of a peer that broke the protocol
	ErrPeerRefused   = session.ErrPeerRefused   // wrapped by a handshake refused for the peer's uid (*PeerError)
	ErrPathRefused   = session.ErrPathRefused   // wrapped by a handshake refused for a file path outside the rules
	ErrBadLength     = session.ErrBadLength     // wrapped by a zero-copy call given a length out of range

	// errDialerClosed is returned by a Dialer's dials after Close.
	errDialerClosed = fmt.Errorf("shmlink: dialer closed: %w", net.ErrClosed)
)

// ConfigError reports a rejected configuration field (session.ConfigError).
type ConfigError = session.ConfigError

// SessionError is the error a session ended with when the peer or the
// control connection failed (session.SessionError).
type SessionError = session.SessionError

// PeerError reports a peer refused by Config.AllowUIDs or PeerCheck, with
// its credentials (session.PeerError).
type PeerError = session.PeerError
