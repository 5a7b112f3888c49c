package session

import (
	"fmt"
	"time"

	"github.com/shmlink/shmlink/internal/wire"
)

// Hot restart (docs/protocol.md section 5). The old server process sends
// HotRestart{epoch} on every session (SendHotRestart). The client's owner
// stops using the session for new streams (HotRestartEpoch reports the
// HotRestart), the streams in flight finish, and the client answers
// HotRestartAck{epoch} by itself as soon as the last one is gone;
// OpenStream fails with ErrDraining from then on. The server ends the session when the ack arrives (Err is then
// ErrHotRestarted), which the client reads as the peer's close.
//
// A client whose ack the server does not answer by closing the session
// within ackGrace ends the session itself (ackUnanswered): it has no
// stream left and takes none, so a server that keeps it open would only
// make a Dialer pile up such sessions.
//
// A HotRestart sent to a server, or an ack sent to a client, is a protocol
// error that ends the session. An ack the server did not ask for (no
// HotRestart sent, another epoch) is logged and ignored, like shmipc-go
// does.

// maxAckGrace bounds ackGrace.
const maxAckGrace = 5 * time.Second

// hotRestart is a session's hot-restart state, guarded by Session.mu.
type hotRestart struct {
	started bool          // server: HotRestart sent; client: HotRestart received
	acked   bool          // client: the ack is sent (or being sent); server: it arrived
	epoch   uint64        // the epoch of that HotRestart
	ch      chan struct{} // closed once started; made by draining
	// ackTimer, on a client that sent the ack, ends the session if the
	// server has not closed it within ackGrace; fail stops it.
	ackTimer *time.Timer
}

// ackGrace is how long a client that acknowledged a hot restart waits
// for the server to close the session before it ends the session itself:
// min(Config.HandshakeTimeout, 5 s), 3 s by default. The Go peer's server
// closes an acknowledged session within 100 ms, shmlink's at once
// (docs/protocol.md section 5).
func (s *Session) ackGrace() time.Duration {
	return min(s.cfg.HandshakeTimeout, maxAckGrace)
}

// SendHotRestart tells the client of a server session that a new server
// process took over (docs/protocol.md section 5): it sends HotRestart{epoch},
// where epoch is the new process's generation. The client answers with
// HotRestartAck{epoch} once its streams on this session are done, and the
// session then ends with ErrHotRestarted; the streams it still has keep
// working until then, and the client may even open new ones. It returns
// an error on a client session, ErrDraining if a HotRestart was
// already sent, the session's error if it has ended, and the write error
// (which ends the session).
func (s *Session) SendHotRestart(epoch uint64) error {
	if s.isClient {
		return errNotServer
	}
	s.mu.Lock()
	if err := s.err; err != nil {
		s.mu.Unlock()
		return err
	}
	if s.hr.started {
		s.mu.Unlock()
		return ErrDraining
	}
	s.startDrainLocked(epoch)
	s.mu.Unlock()
	s.cfg.Logger.Debug("shmlink: hot restart sent", "remote", s.conn.RemoteAddr(), "epoch", epoch)
	return s.writeCtl(wire.AppendHotRestart(nil, s.version, wire.TypeHotRestart, epoch))
}

// draining returns a channel that is closed when the session starts
// draining for a hot restart: on a client when the server's HotRestart
// arrives, on a server when SendHotRestart was called. A client's owner
// then opens new streams on a new session to the same address (the new
// server process); see HotRestartEpoch for the epoch.
func (s *Session) draining() <-chan struct{} {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.hr.ch == nil {
		s.hr.ch = make(chan struct{})
		if s.hr.started {
			close(s.hr.ch)
		}
	}
	return s.hr.ch
}

// HotRestartEpoch returns the epoch of the HotRestart this session sent
// (server) or received (client), and whether there was one. A client
// puts it in the names of the shared memory of its next sessions
// (Config.Epoch).
func (s *Session) HotRestartEpoch() (epoch uint64, ok bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.hr.epoch, s.hr.started
}

// startDrainLocked marks the session as draining for epoch. The caller
// holds mu and has checked that it was not draining yet.
func (s *Session) startDrainLocked(epoch uint64) {
	s.hr.started, s.hr.epoch = true, epoch
	if s.hr.ch != nil {
		close(s.hr.ch)
	}
}

