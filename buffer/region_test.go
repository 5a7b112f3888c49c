package buffer

import (
	"encoding/binary"
	"errors"
	"io"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/stretchr/testify/require"
)

// smallClasses make a 64 KiB region of three small lists:
// 227, 37 and 3 slices.
var smallClasses = []SizeClass{{SliceSize: 124, Percent: 50}, {SliceSize: 508, Percent: 30}, {SliceSize: 4092, Percent: 20}}

const smallSize = 64 << 10

// testRegion formats a region of size bytes of Go memory.
func testRegion(t testing.TB, size int, classes []SizeClass) (*Region, []byte) {
	t.Helper()
	mem := make([]byte, size)
	r, err := Format(mem, classes)
	require.NoError(t, err)
	return r, mem
}

func get32(mem []byte, off uint32) uint32    { return binary.NativeEndian.Uint32(mem[off:]) }
func put32(mem []byte, off uint32, v uint32) { binary.NativeEndian.PutUint32(mem[off:], v) }

// sliceOff returns the absolute offset of slice i of list l.
func sliceOff(l listInfo, i uint32) uint32 {
	return l.Offset + listHeaderSize + i*(l.SliceSize+sliceHeaderSize)
}

func TestFormatBadConfig(t *testing.T) {
	many := make([]SizeClass, maxLists+1)
	for i := range many {
		many[i] = SizeClass{SliceSize: uint32(4 * (i + 1)), Percent: 1}
	}
	many[0].Percent = 100 - maxLists
	for _, tc := range []struct {
		name    string
		size    int
		classes []SizeClass
	}{
		{"no classes", smallSize, nil},
		{"too many classes", 1 << 20, many},
		{"zero slice size", smallSize, []SizeClass{{0, 100}}},
		{"slice size not a multiple of 4", smallSize, []SizeClass{{1001, 100}}},
		{"descending", smallSize, []SizeClass{{508, 50}, {124, 50}}},
		{"duplicate", smallSize, []SizeClass{{124, 50}, {124, 50}}},
		{"percents below 100", smallSize, []SizeClass{{124, 50}, {508, 49}}},
		{"percents above 100", smallSize, []SizeClass{{124, 50}, {508, 51}}},
		{"percent overflow", smallSize, []SizeClass{{124, 1<<32 - 1}, {508, 101}}},
		{"list of one slice", smallSize, []SizeClass{{124, 99}, {508, 1}}},
		{"slice larger than memory", smallSize, []SizeClass{{1 << 20, 100}}},
		{"huge slice size", smallSize, []SizeClass{{1<<32 - 4, 100}}},
		{"more slices than a region may have", regionHeaderSize + listHeaderSize + (maxSlices+1)*24, []SizeClass{{4, 100}}},
		{"memory below headers", 40, []SizeClass{{124, 100}}},
		{"memory below region header", 4, []SizeClass{{124, 100}}},
		{"no memory", 0, []SizeClass{{124, 100}}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			mem := make([]byte, tc.size)
			r, err := Format(mem, tc.classes)
			require.ErrorIs(t, err, errBadConfig)
			require.Nil(t, r)
			require.Equal(t, make([]byte, tc.size), mem, "mem must be unchanged")
		})
	}
	t.Run("misaligned", func(t *testing.T) {
		mem := make([]byte, smallSize+1)
		_, err := Format(mem[1:], smallClasses)
		require.ErrorIs(t, err, errBadConfig)
	})
}

func TestFormatSmall(t *testing.T) {
	r, _ := testRegion(t, smallSize, smallClasses)
	got := r.listInfo()
	require.Len(t, got, 3)
	for i, want := range []uint32{227, 37, 3} {
		require.Equal(t, want, got[i].Cap, "list %d", i)
	}
	// A minimal region: one list of two slices.
	_, err := Format(make([]byte, regionHeaderSize+listHeaderSize+2*24), []SizeClass{{4, 100}})
	require.NoError(t, err)
}

