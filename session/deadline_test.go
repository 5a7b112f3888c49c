package session

import (
	"testing"
	"time"
)

// A deadline stopped just as its timer fires, then set again, must not
// close its channel twice. Stream.Close stops the deadlines while a
// concurrent SetReadDeadline or SetWriteDeadline, past its closed check,
// sets them (found by TestSoak: "panic: close of closed channel" in the
// timer's function). The timers here expire around the stop, so that
// some have fired with their function not yet run; before the fix the
// test binary panicked within a few thousand rounds.
func TestDeadlineStopThenSet(t *testing.T) {
	for i := range 20000 {
		d := makeDeadline()
		wait := time.Duration(i%20) * time.Microsecond
		d.set(time.Now().Add(wait))
		for start := time.Now(); time.Since(start) < wait; {
			// Spin: the timer's function runs on another goroutine.
		}
		d.stop()
		if i%2 == 0 {
			d.set(time.Now().Add(-time.Second)) // closes the channel now
		} else {
			d.set(time.Now().Add(wait)) // a new timer
		}
	}
}
