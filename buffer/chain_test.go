package buffer

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"sync"
	"testing"

	"github.com/stretchr/testify/require"
)

// pattern returns n bytes that differ from any shifted copy of themselves
// over short distances, so that a misplaced slice shows.
func pattern(n int, seed byte) []byte {
	p := make([]byte, n)
	for i := range p {
		p[i] = byte(i*7+i>>8) ^ seed
	}
	return p
}

// readChain reads a whole chain with Next, checking each slice, and
// returns the bytes and the slices' list indexes.
func readChain(t *testing.T, r *Region, head uint32) ([]byte, []int) {
	t.Helper()
	var c ChainReader
	require.NoError(t, c.Reset(r, head))
	var got []byte
	var classes []int
	for {
		p, off, err := c.Next()
		if err == io.EOF {
			return got, classes
		}
		require.NoError(t, err)
		h, err := r.slice(off)
		require.NoError(t, err)
		require.Equal(t, int(h.Size), len(p))
		k := -1
		for i, l := range r.listInfo() {
			if off > l.Offset {
				k = i
			}
		}
		classes = append(classes, k)
		got = append(got, p...)
	}
}

// capacity returns the bytes a region's slices can carry at most: cap-1
// slices per list.
func capacity(r *Region) int {
	n := 0
	for _, l := range r.listInfo() {
		n += int(l.Cap-1) * int(l.SliceSize)
	}
	return n
}

func TestChainRoundTrip(t *testing.T) {
	r, _ := testRegion(t, defaultRegionSize, PeerSizeClasses())
	w := r.newChainWriter()
	for _, tc := range []struct {
		size  int
		chunk int // bytes per Write; 0: one Write
	}{
		{1, 0}, {100, 0}, {8172, 0}, {8173, 0}, {32748, 0}, {32749, 0}, {100000, 0},
		{131052, 0}, {131053, 0}, {1 << 20, 0}, {5 << 20, 0}, {8 << 20, 0},
		{100000, 1}, {1 << 20, 4093}, {8 << 20, 64 << 10},
	} {
		t.Run(fmt.Sprintf("%d/%d", tc.size, tc.chunk), func(t *testing.T) {
			if testing.Short() && tc.chunk == 1 {
				t.Skip("byte by byte")
			}
			want := pattern(tc.size, byte(tc.chunk))
			chunk := tc.chunk
			if chunk == 0 {
				chunk = tc.size
			}
			for p := want; len(p) > 0; {
				k := min(chunk, len(p))
				n, err := w.Write(p[:k])
				require.NoError(t, err)
				require.Equal(t, k, n)
				p = p[k:]
			}
			require.Equal(t, tc.size, w.Len())
			head, size := w.Finish()
			require.Equal(t, tc.size, size)
			require.Zero(t, w.Len(), "Finish resets")

			got, classes := readChain(t, r, head)
			require.True(t, bytes.Equal(want, got), "payload differs")
			if tc.size == 8<<20 && tc.chunk == 0 {
				// 50 slices of the largest class, then the rest
				// from the next one down.
				require.Equal(t, 2, classes[0])
				require.Equal(t, 2, classes[49])
				require.Equal(t, 1, classes[50])
			}
			if tc.size <= 8172 {
				require.Equal(t, []int{0}, classes)
			}

			var c ChainReader
			require.NoError(t, c.Reset(r, head))
			got, err := io.ReadAll(chainIO{&c})
			require.NoError(t, err)
			require.True(t, bytes.Equal(want, got), "Read differs")

			n, err := r.FreeChain(head)
			require.NoError(t, err)
			require.Equal(t, len(classes), n)
			require.Equal(t, []int{0, 0, 0}, r.InUse())
		})
	}
}

// TestChainNoSpace writes more than the region holds: Write must return
// every byte it could place and ErrNoSpace, and the partial chain must be
// readable and freeable.
func TestChainNoSpace(t *testing.T) {
	r, _ := testRegion(t, defaultRegionSize, PeerSizeClasses())
	total := capacity(r)
	want := pattern(40<<20, 1)
	var w ChainWriter
	w.Reset(r)
	n, err := w.Write(want)
	require.Same(t, ErrNoSpace, err)
	require.Equal(t, total, n, "every usable slice filled")
	require.Equal(t, n, w.Len())
	n2, err := w.Write([]byte{1})
	require.ErrorIs(t, err, ErrNoSpace)
	require.Zero(t, n2)
	_, err = w.Reserve(1)
	require.ErrorIs(t, err, ErrNoSpace)
	require.Equal(t, n, w.Len(), "failed calls write nothing")

	head, size := w.Finish()
	require.Equal(t, n, size)
	got, _ := readChain(t, r, head)
	require.True(t, bytes.Equal(want[:n], got))
	freed, err := r.FreeChain(head)
	require.NoError(t, err)
	require.Equal(t, 2046+306+50, freed)
	require.Equal(t, []int{0, 0, 0}, r.InUse())

	// Abort of a partial chain.
	n, err = w.Write(want)
	require.ErrorIs(t, err, ErrNoSpace)
	require.Equal(t, total, n)
	require.NoError(t, w.Abort())
	require.Zero(t, w.Len())
	require.Equal(t, []int{0, 0, 0}, r.InUse())
}