func TestAttachGarbage(t *testing.T) {
	littleEndian(t)
	valid := func() []byte {
		_, mem := testRegion(t, smallSize, smallClasses)
		return mem
	}
	lists, _ := testRegion(t, smallSize, smallClasses)
	l := lists.listInfo()
	for _, tc := range []struct {
		name string
		mem  func() []byte
	}{
		{"empty", func() []byte { return nil }},
		{"short", func() []byte { return make([]byte, 4) }},
		{"zeros", func() []byte { return make([]byte, smallSize) }},
		{"ones", func() []byte {
			m := make([]byte, smallSize)
			for i := range m {
				m[i] = 0xff
			}
			return m
		}},
		{"no lists", func() []byte { m := valid(); m[0], m[1] = 0, 0; return m }},
		{"too many lists", func() []byte { m := valid(); m[0], m[1] = maxLists+1, 0; return m }},
		{"more lists than written", func() []byte { m := valid(); m[0] = 4; return m }},
		{"fewer lists than used", func() []byte { m := valid(); m[0] = 2; return m }},
		{"used past mapping", func() []byte { m := valid(); put32(m, 4, smallSize); return m }},
		{"used beyond lists", func() []byte { m := valid(); put32(m, 4, get32(m, 4)+4); return m }},
		{"used short of lists", func() []byte { m := valid(); put32(m, 4, get32(m, 4)-4); return m }},
		{"used huge", func() []byte { m := valid(); put32(m, 4, 1<<32-1); return m }},
		{"cap 0", func() []byte { m := valid(); put32(m, l[1].Offset+listOffCap, 0); return m }},
		{"cap huge", func() []byte { m := valid(); put32(m, l[1].Offset+listOffCap, 1<<32-1); return m }},
		{"cap plus one", func() []byte { m := valid(); put32(m, l[2].Offset+listOffCap, l[2].Cap+1); return m }},
		{"slice size 0", func() []byte { m := valid(); put32(m, l[0].Offset+listOffSliceSize, 0); return m }},
		{"slice size odd", func() []byte { m := valid(); put32(m, l[0].Offset+listOffSliceSize, 125); return m }},
		{"slice size huge", func() []byte { m := valid(); put32(m, l[2].Offset+listOffSliceSize, 1<<32-4); return m }},
		{"descending", func() []byte {
			m := valid()
			// One list of 100 slices of 508 then one of 124: same
			// bytes, wrong order.
			put32(m, 4, 2*listHeaderSize+100*528+100*144)
			m[0] = 2
			put32(m, 8+listOffCap, 100)
			put32(m, 8+listOffSliceSize, 508)
			second := uint32(8 + listHeaderSize + 100*528)
			put32(m, second+listOffCap, 100)
			put32(m, second+listOffSliceSize, 124)
			return m
		}},
		{"misaligned", func() []byte { m := make([]byte, smallSize+1); copy(m[1:], valid()); return m[1:] }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r, err := Attach(tc.mem())
			require.ErrorIs(t, err, ErrCorrupt)
			require.Nil(t, r)
		})
	}
}

// A region may have 2^20 slices (maxSlices), not one more: Format writes
// that many and Attach takes them, and a peer's header claiming more is
// refused, whatever the mapping's size (docs/protocol.md section 2.1).
func TestMaxSlices(t *testing.T) {
	littleEndian(t)
	size := regionHeaderSize + listHeaderSize + maxSlices*24
	mem := make([]byte, size)
	r, err := Format(mem, []SizeClass{{4, 100}})
	require.NoError(t, err)
	slices, _ := r.Capacity()
	require.Equal(t, maxSlices, slices)
	_, err = Attach(mem)
	require.NoError(t, err)

	// One more, by hand: one list of maxSlices+1 slices of 4 bytes.
	mem = make([]byte, size+24)
	mem[0] = 1
	put32(mem, 4, listHeaderSize+(maxSlices+1)*24)
	put32(mem, regionHeaderSize+listOffCap, maxSlices+1)
	put32(mem, regionHeaderSize+listOffSliceSize, 4)
	r, err = Attach(mem)
	require.ErrorIs(t, err, ErrCorrupt)
	require.ErrorContains(t, err, "more than the")
	require.Nil(t, r)
}

func TestAttachSharesState(t *testing.T) {
	r, mem := testRegion(t, smallSize, smallClasses)
	a, err := Attach(mem)
	require.NoError(t, err)
	require.Equal(t, r.listInfo(), a.listInfo())

	off, err := r.Alloc(100)
	require.NoError(t, err)
	require.Equal(t, []int{1, 0, 0}, a.InUse())
	require.NoError(t, a.Free(off))
	require.Equal(t, []int{0, 0, 0}, r.InUse())
	require.ErrorIs(t, r.Free(off), ErrCorrupt, "double free through the other view")
}

