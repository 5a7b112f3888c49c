package buffer

import (
	"encoding/binary"
	"fmt"
	"math"
	"math/bits"
	"sync/atomic"
	"unsafe"
)

const (
	// defaultRegionSize is the size in bytes of the buffer region the
	// existing peers create by default (docs/protocol.md section 2.2): 32 MiB.
	defaultRegionSize = 32 << 20

	// maxLists is the largest number of buffer lists (size classes) Format
	// writes and Attach accepts. The header field is 16 bits; the bound keeps
	// the per-offset list lookup short and what a peer can make us allocate
	// small.
	maxLists = 32
	// maxSlices is the most slices, all lists together, that Format writes
	// and Attach accepts (docs/protocol.md section 2.1). A session may hold
	// one unread message, a queue entry on its heap, per slice of the
	// region, and the peer picks the geometry: 4-byte slices in a sparse
	// 4 GiB file would have made that some 180 million entries, about
	// 13 GB. 2^20 admits a 4 GiB region of 4 KiB slices and bounds the
	// entries to about 75 MB; the default region has a few thousand.
	maxSlices = 1 << 20
)

// A SizeClass describes one buffer list of a region to Format.
type SizeClass struct {
	// SliceSize is the data bytes of each slice, excluding the
	// 20-byte header. It must be a positive multiple of 4 so
	// that every header stays 4-byte aligned for the atomics.
	SliceSize uint32

	// Percent is the share of the region's slice space, in percent, given
	// to this list. The percents of all classes sum to 100.
	Percent uint32
}

// DefaultSizeClasses returns the size classes of shmlink's default
// region (session.Config.SizeClasses; docs/protocol.md section 2.2): the
// slice sizes of the existing peers' default (PeerSizeClasses), 8 KiB,
// 32 KiB and 128 KiB including their header, at 20, 30 and 50 percent
// instead of 50, 30 and 20. In a region of the default 32 MiB they make
// lists of 819, 307 and 127 slices. The returned slice is new on every
// call; the caller may modify it.
func DefaultSizeClasses() []SizeClass {
	return []SizeClass{
		{SliceSize: 8<<10 - sliceHeaderSize, Percent: 20},
		{SliceSize: 32<<10 - sliceHeaderSize, Percent: 30},
		{SliceSize: 128<<10 - sliceHeaderSize, Percent: 50},
	}
}

// PeerSizeClasses returns the size classes of the existing peers' default
// region (the Go module shmipc-go and the Rust crate shmipc;
// docs/protocol.md section 2.2): slices of 8 KiB, 32 KiB and 128 KiB
// including their header, at 50, 30 and 20 percent. In a region of 32 MiB
// they make lists of 2047, 307 and 51 slices. The returned slice is new on
// every call; the caller may modify it.
func PeerSizeClasses() []SizeClass {
	return []SizeClass{
		{SliceSize: 8<<10 - sliceHeaderSize, Percent: 50},
		{SliceSize: 32<<10 - sliceHeaderSize, Percent: 30},
		{SliceSize: 128<<10 - sliceHeaderSize, Percent: 20},
	}
}

// A Region is this process's view of a buffer region (docs/protocol.md section
// 2): a mapping shared with one peer, holding buffer lists of fixed-size
// slices that both processes allocate from and recycle into.
//
// A Region does not own its memory: the caller maps it before Format or
// Attach and must keep it mapped while the Region, or any byte slice one of
// its methods returned, is in use; there is no Close. The list geometry is
// read once, when the Region is made, and every offset later read from
// shared memory is checked against it, so a peer writing anything into the
// mapping can make methods fail with ErrCorrupt but cannot make them panic,
// access memory outside the mapping, or loop forever.
//
// All methods are safe for concurrent use, by many goroutines of this
// process and by the peer; they use no locks. The methods that write a
// slice (SetPayload) expect the caller to own it: it
// came from Alloc and has not been published or freed.
type Region struct {
	mem   []byte
	base  unsafe.Pointer // start of mem
	lists []list         // ascending offset and slice size
	total uint32         // slices in all lists: the bound of a chain walk
}

