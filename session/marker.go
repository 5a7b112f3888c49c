package session

import "encoding/binary"

// The shmlink marker tells a shmlink client that its server is shmlink
// too, with nothing new on the wire (docs/protocol.md section 11): a
// shmlink client formats its buffer region markerSize bytes short of the
// mapping, and a shmlink server writes the marker into those last bytes
// before it sends AckShareMemory. Every peer's layout leaves bytes past the
// region's lists unused (section 2.1), and other servers never write there,
// so the client reads features 0 from them.
const (
	markerSize  = 16
	markerMagic = "SHMLINK\x01" // 8 bytes, then the features (u32) and 0 (u32)

	// featAnnounce: the server takes a stream announced by an empty slice
	// (section 11); shmipc-go's server would follow the slice's stale link.
	featAnnounce uint32 = 1
)

// markRegion writes the marker into the last markerSize bytes of a
// client's buffer mapping, if they lie past the region's lists, and
// reports whether it did. The caller runs it under the fault guard.
func markRegion(bufMem []byte) bool {
	if len(bufMem) < 8+markerSize {
		return false
	}
	used := uint64(binary.NativeEndian.Uint32(bufMem[4:8])) // section 2.1: the lists' bytes after the header
	if uint64(len(bufMem)) < 8+used+markerSize {
		return false
	}
	m := bufMem[len(bufMem)-markerSize:]
	copy(m, markerMagic)
	binary.NativeEndian.PutUint32(m[8:], featAnnounce)
	binary.NativeEndian.PutUint32(m[12:], 0)
	return true
}

// markedFeatures returns the features a shmlink server marked in the
// client's buffer mapping, or 0. The caller runs it under the fault guard.
func markedFeatures(bufMem []byte) uint32 {
	if len(bufMem) < markerSize {
		return 0
	}
	m := bufMem[len(bufMem)-markerSize:]
	if string(m[:8]) != markerMagic {
		return 0
	}
	return binary.NativeEndian.Uint32(m[8:])
}
