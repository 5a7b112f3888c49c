package shmlink

import (
	"cmp"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"sync"
	"syscall"
	"time"

	"github.com/shmlink/shmlink/internal/shm"
	"github.com/shmlink/shmlink/internal/sock"
	"github.com/shmlink/shmlink/session"
)

// Hot upgrade: a new server process takes the listening socket over from
// the running one without closing it, and the running one moves its
// clients over with the shmipc hot-restart messages (PROTOCOL.md section 5).
//
// The handover runs on ListenConfig.UpgradeSocket, a Unix socket of mode
// 0600 served by the live generation, which refuses peers of another uid.
// It is ours, not shmipc's, and speaks 16-byte big-endian frames:
//
//	+0  magic    u32  upgradeMagic ("SLUP")
//	+4  version  u8   upgradeVersion
//	+5  op       u8   opRequest, opGrant, opRefuse or opReady
//	+6  reserved u16  0
//	+8  arg      u64  request: the new process's pid; grant: its epoch;
//	                  refuse: refuseBusy or refuseClosing; ready: 0
//
//  1. new -> old: request.
//  2. old -> new: refuse, and close; or grant, then one sendmsg of one
//     byte carrying SCM_RIGHTS [listening socket, upgrade socket].
//  3. new: checks the sockets, sends ready, and accepts on both at once.
//     Clients that connect meanwhile wait in the socket's backlog: the
//     socket is never closed nor its path unlinked, so none is refused.
//  4. old: stops accepting (closes its own descriptors; the sockets live
//     on in the new process), sends HotRestart{epoch} on every session,
//     and closes each when its client acks (the session package does).
//     When the last has ended, or DrainTimeout passed and it closed those
//     left, it closes the connection and Upgraded fires.
//
// Until that close the new process refuses upgrades (refuseBusy), as the
// old one does from step 1 on: one upgrade at a time, at most two
// generations alive. If the new process fails before ready, or does not
// send it within handoverTimeout, the old one goes on serving as before.
// The live generation removes both socket files when it is closed without
// having handed over.

// DefaultDrainTimeout is how long, by default, a listener that handed its
// socket over waits for its sessions to end (ListenConfig.DrainTimeout).
const DefaultDrainTimeout = 10 * time.Second

var (
	// ErrUpgradeInProgress is returned (wrapped) by ListenConfig.Listen
	// with an UpgradeSocket when the process that owns it is already
	// handing over to another new process, or its predecessor is still
	// draining: one upgrade at a time. The running process is unaffected;
	// try again once it has finished.
	ErrUpgradeInProgress = errors.New("shmlink: upgrade refused: another upgrade is in progress")

	// ErrUpgraded is returned (in a *net.OpError) by Accept once the
	// listener has handed its socket over to a new process and drained
	// (see Listener.Upgraded). It satisfies errors.Is(err, net.ErrClosed).
	ErrUpgraded = fmt.Errorf("shmlink: listener handed over to a new process: %w", net.ErrClosed)

	// errUpgradeFrame is a malformed frame on the upgrade socket.
	errUpgradeFrame = errors.New("shmlink: bad upgrade frame")
)

// The upgrade socket's frames (see above).
const (
	upgradeMagic    = 0x534c5550 // "SLUP"
	upgradeVersion  = 1
	upgradeFrameLen = 16

	opRequest = 1
	opGrant   = 2
	opRefuse  = 3
	opReady   = 4

	refuseBusy    = 1 // a handover is underway, or the previous generation drains
	refuseClosing = 2 // the listener is being closed

	// maxDrainingPicks bounds how often one Dialer.DialContext picks again
	// after its session turned out to be draining.
	maxDrainingPicks = 8

	// handoverTimeout bounds steps 1 to 3 on either side.
	handoverTimeout = 10 * time.Second
	// upgradeSocketMode is the mode of the upgrade socket's file: whoever
	// can connect to it can take the listener.
	upgradeSocketMode = 0o600
)

