package peertest

import (
	"fmt"
	"runtime"
	"slices"
	"sync/atomic"
	"time"

	"golang.org/x/sys/unix"
)

// Measuring CPUDistance: distanceBatches batches of distanceBatch round
// trips, the median batch's mean. About 0.2 ms when the CPUs share a
// cache, 2 ms when a round trip takes 500 ns.
const (
	distanceBatch   = 256
	distanceBatches = 15
	// distanceTimeout bounds the whole measurement: a CPU that another
	// thread keeps busy runs a pinned thread only in time slices.
	distanceTimeout = 200 * time.Millisecond
)

// paddedWord is a word alone on its cache line (64 bytes, with room for
// the adjacent-line prefetcher's 128).
type paddedWord struct {
	v atomic.Uint64
	_ [120]byte
}

// CPUDistance returns how far apart the host has placed CPUs a and b: the
// time for a cache line written by a thread pinned to a to reach a thread
// pinned to b and for the answer to come back, the median over 15 batches
// of 256 round trips. a and b are CPU numbers as the kernel counts them
// (0 to 1023).
//
// On a virtual machine the host moves vCPUs between its cores: on this
// project's 2-vCPU AMD EPYC VM it reads about 50 ns, 90-120 ns or 485-680
// ns, and changes every few seconds. Every cache line that one process
// writes into shared memory and the other reads pays it, so bulk copies
// through shared memory slow down several times in the far placement
// (README, Performance); a socket's copies pay it too, but their system
// calls dominate.
//
// Each side runs on a goroutine locked to a thread of its own, whose CPU
// mask is set to one CPU. The goroutines end with the measurement and
// their threads exit with them, so no other goroutine inherits a mask.
// Both CPUs are held for 0.2 to 2 ms while they are idle. It returns an
// error when a thread cannot be pinned (a CPU that does not exist or is
// not in the process's mask) and ErrDistanceTimeout when the round trips
// take more than 200 ms in all.
func CPUDistance(a, b int) (time.Duration, error) {
	var ping, pong paddedWord
	var stop atomic.Bool
	ready := make(chan error, 1)
	exited := make(chan struct{})
	go func() {
		defer close(exited)
		runtime.LockOSThread() // never unlocked: the thread exits with its mask
		if err := pinThread(b); err != nil {
			ready <- err
			return
		}
		ready <- nil
		var last uint64
		for !stop.Load() {
			if v := ping.v.Load(); v != last {
				last = v
				pong.v.Store(v)
			}
		}
	}()
	if err := <-ready; err != nil {
		return 0, err
	}
	defer func() {
		stop.Store(true)
		<-exited
	}()
	type result struct {
		d   time.Duration
		err error
	}
	done := make(chan result, 1)
	go func() {
		runtime.LockOSThread() // never unlocked: the thread exits with its mask
		if err := pinThread(a); err != nil {
			done <- result{err: err}
			return
		}
		deadline := time.Now().Add(distanceTimeout)
		var seq uint64
		per := make([]time.Duration, 0, distanceBatches)
		for range distanceBatches {
			t0 := time.Now()
			for range distanceBatch {
				seq++
				ping.v.Store(seq)
				for n := 1; pong.v.Load() != seq; n++ {
					if n%(1<<16) == 0 && time.Now().After(deadline) {
						done <- result{err: ErrDistanceTimeout}
						return
					}
				}
			}
			per = append(per, time.Since(t0)/distanceBatch)
		}
		slices.Sort(per)
		done <- result{d: per[len(per)/2]}
	}()
	r := <-done
	return r.d, r.err
}

// pinThread sets the calling thread's CPU mask to cpu alone.
func pinThread(cpu int) error {
	if cpu < 0 || cpu >= 1024 {
		return fmt.Errorf("peertest: CPU %d out of range", cpu)
	}
	var set unix.CPUSet
	set.Set(cpu)
	if err := unix.SchedSetaffinity(0, &set); err != nil {
		return fmt.Errorf("peertest: pin a thread to CPU %d: %w", cpu, err)
	}
	return nil
}

// allowedCPUs returns the CPUs in this process's mask, in order; none if
// the mask cannot be read.
func allowedCPUs() []int {
	var set unix.CPUSet
	if unix.SchedGetaffinity(0, &set) != nil {
		return nil
	}
	var cpus []int
	for c := range 1024 {
		if set.IsSet(c) {
			cpus = append(cpus, c)
		}
	}
	return cpus
}
