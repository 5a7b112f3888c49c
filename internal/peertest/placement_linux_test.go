package peertest

import (
	"slices"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"
)

func TestCPUDistance(t *testing.T) {
	cpus := allowedCPUs()
	require.GreaterOrEqual(t, len(cpus), 2, "the benchmarks measure two CPUs; this machine gives the process %v", cpus)

	// A round trip moves a cache line twice between CPUs: more than a
	// nanosecond, and far less than a scheduler's time slice. Other
	// packages' tests may keep a CPU busy meanwhile, which CPUDistance
	// reports as ErrDistanceTimeout, or which stretches most batches: up to
	// 3 tries.
	var d time.Duration
	var err error
	for range 3 {
		d, err = CPUDistance(cpus[0], cpus[1])
		if err == nil && d < time.Millisecond {
			break
		}
		if err != nil {
			require.ErrorIs(t, err, ErrDistanceTimeout)
		}
	}
	require.NoError(t, err)
	require.Greater(t, d, time.Nanosecond)
	require.Less(t, d, time.Millisecond)

	_, err = CPUDistance(cpus[0], -1)
	require.ErrorContains(t, err, "CPU -1 out of range")
	_, err = CPUDistance(1024, cpus[0])
	require.ErrorContains(t, err, "CPU 1024 out of range")
	if !slices.Contains(cpus, 1023) {
		_, err = CPUDistance(cpus[0], 1023)
		require.ErrorIs(t, err, unix.EINVAL, "a CPU outside the process's mask")
	}
}
