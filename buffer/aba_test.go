package buffer

import (
	"testing"

	"github.com/stretchr/testify/require"
)

// The ABA of the free list (docs/protocol.md section 2.4): our pop reads
// head A and its next B, and pauses before its CAS; meanwhile the peer
// (another view of the same memory, as another process has) pops A to D,
// frees A and C, and pops E to H, so that A is the head again, now linked
// to C. Our CAS then installs B, which the peer holds. What the list
// hands out next must be an error, not B a second time nor a list stuck
// with free slices on it.
func TestFreeListABA(t *testing.T) {
	for _, peerKeepsNext := range []bool{false, true} {
		name := "peer-clears-next"
		if peerKeepsNext {
			// A peer whose allocation leaves flagNext set, as a
			// damaged or foreign implementation may.
			name = "peer-keeps-next"
		}
		t.Run(name, func(t *testing.T) {
			mem := make([]byte, regionHeaderSize+listHeaderSize+8*(44+sliceHeaderSize))
			ours, err := Format(mem, []SizeClass{{SliceSize: 44, Percent: 100}})
			require.NoError(t, err)
			peer, err := Attach(mem)
			require.NoError(t, err)
			l := ours.listInfo()[0]
			require.EqualValues(t, 8, l.Cap)
			slice := func(i uint32) uint32 { return sliceOff(l, i) }

			paused, resume := make(chan struct{}), make(chan struct{})
			ours.lists[0].popHook = func() {
				ours.lists[0].popHook = nil // this pop only
				close(paused)
				<-resume
			}
			type result struct {
				off uint32
				err error
			}
			first := make(chan result, 1)
			go func() {
				off, err := ours.Alloc(0)
				first <- result{off, err}
			}()
			<-paused // read head A, next B

			var held []uint32
			for range 4 {
				off, err := peer.Alloc(0)
				require.NoError(t, err)
				held = append(held, off)
			}
			require.Equal(t, []uint32{slice(0), slice(1), slice(2), slice(3)}, held)
			require.NoError(t, peer.Free(slice(0))) // A
			require.NoError(t, peer.Free(slice(2))) // C, linked after A
			for i := range uint32(4) {
				off, err := peer.Alloc(0)
				require.NoError(t, err)
				require.Equal(t, slice(4+i), off)
			}
			if peerKeepsNext {
				put32(mem, slice(1)+sliceOffFlags, flagWord(flagNext|flagAllocated))
			}
			close(resume)
			r := <-first
			require.NoError(t, r.err)
			require.Equal(t, slice(0), r.off, "our pop gets A")
			require.NoError(t, peer.Free(slice(3))) // D: two slices on the list again

			off, err := ours.Alloc(0)
			require.NotEqual(t, slice(1), off, "B handed out twice")
			require.ErrorIs(t, err, ErrCorrupt, "the damaged list must be reported (got offset %d)", off)
		})
	}
}