// Format writes the initial layout of a region with the given size classes
// into mem (docs/protocol.md sections 2.1 and 2.2) and returns a view of it. The
// classes must be 1 to 32, in strictly ascending SliceSize, each a
// positive multiple of 4, with percents summing to 100; each list gets
// floor(floor(regionCap*Percent/100) / (SliceSize+20)) slices, where
// regionCap = len(mem) - 8 - 36*len(classes) (less the region header and
// the list headers), and each must get at least 2, all together at most
// 2^20 (maxSlices). mem must be 4-byte aligned (a mapping is) and shorter
// than 4 GiB. The bytes of mem after the lists and the slices' data are
// left as they are.
//
// Format returns an error naming the condition when one above does
// not hold; mem is then unchanged. Only the creator of the region formats
// it, before the peer attaches.
func Format(mem []byte, classes []SizeClass) (*Region, error) {
	if reason := checkMem(mem); reason != "" {
		return nil, fmt.Errorf("buffer: format: %s: %w", reason, errBadConfig)
	}
	counts, err := layout(uint64(len(mem)), classes)
	if err != nil {
		return nil, err
	}
	base := unsafe.Pointer(unsafe.SliceData(mem))
	lists := make([]list, len(classes))
	off := uint64(regionHeaderSize)
	for i, c := range classes {
		lists[i] = newList(base, uint32(off), uint32(counts[i]), c.SliceSize)
		off += listHeaderSize + counts[i]*(uint64(c.SliceSize)+sliceHeaderSize)
	}
	binary.NativeEndian.PutUint16(mem[regionOffLists:], uint16(len(classes)))
	binary.NativeEndian.PutUint16(mem[regionOffReserved:], 0)
	binary.NativeEndian.PutUint32(mem[regionOffUsed:], uint32(off-regionHeaderSize))
	for i := range lists {
		lists[i].format(base)
	}
	return newRegion(mem, lists), nil
}

// CheckFormat reports whether Format accepts a region of size bytes with
// the given classes, without any memory: nil, or Format's error. The
// memory's alignment, which Format checks too, is not in question for a
// mapping.
func CheckFormat(size int, classes []SizeClass) error {
	if reason := checkSize(size); reason != "" {
		return fmt.Errorf("buffer: format: %s: %w", reason, errBadConfig)
	}
	_, err := layout(uint64(size), classes)
	return err
}

// layout checks classes for a region of size bytes (Format's conditions)
// and returns the number of slices of each class.
func layout(size uint64, classes []SizeClass) ([]uint64, error) {
	n := len(classes)
	if n == 0 || n > maxLists {
		return nil, fmt.Errorf("buffer: format: %d size classes, want 1 to %d: %w", n, maxLists, errBadConfig)
	}
	var sum uint64
	for i, c := range classes {
		if c.SliceSize == 0 || c.SliceSize%fieldAlign != 0 {
			return nil, fmt.Errorf("buffer: format: class %d: slice size %d is not a positive multiple of %d: %w",
				i, c.SliceSize, fieldAlign, errBadConfig)
		}
		if i > 0 && c.SliceSize <= classes[i-1].SliceSize {
			return nil, fmt.Errorf("buffer: format: class %d: slice size %d not above the previous class's %d: %w",
				i, c.SliceSize, classes[i-1].SliceSize, errBadConfig)
		}
		sum += uint64(c.Percent)
	}
	if sum != 100 {
		return nil, fmt.Errorf("buffer: format: percents sum to %d, want 100: %w", sum, errBadConfig)
	}
	headers := uint64(regionHeaderSize + listHeaderSize*n)
	if size <= headers {
		return nil, fmt.Errorf("buffer: format: %d bytes cannot hold %d list headers: %w", size, n, errBadConfig)
	}
	regionCap := size - headers
	counts := make([]uint64, n)
	var total uint64
	for i, c := range classes {
		counts[i] = regionCap * uint64(c.Percent) / 100 / (uint64(c.SliceSize) + sliceHeaderSize)
		if counts[i] < 2 {
			return nil, fmt.Errorf("buffer: format: class %d (%d-byte slices at %d%%) gets %d slices of %d bytes, want at least 2: %w",
				i, c.SliceSize, c.Percent, counts[i], size, errBadConfig)
		}
		total += counts[i]
	}
	if total > maxSlices {
		return nil, fmt.Errorf("buffer: format: %d slices in %d bytes, want at most %d (larger slices or a smaller region): %w",
			total, size, maxSlices, errBadConfig)
	}
	return counts, nil
}

