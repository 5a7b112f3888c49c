package shmlink_test

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"io"
	"log/slog"
	"net"
	"path/filepath"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/shmlink/shmlink"
	"github.com/shmlink/shmlink/internal/peertest"
	"github.com/shmlink/shmlink/session"
	"github.com/stretchr/testify/require"
)

// logBuffer is a slog destination safe for concurrent use.
type logBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (l *logBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.buf.Write(p)
}

func (l *logBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.buf.String()
}

// echoListener starts an in-process echo listener logging to log.
func echoListener(t *testing.T, network string, log *logBuffer) (*shmlink.Listener, *shmlink.Config) {
	dir := t.TempDir()
	addr := "127.0.0.1:0"
	if network == "unix" {
		addr = filepath.Join(dir, "s.sock")
	}
	cfg := &shmlink.Config{
		ShmDir:           dir,
		HandshakeTimeout: 2 * time.Second,
		Logger:           slog.New(slog.NewTextHandler(log, &slog.HandlerOptions{Level: slog.LevelDebug})),
	}
	lc := shmlink.ListenConfig{Config: cfg}
	ln, err := lc.Listen(context.Background(), network, addr)
	require.NoError(t, err)
	wait := serveStreams(ln)
	t.Cleanup(func() {
		ln.CloseSessions()
		wait()
	})
	return ln, cfg
}

// requireServes checks that ln still serves a good client.
func requireServes(t *testing.T, ln *shmlink.Listener, network string, cfg *shmlink.Config) {
	t.Helper()
	c := *cfg
	c.Logger = nil
	d := &shmlink.Dialer{Config: &c}
	defer d.Close()
	conn, err := d.Dial(network, ln.Addr().String())
	require.NoError(t, err)
	defer conn.Close()
	command(t, conn, peertest.CmdEcho, 0)
	require.NoError(t, peertest.Echo(conn, 100<<10, 42))
}

func header(length uint32, version, typ byte) []byte {
	b := binary.BigEndian.AppendUint32(nil, length)
	return append(b, 0x77, 0x58, version, typ)
}

// Garbage instead of a handshake: the server closes that connection (we
// read EOF), says why in its log, and goes on serving others.
func TestBadHandshake(t *testing.T) {
	cases := []struct {
		name string
		send []byte
		why  string
	}{
		{"garbage", []byte("GET / HTTP/1.1\r\nHost: x\r\n\r\n"), "magic"},
		{"zero version", header(8, 0, 4), "version"},
		{"unknown type", header(8, 3, 10), "type"},
		{"over-long", header(0xfffffff0, 2, 0), "length"},
		{"short length", header(7, 3, 4), "length"},
		{"runtime type first", header(8, 3, 1), "Polling"},
		{"truncated", append(header(60, 2, 0), 0, 20, '/'), "timeout"},
		{"path outside dir", append(append(header(8+2+11+2+11, 2, 0), 0, 11), "/etc/passwd\x00\x0b/etc/passwd"...), "outside"},
	}
	log := &logBuffer{}
	ln, cfg := echoListener(t, "unix", log)
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			conn, err := net.Dial("unix", ln.Addr().String())
			require.NoError(t, err)
			defer conn.Close()
			_, err = conn.Write(tc.send)
			require.NoError(t, err)
			require.NoError(t, conn.SetReadDeadline(time.Now().Add(5*time.Second)))
			// Closed with our bytes unread, the socket may say ECONNRESET.
			if _, err = io.ReadAll(conn); !errors.Is(err, syscall.ECONNRESET) {
				require.NoError(t, err, "the server must close the connection")
			}
			require.Eventually(t, func() bool { return bytes.Contains([]byte(log.String()), []byte(tc.why)) },
				5*time.Second, time.Millisecond, "log: %s", log.String())
			requireServes(t, ln, "unix", cfg)
		})
	}
}

// Garbage after a good handshake ends that session only.
func TestBadRuntimeMessage(t *testing.T) {
	cases := []struct {
		name string
		send []byte
		why  string // what the server must log
	}{
		{"garbage", bytes.Repeat([]byte{0xde, 0xad, 0xbe, 0xef}, 8), "magic: 0xdead"},
		{"hot restart to a server", append(header(16, 2, 8), make([]byte, 8)...), "HotRestart sent to a server"},
		{"short fallback", append(header(12, 2, 3), 0, 0, 0, 2), "FallbackData of 12 bytes"},
		{"fallback below header", header(4, 2, 3), "FallbackData of 4 bytes"},
		// A FallbackData of any length is read in pieces (docs/protocol.md
		// section 13): an over-long message is one of fixed length.
		{"over-long", header(1<<31, 2, 2), "StreamClose of 2147483648 bytes"},
		{"unknown type", header(8, 2, 10), "type: 10"},
		{"handshake type", header(8, 2, 4), "ExchangeProtoVersion after the handshake"},
		{"polling with payload", append(header(9, 2, 1), 0), "Polling of 9 bytes"},
		{"truncated fallback", append(header(100, 2, 3), make([]byte, 20)...), "unexpected EOF"},
		{"bad stream status", append(append(header(20, 2, 3), 0, 0, 0, 2, 0, 0, 0, 7), "data"...), "status 0x7"},
	}
	for _, network := range []string{"unix", "tcp"} {
		log := &logBuffer{}
		ln, cfg := echoListener(t, network, log)
		for _, tc := range cases {
			t.Run(network+"/"+tc.name, func(t *testing.T) {
				conn, err := net.Dial(network, ln.Addr().String())
				require.NoError(t, err)
				c := *cfg
				c.Logger = nil
				c.MemoryType = shmlink.MemoryFile
				s, err := session.Client(conn, &c)
				require.NoError(t, err)
				defer s.Close()
				_, err = conn.Write(tc.send)
				require.NoError(t, err)
				if tc.name == "truncated fallback" {
					conn.(interface{ CloseWrite() error }).CloseWrite()
				}
				select {
				case <-s.Done():
				case <-time.After(10 * time.Second):
					t.Fatal("the server kept the session")
				}
				require.ErrorIs(t, s.Err(), session.ErrPeerClosed)
				require.Eventually(t, func() bool { return bytes.Contains([]byte(log.String()), []byte(tc.why)) },
					5*time.Second, time.Millisecond, "log: %s", log.String())
				requireServes(t, ln, network, cfg)
			})
		}
	}
}
