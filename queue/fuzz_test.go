package queue

import (
	"encoding/binary"
	"errors"
	"math"
	"testing"

	"github.com/stretchr/testify/require"
)

// FuzzRing runs a random sequence of operations on one half of a queue and
// compares it with a slice model until the fuzzer scribbles over head or
// tail; from then on the ring must only stay in bounds and never panic.
//
// data[0] picks the cap; each following byte is an operation: 0-2 put,
// 3-5 pop, 6 write one of a few interesting values (next byte) into head,
// tail, cap, flag or an event (byte after), 7 a working-flag operation.
func FuzzRing(f *testing.F) {
	f.Add([]byte{5, 0, 0, 0, 3, 3, 0, 3, 3, 3})
	f.Add([]byte{6, 0, 0, 0, 0, 0, 0, 0, 0, 3, 0, 3, 0, 3, 3, 3, 3, 3, 3, 3})
	f.Add([]byte{0, 0, 3, 0, 3, 0, 3, 7, 7})
	f.Add([]byte{11, 0, 0, 6, 1, 0, 0, 3, 3})
	f.Add([]byte{11, 0, 0, 6, 2, 1, 3, 0, 3, 6, 0, 2})
	f.Add([]byte{3, 0, 0, 6, 4, 2, 3, 3, 0, 6, 3, 3})
	f.Fuzz(func(t *testing.T, data []byte) {
		if len(data) == 0 {
			return
		}
		cap := 1 + uint32(data[0]%24)
		if !validCap(cap) {
			return
		}
		mem, r, other := newPair(t, cap)
		interesting := [...]int64{-1, 0, 1, int64(cap) - 1, int64(cap), int64(cap) + 1, 1 << 32, math.MaxInt64, math.MinInt64}
		var model []Event
		corrupt := false
		next := uint32(0)
		arg := func(i *int) byte {
			*i++
			if *i < len(data) {
				return data[*i]
			}
			return 0
		}
		for i := 1; i < len(data); i++ {
			switch op := data[i] % 8; op {
			case 0, 1, 2:
				e := Event{StreamID: next, Offset: next ^ 0xdeadbeef, Status: uint32(op)}
				next++
				err := r.Put(e)
				if corrupt {
					if err != nil {
						require.True(t, err == ErrFull || isCorrupt(err), "Put: %v", err)
					}
					break
				}
				if len(model) == int(cap) {
					require.ErrorIs(t, err, ErrFull)
					break
				}
				require.NoError(t, err)
				model = append(model, e)
			case 3, 4, 5:
				e, ok, err := r.Pop()
				if corrupt {
					require.True(t, err == nil || isCorrupt(err), "Pop: %v", err)
					break
				}
				require.NoError(t, err)
				if len(model) == 0 {
					require.False(t, ok)
					break
				}
				require.True(t, ok)
				require.Equal(t, model[0], e)
				model = model[1:]
			case 6:
				v := interesting[int(arg(&i))%len(interesting)]
				switch where := arg(&i) % 5; where {
				case 0:
					binary.NativeEndian.PutUint64(mem[offHead:], uint64(v))
					corrupt = true
				case 1:
					binary.NativeEndian.PutUint64(mem[offTail:], uint64(v))
					corrupt = true
				case 2: // the cap is cached: the model stays valid
					binary.NativeEndian.PutUint32(mem[offCap:], uint32(v))
				case 3: // so is the flag's effect on Put and Pop
					binary.NativeEndian.PutUint32(mem[offWorking:], uint32(v))
				case 4: // an event slot: only the events themselves change
					slot := int(uint64(v)%uint64(cap)) * eventSize
					binary.NativeEndian.PutUint32(mem[offEvents+slot:], uint32(v))
					corrupt = true
				}
			case 7:
				if r.MarkWorking() {
					require.True(t, r.Working())
				}
				r.ClearWorking()
				require.False(t, r.Working())
			}
			n := r.len()
			require.True(t, n >= 0 && n <= int(cap), "Len %d", n)
			if !corrupt {
				require.Equal(t, len(model), n)
				require.Equal(t, len(model) == 0, r.Empty())
			}
			require.True(t, other.Empty(), "the other half is untouched")
		}
	})
}

func isCorrupt(err error) bool {
	return err != nil && err != ErrFull && errors.Is(err, ErrCorrupt)
}