func TestAllocFree(t *testing.T) {
	r, mem := testRegion(t, defaultRegionSize, PeerSizeClasses())
	lists := r.listInfo()
	for _, tc := range []struct {
		size int
		list int
	}{
		{-1, 0}, {0, 0}, {1, 0}, {8172, 0}, {8173, 1}, {32748, 1}, {32749, 2}, {131052, 2}, {131053, 2}, {1 << 30, 2},
	} {
		off, err := r.Alloc(tc.size)
		require.NoError(t, err, "size %d", tc.size)
		l := lists[tc.list]
		stride := l.SliceSize + sliceHeaderSize
		require.GreaterOrEqual(t, off, l.Offset+listHeaderSize, "size %d", tc.size)
		require.Less(t, off, l.Offset+listHeaderSize+l.Cap*stride, "size %d", tc.size)
		require.Zero(t, (off-l.Offset-listHeaderSize)%stride)

		h, err := r.slice(off)
		require.NoError(t, err)
		require.Equal(t, sliceHeader{Offset: off, Cap: l.SliceSize, Next: h.Next, Flags: flagAllocated}, h)
		d, err := r.dataAt(off)
		require.NoError(t, err)
		require.Len(t, d, int(l.SliceSize))
		require.Equal(t, len(d), cap(d))
		in := make([]int, 3)
		in[tc.list] = 1
		require.Equal(t, in, r.InUse())

		require.NoError(t, r.SetPayload(off, 10))
		copy(d, "0123456789")
		p, _, more, err := r.Payload(off)
		require.NoError(t, err)
		require.False(t, more)
		require.Equal(t, "0123456789", string(p))

		require.NoError(t, r.Free(off))
		require.Equal(t, []int{0, 0, 0}, r.InUse())
		// The freed slice is the new tail, with clean fields.
		require.Equal(t, off-l.Offset-listHeaderSize, get32(mem, l.Offset+listOffTail))
		h, err = r.slice(off)
		require.NoError(t, err)
		require.Equal(t, sliceHeader{Offset: off, Cap: l.SliceSize, Next: h.Next}, h)
	}
}

func TestAllocZeroAllocs(t *testing.T) {
	r, _ := testRegion(t, smallSize, smallClasses)
	allocs := testing.AllocsPerRun(1000, func() {
		off, err := r.Alloc(64)
		if err != nil {
			panic(err)
		}
		if err := r.Free(off); err != nil {
			panic(err)
		}
	})
	require.Zero(t, allocs)
}

// TestExhaustion checks that the last free slice of a list is never handed
// out (docs/protocol.md section 2.4) and that Alloc falls through to larger
// classes but not to smaller ones.
func TestExhaustion(t *testing.T) {
	r, _ := testRegion(t, smallSize, smallClasses)
	lists := r.listInfo()
	seen := map[uint32]bool{}
	alloc := func(size int, wantList int) uint32 {
		t.Helper()
		off, err := r.Alloc(size)
		require.NoError(t, err)
		require.False(t, seen[off], "slice %d handed out twice", off)
		seen[off] = true
		require.GreaterOrEqual(t, off, lists[wantList].Offset)
		if wantList+1 < len(lists) {
			require.Less(t, off, lists[wantList+1].Offset)
		}
		return off
	}
	var large []uint32
	for range lists[2].Cap - 1 {
		large = append(large, alloc(4000, 2))
	}
	_, err := r.Alloc(4000)
	require.Same(t, ErrNoSpace, err, "unwrapped")
	_, err = r.Alloc(1 << 20)
	require.Same(t, ErrNoSpace, err)

	for range lists[1].Cap - 1 {
		alloc(500, 1)
	}
	_, err = r.Alloc(500)
	require.ErrorIs(t, err, ErrNoSpace)

	for range lists[0].Cap - 1 {
		alloc(1, 0)
	}
	_, err = r.Alloc(1)
	require.ErrorIs(t, err, ErrNoSpace)
	require.Equal(t, []int{int(lists[0].Cap - 1), int(lists[1].Cap - 1), int(lists[2].Cap - 1)}, r.InUse())

	// One slice back in the largest list serves a small request.
	require.NoError(t, r.Free(large[0]))
	delete(seen, large[0])
	alloc(1, 2)

	for off := range seen {
		require.NoError(t, r.Free(off))
	}
	require.Equal(t, []int{0, 0, 0}, r.InUse())
	// After all that the lists still hand out cap-1 slices each.
	for i, l := range lists {
		var got []uint32
		for range l.Cap - 1 {
			off, err := r.Alloc(int(l.SliceSize))
			require.NoError(t, err, "list %d", i)
			got = append(got, off)
		}
		for _, off := range got {
			require.NoError(t, r.Free(off))
		}
	}
}