func TestChainReserve(t *testing.T) {
	r, _ := testRegion(t, smallSize, smallClasses)
	w := r.newChainWriter()

	b, err := w.Reserve(0)
	require.NoError(t, err)
	require.Nil(t, b)
	_, err = w.Reserve(r.MaxSliceSize() + 1)
	require.ErrorIs(t, err, ErrTooLarge)

	// Reserve, Write and Reserve again share the first slice while it has
	// room.
	b, err = w.Reserve(4)
	require.NoError(t, err)
	require.Len(t, b, 4)
	require.Equal(t, 4, cap(b))
	copy(b, "abcd")
	_, err = w.Write([]byte("efgh"))
	require.NoError(t, err)
	b, err = w.Reserve(100)
	require.NoError(t, err)
	copy(b, bytes.Repeat([]byte{'x'}, 100))
	require.Equal(t, 108, w.Len())
	// 124-108 bytes left: a 20-byte reservation takes a new slice and
	// leaves the 16 bytes unused.
	b, err = w.Reserve(20)
	require.NoError(t, err)
	copy(b, "0123456789abcdefghij")
	// A full-size reservation takes a slice of the largest class.
	b, err = w.Reserve(r.MaxSliceSize())
	require.NoError(t, err)
	require.Len(t, b, r.MaxSliceSize())
	b[0], b[len(b)-1] = 'F', 'L'
	require.Equal(t, []int{2, 0, 1}, r.InUse())

	head, size := w.Finish()
	require.Equal(t, 128+r.MaxSliceSize(), size)
	got, classes := readChain(t, r, head)
	require.Equal(t, []int{0, 0, 2}, classes)
	require.Equal(t, "abcdefgh"+string(bytes.Repeat([]byte{'x'}, 100))+"0123456789abcdefghij", string(got[:128]))
	require.Equal(t, byte('F'), got[128])
	require.Equal(t, byte('L'), got[len(got)-1])
	n, err := r.FreeChain(head)
	require.NoError(t, err)
	require.Equal(t, 3, n)

	// Reserve falls through to larger classes only.
	for range 2 {
		_, err := w.Reserve(4000)
		require.NoError(t, err)
	}
	_, err = w.Reserve(4000)
	require.ErrorIs(t, err, ErrNoSpace)
	require.NoError(t, w.Abort())
	require.Equal(t, []int{0, 0, 0}, r.InUse())
}

func TestChainEmpty(t *testing.T) {
	r, _ := testRegion(t, smallSize, smallClasses)
	w := r.newChainWriter()
	n, err := w.Write(nil)
	require.NoError(t, err)
	require.Zero(t, n)
	head, size := w.Finish()
	require.Zero(t, head)
	require.Zero(t, size)
	require.NoError(t, w.Abort())
	require.Equal(t, []int{0, 0, 0}, r.InUse())

	var c ChainReader
	require.Error(t, c.Reset(r, 0))
	n, err = c.Read(make([]byte, 1))
	require.Zero(t, n)
	require.Equal(t, io.EOF, err)
}

// TestChainReaderMixed interleaves Read and Next.
func TestChainReaderMixed(t *testing.T) {
	r, _ := testRegion(t, smallSize, smallClasses)
	w := r.newChainWriter()
	want := pattern(300, 3) // 124 + 124 + 52 bytes in class 0 slices
	for i := 0; i < len(want); i += 100 {
		_, err := w.Write(want[i : i+100])
		require.NoError(t, err)
	}
	head, _ := w.Finish()

	var c ChainReader
	require.NoError(t, c.Reset(r, head))
	buf := make([]byte, 10)
	n, err := c.Read(buf)
	require.NoError(t, err)
	require.Equal(t, want[:10], buf[:n])
	p, off, err := c.Next()
	require.NoError(t, err)
	require.Equal(t, head, off)
	require.Equal(t, want[10:124], p, "Next returns what Read left")
	p, _, err = c.Next()
	require.NoError(t, err)
	require.Equal(t, want[124:248], p)
	rest, err := io.ReadAll(chainIO{&c})
	require.NoError(t, err)
	require.Equal(t, want[248:], rest)
	_, _, err = c.Next()
	require.Equal(t, io.EOF, err)

	n2, err := r.FreeChain(head)
	require.NoError(t, err)
	require.Equal(t, 3, n2)
}

func TestChainZeroAllocs(t *testing.T) {
	r, _ := testRegion(t, defaultRegionSize, PeerSizeClasses())
	var w ChainWriter
	var c ChainReader
	small := pattern(64, 0)
	large := pattern(1<<20, 0)
	for _, p := range [][]byte{small, large} {
		allocs := testing.AllocsPerRun(20, func() {
			w.Reset(r)
			if _, err := w.Write(p); err != nil {
				panic(err)
			}
			head, _ := w.Finish()
			if err := c.Reset(r, head); err != nil {
				panic(err)
			}
			for {
				if _, _, err := c.Next(); err != nil {
					if err != io.EOF {
						panic(err)
					}
					break
				}
			}
			if _, err := r.FreeChain(head); err != nil {
				panic(err)
			}
		})
		require.Zero(t, allocs, "%d bytes", len(p))
	}
}

