// Package queue implements the IO queue of the shmipc protocol: a pair of
// single-producer single-consumer rings of 12-byte events in shared memory,
// one per direction (docs/protocol.md section 3).
//
// The client creates the queue file and sends on the first half; the server
// sends on the second half. Head and tail are monotonic 64-bit counters
// updated with sync/atomic at fixed offsets; everything read from shared
// memory is treated as untrusted and checked, so a misbehaving peer yields
// ErrCorrupt, never a panic.
package queue

import (
	"encoding/binary"
	"fmt"
	"math"
	"sync/atomic"
	"unsafe"
)

// Event is one entry of the IO queue (docs/protocol.md section 3.2).
type Event struct {
	StreamID uint32 // stream the event belongs to
	Offset   uint32 // byte offset of the first slice's header from the start of the buffer mapping, 0 for a close
	Status   uint32 // low byte = stream state (0 open/data, 1 closed)
}

// Ring is one half of the IO queue: the events of one direction. A Ring
// is safe for one producer (Put) and one consumer (Pop) at a time, which may
// be in different processes; callers serialize producers among themselves
// and consumers among themselves. The working-flag methods and Empty may be
// called from anywhere.
type Ring struct {
	cap     uint32         // events, cached: never re-read from shared memory
	head    *atomic.Int64  // consumer count, in shared memory
	tail    *atomic.Int64  // producer count, in shared memory
	working *atomic.Uint32 // working flag, in shared memory
	events  []byte         // eventSize*cap bytes of shared memory
}

// FormatPair initializes a new queue of cap events per half in mem, which
// must be exactly Size(cap) bytes and start on a 64-byte boundary (an mmap
// does). It writes cap into both headers and zeroes head, tail and the
// working flag, and returns the first half (the client's sending side) and
// the second (the server's), docs/protocol.md section 3.
//
// It returns an error if cap is outside 1..MaxCap,
// len(mem) != Size(cap), mem is misaligned, or cap would put a counter of
// the second half where this architecture cannot update it atomically at
// full speed: on amd64 (legacy layout) the 4-byte aligned counters must not
// straddle a 64-byte cache line, so cap%16 must not be 2 or 8; elsewhere
// (aligned layout) they must be 8-byte aligned, so cap must be even. The
// existing peers' cap, 8192 events, is fine on both.
func FormatPair(mem []byte, cap uint32) (first, second *Ring, err error) {
	if err := CheckFormat(cap); err != nil {
		return nil, nil, err
	}
	if len(mem) != Size(cap) {
		return nil, nil, fmt.Errorf("%w: %d bytes of memory for cap %d, want %d", errBadConfig, len(mem), cap, Size(cap))
	}
	if err := checkMemory(mem, cap); err != nil {
		return nil, nil, err
	}
	half := halfSize(cap)
	for _, base := range [...]int{0, half} {
		binary.NativeEndian.PutUint32(mem[base+offCap:], cap)
	}
	first, second = newRing(mem[:half], cap), newRing(mem[half:], cap)
	for _, r := range [...]*Ring{first, second} {
		r.head.Store(0)
		r.tail.Store(0)
		r.working.Store(0)
	}
	return first, second, nil
}

