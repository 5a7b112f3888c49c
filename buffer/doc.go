// Package buffer implements the buffer region of the shmipc protocol
// (docs/protocol.md section 2): a shared-memory mapping cut into buffer lists of
// fixed-size slices, which both processes of a session allocate message
// slices from, lock-free, and which the receiver of a message recycles.
//
// The layout is the existing peers' (cloudwego/shmipc-go and the Rust
// crate shmipc), byte for byte, in host byte order:
//
//	region header, 8 bytes (section 2.1)
//	  +0  u16  number of buffer lists
//	  +2  u16  reserved, 0
//	  +4  u32  bytes used by the lists after this header
//	buffer list, 36 bytes of header, lists back to back by ascending slice size (2.2)
//	  +0  i32  free count
//	  +4  u32  cap: slices in the list
//	  +8  u32  head: first free slice, relative to the slice area (list + 36)
//	  +12 u32  tail: last free slice, same base
//	  +16 u32  data bytes per slice
//	  +20 16 bytes of informational counters (+20: i32 slices in use)
//	  +36 cap slices
//	slice, 20 bytes of header then the data (2.3)
//	  +0  u32  cap: data bytes
//	  +4  u32  size: valid bytes
//	  +8  u32  start: first valid byte in data
//	  +12 u32  next: free list: area-relative; message chain: absolute offset
//	  +16 u8   flags: 0x01 next is valid, 0x02 allocated; 3 unused bytes
//	  +20      data
//
// A slice is named on the wire, in IO-queue events and chain links, by the
// absolute offset of its header from the start of the mapping. A message
// is a chain of slices linked by next and flag 0x01; Region.Alloc and
// Region.Free pop and push single slices, ChainWriter and ChainReader build
// and walk chains.
//
// The peer can write anything into the mapping at any time. A Region
// therefore reads the list geometry once, at Format or Attach, and checks
// every offset, link, size and count it later reads from shared memory
// against that copy: a bad value returns an error wrapping ErrCorrupt,
// never a panic, an access outside the mapping, or an endless loop.
package buffer
