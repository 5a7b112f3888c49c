package buffer

import (
	"encoding/binary"
	"testing"

	"github.com/stretchr/testify/require"
)

// TestLayoutOffsets checks the offset constants against the byte maps of
// docs/protocol.md sections 2.1 to 2.3.
func TestLayoutOffsets(t *testing.T) {
	for _, tc := range []struct {
		name      string
		got, want int
	}{
		{"region lists", regionOffLists, 0},
		{"region reserved", regionOffReserved, 2},
		{"region used", regionOffUsed, 4},
		{"regionHeaderSize", regionHeaderSize, 8},
		{"list free", listOffFree, 0},
		{"list cap", listOffCap, 4},
		{"list head", listOffHead, 8},
		{"list tail", listOffTail, 12},
		{"list slice size", listOffSliceSize, 16},
		{"list in use", listOffInUse, 20},
		{"list counters", listOffInUse + 16, listHeaderSize},
		{"listHeaderSize", listHeaderSize, 36},
		{"slice cap", sliceOffCap, 0},
		{"slice size", sliceOffSize, 4},
		{"slice start", sliceOffStart, 8},
		{"slice next", sliceOffNext, 12},
		{"slice flags", sliceOffFlags, 16},
		{"sliceHeaderSize", sliceHeaderSize, 20},
		{"flagNext", flagNext, 0x01},
		{"flagAllocated", flagAllocated, 0x02},
		{"defaultRegionSize", defaultRegionSize, 32 << 20},
	} {
		require.Equal(t, tc.want, tc.got, tc.name)
	}
	// Every shared field must stay 4-byte aligned for the atomics.
	for _, off := range []int{regionHeaderSize, listHeaderSize, sliceHeaderSize,
		listOffFree, listOffCap, listOffHead, listOffTail, listOffSliceSize, listOffInUse,
		sliceOffCap, sliceOffSize, sliceOffStart, sliceOffNext, sliceOffFlags} {
		require.Zero(t, off%fieldAlign, "offset %d", off)
	}
}

// TestFlagWord checks that the flags byte is the first byte of its word.
func TestFlagWord(t *testing.T) {
	var b [4]byte
	binary.NativeEndian.PutUint32(b[:], flagWord(flagNext|flagAllocated))
	require.Equal(t, [4]byte{0x03, 0, 0, 0}, b)
	require.Equal(t, uint8(flagAllocated), wordFlags(binary.NativeEndian.Uint32([]byte{0x02, 0xff, 0xff, 0xff})))
}

func TestPeerSizeClasses(t *testing.T) {
	a := PeerSizeClasses()
	require.Equal(t, []SizeClass{{8172, 50}, {32748, 30}, {131052, 20}}, a)
	a[0].SliceSize = 1
	require.Equal(t, uint32(8172), PeerSizeClasses()[0].SliceSize, "each call returns a fresh slice")
}

// TestDefaultSizeClasses checks shmlink's default classes and the lists
// they make in a region of the default 32 MiB (docs/protocol.md section
// 2.2): the peers' slice sizes, with the largest class's share raised.
func TestDefaultSizeClasses(t *testing.T) {
	a := DefaultSizeClasses()
	require.Equal(t, []SizeClass{{8172, 20}, {32748, 30}, {131052, 50}}, a)
	a[2].Percent = 1
	require.Equal(t, uint32(50), DefaultSizeClasses()[2].Percent, "each call returns a fresh slice")

	mem := make([]byte, defaultRegionSize)
	r, err := Format(mem, DefaultSizeClasses())
	require.NoError(t, err)
	require.Equal(t, classLists(819, 307, 127), r.listInfo())
	require.Equal(t, 131052, r.MaxSliceSize())
	a2, err := Attach(mem)
	require.NoError(t, err)
	require.Equal(t, r.listInfo(), a2.listInfo(), "a peer reads the lists from the headers")
}

