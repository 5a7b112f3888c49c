// Package testhook holds settings that tests of other packages change to
// reach states that would take too long to reach for real. Each is zero
// unless a test sets it, and the code that reads it takes zero to mean
// that no test asked for anything.
package testhook

import "sync/atomic"

// FirstStreamID, when not zero, is the id that a client session created
// from then on gives its first new stream, instead of 2 (docs/protocol.md
// section 4). Set near 2^32, it lets a test exhaust the 32-bit id space
// (session.ErrStreamIDs) in a few streams.
var FirstStreamID atomic.Uint32
