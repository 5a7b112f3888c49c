package upgrade

import (
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"sync"
	"time"

	"github.com/shmlink/shmlink/internal/sock"
)

const (
	// handoverTimeout bounds a handover from the request to the ready
	// frame (docs/protocol.md section 14, "Sequence") on either side.
	handoverTimeout = 10 * time.Second
	// socketMode is the mode of the upgrade socket's file: whoever can
	// connect to it can take the listener.
	socketMode = 0o600
	// acceptBackoff is how long serve waits after a failed accept (out of
	// descriptors or the like) before it accepts again, as net/http does.
	acceptBackoff = 100 * time.Millisecond
)

// Config configures an Upgrader; TakeOver and Listen take it.
type Config struct {
	// Path is the upgrade socket's path (ListenConfig.UpgradeSocket).
	Path string
	// Network and Address are those the listening socket was asked for:
	// TakeOver checks that the socket received is of that kind at that
	// address (any port for a TCP port 0); Listen removes a dead
	// process's socket file at a "unix" Address.
	Network, Address string
	// DrainTimeout is how long a generation that handed over waits for
	// its connections to end before it closes the sessions left, from the
	// new process's ready on. It must be positive.
	DrainTimeout time.Duration
	// Logger receives the handover's events; nil discards them.
	Logger *slog.Logger
	// Extras is the number of sockets handed over beside the listening
	// socket and the upgrade socket: those the Listener's Extras returns
	// (an ExtraSender), the same number in every generation.
	Extras int
}

// ExtraSender is a Listener that hands more sockets over than its
// listening socket (the "quic" network: a socket to forward the old
// generation's packets into, docs/protocol.md section 17). Extras returns
// them, owned by the ExtraSender, and done, which the Upgrader calls once
// the handover succeeded (ok) or failed (a nil done is not called); they
// follow the upgrade socket in the message, and the new process finds them
// in Received. When Extras returns an error, the Upgrader refuses the
// request with reason 3 (the new process's TakeOver returns
// ErrHandoverFailed), logs the error and serves on (docs/protocol.md
// section 14).
type ExtraSender interface {
	Extras() (lns []net.Listener, done func(ok bool), err error)
}

// Listener is the listener whose socket an Upgrader hands over, as the
// Upgrader drives it once a new process took over; the root package's
// Listener provides it. The Upgrader calls HandOver and then Drained, from
// its own goroutine and without holding its lock.
type Listener interface {
	// HandOver stops accepting: it closes this process's descriptor of
	// the listening socket (the socket lives on in the new process of
	// epoch) and returns once no new connection can start. It sends
	// HotRestart{epoch} on every session, and on every session whose
	// handshake completes later, so that the clients move over; it
	// returns without waiting for those writes, which a client that does
	// not read holds up to its write timeout. The drain timeout runs
	// already. The channel it returns is closed once the listener serves
	// no connection any more, neither session nor handshake.
	HandOver(epoch uint64) (idle <-chan struct{})
	// Drained closes every session left (after the drain timeout), with
	// its streams, all at once, and returns how many; and makes the
	// listener's Accept fail from now on: it handed over and drained.
	Drained() (closed int)
}

// An Upgrader is one generation's side of the hot upgrade: it serves the
// upgrade socket, grants the listener to the next generation and drains
// the Listener. Make one with TakeOver or Listen, then Start it; Stop and
// Close it when the listener closes.
type Upgrader struct {
	cfg      Config
	log      *slog.Logger
	uln      *net.UnixListener // the upgrade socket; owned, and sent to the next generation
	ln       net.Listener      // the listening socket; owned by the Listener, sent too
	sockFile string            // ln's socket file, for Stop and Close; "" for TCP and abstract sockets
	epoch    uint64            // this generation's
	received []net.Listener    // the extra sockets TakeOver received; owned by the caller
	l        Listener          // set by Start

	quit         chan struct{} // closed by Stop
	stopped      chan struct{} // closed once Stop has dealt with the socket files
	upgraded     chan struct{} // see Upgraded
	upgradedOnce sync.Once
	wg           sync.WaitGroup // serve, handle and watchPrev; Close waits

	mu    sync.Mutex
	state state    // changed only by stepLocked
	prev  net.Conn // the previous generation's connection, until it drained
	next  net.Conn // the next generation's, until this one drained
	// asking holds the connections of new processes not granted the
	// listener (yet): Stop cuts them short. A granted one has its answer
	// within handoverTimeout, and Close waits for it.
	asking map[net.Conn]struct{}

	// owned are the socket files that were this generation's when Stop
	// came while a grant was pending: if the handover then failed, Close
	// removes those that their paths still name. Set by Stop before it
	// closes stopped; not guarded by mu.
	owned []ownedFile
}

