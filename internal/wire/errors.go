package wire

import "errors"

// ErrProtocol is wrapped by every error about a control message that breaks
// the protocol: a bad header, a length that does not fit the type, a
// malformed payload (every *ProtocolError), or a message the receiving
// session does not accept in its state. package session exports it as
// session.ErrProtocol. The session that received such a message must end.
var ErrProtocol = errors.New("shmlink: protocol error")

// ProtocolError reports what is wrong with a control message received from
// the peer. It wraps ErrProtocol.
type ProtocolError struct {
	// Field is the part of the message at fault: "header", "length",
	// "magic", "version", "type", "queue path", "buffer path" or "payload".
	Field string
	// Reason says what is wrong with it.
	Reason string
}

// Error returns "shmlink: protocol error: <Field>: <Reason>".
func (e *ProtocolError) Error() string {
	return "shmlink: protocol error: " + e.Field + ": " + e.Reason
}

// Unwrap returns ErrProtocol.
func (e *ProtocolError) Unwrap() error { return ErrProtocol }
