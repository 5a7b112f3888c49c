package buffer

import (
	"fmt"
	"sync"
	"sync/atomic"
	"unsafe"
)

// Retry bounds of the lock-free list operations. Every loop that reads
// shared memory is bounded, so a peer that keeps rewriting a list can make
// an operation fail but never spin forever.
const (
	// popTries bounds the CAS attempts on a list head; the peers use 200
	// (docs/protocol.md section 2.4). Running out is reported as ErrNoSpace.
	popTries = 200

	// pushTries bounds the CAS attempts on a list tail. Each failed attempt
	// means another push succeeded, so only a peer rewriting the tail can
	// exhaust it; that is reported as ErrCorrupt.
	pushTries = 1 << 16

	// claimTries bounds the CAS attempts on the flags of a slice being
	// freed, which only the slice's owner writes.
	claimTries = 16
)

// list is this process's view of one buffer list (docs/protocol.md section 2.2).
// Its geometry is read once, by Format or Attach, and never again: a peer
// may rewrite cap and slice size in shared memory at any time, so every
// offset read at run time (head, tail, next) is checked against this copy.
type list struct {
	off      uint32 // absolute offset of the list header
	area     uint32 // absolute offset of slice 0: off + listHeaderSize
	areaLen  uint32 // bytes of slices: cap * stride
	end      uint32 // absolute offset one past the last slice
	cap      uint32 // slices in the list
	dataSize uint32 // data bytes per slice
	stride   uint32 // sliceHeaderSize + dataSize
	// strideMask is stride-1 when stride is a power of two (the default
	// classes), letting validRel avoid a division; 0 otherwise.
	strideMask uint32

	// Shared counters and links, at fixed offsets inside the mapping.
	free  *int32
	head  *uint32
	tail  *uint32
	inUse *int32

	// popMu serializes this process's pops of the list, so that the ABA
	// of pop can only come from the peer's (see pop). It also guards warm.
	popMu *sync.Mutex
	// warm is this process's stack of slices it recycled and keeps for its
	// own next pops instead of pushing them on the tail (keepWarm,
	// takeWarm; docs/protocol.md section 2.4, "Warm slices"): absolute
	// header offsets, the most recent last. At most warmMax.
	warm    []uint32
	warmMax int
	// nwarm is len(warm), readable without popMu: pop's and InUse's
	// look at an empty stack costs one atomic load.
	nwarm *atomic.Int32
	// popHook, set by tests only, runs in pop between reading the head's
	// next link and the CAS that installs it.
	popHook func()
}

// newList returns the view of a list whose header is at off, with cap
// slices of dataSize data bytes. The caller has checked that the list lies
// inside the mapping that starts at base.
func newList(base unsafe.Pointer, off, cap, dataSize uint32) list {
	stride := sliceHeaderSize + dataSize
	l := list{
		off:      off,
		area:     off + listHeaderSize,
		areaLen:  cap * stride,
		cap:      cap,
		dataSize: dataSize,
		stride:   stride,
		free:     i32(base, off+listOffFree),
		head:     u32(base, off+listOffHead),
		tail:     u32(base, off+listOffTail),
		inUse:    i32(base, off+listOffInUse),
		popMu:    new(sync.Mutex),
	}
	l.end = l.area + l.areaLen
	if stride&(stride-1) == 0 {
		l.strideMask = stride - 1
	}
	l.warmMax = max(min(maxWarmSlices, int(maxWarmBytes/dataSize), int(cap/8)), 0)
	l.warm = make([]uint32, 0, l.warmMax)
	l.nwarm = new(atomic.Int32)
	return l
}

// validRel reports whether rel, an offset relative to the slice area, is
// the header of one of the list's slices.
func (l *list) validRel(rel uint32) bool {
	if rel >= l.areaLen {
		return false
	}
	if l.strideMask != 0 {
		return rel&l.strideMask == 0
	}
	return rel%l.stride == 0
}

// format writes the initial state of the list and its slices (docs/protocol.md
// section 2.2): every slice free and linked to the next, the last one
// without flagNext. Only the creator calls it, before any peer attaches.
func (l *list) format(base unsafe.Pointer) {
	*u32(base, l.off+listOffFree) = l.cap
	*u32(base, l.off+listOffCap) = l.cap
	*u32(base, l.off+listOffHead) = 0
	*u32(base, l.off+listOffTail) = l.areaLen - l.stride
	*u32(base, l.off+listOffSliceSize) = l.dataSize
	for c := uint32(listOffInUse); c < listHeaderSize; c += 4 {
		*u32(base, l.off+c) = 0
	}
	for rel := uint32(0); rel < l.areaLen; rel += l.stride {
		h := l.area + rel
		next, flags := rel+l.stride, uint8(flagNext)
		if next == l.areaLen {
			next, flags = 0, 0
		}
		*u32(base, h+sliceOffCap) = l.dataSize
		*u32(base, h+sliceOffSize) = 0
		*u32(base, h+sliceOffStart) = 0
		*u32(base, h+sliceOffNext) = next
		*u32(base, h+sliceOffFlags) = flagWord(flags)
	}
}

