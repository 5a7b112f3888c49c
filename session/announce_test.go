package session

import (
	"context"
	"io"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// A stream announced with an empty FallbackData, because no slice was
// free, must not have its close (or data) overtake that announcement on
// the IO queue. The server drains the queue from its receive loop but also
// from any reader polling for its data (Stream.poll), while the socket
// behind it may lag: a close popped first is dropped (no such stream yet)
// and the late announcement then opens a stream that never ends, and a
// stream whose whole life came first is opened anew after it ended (found
// by the root package's TestSoak: a server stream that never got its
// first byte). Holding the server's drainMu stands in for that lag: its
// receive loop stops before it dispatches the announcement while the test
// drains the queue as a polling reader would.
func TestFallbackAnnounceNotOvertaken(t *testing.T) {
	client, server := pair(t, tinyConfig())
	client.shm.mu.RLock()
	region := client.shm.mem.region
	var taken []uint32
	for {
		off, err := region.Alloc(0)
		if err != nil {
			break
		}
		taken = append(taken, off)
	}
	client.shm.mu.RUnlock()
	defer func() {
		client.shm.mu.RLock()
		for _, off := range taken {
			region.Free(off)
		}
		client.shm.mu.RUnlock()
	}()

	server.rx.mu.Lock()
	c, err := client.OpenStream(context.Background())
	if err != nil {
		server.rx.mu.Unlock()
		require.NoError(t, err)
	}
	require.NoError(t, c.Close())
	server.shm.mu.RLock()
	_, err = server.harvestLocked(server.shm.mem, false)
	server.shm.mu.RUnlock()
	server.rx.mu.Unlock()
	require.NoError(t, err)

	s := accept(t, server)
	require.Equal(t, c.ID(), s.ID())
	require.NoError(t, s.SetReadDeadline(time.Now().Add(5*time.Second)))
	_, err = s.Read(make([]byte, 1))
	require.ErrorIs(t, err, io.EOF, "the client's close reaches the stream")
	require.NoError(t, s.Close())
	eventually(t, func() bool { return server.NumStreams() == 0 }, "the server forgets the stream")
}
