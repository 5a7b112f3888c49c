package buffer

import (
	"bytes"
	"encoding/binary"
	"errors"
	"io"
	"slices"
	"testing"

	"github.com/stretchr/testify/require"
)

// fuzzClasses make a 32 KiB region of 113, 18 and 3 slices.
var fuzzClasses = []SizeClass{{SliceSize: 124, Percent: 50}, {SliceSize: 508, Percent: 30}, {SliceSize: 2044, Percent: 20}}

const fuzzSize = 32 << 10

// Operations of FuzzRegion, one input byte each, followed by their
// arguments.
const (
	opAlloc       = iota // u16 size
	opFree               // u8 index into the held slices
	opFreeAt             // offset (see fuzzer.offset)
	opChain              // u16 size, u8 mode: bit 0 Abort instead of Finish
	opReserve            // u16 size, u8 mode as opChain
	opRead               // offset: Slice, Data, Payload and a chain walk
	opPoke               // target (see fuzzer.target), u8 value kind, u32 value
	opPokeByte           // u16 position, u8 value
	opAttach             // none
	opFreeChainAt        // offset; only once the region is damaged
	numOps
)

// fuzzer applies one FuzzRegion input to a region and keeps a model of it:
// the slices held and, until the input damages shared memory, what every
// operation must return.
type fuzzer struct {
	t       *testing.T
	in      []byte
	mem     []byte
	r       *Region
	lists   []listInfo
	held    []uint32 // allocated slices, in allocation order
	damaged bool     // shared memory was written behind the region's back
	w       ChainWriter
	c       ChainReader
	src     []byte // pattern to write chains from
	dst     []byte // buffer to read chains into
}

func (f *fuzzer) u8() uint8 {
	if len(f.in) == 0 {
		return 0
	}
	b := f.in[0]
	f.in = f.in[1:]
	return b
}

func (f *fuzzer) u16() uint32 { return uint32(f.u8()) | uint32(f.u8())<<8 }
func (f *fuzzer) u32() uint32 { return f.u16() | f.u16()<<16 }

// slot returns the absolute offset of a slice chosen by the input.
func (f *fuzzer) slot() uint32 {
	l := f.lists[int(f.u8())%len(f.lists)]
	return sliceOff(l, uint32(f.u8())%l.Cap)
}

// offset returns an offset chosen by the input: a slice header, a held
// slice, or any value.
func (f *fuzzer) offset() uint32 {
	switch f.u8() % 4 {
	case 0:
		return f.slot()
	case 1:
		if len(f.held) > 0 {
			return f.held[int(f.u8())%len(f.held)]
		}
		return f.slot()
	case 2:
		return f.slot() + uint32(f.u8())
	default:
		return f.u32()
	}
}

// target returns the 4-byte aligned offset of a field chosen by the input:
// a list header field, a slice header field, or any word of the mapping.
func (f *fuzzer) target() uint32 {
	switch f.u8() % 4 {
	case 0:
		l := f.lists[int(f.u8())%len(f.lists)]
		return l.Offset + uint32(f.u8())%(listHeaderSize/4)*4
	case 1, 2:
		return f.slot() + uint32(f.u8())%(sliceHeaderSize/4)*4
	default:
		return uint32(f.u16()) % fuzzSize &^ 3
	}
}

// value returns a u32 chosen by the input: mostly values that look right.
func (f *fuzzer) value() uint32 {
	l := f.lists[int(f.u8())%len(f.lists)]
	stride := l.SliceSize + sliceHeaderSize
	switch f.u8() % 6 {
	case 0:
		return uint32(f.u8()) % l.Cap * stride // area-relative offset
	case 1:
		return f.slot() // absolute offset
	case 2:
		return l.SliceSize
	case 3:
		return uint32(f.u8())
	case 4:
		return flagWord(f.u8() & 3)
	default:
		return f.u32()
	}
}

// listOf returns the index of the list holding slice off.
func (f *fuzzer) listOf(off uint32) int {
	k := 0
	for i, l := range f.lists {
		if off > l.Offset {
			k = i
		}
	}
	return k
}

// heldPer returns the held slices per list.
func (f *fuzzer) heldPer() []int {
	n := make([]int, len(f.lists))
	for _, off := range f.held {
		n[f.listOf(off)]++
	}
	return n
}

// freeBytes returns the bytes the slices still free can carry.
func (f *fuzzer) freeBytes() int {
	n := 0
	for i, h := range f.heldPer() {
		n += (int(f.lists[i].Cap) - 1 - h) * int(f.lists[i].SliceSize)
	}
	return n
}