// AttachPair attaches to a queue a peer formatted in mem (a mapping of the
// peer's whole queue file, starting on a 64-byte boundary) and returns its
// first half (the client's sending side) and second half (the server's),
// docs/protocol.md section 3. The cap is read once, here; the Rings never read
// it from shared memory again.
//
// It returns an error wrapping ErrCorrupt if the header does not describe
// mem: the two caps differ, a cap is outside 1..MaxCap, or len(mem) is not
// Size(cap). It returns an error if mem is misaligned
// or the cap is one this architecture cannot use (see FormatPair).
// The counters are not checked here; Put and Pop check them on every call.
func AttachPair(mem []byte) (first, second *Ring, err error) {
	if len(mem) < headerSize {
		return nil, nil, fmt.Errorf("%w: %d bytes is shorter than a queue header", ErrCorrupt, len(mem))
	}
	cap := binary.NativeEndian.Uint32(mem[offCap:])
	if cap < 1 || cap > MaxCap {
		return nil, nil, fmt.Errorf("%w: cap %d outside 1..%d", ErrCorrupt, cap, MaxCap)
	}
	if len(mem) != Size(cap) {
		return nil, nil, fmt.Errorf("%w: %d bytes of memory for cap %d, want %d", ErrCorrupt, len(mem), cap, Size(cap))
	}
	half := halfSize(cap)
	if cap2 := binary.NativeEndian.Uint32(mem[half+offCap:]); cap2 != cap {
		return nil, nil, fmt.Errorf("%w: the halves have caps %d and %d", ErrCorrupt, cap, cap2)
	}
	if err := checkMemory(mem, cap); err != nil {
		return nil, nil, err
	}
	return newRing(mem[:half], cap), newRing(mem[half:], cap), nil
}

// checkMemory checks that the counters of both halves of a queue of cap
// events in mem can be used atomically on this architecture.
func checkMemory(mem []byte, cap uint32) error {
	if addr := uintptr(unsafe.Pointer(unsafe.SliceData(mem))); addr%cacheLine != 0 {
		return fmt.Errorf("%w: memory at %#x is not %d-byte aligned", errBadConfig, addr, cacheLine)
	}
	if err := checkPlacement("first", 0); err != nil {
		return err
	}
	if err := checkPlacement("second", halfSize(cap)); err != nil {
		return fmt.Errorf("%w (cap %d)", err, cap)
	}
	return nil
}

// Head returns the ring's head counter: how many events its consumer has
// popped since the ring was formatted (docs/protocol.md section 3.1). The
// consumer may be the peer, which writes it; it is read atomically and
// not checked.
func (r *Ring) Head() int64 { return r.head.Load() }

// CheckFormat reports whether FormatPair accepts a queue of cap events
// per half, without any memory (docs/protocol.md section 3.1): nil, or
// FormatPair's error about cap, which must be 1 to MaxCap and place the
// second half's counters where this architecture can use them atomically.
func CheckFormat(cap uint32) error {
	if cap < 1 || cap > MaxCap {
		return fmt.Errorf("%w: cap %d outside 1..%d", errBadConfig, cap, MaxCap)
	}
	if err := checkPlacement("second", halfSize(cap)); err != nil {
		return fmt.Errorf("%w (cap %d)", err, cap)
	}
	return nil
}

// newRing returns the Ring of the half in mem, which holds a checked header
// and cap events.
func newRing(mem []byte, cap uint32) *Ring {
	return &Ring{
		cap:     cap,
		head:    (*atomic.Int64)(unsafe.Pointer(&mem[offHead])),
		tail:    (*atomic.Int64)(unsafe.Pointer(&mem[offTail])),
		working: (*atomic.Uint32)(unsafe.Pointer(&mem[offWorking])),
		events:  mem[offEvents : offEvents+eventSize*int(cap)],
	}
}

// capacity returns the number of events the ring holds when full, as read from
// the header once by FormatPair or AttachPair (docs/protocol.md section 3.1).
func (r *Ring) capacity() uint32 { return r.cap }

// counters loads head and tail and checks them: 0 <= head <= tail <=
// head+cap, and tail below the largest count so tail+1 cannot overflow.
// Anything else wraps ErrCorrupt.
func (r *Ring) counters() (head, tail int64, err error) {
	head, tail = r.head.Load(), r.tail.Load()
	if head < 0 || tail < head || tail-head > int64(r.cap) || tail == math.MaxInt64 {
		return 0, 0, fmt.Errorf("%w: head %d, tail %d, cap %d", ErrCorrupt, head, tail, r.cap)
	}
	return head, tail, nil
}