// TestChainConcurrent sends chains from writer goroutines to reader
// goroutines, which check and free them, as two processes' streams would.
func TestChainConcurrent(t *testing.T) {
	r, _ := testRegion(t, defaultRegionSize, concurrentClasses)
	const writers, readers = 8, 8
	msgs := 300
	if testing.Short() {
		msgs = 30
	}
	type msg struct {
		head uint32
		size int
		seed byte
	}
	ch := make(chan msg, 64)
	errs := make(chan error, writers+readers)
	var ww, rw sync.WaitGroup
	for g := range writers {
		ww.Go(func() {
			var w ChainWriter
			w.Reset(r)
			for i := range msgs {
				seed := byte(g*31 + i)
				size := 1 + (i*997+g*131)%3000
				if _, err := w.Write(pattern(size, seed)); err != nil {
					errs <- err
					return
				}
				head, n := w.Finish()
				ch <- msg{head, n, seed}
			}
		})
	}
	for range readers {
		rw.Go(func() {
			var c ChainReader
			buf := make([]byte, 3000)
			for m := range ch {
				if err := c.Reset(r, m.head); err != nil {
					errs <- err
					return
				}
				n, err := io.ReadFull(chainIO{&c}, buf[:m.size])
				if err != nil || n != m.size {
					errs <- fmt.Errorf("read %d of %d bytes: %w", n, m.size, err)
					return
				}
				if !bytes.Equal(buf[:n], pattern(m.size, m.seed)) {
					errs <- errors.New("payload differs")
					return
				}
				if _, err := r.FreeChain(m.head); err != nil {
					errs <- err
					return
				}
			}
		})
	}
	ww.Wait()
	close(ch)
	rw.Wait()
	close(errs)
	for err := range errs {
		require.NoError(t, err)
	}
	require.Equal(t, []int{0, 0, 0}, r.InUse())
}

// chainIO is a ChainReader as an io.Reader.
type chainIO struct{ c *ChainReader }

func (r chainIO) Read(p []byte) (int, error) { return r.c.Read(p) }

// While the largest class runs short (under a quarter of its slices free),
// Write leaves it to what fills it: a rest smaller than one of its slices
// starts at the class below (writeWant), so a 64 KiB event takes two
// 32 KiB slices of the default classes (and an 8 KiB one for the 40 bytes
// their headers take, which WholeSlices leaves out of the event), not half
// of a 128 KiB one. With large slices plentiful, or the classes below
// exhausted, the event takes one.
func TestWriteLeavesLargestClassWhenShort(t *testing.T) {
	r, _ := testRegion(t, defaultRegionSize, PeerSizeClasses())
	w := r.newChainWriter()
	write := func(size int) []int {
		t.Helper()
		want := pattern(size, 7)
		n, err := w.Write(want)
		require.NoError(t, err)
		require.Equal(t, size, n)
		head, _ := w.Finish()
		got, classes := readChain(t, r, head)
		require.True(t, bytes.Equal(want, got), "payload differs")
		_, err = r.FreeChain(head)
		require.NoError(t, err)
		return classes
	}
	var held []uint32
	hold := func(size int) bool {
		t.Helper()
		off, err := r.Alloc(size)
		require.NoError(t, err)
		if r.SliceSize(off) != size {
			require.NoError(t, r.Free(off))
			return false
		}
		held = append(held, off)
		return true
	}
	mid := int(r.lists[1].dataSize)
	big := r.MaxSliceSize()
	largest := &r.lists[len(r.lists)-1]
	require.Equal(t, []int{2}, write(64<<10), "large slices plentiful: one per event")
	require.Equal(t, 64<<10, w.WholeSlices(64<<10))

	for !largest.short() {
		require.True(t, hold(big))
	}
	require.Equal(t, int(largest.cap)/4, int(largest.cap)-largest.used(), "free large slices once short")
	require.Equal(t, []int{1, 1, 0}, write(64<<10), "a 64 KiB event while short")
	require.Equal(t, 2*mid, w.WholeSlices(64<<10))
	require.Equal(t, []int{1, 1}, write(w.WholeSlices(64<<10)))
	require.Equal(t, mid, w.WholeSlices(mid+100))
	for _, n := range []int{0, 1, mid, big, big + 1} {
		require.Equal(t, n, w.WholeSlices(n), "%d bytes", n)
	}
	require.Equal(t, []int{1}, write(mid), "a rest that fills the middle class")
	require.Equal(t, []int{1, 1}, write(2*mid))
	require.Equal(t, []int{2}, write(big), "a rest that fills the largest class")
	require.Equal(t, []int{2, 0}, write(big+1))

	// With the middle class exhausted, a rest larger than the smallest
	// slices goes to the largest class before the smallest, as before.
	for hold(mid) {
	}
	require.Equal(t, []int{2}, write(64<<10))
	for _, off := range held {
		require.NoError(t, r.Free(off))
	}
	require.Equal(t, []int{0, 0, 0}, r.InUse())
}
