package session

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// A stream spins for all of PollTime while its waits are answered within
// it, parks at once (but for a probe every probeEvery waits) once most are
// not, and spins again when answers come quickly again.
func TestIdleLearner(t *testing.T) {
	const poll = 50 * time.Microsecond
	l := newIdleLearner()
	require.Equal(t, poll, l.budget(poll), "a new stream spins")
	for range 20 {
		require.Equal(t, poll, l.budget(poll))
		l.record(3*time.Microsecond, poll)
	}
	// Requests with pauses: every wait lasts a millisecond.
	spins := 0
	for range 10 * probeEvery {
		if l.budget(poll) > 0 {
			spins++
		}
		l.record(time.Millisecond, poll)
	}
	require.LessOrEqual(t, spins, 8+10, "misses stop the spinning but for probes")
	spins = 0
	for range probeEvery {
		if l.budget(poll) > 0 {
			spins++
		}
		l.record(time.Millisecond, poll)
	}
	require.Equal(t, 1, spins, "a stream whose waits miss spins once in probeEvery waits")
	// The traffic turns back-to-back: the probes see hits, and spinning
	// resumes.
	for range 10 * probeEvery {
		if l.budget(poll) > 0 {
			l.record(2*time.Microsecond, poll)
		}
	}
	require.Equal(t, poll, l.budget(poll), "hits bring spinning back")
	require.Equal(t, time.Duration(0), l.budget(-1), "PollTime < 0 never spins")
}
