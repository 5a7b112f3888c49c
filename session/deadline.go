package session

import (
	"sync"
	"sync/atomic"
	"time"
)

// deadline is a settable point in time whose passing closes a channel, so
// that calls blocked in select wake when it is set, moved or passes. It
// follows net/pipe.go's pipeDeadline.
type deadline struct {
	mu     sync.Mutex
	at     time.Time // the deadline; zero: none
	timer  *time.Timer
	cancel chan struct{} // closed when the deadline passes
	// cur is cancel for wait, which reads it without mu: the read paths
	// check the deadline on every wait and every spinBatch polls.
	cur atomic.Pointer[chan struct{}]
	// notify, if not nil, is a channel of capacity 1 signalled after
	// cancel is closed: a reader that sleeps on its stream's readCh alone
	// wakes for the deadline too (Stream.waitForData).
	notify chan struct{}
	// onExpire, if not nil, is called after cancel is closed: a write
	// deadline cuts its stream's write on the control connection short
	// (Session.cutWrite).
	onExpire func()
}

// init readies d, without a deadline set; notify, if not nil, is
// signalled whenever the deadline passes (see deadline.notify). d is not
// in use yet.
func (d *deadline) init(notify chan struct{}) {
	d.notify = notify
	d.newCancel()
}

// newCancel makes a new channel for the deadline to close. The caller
// holds mu, or d is not in use yet.
func (d *deadline) newCancel() {
	c := make(chan struct{})
	d.cancel = c
	d.cur.Store(&c)
}

// expire closes cancel, the channel of a deadline that passed, then
// signals notify and calls onExpire.
func (d *deadline) expire(cancel chan struct{}) {
	close(cancel)
	if d.notify != nil {
		signal(d.notify)
	}
	if d.onExpire != nil {
		d.onExpire()
	}
}

// set moves the deadline to t; the zero time means none. A time in the past
// closes the channel at once.
func (d *deadline) set(t time.Time) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.timer != nil && !d.timer.Stop() {
		<-d.cancel // the timer fired: wait for it to close cancel
	}
	d.timer = nil
	d.at = t
	closed := isClosedChan(d.cancel)
	if t.IsZero() {
		if closed {
			d.newCancel()
		}
		return
	}
	if dur := time.Until(t); dur > 0 {
		if closed {
			d.newCancel()
		}
		cancel := d.cancel
		d.timer = time.AfterFunc(dur, func() { d.expire(cancel) })
		return
	}
	if !closed {
		d.expire(d.cancel)
	}
}

// when returns the deadline and the channel closed when it passes.
func (d *deadline) when() (time.Time, chan struct{}) {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.at, d.cancel
}

// wait returns the channel closed when the deadline passes. It takes no
// lock.
func (d *deadline) wait() chan struct{} {
	return *d.cur.Load()
}

// stop releases the timer. Like set, it waits for a timer that has
// already fired to close the channel: a set after stop (SetReadDeadline
// racing with Close) would otherwise close it too, or arm a new timer on
// it, and the channel would be closed twice.
func (d *deadline) stop() {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.timer != nil && !d.timer.Stop() {
		<-d.cancel
	}
	d.timer = nil
}

func isClosedChan(c <-chan struct{}) bool {
	select {
	case <-c:
		return true
	default:
		return false
	}
}
