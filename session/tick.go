package session

import (
	"sync"
	"sync/atomic"
	"time"
)

// The session's housekeeping timer (docs/protocol.md section 12.2).
//
// Two things must happen a while after traffic stops: a lease of the
// working flag ends (section 12, endSpin), and the receive loop takes the
// control connection back from a reader that left it free (section 12.1,
// ctlIn). Both used to arm a timer on the path of every message, and the
// hand-back timer fired about once per request when requests came about
// 1 ms apart. Neither is free on a virtual machine whose idle vCPUs halt:
//   - Arming a Go timer wakes a thread on an idle CPU when no thread waits
//     in the network poller (runtime.wakeNetPoller). Measured with
//     requests 1 ms apart, a server's Read returned 12 µs (median) after
//     its data came, instead of 1 µs without the arming.
//   - A timer that fires wakes the process's halted vCPUs. With requests
//     1 ms apart, a hand-back that fired every 1 ms cost 15 to 20 µs of
//     median round trip and about 65 µs of CPU per request, against the
//     same code with the hand-back never armed (5 alternating runs).
//
// So one timer does both, and it runs rarely while traffic flows. Paths of
// messages only note that there is work (poke); they arm the timer only
// when it is stopped. Once running, the timer re-arms itself from its own
// goroutine: soon when the connection was let go and is not yet due to be
// handed back, every standbyTick while there is anything to look after or
// was since the last tick, and it stops after a standbyTick with nothing.
// The cost is a looser bound: while the timer runs on standbyTick, a
// connection let go waits up to a standbyTick before the receive loop
// takes it back (section 12.1), and a lease lasts up to two of them.
type ticker struct {
	standby time.Duration // the longest period
	timer   *time.Timer
	armed   atomic.Bool // timer runs
	busy    atomic.Bool // something to look after happened since the last tick

	mu         sync.Mutex    // held by tick
	leaseCheck time.Duration // when tick last checked the lease (now)
}

// standbyTick is the ticker's longest period: the bound on how long a
// connection let go stays free while the timer runs anyway (section 12.1).
// Long enough that a timer running while requests flow costs little: one
// wakeup in standbyTick, against one per request.
const standbyTick = 16 * time.Millisecond

// init makes the timer of s; handBack is ctlIn.handBackAfter, the
// standby period if it is longer than standbyTick.
func (tk *ticker) init(s *Session, handBack time.Duration) {
	tk.standby = max(standbyTick, handBack)
	tk.timer = time.AfterFunc(time.Hour, s.tick)
	tk.timer.Stop()
}

// now returns monoNow: the ticker's times and the stamps it compares them
// with share one clock.
func (tk *ticker) now() time.Duration {
	return monoNow()
}

// clockBase is the origin of monoNow.
var clockBase = time.Now()

// monoNow returns the time since the package was loaded, from the monotonic
// clock only, at least 1 ns, so that 0 can mean "not set". The read paths
// stamp their waits and read calls with it: time.Now reads the wall clock
// as well, and took 44 ns against 24 ns here (AMD EPYC VM, vDSO with the
// tsc clocksource), several times per waited read.
func monoNow() time.Duration {
	return max(time.Since(clockBase), 1)
}

// poke tells the ticker that there is something to look after, and arms
// the timer to run after d if it is stopped. While it runs, poke costs two
// atomic loads.
func (tk *ticker) poke(d time.Duration) {
	if !tk.busy.Load() {
		tk.busy.Store(true)
	}
	if !tk.armed.Load() && !tk.armed.Swap(true) {
		tk.timer.Reset(d)
	}
}

// stop stops the timer for good (the session ended); a poke afterwards
// runs tick once, which does nothing.
func (tk *ticker) stop() {
	tk.timer.Stop()
}

// tick runs on the timer: it ends a lease that no poll renewed, hands the
// control connection back to the receive loop once it has been free for
// handBackAfter, and re-arms the timer or stops it (see ticker).
func (s *Session) tick() {
	tk := &s.tk
	tk.mu.Lock()
	defer tk.mu.Unlock()
	if isClosedChan(s.dead) {
		tk.armed.Store(false)
		return
	}
	sampleHostIdle(time.Now())
	now := tk.now()
	next := time.Duration(0)
	if tk.busy.Swap(false) || s.leaseTick(now) {
		next = tk.standby
	}
	if due := s.rx.in.handBackTick(now); due > 0 && (next == 0 || due < next) {
		next = due
	}
	if next > 0 {
		tk.timer.Reset(next)
		return
	}
	tk.armed.Store(false)
	// A poke that saw the timer armed set busy before: it is seen here.
	if tk.busy.Load() && !tk.armed.Swap(true) {
		tk.timer.Reset(tk.standby)
	}
}

// leaseTick ends the lease of the working flag if no spin renewed it
// since the last check, checking at most once per PollTime (section 12):
// a lease lasts one to two ticks, and at least PollTime. It reports
// whether a lease is still held. The caller holds tk.mu.
func (s *Session) leaseTick(now time.Duration) (held bool) {
	tk := &s.tk
	if !s.rx.leased.Load() {
		return false
	}
	if now-tk.leaseCheck < s.cfg.PollTime {
		return true
	}
	tk.leaseCheck = now
	seq := s.rx.leaseSeq.Load()
	if s.rx.tickSeq.Swap(seq) != seq || s.rx.spinning.Load() {
		return true
	}
	// A spin that leases after this store sets leased again; one that
	// leased before it is ended by the settle below.
	s.rx.leased.Store(false)
	s.settle()
	return false
}

// handBackTick makes the receive loop take the connection back if it has
// been free for handBackAfter (section 12.1). If it is free and not yet
// due, it returns how long until it is; else 0.
func (in *ctlIn) handBackTick(now time.Duration) (due time.Duration) {
	since := in.freeSince.Load()
	if since == 0 {
		return 0
	}
	if left := time.Duration(since) + in.handBackAfter - now; left > 0 {
		return left
	}
	signal(in.bgWake) // the loop takes it unless a reader does first
	return 0
}
