package session

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// noPolls turns spinning off: every wait for data parks (the baton's
// path, ctlread.go).
var noPolls = &Config{PollTime: -1}

// echo serves st until it ends: it writes back what it reads.
func echo(st *Stream) {
	buf := make([]byte, 4096)
	for {
		n, err := st.Read(buf)
		if err != nil {
			return
		}
		if _, err := st.Write(buf[:n]); err != nil {
			return
		}
	}
}

// A reader that parks while nobody else waits reads the peer's wakeup
// itself: the kernel's wakeup runs it, not the receive loop's harvest.
func TestParkedReaderReadsWakeup(t *testing.T) {
	client, server := pair(t, noPolls)
	c, s := streamPair(t, client, server)
	const rounds = 20
	for i := range rounds {
		got := make([]byte, 1)
		done := readAsync(c, got)
		waitHolder(t, c)
		_, err := s.Write([]byte{byte(i)})
		require.NoError(t, err)
		require.NoError(t, <-done)
		require.Equal(t, byte(i), got[0])
	}
	// Each round's Polling reached a reader holding the baton, which
	// read it itself.
	cs := client.Stats()
	require.GreaterOrEqual(t, cs.DirectWakeups, uint64(rounds), "client %+v", cs)

	// Round trips in a loop: the readers on both sides keep the baton.
	go echo(s)
	msg := make([]byte, 64)
	got := make([]byte, 64)
	for i := range 300 {
		msg[0] = byte(i)
		_, err := c.Write(msg)
		require.NoError(t, err)
		_, err = io.ReadFull(c, got)
		require.NoError(t, err)
		require.Equal(t, msg, got)
	}
	require.Greater(t, client.Stats().DirectWakeups, cs.DirectWakeups)
	require.NotZero(t, server.Stats().DirectWakeups)
}

// waitHolder waits until st's reader holds the baton.
func waitHolder(t *testing.T, st *Stream) {
	t.Helper()
	waitFor(t, "the reader holds the baton", func() bool { return st.s.rd.holder.Load() == st })
}

// A reader that holds the baton still sees its read deadline, and Close.
func TestHolderDeadlineAndClose(t *testing.T) {
	client, server := pair(t, noPolls)
	c, _ := streamPair(t, client, server)

	done := readAsync(c, make([]byte, 1))
	waitHolder(t, c)
	require.NoError(t, c.SetReadDeadline(time.Now().Add(20*time.Millisecond)))
	err := <-done
	require.ErrorIs(t, err, os.ErrDeadlineExceeded)

	require.NoError(t, c.SetReadDeadline(time.Time{}))
	done = readAsync(c, make([]byte, 1))
	waitHolder(t, c)
	require.NoError(t, c.Close())
	select {
	case err := <-done:
		require.ErrorIs(t, err, ErrStreamClosed)
	case <-time.After(5 * time.Second):
		t.Fatal("Close did not wake the reader holding the baton")
	}
	// The baton went back: the session still delivers.
	c2, s2 := streamPair(t, client, server)
	go echo(s2)
	_, err = c2.Write([]byte("again"))
	require.NoError(t, err)
	got := make([]byte, 5)
	_, err = io.ReadFull(c2, got)
	require.NoError(t, err)
	require.Equal(t, "again", string(got))
}

// FallbackData is the receive loop's to read: a holder gives the baton
// back when one comes, and the stream it is for gets its bytes, while the
// holder goes on waiting for its own.
func TestHolderGivesBackFallbackData(t *testing.T) {
	client, server := pair(t, noPolls)
	c1, s1 := streamPair(t, client, server)
	c2, s2 := streamPair(t, client, server)

	done1 := readAsync(s1, make([]byte, 3))
	waitHolder(t, s1)
	require.NoError(t, client.writeFallback(c2.ID(), []byte("via socket"), true, nil))
	got := make([]byte, len("via socket"))
	_, err := io.ReadFull(s2, got)
	require.NoError(t, err)
	require.Equal(t, "via socket", string(got))

	_, err = c1.Write([]byte("one"))
	require.NoError(t, err)
	require.NoError(t, <-done1)
}

// Readers of several streams waiting at once all get their data, whoever
// holds the baton.
func TestManyParkedReaders(t *testing.T) {
	client, server := pair(t, noPolls)
	const n = 8
	var wg sync.WaitGroup
	errs := make(chan error, n)
	for range n {
		c, s := streamPair(t, client, server)
		go echo(s)
		wg.Go(func() {
			msg := []byte(fmt.Sprintf("ping-%d", c.ID()))
			got := make([]byte, len(msg))
			for range 200 {
				if _, err := c.Write(msg); err != nil {
					errs <- err
					return
				}
				if _, err := io.ReadFull(c, got); err != nil {
					errs <- err
					return
				}
				if string(got) != string(msg) {
					errs <- errors.New("mismatch: " + string(got))
					return
				}
			}
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		require.NoError(t, err)
	}
}

// The baton's holder leaves it free when it returns; a free baton goes
// back to the receive loop soon, so that messages for streams nobody waits
// on (here, the announcement of a new stream) are read.
func TestFreeBatonReturns(t *testing.T) {
	client, server := pair(t, noPolls)
	c, s := streamPair(t, client, server)
	done := readAsync(s, make([]byte, 1))
	waitHolder(t, s)
	_, err := c.Write([]byte{1})
	require.NoError(t, err)
	require.NoError(t, <-done)
	// Nobody waits on the server now; a new stream must still be accepted.
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	c2, err := client.OpenStream(ctx)
	require.NoError(t, err)
	s2, err := server.AcceptStream(ctx)
	require.NoError(t, err)
	require.Equal(t, c2.ID(), s2.ID())
	waitFor(t, "the receive loop holds the baton", func() bool { return server.rd.state.Load() == batonLoop })
}