// upgrader is a Listener's hot-upgrade state (ListenConfig.UpgradeSocket).
// Its methods do nothing on a nil *upgrader, so that the Listener calls
// them unconditionally.
type upgrader struct {
	path     string            // ListenConfig.UpgradeSocket
	ln       *net.UnixListener // the upgrade socket; the next generation gets it too
	sockFile string            // the listening socket's file ("unix"); "" for TCP
	epoch    uint64            // this generation's
	drain    time.Duration
	log      *slog.Logger

	acceptDone   chan struct{} // closed when acceptLoop has returned
	connGone     chan struct{} // cap 1: a serve goroutine returned
	upgraded     chan struct{} // see Listener.Upgraded
	upgradedOnce sync.Once

	mu       sync.Mutex
	conns    int      // serve goroutines running: sessions and handshakes
	owner    bool     // live generation: Close removes the socket files unless handed
	busy     bool     // a handover to a new process is underway
	handed   bool     // a new process took over (it sent ready)
	draining bool     // every session gets HotRestart
	closing  bool     // Close was called
	prev     net.Conn // the previous generation's connection, until it drained
	next     net.Conn // the next generation's, until this one drained
	// asking holds the connections of new processes not granted the
	// listener (yet): Close cuts them short. A granted one has its answer
	// within handoverTimeout, and Close waits for it.
	asking map[net.Conn]struct{}
}

// newUpgrader returns the state of a generation of epoch that listens on
// ln and serves the upgrade socket uln.
func newUpgrader(lc *ListenConfig, cfg *Config, uln *net.UnixListener, ln net.Listener, epoch uint64) *upgrader {
	u := &upgrader{
		path:       lc.UpgradeSocket,
		ln:         uln,
		epoch:      epoch,
		drain:      lc.DrainTimeout,
		log:        cfg.Logger,
		acceptDone: make(chan struct{}),
		connGone:   make(chan struct{}, 1),
		upgraded:   make(chan struct{}),
		asking:     make(map[net.Conn]struct{}),
	}
	if u.drain == 0 {
		u.drain = DefaultDrainTimeout
	}
	if u.log == nil {
		u.log = slog.New(slog.DiscardHandler)
	}
	// The files go when the last generation is closed (closed), never
	// when one that handed over closes its descriptors.
	uln.SetUnlinkOnClose(false)
	if ul, ok := ln.(*net.UnixListener); ok {
		ul.SetUnlinkOnClose(false)
		if name := ul.Addr().String(); name != "" && name[0] != '@' {
			u.sockFile = name
		}
	}
	return u
}

// Upgraded returns a channel that is closed once a new process has taken
// the listener over through ListenConfig.UpgradeSocket and this listener
// has drained: every session acknowledged the hot restart and ended, or
// DrainTimeout passed and the rest were closed (or Close was called
// meanwhile). Accept then returns ErrUpgraded, and the process may Close
// the listener and exit. Without UpgradeSocket it returns nil, a channel
// that never fires.
func (l *Listener) Upgraded() <-chan struct{} {
	if l.up == nil {
		return nil
	}
	return l.up.upgraded
}

// Epoch returns the listener's generation: 0 for a listener that listened
// afresh (or without UpgradeSocket), and its predecessor's plus one for a
// listener that took one over. Sessions dialed after the hot restart name
// their shared memory with it (Config.Epoch).
func (l *Listener) Epoch() uint64 {
	if l.up == nil {
		return 0
	}
	return l.up.epoch
}

// listenUpgradable is Listen with an UpgradeSocket: take the listener over
// from the process that owns the socket, or listen afresh if none does.
func (lc *ListenConfig) listenUpgradable(ctx context.Context, network, address string, cfg Config) (*Listener, error) {
	switch {
	case lc.DrainTimeout < 0:
		return nil, &session.ConfigError{Field: "ListenConfig.DrainTimeout", Reason: "negative"}
	case network == "unix" && address == lc.UpgradeSocket:
		return nil, &session.ConfigError{Field: "ListenConfig.UpgradeSocket", Reason: "the listening address itself"}
	}
	var d net.Dialer
	c, err := d.DialContext(ctx, "unix", lc.UpgradeSocket)
	switch {
	case err == nil:
		return lc.takeOver(ctx, c.(*net.UnixConn), network, address, cfg)
	case !noListener(err):
		return nil, fmt.Errorf("shmlink: upgrade socket: %w", err)
	}
	uln, err := listenStale(lc.UpgradeSocket, func() (net.Listener, error) {
		return sock.ListenUnix(lc.UpgradeSocket, upgradeSocketMode)
	})
	if err != nil {
		return nil, fmt.Errorf("shmlink: upgrade socket: %w", err)
	}
	// We own the upgrade socket, so no generation is alive: a socket file
	// at a "unix" address is a dead one's.
	ln, err := listenStale(address, func() (net.Listener, error) { return lc.listen(ctx, network, address) })
	if err != nil {
		uln.Close() // removes its file
		return nil, err
	}
	u := newUpgrader(lc, &cfg, uln.(*net.UnixListener), ln, 0)
	u.owner = true
	l := newListener(ln, cfg, u)
	l.wg.Add(1)
	go l.upgradeLoop()
	return l, nil
}

