package buffer

import "errors"

var (
	// ErrNoSpace is returned by Region.Alloc, ChainWriter.Write and
	// ChainWriter.Reserve when no buffer list that may serve the request has
	// a slice to hand out; the last free slice of a list is never handed out
	// (docs/protocol.md section 2.4). It is not fatal: the caller may retry after
	// the peer recycled slices, or send the data on the socket as
	// FallbackData. Region.Alloc returns it unwrapped, without allocating.
	ErrNoSpace = errors.New("buffer: no free slice")

	// ErrCorrupt is returned, wrapped with the operation and the bad value,
	// when something read from shared memory is impossible: an offset that
	// is not a slice header of the region, a slice cap that differs from its
	// list's, size and start past the cap, a chain longer than the region
	// has slices, a free list whose head or tail points outside the list, a
	// slice freed twice, or a region header (Attach) that does not describe
	// the mapping. The peer broke the protocol: the session must end.
	ErrCorrupt = errors.New("buffer: corrupt shared memory")

	// errBadConfig is returned, wrapped with the reason, by Format when the
	// size classes or the memory cannot make a region: no classes or more
	// than 32, slice sizes not ascending or not multiples of 4, percents
	// not summing to 100, a list of fewer than 2 slices, memory too small,
	// 4 GiB or larger, or not 4-byte aligned.
	errBadConfig = errors.New("buffer: bad region config")

	// ErrTooLarge is returned by ChainWriter.Reserve when the reservation is
	// larger than Region.MaxSliceSize (a reservation is contiguous, so it
	// must fit in one slice), and by Region.SetPayload when the size is
	// larger than the slice.
	ErrTooLarge = errors.New("buffer: larger than a slice")
)
