package shmlink_test

import (
	"context"
	"fmt"
	"io"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/shmlink/shmlink"
	"github.com/shmlink/shmlink/internal/peertest"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// Bounds of TestScale.
const (
	// scaleClients is the number of goroutines that each dial a stream.
	scaleClients = 5000
	// scaleMsgSize is the bytes each of them sends and reads back.
	scaleMsgSize = 1 << 10
	// scaleHandlers is the number of echo handlers of the server. The race
	// detector allows 8128 live goroutines, so 5,000 clients plus a handler
	// per stream would not fit under -race; the streams beyond it wait in
	// their sessions' accept backlogs, as they would on a busy server.
	scaleHandlers = 1000
)

// TestScale has 5,000 goroutines, all live at once and released together,
// each Dial a stream on one shared Dialer, write 1 KiB derived from its
// index, read the server's echo and check every byte, and Close. Then the
// idle sessions time out on both sides, and the Dialer's and the listener's
// session counts, the process's descriptors and goroutines are back where
// they were before the first Dial.
func TestScale(t *testing.T) {
	// The burst spreads over the Dialer's sessions (one takes at most
	// twice StreamsPerSession while the next is dialed), so each session's
	// accept backlog, 4096 by default, holds its streams that wait for a
	// handler: the server refuses none (a refused stream's client would
	// read io.EOF).
	dir := t.TempDir()
	cfg := &shmlink.Config{ShmDir: dir}
	lc := shmlink.ListenConfig{Config: cfg}
	ln, err := lc.Listen(context.Background(), "unix", filepath.Join(dir, "s.sock"))
	require.NoError(t, err)
	defer ln.CloseSessions()
	stop := serveEcho(ln, scaleHandlers)
	defer stop()
	d := &shmlink.Dialer{Config: cfg, IdleTimeout: 50 * time.Millisecond}
	defer d.Close()
	addr := ln.Addr().String()

	base := snapshot(t)
	start := make(chan struct{})
	var (
		wg       sync.WaitGroup
		mu       sync.Mutex
		failures []error
		peak     int // most sessions seen by a dial
	)
	exchange := func(i int) error {
		c, err := d.Dial("unix", addr)
		if err != nil {
			return fmt.Errorf("dial: %w", err)
		}
		defer c.Close()
		mu.Lock()
		peak = max(peak, d.NumSessions())
		mu.Unlock()
		msg := make([]byte, scaleMsgSize)
		peertest.Pattern(msg, uint64(i), 0)
		if _, err := c.Write(msg); err != nil {
			return fmt.Errorf("write: %w", err)
		}
		got := make([]byte, scaleMsgSize)
		if _, err := io.ReadFull(c, got); err != nil {
			return fmt.Errorf("read: %w", err)
		}
		if err := peertest.CheckPattern(got, uint64(i), 0); err != nil {
			return err
		}
		return c.Close()
	}
	t0 := time.Now()
	for i := range scaleClients {
		wg.Add(1)
		go func() {
			defer wg.Done()
			<-start
			if err := exchange(i); err != nil {
				mu.Lock()
				failures = append(failures, fmt.Errorf("goroutine %d: %w", i, err))
				mu.Unlock()
			}
		}()
	}
	close(start)
	wg.Wait()
	t.Logf("%d exchanges of %d bytes in %v over at most %d sessions",
		scaleClients, scaleMsgSize, time.Since(t0).Round(time.Millisecond), peak)
	require.Empty(t, failures, "%d of %d exchanges failed; listener %+v; dialer %+v",
		len(failures), scaleClients, ln.Stats(), d.Stats())
	require.Zero(t, ln.Stats().StreamsRefused)

	requireBackTo(t, base, func(c *assert.CollectT) {
		assert.Zero(c, d.NumSessions(), "the Dialer's idle sessions time out")
		assert.Zero(c, ln.NumSessions(), "and end on the listener too")
	})
}