// noListener reports whether err, from dialing a Unix socket, means that
// no process listens on it.
func noListener(err error) bool {
	return errors.Is(err, syscall.ENOENT) || errors.Is(err, syscall.ECONNREFUSED)
}

// listenStale calls listen; if that fails because path exists, and path is
// a Unix socket on which nobody listens (a dead process's), it removes it
// and calls listen again.
func listenStale(path string, listen func() (net.Listener, error)) (net.Listener, error) {
	ln, err := listen()
	if err == nil || !errors.Is(err, syscall.EADDRINUSE) || path == "" || path[0] == '@' {
		return ln, err
	}
	if fi, serr := os.Lstat(path); serr != nil || fi.Mode().Type() != os.ModeSocket {
		return nil, err
	}
	c, derr := net.Dial("unix", path)
	if derr == nil {
		c.Close()
		return nil, err
	}
	if !errors.Is(derr, syscall.ECONNREFUSED) {
		return nil, err
	}
	os.Remove(path)
	return listen()
}

// takeOver runs the new process's side of the handover on conn, connected
// to the upgrade socket (steps 1 to 3).
func (lc *ListenConfig) takeOver(ctx context.Context, conn *net.UnixConn, network, address string, cfg Config) (_ *Listener, err error) {
	var ln, uln net.Listener
	defer func() {
		if err != nil {
			conn.Close()
			if ln != nil {
				ln.Close()
			}
			if uln != nil {
				uln.Close()
			}
			err = fmt.Errorf("shmlink: upgrade via %s: %w", lc.UpgradeSocket, err)
		}
	}()
	deadline := time.Now().Add(handoverTimeout)
	if dl, ok := ctx.Deadline(); ok && dl.Before(deadline) {
		deadline = dl
	}
	if err := conn.SetDeadline(deadline); err != nil {
		return nil, err
	}
	// ctx bounds the handover until ready is sent, and no further.
	var cmu sync.Mutex
	committed := false
	stop := context.AfterFunc(ctx, func() {
		cmu.Lock()
		defer cmu.Unlock()
		if !committed {
			conn.SetDeadline(time.Unix(1, 0))
		}
	})
	defer stop()
	if _, uid, _, err := sock.PeerCred(conn); err != nil {
		return nil, err
	} else if uid != os.Geteuid() {
		return nil, fmt.Errorf("upgrade socket served by uid %d", uid)
	}

	if err := writeFrame(conn, opRequest, uint64(os.Getpid())); err != nil {
		return nil, err
	}
	op, arg, err := readFrame(conn)
	switch {
	case err != nil:
		return nil, err
	case op == opRefuse && arg == refuseBusy:
		return nil, ErrUpgradeInProgress
	case op == opRefuse:
		return nil, errors.New("refused: the running listener is closing")
	case op != opGrant:
		return nil, fmt.Errorf("%w: op %d, want grant", errUpgradeFrame, op)
	}
	epoch := arg
	fds, err := shm.RecvFds(conn, 2)
	if err != nil {
		return nil, fmt.Errorf("receive the listeners: %w", err)
	}
	if ln, err = fileListener(fds[0], "listener"); err != nil {
		shm.CloseFd(fds[1])
		return nil, err
	}
	if uln, err = fileListener(fds[1], "upgrade socket"); err != nil {
		return nil, err
	}
	if err := lc.checkTakenOver(ln, uln, network, address); err != nil {
		return nil, err
	}
	// Committed: from ready on, the old process stops accepting.
	cmu.Lock()
	err = writeFrame(conn, opReady, 0)
	committed = err == nil
	cmu.Unlock()
	if err != nil {
		return nil, err
	}
	conn.SetDeadline(time.Time{})
	u := newUpgrader(lc, &cfg, uln.(*net.UnixListener), ln, epoch)
	u.owner = true
	u.prev = conn
	l := newListener(ln, cfg, u)
	l.wg.Add(2)
	go l.upgradeLoop()
	go l.watchPrev(conn)
	return l, nil
}

