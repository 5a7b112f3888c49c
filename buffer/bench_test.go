package buffer

import (
	"io"
	"testing"
)

// BenchmarkAllocFree pops and pushes one slice; the baseline is the same
// pair of operations on a Go channel used as a free list.
func BenchmarkAllocFree(b *testing.B) {
	b.Run("region", func(b *testing.B) {
		r, _ := testRegion(b, defaultRegionSize, PeerSizeClasses())
		b.ReportAllocs()
		for b.Loop() {
			off, err := r.Alloc(64)
			if err != nil {
				b.Fatal(err)
			}
			if err := r.Free(off); err != nil {
				b.Fatal(err)
			}
		}
	})
	b.Run("region-parallel", func(b *testing.B) {
		r, _ := testRegion(b, defaultRegionSize, PeerSizeClasses())
		b.ReportAllocs()
		b.ResetTimer()
		b.RunParallel(func(pb *testing.PB) {
			for pb.Next() {
				off, err := r.Alloc(64)
				if err != nil {
					b.Error(err)
					return
				}
				if err := r.Free(off); err != nil {
					b.Error(err)
					return
				}
			}
		})
	})
	b.Run("baseline-chan", func(b *testing.B) {
		free := make(chan uint32, 2048)
		for i := range uint32(2047) {
			free <- i
		}
		b.ReportAllocs()
		for b.Loop() {
			off := <-free
			free <- off
		}
	})
}

// BenchmarkChainWrite writes a message into a chain, finishes it and frees
// it, as a sender and its peer's receiver would; the baseline copies the
// same bytes into a Go slice.
func BenchmarkChainWrite(b *testing.B) {
	for _, bc := range []struct {
		name string
		size int
	}{
		{"64B", 64},
		{"1MB", 1 << 20},
	} {
		p := pattern(bc.size, 1)
		b.Run(bc.name, func(b *testing.B) {
			r, _ := testRegion(b, defaultRegionSize, PeerSizeClasses())
			var w ChainWriter
			w.Reset(r)
			b.SetBytes(int64(bc.size))
			b.ReportAllocs()
			for b.Loop() {
				if _, err := w.Write(p); err != nil {
					b.Fatal(err)
				}
				head, _ := w.Finish()
				if _, err := r.FreeChain(head); err != nil {
					b.Fatal(err)
				}
			}
		})
		b.Run(bc.name+"/baseline-copy", func(b *testing.B) {
			dst := make([]byte, bc.size)
			b.SetBytes(int64(bc.size))
			b.ReportAllocs()
			for b.Loop() {
				copy(dst, p)
			}
		})
	}
}

// BenchmarkChainRead reads a 1 MB chain with ChainReader.Read.
func BenchmarkChainRead(b *testing.B) {
	r, _ := testRegion(b, defaultRegionSize, PeerSizeClasses())
	w := r.newChainWriter()
	if _, err := w.Write(pattern(1<<20, 2)); err != nil {
		b.Fatal(err)
	}
	head, size := w.Finish()
	dst := make([]byte, size)
	var c ChainReader
	b.SetBytes(int64(size))
	b.ReportAllocs()
	for b.Loop() {
		if err := c.Reset(r, head); err != nil {
			b.Fatal(err)
		}
		if _, err := io.ReadFull(chainIO{&c}, dst); err != nil {
			b.Fatal(err)
		}
	}
}
