package session

import (
	"bytes"
	"context"
	"io"
	"math/rand/v2"
	"sync"
	"testing"

	"github.com/stretchr/testify/require"
)

// echoAll copies what st reads back to it until the peer's end.
func echoAll(st *Stream) {
	io.Copy(st, st)
	st.Close()
}

// A ping-pong between two sessions of one process: they do not poll,
// every wakeup is handed to the peer session, none goes over the
// connection, and every byte arrives in order. Between sessions that wake
// over the connection (as two processes do; polling off, so that every
// answer takes a wakeup), none is local.
func TestLocalWakeups(t *testing.T) {
	for _, local := range []bool{true, false} {
		name := map[bool]string{true: "local", false: "socket"}[local]
		t.Run(name, func(t *testing.T) {
			var client, server *Session
			if local {
				client, server = localPairWith(t, nil, nil) // polling on by default
			} else {
				cfg := &Config{PollTime: -1}
				client, server = pairWith(t, cfg, cfg)
			}
			c, s := streamPair(t, client, server)
			go echoAll(s)
			rng := rand.New(rand.NewPCG(1, 2))
			for i := range 200 {
				msg := randomBytes(1+rng.IntN(64<<10), uint64(i))
				_, err := c.Write(msg)
				require.NoError(t, err)
				got := make([]byte, len(msg))
				_, err = io.ReadFull(c, got)
				require.NoError(t, err)
				require.True(t, bytes.Equal(msg, got), "message %d differs", i)
			}
			cs, ss := client.Stats(), server.Stats()
			require.NotZero(t, cs.WakeupsSent, "%+v", cs)
			require.NotZero(t, ss.WakeupsSent, "%+v", ss)
			if local {
				require.Equal(t, cs.WakeupsSent, cs.LocalWakeups, "%+v", cs)
				require.Equal(t, ss.WakeupsSent, ss.LocalWakeups, "%+v", ss)
				require.LessOrEqual(t, cs.SelfWakes, cs.Parks, "%+v", cs)
				require.LessOrEqual(t, ss.SelfWakes, ss.Parks, "%+v", ss)
				require.Zero(t, cs.SpinHits+cs.SpinMisses+ss.SpinHits+ss.SpinMisses, "a paired session polled")
				require.NotZero(t, cs.Parks)
			} else {
				require.Zero(t, cs.LocalWakeups+ss.LocalWakeups)
			}
			waitFor(t, "each side handled every wakeup of the other", func() bool {
				cs, ss := client.Stats(), server.Stats()
				return cs.WakeupsReceived == ss.WakeupsSent && ss.WakeupsReceived == cs.WakeupsSent
			})
		})
	}
}

// A reader asleep in a paired session takes the next wakeup itself: the
// peer's wake goes to it, not to the session's harvester goroutine, and
// it harvests, so that it runs after one goroutine switch, not two.
func TestLocalSleeperHarvests(t *testing.T) {
	client, server := localPairWith(t, nil, nil)
	c, s := streamPair(t, client, server)
	for i := range 3 {
		before := client.Stats()
		buf := make([]byte, 1)
		done := readAsync(c, buf)
		waitFor(t, "the reader sleeps in the harvester's place", func() bool {
			return client.localSleeper.Load() == c
		})
		_, err := s.Write([]byte{byte('a' + i)})
		require.NoError(t, err)
		require.NoError(t, <-done)
		require.Equal(t, byte('a'+i), buf[0])
		after := client.Stats()
		require.Equal(t, before.WakeupsReceived+1, after.WakeupsReceived, "%+v", after)
		require.Equal(t, before.SelfWakes+1, after.SelfWakes, "the reader did not harvest its wakeup: %+v", after)
		require.Nil(t, client.localSleeper.Load(), "the woken reader still holds the harvester's place")
	}
}

// A sleeping reader woken for a queue that holds more than one batch of
// events harvests one batch and leaves the rest to the harvester: every
// event is delivered, in order, and the reader gets its data.
func TestLocalSleeperLongQueue(t *testing.T) {
	client, server := localPairWith(t, nil, nil)
	c, s := streamPair(t, client, server)
	c2, s2 := streamPair(t, client, server)
	buf := make([]byte, 1)
	done := readAsync(c, buf)
	waitFor(t, "the reader sleeps in the harvester's place", func() bool {
		return client.localSleeper.Load() == c
	})
	const n = 3 * maxHarvest
	for i := range n {
		_, err := s2.Write([]byte{byte(i)})
		require.NoError(t, err)
	}
	_, err := s.Write([]byte{'x'})
	require.NoError(t, err)
	require.NoError(t, <-done)
	require.Equal(t, byte('x'), buf[0])
	got := make([]byte, n)
	_, err = io.ReadFull(c2, got)
	require.NoError(t, err)
	for i := range n {
		require.Equal(t, byte(i), got[i], "byte %d", i)
	}
	require.NotZero(t, client.Stats().SelfWakes)
}