// spare reports whether list i or a larger one has a slice to hand out.
func (f *fuzzer) spare(i int) bool {
	per := f.heldPer()
	for ; i < len(f.lists); i++ {
		if per[i] < int(f.lists[i].Cap)-1 {
			return true
		}
	}
	return false
}

func (f *fuzzer) drop(off uint32) {
	if i := slices.Index(f.held, off); i >= 0 {
		f.held = slices.Delete(f.held, i, i+1)
	}
}

func (f *fuzzer) step() {
	t := f.t
	switch op := f.u8() % numOps; op {
	case opAlloc:
		size := int(f.u16() % 4096)
		off, err := f.r.Alloc(size)
		if f.damaged {
			if err == nil && !slices.Contains(f.held, off) {
				f.held = append(f.held, off)
			}
			return
		}
		// The first list from size's class up with a spare slice.
		want := -1
		per := f.heldPer()
		for i := f.r.class(size); i < len(f.lists); i++ {
			if per[i] < int(f.lists[i].Cap)-1 {
				want = i
				break
			}
		}
		if want < 0 {
			require.Same(t, ErrNoSpace, err)
			return
		}
		require.NoError(t, err)
		require.Equal(t, want, f.listOf(off))
		require.NotContains(t, f.held, off, "slice handed out twice")
		f.held = append(f.held, off)

	case opFree:
		if len(f.held) == 0 {
			return
		}
		off := f.held[int(f.u8())%len(f.held)]
		f.drop(off)
		err := f.r.Free(off)
		if !f.damaged {
			require.NoError(t, err)
		}

	case opFreeAt:
		off := f.offset()
		isHeld := slices.Contains(f.held, off)
		err := f.r.Free(off)
		if isHeld {
			f.drop(off)
		}
		if !f.damaged {
			if isHeld {
				require.NoError(t, err)
			} else {
				require.ErrorIs(t, err, ErrCorrupt)
			}
		}

	case opChain, opReserve:
		size := int(f.u16())
		abort := f.u8()&1 != 0
		var n int
		var err error
		if op == opChain {
			n, err = f.w.Write(f.src[:size])
		} else {
			size %= 3000
			var b []byte
			b, err = f.w.Reserve(size)
			n = copy(b, f.src)
		}
		if !f.damaged {
			switch {
			case op == opReserve && size > f.r.MaxSliceSize():
				require.ErrorIs(t, err, ErrTooLarge)
			case op == opChain && size > f.freeBytes():
				require.Same(t, ErrNoSpace, err)
				require.Equal(t, f.freeBytes(), n)
			case op == opReserve && size > 0 && !f.spare(f.r.class(size)):
				require.Same(t, ErrNoSpace, err)
			default:
				require.NoError(t, err)
				require.Equal(t, size, n)
			}
		}
		if abort {
			err := f.w.Abort()
			if !f.damaged {
				require.NoError(t, err)
			}
			return
		}
		head, total := f.w.Finish()
		if head == 0 {
			return
		}
		if !f.damaged {
			require.Equal(t, n, total)
			require.NoError(t, f.c.Reset(f.r, head))
			got, err := io.ReadFull(chainIO{&f.c}, f.dst[:total])
			require.NoError(t, err)
			require.True(t, bytes.Equal(f.src[:n], f.dst[:got]))
			_, _, err = f.c.Next()
			require.Equal(t, io.EOF, err)
		}
		_, err = f.r.FreeChain(head)
		if !f.damaged {
			require.NoError(t, err)
		}

	case opRead:
		off := f.offset()
		isHeld := slices.Contains(f.held, off)
		_, serr := f.r.slice(off)
		_, derr := f.r.dataAt(off)
		_, _, _, perr := f.r.Payload(off)
		if !f.damaged && isHeld {
			require.NoError(t, serr)
			require.NoError(t, derr)
			require.NoError(t, perr)
		}
		if err := f.c.Reset(f.r, off); err == nil {
			for {
				if _, _, err := f.c.Next(); err != nil {
					break
				}
			}
		}

	case opPoke:
		at := f.target()
		binary.NativeEndian.PutUint32(f.mem[at:], f.value())
		f.damaged = true

	case opPokeByte:
		f.mem[f.u16()%fuzzSize] = f.u8()
		f.damaged = true

	case opAttach:
		r, err := Attach(f.mem)
		if !f.damaged {
			require.NoError(t, err)
			require.Equal(t, f.lists, r.listInfo())
		}
		if err == nil {
			f.r = r
			f.lists = r.listInfo()
			// Held slices outside the new geometry are forgotten.
			f.held = slices.DeleteFunc(f.held, func(off uint32) bool {
				_, ok := r.locate(off)
				return !ok
			})
			f.w.Reset(r)
		} else {
			require.ErrorIs(t, err, ErrCorrupt)
		}

	case opFreeChainAt:
		if !f.damaged {
			return
		}
		off := f.offset()
		f.drop(off)
		_, err := f.r.FreeChain(off)
		if err != nil {
			require.ErrorIs(t, err, ErrCorrupt)
		}
	}
	if !f.damaged {
		require.Equal(t, f.heldPer(), f.r.InUse())
	}
}

