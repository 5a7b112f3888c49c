package session

import (
	"errors"
	"os"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// With KeepAlive, a session whose peer takes nothing from the queue any
// more (a frozen process: here a raw client that never harvests) ends
// with an error naming KeepAlive, which is not a deadline (#15).
func TestKeepAliveEndsFrozenPeer(t *testing.T) {
	_, server, _ := rawClient(t, nil, &Config{KeepAlive: 50 * time.Millisecond})
	waitDone(t, server.Done(), "the session's end by KeepAlive")
	err := server.Err()
	require.ErrorContains(t, err, "KeepAlive")
	require.False(t, errors.Is(err, os.ErrDeadlineExceeded))
	require.GreaterOrEqual(t, server.Stats().EventsSent, uint64(1), "a probe went out")
}

// A live peer that has nothing to say takes the probes from its queue:
// the session lives on through many KeepAlive periods. Each check probes
// unless it heard from the peer since the last one, so at least one side
// probes in any two periods. Which side does depends on how the two
// timers fall: a side whose check comes just after the other's probe
// arrived never probes, so the count is of both sides together.
func TestKeepAliveKeepsLivePeer(t *testing.T) {
	client, server := pairWith(t, &Config{KeepAlive: 20 * time.Millisecond}, &Config{KeepAlive: 20 * time.Millisecond})
	eventually(t, func() bool {
		c, s := client.Stats(), server.Stats()
		return c.EventsSent+s.EventsSent >= 20 && c.EventsReceived+s.EventsReceived >= 20
	}, "twenty probes sent and taken, ten periods or more")
	require.NoError(t, client.Err())
	require.NoError(t, server.Err())
	c, err := client.OpenStream(t.Context())
	require.NoError(t, err)
	s := accept(t, server)
	_, err = c.Write([]byte("alive"))
	require.NoError(t, err)
	require.NoError(t, s.SetReadDeadline(time.Now().Add(10*time.Second)))
	b := make([]byte, 5)
	_, err = s.Read(b)
	require.NoError(t, err)
}