// classLists returns the lists that the peers' slice sizes (8, 32 and 128
// KiB with their header) make with caps slices each, laid out one after
// the other from the region header on (docs/protocol.md section 2.2).
func classLists(caps ...uint32) []listInfo {
	sizes := []uint32{8172, 32748, 131052}
	lists := make([]listInfo, len(caps))
	off := uint32(regionHeaderSize)
	for i, c := range caps {
		lists[i] = listInfo{Offset: off, Cap: c, SliceSize: sizes[i]}
		off += listHeaderSize + c*(sizes[i]+sliceHeaderSize)
	}
	return lists
}

// littleEndian skips t on a big-endian host: the expected bytes below are
// those of the amd64 and arm64 peers.
func littleEndian(t *testing.T) {
	t.Helper()
	if binary.NativeEndian.Uint16([]byte{1, 0}) != 1 {
		t.Skip("expected bytes are little-endian")
	}
}

// checkPeerLayout checks that mem holds a freshly formatted region of the
// peers' default classes (docs/protocol.md section 2.2) and that r
// describes it.
func checkPeerLayout(t *testing.T, mem []byte, r *Region) {
	t.Helper()
	littleEndian(t)
	require.Equal(t, []byte{0x03, 0x00, 0x00, 0x00, 0x6c, 0x60, 0xff, 0x01}, mem[:regionHeaderSize])

	lists := classLists(2047, 307, 51)
	require.Equal(t, []listInfo{
		{Offset: 8, Cap: 2047, SliceSize: 8172},
		{Offset: 8 + 36 + 2047*8192, Cap: 307, SliceSize: 32748},
		{Offset: 8 + 36 + 2047*8192 + 36 + 307*32768, Cap: 51, SliceSize: 131052},
	}, lists, "the peers' layout, spelled out")
	require.Equal(t, lists, r.listInfo())
	require.Equal(t, uint32(lists[2].Offset+36+51*131072), 8+binary.LittleEndian.Uint32(mem[4:]))
	require.Equal(t, defaultRegionSize, len(r.mem))
	require.Equal(t, 131052, r.MaxSliceSize())
	require.Equal(t, []int{0, 0, 0}, r.InUse())

	le := binary.LittleEndian
	for _, l := range r.listInfo() {
		h := mem[l.Offset:]
		stride := l.SliceSize + sliceHeaderSize
		require.Equal(t, l.Cap, le.Uint32(h[0:]), "free")
		require.Equal(t, l.Cap, le.Uint32(h[4:]), "cap")
		require.Equal(t, uint32(0), le.Uint32(h[8:]), "head")
		require.Equal(t, (l.Cap-1)*stride, le.Uint32(h[12:]), "tail")
		require.Equal(t, l.SliceSize, le.Uint32(h[16:]), "slice size")
		require.Equal(t, make([]byte, 16), h[20:36], "counters")
		area := l.Offset + listHeaderSize
		for i := uint32(0); i < l.Cap; i++ {
			s := mem[area+i*stride:]
			require.Equal(t, l.SliceSize, le.Uint32(s[0:]), "slice %d cap", i)
			require.Equal(t, uint32(0), le.Uint32(s[4:]), "slice %d size", i)
			require.Equal(t, uint32(0), le.Uint32(s[8:]), "slice %d start", i)
			if i < l.Cap-1 {
				require.Equal(t, (i+1)*stride, le.Uint32(s[12:]), "slice %d next", i)
				require.Equal(t, []byte{flagNext, 0, 0, 0}, s[16:20], "slice %d flags", i)
			} else {
				require.Equal(t, []byte{0, 0, 0, 0}, s[16:20], "last slice flags")
			}
		}
	}
}

func TestFormatPeerLayout(t *testing.T) {
	mem := make([]byte, defaultRegionSize)
	r, err := Format(mem, PeerSizeClasses())
	require.NoError(t, err)
	checkPeerLayout(t, mem, r)

	a, err := Attach(mem)
	require.NoError(t, err)
	require.Equal(t, r.listInfo(), a.listInfo())
}
