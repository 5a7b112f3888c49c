package buffer

import (
	"encoding/binary"
	"errors"
	"math"
	"testing"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"
)

// sparseMapping maps a memfd of size bytes that holds no page until one is
// written: a peer can offer a region of almost 4 GiB at no cost.
func sparseMapping(tb testing.TB, size int) []byte {
	tb.Helper()
	fd, err := unix.MemfdCreate("geometry", unix.MFD_CLOEXEC)
	require.NoError(tb, err)
	defer unix.Close(fd)
	require.NoError(tb, unix.Ftruncate(fd, int64(size)))
	mem, err := unix.Mmap(fd, 0, size, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	require.NoError(tb, err)
	tb.Cleanup(func() { unix.Munmap(mem) })
	return mem
}

// One list of 2^32-7 slices of 2^32-12 bytes: header and data do not fit
// in 32 bits, and in 64 bits the list's length wraps to just under the
// mapping's. Attach must refuse it (docs/protocol.md section 2.2) rather
// than let the first event index past the mapping.
func TestAttachGeometryOverflow(t *testing.T) {
	mem := sparseMapping(t, math.MaxUint32)
	slices, size := uint32(1<<32-7), uint32(1<<32-12)
	span := uint64(slices) * (uint64(size) + sliceHeaderSize) // wraps to 2^32-56
	binary.NativeEndian.PutUint16(mem[regionOffLists:], 1)
	binary.NativeEndian.PutUint32(mem[regionOffUsed:], uint32(listHeaderSize+span))
	binary.NativeEndian.PutUint32(mem[regionHeaderSize+listOffCap:], slices)
	binary.NativeEndian.PutUint32(mem[regionHeaderSize+listOffSliceSize:], size)
	r, err := Attach(mem)
	if err == nil {
		// What a receiver does with the first event: read its slice.
		_, _, _, perr := r.Payload(regionHeaderSize + listHeaderSize + sliceHeaderSize + 8)
		t.Fatalf("Attach accepted the geometry (Payload: %v)", perr)
	}
	require.True(t, errors.Is(err, ErrCorrupt), "%v", err)
}

// FuzzAttach forges region headers with extreme geometries (caps and
// slice sizes near 0, 2^31 and 2^32, any used length) on a sparse mapping
// of almost 4 GiB, attaches, and exercises whatever attached: nothing may
// panic or fault, every failure is an error (docs/protocol.md sections
// 2.1 and 2.2).
func FuzzAttach(f *testing.F) {
	f.Add(uint16(1), uint32(1<<32-20), uint32(1<<32-7), uint32(1<<32-12), uint32(0), uint32(0), []byte{0})
	f.Add(uint16(2), uint32(1<<31), uint32(1<<30), uint32(4), uint32(2), uint32(1<<31), []byte{1, 2})
	f.Add(uint16(1), uint32(listHeaderSize+2*(8+sliceHeaderSize)), uint32(2), uint32(8), uint32(0), uint32(0), []byte{3})
	mem := sparseMapping(f, math.MaxUint32)
	f.Fuzz(func(t *testing.T, lists uint16, used, cap0, size0, cap1, size1 uint32, ops []byte) {
		clear(mem[:regionHeaderSize+2*listHeaderSize])
		binary.NativeEndian.PutUint16(mem[regionOffLists:], lists)
		binary.NativeEndian.PutUint32(mem[regionOffUsed:], used)
		for i, g := range [][2]uint32{{cap0, size0}, {cap1, size1}} {
			off := regionHeaderSize + i*listHeaderSize
			binary.NativeEndian.PutUint32(mem[off+listOffCap:], g[0])
			binary.NativeEndian.PutUint32(mem[off+listOffSliceSize:], g[1])
		}
		r, err := Attach(mem)
		if err != nil {
			require.ErrorIs(t, err, ErrCorrupt)
			return
		}
		// Touch only the first pages: the rest of the mapping stays sparse.
		for _, op := range ops {
			off := uint32(op) * 4
			switch op % 4 {
			case 0:
				if a, err := r.Alloc(int(op)); err == nil {
					r.Free(a)
				}
			case 1:
				r.Payload(off)
			case 2:
				r.FreeChain(off)
			case 3:
				var cr ChainReader
				if cr.Reset(r, off) == nil {
					cr.Read(make([]byte, 64))
				}
			}
		}
	})
}
