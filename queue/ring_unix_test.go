//go:build unix

package queue

import (
	"testing"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"
)

// mapShared returns an anonymous MAP_SHARED mapping of n bytes, as the
// queue file is mapped, unmapped at the end of the test.
func mapShared(t testing.TB, n int) []byte {
	t.Helper()
	mem, err := unix.Mmap(-1, 0, n, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED|unix.MAP_ANON)
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, unix.Munmap(mem)) })
	return mem
}

// TestProducerConsumerMmap moves a million events through each half of a
// default-size queue in a shared mapping, a client Ring pair on one side
// and an attached server pair on the other.
func TestProducerConsumerMmap(t *testing.T) {
	n := 1_000_000
	if testing.Short() {
		n = 50_000
	}
	mem := mapShared(t, Size(defaultCap))
	clientSend, clientRecv, err := FormatPair(mem, defaultCap)
	require.NoError(t, err)
	serverRecv, serverSend, err := AttachPair(mem)
	require.NoError(t, err)
	produceConsume(t, clientSend, serverRecv, n)
	produceConsume(t, serverSend, clientRecv, n)
}

// TestSmallCapMmap does the same with a small cap that is not a power of 2.
func TestSmallCapMmap(t *testing.T) {
	cap := testCaps()[2]
	mem := mapShared(t, Size(cap))
	send, _, err := FormatPair(mem, cap)
	require.NoError(t, err)
	recv, _, err := AttachPair(mem)
	require.NoError(t, err)
	produceConsume(t, send, recv, 100_000)
}
