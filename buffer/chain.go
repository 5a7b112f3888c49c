package buffer

import (
	"fmt"
	"io"
)

// A ChainWriter builds one message as a chain of slices of a Region
// (docs/protocol.md sections 2.3 and 2.4): Write copies bytes in, Reserve hands
// out room to fill in place, Finish links the chain up and returns its
// head, the offset that goes on the wire.
//
// The zero value is unusable: Reset it onto a Region, which allocates
// nothing. A ChainWriter is meant to be reused, one message after another. It is not safe for
// concurrent use. Until Finish or Abort the slices of the chain belong to
// the writer; after Finish they belong to whoever the head is given to.
type ChainWriter struct {
	r    *Region
	head uint32 // first slice, 0 while the chain is empty
	tail uint32 // last slice, the one being filled
	buf  []byte // data area of tail
	used int    // bytes of buf written
	size int    // bytes of the whole chain written
}

// newChainWriter returns an empty ChainWriter on r (for tests).
func (r *Region) newChainWriter() *ChainWriter {
	return &ChainWriter{r: r}
}

// Reset empties w and makes it write to r. A chain w was building is
// forgotten, not freed: call Abort first to give its slices back.
func (w *ChainWriter) Reset(r *Region) {
	*w = ChainWriter{r: r}
}

// Write appends p to the chain and returns the number of bytes appended.
// It fills the last slice first; when that is full it allocates another:
// from the smallest class that holds what is left of p, or the largest
// class when nothing does, trying larger classes and then smaller ones
// when a class is exhausted (docs/protocol.md section 2.4). While the
// largest class runs short, less than one of its slices holds starts at
// the next class down instead (writeWant).
//
// When no slice can be had, Write returns n < len(p) and ErrNoSpace
// (unwrapped); the n bytes written stay in the chain, which the caller may
// still Finish or Abort. An invalid list returns an error wrapping
// ErrCorrupt the same way.
func (w *ChainWriter) Write(p []byte) (n int, err error) {
	for len(p) > 0 {
		if w.used == len(w.buf) {
			if err := w.grow(w.writeWant(len(p)), true); err != nil {
				return n, err
			}
		}
		c := copy(w.buf[w.used:], p)
		w.used += c
		w.size += c
		n += c
		p = p[c:]
	}
	return n, nil
}

// Reserve appends n bytes to the chain and returns them, contiguous, inside
// one slice in shared memory, for the caller to fill before Finish. They
// come from the last slice when it has room, else from a new slice of the
// smallest class that holds n, or a larger one (the room left in the
// previous slice is then unused). The bytes count as written whether or
// not the caller fills them. Reserve(0) returns nil. The returned bytes
// are the caller's to write until Finish, after which they belong to the
// chain (and to whoever it is published to); after Abort their slice is
// free again, and they must not be touched.
//
// Reserve returns an error wrapping ErrTooLarge when n exceeds
// Region.MaxSliceSize, ErrNoSpace when no slice can be had, and an error
// wrapping ErrCorrupt when a list is invalid; the chain is then unchanged.
func (w *ChainWriter) Reserve(n int) ([]byte, error) {
	if n <= 0 {
		return nil, nil
	}
	if n > w.r.MaxSliceSize() {
		return nil, fmt.Errorf("buffer: reserve %d bytes, slices hold at most %d: %w", n, w.r.MaxSliceSize(), ErrTooLarge)
	}
	if len(w.buf)-w.used < n {
		if err := w.grow(n, false); err != nil {
			return nil, err
		}
	}
	b := w.buf[w.used : w.used+n : w.used+n]
	w.used += n
	w.size += n
	return b, nil
}

// writeWant returns how many bytes Write asks a new slice to hold when
// left bytes of p remain: left, except while the largest class runs short
// (list.short: under a quarter of its slices free) and left is less than
// one of its slices holds; then at most the slice size of the next class
// down. So while large slices are scarce, Write takes one only to fill it
// or when the classes below are exhausted (docs/protocol.md section 2.4).
// Those slices are the fewest (127 in a default 32 MiB region) and the only
// ones a Reserve of more than the next class's size can use; a 64 KiB
// event in one would leave half of it empty.
func (w *ChainWriter) writeWant(left int) int {
	n := len(w.r.lists)
	if n < 2 {
		return left
	}
	below := int(w.r.lists[n-2].dataSize)
	if left <= below || left >= int(w.r.lists[n-1].dataSize) || !w.r.lists[n-1].short() {
		return left
	}
	return below
}

// WholeSlices returns how many of n bytes to give Write for an event that
// starts a chain: n, or while the largest class runs short (writeWant),
// n rounded down to whole slices of the class below, so that the event
// does not end in a slice of its own for the few bytes the headers took.
// With the default classes, 64 KiB then becomes 65,496 bytes, two 32 KiB
// slices, where 65,536 would take a third, of 8 KiB, for 40 bytes
// (docs/protocol.md section 2.4). Call it on an empty chain.
func (w *ChainWriter) WholeSlices(n int) int {
	if want := w.writeWant(n); want < n {
		return n / want * want
	}
	return n
}

