//go:build unix

package buffer

import (
	"math"
	"testing"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"
)

// mmapShared returns an anonymous shared mapping of size bytes, unmapped
// when t ends.
func mmapShared(t *testing.T, size int) []byte {
	t.Helper()
	mem, err := unix.Mmap(-1, 0, size, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED|unix.MAP_ANON)
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, unix.Munmap(mem)) })
	return mem
}

func TestFormatSharedMapping(t *testing.T) {
	mem := mmapShared(t, defaultRegionSize)
	r, err := Format(mem, PeerSizeClasses())
	require.NoError(t, err)
	checkPeerLayout(t, mem, r)

	// A second view, as the peer would have, shares every list.
	a, err := Attach(mem)
	require.NoError(t, err)
	w := r.newChainWriter()
	want := pattern(1<<20, 9)
	_, err = w.Write(want)
	require.NoError(t, err)
	head, _ := w.Finish()
	got, _ := readChain(t, a, head)
	require.Equal(t, want, got)
	n, err := a.FreeChain(head)
	require.NoError(t, err)
	require.Equal(t, 9, n) // 8 slices of 131052 bytes and one of 8172
	require.Equal(t, []int{0, 0, 0}, r.InUse())
}

// TestMemoryTooLarge checks that a mapping of 4 GiB is refused: offsets in
// shared memory are 32-bit. The mapping is reserved, never touched.
func TestMemoryTooLarge(t *testing.T) {
	if math.MaxInt == math.MaxInt32 {
		t.Skip("32-bit address space")
	}
	var size uint64 = 1 << 32 // a variable: the constant overflows int on 32-bit builds
	mem, err := unix.Mmap(-1, 0, int(size), unix.PROT_NONE, unix.MAP_PRIVATE|unix.MAP_ANON|unix.MAP_NORESERVE)
	if err != nil {
		t.Skipf("cannot reserve 4 GiB: %v", err)
	}
	defer unix.Munmap(mem)
	_, err = Format(mem, PeerSizeClasses())
	require.ErrorIs(t, err, errBadConfig)
	_, err = Attach(mem)
	require.ErrorIs(t, err, ErrCorrupt)
}
