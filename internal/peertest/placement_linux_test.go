package peertest

import (
	"slices"
	"testing"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"
)

func TestCPUDistance(t *testing.T) {
	cpus := allowedCPUs()
	require.GreaterOrEqual(t, len(cpus), 2, "the benchmarks measure two CPUs; this machine gives the process %v", cpus)

	d, err := CPUDistance(cpus[0], cpus[1])
	require.NoError(t, err)
	// A round trip moves a cache line twice between CPUs: more than a
	// nanosecond, and far less than a scheduler's time slice.
	require.Greater(t, d.Nanoseconds(), int64(1))
	require.Less(t, d.Milliseconds(), int64(1))

	_, err = CPUDistance(cpus[0], -1)
	require.ErrorContains(t, err, "CPU -1 out of range")
	_, err = CPUDistance(1024, cpus[0])
	require.ErrorContains(t, err, "CPU 1024 out of range")
	if !slices.Contains(cpus, 1023) {
		_, err = CPUDistance(cpus[0], 1023)
		require.ErrorIs(t, err, unix.EINVAL, "a CPU outside the process's mask")
	}
}
