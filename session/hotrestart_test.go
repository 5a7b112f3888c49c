package session

import (
	"bytes"
	"context"
	"encoding/binary"
	"fmt"
	"io"
	"log/slog"
	"os"
	"regexp"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/shmlink/shmlink/internal/wire"
	"github.com/stretchr/testify/require"
)

// waitDone waits for ch for up to 10 s.
func waitDone(t *testing.T, ch <-chan struct{}, what string) {
	t.Helper()
	select {
	case <-ch:
	case <-time.After(10 * time.Second):
		t.Fatalf("timed out waiting for %s", what)
	}
}

// The whole exchange of docs/protocol.md section 5: the client drains, keeps
// its stream in flight working, acks once that stream is closed, and the
// server then ends the session.
func TestHotRestartDrain(t *testing.T) {
	client, server := pair(t, nil)
	c, s := streamPair(t, client, server)

	require.NoError(t, server.SendHotRestart(7))
	require.ErrorIs(t, server.SendHotRestart(8), ErrDraining, "one hot restart per session")
	waitDone(t, client.draining(), "the client to see HotRestart")
	epoch, ok := client.HotRestartEpoch()
	require.True(t, ok)
	require.Equal(t, uint64(7), epoch)
	epoch, ok = server.HotRestartEpoch()
	require.True(t, ok)
	require.Equal(t, uint64(7), epoch)
	select {
	case <-server.draining():
	default:
		t.Fatal("server not draining after SendHotRestart")
	}

	// The stream in flight keeps working both ways.
	_, err := c.Write([]byte("request"))
	require.NoError(t, err)
	got := make([]byte, 7)
	_, err = io.ReadFull(s, got)
	require.NoError(t, err)
	_, err = s.Write([]byte("reply"))
	require.NoError(t, err)
	_, err = io.ReadFull(c, got[:5])
	require.NoError(t, err)
	require.Equal(t, "reply", string(got[:5]))
	require.NoError(t, server.Err(), "no ack while a stream is open")

	require.NoError(t, c.Close())
	waitDone(t, server.Done(), "the server to end the session after the ack")
	require.ErrorIs(t, server.Err(), ErrHotRestarted)
	waitDone(t, client.Done(), "the client to see the close")
	require.ErrorIs(t, client.Err(), ErrPeerClosed)
	require.NoError(t, s.Close())
}

// An idle client acks at once; from the ack on, OpenStream refuses with
// ErrDraining even while the server has not closed the session (here it
// never sent HotRestart, so it logs the ack and ignores it).
func TestHotRestartAckBlocksOpen(t *testing.T) {
	var log syncBuffer
	scfg := &Config{Logger: slog.New(slog.NewTextHandler(&log, nil))}
	// The longest grace for the unanswered ack (TestHotRestartAckUnanswered).
	client, server := pairWith(t, &Config{HandshakeTimeout: time.Minute}, scfg)
	require.NoError(t, client.handleHotRestart(binary.BigEndian.AppendUint64(nil, 3)))
	waitDone(t, client.draining(), "draining")
	c, err := client.OpenStream(context.Background())
	require.ErrorIs(t, err, ErrDraining)
	require.Nil(t, c)
	require.Eventually(t, func() bool { return strings.Contains(log.String(), "unexpected HotRestartAck ignored") },
		10*time.Second, time.Millisecond, "server log: %s", log.String())
	require.NoError(t, server.Err())
	require.NoError(t, client.Err())
}