// handleHotRestart acts on a HotRestart message: a client starts draining
// and acks at once if it has no stream. A second HotRestart is ignored.
func (s *Session) handleHotRestart(payload []byte) error {
	if !s.isClient {
		return fmt.Errorf("%w: HotRestart sent to a server", ErrProtocol)
	}
	epoch, err := wire.ParseEpoch(payload)
	if err != nil {
		return err
	}
	s.mu.Lock()
	first := !s.hr.started
	if first {
		s.startDrainLocked(epoch)
	}
	s.mu.Unlock()
	if first {
		s.cfg.Logger.Debug("shmlink: hot restart: draining", "remote", s.conn.RemoteAddr(), "epoch", epoch)
	} else {
		s.cfg.Logger.Debug("shmlink: repeated HotRestart ignored", "remote", s.conn.RemoteAddr(), "epoch", epoch)
	}
	s.maybeAck()
	return nil
}

// handleHotRestartAck acts on a HotRestartAck message: a server whose
// HotRestart it answers ends the session. It then returns ErrHotRestarted
// to stop the receive loop (the session has ended already, so that error
// is not recorded).
func (s *Session) handleHotRestartAck(payload []byte) error {
	if s.isClient {
		return fmt.Errorf("%w: HotRestartAck sent to a client", ErrProtocol)
	}
	epoch, err := wire.ParseEpoch(payload)
	if err != nil {
		return err
	}
	s.mu.Lock()
	ok := s.hr.started && !s.hr.acked && epoch == s.hr.epoch
	if ok {
		s.hr.acked = true
	}
	want, started := s.hr.epoch, s.hr.started
	s.mu.Unlock()
	if !ok {
		s.ctr.acksIgnored.Add(1)
		if !s.warnAck.allow() {
			return nil
		}
		s.cfg.Logger.Warn("shmlink: unexpected HotRestartAck ignored", "remote", s.conn.RemoteAddr(),
			"epoch", epoch, "sent", started, "want", want)
		return nil
	}
	s.cfg.Logger.Debug("shmlink: hot restart acknowledged", "remote", s.conn.RemoteAddr(), "epoch", epoch)
	s.fail(ErrHotRestarted)
	return ErrHotRestarted
}

// maybeAck sends the HotRestartAck of a draining client session once it
// has no stream left: none routed and none that the application has yet
// to Close (a client routes no stream the application closed).
// From the moment it decides to, OpenStream fails with ErrDraining, so no
// stream can slip in after the ack.
func (s *Session) maybeAck() {
	if !s.isClient {
		return
	}
	s.mu.Lock()
	send := s.hr.started && !s.hr.acked && s.err == nil && len(s.tab.routed) == 0 && len(s.tab.live) == 0
	if send {
		s.hr.acked = true
	}
	epoch := s.hr.epoch
	s.mu.Unlock()
	if !send {
		return
	}
	s.cfg.Logger.Debug("shmlink: hot restart: acknowledging", "remote", s.conn.RemoteAddr(), "epoch", epoch)
	if s.writeCtl(wire.AppendHotRestart(nil, s.version, wire.TypeHotRestartAck, epoch)) != nil {
		return // the session ended
	}
	s.mu.Lock()
	if s.err == nil { // else fail has run, or is about to
		s.hr.ackTimer = time.AfterFunc(s.ackGrace(), s.ackUnanswered)
	}
	s.mu.Unlock()
}

// ackUnanswered ends a client session whose HotRestartAck the server has
// not answered by closing the session within ackGrace, with a
// *SessionError of op "hot restart" that says so. It runs on ackTimer's
// goroutine.
func (s *Session) ackUnanswered() {
	if s.Err() != nil {
		return
	}
	grace := s.ackGrace()
	s.cfg.Logger.Debug("shmlink: hot restart: the server kept the session after the ack", "remote", s.conn.RemoteAddr(), "after", grace)
	s.failOp("hot restart", fmt.Errorf("the server did not close the session within %v of its HotRestartAck (min(Config.HandshakeTimeout, %v))", grace, maxAckGrace))
	s.unmapIfUnused()
}
