package session

import (
	"io"
	"testing"

	"github.com/stretchr/testify/require"
)

// A reader keeps the slices it read warm for its session's next writes
// (docs/protocol.md section 2.4, "Warm slices"): the peer counts them in
// use meanwhile. A reader that goes to sleep for more data hands them back
// to the free lists, so an idle session keeps none.
func TestReaderThatSleepsReleasesWarmSlices(t *testing.T) {
	client, server := pair(t, nil)
	c, s := streamPair(t, client, server)
	msg := make([]byte, 64)
	_, err := c.Write(msg)
	require.NoError(t, err)
	// The read below must not wait: a reader that sleeps hands back what
	// it keeps (streamPair's byte), the behaviour checked further down.
	eventually(t, func() bool {
		s.mu.Lock()
		defer s.mu.Unlock()
		return s.rhead < len(s.recv)
	}, "msg arrives")
	_, err = io.ReadFull(s, msg)
	require.NoError(t, err)
	require.Equal(t, 2, sum(client.Stats().SlicesInUse), "the server keeps the slices it read: streamPair's byte and msg")
	require.Zero(t, sum(server.Stats().SlicesInUse), "its own view counts it free")

	read := make(chan error, 1)
	go func() {
		_, err := io.ReadFull(s, make([]byte, len(msg)))
		read <- err
	}()
	eventually(t, func() bool { return sum(client.Stats().SlicesInUse) == 0 }, "the sleeping reader released it")
	_, err = c.Write(msg)
	require.NoError(t, err)
	require.NoError(t, result(t, read))
}

// The slice a reader just read is the first its session's next write
// takes: an answer travels in its request's slice.
func TestWriteReusesTheSliceJustRead(t *testing.T) {
	client, server := pair(t, nil)
	c, s := streamPair(t, client, server)
	msg := make([]byte, 64)
	_, err := c.Write(msg)
	require.NoError(t, err)
	var req uint32
	eventually(t, func() bool {
		s.mu.Lock()
		defer s.mu.Unlock()
		if s.rhead < len(s.recv) {
			req = s.recv[s.rhead].off
		}
		return req != 0
	}, "the request arrives")
	_, err = io.ReadFull(s, msg)
	require.NoError(t, err)
	region := server.shm.mem.region
	off, err := region.Alloc(64)
	require.NoError(t, err)
	require.Equal(t, req, off, "the request's slice, kept warm, comes first")
	require.NoError(t, region.Free(off))
}