// checkTakenOver checks that the sockets received from the old process
// are what this one was asked to listen on: a listener of the same kind
// at the same path (or TCP port, unless 0), and a Unix upgrade socket.
func (lc *ListenConfig) checkTakenOver(ln, uln net.Listener, network, address string) error {
	if _, ok := uln.(*net.UnixListener); !ok {
		return fmt.Errorf("the upgrade socket received is a %T", uln)
	}
	switch l := ln.(type) {
	case *net.UnixListener:
		if network != "unix" {
			return fmt.Errorf("the running listener is on a Unix socket, not %s", network)
		}
		if got := l.Addr().String(); got != address {
			return fmt.Errorf("the running listener is at %q, not %q", got, address)
		}
	case *net.TCPListener:
		if network == "unix" {
			return errors.New("the running listener is on TCP, not a Unix socket")
		}
		ta := l.Addr().(*net.TCPAddr)
		if _, port, err := net.SplitHostPort(address); err == nil && port != "" && port != "0" {
			if p, err := net.LookupPort(network, port); err != nil || p != ta.Port {
				return fmt.Errorf("the running listener is at %v, not %s", ta, address)
			}
		}
		if !lc.AllowNonLoopback && !ta.IP.IsLoopback() {
			return fmt.Errorf("%w: the running listener is at %v", ErrNotLoopback, ta)
		}
	default:
		return fmt.Errorf("the listener received is a %T", ln)
	}
	return nil
}

// watchPrev waits for the previous generation to close its connection,
// once it has drained (or died): upgrades are refused until then.
func (l *Listener) watchPrev(conn net.Conn) {
	defer l.wg.Done()
	io.Copy(io.Discard, conn)
	u := l.up
	u.mu.Lock()
	if u.prev == conn {
		u.prev = nil
	}
	u.mu.Unlock()
	conn.Close()
	u.log.Debug("shmlink: previous generation drained", "epoch", u.epoch)
}

// upgradeLoop serves the upgrade socket until it is closed: by a
// handover, or Close.
func (l *Listener) upgradeLoop() {
	defer l.wg.Done()
	u := l.up
	for {
		conn, err := u.ln.AcceptUnix()
		if err != nil {
			if errors.Is(err, net.ErrClosed) {
				return
			}
			// Out of descriptors or the like: back off, as net/http does.
			u.log.Warn("shmlink: upgrade socket accept failed", "path", u.path, "err", err)
			t := time.NewTimer(100 * time.Millisecond)
			select {
			case <-l.done:
				t.Stop()
				return
			case <-t.C:
			}
			continue
		}
		l.wg.Add(1)
		go l.handleUpgrade(conn)
	}
}

// handleUpgrade runs the old process's side of the handover with a new
// process connected to the upgrade socket (steps 1 to 4).
func (l *Listener) handleUpgrade(conn *net.UnixConn) {
	defer l.wg.Done()
	u := l.up
	u.mu.Lock()
	if u.closing {
		u.mu.Unlock()
		conn.Close()
		return
	}
	u.asking[conn] = struct{}{}
	u.mu.Unlock()
	handed := false
	defer func() {
		u.mu.Lock()
		delete(u.asking, conn)
		u.mu.Unlock()
		if !handed {
			conn.Close()
		}
	}()
	conn.SetDeadline(time.Now().Add(handoverTimeout))
	pid, uid, _, err := sock.PeerCred(conn)
	if err != nil || uid != os.Geteuid() {
		u.log.Warn("shmlink: upgrade request refused: peer of another user", "pid", pid, "uid", uid, "err", err)
		return
	}
	op, _, err := readFrame(conn)
	if err == nil && op != opRequest {
		err = fmt.Errorf("%w: op %d, want request", errUpgradeFrame, op)
	}
	if err != nil {
		u.log.Warn("shmlink: bad upgrade request", "pid", pid, "err", err)
		return
	}
	var reason uint64
	u.mu.Lock()
	switch {
	case u.closing:
		reason = refuseClosing
	case u.busy || u.handed || u.prev != nil:
		reason = refuseBusy
	default:
		u.busy = true
		delete(u.asking, conn)
	}
	u.mu.Unlock()
	if reason != 0 {
		u.log.Info("shmlink: upgrade refused", "pid", pid, "closing", reason == refuseClosing)
		writeFrame(conn, opRefuse, reason)
		return
	}
	epoch := u.epoch + 1
	err = writeFrame(conn, opGrant, epoch)
	if err == nil {
		err = sendListeners(conn, l.ln, u.ln)
	}
	if err == nil {
		op, _, err = readFrame(conn)
		if err == nil && op != opReady {
			err = fmt.Errorf("%w: op %d, want ready", errUpgradeFrame, op)
		}
	}
	if err != nil {
		u.mu.Lock()
		u.busy = false
		u.mu.Unlock()
		u.log.Warn("shmlink: upgrade failed; still serving", "pid", pid, "err", err)
		return
	}
	conn.SetDeadline(time.Time{})
	handed = true
	u.log.Info("shmlink: listener handed over; draining", "pid", pid, "epoch", epoch)
	l.handOver(conn)
}

