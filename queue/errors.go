package queue

import "errors"

var (
	// ErrFull is returned by Ring.Put when the ring already holds cap events
	// the peer has not popped yet (docs/protocol.md section 3.3). It is not
	// fatal: the caller may retry after the peer drained the ring.
	ErrFull = errors.New("queue: IO queue full")

	// ErrCorrupt is returned by Ring.Put and Ring.Pop when the head and tail
	// counters in shared memory are impossible (negative, head past tail,
	// more than cap events apart), and by AttachPair when the queue header
	// a peer wrote does not match the mapping. The peer broke the protocol:
	// the session must end.
	ErrCorrupt = errors.New("queue: IO queue corrupt")

	// errBadConfig is returned by FormatPair when cap is outside 1..MaxCap
	// or len(mem) is not Size(cap), and by FormatPair and AttachPair when
	// mem is not 64-byte aligned or the cap puts a counter of the second
	// half where atomics are unsafe or slow on this architecture (see
	// FormatPair).
	errBadConfig = errors.New("queue: bad IO queue configuration")
)
