package shmlink_test

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"sync"
	"testing"

	"github.com/shmlink/shmlink"
	"github.com/shmlink/shmlink/buffer"
	"github.com/shmlink/shmlink/internal/peertest"
	"github.com/shmlink/shmlink/session"
	"github.com/stretchr/testify/require"
)

// command writes the 9-byte command header of the test server.
func command(t testing.TB, c net.Conn, cmd byte, arg uint64) {
	var hdr [9]byte
	hdr[0] = cmd
	binary.BigEndian.PutUint64(hdr[1:], arg)
	_, err := c.Write(hdr[:])
	require.NoError(t, err)
}

var sizes = []int{1, 100, 8172, 8173, 32748, 65536, 131052, 131053, 1 << 20, 4 << 20, 8 << 20}

func TestTwoProcessExchange(t *testing.T) {
	for _, tr := range transports {
		t.Run(tr.name, func(t *testing.T) {
			p := startPeer(t, tr)
			d := p.dialer(t, tr, shmlink.Config{})
			for _, n := range sizes {
				t.Run(fmt.Sprint(n), func(t *testing.T) {
					c, err := d.Dial(tr.network, p.addr)
					require.NoError(t, err)
					defer c.Close()
					command(t, c, peertest.CmdEcho, 0)
					require.NoError(t, peertest.Echo(c, n, uint64(n)))
				})
			}
			require.Equal(t, 1, d.NumSessions(), "one session serves every stream")
		})
	}
}

func TestTwoProcessEOFAfterClose(t *testing.T) {
	for _, tr := range transports {
		t.Run(tr.name, func(t *testing.T) {
			p := startPeer(t, tr)
			d := p.dialer(t, tr, shmlink.Config{})
			for _, n := range []int{0, 1, 8173, 1 << 20, 5 << 20} {
				c, err := d.Dial(tr.network, p.addr)
				require.NoError(t, err)
				command(t, c, peertest.CmdGenerate, uint64(n))
				// The server writes and closes at once: every byte must still
				// arrive before EOF.
				got, err := io.ReadAll(c)
				require.NoError(t, err)
				require.Len(t, got, n)
				require.NoError(t, peertest.CheckPattern(got, uint64(n), 0))
				k, err := c.Read(make([]byte, 1))
				require.Equal(t, 0, k)
				require.ErrorIs(t, err, io.EOF)
				require.NoError(t, c.Close())
			}
		})
	}
}

func TestTwoProcessConcurrentStreams(t *testing.T) {
	const streams = 1000
	for _, tr := range transports {
		t.Run(tr.name, func(t *testing.T) {
			p := startPeer(t, tr)
			d := p.dialer(t, tr, shmlink.Config{})
			var wg sync.WaitGroup
			errs := make(chan error, streams)
			for i := range streams {
				wg.Add(1)
				go func() {
					defer wg.Done()
					c, err := d.Dial(tr.network, p.addr)
					if err != nil {
						errs <- err
						return
					}
					defer c.Close()
					var hdr [9]byte
					hdr[0] = peertest.CmdEcho
					if _, err := c.Write(hdr[:]); err != nil {
						errs <- err
						return
					}
					n := 1 + rand.IntN(16<<10)
					if err := peertest.Echo(c, n, uint64(i)<<32|uint64(n)); err != nil {
						errs <- fmt.Errorf("stream %d (%d bytes): %w", i, n, err)
					}
				}()
			}
			wg.Wait()
			close(errs)
			for err := range errs {
				t.Error(err)
			}
			n := d.NumSessions()
			require.True(t, n >= 1 && n <= 4, "%d sessions, at most the default MaxSessions", n)
		})
	}
}

// A region too small for the traffic: a client with Config.Fallback sends
// what does not fit as FallbackData, while the server (default Config)
// waits for free slices instead; either way the bytes arrive intact and in
// order.
func TestTwoProcessFallback(t *testing.T) {
	for _, tr := range transports {
		t.Run(tr.name, func(t *testing.T) {
			p := startPeer(t, tr)
			cfg := shmlink.Config{
				BufferSize:  64 << 10,
				SizeClasses: []buffer.SizeClass{{SliceSize: 4076, Percent: 100}},
				MemoryType:  tr.memory,
				ShmDir:      p.shmDir,
				Fallback:    true,
			}
			conn, err := net.Dial(tr.network, p.addr)
			require.NoError(t, err)
			s, err := session.Client(conn, &cfg)
			require.NoError(t, err)
			defer s.Close()
			for _, n := range []int{100, 300 << 10, 3 << 20} {
				c, err := s.OpenStream(context.Background())
				require.NoError(t, err)
				command(t, c, peertest.CmdEcho, 0)
				require.NoError(t, peertest.Echo(c, n, uint64(n)))
				require.NoError(t, c.Close())
			}
			st := s.Stats()
			require.NotZero(t, st.FallbackWrites, "the client never fell back: %+v", st)
			require.Zero(t, st.FallbackReads, "the server fell back: %+v", st)
		})
	}
}

// With the default Config a writer that finds shared memory exhausted waits
// for the reader to free slices (backpressure): nothing goes over the
// socket. (session's TestBackpressureDeadline has a write deadline end the
// wait.)
func TestTwoProcessBackpressure(t *testing.T) {
	for _, tr := range transports {
		t.Run(tr.name, func(t *testing.T) {
			p := startPeer(t, tr)
			cfg := shmlink.Config{
				BufferSize:  64 << 10,
				SizeClasses: []buffer.SizeClass{{SliceSize: 4076, Percent: 100}},
				MemoryType:  tr.memory,
				ShmDir:      p.shmDir,
			}
			conn, err := net.Dial(tr.network, p.addr)
			require.NoError(t, err)
			s, err := session.Client(conn, &cfg)
			require.NoError(t, err)
			defer s.Close()
			c, err := s.OpenStream(context.Background())
			require.NoError(t, err)
			command(t, c, peertest.CmdEcho, 0)
			require.NoError(t, peertest.Echo(c, 3<<20, 7))
			st := s.Stats()
			require.Zero(t, st.FallbackWrites, "%+v", st)
			require.Zero(t, st.FallbackReads, "%+v", st)
			require.NotZero(t, st.MemoryFull, "the region never filled: %+v", st)

			require.NoError(t, c.Close())
		})
	}
}

func TestDialErrors(t *testing.T) {
	_, err := shmlink.Dial("udp", "127.0.0.1:1")
	require.ErrorIs(t, err, shmlink.ErrNetwork)
	_, err = shmlink.Listen("ip", "x")
	require.ErrorIs(t, err, shmlink.ErrNetwork)
	_, err = shmlink.Dial("unix", t.TempDir()+"/nothing.sock")
	require.Error(t, err)
	lc := shmlink.ListenConfig{Config: &shmlink.Config{BufferSize: -1}}
	_, err = lc.Listen(context.Background(), "unix", t.TempDir()+"/x.sock")
	var ce *session.ConfigError
	require.True(t, errors.As(err, &ce), "got %v", err)
	require.Equal(t, "BufferSize", ce.Field)
}
