package shmlink

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"sync/atomic"

	"github.com/shmlink/shmlink/internal/sock"
	"github.com/shmlink/shmlink/session"
)

// PeerCred identifies the process at the other end of a Unix socket or a
// loopback TCP connection, for Config.PeerCheck; see session.PeerCred.
type PeerCred = session.PeerCred

// defaultSocketMode is the permission bits of a Unix listener's socket file
// when ListenConfig.SocketMode is zero: read and write for the owner only
// (connecting needs write permission).
const defaultSocketMode os.FileMode = 0o600

// listenerAccess holds a Listener's access-control counters.
type listenerAccess struct {
	peersRefused atomic.Uint64 // connections refused for their peer's credentials
}

// PeersRefused returns how many connections the listener has closed, since
// it started, because the client's credentials failed Config.AllowUIDs or
// Config.PeerCheck (each is also logged to Config.Logger at level Warn).
// It stays 0 on "quic", where TLS (ClientAuth) refuses clients before
// shmlink sees them.
func (l *Listener) PeersRefused() uint64 { return l.access.peersRefused.Load() }

// handshakeFailed logs a failed handshake on conn, and counts it if the
// peer was refused for its credentials.
func (l *Listener) handshakeFailed(conn net.Conn, err error) {
	if !errors.Is(err, session.ErrPeerRefused) {
		l.cfg.Logger.Info("shmlink: handshake failed", "remote", conn.RemoteAddr(), "err", err)
		return
	}
	l.access.peersRefused.Add(1)
	args := []any{"addr", l.ln.Addr(), "err", err}
	var pe *session.PeerError
	if errors.As(err, &pe) {
		args = append(args, "pid", pe.Cred.PID, "uid", pe.Cred.UID, "gid", pe.Cred.GID)
	}
	l.cfg.Logger.Warn("shmlink: peer refused", args...)
}

// listen opens the listener's socket. A "unix" socket file gets
// SocketMode before the socket listens (see sock.ListenUnix: no client can
// connect under the umask's mode, and the umask, which is process-wide, is
// left alone). A TCP address must be loopback unless AllowNonLoopback: it
// is checked before binding, names resolved, and the bound address checked
// again.
func (lc *ListenConfig) listen(ctx context.Context, network, address string) (net.Listener, error) {
	if network == "unix" {
		mode := cmp.Or(lc.SocketMode, defaultSocketMode)
		if mode&^os.ModePerm != 0 {
			return nil, &session.ConfigError{Field: "ListenConfig.SocketMode",
				Reason: fmt.Sprintf("%#o has bits other than the permission bits (0777)", uint32(mode))}
		}
		return sock.ListenUnix(address, mode)
	}
	if !lc.AllowNonLoopback {
		if err := checkLoopback(ctx, network, address); err != nil {
			return nil, err
		}
	}
	var nlc net.ListenConfig
	ln, err := nlc.Listen(ctx, network, address)
	if err != nil {
		return nil, err
	}
	if ta, ok := ln.Addr().(*net.TCPAddr); ok && !lc.AllowNonLoopback && !ta.IP.IsLoopback() {
		ln.Close()
		return nil, notLoopback(network, address, fmt.Sprintf("bound to %v", ta))
	}
	return ln, nil
}

// checkLoopback returns an error wrapping ErrNotLoopback unless address's
// host is "localhost" (RFC 6761), a loopback IP, or a name that resolves
// only to loopback IPs. Addresses that do not parse or resolve are left to
// net.Listen to report.
func checkLoopback(ctx context.Context, network, address string) error {
	host, _, err := net.SplitHostPort(address)
	switch {
	case err != nil || host == "localhost":
		return nil
	case host == "":
		return notLoopback(network, address, "all interfaces")
	}
	if ip, err := netip.ParseAddr(host); err == nil {
		if !ip.IsLoopback() {
			return notLoopback(network, address, "")
		}
		return nil
	}
	ipNet := map[string]string{"tcp": "ip", "tcp4": "ip4", "tcp6": "ip6"}[network]
	ips, err := net.DefaultResolver.LookupNetIP(ctx, ipNet, host)
	if err != nil {
		return nil
	}
	for _, ip := range ips {
		if !ip.IsLoopback() {
			return notLoopback(network, address, "resolves to "+ip.String())
		}
	}
	return nil
}

// notLoopback is the error for a refused non-loopback TCP address.
func notLoopback(network, address, detail string) error {
	if detail != "" {
		detail = " (" + detail + ")"
	}
	return fmt.Errorf("%w: %s %q%s; set ListenConfig.AllowNonLoopback to listen on it", ErrNotLoopback, network, address, detail)
}
