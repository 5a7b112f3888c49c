package session

import (
	"context"
	"io"
	"net"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// accept returns the server's next stream, failing the test after 5 s.
func accept(t testing.TB, server *Session) *Stream {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	st, err := server.AcceptStream(ctx)
	require.NoError(t, err)
	return st
}

// eventually polls cond for up to 5 s: for state that changes when the
// peer's receive loop has run, which the test cannot wait on directly.
func eventually(t *testing.T, cond func() bool, msg string) {
	t.Helper()
	require.Eventually(t, cond, 5*time.Second, time.Millisecond, msg)
}

// OpenStream announces the stream with an empty event: the server accepts
// it before the client writes anything, and can speak first.
func TestAnnounceBeforeData(t *testing.T) {
	client, server := pair(t, nil)
	c, err := client.OpenStream(context.Background())
	require.NoError(t, err)
	s := accept(t, server)
	require.Equal(t, c.ID(), s.ID())
	require.Zero(t, s.Buffered(), "the announcement carries no bytes")

	_, err = s.Write([]byte("220 ready\r\n"))
	require.NoError(t, err)
	got := make([]byte, 11)
	_, err = io.ReadFull(c, got)
	require.NoError(t, err)
	require.Equal(t, "220 ready\r\n", string(got))

	require.NoError(t, c.Close())
	_, err = s.Read(make([]byte, 1))
	require.ErrorIs(t, err, io.EOF)
	require.NoError(t, s.Close())
	eventually(t, func() bool { return client.NumStreams() == 0 && server.NumStreams() == 0 }, "both sides forget the stream")
	// The client gets its slices back when the server frees them and,
	// for a slice its reader kept warm for the next write, when the idle
	// session releases it, which happens after the stream is forgotten.
	eventually(t, func() bool { return sum(client.Stats().SlicesInUse) == 0 }, "the announcement's slice was recycled")
}

// A stream opened and closed without a byte is still seen by the server,
// which reads EOF at once.
func TestOpenCloseWithoutData(t *testing.T) {
	client, server := pair(t, nil)
	c, err := client.OpenStream(context.Background())
	require.NoError(t, err)
	require.NoError(t, c.Close())
	s := accept(t, server)
	n, err := s.Read(make([]byte, 8))
	require.Zero(t, n)
	require.ErrorIs(t, err, io.EOF)
	require.NoError(t, s.Close())
}

// CloseWrite sends the close once: the peer reads EOF after the data while
// we keep reading its reply; Close afterwards sends nothing more.
func TestCloseWrite(t *testing.T) {
	client, server := pair(t, nil)
	c, err := client.OpenStream(context.Background())
	require.NoError(t, err)
	s := accept(t, server)

	b, err := c.Reserve(5)
	require.NoError(t, err)
	copy(b, "query")
	require.NoError(t, c.CloseWrite(), "CloseWrite flushes reserved bytes first")
	require.NoError(t, c.CloseWrite(), "a second CloseWrite is a no-op")
	_, err = c.Write([]byte("x"))
	require.ErrorIs(t, err, ErrWriteClosed)
	require.ErrorIs(t, err, net.ErrClosed)

	got, err := io.ReadAll(s)
	require.NoError(t, err)
	require.Equal(t, "query", string(got), "the peer reads the data, then EOF")

	// The server answers on its still-open write side.
	_, err = s.Write([]byte("answer"))
	require.NoError(t, err)
	got = make([]byte, 6)
	_, err = io.ReadFull(c, got)
	require.NoError(t, err)
	require.Equal(t, "answer", string(got))
	require.NoError(t, s.Close())
	_, err = c.Read(make([]byte, 1))
	require.ErrorIs(t, err, io.EOF)

	sent := client.Stats().EventsSent // announce, data, close
	require.EqualValues(t, 3, sent)
	require.NoError(t, c.Close())
	require.Equal(t, sent, client.Stats().EventsSent, "Close after CloseWrite sends no second close")
	eventually(t, func() bool { return client.NumStreams() == 0 && server.NumStreams() == 0 }, "both sides forget the stream")

	// The id is reused and the new stream is a fresh one on the server.
	c2, err := client.OpenStream(context.Background())
	require.NoError(t, err)
	require.Equal(t, c.ID(), c2.ID())
	s2 := accept(t, server)
	require.Equal(t, c.ID(), s2.ID())
	_, err = c2.Write([]byte("again"))
	require.NoError(t, err)
	got = make([]byte, 5)
	_, err = io.ReadFull(s2, got)
	require.NoError(t, err)
	require.Equal(t, "again", string(got))
}

// CloseWrite on the server side: the client reads EOF and still writes.
func TestCloseWriteServer(t *testing.T) {
	client, server := pair(t, nil)
	c, err := client.OpenStream(context.Background())
	require.NoError(t, err)
	s := accept(t, server)
	_, err = s.Write([]byte("greeting"))
	require.NoError(t, err)
	require.NoError(t, s.CloseWrite())
	got, err := io.ReadAll(c)
	require.NoError(t, err)
	require.Equal(t, "greeting", string(got))
	_, err = c.Write([]byte("reply"))
	require.NoError(t, err)
	require.NoError(t, c.Close())
	got, err = io.ReadAll(s)
	require.NoError(t, err)
	require.Equal(t, "reply", string(got))
	require.NoError(t, s.Close())
	eventually(t, func() bool { return client.NumStreams() == 0 && server.NumStreams() == 0 }, "both sides forget the stream")
}

// A stream id comes back only when both sides have closed the stream.
func TestStreamIDReuse(t *testing.T) {
	client, server := pair(t, nil)
	ctx := context.Background()
	c1, err := client.OpenStream(ctx)
	require.NoError(t, err)
	s1 := accept(t, server)
	require.NoError(t, c1.Close())

	// The server has not closed: the id stays taken.
	c2, err := client.OpenStream(ctx)
	require.NoError(t, err)
	require.NotEqual(t, c1.ID(), c2.ID())
	s2 := accept(t, server)
	require.Equal(t, c2.ID(), s2.ID())

	_, err = s1.Read(make([]byte, 1))
	require.ErrorIs(t, err, io.EOF)
	require.NoError(t, s1.Close())
	eventually(t, func() bool {
		client.mu.Lock()
		defer client.mu.Unlock()
		return len(client.tab.freeIDs) == 1
	}, "the client sees the server's close")

	// Now it is reused, by a stream the server accepts as new.
	c3, err := client.OpenStream(ctx)
	require.NoError(t, err)
	require.Equal(t, c1.ID(), c3.ID())
	s3 := accept(t, server)
	require.Equal(t, c1.ID(), s3.ID())
	require.NotSame(t, s1, s3)
	_, err = c3.Write([]byte("three"))
	require.NoError(t, err)
	got := make([]byte, 5)
	_, err = io.ReadFull(s3, got)
	require.NoError(t, err)
	require.Equal(t, "three", string(got))

	// Closes in the other order: server first.
	require.NoError(t, s2.Close())
	_, err = c2.Read(make([]byte, 1))
	require.ErrorIs(t, err, io.EOF)
	require.NoError(t, c2.Close())
	c4, err := client.OpenStream(ctx)
	require.NoError(t, err)
	require.Equal(t, c2.ID(), c4.ID(), "reused as soon as the client's close is out")
	s4 := accept(t, server)
	_, err = c4.Write([]byte("four"))
	require.NoError(t, err)
	got = make([]byte, 4)
	_, err = io.ReadFull(s4, got)
	require.NoError(t, err)
	require.Equal(t, "four", string(got))
}

// Many open/exchange/close cycles reuse a handful of ids and leave no
// stream, slice or id behind.
func TestStreamIDReuseCycles(t *testing.T) {
	client, server := pair(t, nil)
	ctx := context.Background()
	done := make(chan error, 1)
	go func() {
		for range 500 {
			s, err := server.AcceptStream(ctx)
			if err != nil {
				done <- err
				return
			}
			_, err = io.Copy(s, s)
			s.Close()
			if err != nil {
				done <- err
				return
			}
		}
		done <- nil
	}()
	maxID := uint32(0)
	msg := make([]byte, 1000)
	for i := range 500 {
		c, err := client.OpenStream(ctx)
		require.NoError(t, err)
		maxID = max(maxID, c.ID())
		msg[0] = byte(i)
		_, err = c.Write(msg)
		require.NoError(t, err)
		require.NoError(t, c.CloseWrite())
		got, err := io.ReadAll(c)
		require.NoError(t, err)
		require.Equal(t, msg, got)
		require.NoError(t, c.Close())
	}
	require.NoError(t, <-done)
	require.Less(t, maxID, uint32(10), "ids are reused, not consumed")
	eventually(t, func() bool {
		return client.NumStreams() == 0 && server.NumStreams() == 0 &&
			sum(client.Stats().SlicesInUse) == 0
	}, "nothing left behind")
}

// A server whose accept backlog is full refuses a stream: the client reads
// and writes ErrStreamRefused (ECONNREFUSED), the data it wrote before it
// knew is dropped rather than opening a phantom stream, and the id is
// reused cleanly once both closes were exchanged.
func TestRefusedStream(t *testing.T) {
	client, server := pair(t, &Config{AcceptBacklog: 1})
	ctx := context.Background()
	c1, err := client.OpenStream(ctx)
	require.NoError(t, err)
	c2, err := client.OpenStream(ctx)
	require.NoError(t, err)
	// Sent before the refusal came back, or refused already.
	if _, err = c2.Write([]byte("dropped")); err != nil {
		require.ErrorIs(t, err, ErrStreamRefused)
	}
	_, err = c2.Read(make([]byte, 1))
	require.ErrorIs(t, err, ErrStreamRefused)
	require.ErrorIs(t, err, syscall.ECONNREFUSED)
	_, err = c2.Write([]byte("late"))
	require.ErrorIs(t, err, ErrStreamRefused)
	_, err = c2.ReadChunk(1)
	require.ErrorIs(t, err, ErrStreamRefused)
	s1 := accept(t, server)
	require.Equal(t, c1.ID(), s1.ID())
	require.NoError(t, c2.Close())
	eventually(t, func() bool { return client.NumStreams() == 1 && server.NumStreams() == 1 }, "the refused stream is forgotten")

	c3, err := client.OpenStream(ctx)
	require.NoError(t, err)
	require.Equal(t, c2.ID(), c3.ID())
	_, err = c3.Write([]byte("kept"))
	require.NoError(t, err)
	s3 := accept(t, server)
	got := make([]byte, 4)
	_, err = io.ReadFull(s3, got)
	require.NoError(t, err)
	require.Equal(t, "kept", string(got), "no byte of the refused stream")
	eventually(t, func() bool { return sum(server.Stats().SlicesInUse) == 0 }, "the dropped data was recycled")
}

// Every call on a closed stream fails with net.ErrClosed.
func TestClosedStreamErrors(t *testing.T) {
	client, server := pair(t, nil)
	c, err := client.OpenStream(context.Background())
	require.NoError(t, err)
	accept(t, server)
	require.NoError(t, c.Close())
	calls := map[string]func() error{
		"Read":             func() error { _, err := c.Read(make([]byte, 1)); return err },
		"Write":            func() error { _, err := c.Write([]byte("x")); return err },
		"Reserve":          func() error { _, err := c.Reserve(1); return err },
		"Flush":            c.Flush,
		"Peek":             func() error { _, err := c.Peek(1); return err },
		"ReadBytes":        func() error { _, err := c.ReadBytes(1); return err },
		"Discard":          func() error { _, err := c.Discard(1); return err },
		"SetDeadline":      func() error { return c.SetDeadline(time.Now()) },
		"SetReadDeadline":  func() error { return c.SetReadDeadline(time.Now()) },
		"SetWriteDeadline": func() error { return c.SetWriteDeadline(time.Now()) },
		"CloseWrite":       c.CloseWrite,
		"Close":            c.Close,
	}
	for name, call := range calls {
		require.ErrorIs(t, call(), net.ErrClosed, name)
	}

	// The same for a stream whose session was closed locally.
	c2, err := client.OpenStream(context.Background())
	require.NoError(t, err)
	require.NoError(t, client.Close())
	_, err = c2.Write([]byte("x"))
	require.ErrorIs(t, err, net.ErrClosed)
	_, err = c2.Read(make([]byte, 1))
	require.ErrorIs(t, err, net.ErrClosed)
	_, err = client.OpenStream(context.Background())
	require.ErrorIs(t, err, net.ErrClosed)
	require.ErrorIs(t, client.Close(), net.ErrClosed)
}

// A session with an idle timeout ends once it has had no stream for that
// long, and not while one is open.
func TestIdleTimeout(t *testing.T) {
	client, server := pair(t, nil)
	c, err := client.OpenStream(context.Background())
	require.NoError(t, err)
	s := accept(t, server)
	client.SetIdleTimeout(time.Millisecond)
	// While the stream is open the session stays: a round trip works after
	// many idle periods would have passed.
	deadline := time.Now().Add(50 * time.Millisecond)
	for time.Now().Before(deadline) {
		_, err = c.Write([]byte("x"))
		require.NoError(t, err)
		_, err = io.ReadFull(s, make([]byte, 1))
		require.NoError(t, err)
	}
	require.NoError(t, client.Err())
	require.NoError(t, c.Close())
	require.NoError(t, s.Close())
	select {
	case <-client.Done():
	case <-time.After(5 * time.Second):
		t.Fatal("idle session not closed")
	}
	require.ErrorIs(t, client.Err(), ErrSessionClosed)
	_, err = client.OpenStream(context.Background())
	require.ErrorIs(t, err, net.ErrClosed)
}

// Stats counts what went through each path.
func TestStats(t *testing.T) {
	client, server := pair(t, nil)
	c, err := client.OpenStream(context.Background())
	require.NoError(t, err)
	s := accept(t, server)
	_, err = c.Write(make([]byte, 10000))
	require.NoError(t, err)
	_, err = io.ReadFull(s, make([]byte, 10000))
	require.NoError(t, err)
	cs := client.Stats()
	require.EqualValues(t, 10000, cs.BytesSent)
	require.EqualValues(t, 2, cs.EventsSent, "announce and data")
	require.NotZero(t, cs.WakeupsSent)
	require.Equal(t, 1, cs.ActiveStreams)
	require.Len(t, cs.SlicesInUse, 3)
	ss := server.Stats()
	require.EqualValues(t, 10000, ss.BytesReceived)
	require.EqualValues(t, 2, ss.EventsReceived)
	eventually(t, func() bool { return server.Stats().WakeupsReceived == cs.WakeupsSent }, "every Polling arrives")
	require.Zero(t, ss.FallbackReads)

	// Bytes held by an unread message show as slices in use.
	_, err = c.Write(make([]byte, 100))
	require.NoError(t, err)
	eventually(t, func() bool { return s.Buffered() == 100 }, "the message arrives")
	require.Equal(t, 1, sum(server.Stats().SlicesInUse))
	_, err = io.ReadFull(s, make([]byte, 100))
	require.NoError(t, err)
	require.Zero(t, sum(server.Stats().SlicesInUse))
}

// Refuse on a server closes an accepted stream as refused: the client's
// reads and writes fail with ErrStreamRefused, and what it sent is
// dropped. On a client it is Close: the server reads io.EOF.
func TestRefuse(t *testing.T) {
	client, server := pair(t, nil)
	c, err := client.OpenStream(t.Context())
	require.NoError(t, err)
	_, err = c.Write([]byte("unwanted"))
	require.NoError(t, err)
	s := accept(t, server)
	require.NoError(t, s.Refuse())
	_, err = c.Read(make([]byte, 1))
	require.ErrorIs(t, err, ErrStreamRefused)
	_, err = c.Write([]byte("more"))
	require.ErrorIs(t, err, ErrStreamRefused)
	require.ErrorIs(t, s.Refuse(), ErrStreamClosed, "a second Refuse is a second Close")
	require.NoError(t, c.Close())

	c, err = client.OpenStream(t.Context())
	require.NoError(t, err)
	s = accept(t, server)
	require.NoError(t, c.Refuse())
	_, err = s.Read(make([]byte, 1))
	require.ErrorIs(t, err, io.EOF)
	require.NoError(t, s.Close())
	eventually(t, func() bool {
		return client.NumStreams() == 0 && server.NumStreams() == 0 &&
			sum(client.Stats().SlicesInUse) == 0
	}, "nothing left behind")
}
