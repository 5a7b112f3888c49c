package session

import (
	"os"
	"sync"
	"sync/atomic"
	"syscall"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"
)

// The session's housekeeping timer (docs/protocol.md section 12.2).
//
// Two things must happen a while after traffic stops: a lease of the
// working flag ends (section 12, endSpin), and the receive loop takes the
// control connection back from a reader that left it free (section 12.1,
// ctlIn). Each is pending from the moment it starts (a lease, a let-go)
// until it ends, and most end long before their bound: a reader that comes
// back for more data and sleeps settles the flag and takes the connection
// again. The timer runs only while one is pending.
//
// Neither arming a timer nor a timer's firing is free on a virtual
// machine whose idle vCPUs halt:
//   - Arming a Go timer wakes a thread on an idle CPU when no thread waits
//     in the network poller (runtime.wakeNetPoller). Measured with
//     requests 1 ms apart, a server's Read returned 12 µs (median) after
//     its data came, instead of 1 µs without the arming.
//   - A timer that fires wakes the process's halted vCPUs: a Go timer's
//     function runs in a new goroutine, whose start wakes a second thread.
//
// So the timer is a timerfd (timerfd_create(2)), armed and disarmed with
// raw system calls that wake no thread, and read by a goroutine of its own
// that waits in the network poller: a firing wakes that goroutine only.
// Paths of messages arm it when something becomes pending (poke: one
// atomic load when it is armed for pending work already), and the path of
// a reader about to sleep disarms it when nothing is pending any more
// (relax). A firing re-arms it while something is still pending. A timer
// that would be disarmed stays armed for the process's next host sample
// if no other session's timer takes it (claimSample, section 12.3). Where
// a timerfd cannot be made, a Go timer does the same, at the costs above.
type ticker struct {
	standby time.Duration // the longest period
	// early is set while the timer is armed for pending work: then poke
	// costs one atomic load. It is written under mu.
	early atomic.Bool

	// stopped is set when the session ended. stop sets it without mu: the
	// session may end inside a tick (leaseTick's settle delivers a close).
	stopped atomic.Bool

	mu         sync.Mutex       // held to arm, disarm and tick; never around session code
	due        time.Duration    // when the timer fires (now), 0 while disarmed; -1 inside tick
	claimAt    time.Duration    // the host sample this timer is to take (claimSample), or 0
	tfd        *os.File         // the timerfd, or nil
	rc         syscall.RawConn  // tfd's
	settime    func(fd uintptr) // sets tfd to spec; made once, so that arming allocates nothing
	spec       unix.ItimerSpec  // tfd's setting
	gt         *time.Timer      // the Go timer, if tfd is nil
	leaseCheck time.Duration    // when tick last checked the lease (now)
	ticks      atomic.Uint64    // firings that ran tick
}

// denseLetGap is the time between two let-goes of the connection below
// which relax leaves the timer armed. Arming and disarming a timerfd took
// 0.8 µs (AMD EPYC VM), one of them on the path of a request, and a
// firing with nothing to do some 40 to 60 µs of CPU on a VM whose idle
// vCPUs halt: one firing per 16 ms costs less than one arming per request
// once requests come less than about 1 ms apart.
const denseLetGap = time.Millisecond

// standbyTick is the ticker's longest period: the bound on how long a
// connection let go stays free while let-goes come one after another
// (section 12.1), and the period at which a lease is checked.
const standbyTick = 16 * time.Millisecond

