//go:build !linux

package peertest

import (
	"errors"
	"time"
)

// CPUDistance measures how far apart the host placed two CPUs on Linux
// (see the Linux version); elsewhere it returns an error.
func CPUDistance(a, b int) (time.Duration, error) {
	return 0, errors.New("peertest: CPU distance: pinning threads needs Linux")
}

// allowedCPUs returns none: pinning needs Linux.
func allowedCPUs() []int { return nil }