// syncBuffer is a log destination safe for concurrent use.
type syncBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (b *syncBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

func (b *syncBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String()
}

// A second HotRestart changes nothing; the ack carries the first epoch.
func TestHotRestartRepeated(t *testing.T) {
	client, server := pair(t, nil)
	c, s := streamPair(t, client, server)
	require.NoError(t, server.SendHotRestart(4))
	waitDone(t, client.draining(), "draining")
	require.NoError(t, server.writeCtl(wire.AppendHotRestart(nil, server.version, wire.TypeHotRestart, 9)))
	require.NoError(t, c.Close())
	require.NoError(t, s.Close())
	waitDone(t, server.Done(), "the ack")
	require.ErrorIs(t, server.Err(), ErrHotRestarted)
	epoch, _ := client.HotRestartEpoch()
	require.Equal(t, uint64(4), epoch)
}

// HotRestart at a server, or HotRestartAck at a client, is a protocol
// error that ends that session, never a crash.
func TestHotRestartWrongDirection(t *testing.T) {
	t.Run("HotRestart to a server", func(t *testing.T) {
		client, server := pair(t, nil)
		require.NoError(t, client.writeCtl(wire.AppendHotRestart(nil, client.version, wire.TypeHotRestart, 1)))
		waitDone(t, server.Done(), "the server to fail")
		require.ErrorIs(t, server.Err(), ErrProtocol)
		require.ErrorContains(t, server.Err(), "HotRestart sent to a server")
	})
	t.Run("HotRestartAck to a client", func(t *testing.T) {
		client, server := pair(t, nil)
		require.NoError(t, server.writeCtl(wire.AppendHotRestart(nil, server.version, wire.TypeHotRestartAck, 1)))
		waitDone(t, client.Done(), "the client to fail")
		require.ErrorIs(t, client.Err(), ErrProtocol)
		require.ErrorContains(t, client.Err(), "HotRestartAck sent to a client")
	})
	t.Run("SendHotRestart on a client", func(t *testing.T) {
		client, _ := pair(t, nil)
		require.ErrorIs(t, client.SendHotRestart(1), errNotServer)
	})
	t.Run("SendHotRestart after the end", func(t *testing.T) {
		_, server := pair(t, nil)
		require.NoError(t, server.Close())
		require.ErrorIs(t, server.SendHotRestart(1), ErrSessionClosed)
	})
}

// Shared-memory names carry the epoch, with the pid right after the
// prefix, where removeStale looks for it.
func TestRandomNameEpoch(t *testing.T) {
	re := regexp.MustCompile(fmt.Sprintf(`^shmlink_%d_e42_[0-9a-f]{16}$`, os.Getpid()))
	a, b := randomName(42), randomName(42)
	require.Regexp(t, re, a)
	require.NotEqual(t, a, b)
}

// A client whose HotRestartAck the server does not answer by closing the
// session ends it itself after min(HandshakeTimeout, 5 s), with an error
// that says why: a Dialer would otherwise keep it (it takes no stream)
// until the server or IdleTimeout ended it. Here the server never sent
// HotRestart (the test writes the message), so it ignores the ack.
func TestHotRestartAckUnanswered(t *testing.T) {
	const grace = 300 * time.Millisecond
	client, server := pairWith(t, &Config{HandshakeTimeout: grace}, nil)
	require.Equal(t, grace, client.ackGrace())
	start := time.Now()
	require.NoError(t, server.writeCtl(wire.AppendHotRestart(nil, server.version, wire.TypeHotRestart, 5)))
	waitDone(t, client.Done(), "the client to end the session")
	require.GreaterOrEqual(t, time.Since(start), grace, "the server had its chance to close")
	require.ErrorContains(t, client.Err(), "the server did not close the session within 300ms of its HotRestartAck")
	var serr *SessionError
	require.ErrorAs(t, client.Err(), &serr)
	require.Equal(t, "hot restart", serr.Op)
	waitDone(t, server.Done(), "the server to see the close")
	require.ErrorIs(t, server.Err(), ErrPeerClosed)
	require.EqualValues(t, 1, server.Stats().AcksIgnored)

	// The bound on the grace.
	c, _ := pairWith(t, &Config{HandshakeTimeout: time.Minute}, nil)
	require.Equal(t, maxAckGrace, c.ackGrace())
}
