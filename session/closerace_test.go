package session

import (
	"testing"

	"github.com/stretchr/testify/require"
)

// A session's Close that finds a stream's Close under way in another
// goroutine (a server's handler closing its connection as the server
// shuts down) waits for it: the memory is unmapped when Close returns.
func TestSessionCloseWaitsForStreamClose(t *testing.T) {
	for try := range 100 {
		client, server := pair(t, nil)
		_, s := streamPair(t, client, server)
		closed := make(chan error, 1)
		go func() { closed <- s.Close() }()
		require.NoError(t, server.Close())
		require.True(t, server.shm.unmapped.Load(), "try %d: the memory is mapped after Close returned", try)
		<-closed
		client.Close()
	}
}