// ownedFile is a socket file of a generation, at path.
type ownedFile struct {
	path string
	ref  fileRef
}

// socketFiles returns the paths of the socket files of this generation's
// sockets: the upgrade socket's, and the listening socket's if it has one.
func (u *Upgrader) socketFiles() []string {
	if u.sockFile == "" {
		return []string{u.cfg.Path}
	}
	return []string{u.cfg.Path, u.sockFile}
}

// newUpgrader returns the Upgrader of a generation of epoch, in state st,
// that listens on ln and serves the upgrade socket uln. Neither socket
// file is removed when its listener is closed: the last generation's Stop
// removes them, or its Close after a grant pending at Stop failed.
func newUpgrader(cfg Config, uln *net.UnixListener, ln net.Listener, epoch uint64, st state) *Upgrader {
	u := &Upgrader{
		cfg:      cfg,
		log:      cfg.Logger,
		uln:      uln,
		ln:       ln,
		epoch:    epoch,
		quit:     make(chan struct{}),
		stopped:  make(chan struct{}),
		upgraded: make(chan struct{}),
		state:    st,
		asking:   make(map[net.Conn]struct{}),
	}
	if u.log == nil {
		u.log = slog.New(slog.DiscardHandler)
	}
	uln.SetUnlinkOnClose(false)
	if ul, ok := ln.(*net.UnixListener); ok {
		ul.SetUnlinkOnClose(false)
		if name := ul.Addr().String(); name != "" && name[0] != '@' {
			u.sockFile = name
		}
	}
	return u
}

// stepLocked moves u.state along the edge of ev, the only place where the
// state changes, and reports whether ev had an edge from the current
// state (if not, the state is unchanged). u.mu must be held.
func (u *Upgrader) stepLocked(ev event) bool {
	next, ok := u.state.next(ev)
	u.state = next
	return ok
}

// Epoch returns this generation's epoch: 0 for the first, its
// predecessor's plus one for one that took over.
func (u *Upgrader) Epoch() uint64 { return u.epoch }

// Received returns the extra sockets TakeOver received from the previous
// generation (Config.Extras of them; none for the first generation),
// owned by the caller.
func (u *Upgrader) Received() []net.Listener { return u.received }

// Upgraded returns a channel that is closed once this generation handed
// over and drained, or handed over and was closed.
func (u *Upgrader) Upgraded() <-chan struct{} { return u.upgraded }

// fireUpgraded closes the Upgraded channel, once.
func (u *Upgrader) fireUpgraded() { u.upgradedOnce.Do(func() { close(u.upgraded) }) }

// Start serves the upgrade socket for the next generation, handing l over
// to it, and in a generation that took over watches the previous
// generation until it has drained. Call it once, before Stop.
func (u *Upgrader) Start(l Listener) {
	u.l = l
	u.mu.Lock()
	prev := u.prev
	u.mu.Unlock()
	u.wg.Add(1)
	go u.serve()
	if prev != nil {
		u.wg.Add(1)
		go u.watchPrev(prev)
	}
}

// Stop stops serving the upgrade socket and closes the connections to the
// previous and next generations and to new processes not granted the
// listener; it returns at once, and does nothing if called again. The
// Upgrader calls the Listener no more after Stop, except to finish a
// drain that the Listener's Close cuts short anyway.
//
// Call it before the Listener closes its listening socket: a generation
// that owns the sockets and has no grant pending removes their files
// first, before it closes the upgrade socket, while both still listen, so
// that no other process can have removed them as stale and bound its own
// at those paths. With a grant pending, the answer decides whose the
// files are (Close); Stop only takes note of which files are this
// generation's (docs/protocol.md section 14).
func (u *Upgrader) Stop() {
	u.mu.Lock()
	if !u.stepLocked(evClose) {
		u.mu.Unlock()
		return
	}
	st := u.state
	conns := []net.Conn{u.prev, u.next}
	u.prev, u.next = nil, nil
	for c := range u.asking {
		conns = append(conns, c)
	}
	u.mu.Unlock()
	close(u.quit)
	switch st {
	case stateClosed:
		for _, path := range u.socketFiles() {
			os.Remove(path)
		}
	case stateClosingGranting:
		for _, path := range u.socketFiles() {
			// A file without a ref (none there, or no descriptor left)
			// is never removed: a stale file is the lesser harm, and the
			// next generation to listen afresh removes it.
			if ref, ok := refFile(path); ok {
				u.owned = append(u.owned, ownedFile{path, ref})
			}
		}
	}
	close(u.stopped)
	u.uln.Close()
	for _, c := range conns {
		if c != nil {
			c.Close()
		}
	}
}