// pop takes the first free slice off the list and returns the absolute
// offset of its header (docs/protocol.md section 2.4). It returns ErrNoSpace,
// unwrapped, when the list holds at most one free slice or the head did not
// settle within popTries attempts, and an error wrapping ErrCorrupt when the
// head or a next link is not a slice of this list.
//
// The protocol's list is exposed to ABA, in every implementation: a popper
// delayed between reading head's next and its CAS, while other pops and
// pushes bring the same slice back to the head, installs a stale next,
// which may be a slice someone holds. It takes a whole turn of the free
// list during the delay, so it threatens nearly exhausted lists most.
// Within this process it cannot happen: popMu lets one pop of ours run at
// a time, and our pushes alone cannot bring a slice back to the head. The
// peer's pops can still interleave with ours; what that damages is
// detected instead of handed on: a head, or a slice just taken, that is
// marked allocated means the list is damaged, and pop reports ErrCorrupt
// (docs/protocol.md section 2.4). Validation keeps any next inside the
// list, so the worst outcome is a damaged free list, never an access
// outside the mapping.
func (l *list) pop(base unsafe.Pointer) (uint32, error) {
	if hdr, ok, err := l.takeWarm(base, false); ok || err != nil {
		return hdr, err
	}
	if atomic.AddInt32(l.free, -1) <= 0 {
		atomic.AddInt32(l.free, 1)
		// A slice kept warm meanwhile is ours: a writer never runs out
		// while its own process keeps one (see keepWarm).
		return l.takeWarmOrNoSpace(base)
	}
	l.popMu.Lock()
	defer l.popMu.Unlock()
	for range popTries {
		h := atomic.LoadUint32(l.head)
		if !l.validRel(h) {
			atomic.AddInt32(l.free, 1)
			return 0, l.corrupt("head", h)
		}
		hdr := l.area + h
		fw := load32(base, hdr+sliceOffFlags)
		if fw&flagWord(flagAllocated) != 0 {
			if atomic.LoadUint32(l.head) != h {
				continue // the peer took h meanwhile
			}
			atomic.AddInt32(l.free, 1)
			return 0, l.corrupt("head, an allocated slice,", h)
		}
		if fw&flagWord(flagNext) == 0 {
			// The head is the last free slice, or a push has moved the
			// tail but not linked it yet.
			if atomic.LoadInt32(l.free) <= 1 {
				break
			}
			continue
		}
		next := load32(base, hdr+sliceOffNext)
		if next == h || !l.validRel(next) {
			if atomic.LoadUint32(l.head) != h {
				continue // read while another popper took h
			}
			atomic.AddInt32(l.free, 1)
			return 0, l.corrupt("next link", next)
		}
		if l.popHook != nil {
			l.popHook()
		}
		if atomic.CompareAndSwapUint32(l.head, h, next) {
			// The slice is ours: restore the cap a peer may have
			// damaged, then mark it allocated; it must not have been.
			*u32(base, hdr+sliceOffCap) = l.dataSize
			if old := atomic.SwapUint32(u32(base, hdr+sliceOffFlags), flagWord(flagAllocated)); old&flagWord(flagAllocated) != 0 {
				return 0, l.corrupt("slice taken from the head, already allocated,", h)
			}
			atomic.AddInt32(l.inUse, 1)
			return hdr, nil
		}
	}
	atomic.AddInt32(l.free, 1)
	return 0, ErrNoSpace
}

// push recycles the slice whose header is at absolute offset hdr onto the
// tail of the list (docs/protocol.md section 2.4). The caller has checked that
// hdr is a slice of this list and has cleared its flags, which makes it the
// caller's alone. It returns an error wrapping ErrCorrupt when the tail is
// not a slice of this list or is hdr itself; the slice is then lost.
func (l *list) push(base unsafe.Pointer, hdr uint32) error {
	rel := hdr - l.area
	*u32(base, hdr+sliceOffSize) = 0
	*u32(base, hdr+sliceOffStart) = 0
	for range pushTries {
		t := atomic.LoadUint32(l.tail)
		if !l.validRel(t) || t == rel {
			return l.corrupt("tail", t)
		}
		if atomic.CompareAndSwapUint32(l.tail, t, rel) {
			old := l.area + t
			atomic.StoreUint32(u32(base, old+sliceOffNext), rel)
			atomic.OrUint32(u32(base, old+sliceOffFlags), flagWord(flagNext))
			atomic.AddInt32(l.free, 1)
			atomic.AddInt32(l.inUse, -1)
			return nil
		}
	}
	return fmt.Errorf("buffer list at %d: tail keeps changing: %w", l.off, ErrCorrupt)
}

// Bounds of a list's warm slices (keepWarm): the stack holds at most
// maxWarmSlices slices and maxWarmBytes of data, and an eighth of the
// list, so that a list of a few slices holds none.
const (
	maxWarmSlices = 16
	maxWarmBytes  = 512 << 10
)

