package session

import "time"

// The idle strategy of a reader with nothing to read (docs/protocol.md
// section 12.2): spin on the receive queue, then park until the peer's
// wakeup (ctlread.go). Whether a reader spins is learned per stream from
// how long its recent waits took:
//
//   - A wait that ended within Config.PollTime is a hit: spinning would
//     have caught it. A stream whose recent waits were mostly hits spins
//     for up to PollTime; one whose waits were mostly misses (requests
//     that come with pauses, a server waiting for the next call) parks at
//     once, and spins only on every probeEvery-th wait, to notice when the
//     traffic changes.
//   - On a busy host the same rule decides: where a spinner keeps the
//     peer from the CPU it needs to answer, spins miss and the stream
//     parks; where the peer gets its CPU anyway, spinning still pays.

// idleLearner is a stream's record of its recent waits for data. Its
// owner is the stream's reader (it is guarded by Stream.rmu).
type idleLearner struct {
	hitRate uint32 // recent waits that were hits, out of hitScale (EWMA)
	waits   uint32 // waits since the stream began, for the probes
}

const (
	// hitScale is the fixed-point scale of idleLearner.hitRate.
	hitScale = 1 << 10
	// hitShift sets the EWMA's weight of the newest wait: 1/8.
	hitShift = 3
	// probeEvery is how often a stream whose spins do not pay spins anyway.
	probeEvery = 16
)

// newIdleLearner returns a learner that spins until waits say otherwise:
// the first messages of a stream are usually a burst.
func newIdleLearner() idleLearner { return idleLearner{hitRate: hitScale} }

// budget returns how long the next wait should spin before it parks:
// zero to park at once. pollTime is Config.PollTime. A spin that pays at
// all gets all of pollTime: a miss then costs at most a spin as long as a
// sleep and a wakeup (the bound of the 2-competitive spin-then-block
// rule), where a shorter spin misses the answers that come a little late,
// each of which costs a wakeup.
func (l *idleLearner) budget(pollTime time.Duration) time.Duration {
	l.waits++
	if pollTime <= 0 || (l.hitRate < hitScale/2 && l.waits%probeEvery != 0) {
		return 0
	}
	return pollTime
}

// record adds a wait that took d (spinning or parked) to the learner.
func (l *idleLearner) record(d, pollTime time.Duration) {
	hit := uint32(0)
	if d <= pollTime {
		hit = hitScale
	}
	l.hitRate = l.hitRate - l.hitRate>>hitShift + hit>>hitShift
}