// sendListeners sends the descriptors of ln and uln over conn in one
// SCM_RIGHTS message. They stay open here.
func sendListeners(conn *net.UnixConn, ln, uln net.Listener) error {
	sc, ok := ln.(syscall.Conn)
	if !ok {
		return fmt.Errorf("a %T cannot be handed over", ln)
	}
	rc, err := sc.SyscallConn()
	if err != nil {
		return err
	}
	urc, err := uln.(syscall.Conn).SyscallConn()
	if err != nil {
		return err
	}
	var serr error
	err = rc.Control(func(fd uintptr) {
		serr = urc.Control(func(ufd uintptr) {
			serr = shm.SendFds(conn, int(fd), int(ufd))
		})
	})
	return cmp.Or(err, serr)
}

// handOver is step 4: the new process accepts now; stop accepting, move
// the clients over and drain. conn is the new process's connection.
func (l *Listener) handOver(conn *net.UnixConn) {
	u := l.up
	u.mu.Lock()
	u.handed, u.busy = true, false
	closing := u.closing
	if !closing {
		u.next = conn
	}
	u.mu.Unlock()
	// Close our descriptors: the sockets live on in the new process.
	l.ln.Close()
	u.ln.Close()
	if closing {
		conn.Close() // Close ends the sessions
		return
	}
	<-u.acceptDone // no more connections here
	u.mu.Lock()
	u.draining = true
	u.mu.Unlock()
	l.mu.Lock()
	sessions := make([]*session.Session, 0, len(l.sessions))
	for s := range l.sessions {
		sessions = append(sessions, s)
	}
	l.mu.Unlock()
	for _, s := range sessions {
		s.SendHotRestart(u.epoch + 1) // an error means it has ended anyway
	}
	l.drainSessions()
}

// drainSessions waits until every connection of the listener is gone, or
// the drain timeout, then closes the sessions left, makes Accept return
// ErrUpgraded, tells the next generation and fires Upgraded.
func (l *Listener) drainSessions() {
	u := l.up
	timer := time.NewTimer(u.drain)
	defer timer.Stop()
	for timedOut := false; !timedOut; {
		u.mu.Lock()
		n := u.conns
		u.mu.Unlock()
		if n == 0 {
			break
		}
		select {
		case <-u.connGone:
		case <-l.done:
			return // Close ends the sessions and fires Upgraded
		case <-timer.C:
			timedOut = true
			l.mu.Lock()
			left := make([]*session.Session, 0, len(l.sessions))
			for s := range l.sessions {
				left = append(left, s)
			}
			l.mu.Unlock()
			u.log.Warn("shmlink: drain timeout; closing the sessions left", "sessions", len(left), "after", u.drain)
			for _, s := range left {
				s.Close()
			}
		}
	}
	l.mu.Lock()
	if l.err == nil {
		l.err = &net.OpError{Op: "accept", Net: l.ln.Addr().Network(), Addr: l.ln.Addr(), Err: ErrUpgraded}
	}
	l.mu.Unlock()
	l.stop()
	u.mu.Lock()
	next := u.next
	u.next = nil
	u.mu.Unlock()
	if next != nil {
		next.Close()
	}
	u.log.Info("shmlink: drained", "epoch", u.epoch)
	u.upgradedOnce.Do(func() { close(u.upgraded) })
}

