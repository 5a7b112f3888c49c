package session

import (
	"bytes"
	"io"
	"testing"

	"github.com/stretchr/testify/require"
)

// The pools' classes: a copy of at most 64 KiB comes from a buffer of the
// next power of two, at least 64 bytes, so a pooled buffer of more than 64
// bytes is less than twice what it holds; the bytes handed out end at the
// copy's length. Longer copies are not pooled.
func TestSpillBufClasses(t *testing.T) {
	for _, tc := range []struct{ n, class, capacity int }{
		{1, 0, 64},
		{59, 0, 64},
		{64, 0, 64},
		{65, 1, 128},
		{256, 2, 256},
		{257, 3, 512},
		{4097, 7, 8192},
		{40000, 10, 65536},
		{65496, 10, 65536},
		{65536, 10, 65536},
		{65537, -1, 65537},
	} {
		require.Equal(t, tc.class, spillClass(tc.n), "class of %d bytes", tc.n)
		data, buf := getSpillBuf(tc.n)
		require.Len(t, data, tc.n)
		require.Equal(t, tc.n, cap(data), "the bytes handed out end at the copy")
		if tc.class < 0 {
			require.Nil(t, buf)
			continue
		}
		require.NotNil(t, buf)
		require.Equal(t, tc.capacity, cap(*buf))
		if tc.n > minSpillBuf {
			require.Less(t, cap(*buf), 2*tc.n)
		}
		putSpillBuf(buf)
	}
	putSpillBuf(nil) // ignored
}

// A stalled reader's data copied out of shared memory comes in pooled
// buffers. A buffer behind a zero-copy view (ReadChunk) goes back to its
// pool only at ReleasePreviousRead, so copies made meanwhile, which take
// buffers from the same pools, cannot overwrite the view; a buffer read by
// Read goes back at once. Every byte arrives intact either way.
func TestSpillBuffersRecycled(t *testing.T) {
	client, server := pair(t, tinyConfig())
	c, s := streamPair(t, client, server)
	data := randomBytes(2<<20, 3)
	// Nobody reads while the region (64 KiB) takes 2 MiB: the server
	// copies most of it out as it arrives.
	_, err := c.Write(data)
	require.NoError(t, err)
	require.NoError(t, c.CloseWrite())
	require.NotZero(t, server.Stats().Spilled)

	pooled := func() (n int) {
		s.mu.Lock()
		defer s.mu.Unlock()
		for _, ch := range s.recv[s.rhead:] {
			if ch.buf != nil {
				n++
			}
		}
		return n
	}
	heldBufs := func() int {
		s.mu.Lock()
		defer s.mu.Unlock()
		return len(s.heldBufs)
	}
	require.NotZero(t, pooled(), "no copied-out message sits in a pooled buffer")

	// First half: zero-copy views, four at a time, checked again after
	// other copies have taken buffers from the pools and filled them.
	got := 0
	sawHeld := false
	for got < len(data)/2 {
		var views [][]byte
		var at []int
		for range 4 {
			b, err := s.ReadChunk(16 << 10)
			require.NoError(t, err)
			views, at = append(views, b), append(at, got)
			got += len(b)
		}
		if heldBufs() > 0 {
			sawHeld = true
		}
		for i := range spillPools {
			d, buf := getSpillBuf(minSpillBuf << i)
			for j := range d {
				d[j] = 0xa5
			}
			putSpillBuf(buf)
		}
		for i, b := range views {
			require.True(t, bytes.Equal(data[at[i]:at[i]+len(b)], b), "view at %d changed before its release", at[i])
		}
		s.ReleasePreviousRead()
		require.Zero(t, heldBufs(), "a release kept buffers")
	}
	require.True(t, sawHeld, "no zero-copy view of a pooled buffer was held until its release")

	// The rest through Peek and Read, with no release: the views Peek
	// pins are kept for a release up to a bound, and the rest left to the
	// garbage collector, so a reader that never releases holds no more.
	var rest []byte
	buf := make([]byte, 16<<10)
	for {
		if _, err := s.Peek(1); err == io.EOF {
			break
		} else {
			require.NoError(t, err)
		}
		n, err := s.Read(buf)
		require.NoError(t, err)
		rest = append(rest, buf[:n]...)
		require.LessOrEqual(t, heldBufs(), maxHeldBufs)
	}
	require.True(t, bytes.Equal(data[got:], rest), "the bytes read by Read differ")
	require.Equal(t, maxHeldBufs, heldBufs(), "Peek's views were not kept for a release")
	s.ReleasePreviousRead()
	require.Zero(t, heldBufs())
	for i, n := range server.Stats().SlicesInUse {
		require.Zero(t, n, "list %d: slices still in use", i)
	}
}
