package session

import "encoding/binary"

// The shmlink markers tell each side that its peer is shmlink too, with
// nothing new on the wire (docs/protocol.md section 11): a shmlink client
// formats its buffer region markerSize bytes short of the mapping and
// writes its own marker into those last bytes; a shmlink server reads the
// client's marker and then writes its own over it before it sends
// AckShareMemory. Every peer's layout leaves bytes past the region's lists
// unused (section 2.1), other clients leave them zero and other servers
// never touch them, so either side reads features 0 from an unmodified
// peer.
const (
	markerSize        = 16
	markerMagic       = "SHMLINK\x01" // the server's: 8 bytes, then the features (u32) and 0 (u32)
	clientMarkerMagic = "SHMLINKC"    // the client's, in the same layout

	// featAnnounce (server): the server takes a stream announced by an
	// empty slice (section 11); shmipc-go's server would follow the
	// slice's stale link.
	featAnnounce uint32 = 1
	// featCloseReason (client): the client reads the reason byte of a
	// close's status (section 11), so the server may tell it that it
	// refused a stream; other clients might take a status above 1 for
	// another state.
	featCloseReason uint32 = 1 << 1
)

// Reasons in the second byte of a close's status (docs/protocol.md
// section 11), sent only to a client that marked featCloseReason.
const (
	reasonShift   = 8
	reasonRefused = 1 // the server refused the stream
)

// markerArea returns the last markerSize bytes of a client's buffer
// mapping if they lie past the region's lists, or nil. The caller runs it
// under the fault guard.
func markerArea(bufMem []byte) []byte {
	if len(bufMem) < 8+markerSize {
		return nil
	}
	used := uint64(binary.NativeEndian.Uint32(bufMem[4:8])) // section 2.1: the lists' bytes after the header
	if uint64(len(bufMem)) < 8+used+markerSize {
		return nil
	}
	return bufMem[len(bufMem)-markerSize:]
}

// markRegion writes the server's marker into a client's buffer mapping, if
// its last markerSize bytes lie past the region's lists, and reports
// whether it did. The caller runs it under the fault guard.
func markRegion(bufMem []byte) bool {
	return writeMarker(markerArea(bufMem), markerMagic, featAnnounce)
}

// markClientRegion writes the client's marker into its own buffer mapping,
// formatted markerSize bytes short; a server reads it with
// clientFeatures before it writes its own marker there.
func markClientRegion(bufMem []byte) bool {
	return writeMarker(markerArea(bufMem), clientMarkerMagic, featCloseReason)
}

// writeMarker writes magic and features into m, if it is a marker area.
func writeMarker(m []byte, magic string, features uint32) bool {
	if len(m) != markerSize {
		return false
	}
	copy(m, magic)
	binary.NativeEndian.PutUint32(m[8:], features)
	binary.NativeEndian.PutUint32(m[12:], 0)
	return true
}

// clientFeatures returns the features a shmlink client marked in its
// buffer mapping, or 0. The caller runs it under the fault guard.
func clientFeatures(bufMem []byte) uint32 {
	m := markerArea(bufMem)
	if m == nil || string(m[:8]) != clientMarkerMagic {
		return 0
	}
	return binary.NativeEndian.Uint32(m[8:])
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
