package shmlink_test

import (
	"context"
	"errors"
	"io"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/shmlink/shmlink"
	"github.com/shmlink/shmlink/internal/peertest"
	"github.com/stretchr/testify/require"
)

// cmdStall is a stream command of the drain tests (as peertest's): the
// server fills its client's region and control socket, which that client
// never reads, and keeps the stream open.
const cmdStall = 'S'

// serveStalling accepts on ln until it fails. A stream whose command is
// cmdStall gets 1 KiB writes until one waits 100 ms with nothing sent:
// the region is full, and so is the control socket, with no write owed
// on it; full receives nil then (or the error that ended the writes), and
// the stream stays open until its session ends. Other streams are echoed
// after their command (peertest.CmdEcho). wait waits for the handlers.
func serveStalling(ln *shmlink.Listener, full chan<- error) (wait func()) {
	return peertest.ServeEach(ln, func(c net.Conn) {
		cmd, _, err := peertest.ReadCommand(c)
		if err != nil {
			return
		}
		if cmd != cmdStall {
			io.Copy(c, c)
			return
		}
		chunk := make([]byte, 1<<10)
		for {
			c.SetWriteDeadline(time.Now().Add(100 * time.Millisecond))
			if _, err := c.Write(chunk); err != nil {
				if !errors.Is(err, os.ErrDeadlineExceeded) {
					full <- err
					return
				}
				break
			}
		}
		c.SetWriteDeadline(time.Time{})
		full <- nil
		io.Copy(io.Discard, c) // until the session ends
	})
}

// logSignal is a slog.Handler that closes a channel at the first record
// whose message contains a string.
type logSignal struct {
	substr string
	once   *sync.Once
	ch     chan struct{}
}

func newLogSignal(substr string) logSignal {
	return logSignal{substr, new(sync.Once), make(chan struct{})}
}

func (h logSignal) Enabled(context.Context, slog.Level) bool { return true }
func (h logSignal) Handle(_ context.Context, r slog.Record) error {
	if strings.Contains(r.Message, h.substr) {
		h.once.Do(func() { close(h.ch) })
	}
	return nil
}
func (h logSignal) WithAttrs([]slog.Attr) slog.Handler { return h }
func (h logSignal) WithGroup(string) slog.Handler      { return h }

// Clients that stopped reading their control socket, its buffer full, hold
// neither the other clients' HotRestart nor the drain (docs/protocol.md
// section 14): the old listener sends HotRestart on every session at once,
// its DrainTimeout runs from ready, and it closes the sessions left all at
// once, each Close giving its client up to 1 s to take the events queued
// (Session.Close); so it drains within DrainTimeout and 1 s, and a Close
// during the drain returns at once. One at a time, each stalled client's
// HotRestart took WriteTimeout and each close 1 s (drain: k times
// WriteTimeout, then DrainTimeout, then k seconds; Close: k times
// WriteTimeout), and a healthy client behind them waited as long for its
// HotRestart.
func TestUpgradeDrainStalledClients(t *testing.T) {
	const (
		stalled      = 5
		writeTimeout = 10 * time.Second // the default: longer than the drain
		drainTimeout = time.Second
		closeWait    = time.Second     // Session.Close's wait, min(HandshakeTimeout, 1 s)
		slack        = 5 * time.Second // a busy host under -race; one stalled client alone took writeTimeout
	)
	for _, closeEarly := range []bool{false, true} {
		name := "drain"
		if closeEarly {
			name = "close during drain"
		}
		t.Run(name, func(t *testing.T) {
			dir := t.TempDir()
			base := snapshot(t, dir)
			// After the deferred closes, and the raw clients' cleanups.
			t.Cleanup(func() { requireNoLeaks(t, base, dir) })
			addr, usock := filepath.Join(dir, "s.sock"), filepath.Join(dir, "upgrade.sock")
			handedOver := newLogSignal("listener handed over")
			cfg := &shmlink.Config{ShmDir: dir, Fallback: true, WriteTimeout: writeTimeout, Logger: slog.New(handedOver)}
			lc := shmlink.ListenConfig{Config: cfg, UpgradeSocket: usock, DrainTimeout: drainTimeout}
			a, err := lc.Listen(context.Background(), "unix", addr)
			require.NoError(t, err)
			full := make(chan error, stalled)
			waitA := serveStalling(a, full)
			defer waitA()
			defer a.CloseSessions()

			d := &shmlink.Dialer{Config: &shmlink.Config{ShmDir: dir}}
			defer d.Close()
			held, err := d.Dial("unix", addr) // keeps a healthy session on a
			require.NoError(t, err)
			defer held.Close()
			_, err = held.Write(peertest.Command(peertest.CmdEcho, 0))
			require.NoError(t, err)
			require.NoError(t, peertest.Echo(held, 1000, 1))
			for range stalled {
				p := dialHostile(t, addr)
				p.write(t, fallbackMsg(2, peertest.Command(cmdStall, 0)))
			}
			for range stalled {
				select {
				case err := <-full:
					require.NoError(t, err)
				case <-time.After(30 * time.Second):
					t.Fatal("the stalled clients' sockets did not fill")
				}
			}

			b, err := (&shmlink.ListenConfig{Config: &shmlink.Config{ShmDir: dir}, UpgradeSocket: usock}).
				Listen(context.Background(), "unix", addr)
			require.NoError(t, err)
			waitB := serveStalling(b, nil)
			defer waitB()
			defer b.CloseSessions()
			waitChan(t, handedOver.ch, "a to hand over")
			start := time.Now()

			if closeEarly {
				require.NoError(t, a.Close())
				t.Logf("a's Close returned %v after the handover", time.Since(start))
				require.Less(t, time.Since(start), slack, "a's Close waited for the stalled clients")
				return
			}
			// The healthy client moves over at once.
			require.Eventually(t, func() bool {
				c, err := d.Dial("unix", addr)
				require.NoError(t, err)
				defer c.Close()
				_, err = c.Write(peertest.Command(peertest.CmdEcho, 0))
				require.NoError(t, err)
				require.NoError(t, peertest.Echo(c, 100, 2))
				return b.NumSessions() > 0
			}, 10*time.Second, time.Millisecond)
			t.Logf("the healthy client moved over %v after the handover", time.Since(start))
			require.Less(t, time.Since(start), slack, "the healthy client's HotRestart waited for the stalled ones")
			require.NoError(t, peertest.Echo(held, 1000, 3), "its stream in flight still works")

			waitChan(t, a.Upgraded(), "a to drain")
			t.Logf("a drained %v after the handover", time.Since(start))
			require.Less(t, time.Since(start), drainTimeout+closeWait+slack, "the drain")
			require.Zero(t, a.NumSessions())
			require.NoError(t, a.Close())
		})
	}
}