// init makes the timer of s; handBack is ctlIn.handBackAfter, the
// standby period if it is longer than standbyTick.
func (tk *ticker) init(s *Session, handBack time.Duration) {
	tk.standby = max(standbyTick, handBack)
	fd, err := timerfdCreate(unix.CLOCK_MONOTONIC, unix.TFD_NONBLOCK|unix.TFD_CLOEXEC)
	if err == nil {
		f := os.NewFile(uintptr(fd), "shmlink-timer")
		if rc, err := f.SyscallConn(); err == nil {
			tk.tfd, tk.rc = f, rc
			tk.settime = func(fd uintptr) {
				// A raw call: through package syscall it would wake the
				// runtime's monitor thread (section 12.4). It fails only for
				// a bad descriptor or setting, neither of which can happen
				// here.
				unix.RawSyscall6(unix.SYS_TIMERFD_SETTIME, fd, 0, uintptr(unsafe.Pointer(&tk.spec)), 0, 0, 0)
			}
			go tk.run(s)
			return
		}
		f.Close()
	}
	tk.gt = time.AfterFunc(time.Hour, s.tick)
	tk.gt.Stop()
}

// timerfdCreate is unix.TimerfdCreate; tests make it fail to run the Go
// timer instead.
var timerfdCreate = unix.TimerfdCreate

// run reads the timerfd until it is closed, and ticks at each expiry.
func (tk *ticker) run(s *Session) {
	var buf [8]byte
	read := func(fd uintptr) bool {
		_, _, errno := unix.RawSyscall(unix.SYS_READ, fd, uintptr(unsafe.Pointer(&buf[0])), uintptr(len(buf)))
		return errno != unix.EAGAIN
	}
	for {
		err := tk.rc.Read(read)
		if err != nil {
			return // closed by stop
		}
		s.tick()
	}
}