// Close stops the Upgrader (Stop) and waits for its goroutines, for a
// granted handover's answer too (at most 10 s). If that handover failed,
// it removes the socket files that were this generation's when Stop came,
// each only if its path still names that file: a process that listened
// afresh meanwhile, once the sockets were closed, keeps its own
// (docs/protocol.md section 14). A generation that handed over fires
// Upgraded. Call it once, after the Listener has closed its socket.
func (u *Upgrader) Close() {
	u.Stop()
	<-u.stopped
	u.wg.Wait()
	u.mu.Lock()
	st := u.state
	u.mu.Unlock()
	for _, f := range u.owned {
		if st == stateClosed && f.ref.names(f.path) {
			os.Remove(f.path)
		}
		f.ref.release()
	}
	u.owned = nil
	if st == stateClosedHandedOver {
		u.fireUpgraded()
	}
}

// serve accepts on the upgrade socket until it is closed (by a handover,
// or Stop) or fails for good. An error that passes (sock.Retryable: out of
// descriptors, say) is logged and retried after acceptBackoff; any other
// (EINVAL: the socket is not listening) is logged once as an error, and
// serve stops: the listener serves on, but cannot be upgraded any more.
func (u *Upgrader) serve() {
	defer u.wg.Done()
	for {
		conn, err := u.uln.AcceptUnix()
		if err != nil {
			if errors.Is(err, net.ErrClosed) {
				return
			}
			if !sock.Retryable(err) {
				u.log.Error("shmlink: upgrade socket failed; no upgrade is possible from now on", "path", u.cfg.Path, "err", err)
				return
			}
			u.log.Warn("shmlink: upgrade socket accept failed", "path", u.cfg.Path, "err", err)
			t := time.NewTimer(acceptBackoff)
			select {
			case <-u.quit:
				t.Stop()
				return
			case <-t.C:
			}
			continue
		}
		u.wg.Add(1)
		go u.handle(conn)
	}
}

// watchPrev waits for the previous generation to close its connection,
// once it has drained (or died): upgrades are refused until then.
func (u *Upgrader) watchPrev(conn net.Conn) {
	defer u.wg.Done()
	io.Copy(io.Discard, conn)
	u.mu.Lock()
	if u.prev == conn {
		u.prev = nil
		u.stepLocked(evPrevDrained)
	}
	u.mu.Unlock()
	conn.Close()
	u.log.Debug("shmlink: previous generation drained", "epoch", u.epoch)
}

// handle runs the old side of a handover with a new process connected to
// the upgrade socket (docs/protocol.md section 14, its sequence).
func (u *Upgrader) handle(conn *net.UnixConn) {
	defer u.wg.Done()
	if !u.ask(conn) {
		conn.Close()
		return
	}
	kept := false
	defer func() {
		u.mu.Lock()
		delete(u.asking, conn)
		u.mu.Unlock()
		if !kept {
			conn.Close()
		}
	}()
	conn.SetDeadline(time.Now().Add(handoverTimeout))
	pid, uid, _, err := sock.PeerCred(conn)
	if err != nil || uid != os.Geteuid() {
		u.log.Warn("shmlink: upgrade request refused: peer of another user", "pid", pid, "uid", uid, "err", err)
		return
	}
	if _, err := readOp(conn, opRequest); err != nil {
		u.log.Warn("shmlink: bad upgrade request", "pid", pid, "err", err)
		return
	}
	if reason := u.admit(conn); reason != 0 {
		u.log.Info("shmlink: upgrade refused", "pid", pid, "closing", reason == refuseClosing)
		writeFrame(conn, opRefuse, reason)
		return
	}
	kept = u.grant(conn, pid)
}

