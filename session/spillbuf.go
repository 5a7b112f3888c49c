package session

import (
	"math/bits"
	"sync"
)

// Buffers for copies out of shared memory (docs/protocol.md section 13).
//
// While the region runs short, a stalled reader's unread messages are
// copied to the heap and their slices freed. With 64 streams of 1 MiB in
// flight in a 32 MiB region that is a third of a megabyte per round trip,
// one message (at most one event's 64 KiB) at a time. Allocating each copy
// costs the allocator's zeroing and a garbage collection every few
// milliseconds, so the copies come from pools by size class and go back
// once read: as soon as Read copies them out or Discard skips them, or at
// ReleasePreviousRead or Close behind the zero-copy views of Peek,
// ReadBytes and ReadChunk (WriteTo releases after each chunk), whose
// contract already ends there.

const (
	// minSpillBuf and maxSpillBuf bound the pooled capacities, powers of
	// two in bytes. A copy of more than maxSpillBuf (a peer's event may be
	// longer than ours) is allocated as before. A pooled buffer holds less
	// than twice the bytes copied into it, or minSpillBuf for a shorter
	// copy, so the heap limits, which count bytes held, stay within a
	// factor of two of the memory behind them (each message also costs
	// its entry in the receive buffer).
	minSpillBuf = 64
	maxSpillBuf = maxEventBytes
	spillShift  = 6  // log2(minSpillBuf)
	spillPoolN  = 11 // classes: minSpillBuf<<(spillPoolN-1) == maxSpillBuf
)

// spillPools holds free buffers of capacity minSpillBuf<<i in pool i.
var spillPools [spillPoolN]sync.Pool

// spillClass returns the pool for a copy of n bytes, or -1 for none.
func spillClass(n int) int {
	switch {
	case n <= 0 || n > maxSpillBuf:
		return -1
	case n <= minSpillBuf:
		return 0
	}
	return bits.Len(uint(n-1)) - spillShift
}

// getSpillBuf returns n bytes to copy a message into, and the pooled
// buffer behind them (nil when not pooled), which putSpillBuf takes back
// once nothing refers to the bytes. The bytes are not zeroed: the caller
// overwrites all n.
func getSpillBuf(n int) (data []byte, buf *[]byte) {
	i := spillClass(n)
	if i < 0 {
		return make([]byte, n), nil
	}
	if p, _ := spillPools[i].Get().(*[]byte); p != nil {
		return (*p)[:n:n], p
	}
	b := make([]byte, minSpillBuf<<i)
	return b[:n:n], &b
}

// putSpillBuf returns a buffer of getSpillBuf to its pool; nil is ignored.
// No slice of it may be used afterwards.
func putSpillBuf(p *[]byte) {
	if p == nil {
		return
	}
	spillPools[spillClass(cap(*p))].Put(p)
}

// The classes must cover minSpillBuf to maxSpillBuf exactly.
var _ [0]struct{} = [minSpillBuf<<(spillPoolN-1) - maxSpillBuf]struct{}{}
var _ [0]struct{} = [1<<spillShift - minSpillBuf]struct{}{}
