package session

import (
	"bytes"
	"io"
	"math/rand/v2"
	"os"
	"testing"
	"time"

	"github.com/shmlink/shmlink/buffer"
	"github.com/stretchr/testify/require"
)

// tinyConfig is a 64 KiB region of 4 KiB slices: easy to exhaust.
func tinyConfig() *Config {
	return &Config{
		BufferSize:  64 << 10,
		SizeClasses: []buffer.SizeClass{{SliceSize: 4076, Percent: 100}},
	}
}

func randomBytes(n int, seed uint64) []byte {
	b := make([]byte, n)
	r := rand.New(rand.NewPCG(seed, seed))
	for i := range b {
		b[i] = byte(r.Uint32())
	}
	return b
}

// A reader that keeps every slice (no copying out): the writer waits for
// space, its deadline ends the wait, nothing goes over the socket, and the
// bytes it counted as written arrive intact once the reader reads.
func TestBackpressureDeadline(t *testing.T) {
	scfg := tinyConfig()
	scfg.StreamMemoryLimit, scfg.StreamHeapLimit = -1, -1
	client, server := pairWith(t, tinyConfig(), scfg)
	c, s := streamPair(t, client, server)

	data := randomBytes(1<<20, 1)
	require.NoError(t, c.SetWriteDeadline(time.Now().Add(100*time.Millisecond)))
	n, err := c.Write(data)
	require.ErrorIs(t, err, os.ErrDeadlineExceeded)
	require.Less(t, n, 64<<10, "more than the region was written")
	_, err = c.Reserve(100)
	require.ErrorIs(t, err, os.ErrDeadlineExceeded, "Reserve waits for space too")

	st := client.Stats()
	require.Zero(t, st.FallbackWrites, "%+v", st)
	require.NotZero(t, st.MemoryFull, "%+v", st)

	// The reader drains; the writer, without a deadline, finishes the rest.
	require.NoError(t, c.SetWriteDeadline(time.Time{}))
	done := make(chan error, 1)
	go func() {
		_, err := c.Write(data[n:])
		if err == nil {
			err = c.CloseWrite()
		}
		done <- err
	}()
	got, err := io.ReadAll(s)
	require.NoError(t, err)
	require.NoError(t, <-done)
	require.True(t, bytes.Equal(data, got), "the bytes differ")
	require.Zero(t, client.Stats().FallbackWrites)
}

// One stream whose reader stalls must not starve the others: past
// Config.StreamMemoryLimit its data is copied to the heap and its slices
// freed, so another stream keeps exchanging through the same small region.
func TestStalledReader(t *testing.T) {
	client, server := pair(t, tinyConfig())
	stalledC, stalledS := streamPair(t, client, server)
	c, s := streamPair(t, client, server)

	data := randomBytes(1<<20, 2)
	_, err := stalledC.Write(data) // nobody reads it yet
	require.NoError(t, err)

	msg := make([]byte, 1024)
	for i := range 100 {
		msg[0] = byte(i)
		_, err := c.Write(msg)
		require.NoError(t, err)
		_, err = io.ReadFull(s, msg)
		require.NoError(t, err)
		_, err = s.Write(msg)
		require.NoError(t, err)
		_, err = io.ReadFull(c, msg)
		require.NoError(t, err)
		require.Equal(t, byte(i), msg[0])
	}

	require.NoError(t, stalledC.CloseWrite())
	got, err := io.ReadAll(stalledS)
	require.NoError(t, err)
	require.True(t, bytes.Equal(data, got), "the stalled stream's bytes differ")

	st := server.Stats()
	require.NotZero(t, st.Spilled, "%+v", st)
	require.Zero(t, client.Stats().FallbackWrites)
	for i, n := range st.SlicesInUse {
		require.Zero(t, n, "list %d: slices still in use", i)
	}
}