// keepWarm keeps the slice whose header is at absolute offset hdr, which the
// caller has claimed (its flags are 0), on this process's stack for its
// next pop, and reports whether it did: only while the stack has room and
// at least a quarter of the list's slices are free, so that the peer never
// runs short for it. A warm slice stays off the free list, flags 0, size
// and start 0; the shared counters count it in use, as before the free
// (docs/protocol.md section 2.4, "Warm slices").
//
// Why: the free list is first in, first out, so a pushed slice comes back
// only after every other free slice of its class, its lines and page long
// gone from the caches. A warm slice comes back at once, still in this
// CPU's caches and TLB.
//
// The check of the free count is made under popMu, as is a failed pop's
// last look at the stack (takeWarmOrNoSpace): a pop that finds the list
// empty either sees the slice kept, or the slice is pushed instead,
// never kept where that pop has stopped looking.
func (l *list) keepWarm(base unsafe.Pointer, hdr uint32) bool {
	if l.warmMax <= 0 || l.short() { // a short list skips the lock
		return false
	}
	l.popMu.Lock()
	defer l.popMu.Unlock()
	if len(l.warm) >= l.warmMax || l.short() {
		return false
	}
	*u32(base, hdr+sliceOffSize) = 0
	*u32(base, hdr+sliceOffStart) = 0
	l.warm = append(l.warm, hdr)
	l.nwarm.Store(int32(len(l.warm)))
	return true
}

// takeWarm pops the most recent warm slice, marked allocated with its cap
// restored, as pop hands slices out; ok is false when none is kept. A warm
// slice whose flags are not 0 was written by the peer, which never owned
// it: that is ErrCorrupt, and the slice is dropped.
//
// Unless locked is set, a stack that its count (nwarm) shows empty is
// not looked at under popMu.
func (l *list) takeWarm(base unsafe.Pointer, locked bool) (hdr uint32, ok bool, err error) {
	if l.warmMax <= 0 || (!locked && l.nwarm.Load() == 0) {
		return 0, false, nil
	}
	l.popMu.Lock()
	n := len(l.warm)
	if n == 0 {
		l.popMu.Unlock()
		return 0, false, nil
	}
	hdr = l.warm[n-1]
	l.warm = l.warm[:n-1]
	l.nwarm.Store(int32(n - 1))
	l.popMu.Unlock()
	*u32(base, hdr+sliceOffCap) = l.dataSize
	if !atomic.CompareAndSwapUint32(u32(base, hdr+sliceOffFlags), 0, flagWord(flagAllocated)) {
		return 0, false, fmt.Errorf("buffer list at %d: warm slice at %d: flags changed to %#x: %w",
			l.off, hdr, wordFlags(atomic.LoadUint32(u32(base, hdr+sliceOffFlags))), ErrCorrupt)
	}
	return hdr, true, nil
}

// takeWarmOrNoSpace is the end of a pop that found the list empty: a
// warm slice if this process keeps one (looked for under popMu, see
// keepWarm), ErrNoSpace otherwise.
func (l *list) takeWarmOrNoSpace(base unsafe.Pointer) (uint32, error) {
	hdr, ok, err := l.takeWarm(base, true)
	if !ok && err == nil {
		err = ErrNoSpace
	}
	return hdr, err
}

// releaseWarm pushes every warm slice on the free list (docs/protocol.md
// section 2.4), and returns the first error of a push; the slices after
// it stay warm. A warm slice whose flags are not 0 (the peer wrote them) is skipped.
func (l *list) releaseWarm(base unsafe.Pointer) error {
	if l.warmMax <= 0 || l.nwarm.Load() == 0 {
		return nil
	}
	var buf [maxWarmSlices]uint32
	l.popMu.Lock()
	kept := buf[:copy(buf[:], l.warm)]
	l.warm = l.warm[:0]
	l.nwarm.Store(0)
	l.popMu.Unlock()
	for i, hdr := range kept {
		if atomic.LoadUint32(u32(base, hdr+sliceOffFlags)) != 0 {
			continue
		}
		if err := l.push(base, hdr); err != nil {
			l.popMu.Lock()
			l.warm = append(l.warm, kept[i+1:]...)
			l.nwarm.Store(int32(len(l.warm)))
			l.popMu.Unlock()
			return err
		}
	}
	return nil
}

// warmCount returns how many slices this process keeps warm (keepWarm).
func (l *list) warmCount() int {
	if l.warmMax <= 0 {
		return 0
	}
	return int(l.nwarm.Load())
}

// used returns the slices of the list not on its free list, cap minus the
// free count clamped to [0, cap].
func (l *list) used() int {
	free := atomic.LoadInt32(l.free)
	switch {
	case free <= 0:
		return int(l.cap)
	case uint32(free) >= l.cap:
		return 0
	}
	return int(l.cap) - int(free)
}

// short reports whether under a quarter of the list's slices are free, by
// the same snapshot of the free count as used.
func (l *list) short() bool {
	return 4*(int(l.cap)-l.used()) < int(l.cap)
}

// corrupt returns the error for a bad offset read from the list.
func (l *list) corrupt(what string, v uint32) error {
	return fmt.Errorf("buffer list at %d: %s %d is not a slice of the list: %w", l.off, what, v, ErrCorrupt)
}