// setLocked arms the timer to fire at due (now is the time now), or
// disarms it if due is 0. The caller holds mu.
func (tk *ticker) setLocked(now, due time.Duration) {
	if tk.stopped.Load() || due == tk.due {
		return
	}
	tk.due = due
	d := time.Duration(0)
	if due > 0 {
		d = max(due-now, 1) // 0 would disarm a timerfd
	}
	if tk.tfd == nil {
		if d > 0 {
			tk.gt.Reset(d)
		} else {
			tk.gt.Stop()
		}
		return
	}
	tk.spec.Value = unix.NsecToTimespec(d.Nanoseconds())
	// Control fails without calling settime once stop closed the file.
	tk.rc.Control(tk.settime)
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

// poke arms the timer to fire after d unless it is armed for pending
// work: the caller has just made something pending (a lease, a let-go).
// When it is, poke costs an atomic load, and the thing waits for the next
// firing.
func (tk *ticker) poke(d time.Duration) {
	if tk.early.Load() {
		return
	}
	tk.mu.Lock()
	defer tk.mu.Unlock()
	if tk.early.Load() {
		return
	}
	now := tk.now()
	due := now + d
	if tk.due != 0 && tk.due < due {
		due = tk.due // armed for a host sample, sooner
	}
	tk.early.Store(true)
	tk.setLocked(now, due)
}

// relax disarms the timer if nothing is pending any more: the caller has
// just ended something that was (settled the flag, took the connection).
// The timer stays armed, or is armed anew, for the next sample of the
// host's idle CPU time if no other session's timer takes it
// (claimSample). While let-goes come less than denseLetGap apart, it
// stays armed: it then fires with nothing to do at most once per standby
// period, which costs less than arming and disarming it for every
// request.
func (s *Session) relax() {
	tk := &s.tk
	if !tk.early.Load() || s.rx.in.letGap.Load() < int64(denseLetGap) || s.pending() {
		return
	}
	tk.mu.Lock()
	defer tk.mu.Unlock()
	if !tk.early.Load() {
		return
	}
	// A poke that finds early set made its work pending before it looked:
	// either it sees early cleared here and arms anew, or its work is seen
	// below (the atomics are sequentially consistent).
	tk.early.Store(false)
	if s.pending() {
		tk.early.Store(true)
		return
	}
	tk.idleLocked(tk.now(), true)
}

// idleLocked arms the timer for the host sample this session is to take,
// if any, or disarms it: nothing is pending. With claim set, the session
// claims the process's next sample if no other session has. The caller
// holds mu.
func (tk *ticker) idleLocked(now time.Duration, claim bool) {
	at := tk.claimAt
	if claim {
		at = hostIdle.claimSample(now, at)
	} else if at <= now {
		at = 0 // taken, or missed: the next reader that sleeps claims anew
	}
	tk.claimAt = at
	tk.setLocked(now, at)
}

// pending reports whether a lease is held or the connection is free: what
// the timer looks after.
func (s *Session) pending() bool {
	return s.rx.leased.Load() || s.rx.in.freeSince.Load() != 0
}

// stop stops the timer for good (the session ended) and lets its
// goroutine return; a poke afterwards arms nothing. It does not take mu:
// the session may end inside a tick. A Go timer that a setting in
// progress re-arms fires once more and finds the timer stopped.
func (tk *ticker) stop() {
	tk.stopped.Store(true)
	if tk.tfd != nil {
		tk.tfd.Close()
	} else {
		tk.gt.Stop()
	}
}

// tick runs when the timer fires: it ends a lease that no poll renewed,
// hands the control connection back to the receive loop once it has been
// free for its time, samples the host's idle CPU time (section 12.3), and
// re-arms the timer while something is still pending, or for a sample
// this session is to take. The settle that ends a lease runs after mu is
// released: it delivers what the lease held back, which may end the
// session.
func (s *Session) tick() {
	if s.tickLocked() {
		s.settle()
	}
}

// tickLocked is tick's work under mu; it reports whether a lease ended
// and the flag is to be settled.
func (s *Session) tickLocked() (settle bool) {
	tk := &s.tk
	tk.mu.Lock()
	defer tk.mu.Unlock()
	tk.ticks.Add(1)
	if tk.stopped.Load() || isClosedChan(s.dead) {
		return false
	}
	// The firing may be of an earlier setting than due: mark due unknown,
	// so that the setting below always reaches the timer.
	tk.due = -1
	// Work made pending from here on arms the timer anew or is seen below
	// (see relax).
	tk.early.Store(false)
	sampleHostIdle(time.Now())
	now := tk.now()
	next := time.Duration(0)
	held, settle := s.leaseTick(now)
	if held {
		next = tk.standby
	}
	if due := s.rx.in.handBackTick(now); due > 0 && (next == 0 || due < next) {
		next = due
	}
	if next > 0 {
		tk.early.Store(true)
		tk.setLocked(now, now+next)
		return settle
	}
	tk.idleLocked(now, false)
	return settle
}

// leaseTick ends the lease of the working flag if no spin renewed it
// since the last check, checking at most once per PollTime (section 12):
// a lease lasts one to two standby periods, and at least PollTime. It
// reports whether a lease is still held, and whether it just ended one,
// whose flag the caller settles once it has let go of tk.mu. The caller
// holds tk.mu.
func (s *Session) leaseTick(now time.Duration) (held, ended bool) {
	tk := &s.tk
	if !s.rx.leased.Load() {
		return false, false
	}
	if now-tk.leaseCheck < s.pollTime() {
		return true, false
	}
	tk.leaseCheck = now
	seq := s.rx.leaseSeq.Load()
	if s.rx.tickSeq.Swap(seq) != seq || s.rx.spinning.Load() {
		return true, false
	}
	// A spin that leases after this store sets leased again; one that
	// leased before it is ended by the caller's settle.
	s.rx.leased.Store(false)
	return false, true
}

// handBackTick makes the receive loop take the connection back if it has
// been free for its time (section 12.1). If it is free and not yet due, it
// returns how long until it is; else 0.
func (in *ctlIn) handBackTick(now time.Duration) (due time.Duration) {
	if in.freeSince.Load() == 0 {
		return 0
	}
	if left := time.Duration(in.handBackAt.Load()) - now; left > 0 {
		return left
	}
	signal(in.bgWake) // the loop takes it unless a reader does first
	return 0
}
