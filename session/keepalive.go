package session

import (
	"fmt"
	"sync"
	"time"

	"github.com/shmlink/shmlink/queue"
)

// keepAlive is the state of Config.KeepAlive's checks (docs/protocol.md
// section 13). A timer runs the check every KeepAlive. When something was
// heard from the peer since the last check (an event popped, a Polling or
// a FallbackData: the session's counters of them moved), all is well. Otherwise the check looks at the peer's
// consumption of our send queue: if a probe went out at the last check
// and the queue's head has not moved since while events wait in it, the
// peer took nothing for a whole KeepAlive and the session ends; else a
// new probe goes out, the close of stream 0 (ids start at 2, so every
// peer ignores it), with a Polling.
type keepAlive struct {
	timer *time.Timer // nil when KeepAlive is off

	mu        sync.Mutex // guards what follows; held by the check only
	seen      uint64     // heard(), at the last check
	probing   bool       // a probe went out at the last check
	probeHead int64      // the send queue's head then
}

// startKeepAlive arms the first check, if Config.KeepAlive is set.
func (s *Session) startKeepAlive() {
	if d := s.cfg.KeepAlive; d > 0 {
		// Set before it can fire: the check resets it.
		s.ka.timer = time.AfterFunc(time.Hour, s.keepAliveCheck)
		s.ka.timer.Reset(d)
	}
}

// stopKeepAlive stops the checks; the session has ended.
func (s *Session) stopKeepAlive() {
	if s.ka.timer != nil {
		s.ka.timer.Stop()
	}
}

// heard sums the counters of what came from the peer: it moves whenever
// the peer did something for the session.
func (s *Session) heard() uint64 {
	return s.ctr.eventsReceived.Load() + s.ctr.wakeupsReceived.Load() + s.ctr.fallbackRead.Load()
}

// keepAliveCheck is one check (see keepAlive); it runs on the timer's
// goroutine and arms the next one.
func (s *Session) keepAliveCheck() {
	ka := &s.ka
	ka.mu.Lock()
	defer ka.mu.Unlock()
	if s.Err() != nil {
		return
	}
	if heard := s.heard(); heard != ka.seen {
		ka.seen, ka.probing = heard, false
		ka.timer.Reset(s.cfg.KeepAlive)
		return
	}
	var dead bool
	err := s.withMem(func(m *memory) error {
		head := m.send.Head()
		if ka.probing && head == ka.probeHead && !m.send.Empty() {
			dead = true
			return nil
		}
		ka.probing, ka.probeHead = true, head
		full, err := s.put(m, queue.Event{StreamID: 0, Status: stateClosed})
		if err == nil && !full {
			s.wake() // whatever the flag says: a frozen peer may have left it set
		}
		return err
	})
	if dead {
		s.failOp("keepalive", fmt.Errorf("the peer took no event for %v (Config.KeepAlive)", s.cfg.KeepAlive))
		return
	}
	if err == nil {
		ka.timer.Reset(s.cfg.KeepAlive)
	}
}
