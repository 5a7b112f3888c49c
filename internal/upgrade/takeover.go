package upgrade

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"sync"
	"syscall"
	"time"

	"github.com/shmlink/shmlink/internal/sock"
)

// TakeOver connects to the upgrade socket at cfg.Path and, if a process
// serves it, takes that process's listening socket over (docs/protocol.md
// section 14, "Sequence": from the request to the ready frame). The listening socket received must be a
// listener of cfg.Network at cfg.Address, and pass check (nil: no check),
// before this process commits to it. ctx bounds the
// handover until this process has committed, and no further; the
// handover takes at most 10 s anyway.
//
// It returns the listening socket and the Upgrader of the new generation,
// both owned by the caller. It returns ErrNoOwner (not wrapped) when no
// process serves the upgrade socket, and otherwise an error wrapping
// ErrInProgress, ErrHandoverFailed or ErrClosing when that process
// refuses, ErrFrame, check's error, or the I/O error; the process then
// goes on serving as before.
func TakeOver(ctx context.Context, cfg Config, check func(ln net.Listener) error) (net.Listener, *Upgrader, error) {
	var d net.Dialer
	c, err := d.DialContext(ctx, "unix", cfg.Path)
	switch {
	case err == nil:
	case noListener(err):
		return nil, nil, ErrNoOwner
	default:
		return nil, nil, fmt.Errorf("shmlink: upgrade socket: %w", err)
	}
	conn := c.(*net.UnixConn)
	ln, uln, extras, epoch, err := takeOver(ctx, conn, cfg.Extras, func(ln net.Listener) error {
		if err := checkReceived(ln, cfg.Network, cfg.Address); err != nil || check == nil {
			return err
		}
		return check(ln)
	})
	if err != nil {
		conn.Close()
		return nil, nil, fmt.Errorf("shmlink: upgrade via %s: %w", cfg.Path, err)
	}
	u := newUpgrader(cfg, uln, ln, epoch, stateFollowing)
	u.received = extras
	u.prev = conn // closed by the previous generation once it drained
	return ln, u, nil
}

// takeOver runs the new process's side of steps 1 to 3 on conn, connected
// to the upgrade socket, and returns the sockets received (the listening
// socket, the upgrade socket and extra more) and the new epoch. On error
// it closes what it received, not conn.
func takeOver(ctx context.Context, conn *net.UnixConn, extra int, check func(net.Listener) error) (ln net.Listener, uln *net.UnixListener, extras []net.Listener, epoch uint64, err error) {
	deadline := time.Now().Add(handoverTimeout)
	if dl, ok := ctx.Deadline(); ok && dl.Before(deadline) {
		deadline = dl
	}
	if err := conn.SetDeadline(deadline); err != nil {
		return nil, nil, nil, 0, err
	}
	ready := guardReady(ctx, conn)
	defer ready.stop()
	if _, uid, _, err := sock.PeerCred(conn); err != nil {
		return nil, nil, nil, 0, err
	} else if uid != os.Geteuid() {
		return nil, nil, nil, 0, fmt.Errorf("upgrade socket served by uid %d", uid)
	}
	if epoch, err = askGrant(conn); err != nil {
		return nil, nil, nil, 0, err
	}
	lns, err := sock.RecvListeners(conn, 2+extra)
	if err != nil {
		return nil, nil, nil, 0, fmt.Errorf("receive the listeners: %w", err)
	}
	ln = lns[0]
	uln, ok := lns[1].(*net.UnixListener)
	if !ok {
		err = fmt.Errorf("the upgrade socket received is a %T", lns[1])
	} else if err = check(ln); err == nil {
		// Committed: from ready on, the old process stops accepting.
		err = ready.send()
	}
	if err != nil {
		for _, l := range lns {
			l.Close()
		}
		return nil, nil, nil, 0, err
	}
	conn.SetDeadline(time.Time{})
	return ln, uln, lns[2:], epoch, nil
}

// askGrant sends the request (step 1) and reads the answer (step 2): the
// epoch granted, or ErrInProgress, ErrHandoverFailed, ErrClosing (any
// other refusal) or an error wrapping ErrFrame.
func askGrant(conn net.Conn) (epoch uint64, err error) {
	if err := writeFrame(conn, opRequest, uint64(os.Getpid())); err != nil {
		return 0, err
	}
	o, arg, err := readFrame(conn)
	switch {
	case err != nil:
		return 0, err
	case o == opRefuse && arg == refuseBusy:
		return 0, ErrInProgress
	case o == opRefuse && arg == refuseFailed:
		return 0, ErrHandoverFailed
	case o == opRefuse:
		return 0, ErrClosing
	case o != opGrant:
		return 0, fmt.Errorf("%w: op %v, want %v", ErrFrame, o, opGrant)
	}
	return arg, nil
}

