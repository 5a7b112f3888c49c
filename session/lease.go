package session

import (
	"errors"
	"time"
)

// The working-flag lease (PROTOCOL.md section 3.3).
//
// A reader that polls the receive queue (Stream.poll) holds the queue's
// working flag at 1, so the peer puts events without sending a Polling
// message. When the reader has its data and returns to the application,
// clearing the flag at once would make the peer's next event cost a wakeup
// (a system call in each process and a goroutine switch here), although a
// reader that loops (io.Copy, a bufio.Reader, a request handler) is back
// within microseconds. So the flag stays at 1, leased, and events that come
// meanwhile wait in the queue for the next poll. The lease ends, and the
// flag is settled (cleared, then the queue drained: see drainLocked), when
//   - a goroutine is about to block for the session's events (a reader in
//     waitReadable): it settles before it sleeps, and a poller that stops
//     while one is blocked settles instead of leasing;
//   - no poll has run for one to two Config.PollTime periods (leaseTick;
//     Go's timers round a sleeping process's wait up to about 1 ms).
// A new stream's announcement wakes the peer whatever the flag says (see
// announce), so a lease never delays AcceptStream.

// endPoll ends the poll of the reader holding s.polling. With lease set
// (the reader got what it waited for) and no goroutine blocked for the
// session's events, the working flag stays at 1 and the lease timer is
// armed; otherwise the flag is settled now.
func (s *Session) endPoll(lease bool) {
	s.polling.Store(false)
	if lease {
		s.leaseSeq.Add(1)
		// A goroutine that starts to wait after this load settles by
		// itself (waitReadable): the atomics order its count before its
		// settle, and our store of polling before this load.
		if s.waiters.Load() == 0 {
			if !s.leaseArmed.Swap(true) {
				s.leaseTimer.Reset(s.cfg.PollTime)
			}
			return
		}
	}
	s.settle()
}

// settle clears the receive queue's working flag, unless a reader is
// polling, and drains what came meanwhile. A corrupt queue ends the
// session.
func (s *Session) settle() {
	if err := s.drain(); err != nil && !errors.Is(err, ErrSessionClosed) {
		s.fail(&SessionError{Op: "read", Err: err})
	}
}

// leaseTick runs on the lease timer: while polls keep ending with a lease
// (leaseSeq moved since the last tick) or one is running, it waits another
// PollTime; otherwise the lease has expired and the flag is settled.
func (s *Session) leaseTick() {
	if isClosedChan(s.dead) {
		return
	}
	seq := s.leaseSeq.Load()
	if s.tickSeq.Swap(seq) != seq || s.polling.Load() {
		s.leaseTimer.Reset(s.cfg.PollTime)
		return
	}
	s.leaseArmed.Store(false)
	s.settle()
}

// newLeaseTimer returns the stopped lease timer of s.
func (s *Session) newLeaseTimer() *time.Timer {
	t := time.AfterFunc(time.Hour, s.leaseTick)
	t.Stop()
	return t
}