// Unreserve gives back the last k bytes of the last Reserve, left
// unfilled: they are not part of the message. k must be at most that
// Reserve's n; a larger k is cut to the bytes of the last slice.
func (w *ChainWriter) Unreserve(k int) {
	k = max(0, min(k, w.used))
	w.used -= k
	w.size -= k
}

// grow allocates a slice for want more bytes (see Region.alloc for down),
// closes the current last slice and links it to the new one.
func (w *ChainWriter) grow(want int, down bool) error {
	off, l, err := w.r.alloc(w.r.class(want), down)
	if err != nil {
		return err
	}
	if w.head == 0 {
		w.head = off
	} else {
		w.close()
		w.r.link(w.tail, off)
	}
	w.tail, w.buf, w.used = off, w.r.data(l, off), 0
	return nil
}

// close records the bytes written to the last slice in its header.
func (w *ChainWriter) close() {
	*u32(w.r.base, w.tail+sliceOffSize) = uint32(w.used)
	*u32(w.r.base, w.tail+sliceOffStart) = 0
}

// Len returns the bytes written to the chain so far, reservations included.
func (w *ChainWriter) Len() int { return w.size }

// Finish completes the chain, writing the last slice's size, and returns
// the absolute offset of its first slice and its total size in bytes; the
// chain is then the caller's to publish (or free with Region.FreeChain).
// An empty chain returns 0, 0. w is reset, ready for the next message.
func (w *ChainWriter) Finish() (head uint32, size int) {
	head, size = w.head, w.size
	if head != 0 {
		w.close()
	}
	w.Reset(w.r)
	return head, size
}

// Abort frees every slice of the unfinished chain and resets w. It returns
// the error of Region.FreeChain, wrapping ErrCorrupt, when the peer damaged
// the chain meanwhile; the slices after the damage are then lost.
func (w *ChainWriter) Abort() error {
	head := w.head
	w.Reset(w.r)
	if head == 0 {
		return nil
	}
	_, err := w.r.FreeChain(head)
	return err
}

// A ChainReader walks a received chain of slices (docs/protocol.md section 2.3),
// checking every slice and link, and ending with an error after as many
// slices as the region has, so that a cycle cannot make it loop. It does
// not free the slices; Region.FreeChain does that once the caller is done
// with the bytes.
//
// The zero value is unusable: Reset it onto a chain. A ChainReader is a
// value that allocates nothing and is meant to be reused. It is not safe
// for concurrent use.
type ChainReader struct {
	r       *Region
	next    uint32 // slice to read next
	more    bool   // next is valid
	left    uint32 // slices the walk may still visit
	off     uint32 // slice pending is from
	pending []byte // what read left of the current slice's payload
}

// Reset makes c read the chain whose first slice is at absolute offset
// head of r. It returns an error wrapping ErrCorrupt when head is not a
// slice header; c then reads nothing.
func (c *ChainReader) Reset(r *Region, head uint32) error {
	*c = ChainReader{r: r}
	if _, ok := r.locate(head); !ok {
		return badOffset("read chain", head)
	}
	c.next, c.more, c.left = head, true, r.total
	return nil
}

// Next returns the payload of the chain's next slice (or, after read, what
// read left of the current one) and the absolute offset of that slice. p
// points into shared memory, valid until the chain is freed; see
// Region.Payload. At the end of the chain Next returns io.EOF.
//
// Next returns an error wrapping ErrCorrupt when a slice or link is
// invalid (see Region.Payload) or the chain is longer than the region has
// slices; the walk then ends.
func (c *ChainReader) Next() (p []byte, off uint32, err error) {
	if len(c.pending) > 0 {
		p, c.pending = c.pending, nil
		return p, c.off, nil
	}
	return c.advance()
}

// advance reads the payload of the next slice.
func (c *ChainReader) advance() ([]byte, uint32, error) {
	if !c.more {
		return nil, 0, io.EOF
	}
	off := c.next
	c.more = false
	if c.left == 0 {
		return nil, off, fmt.Errorf("buffer: read chain: longer than the region's %d slices: %w", c.r.total, ErrCorrupt)
	}
	c.left--
	p, next, more, err := c.r.Payload(off)
	if err != nil {
		return nil, off, err
	}
	c.next, c.more, c.off = next, more, off
	return p, off, nil
}

// Read copies the chain's bytes into p, slice after slice, and returns the
// number copied; it implements io.Reader. At the end of the chain it
// returns 0, io.EOF, and on a corrupt chain the bytes copied so far with
// an error wrapping ErrCorrupt.
func (c *ChainReader) Read(p []byte) (n int, err error) {
	for n < len(p) {
		if len(c.pending) == 0 {
			q, _, err := c.advance()
			if err != nil {
				if err == io.EOF && n > 0 {
					err = nil
				}
				return n, err
			}
			c.pending = q
			continue
		}
		k := copy(p[n:], c.pending)
		c.pending = c.pending[k:]
		n += k
	}
	return n, nil
}
