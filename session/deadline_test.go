package session

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"
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
		var d deadline
		d.init(nil)
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

// A deadline with a notify channel signals it whenever it passes: set in
// the past at once, set in the future when its timer fires, and not when
// it is moved or cleared before that. A reader that sleeps on its
// stream's readCh alone counts on it (Stream.waitForData).
func TestDeadlineNotifies(t *testing.T) {
	notify := make(chan struct{}, 1)
	var d deadline
	d.init(notify)
	d.set(time.Now().Add(time.Hour))
	d.set(time.Time{})
	if len(notify) != 0 {
		t.Fatal("a deadline moved or cleared before it passed signalled notify")
	}

	d.set(time.Now().Add(-time.Second))
	if len(notify) != 1 {
		t.Fatal("a deadline set in the past did not signal notify")
	}
	<-notify

	d.set(time.Now().Add(time.Millisecond))
	select {
	case <-notify:
	case <-time.After(10 * time.Second):
		t.Fatal("a deadline that passed did not signal notify within 10 s")
	}
	if !isClosedChan(d.wait()) {
		t.Fatal("notify came before the deadline's channel was closed")
	}
}

// After Close every call fails with ErrStreamClosed, the zero-length Read
// and Write included (they returned 0, nil).
func TestZeroLengthAfterClose(t *testing.T) {
	client, server := pair(t, nil)
	c, s := streamPair(t, client, server)
	_, err := c.Write(nil)
	require.NoError(t, err, "Write(nil) on an open stream")
	_, err = s.Read(nil)
	require.NoError(t, err, "Read(nil) on an open stream")
	require.NoError(t, c.Close())
	require.NoError(t, s.Close())
	for _, st := range []*Stream{c, s} {
		_, err = st.Write(nil)
		require.ErrorIs(t, err, ErrStreamClosed, "Write(nil) after Close")
		_, err = st.Read(nil)
		require.ErrorIs(t, err, ErrStreamClosed, "Read(nil) after Close")
	}
}