// concurrentClasses make a defaultRegionSize region of lists so long
// (69904, 58254 and 22585 slices) that the concurrent tests never take a
// list's head around a whole turn: the protocol's free list is exposed to
// ABA (see list.pop), which these tests must not provoke.
var concurrentClasses = []SizeClass{{SliceSize: 4, Percent: 5}, {SliceSize: 124, Percent: 25}, {SliceSize: 1020, Percent: 70}}

// TestConcurrentAllocFree runs allocators and freers on many goroutines and
// checks that no slice is ever held by two of them.
func TestConcurrentAllocFree(t *testing.T) {
	r, _ := testRegion(t, defaultRegionSize, concurrentClasses)
	lists := r.listInfo()
	owner := make([]atomic.Int32, defaultRegionSize/24+1) // by offset / smallest stride
	const workers = 16
	iters := 2000
	if testing.Short() {
		iters = 200
	}
	// 3/8 of the allocations go to list 1 and 1/8 to list 2: well under
	// their caps in total.
	sizes := []int{1, 4, 100, 124, 1, 4, 124, 1000}
	var wg sync.WaitGroup
	errs := make(chan error, workers)
	for g := range workers {
		wg.Go(func() {
			id := int32(g + 1)
			var held []uint32
			for i := range iters {
				off, err := r.Alloc(sizes[(i+g)%len(sizes)])
				if err != nil {
					errs <- err
					return
				}
				if !owner[off/24].CompareAndSwap(0, id) {
					errs <- errors.New("slice handed out twice")
					return
				}
				d, _ := r.dataAt(off)
				binary.NativeEndian.PutUint32(d, uint32(id))
				held = append(held, off)
				if len(held) > (i+g)%4 {
					off := held[0]
					held = held[1:]
					d, _ := r.dataAt(off)
					if binary.NativeEndian.Uint32(d) != uint32(id) {
						errs <- errors.New("slice data overwritten by another holder")
						return
					}
					owner[off/24].Store(0)
					if err := r.Free(off); err != nil {
						errs <- err
						return
					}
				}
			}
			for _, off := range held {
				owner[off/24].Store(0)
				if err := r.Free(off); err != nil {
					errs <- err
					return
				}
			}
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		require.NoError(t, err)
	}
	require.Equal(t, []int{0, 0, 0}, r.InUse())
	// The lists survived: each still hands out cap-1 distinct slices.
	for i, l := range lists {
		seen := make([]bool, l.Cap)
		var offs []uint32
		for range l.Cap - 1 {
			off, err := r.Alloc(int(l.SliceSize))
			require.NoError(t, err)
			k := (off - l.Offset - listHeaderSize) / (l.SliceSize + sliceHeaderSize)
			require.Less(t, k, l.Cap)
			require.False(t, seen[k])
			seen[k] = true
			offs = append(offs, off)
		}
		if i == len(lists)-1 {
			_, err := r.Alloc(int(l.SliceSize))
			require.ErrorIs(t, err, ErrNoSpace)
		}
		for _, off := range offs {
			require.NoError(t, r.Free(off))
		}
	}
}

// TestCorruptOffsets feeds offsets that are not slice headers to every
// method that takes one.
func TestCorruptOffsets(t *testing.T) {
	r, _ := testRegion(t, smallSize, smallClasses)
	lists := r.listInfo()
	good, err := r.Alloc(1)
	require.NoError(t, err)
	l0, l2 := lists[0], lists[2]
	end := sliceOff(l2, l2.Cap)
	for _, tc := range []struct {
		name string
		off  uint32
	}{
		{"zero", 0},
		{"region header", 4},
		{"list header", l0.Offset},
		{"inside list header", l0.Offset + 20},
		{"misaligned", good + 1},
		{"inside slice header", good + 4},
		{"data", good + sliceHeaderSize},
		{"last data byte", sliceOff(l0, 1) - 1},
		{"second list header", lists[1].Offset},
		{"end of lists", end},
		{"beyond mapping", smallSize},
		{"max", 1<<32 - 1},
		{"max aligned", 1<<32 - 4},
	} {
		t.Run(tc.name, func(t *testing.T) {
			require.ErrorIs(t, r.Free(tc.off), ErrCorrupt)
			_, err := r.slice(tc.off)
			require.ErrorIs(t, err, ErrCorrupt)
			_, err = r.dataAt(tc.off)
			require.ErrorIs(t, err, ErrCorrupt)
			_, _, _, err = r.Payload(tc.off)
			require.ErrorIs(t, err, ErrCorrupt)
			require.ErrorIs(t, r.SetPayload(tc.off, 0), ErrCorrupt)
			require.ErrorIs(t, r.linkChecked(tc.off, good), ErrCorrupt)
			require.ErrorIs(t, r.linkChecked(good, tc.off), ErrCorrupt)
			n, err := r.FreeChain(tc.off)
			require.ErrorIs(t, err, ErrCorrupt)
			require.Zero(t, n)
			var c ChainReader
			require.ErrorIs(t, c.Reset(r, tc.off), ErrCorrupt)
			_, _, err = c.Next()
			require.ErrorIs(t, err, io.EOF)
		})
	}
	require.Equal(t, []int{1, 0, 0}, r.InUse(), "nothing freed")
	require.ErrorIs(t, r.linkChecked(good, good), ErrCorrupt, "self link")
	require.ErrorIs(t, r.SetPayload(good, l0.SliceSize+1), ErrTooLarge)
	require.NoError(t, r.SetPayload(good, l0.SliceSize))
	require.NoError(t, r.Free(good))
}

// TestCorruptSlice damages the header of an allocated slice the way a peer
// could and checks that readers and Free refuse it.
func TestCorruptSlice(t *testing.T) {
	for _, tc := range []struct {
		name     string
		damage   func(mem []byte, off uint32, size uint32)
		freeOK   bool // Free still works: the damage is to payload fields
		payloadE bool // Payload and ChainReader.Next fail
		sliceE   bool // Slice fails (it does not check next)
	}{
		{"cap zero", func(m []byte, off, _ uint32) { put32(m, off+sliceOffCap, 0) }, false, true, true},
		{"cap larger", func(m []byte, off, size uint32) { put32(m, off+sliceOffCap, size+4) }, false, true, true},
		{"cap of another list", func(m []byte, off, _ uint32) { put32(m, off+sliceOffCap, 508) }, false, true, true},
		{"size past cap", func(m []byte, off, size uint32) { put32(m, off+sliceOffSize, size+1) }, true, true, true},
		{"size huge", func(m []byte, off, _ uint32) { put32(m, off+sliceOffSize, 1<<32-1) }, true, true, true},
		{"start past cap", func(m []byte, off, size uint32) { put32(m, off+sliceOffStart, size+1) }, true, true, true},
		{"start+size past cap", func(m []byte, off, size uint32) {
			put32(m, off+sliceOffStart, size-1)
			put32(m, off+sliceOffSize, 2)
		}, true, true, true},
		{"start+size wraps", func(m []byte, off, _ uint32) {
			put32(m, off+sliceOffStart, 1<<32-1)
			put32(m, off+sliceOffSize, 2)
		}, true, true, true},
		{"next out of range", func(m []byte, off, _ uint32) {
			put32(m, off+sliceOffNext, 1<<31)
			put32(m, off+sliceOffFlags, flagWord(flagNext|flagAllocated))
		}, true, true, false},
		{"next misaligned", func(m []byte, off, _ uint32) {
			put32(m, off+sliceOffNext, off+sliceHeaderSize+124+1)
			put32(m, off+sliceOffFlags, flagWord(flagNext|flagAllocated))
		}, true, true, false},
		{"next to itself", func(m []byte, off, _ uint32) {
			put32(m, off+sliceOffNext, off)
			put32(m, off+sliceOffFlags, flagWord(flagNext|flagAllocated))
		}, true, true, false},
		{"next without flag is ignored", func(m []byte, off, _ uint32) {
			put32(m, off+sliceOffNext, 1<<31)
		}, true, false, false},
		{"allocated flag cleared", func(m []byte, off, _ uint32) {
			put32(m, off+sliceOffFlags, 0)
		}, false, false, false},
		{"unused flag bytes set", func(m []byte, off, _ uint32) {
			put32(m, off+sliceOffFlags, flagWord(flagAllocated)|^flagWord(0xff))
		}, true, false, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			littleEndian(t)
			r, mem := testRegion(t, smallSize, smallClasses)
			off, err := r.Alloc(1)
			require.NoError(t, err)
			tc.damage(mem, off, 124)

			_, _, _, err = r.Payload(off)
			_, serr := r.slice(off)
			var c ChainReader
			require.NoError(t, c.Reset(r, off))
			_, _, nerr := c.Next()
			if tc.payloadE {
				require.ErrorIs(t, err, ErrCorrupt)
				require.ErrorIs(t, nerr, ErrCorrupt)
			} else {
				require.NoError(t, err)
				require.NoError(t, nerr)
			}
			if tc.sliceE {
				require.ErrorIs(t, serr, ErrCorrupt)
			} else {
				require.NoError(t, serr)
			}
			if tc.freeOK {
				require.NoError(t, r.Free(off))
				require.Equal(t, []int{0, 0, 0}, r.InUse())
			} else {
				require.ErrorIs(t, r.Free(off), ErrCorrupt)
				require.Equal(t, []int{1, 0, 0}, r.InUse())
			}
		})
	}
}

// TestCorruptList damages a free list's header and links and checks that
// Alloc and Free fail with ErrCorrupt or ErrNoSpace, leaving the free
// count as it was.
func TestCorruptList(t *testing.T) {
	littleEndian(t)
	for _, tc := range []struct {
		name    string
		damage  func(mem []byte, l listInfo)
		allocE  error
		freeE   error // Free of a slice allocated before the damage
		inUseOK bool
	}{
		{"head out of range", func(m []byte, l listInfo) { put32(m, l.Offset+listOffHead, 1<<31) }, ErrCorrupt, nil, true},
		{"head at area end", func(m []byte, l listInfo) {
			put32(m, l.Offset+listOffHead, l.Cap*(l.SliceSize+sliceHeaderSize))
		}, ErrCorrupt, nil, true},
		{"head misaligned", func(m []byte, l listInfo) { put32(m, l.Offset+listOffHead, 4) }, ErrCorrupt, nil, true},
		{"head next out of range", func(m []byte, l listInfo) {
			put32(m, get32(m, l.Offset+listOffHead)+l.Offset+listHeaderSize+sliceOffNext, 1<<31)
		}, ErrCorrupt, nil, true},
		{"head next to itself", func(m []byte, l listInfo) {
			h := get32(m, l.Offset+listOffHead)
			put32(m, h+l.Offset+listHeaderSize+sliceOffNext, h)
		}, ErrCorrupt, nil, true},
		{"head without next", func(m []byte, l listInfo) {
			put32(m, get32(m, l.Offset+listOffHead)+l.Offset+listHeaderSize+sliceOffFlags, 0)
		}, ErrNoSpace, nil, true},
		{"free count huge", func(m []byte, l listInfo) {
			// Every slice allocated, yet the count claims plenty.
			put32(m, l.Offset+listOffHead, get32(m, l.Offset+listOffTail))
		}, ErrNoSpace, nil, true},
		{"free count zero", func(m []byte, l listInfo) { put32(m, l.Offset+listOffFree, 0) }, ErrNoSpace, nil, false},
		{"free count negative", func(m []byte, l listInfo) { put32(m, l.Offset+listOffFree, 1<<32-5) }, ErrNoSpace, nil, false},
		{"tail out of range", func(m []byte, l listInfo) { put32(m, l.Offset+listOffTail, 1<<31) }, nil, ErrCorrupt, true},
		{"tail misaligned", func(m []byte, l listInfo) { put32(m, l.Offset+listOffTail, 8) }, nil, ErrCorrupt, true},
		{"cap and slice size rewritten", func(m []byte, l listInfo) {
			put32(m, l.Offset+listOffCap, 1<<32-1)
			put32(m, l.Offset+listOffSliceSize, 1<<32-4)
		}, nil, nil, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			// One list only, so that Alloc cannot fall through.
			r, mem := testRegion(t, 4096, []SizeClass{{SliceSize: 124, Percent: 100}})
			l := r.listInfo()[0]
			held, err := r.Alloc(1)
			require.NoError(t, err)
			free := get32(mem, l.Offset+listOffFree)
			tc.damage(mem, l)
			free2 := get32(mem, l.Offset+listOffFree)

			off, err := r.Alloc(1)
			if tc.allocE != nil {
				require.ErrorIs(t, err, tc.allocE)
				require.Equal(t, free2, get32(mem, l.Offset+listOffFree), "free count restored")
			} else {
				require.NoError(t, err)
				if tc.freeE != nil {
					require.ErrorIs(t, r.Free(off), tc.freeE)
				} else {
					require.NoError(t, r.Free(off))
				}
			}
			err = r.Free(held)
			if tc.freeE != nil {
				require.ErrorIs(t, err, tc.freeE)
			} else {
				require.NoError(t, err)
				if tc.inUseOK {
					require.Equal(t, free+1, get32(mem, l.Offset+listOffFree))
				}
			}
			// The geometry is cached: Lists ignores the damage.
			require.Equal(t, l, r.listInfo()[0])
		})
	}
}

