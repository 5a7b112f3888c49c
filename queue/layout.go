package queue

import "fmt"

// Sizes and bounds of the IO queue (docs/protocol.md section 3).
const (
	// headerSize is the size in bytes of the header at the start of each
	// half of the queue (docs/protocol.md section 3.1).
	headerSize = offEvents

	// eventSize is the size in bytes of one event (docs/protocol.md section 3.2).
	eventSize = eventOffStatus + 4

	// defaultCap is the number of events per half that the existing peers
	// use; it makes a queue of Size(defaultCap) = 196656 bytes.
	defaultCap = 8192

	// MaxCap is the largest number of events per half FormatPair and
	// AttachPair accept (a queue of about 24 MiB). It bounds what an
	// untrusted peer can make this side map and index.
	MaxCap = 1 << 20
)

// Event layout, 12 bytes in host order (docs/protocol.md section 3.2). The
// prose spec's field order is wrong; the peers use this one:
//
//	+0  stream id                 u32
//	+4  offset of the first slice u32 (0 for a close)
//	+8  status                    u32 (low byte = stream state)
//	+12 next event
const (
	eventOffStreamID = 0
	eventOffOffset   = eventOffStreamID + 4
	eventOffStatus   = eventOffOffset + 4
)

// cacheLine is the size in bytes of the cache line an atomic counter must
// not straddle. A line-straddling (split) lock on x86 is orders of
// magnitude slower, and with split-lock detection it traps into the kernel.
const cacheLine = 64

// The header layout itself is per architecture: layout_amd64.go holds the
// legacy layout of the amd64 peers, layout_other.go the aligned one.
// Both define offCap, offWorking, offHead, offTail and offEvents, plus
// counterAlign, the alignment in bytes the 64-bit counters need.

// Size returns the size in bytes of a whole queue file of cap events per
// half: two halves of a 24-byte header and 12 bytes per event (docs/protocol.md
// section 3). For cap > MaxCap the result is not a usable size.
func Size(cap uint32) int {
	return 2 * halfSize(cap)
}

// halfSize returns the size in bytes of one half, header included.
func halfSize(cap uint32) int {
	return headerSize + eventSize*int(cap)
}

// checkPlacement returns an error wrapping errBadConfig when the counters
// of the half starting at byte base of a 64-byte aligned mapping cannot be
// used atomically on this architecture: misaligned for counterAlign, or
// straddling a cache line.
func checkPlacement(half string, base int) error {
	for _, c := range [...]struct {
		name string
		off  int
	}{{"head", base + offHead}, {"tail", base + offTail}} {
		if c.off%counterAlign != 0 {
			return fmt.Errorf("%w: the %s half's %s counter at byte %d is not %d-byte aligned",
				errBadConfig, half, c.name, c.off, counterAlign)
		}
		if c.off/cacheLine != (c.off+7)/cacheLine {
			return fmt.Errorf("%w: the %s half's %s counter at byte %d straddles a %d-byte cache line",
				errBadConfig, half, c.name, c.off, cacheLine)
		}
	}
	return nil
}