// Attach returns a view of a region a peer formatted in mem (docs/protocol.md
// sections 2.1 and 2.2). It checks the header against the mapping: 1 to
// 32 lists, each with at least one slice, at most 2^20 slices in all
// (maxSlices), a slice size that is a
// positive multiple of 4 and not below the previous list's, all lying back
// to back inside mem and together exactly the header's used bytes. The
// free lists themselves (free count, head, tail, links) are not checked
// here; every operation checks what it reads.
//
// Attach returns an error wrapping ErrCorrupt when the header does not
// describe a usable region, or mem is not 4-byte aligned or 4 GiB or
// larger.
func Attach(mem []byte) (*Region, error) {
	if reason := checkMem(mem); reason != "" {
		return nil, fmt.Errorf("buffer: attach: %s: %w", reason, ErrCorrupt)
	}
	n := int(binary.NativeEndian.Uint16(mem[regionOffLists:]))
	used := uint64(binary.NativeEndian.Uint32(mem[regionOffUsed:]))
	if n == 0 || n > maxLists {
		return nil, fmt.Errorf("buffer: attach: %d buffer lists, want 1 to %d: %w", n, maxLists, ErrCorrupt)
	}
	limit := regionHeaderSize + used
	if limit > uint64(len(mem)) {
		return nil, fmt.Errorf("buffer: attach: header claims %d bytes of lists, mapping has %d bytes: %w",
			used, len(mem), ErrCorrupt)
	}
	base := unsafe.Pointer(unsafe.SliceData(mem))
	lists := make([]list, n)
	off := uint64(regionHeaderSize)
	total := uint64(0)
	for i := range lists {
		if off+listHeaderSize > limit {
			return nil, fmt.Errorf("buffer: attach: list %d at %d: header past the used bytes (%d): %w", i, off, limit, ErrCorrupt)
		}
		slices := binary.NativeEndian.Uint32(mem[off+listOffCap:])
		size := binary.NativeEndian.Uint32(mem[off+listOffSliceSize:])
		if slices == 0 || size == 0 || size%fieldAlign != 0 {
			return nil, fmt.Errorf("buffer: attach: list %d at %d: cap %d, slice size %d: %w", i, off, slices, size, ErrCorrupt)
		}
		if total += uint64(slices); total > maxSlices {
			return nil, fmt.Errorf("buffer: attach: list %d at %d: %d slices so far, more than the %d a region may have: %w",
				i, off, total, maxSlices, ErrCorrupt)
		}
		if i > 0 && size < lists[i-1].dataSize {
			return nil, fmt.Errorf("buffer: attach: list %d at %d: slice size %d below the previous list's %d: %w",
				i, off, size, lists[i-1].dataSize, ErrCorrupt)
		}
		// A slice's header and data must fit in 32 bits (offsets are u32),
		// and so must the list: checked in 64 bits, without overflow.
		stride := uint64(size) + sliceHeaderSize
		if stride > math.MaxUint32 {
			return nil, fmt.Errorf("buffer: attach: list %d at %d: slice size %d: with its header past 4 GiB: %w", i, off, size, ErrCorrupt)
		}
		hi, span := bits.Mul64(uint64(slices), stride)
		end := off + listHeaderSize + span
		if hi != 0 || span > limit || end > limit {
			return nil, fmt.Errorf("buffer: attach: list %d at %d: %d slices of %d bytes end at %d, past the used bytes (%d): %w",
				i, off, slices, size, end, limit, ErrCorrupt)
		}
		lists[i] = newList(base, uint32(off), slices, size)
		off = end
	}
	if off != limit {
		return nil, fmt.Errorf("buffer: attach: lists end at %d, header says %d: %w", off, limit, ErrCorrupt)
	}
	return newRegion(mem, lists), nil
}