// Put appends e to the ring (docs/protocol.md section 3.3): it writes e at
// index tail%cap and then atomically advances tail. It returns ErrFull if
// the ring holds cap events, and an error wrapping ErrCorrupt if the
// counters in shared memory are impossible. Only one goroutine in all
// processes may call Put on a ring at a time. Put does not allocate.
//
// After a successful Put the sender calls MarkWorking and, if it returns
// true, sends one Polling message.
func (r *Ring) Put(e Event) error {
	head, tail, err := r.counters()
	if err != nil {
		return err
	}
	if tail-head == int64(r.cap) {
		return ErrFull
	}
	i := int(uint64(tail)%uint64(r.cap)) * eventSize
	b := r.events[i : i+eventSize]
	binary.NativeEndian.PutUint32(b[eventOffStreamID:], e.StreamID)
	binary.NativeEndian.PutUint32(b[eventOffOffset:], e.Offset)
	binary.NativeEndian.PutUint32(b[eventOffStatus:], e.Status)
	r.tail.Store(tail + 1)
	return nil
}

// Pop removes the oldest event from the ring (docs/protocol.md section 3.3): it
// reads the event at index head%cap and then atomically advances head. It
// returns ok == false with a nil error when the ring is empty, and an error
// wrapping ErrCorrupt if the counters in shared memory are impossible. Only
// one goroutine in all processes may call Pop on a ring at a time. Pop
// does not allocate.
//
// The event's fields are as the peer wrote them: the caller must
// bounds-check Offset and Status before using them.
func (r *Ring) Pop() (e Event, ok bool, err error) {
	head, tail, err := r.counters()
	if err != nil {
		return Event{}, false, err
	}
	if head == tail {
		return Event{}, false, nil
	}
	i := int(uint64(head)%uint64(r.cap)) * eventSize
	b := r.events[i : i+eventSize]
	e = Event{
		StreamID: binary.NativeEndian.Uint32(b[eventOffStreamID:]),
		Offset:   binary.NativeEndian.Uint32(b[eventOffOffset:]),
		Status:   binary.NativeEndian.Uint32(b[eventOffStatus:]),
	}
	r.head.Store(head + 1)
	return e, true, nil
}

// len returns the number of events in the ring, tail - head clamped to
// 0..cap, for statistics (docs/protocol.md section 3.3). It is a snapshot that
// may be stale at once, and it never fails: corrupt counters show up in
// Put and Pop.
func (r *Ring) len() int {
	head, tail := r.head.Load(), r.tail.Load()
	return int(min(max(tail-head, 0), int64(r.cap)))
}

// Empty reports whether the ring holds no events, head >= tail (docs/protocol.md
// section 3.3): the receiver's re-check after ClearWorking. Corrupt
// counters make Pop return ErrCorrupt, whatever Empty reports.
func (r *Ring) Empty() bool {
	return r.head.Load() >= r.tail.Load()
}

// MarkWorking sets the working flag if it was clear, with a compare-and-swap
// 0 -> 1, and reports whether this call set it. A sender calls it after each
// Put and, only when it returns true, sends one Polling message
// (docs/protocol.md section 3.3).
func (r *Ring) MarkWorking() bool {
	return r.working.CompareAndSwap(0, 1)
}

// ClearWorking stores 0 in the working flag. A receiver calls it after
// draining the ring and must then check the ring again: an event put
// before the clear may not have been popped (docs/protocol.md section 3.3).
func (r *Ring) ClearWorking() {
	r.working.Store(0)
}

// SetWorking stores 1 in the working flag: a receiver that keeps polling the
// ring itself, or that found it non-empty after ClearWorking, tells the
// sender not to send Polling messages (docs/protocol.md section 3.3).
func (r *Ring) SetWorking() {
	r.working.Store(1)
}

// Working reports whether the working flag is set, that is non-zero
// (docs/protocol.md section 3.3).
func (r *Ring) Working() bool {
	return r.working.Load() != 0
}