// Sessions started at once pair each with its own peer.
func TestLocalPairsMatch(t *testing.T) {
	const n = 8
	clients, servers := make([]*Session, n), make([]*Session, n)
	errs := make(chan error, 2*n)
	var wg sync.WaitGroup
	for i := range n {
		cc, sc := socketPair(t)
		wg.Add(2)
		go func() {
			defer wg.Done()
			var err error
			servers[i], err = Server(sc, nil)
			errs <- err
		}()
		go func() {
			defer wg.Done()
			var err error
			clients[i], err = Client(cc, nil)
			errs <- err
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		require.NoError(t, err)
	}
	for i := range n {
		t.Cleanup(func() {
			clients[i].Close()
			servers[i].Close()
		})
		require.Same(t, servers[i], clients[i].local.Load(), "client %d", i)
		require.Same(t, clients[i], servers[i].local.Load(), "server %d", i)
	}
	localPairs.Lock()
	defer localPairs.Unlock()
	for i := range n {
		for _, s := range []*Session{clients[i], servers[i]} {
			require.NotSame(t, s, localPairs.m[s.localID], "a paired session stays recorded")
		}
	}
}

// A server whose client in this process is no session of ours (raw bytes,
// as a shmipc-go client linked into the same program would be) stays
// unpaired and wakes over the connection; once it ends it is forgotten,
// so that the record does not grow with such sessions.
func TestLocalUnpaired(t *testing.T) {
	mem, server, write := rawClient(t, nil, &Config{PollTime: -1})
	require.True(t, server.localPeer, "the peer is this process")
	require.Nil(t, server.local.Load())
	localPairs.Lock()
	require.Same(t, server, localPairs.m[server.localID])
	localPairs.Unlock()

	announceRaw(t, mem, 2, write)
	st := accept(t, server)
	pumpRead(t, mem, write, st, "hello") // its reader reads the Polling itself

	require.NoError(t, server.Close())
	localPairs.Lock()
	defer localPairs.Unlock()
	_, ok := localPairs.m[server.localID]
	require.False(t, ok, "the ended session is still recorded")
}

// A client reader that reads the connection itself before its server
// session paired with it (the server started last) still gets the
// server's answer, which comes through the harvester: the delivery kicks
// its read of the connection (ctlIn.kick).
func TestLocalPairAfterReaderPumps(t *testing.T) {
	release := make(chan struct{})
	hook := func(s *Session) {
		if !s.isClient {
			<-release
		}
	}
	pairHook.Store(&hook)
	t.Cleanup(func() { pairHook.Store(nil) })

	cc, sc := socketPair(t)
	done := make(chan *Session, 1)
	go func() {
		s, err := Server(sc, nil)
		if err != nil {
			t.Error(err)
		}
		done <- s
	}()
	client, err := Client(cc, &Config{PollTime: -1})
	require.NoError(t, err)
	t.Cleanup(func() { client.Close() })
	c, err := client.OpenStream(context.Background())
	require.NoError(t, err)
	_, err = c.Write([]byte("?"))
	require.NoError(t, err)
	got := make([]byte, 2)
	read := readAsync(c, got)
	waitPumping(t, c)
	require.Nil(t, client.local.Load(), "paired before its server started")

	close(release)
	server := <-done
	require.NotNil(t, server)
	t.Cleanup(func() { server.Close() })
	require.Same(t, server, client.local.Load())
	s := accept(t, server)
	q := make([]byte, 1)
	_, err = io.ReadFull(s, q)
	require.NoError(t, err)
	_, err = s.Write([]byte("hi"))
	require.NoError(t, err)
	require.NoError(t, result(t, read))
	require.Equal(t, "hi", string(got))
	require.NotZero(t, server.Stats().LocalWakeups)
}

// Paired sessions whose data goes partly over the connection (the region
// runs out, Config.Fallback): the FallbackData on the connection and the
// events behind local wakeups arrive in the order they were written, and
// each stream's close after its last byte.
func TestLocalPairFallbackOrder(t *testing.T) {
	ccfg := tinyConfig()
	ccfg.Fallback = true
	client, server := localPairWith(t, ccfg, tinyConfig())
	const streams, size = 4, 512 << 10
	var wg sync.WaitGroup
	for i := range streams {
		c, err := client.OpenStream(context.Background())
		require.NoError(t, err)
		data := randomBytes(size, uint64(i))
		wg.Add(1)
		go func() {
			defer wg.Done()
			rng := rand.New(rand.NewPCG(uint64(i), 7))
			for rest := data; len(rest) > 0; {
				k := min(len(rest), 1+rng.IntN(48<<10))
				if _, err := c.Write(rest[:k]); err != nil {
					t.Error(err)
					return
				}
				rest = rest[k:]
			}
			c.Close()
		}()
	}
	for range streams {
		s := accept(t, server)
		got, err := io.ReadAll(s)
		require.NoError(t, err)
		i := int(s.ID() - 2) // ids 2, 3, ... in order of opening
		require.True(t, bytes.Equal(randomBytes(size, uint64(i)), got), "stream %d differs", s.ID())
		s.Close()
	}
	wg.Wait()
	st := client.Stats()
	require.NotZero(t, st.FallbackWrites, "nothing went over the connection: %+v", st)
	require.NotZero(t, st.LocalWakeups, "%+v", st)
}
