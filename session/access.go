package session

import (
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"slices"
	"syscall"

	"github.com/shmlink/shmlink/internal/shm"
	"github.com/shmlink/shmlink/internal/sock"
)

// PeerCred identifies the process at the other end of a Unix socket (or of
// a loopback TCP connection, below), as the kernel recorded it when the connection was made (SO_PEERCRED on Linux):
// for a server, the client process that connected; for a client, the
// process that created the listening socket. Ids are as seen from this
// process's namespaces; PID is 0 when the peer's pid is not visible from
// ours. Over loopback TCP only UID is known, the owner of the peer's
// socket (docs/protocol.md section 9): PID is 0 and GID -1.
type PeerCred struct {
	PID int // process id
	UID int // effective user id
	GID int // effective group id
}

// checkPeer applies cfg's peer check (Config.AllowUIDs, Config.PeerCheck)
// to the process at the other end of conn and returns the uid that
// shared-memory files named by the peer must belong to. On a Unix socket
// the kernel gives the peer's credentials (SO_PEERCRED); on a loopback TCP
// connection it gives the uid that owns the peer's socket (socket
// diagnostics, sock.TCPPeerUID: PID is 0 and GID -1 then, unknown), and a
// connection whose owner cannot be found is refused. Over TCP between
// hosts there is no check, and files must belong to this process's
// effective uid. A refused peer gets a handshake error wrapping
// ErrPeerRefused.
func checkPeer(conn net.Conn, cfg *Config) (uid int, err error) {
	cred := PeerCred{GID: -1}
	switch c := conn.(type) {
	case *net.UnixConn:
		if cred.PID, cred.UID, cred.GID, err = sock.PeerCred(c); err != nil {
			return 0, handshakeError("peer credentials", fmt.Errorf("%w: %w", ErrPeerRefused, err))
		}
	case *net.TCPConn:
		local, remote := c.LocalAddr().(*net.TCPAddr), c.RemoteAddr().(*net.TCPAddr)
		if !local.IP.IsLoopback() || !remote.IP.IsLoopback() {
			return os.Geteuid(), nil
		}
		if cred.UID, err = sock.TCPPeerUID(local, remote); err != nil {
			return 0, handshakeError("peer credentials", fmt.Errorf("%w: %w", ErrPeerRefused, err))
		}
	default:
		return os.Geteuid(), nil
	}
	if err := cfg.allowPeer(cred); err != nil {
		return 0, handshakeError("peer credentials", &PeerError{Cred: cred, Err: err})
	}
	return cred.UID, nil
}

// allowPeer returns nil if c allows cred: by PeerCheck if set, else by
// AllowUIDs, which defaults to this process's effective uid.
func (c *Config) allowPeer(cred PeerCred) error {
	switch {
	case c.PeerCheck != nil:
		if err := c.PeerCheck(cred); err != nil {
			return fmt.Errorf("Config.PeerCheck: %w", err)
		}
		return nil
	case len(c.AllowUIDs) == 0:
		if euid := os.Geteuid(); cred.UID != euid {
			return fmt.Errorf("uid %d is not this process's uid %d (set Config.AllowUIDs or Config.PeerCheck to allow it)", cred.UID, euid)
		}
		return nil
	case !slices.Contains(c.AllowUIDs, cred.UID):
		return fmt.Errorf("uid %d is not in Config.AllowUIDs %v", cred.UID, c.AllowUIDs)
	}
	return nil
}

// validateAccess checks AllowUIDs and PeerCheck for Validate.
func (c *Config) validateAccess() error {
	if len(c.AllowUIDs) > 0 && c.PeerCheck != nil {
		return &ConfigError{Field: "AllowUIDs", Reason: "set AllowUIDs or PeerCheck, not both"}
	}
	for _, uid := range c.AllowUIDs {
		if uid < 0 || int64(uid) > 1<<32-2 {
			return &ConfigError{Field: "AllowUIDs", Reason: fmt.Sprintf("uid %d out of range", uid)}
		}
	}
	return nil
}

// openShared opens the shared-memory file at path, named by a peer whose
// files belong to uid, with shm.OpenFile's checks. A file refused by them
// gets an error wrapping ErrPathRefused.
func openShared(path string, uid int) (*os.File, error) {
	f, err := shm.OpenFile(path, uid)
	if err != nil && (errors.Is(err, shm.ErrNotRegular) || errors.Is(err, shm.ErrNotOwner) ||
		errors.Is(err, shm.ErrChanged) || errors.Is(err, syscall.ELOOP)) {
		err = fmt.Errorf("%w: %w", ErrPathRefused, err)
	}
	return f, err
}

// explainClose adds the likely reason to a client's handshake error caused
// by the server closing the connection: a server closes, without a word
// (the protocol has none), a client whose credentials or handshake it
// refuses, and one whose files (memory type mt, in shmDir) it cannot open,
// most often because its own Config.ShmDir differs.
func explainClose(err *error, mt MemoryType, shmDir string) {
	var se *SessionError
	if *err == nil || !errors.As(*err, &se) || errors.Is(se.Err, ErrPeerRefused) {
		return
	}
	if errors.Is(se.Err, io.EOF) || errors.Is(se.Err, io.ErrUnexpectedEOF) ||
		errors.Is(se.Err, syscall.ECONNRESET) || errors.Is(se.Err, syscall.EPIPE) {
		why := fmt.Sprintf("it may refuse this process's uid %d or its handshake", os.Geteuid())
		if mt == MemoryFile {
			why += fmt.Sprintf(", or not open our files in %s: client and server need the same Config.ShmDir", shmDir)
		}
		se.Err = fmt.Errorf("%w (the server closed the connection: %s; see the server's log)", se.Err, why)
	}
}