// checkMem returns why mem cannot hold a region, or "".
func checkMem(mem []byte) string {
	if reason := checkSize(len(mem)); reason != "" {
		return reason
	}
	if uintptr(unsafe.Pointer(unsafe.SliceData(mem)))%fieldAlign != 0 {
		return fmt.Sprintf("memory not %d-byte aligned", fieldAlign)
	}
	return ""
}

// checkSize returns why a region of n bytes cannot be, or "".
func checkSize(n int) string {
	switch {
	case n < regionHeaderSize:
		return fmt.Sprintf("%d bytes of memory, want at least %d", n, regionHeaderSize)
	case uint64(n) > math.MaxUint32:
		return fmt.Sprintf("%d bytes of memory, want less than 4 GiB", n)
	}
	return ""
}

func newRegion(mem []byte, lists []list) *Region {
	r := &Region{mem: mem, base: unsafe.Pointer(unsafe.SliceData(mem)), lists: lists}
	for i := range lists {
		r.total += lists[i].cap
	}
	return r
}

// Capacity returns the number of slices in all the region's buffer lists
// and their data bytes, headers excluded, as cached by Format or Attach.
func (r *Region) Capacity() (slices, bytes int) {
	for i := range r.lists {
		l := &r.lists[i]
		slices += int(l.cap)
		bytes += int(l.cap) * int(l.dataSize)
	}
	return slices, bytes
}

// MaxSliceSize returns the data bytes of a slice of the largest class, the
// most one slice can carry.
func (r *Region) MaxSliceSize() int { return int(r.lists[len(r.lists)-1].dataSize) }

// InUse returns, per buffer list in ascending order of slice size
// (docs/protocol.md section 2.2), the slices in use: not on the free list
// (the cap minus the shared free count, clamped to [0, cap]) and not kept
// warm by this process (FreeWarm). Both processes' allocations count, and
// so do the slices the peer keeps warm. It is meant for
// statistics and leak tests; the values may be stale as soon as they are
// returned.
func (r *Region) InUse() []int {
	out := make([]int, len(r.lists))
	for i := range r.lists {
		l := &r.lists[i]
		out[i] = max(l.used()-l.warmCount(), 0)
	}
	return out
}

// ReleaseWarm pushes the slices this process keeps warm (FreeWarm) onto
// their free lists, where the peer can allocate them too. A warm slice
// whose flags are no longer 0 (the peer wrote to a slice it does not own)
// is dropped, not pushed. It returns an error wrapping ErrCorrupt when a
// list's tail is invalid: the slice being pushed is then lost, as with
// Free, and the ones after it stay kept.
func (r *Region) ReleaseWarm() error {
	for i := range r.lists {
		if err := r.lists[i].releaseWarm(r.base); err != nil {
			return err
		}
	}
	return nil
}

// Alloc pops one slice and returns the absolute offset in bytes of its
// header from the start of the mapping, the value that goes on the wire
// (docs/protocol.md sections 2.3 and 2.4). It tries the smallest class whose
// SliceSize is at least size, then the larger ones; when size exceeds
// MaxSliceSize only the largest class is tried. The slice comes with
// its allocated flag set, size and start 0, and belongs to the caller until it
// is freed (Free, FreeChain) or published to the peer, whose receiver then
// frees it.
//
// Alloc returns ErrNoSpace, unwrapped and without allocating, when no
// tried list had a slice to spare, and an error wrapping ErrCorrupt when a
// list's head or links are invalid.
func (r *Region) Alloc(size int) (off uint32, err error) {
	off, _, err = r.alloc(r.class(size), false)
	return off, err
}

// class returns the index of the smallest list whose slices hold size
// bytes, or of the largest list.
func (r *Region) class(size int) int {
	for i := range r.lists {
		if size <= int(r.lists[i].dataSize) {
			return i
		}
	}
	return len(r.lists) - 1
}

