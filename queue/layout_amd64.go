package queue

// Legacy header layout, the one the amd64 peers use and the only one they
// interoperate with (docs/protocol.md section 3.1). Byte map of each half:
//
//	+0  cap          u32  events in this half, written once by the creator
//	+4  head         i64  consumer count, monotonic; only 4-byte aligned
//	+12 tail         i64  producer count, monotonic; only 4-byte aligned
//	+20 working flag u32  1 while the receiver is draining (section 3.3)
//	+24 events       eventSize*cap bytes
//
// x86 atomics accept the 4-byte aligned counters as long as they do not
// straddle a cache line; FormatPair and AttachPair reject caps for which
// the second half's counters would (cap%16 == 2 or 8).
const (
	offCap     = 0
	offHead    = offCap + 4
	offTail    = offHead + 8
	offWorking = offTail + 8
	offEvents  = offWorking + 4

	// counterAlign is the alignment in bytes head and tail need.
	counterAlign = 4

	// legacyLayout reports which of the two layouts this build uses.
	legacyLayout = true
)