// checkError fails t when err is neither nil nor one of the package's
// sentinels.
func checkError(t *testing.T, err error) {
	if err != nil && !errors.Is(err, ErrCorrupt) && !errors.Is(err, ErrNoSpace) && !errors.Is(err, ErrTooLarge) {
		t.Fatalf("unexpected error %v", err)
	}
}

// FuzzRegion formats a small region and applies a sequence of operations to
// it: Alloc, Free, chain writes, reservations and walks, reads of any
// offset, re-Attach, and arbitrary writes into the mapping as a hostile
// peer would make. Nothing may panic, loop or touch memory outside the
// mapping; until the first write behind the region's back, every result
// must match the model (no slice handed out twice, exact ErrNoSpace, chain
// contents, in-use counts).
func FuzzRegion(f *testing.F) {
	for _, seed := range fuzzSeeds() {
		f.Add(seed)
	}
	src := pattern(1<<16, 0x5a)
	f.Fuzz(func(t *testing.T, in []byte) {
		mem := make([]byte, fuzzSize)
		r, err := Format(mem, fuzzClasses)
		require.NoError(t, err)
		z := &fuzzer{t: t, in: in, mem: mem, r: r, lists: r.listInfo(), src: src, dst: make([]byte, 1<<16)}
		z.w.Reset(r)
		for len(z.in) > 0 {
			z.step()
		}
		for _, off := range z.held {
			err := z.r.Free(off)
			if !z.damaged {
				require.NoError(t, err)
			}
			checkError(t, err)
		}
		if !z.damaged {
			require.Equal(t, make([]int, len(z.lists)), z.r.InUse())
		}
	})
}

// fuzzSeeds returns inputs that reach each operation and the interesting
// states: exhausted lists, long chains, damaged heads, tails and links.
func fuzzSeeds() [][]byte {
	alloc := func(size uint16) []byte { return []byte{opAlloc, byte(size), byte(size >> 8)} }
	var exhaust []byte
	for range 140 {
		exhaust = append(exhaust, alloc(100)...)
	}
	for i := range 140 {
		exhaust = append(exhaust, opFree, byte(i*7))
	}
	return [][]byte{
		nil,
		slices.Concat(alloc(1), alloc(200), alloc(3000), []byte{opFree, 0, opFree, 0, opFree, 0}),
		exhaust,
		{opChain, 0xff, 0xff, 0, opChain, 0x00, 0x10, 1, opReserve, 0xd0, 0x07, 0, opReserve, 0xff, 0xff, 1},
		slices.Concat(alloc(1), []byte{opRead, 1, 0, opFreeAt, 1, 0, opFreeAt, 1, 0, opFreeAt, 3, 1, 2, 3, 4}),
		// Damage the first list's head, then allocate.
		slices.Concat([]byte{opPoke, 0, 0, 2, 0, 3, 0xff, 0xff, 0xff, 0x7f}, alloc(1), alloc(1)),
		// Make a held slice's next point at itself, then walk and free it.
		slices.Concat(alloc(1), []byte{opPoke, 1, 0, 0, 3, 0, 1, 0, 0, opRead, 1, 0, opFreeChainAt, 1, 0}),
		// Damage a tail and a free count, then free.
		slices.Concat(alloc(600), []byte{opPoke, 0, 1, 3, 0, 3, 9, opPoke, 0, 1, 0, 0, 5, 0, 0, 0, 0x80}, []byte{opFree, 0}),
		{opPokeByte, 0, 0, 7, opAttach, opPokeByte, 4, 0, 0xff, opAttach, opChain, 0, 8, 0},
	}
}
