package shmlink_test

import (
	"bytes"
	"context"
	"io"
	"math/rand/v2"
	"path/filepath"
	"testing"

	"github.com/shmlink/shmlink"
	"github.com/shmlink/shmlink/internal/peertest"
	"github.com/shmlink/shmlink/session"
	"github.com/stretchr/testify/require"
)

// A program that dials its own listener: over a Unix socket the client
// and the server session pair (docs/protocol.md section 12.9), in both
// memory types. Every wakeup is handed over without the connection, no
// reader polls, and every byte of an echo arrives. Over TCP, and between
// two processes, sessions do not pair.
func TestInProcessSessionsPair(t *testing.T) {
	for _, tc := range []struct {
		name, network string
		memory        shmlink.MemoryType
		pairs         bool
	}{
		{"unix-memfd", "unix", shmlink.MemoryMemfd, true},
		{"unix-file", "unix", shmlink.MemoryFile, true},
		{"tcp-file", "tcp", shmlink.MemoryFile, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dir := t.TempDir()
			cfg := shmlink.Config{MemoryType: tc.memory, ShmDir: dir}
			addr := filepath.Join(dir, "s")
			if tc.network == "tcp" {
				addr = "127.0.0.1:0"
			}
			lc := shmlink.ListenConfig{Config: &cfg}
			ln, err := lc.Listen(context.Background(), tc.network, addr)
			require.NoError(t, err)
			defer ln.Close()
			accepted := make(chan *shmlink.Stream, 1)
			go func() {
				c, err := ln.AcceptStream()
				if err != nil {
					close(accepted)
					return
				}
				accepted <- c
				io.Copy(c, c)
				c.Close()
			}()
			d := shmlink.Dialer{Config: &cfg}
			conn, err := d.Dial(tc.network, ln.Addr().String())
			require.NoError(t, err)
			defer conn.Close()
			rng := rand.New(rand.NewPCG(3, 4))
			echo := func(i int) {
				msg := make([]byte, 1+rng.IntN(32<<10))
				for j := range msg {
					msg[j] = byte(rng.Uint32())
				}
				_, err := conn.Write(msg)
				require.NoError(t, err)
				got := make([]byte, len(msg))
				_, err = io.ReadFull(conn, got)
				require.NoError(t, err)
				require.True(t, bytes.Equal(msg, got), "message %d differs", i)
			}
			// The server session pairs when it starts, before it can accept:
			// after the first echo the two are paired. Before that, the
			// client's first wakeups and polls went as between processes.
			echo(0)
			server, ok := <-accepted
			require.True(t, ok, "the listener accepted no stream")
			sessions := []*session.Session{conn.(*shmlink.Stream).Session(), server.Session()}
			before := []shmlink.Stats{sessions[0].Stats(), sessions[1].Stats()}
			for i := range 100 {
				echo(1 + i)
			}
			for k, s := range sessions {
				st, st0 := s.Stats(), before[k]
				local, sent := st.LocalWakeups-st0.LocalWakeups, st.WakeupsSent-st0.WakeupsSent
				spins := st.SpinHits + st.SpinMisses - st0.SpinHits - st0.SpinMisses
				if tc.pairs {
					require.NotZero(t, local, "%+v", st)
					require.Equal(t, sent, local, "%+v", st)
					require.Zero(t, spins, "a paired session polled: %+v", st)
				} else {
					require.Zero(t, st.LocalWakeups, "%+v", st)
				}
			}
		})
	}
}

// Between two processes over a Unix socket, nothing is handed over: the
// peer's pid is not ours.
func TestTwoProcessSessionsDoNotPair(t *testing.T) {
	tr := transports[0]
	p := startPeer(t, tr)
	d := p.dialer(t, tr, shmlink.Config{PollTime: -1}) // every answer takes a wakeup
	c, err := d.Dial(tr.network, p.addr)
	require.NoError(t, err)
	defer c.Close()
	command(t, c, peertest.CmdEcho, 0)
	require.NoError(t, peertest.Echo(c, 64<<10, 1))
	st := c.(*shmlink.Stream).Session().Stats()
	require.NotZero(t, st.WakeupsSent, "%+v", st)
	require.Zero(t, st.LocalWakeups, "%+v", st)
}
