package buffer

// listInfo describes one buffer list of a region, for tests.
type listInfo struct {
	Offset    uint32 // absolute offset in bytes of the list header
	Cap       uint32 // slices in the list
	SliceSize uint32 // data bytes of each slice, header excluded
}

// listInfo returns the geometry of r's buffer lists, in ascending order of
// offset and slice size.
func (r *Region) listInfo() []listInfo {
	out := make([]listInfo, len(r.lists))
	for i := range r.lists {
		l := &r.lists[i]
		out[i] = listInfo{Offset: l.off, Cap: l.cap, SliceSize: l.dataSize}
	}
	return out
}
