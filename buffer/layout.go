package buffer

import (
	"sync/atomic"
	"unsafe"
)

// Region header, 8 bytes at offset 0 of the mapping (docs/protocol.md section
// 2.1), host byte order:
//
//	+0 lists     u16  number of buffer lists, 1..maxLists
//	+2 reserved  u16  0
//	+4 used      u32  bytes of buffer lists after this header
//	+8 buffer lists, back to back, ascending slice size, no padding
const (
	regionOffLists    = 0
	regionOffReserved = regionOffLists + 2
	regionOffUsed     = regionOffReserved + 2

	// regionHeaderSize is the size in bytes of the region header at offset
	// 0 of the mapping (docs/protocol.md section 2.1).
	regionHeaderSize = regionOffUsed + 4
)

// Buffer list header, 36 bytes, followed by cap slices (docs/protocol.md section
// 2.2). head and tail are offsets relative to the list's slice area, which
// starts right after this header:
//
//	+0  free      i32  free slices, atomic
//	+4  cap       u32  slices in the list, written once by the creator
//	+8  head      u32  first free slice, area-relative, atomic (CAS)
//	+12 tail      u32  last free slice, area-relative, atomic (CAS)
//	+16 size      u32  data bytes per slice, written once by the creator
//	+20 in use    i32  slices handed out, informational, atomic
//	+24 counters  12 bytes, informational, never read
//	+36 slice 0, slice 1, ... slice cap-1, each sliceHeaderSize+size bytes
const (
	listOffFree      = 0
	listOffCap       = listOffFree + 4
	listOffHead      = listOffCap + 4
	listOffTail      = listOffHead + 4
	listOffSliceSize = listOffTail + 4
	listOffInUse     = listOffSliceSize + 4
	listOffCounters  = listOffInUse + 4

	// listCountersSize is the size in bytes of the informational counters
	// after the in-use count.
	listCountersSize = 12

	// listHeaderSize is the size in bytes of a buffer list header
	// (docs/protocol.md section 2.2).
	listHeaderSize = listOffCounters + listCountersSize
)

// Slice header, 20 bytes, followed by the slice's data (docs/protocol.md section
// 2.3). next is area-relative while the slice is on a free list and an
// absolute mapping offset while it is part of a message chain:
//
//	+0  cap    u32  data bytes, equal to the list's slice size
//	+4  size   u32  valid bytes, written by the sender before publishing
//	+8  start  u32  offset of the first valid byte in data (0 in practice)
//	+12 next   u32  next slice: free list (relative) or chain (absolute)
//	+16 flags  u8   flagNext | flagAllocated
//	+17 unused 3 bytes; with flags they form the u32 word the atomics use
//	+20 data   cap bytes
const (
	sliceOffCap   = 0
	sliceOffSize  = sliceOffCap + 4
	sliceOffStart = sliceOffSize + 4
	sliceOffNext  = sliceOffStart + 4
	sliceOffFlags = sliceOffNext + 4

	// sliceFlagsWordSize is the size in bytes of the flags byte and the
	// three unused bytes after it, accessed together as one atomic u32.
	sliceFlagsWordSize = 4

	// sliceHeaderSize is the size in bytes of a slice header (docs/protocol.md
	// section 2.3).
	sliceHeaderSize = sliceOffFlags + sliceFlagsWordSize
)

// Slice flags, the byte at slice header +16 (docs/protocol.md section 2.3).
const (
	// flagNext marks the slice's next field as valid: on a free list the
	// slice has a successor, in a chain the message continues.
	flagNext = 0x01

	// flagAllocated marks a slice popped from its free list and not yet
	// recycled.
	flagAllocated = 0x02
)

// fieldAlign is the alignment in bytes every shared field needs for the
// 32-bit atomics; all offsets above and every slice size are multiples of
// it, so a 4-byte aligned mapping keeps every field aligned.
const fieldAlign = 4

// flagWord returns flags (a FlagXxx combination) as the native-order u32
// word at slice header +16.
func flagWord(flags uint8) uint32 { return uint32(flags) << flagShift }

// wordFlags returns the flags byte of a flags word.
func wordFlags(w uint32) uint8 { return uint8(w >> flagShift) }

// u32 returns a pointer to the 4-byte field at byte off of the mapping that
// starts at base. The caller has checked that off+4 is inside the mapping
// and that off is a multiple of fieldAlign.
func u32(base unsafe.Pointer, off uint32) *uint32 {
	return (*uint32)(unsafe.Add(base, off))
}

// i32 is u32 for the signed fields (free and in-use counts).
func i32(base unsafe.Pointer, off uint32) *int32 {
	return (*int32)(unsafe.Add(base, off))
}

// load32 reads the field at off once, atomically, so that a value the peer
// changes concurrently is validated and used as the same value.
func load32(base unsafe.Pointer, off uint32) uint32 {
	return atomic.LoadUint32(u32(base, off))
}