// readyGuard lets a context cut a handover short until the ready frame is
// sent, and not after: from then on the old process stops accepting, and
// this one must serve.
type readyGuard struct {
	conn net.Conn
	stop func() bool // stops watching the context

	mu   sync.Mutex
	sent bool // ready went out: the context no longer matters
}

// guardReady watches ctx for a handover on conn: when ctx is done before
// ready is sent, conn's deadline is set in the past, which fails the
// handover's I/O. The caller must call stop.
func guardReady(ctx context.Context, conn net.Conn) *readyGuard {
	g := &readyGuard{conn: conn}
	g.stop = context.AfterFunc(ctx, func() {
		g.mu.Lock()
		defer g.mu.Unlock()
		if !g.sent {
			conn.SetDeadline(time.Unix(1, 0))
		}
	})
	return g
}

// send writes the ready frame (step 3), unless the context already cut
// the handover short.
func (g *readyGuard) send() error {
	g.mu.Lock()
	defer g.mu.Unlock()
	err := writeFrame(g.conn, opReady, 0)
	g.sent = err == nil
	return err
}

// checkReceived checks that ln, received from the old process, is what
// this one was asked to listen on: a listener of the same kind at the same
// path, or TCP port unless that is 0.
func checkReceived(ln net.Listener, network, address string) error {
	switch l := ln.(type) {
	case *net.UnixListener:
		if network != "unix" {
			return fmt.Errorf("the running listener is on a Unix socket, not %s", network)
		}
		if got := l.Addr().String(); got != address {
			return fmt.Errorf("the running listener is at %q, not %q", got, address)
		}
	case sock.PacketListener:
		ua, ok := l.Addr().(*net.UDPAddr)
		if network != "quic" || !ok {
			return fmt.Errorf("the running listener is a datagram socket at %v, not %s", l.Addr(), network)
		}
		if _, port, err := net.SplitHostPort(address); err == nil && port != "" && port != "0" {
			if p, err := net.LookupPort("udp", port); err != nil || p != ua.Port {
				return fmt.Errorf("the running listener is at %v, not %s", ua, address)
			}
		}
	case *net.TCPListener:
		if network == "unix" || network == "quic" {
			return errors.New("the running listener is on TCP, not a Unix socket")
		}
		ta := l.Addr().(*net.TCPAddr)
		if _, port, err := net.SplitHostPort(address); err == nil && port != "" && port != "0" {
			if p, err := net.LookupPort(network, port); err != nil || p != ta.Port {
				return fmt.Errorf("the running listener is at %v, not %s", ta, address)
			}
		}
	default:
		return fmt.Errorf("the listener received is a %T", ln)
	}
	return nil
}

// Listen makes the first generation, when TakeOver returned ErrNoOwner:
// it listens on the upgrade socket at cfg.Path (mode 0600) and calls
// listen for the listening socket, and returns that socket and the
// Upgrader of generation 0, both owned by the caller. A socket file left
// at cfg.Path or at cfg.Address by a dead process (one on which nobody
// listens) is removed first. It returns listen's error, and the upgrade
// socket's wrapped.
func Listen(cfg Config, listen func() (net.Listener, error)) (net.Listener, *Upgrader, error) {
	uln, err := sock.ListenUnix(cfg.Path, socketMode) // a dead process's socket file goes
	if err != nil {
		return nil, nil, fmt.Errorf("shmlink: upgrade socket: %w", err)
	}
	// We own the upgrade socket, so no generation is alive: a socket file
	// at a "unix" address is a dead one's, which sock.ListenUnix removes.
	ln, err := listen()
	if err != nil {
		uln.Close() // removes its file
		return nil, nil, err
	}
	return ln, newUpgrader(cfg, uln, ln, 0, stateServing), nil
}

// noListener reports whether err, from dialing a Unix socket, means that
// no process listens on it.
func noListener(err error) bool {
	return errors.Is(err, syscall.ENOENT) || errors.Is(err, syscall.ECONNREFUSED)
}