// ask records conn as asking, unless the Upgrader is stopped.
func (u *Upgrader) ask(conn net.Conn) bool {
	u.mu.Lock()
	defer u.mu.Unlock()
	if u.state.closing() {
		return false
	}
	u.asking[conn] = struct{}{}
	return true
}

// admit grants conn's request, and returns 0, or returns the reason to
// refuse it: one upgrade at a time, none while closing.
func (u *Upgrader) admit(conn net.Conn) uint64 {
	u.mu.Lock()
	defer u.mu.Unlock()
	if reason := u.state.refusal(); reason != 0 {
		return reason
	}
	u.stepLocked(evGrant)
	delete(u.asking, conn) // granted: it has its answer within handoverTimeout
	return 0
}

// grant runs steps 2 to 4 with the granted new process of pid on conn:
// send the grant and the sockets, wait for ready, then stop accepting,
// move the clients over and drain. It reports whether conn was kept for
// the drain (the new process waits for its close); if not, the caller
// closes it.
func (u *Upgrader) grant(conn *net.UnixConn, pid int) (kept bool) {
	epoch := u.epoch + 1
	lns := []net.Listener{u.ln, u.uln}
	extrasDone := func(bool) {}
	if es, ok := u.l.(ExtraSender); ok {
		extras, done, err := es.Extras()
		if err != nil {
			// Nothing was sent: refuse (docs/protocol.md section 14,
			// reason 3), and serve on. The state goes back first, so
			// that the new process may ask again as soon as it reads
			// the refusal.
			u.failed(pid, fmt.Errorf("the sockets to hand over beside the listener: %w", err))
			writeFrame(conn, opRefuse, refuseFailed)
			return false
		}
		lns = append(lns, extras...)
		if done != nil {
			extrasDone = done
		}
	}
	err := writeFrame(conn, opGrant, epoch)
	if err == nil {
		err = sock.SendListeners(conn, lns...)
	}
	if err == nil {
		_, err = readOp(conn, opReady)
	}
	extrasDone(err == nil)
	if err != nil {
		u.failed(pid, err)
		return false
	}
	u.mu.Lock()
	u.stepLocked(evReady)
	closing := u.state.closing()
	if !closing {
		u.next = conn
	}
	u.mu.Unlock()
	conn.SetDeadline(time.Time{})
	u.log.Info("shmlink: listener handed over; draining", "pid", pid, "epoch", epoch)
	u.uln.Close() // the upgrade socket lives on in the new process
	if closing {
		return false // the listener's Close ends the sessions
	}
	// The drain timeout runs from ready, however long HandOver takes
	// (docs/protocol.md section 14).
	timer := time.NewTimer(u.cfg.DrainTimeout)
	defer timer.Stop()
	u.drain(u.l.HandOver(epoch), timer.C)
	return true
}

// failed ends a granted handover with the new process of pid that failed
// before ready, for err: this generation serves on as before.
func (u *Upgrader) failed(pid int, err error) {
	u.mu.Lock()
	u.stepLocked(evFail)
	u.mu.Unlock()
	u.log.Warn("shmlink: upgrade failed; still serving", "pid", pid, "err", err)
}

// drain waits until idle is closed (the Listener serves no connection),
// or timeout fires (the drain timeout), then has the Listener close the
// sessions left and fail Accept, tells the next generation (closes its
// connection) and fires Upgraded. If the Upgrader is stopped meanwhile,
// the Listener's Close does the rest.
func (u *Upgrader) drain(idle <-chan struct{}, timeout <-chan time.Time) {
	timedOut := false
	select {
	case <-idle:
	case <-timeout:
		timedOut = true
	case <-u.quit:
		return
	}
	if n := u.l.Drained(); timedOut {
		u.log.Warn("shmlink: drain timeout; closed the sessions left", "sessions", n, "after", u.cfg.DrainTimeout)
	}
	u.mu.Lock()
	next := u.next
	u.next = nil
	u.mu.Unlock()
	if next != nil {
		next.Close()
	}
	u.log.Info("shmlink: drained", "epoch", u.epoch)
	u.fireUpgraded()
}
