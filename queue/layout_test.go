package queue

import (
	"encoding/binary"
	"errors"
	"runtime"
	"testing"
	"unsafe"

	"github.com/stretchr/testify/require"
)

// alignedMem returns n zero bytes starting on a cache line, like a mapping.
func alignedMem(n int) []byte {
	buf := make([]byte, n+cacheLine)
	off := int(-uintptr(unsafe.Pointer(&buf[0])) % cacheLine)
	return buf[off : off+n : off+n]
}

// validCap reports whether this architecture can use a queue of cap
// events, per the rule FormatPair documents.
func validCap(cap uint32) bool {
	if cap < 1 || cap > MaxCap {
		return false
	}
	if legacyLayout {
		return cap%16 != 2 && cap%16 != 8
	}
	return cap%2 == 0
}

// TestLayout checks the header offsets of this build's layout against the
// table in docs/protocol.md section 3.1 and the event against section 3.2.
func TestLayout(t *testing.T) {
	type offsets struct{ cap, head, tail, working, events int }
	want := map[bool]offsets{
		true:  {cap: 0, head: 4, tail: 12, working: 20, events: 24}, // legacy (amd64 peers)
		false: {cap: 0, head: 8, tail: 16, working: 4, events: 24},  // aligned (arm64 peers)
	}
	require.Equal(t, runtime.GOARCH == "amd64", legacyLayout, "amd64 builds must use the legacy layout")
	got := offsets{cap: offCap, head: offHead, tail: offTail, working: offWorking, events: offEvents}
	require.Equal(t, want[legacyLayout], got)

	require.Equal(t, 24, headerSize)
	require.Equal(t, 12, eventSize)
	require.Equal(t, [3]int{0, 4, 8}, [3]int{eventOffStreamID, eventOffOffset, eventOffStatus})
}

func TestSize(t *testing.T) {
	for _, tc := range []struct {
		cap  uint32
		want int
	}{
		{defaultCap, 196656}, // docs/protocol.md section 3
		{1, 2 * (24 + 12)},
		{7, 2 * (24 + 7*12)},
		{MaxCap, 2 * (24 + 12<<20)},
	} {
		require.Equal(t, tc.want, Size(tc.cap), "cap %d", tc.cap)
	}
}

// TestFormatPairHeader checks the bytes FormatPair writes.
func TestFormatPairHeader(t *testing.T) {
	mem := alignedMem(Size(defaultCap))
	for i := range mem {
		mem[i] = 0xa5
	}
	first, second, err := FormatPair(mem, defaultCap)
	require.NoError(t, err)
	require.Equal(t, uint32(defaultCap), first.capacity())
	require.Equal(t, uint32(defaultCap), second.capacity())
	for _, base := range []int{0, Size(defaultCap) / 2} {
		require.Equal(t, uint32(defaultCap), binary.NativeEndian.Uint32(mem[base+offCap:]))
		require.Zero(t, binary.NativeEndian.Uint64(mem[base+offHead:]))
		require.Zero(t, binary.NativeEndian.Uint64(mem[base+offTail:]))
		require.Zero(t, binary.NativeEndian.Uint32(mem[base+offWorking:]))
	}
	require.True(t, first.Empty())
	require.False(t, first.Working())
}

// TestPlacement checks which caps FormatPair and AttachPair accept on
// this architecture: defaultCap must be fine for both halves.
func TestPlacement(t *testing.T) {
	require.True(t, validCap(defaultCap))
	require.NoError(t, checkPlacement("first", 0))
	require.NoError(t, checkPlacement("second", Size(defaultCap)/2))

	for cap := uint32(1); cap <= 64; cap++ {
		mem := alignedMem(Size(cap))
		_, _, err := FormatPair(mem, cap)
		if validCap(cap) {
			require.NoError(t, err, "cap %d", cap)
			_, _, err = AttachPair(mem)
			require.NoError(t, err, "cap %d", cap)
			continue
		}
		require.ErrorIs(t, err, errBadConfig, "cap %d", cap)
		require.ErrorContains(t, err, "second half")
		if legacyLayout {
			require.ErrorContains(t, err, "straddles a 64-byte cache line")
		} else {
			require.ErrorContains(t, err, "8-byte aligned")
		}
		// A peer's file with such a cap is refused the same way.
		binary.NativeEndian.PutUint32(mem[offCap:], cap)
		binary.NativeEndian.PutUint32(mem[Size(cap)/2+offCap:], cap)
		_, _, err = AttachPair(mem)
		require.ErrorIs(t, err, errBadConfig, "cap %d", cap)
	}
}