// TestCorruptChain builds chains with bad links and checks that walks end.
func TestCorruptChain(t *testing.T) {
	t.Run("cycle", func(t *testing.T) {
		r, _ := testRegion(t, smallSize, smallClasses)
		a, _ := r.Alloc(1)
		b, _ := r.Alloc(1)
		require.NoError(t, r.linkChecked(a, b))
		require.NoError(t, r.linkChecked(b, a))
		require.NoError(t, r.SetPayload(a, 1))
		require.NoError(t, r.SetPayload(b, 2))

		var c ChainReader
		require.NoError(t, c.Reset(r, a))
		var n int
		var err error
		for err == nil {
			_, _, err = c.Next()
			n++
		}
		require.ErrorIs(t, err, ErrCorrupt)
		require.LessOrEqual(t, n, int(r.total)+1)
		_, _, err = c.Next()
		require.ErrorIs(t, err, io.EOF, "the walk stays ended")

		require.NoError(t, c.Reset(r, a))
		k, err := io.Copy(io.Discard, chainIO{&c})
		require.ErrorIs(t, err, ErrCorrupt)
		// The walk visits as many slices as the region has: a (1 byte), b
		// (2 bytes), a, b, ...
		require.Equal(t, int64((r.total+1)/2+2*(r.total/2)), k)

		freed, err := r.FreeChain(a)
		require.ErrorIs(t, err, ErrCorrupt, "a freed twice")
		require.Equal(t, 2, freed)
		require.Equal(t, []int{0, 0, 0}, r.InUse())
	})
	t.Run("link into free slice", func(t *testing.T) {
		r, _ := testRegion(t, smallSize, smallClasses)
		a, _ := r.Alloc(1)
		b, _ := r.Alloc(1)
		require.NoError(t, r.linkChecked(a, b))
		require.NoError(t, r.Free(b))
		n, err := r.FreeChain(a)
		require.ErrorIs(t, err, ErrCorrupt)
		require.Equal(t, 1, n)
		require.Equal(t, []int{0, 0, 0}, r.InUse())
	})
	t.Run("link out of range", func(t *testing.T) {
		r, mem := testRegion(t, smallSize, smallClasses)
		a, _ := r.Alloc(1)
		put32(mem, a+sliceOffNext, 3)
		put32(mem, a+sliceOffFlags, flagWord(flagNext|flagAllocated))
		n, err := r.FreeChain(a)
		require.ErrorIs(t, err, ErrCorrupt)
		require.Equal(t, 1, n, "a is freed, the bad link is not followed")
	})
	t.Run("long chain", func(t *testing.T) {
		// A chain through every allocatable slice is fine.
		r, _ := testRegion(t, smallSize, smallClasses)
		var offs []uint32
		for {
			off, err := r.Alloc(1 << 20)
			if err != nil {
				require.ErrorIs(t, err, ErrNoSpace)
				break
			}
			offs = append(offs, off)
		}
		for {
			off, err := r.Alloc(1)
			if err != nil {
				break
			}
			offs = append(offs, off)
		}
		for i := range offs[1:] {
			require.NoError(t, r.linkChecked(offs[i], offs[i+1]))
		}
		var c ChainReader
		require.NoError(t, c.Reset(r, offs[0]))
		var n int
		for {
			_, off, err := c.Next()
			if err != nil {
				require.ErrorIs(t, err, io.EOF)
				break
			}
			require.Equal(t, offs[n], off)
			n++
		}
		require.Equal(t, len(offs), n)
		freed, err := r.FreeChain(offs[0])
		require.NoError(t, err)
		require.Equal(t, len(offs), freed)
		require.Equal(t, []int{0, 0, 0}, r.InUse())
	})
}
