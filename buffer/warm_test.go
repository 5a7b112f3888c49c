package buffer

import (
	"testing"

	"github.com/stretchr/testify/require"
)

// With smallClasses, list 0 (227 slices of 124 B) keeps up to 16 slices
// warm, list 1 (37 slices) 4, list 2 (3 slices) none: an eighth of a list
// at most.

// FreeWarm's slices come back to this process's next Alloc, the most
// recent first, and count as free to this view only: the peer's view
// (another Attach of the same memory) counts them in use until then.
func TestFreeWarmReusesLastFreed(t *testing.T) {
	r, mem := testRegion(t, smallSize, smallClasses)
	peer, err := Attach(mem)
	require.NoError(t, err)
	a, err := r.Alloc(100)
	require.NoError(t, err)
	b, err := r.Alloc(100)
	require.NoError(t, err)
	require.NoError(t, r.FreeWarm(a))
	require.NoError(t, r.FreeWarm(b))
	require.Equal(t, []int{0, 0, 0}, r.InUse())
	require.Equal(t, []int{2, 0, 0}, peer.InUse(), "the peer sees kept slices in use")
	free := r.FreeBytes()
	require.Equal(t, free-2*124, peer.FreeBytes())

	got, err := r.Alloc(100)
	require.NoError(t, err)
	require.Equal(t, b, got, "the last freed comes first")
	got, err = r.Alloc(100)
	require.NoError(t, err)
	require.Equal(t, a, got)
	require.Equal(t, []int{2, 0, 0}, r.InUse())
	require.Equal(t, byte(flagAllocated), byte(get32(mem, a+sliceOffFlags)), "handed out allocated")
	require.NoError(t, r.Free(a))
	require.NoError(t, r.Free(b))
	require.Equal(t, []int{0, 0, 0}, peer.InUse(), "Free pushes")
}

// A list keeps at most its bound warm; the rest of the frees push, and
// ReleaseWarm pushes the kept ones.
func TestFreeWarmBoundAndRelease(t *testing.T) {
	r, mem := testRegion(t, smallSize, smallClasses)
	peer, err := Attach(mem)
	require.NoError(t, err)
	var offs []uint32
	for range 40 {
		off, err := r.Alloc(100)
		require.NoError(t, err)
		offs = append(offs, off)
	}
	for _, off := range offs {
		require.NoError(t, r.FreeWarm(off))
	}
	require.Equal(t, []int{16, 0, 0}, peer.InUse(), "list 0 keeps 16")
	require.Equal(t, []int{0, 0, 0}, r.InUse())

	var mid []uint32
	for range 6 {
		off, err := r.Alloc(400) // list 1: keeps 4
		require.NoError(t, err)
		mid = append(mid, off)
	}
	for _, off := range mid {
		require.NoError(t, r.FreeWarm(off))
	}
	require.Equal(t, []int{16, 4, 0}, peer.InUse())
	big, err := r.Alloc(4000) // list 2: 3 slices, keeps none
	require.NoError(t, err)
	require.NoError(t, r.FreeWarm(big))
	require.Equal(t, []int{16, 4, 0}, peer.InUse())

	require.NoError(t, r.ReleaseWarm())
	require.Equal(t, []int{0, 0, 0}, peer.InUse())
	require.Equal(t, []int{0, 0, 0}, r.InUse())
	require.NoError(t, r.ReleaseWarm(), "nothing left to release")
}

// While under a quarter of a list is free, FreeWarm pushes, so that the
// peer does not run short for this process's sake.
func TestFreeWarmNotWhenShort(t *testing.T) {
	r, mem := testRegion(t, smallSize, smallClasses)
	peer, err := Attach(mem)
	require.NoError(t, err)
	var offs []uint32
	for {
		off, err := r.Alloc(100)
		if err == ErrNoSpace {
			break
		}
		require.NoError(t, err)
		offs = append(offs, off)
		if len(offs) == 200 { // 27 of 227 left: under a quarter
			break
		}
	}
	require.NoError(t, r.FreeWarm(offs[0]))
	require.Equal(t, 199, peer.InUse()[0], "pushed: the peer sees it free")
}

// A slice kept warm has flags 0: freeing it again is a double free, and
// the slice is still handed out once.
func TestFreeWarmDoubleFree(t *testing.T) {
	r, _ := testRegion(t, smallSize, smallClasses)
	a, err := r.Alloc(100)
	require.NoError(t, err)
	require.NoError(t, r.FreeWarm(a))
	require.ErrorIs(t, r.Free(a), ErrCorrupt)
	require.ErrorIs(t, r.FreeWarm(a), ErrCorrupt)
	got, err := r.Alloc(100)
	require.NoError(t, err)
	require.Equal(t, a, got)
	next, err := r.Alloc(100)
	require.NoError(t, err)
	require.NotEqual(t, a, next, "handed out once")
}

// A peer that writes the flags of a slice we keep warm (it never owned it)
// makes our next Alloc of that list fail with ErrCorrupt, and the slice is
// dropped, never handed out; ReleaseWarm skips such a slice.
func TestWarmSliceWrittenByPeer(t *testing.T) {
	r, mem := testRegion(t, smallSize, smallClasses)
	a, err := r.Alloc(100)
	require.NoError(t, err)
	b, err := r.Alloc(100)
	require.NoError(t, err)
	require.NoError(t, r.FreeWarm(a))
	require.NoError(t, r.FreeWarm(b))
	put32(mem, b+sliceOffFlags, uint32(flagAllocated))
	_, err = r.Alloc(100)
	require.ErrorIs(t, err, ErrCorrupt)
	put32(mem, a+sliceOffFlags, uint32(flagNext))
	require.NoError(t, r.ReleaseWarm())
	got, err := r.Alloc(100)
	require.NoError(t, err)
	require.NotEqual(t, a, got)
	require.NotEqual(t, b, got)
}
