package session

import (
	"net"
	"os"
	"sync"
	"sync/atomic"

	"github.com/shmlink/shmlink/internal/shm"
	"github.com/shmlink/shmlink/internal/sock"
)

// Wakeups between two sessions of one process (docs/protocol.md section
// 12.9). When both ends of a session live in this process, a Polling on
// the control connection costs a send, the network poller's wakeup and a
// receive, all to move one goroutine of this process to another. The two
// sessions find each other instead (localPairs) and a wake hands the
// Polling straight to the peer session's harvester goroutine
// (localHarvest), which harvests as the receive loop would on reading
// the Polling. Nothing changes on the wire: the two sessions still map the
// same queue, and every other message still goes over the connection.

// localPairs holds the sessions of this process whose peer is this
// process too and has not been paired with them yet, by the file of
// their queue: a client's is the one it created, a server's the one it
// mapped from its client. Two sessions that map one queue file, a
// client and a server, are the two ends of one connection.
var localPairs = struct {
	sync.Mutex
	m map[shm.FileID]*Session
}{m: make(map[shm.FileID]*Session)}

// peerIsSelf reports whether the process at the other end of conn is this
// one: conn is a Unix socket whose peer's pid (SO_PEERCRED) is ours.
// Over TCP it reports false; such sessions keep their Pollings on the
// connection.
func peerIsSelf(conn net.Conn) bool {
	uc, ok := conn.(*net.UnixConn)
	if !ok {
		return false
	}
	pid, _, _, err := sock.PeerCred(uc)
	return err == nil && pid == os.Getpid()
}

// pairLocal records s, whose peer is this process (peerIsSelf) and whose
// queue file is id, and pairs it with its peer session if that one
// recorded itself first: from then on each one's wakes go to the other's
// harvester (wake). It runs before the session is used.
func (s *Session) pairLocal(id shm.FileID) {
	if h := pairHook.Load(); h != nil {
		(*h)(s)
	}
	localPairs.Lock()
	defer localPairs.Unlock()
	p, ok := localPairs.m[id]
	if !ok {
		localPairs.m[id] = s
		s.localID = id
		return
	}
	delete(localPairs.m, id)
	if p.isClient == s.isClient || p.Err() != nil {
		return
	}
	p.pollOff.Store(true)
	s.pollOff.Store(true)
	p.local.Store(s)
	s.local.Store(p)
	go p.localHarvest()
	go s.localHarvest()
}

// unpairLocal forgets s in localPairs if it is still there unpaired: it
// ended before its peer session started, or its peer is not shmlink.
func (s *Session) unpairLocal() {
	if !s.localPeer {
		return
	}
	localPairs.Lock()
	if localPairs.m[s.localID] == s {
		delete(localPairs.m, s.localID)
	}
	localPairs.Unlock()
}

// pairHook, if set (tests only), is called by a session about to pair
// (pairLocal), before it looks for its peer.
var pairHook atomic.Pointer[func(*Session)]

// wakeLocal hands a Polling to p, the peer session in this process: its
// harvester (localHarvest) harvests as the receive loop would on reading
// one. It never blocks: wakes that come while the harvester has not yet
// taken the last one make one harvest, which covers the events put before
// each of them. It leaves ctlWriter.wokeAt alone: paired sessions do not
// poll, and only polls read it (wokePeerAt).
//
// When a reader of p sleeps for its data (sleepLocal), the wake goes to
// that reader, which harvests for the session itself: it runs after one
// goroutine switch, not two (issue #16's item 3, as a reader that reads
// the control connection itself does between processes).
func (s *Session) wakeLocal(p *Session) {
	s.ctr.wakeupsSent.Add(1)
	s.ctr.localWakeups.Add(1)
	p.localPending.Add(1)
	if p.localSleeper.Load() != nil {
		if r := p.localSleeper.Swap(nil); r != nil {
			signal(r.readCh)
			return
		}
	}
	signal(p.localWake)
}

// sleepLocal puts st's reader, about to sleep on st.readCh in a session
// paired in this process, in the place of the session's harvester for
// the next wake (wakeLocal), unless another reader holds that place; it
// reports whether it did. The caller then sleeps on st.readCh and calls
// wokeLocal when it wakes.
func (st *Stream) sleepLocal() bool {
	s := st.s
	return s.local.Load() != nil && s.localSleeper.CompareAndSwap(nil, st)
}

// wokeLocal ends the sleep that sleepLocal began, once st.readCh has
// woken the reader. If a wake took the reader out of the sleeper's place
// (wakeLocal), the reader harvests, as localHarvest would, and counts in
// Stats.SelfWakes: the harvest covers every wake counted in
// localPending, and one that the harvester has taken already is being
// harvested there. The reader harvests one batch (harvestBatch) and
// leaves the rest of a long queue to the harvester, so that its read
// deadline is not held up by a peer that keeps putting events. It ends
// the session if the receive queue is corrupt. The caller holds rmu and
// counts in rx.waiters.
func (st *Stream) wokeLocal() {
	s := st.s
	if s.localSleeper.CompareAndSwap(st, nil) {
		return // woken by its data, a close or a deadline
	}
	n := s.localPending.Swap(0)
	if n == 0 {
		return
	}
	more, err := s.harvestBatch()
	s.ctr.wakeupsReceived.Add(n)
	s.ctr.selfWakes.Add(1)
	// The harvest signalled st.readCh if it delivered to st: the caller
	// sees that delivery when it looks at the stream again, and the
	// signal left over would only wake its next wait at once, for
	// nothing. Whatever else signals readCh (a close, the deadline, the
	// session's end) is seen there too.
	select {
	case <-st.readCh:
	default:
	}
	if err != nil {
		s.failOp("harvest", err)
		return
	}
	if more {
		signal(s.localWake)
	}
}

// localHarvest is the harvester goroutine of a session paired with its
// peer in this process (pairLocal): it harvests the receive queue for the
// wakes that the peer hands it (wakeLocal), until the session ends. The
// wakes taken before a harvest count as received once it is done, as a
// Polling does once handled (Session.handle).
func (s *Session) localHarvest() {
	for {
		select {
		case <-s.localWake:
		case <-s.dead:
			return
		}
		n := s.localPending.Swap(0)
		err := s.harvest()
		s.ctr.wakeupsReceived.Add(n)
		if err != nil {
			s.failOp("harvest", err)
			return
		}
	}
}