// alloc pops a slice from list i or a larger one, and then, when down is
// set, from the smaller ones, nearest first.
func (r *Region) alloc(i int, down bool) (uint32, *list, error) {
	for j := i; j < len(r.lists); j++ {
		off, err := r.lists[j].pop(r.base)
		if err == nil {
			return off, &r.lists[j], nil
		}
		if err != ErrNoSpace {
			return 0, nil, err
		}
	}
	if down {
		for j := i - 1; j >= 0; j-- {
			off, err := r.lists[j].pop(r.base)
			if err == nil {
				return off, &r.lists[j], nil
			}
			if err != ErrNoSpace {
				return 0, nil, err
			}
		}
	}
	return 0, nil, ErrNoSpace
}

// locate returns the list holding the slice whose header is at absolute
// offset off, found from the cached geometry, or false when off is not a
// slice header of the region.
func (r *Region) locate(off uint32) (*list, bool) {
	for i := range r.lists {
		l := &r.lists[i]
		if off < l.end {
			if off < l.area {
				return nil, false
			}
			return l, l.validRel(off - l.area)
		}
	}
	return nil, false
}

// badOffset returns the error for an offset that is not a slice header.
func badOffset(op string, off uint32) error {
	return fmt.Errorf("buffer: %s: offset %d is not a slice header: %w", op, off, ErrCorrupt)
}

// Free recycles the slice whose header is at absolute offset off onto its
// buffer list (docs/protocol.md section 2.4). The list is found from off and the
// cached geometry, not from the slice's cap field. off typically comes from
// the peer, as a message the caller received; after Free the slice and any
// byte slice obtained for it belong to the region again.
//
// Free returns an error wrapping ErrCorrupt, and recycles nothing, when off
// is not a slice header, the slice's cap field is not its list's slice
// size, or the slice is not marked allocated (it is free already: a double
// free). It also returns one when the list's tail is invalid; the slice is
// then lost.
func (r *Region) Free(off uint32) error {
	l, ok := r.locate(off)
	if !ok {
		return badOffset("free", off)
	}
	_, err := r.free(l, off, false)
	return err
}

// FreeWarm is Free, except that while at least a quarter of the slice's
// list is free, the slice may be kept for this process's next Alloc
// instead of going to the tail of the free list: up to 16 slices, 512 KiB
// and an eighth of the list per list ("Warm slices" in docs/protocol.md
// section 2.4). The free list is first in, first out, so a pushed slice
// comes back only after every other free slice of its class, out of the
// caches; a kept one comes back at once. A kept slice is off the free
// list, its flags 0: the shared counters, and so the peer's InUse, count
// it in use until the next Alloc takes it or ReleaseWarm pushes it;
// InUse and FreeBytes of this Region count it free. Its errors are Free's.
func (r *Region) FreeWarm(off uint32) error {
	l, ok := r.locate(off)
	if !ok {
		return badOffset("free", off)
	}
	_, err := r.free(l, off, true)
	return err
}

// free checks and claims the slice at off of list l, then keeps it warm
// (when warm is set and the list allows it) or pushes it. It returns the
// flags word the slice had before the claim.
func (r *Region) free(l *list, off uint32, warm bool) (uint32, error) {
	if c := load32(r.base, off+sliceOffCap); c != l.dataSize {
		return 0, fmt.Errorf("buffer: free slice at %d: cap %d, its list's slices have %d: %w", off, c, l.dataSize, ErrCorrupt)
	}
	fp := u32(r.base, off+sliceOffFlags)
	for range claimTries {
		fw := atomic.LoadUint32(fp)
		if fw&flagWord(flagAllocated) == 0 {
			return 0, fmt.Errorf("buffer: free slice at %d: not allocated (flags %#x): %w", off, wordFlags(fw), ErrCorrupt)
		}
		if atomic.CompareAndSwapUint32(fp, fw, 0) {
			if warm && l.keepWarm(r.base, off) {
				return fw, nil
			}
			return fw, l.push(r.base, off)
		}
	}
	return 0, fmt.Errorf("buffer: free slice at %d: flags keep changing: %w", off, ErrCorrupt)
}

