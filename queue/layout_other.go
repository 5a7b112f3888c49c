//go:build !amd64

package queue

// Aligned header layout, the one the arm64 peers use (docs/protocol.md section
// 3.1). Byte map of each half:
//
//	+0  cap          u32  events in this half, written once by the creator
//	+4  working flag u32  1 while the receiver is draining (section 3.3)
//	+8  head         i64  consumer count, monotonic
//	+16 tail         i64  producer count, monotonic
//	+24 events       eventSize*cap bytes
//
// 64-bit atomics need 8-byte alignment outside amd64, so FormatPair and
// AttachPair reject an odd cap, which would misalign the second half.
const (
	offCap     = 0
	offWorking = offCap + 4
	offHead    = offWorking + 4
	offTail    = offHead + 8
	offEvents  = offTail + 8

	// counterAlign is the alignment in bytes head and tail need.
	counterAlign = 8

	// legacyLayout reports which of the two layouts this build uses.
	legacyLayout = false
)
