package session

import (
	"errors"
	"fmt"
	"net"
	"os"
	"strings"
	"syscall"

	"github.com/shmlink/shmlink/internal/wire"
)

var (
	// ErrSessionClosed is returned by every call on a session, or on a stream
	// of a session, after the session was closed locally. It satisfies
	// errors.Is(err, net.ErrClosed).
	ErrSessionClosed = fmt.Errorf("shmlink: session closed: %w", net.ErrClosed)

	// ErrStreamClosed is returned by Read, Write and the zero-copy calls on a
	// stream after its Close. It satisfies errors.Is(err, net.ErrClosed).
	ErrStreamClosed = fmt.Errorf("shmlink: stream closed: %w", net.ErrClosed)

	// ErrWriteClosed is returned by Write, Reserve and Flush after
	// CloseWrite. It satisfies errors.Is(err, net.ErrClosed).
	ErrWriteClosed = fmt.Errorf("shmlink: stream closed for writing: %w", net.ErrClosed)

	// ErrStreamRefused is returned by Read, Write and the zero-copy calls on
	// a client's stream that its server refused: the session's accept
	// backlog (Config.AcceptBacklog) or Config.MaxStreams was full, or the
	// server session was closing (CloseWhenIdle, a closed Listener).
	// Nothing written on the stream reached the server's application. Only
	// a shmlink server says so (docs/protocol.md section 11); with another
	// server, or when its IO queue was full, a refused stream ends as a
	// closed one does, with io.EOF. It satisfies errors.Is(err,
	// syscall.ECONNREFUSED).
	ErrStreamRefused = fmt.Errorf("shmlink: stream refused by the server: %w", syscall.ECONNREFUSED)

	// errNotClient is returned by OpenStream on a server session: only the
	// client opens streams in the shmipc protocol (docs/protocol.md section 4).
	errNotClient = errors.New("shmlink: only a client session opens streams")

	// errNotServer is returned by AcceptStream on a client session.
	errNotServer = errors.New("shmlink: only a server session accepts streams")

	// ErrQueueFull is returned by a write, and by OpenStream, when the peer
	// left the IO queue full for longer than Config.QueueFullTimeout.
	ErrQueueFull = errors.New("shmlink: IO queue full")

	// ErrBadLength is wrapped by the error of a zero-copy call given a
	// length it cannot serve: Reserve outside [1, Session.MaxSliceSize()],
	// Peek, ReadBytes and ReadChunk below 1. Nothing is reserved or consumed, and the
	// stream stays usable.
	ErrBadLength = errors.New("shmlink: length out of range")

	// ErrStreamIDs is returned by OpenStream when the 32-bit stream id space
	// of the session is used up.
	ErrStreamIDs = errors.New("shmlink: stream ids exhausted")

	// ErrProtocol is wrapped by the error a session ends with when the peer
	// sent a control message that breaks the protocol: a bad header, a
	// length that does not fit the type, a malformed payload, or a message
	// the session does not accept in its state (docs/protocol.md sections
	// 1.1 and 1.2).
	// Handshake errors wrap it too when the peer's handshake message was
	// malformed or of the wrong type.
	ErrProtocol = wire.ErrProtocol

	// ErrHandshake is wrapped by every handshake failure.
	ErrHandshake = errors.New("shmlink: handshake failed")

	// ErrPeerClosed is the cause recorded when the peer closed the control
	// connection without closing the stream first (it died, or ended its
	// session): the stream's calls return it, inside a *SessionError, after
	// the data that arrived before. As a socket's reset does, it satisfies
	// errors.Is(err, syscall.ECONNRESET); a stream the peer closed in order
	// reads io.EOF instead.
	ErrPeerClosed = fmt.Errorf("shmlink: peer closed the session: %w", syscall.ECONNRESET)

	// ErrDraining is returned by OpenStream on a client session that has
	// acknowledged a hot restart (docs/protocol.md section 5): the old server
	// closes it, so the stream must go on a new session. SendHotRestart
	// returns it when the session is already draining.
	ErrDraining = errors.New("shmlink: session is draining for a hot restart")

	// ErrHotRestarted is the cause recorded when a server session ended
	// because its client acknowledged the hot restart (HotRestartAck): the
	// client moved to the new server process. It satisfies errors.Is(err,
	// net.ErrClosed).
	ErrHotRestarted = fmt.Errorf("shmlink: session moved to a new server process: %w", net.ErrClosed)
)

// ConfigError reports a configuration field that was rejected: a Config
// field by Config.Validate, or a field of another type, such as
// shmlink.Dialer's, whose name is then qualified ("Dialer.MaxSessions").
type ConfigError struct {
	Field  string // name of the Config field, or Type.Field for another type
	Reason string // what is wrong with it
}

// Error returns "shmlink: bad Config.<Field>: <Reason>", or "shmlink: bad
// <Field>: <Reason>" for a qualified Field.
func (e *ConfigError) Error() string {
	if strings.Contains(e.Field, ".") {
		return "shmlink: bad " + e.Field + ": " + e.Reason
	}
	return "shmlink: bad Config." + e.Field + ": " + e.Reason
}

// SessionError is the error a session ended with when the peer or the
// control connection failed (a protocol error, corrupt shared memory, an I/O
// error): every stream of the session returns it.
type SessionError struct {
	Op  string // what the session was doing: "read", "poll", "handshake", ...
	Err error  // the cause
}

// Error returns "shmlink: session <Op>: <Err>", with the "shmlink: "
// prefixes of the causes dropped: one per message.
func (e *SessionError) Error() string {
	return "shmlink: " + strings.ReplaceAll("session "+e.Op+": "+e.Err.Error(), "shmlink: ", "")
}

// Unwrap returns the cause.
func (e *SessionError) Unwrap() error { return e.Err }

// deadlineError is returned when a deadline passes. It is a net.Error with
// Timeout() true and unwraps to os.ErrDeadlineExceeded.
type deadlineError struct{}

func (deadlineError) Error() string   { return "shmlink: i/o timeout" }
func (deadlineError) Timeout() bool   { return true }
func (deadlineError) Temporary() bool { return true }
func (deadlineError) Unwrap() error   { return os.ErrDeadlineExceeded }

// errDeadline is the one value of deadlineError.
var errDeadline net.Error = deadlineError{}
