//go:build !linux

package sock

import (
	"net"
	"os"
)

// PeerCred returns ErrUnsupported on this platform.
func PeerCred(c *net.UnixConn) (pid, uid, gid int, err error) { return 0, 0, 0, ErrUnsupported }

// ListenUnix listens on a Unix stream socket at path and then sets the
// file's permission bits to mode. Unlike on Linux, a client may connect in
// between, under the umask's mode.
func ListenUnix(path string, mode os.FileMode) (*net.UnixListener, error) {
	ln, err := net.ListenUnix("unix", &net.UnixAddr{Name: path, Net: "unix"})
	if err != nil || path == "" || path[0] == '@' {
		return ln, err
	}
	if err := os.Chmod(path, mode.Perm()); err != nil {
		ln.Close()
		return nil, &net.OpError{Op: "listen", Net: "unix", Addr: ln.Addr(), Err: err}
	}
	return ln, nil
}

// SendListeners returns ErrUnsupported on this platform.
func SendListeners(c *net.UnixConn, lns ...net.Listener) error { return ErrUnsupported }

// RecvListeners returns ErrUnsupported on this platform.
func RecvListeners(c *net.UnixConn, n int) ([]net.Listener, error) { return nil, ErrUnsupported }

// TCPPeerUID returns ErrUnsupported on this platform.
func TCPPeerUID(local, remote *net.TCPAddr) (int, error) { return 0, ErrUnsupported }