// FreeChain frees every slice of the chain that starts at absolute offset
// head, following next links while the slice's next flag is set (docs/protocol.md section
// 2.3), and returns the number of slices freed. Each link is read before
// its slice is freed. The walk ends after at most as many links as the
// region has slices.
//
// FreeChain stops at the first bad slice and returns the count so far with
// an error wrapping ErrCorrupt: an offset or link that is not a slice
// header, a cap mismatch, a slice already free (which also ends a cycle),
// or a chain longer than the region. Slices after that point stay
// allocated.
func (r *Region) FreeChain(head uint32) (n int, err error) {
	off := head
	for n = 0; n < int(r.total); n++ {
		l, ok := r.locate(off)
		if !ok {
			return n, badOffset(fmt.Sprintf("free chain from %d, slice %d", head, n), off)
		}
		next := load32(r.base, off+sliceOffNext)
		fw, err := r.free(l, off, false)
		if err != nil {
			return n, err
		}
		if fw&flagWord(flagNext) == 0 {
			return n + 1, nil
		}
		off = next
	}
	return n, fmt.Errorf("buffer: free chain from %d: longer than the region's %d slices: %w", head, r.total, ErrCorrupt)
}

// A sliceHeader is a snapshot of a slice header (docs/protocol.md section 2.3).
type sliceHeader struct {
	// Offset is the absolute offset in bytes of the header from the start
	// of the mapping.
	Offset uint32

	// Cap is the data capacity in bytes; slice checked that it equals the
	// slice size of the slice's list.
	Cap uint32

	// Size is the valid bytes in the data, from Start; slice checked that
	// Start+Size <= Cap.
	Size uint32

	// Start is the offset in bytes of the first valid byte in the data.
	Start uint32

	// Next is the raw next field: area-relative on a free list, absolute in
	// a chain, meaningful only with flagNext. It is not checked.
	Next uint32

	// Flags is the flags byte, flagNext | flagAllocated.
	Flags uint8
}

// slice returns a snapshot of the header of the slice at absolute offset
// off, each field read once. It returns an error wrapping ErrCorrupt when
// off is not a slice header, the cap field differs from the list's slice
// size, or start+size exceeds the cap.
func (r *Region) slice(off uint32) (sliceHeader, error) {
	l, ok := r.locate(off)
	if !ok {
		return sliceHeader{}, badOffset("slice", off)
	}
	h := sliceHeader{
		Offset: off,
		Cap:    load32(r.base, off+sliceOffCap),
		Size:   load32(r.base, off+sliceOffSize),
		Start:  load32(r.base, off+sliceOffStart),
		Next:   load32(r.base, off+sliceOffNext),
		Flags:  wordFlags(load32(r.base, off+sliceOffFlags)),
	}
	if h.Cap != l.dataSize {
		return sliceHeader{}, fmt.Errorf("buffer: slice at %d: cap %d, its list's slices have %d: %w", off, h.Cap, l.dataSize, ErrCorrupt)
	}
	if h.Start > h.Cap || h.Size > h.Cap-h.Start {
		return sliceHeader{}, fmt.Errorf("buffer: slice at %d: start %d + size %d past cap %d: %w", off, h.Start, h.Size, h.Cap, ErrCorrupt)
	}
	return h, nil
}

// FreeBytes returns the data capacity in bytes of the slices free now, in
// every list: a snapshot of the lists' free counters (docs/protocol.md section
// 2), which both processes change concurrently. It reads shared memory
// but takes no lock.
func (r *Region) FreeBytes() int {
	n := 0
	for i := range r.lists {
		l := &r.lists[i]
		n += (int(l.cap) - l.used() + l.warmCount()) * int(l.dataSize)
	}
	return n
}

// SliceSize returns the data capacity in bytes of the slices of the list
// that holds absolute offset off (the slice size of docs/protocol.md section
// 2), or 0 if off is not a slice header. It reads no shared memory.
func (r *Region) SliceSize(off uint32) int {
	l, ok := r.locate(off)
	if !ok {
		return 0
	}
	return int(l.dataSize)
}