// closeSocket closes the listening socket for Close, and with an upgrade
// socket that too and the connections to the other generations. A
// listener that handed over closed its socket already: that is no error.
func (l *Listener) closeSocket() error {
	u := l.up
	if u == nil {
		return l.ln.Close()
	}
	u.mu.Lock()
	u.closing = true
	conns := []net.Conn{u.prev, u.next}
	u.prev, u.next = nil, nil
	for c := range u.asking {
		conns = append(conns, c)
	}
	u.mu.Unlock()
	err := l.ln.Close()
	u.ln.Close()
	for _, c := range conns {
		if c != nil {
			c.Close()
		}
	}
	if u.handedOver() {
		return nil
	}
	return err
}

// closed finishes Close once every goroutine is done: the live generation
// removes the socket files; one that handed over fires Upgraded.
func (u *upgrader) closed() {
	if u == nil {
		return
	}
	u.mu.Lock()
	remove := u.owner && !u.handed
	handed := u.handed
	u.mu.Unlock()
	if remove {
		os.Remove(u.path)
		if u.sockFile != "" {
			os.Remove(u.sockFile)
		}
	}
	if handed {
		u.upgradedOnce.Do(func() { close(u.upgraded) })
	}
}

// handedOver reports whether a new process took the listener over.
func (u *upgrader) handedOver() bool {
	if u == nil {
		return false
	}
	u.mu.Lock()
	defer u.mu.Unlock()
	return u.handed
}

// acceptStopped records that acceptLoop has returned.
func (u *upgrader) acceptStopped() {
	if u != nil {
		close(u.acceptDone)
	}
}

// connStarted counts a connection whose serve goroutine starts.
func (u *upgrader) connStarted() {
	if u != nil {
		u.mu.Lock()
		u.conns++
		u.mu.Unlock()
	}
}

// connEnded counts a serve goroutine that returned.
func (u *upgrader) connEnded() {
	if u != nil {
		u.mu.Lock()
		u.conns--
		u.mu.Unlock()
		select {
		case u.connGone <- struct{}{}:
		default:
		}
	}
}

// sessionStarted sends HotRestart on a session whose handshake completed
// after the handover: its client must move too.
func (u *upgrader) sessionStarted(s *session.Session) {
	if u == nil {
		return
	}
	u.mu.Lock()
	draining := u.draining
	u.mu.Unlock()
	if draining {
		s.SendHotRestart(u.epoch + 1)
	}
}

// withEpoch returns cfg with Epoch set to epoch, copying it if needed.
func withEpoch(cfg *Config, epoch uint64) *Config {
	if epoch == 0 {
		return cfg
	}
	var c Config
	if cfg != nil {
		c = *cfg
	}
	c.Epoch = epoch
	return &c
}

// retireDraining sets s aside in p.draining if its server announced a hot
// restart, and reports whether it did: no new stream goes to s.
func (p *sessionPool) retireDraining(s *session.Session) bool {
	epoch, ok := s.HotRestartEpoch()
	if !ok {
		return false
	}
	p.epoch = max(p.epoch, epoch)
	p.draining = append(p.draining, s)
	return true
}

// pruneDraining forgets the draining sessions that have ended.
func (p *sessionPool) pruneDraining() {
	live := p.draining[:0]
	for _, s := range p.draining {
		if s.Err() == nil {
			live = append(live, s)
		}
	}
	clear(p.draining[len(live):])
	p.draining = live
}

// fileListener makes a net.Listener of fd and closes fd.
func fileListener(fd int, name string) (net.Listener, error) {
	f := os.NewFile(uintptr(fd), name)
	defer f.Close()
	return net.FileListener(f)
}

// writeFrame writes one frame of the upgrade socket.
func writeFrame(c net.Conn, op uint8, arg uint64) error {
	var b [upgradeFrameLen]byte
	binary.BigEndian.PutUint32(b[0:], upgradeMagic)
	b[4], b[5] = upgradeVersion, op
	binary.BigEndian.PutUint64(b[8:], arg)
	_, err := c.Write(b[:])
	return err
}

// readFrame reads one frame of the upgrade socket, exactly its 16 bytes:
// a descriptor-carrying message may follow.
func readFrame(c net.Conn) (op uint8, arg uint64, err error) {
	var b [upgradeFrameLen]byte
	if _, err := io.ReadFull(c, b[:]); err != nil {
		return 0, 0, err
	}
	if m := binary.BigEndian.Uint32(b[0:]); m != upgradeMagic || b[4] != upgradeVersion {
		return 0, 0, fmt.Errorf("%w: magic %#x version %d", errUpgradeFrame, m, b[4])
	}
	return b[5], binary.BigEndian.Uint64(b[8:]), nil
}