func TestFormatPairErrors(t *testing.T) {
	for _, tc := range []struct {
		name string
		mem  []byte
		cap  uint32
	}{
		{"cap 0", alignedMem(Size(1)), 0},
		{"cap above MaxCap", alignedMem(64), MaxCap + 1},
		{"memory too short", alignedMem(Size(4) - 1), 4},
		{"memory too long", alignedMem(Size(4) + 1), 4},
		{"memory misaligned", alignedMem(Size(4) + 4)[4:], 4},
		{"nil memory", nil, 4},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, _, err := FormatPair(tc.mem, tc.cap)
			require.ErrorIs(t, err, errBadConfig)
		})
	}
}

func TestAttachPair(t *testing.T) {
	const cap = 6
	mem := alignedMem(Size(cap))
	cf, cr, err := FormatPair(mem, cap)
	require.NoError(t, err)
	ss, sr, err := AttachPair(mem)
	require.NoError(t, err)
	require.Equal(t, uint32(cap), ss.capacity())

	// Client sends on the first half, the server receives there.
	require.NoError(t, cf.Put(Event{StreamID: 2, Offset: 8, Status: 0}))
	require.True(t, cr.Empty())
	e, ok, err := ss.Pop()
	require.NoError(t, err)
	require.True(t, ok)
	require.Equal(t, Event{StreamID: 2, Offset: 8}, e)
	// And the other way round.
	require.NoError(t, sr.Put(Event{StreamID: 2, Status: 1}))
	require.True(t, ss.Empty())
	e, ok, err = cr.Pop()
	require.NoError(t, err)
	require.True(t, ok)
	require.Equal(t, Event{StreamID: 2, Status: 1}, e)

	// The cap is cached: a peer rewriting it later changes nothing.
	binary.NativeEndian.PutUint32(mem[offCap:], 1)
	require.Equal(t, uint32(cap), ss.capacity())
	for i := range cap {
		require.NoError(t, cf.Put(Event{StreamID: uint32(i)}))
	}
	require.ErrorIs(t, cf.Put(Event{}), ErrFull)
}

func TestAttachPairErrors(t *testing.T) {
	const cap = 6
	formatted := func() []byte {
		mem := alignedMem(Size(cap))
		_, _, err := FormatPair(mem, cap)
		require.NoError(t, err)
		return mem
	}
	second := Size(cap) / 2
	for _, tc := range []struct {
		name  string
		mem   func() []byte
		isErr error
	}{
		{"empty", func() []byte { return nil }, ErrCorrupt},
		{"shorter than a header", func() []byte { return formatted()[:headerSize-1] }, ErrCorrupt},
		{"cap 0", func() []byte {
			m := formatted()
			binary.NativeEndian.PutUint32(m[offCap:], 0)
			return m
		}, ErrCorrupt},
		{"cap above MaxCap", func() []byte {
			m := formatted()
			binary.NativeEndian.PutUint32(m[offCap:], MaxCap+1)
			return m
		}, ErrCorrupt},
		{"cap larger than the file", func() []byte {
			m := formatted()
			binary.NativeEndian.PutUint32(m[offCap:], cap+2)
			return m
		}, ErrCorrupt},
		{"caps differ", func() []byte {
			m := formatted()
			binary.NativeEndian.PutUint32(m[second+offCap:], cap-2)
			return m
		}, ErrCorrupt},
		{"file longer than the caps say", func() []byte {
			m := alignedMem(Size(cap) + 12)
			_, _, err := FormatPair(m[:Size(cap)], cap)
			require.NoError(t, err)
			return m
		}, ErrCorrupt},
		{"misaligned", func() []byte {
			m := alignedMem(Size(cap) + 8)[8:]
			binary.NativeEndian.PutUint32(m[offCap:], cap)
			binary.NativeEndian.PutUint32(m[second+offCap:], cap)
			return m
		}, errBadConfig},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, _, err := AttachPair(tc.mem())
			require.ErrorIs(t, err, tc.isErr)
			other := errBadConfig
			if tc.isErr == errBadConfig {
				other = ErrCorrupt
			}
			require.False(t, errors.Is(err, other))
		})
	}
}