// dataAt returns the whole data area of the slice at absolute offset off:
// its list's slice size in bytes, in shared memory, with len == cap. The
// bytes are the caller's to write while it owns the slice (from Alloc until
// it publishes or frees it). It returns an error wrapping ErrCorrupt when
// off is not a slice header; the header itself is not read.
func (r *Region) dataAt(off uint32) ([]byte, error) {
	l, ok := r.locate(off)
	if !ok {
		return nil, badOffset("data", off)
	}
	return r.data(l, off), nil
}

// data returns the data area of the slice at off of list l.
func (r *Region) data(l *list, off uint32) []byte {
	d := off + sliceHeaderSize
	return r.mem[d : d+l.dataSize : d+l.dataSize]
}

// Payload returns the valid bytes of the slice at absolute offset off,
// data[start:start+size], and its chain link: when its next flag is set,
// hasNext is true and next is the absolute offset of the next slice,
// checked to be a slice header. p points into shared memory; it stays valid until the
// slice is freed, and a misbehaving peer may change it meanwhile, so the
// caller copies or parses it defensively.
//
// Payload returns an error wrapping ErrCorrupt when off or next is not a
// slice header, next is off itself, the cap field differs from the list's
// slice size, or start+size exceeds the cap.
func (r *Region) Payload(off uint32) (p []byte, next uint32, hasNext bool, err error) {
	l, ok := r.locate(off)
	if !ok {
		return nil, 0, false, badOffset("payload", off)
	}
	c := load32(r.base, off+sliceOffCap)
	size := load32(r.base, off+sliceOffSize)
	start := load32(r.base, off+sliceOffStart)
	if c != l.dataSize {
		return nil, 0, false, fmt.Errorf("buffer: payload of slice at %d: cap %d, its list's slices have %d: %w",
			off, c, l.dataSize, ErrCorrupt)
	}
	if start > c || size > c-start {
		return nil, 0, false, fmt.Errorf("buffer: payload of slice at %d: start %d + size %d past cap %d: %w",
			off, start, size, c, ErrCorrupt)
	}
	if load32(r.base, off+sliceOffFlags)&flagWord(flagNext) != 0 {
		next = load32(r.base, off+sliceOffNext)
		if _, ok := r.locate(next); !ok || next == off {
			return nil, 0, false, fmt.Errorf("buffer: payload of slice at %d: next %d is not a slice header: %w",
				off, next, ErrCorrupt)
		}
		hasNext = true
	}
	d := off + sliceHeaderSize + start
	return r.mem[d : d+size : d+size], next, hasNext, nil
}

// SetPayload records that the slice at absolute offset off, which the
// caller owns, holds size valid bytes from the start of its data: it sets
// size and start = 0. It returns an error wrapping ErrCorrupt when off is
// not a slice header and one wrapping ErrTooLarge when size exceeds the
// slice size.
func (r *Region) SetPayload(off uint32, size uint32) error {
	l, ok := r.locate(off)
	if !ok {
		return badOffset("set payload", off)
	}
	if size > l.dataSize {
		return fmt.Errorf("buffer: set payload of slice at %d: size %d, slices hold %d: %w", off, size, l.dataSize, ErrTooLarge)
	}
	*u32(r.base, off+sliceOffSize) = size
	*u32(r.base, off+sliceOffStart) = 0
	return nil
}

// linkChecked makes next, an absolute offset, the successor of the slice at
// absolute offset off in a chain: it sets off's next field and its flags to
// flagNext|flagAllocated (docs/protocol.md section 2.3). The caller owns off.
// It returns an error wrapping ErrCorrupt when off or next is not a slice
// header or they are equal.
func (r *Region) linkChecked(off, next uint32) error {
	if _, ok := r.locate(off); !ok {
		return badOffset("link", off)
	}
	if _, ok := r.locate(next); !ok || next == off {
		return badOffset(fmt.Sprintf("link %d to next", off), next)
	}
	r.link(off, next)
	return nil
}

// link sets the chain link of the slice at off; both offsets are checked.
func (r *Region) link(off, next uint32) {
	atomic.StoreUint32(u32(r.base, off+sliceOffNext), next)
	atomic.StoreUint32(u32(r.base, off+sliceOffFlags), flagWord(flagNext|flagAllocated))
}
