package upgrade

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/shmlink/shmlink/internal/sock"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"
)

// fakeListener is the Listener an Upgrader drives, in the test process:
// it records HandOver's epoch, is idle at once, and as an ExtraSender
// returns what extras returns.
type fakeListener struct {
	handedOver chan uint64 // HandOver's epoch

	mu     sync.Mutex
	extras func() ([]net.Listener, func(bool), error)
}

func newFakeListener() *fakeListener {
	return &fakeListener{handedOver: make(chan uint64, 1)}
}

func (f *fakeListener) HandOver(epoch uint64) <-chan struct{} {
	f.handedOver <- epoch
	idle := make(chan struct{})
	close(idle)
	return idle
}

func (f *fakeListener) Drained() int { return 0 }

func (f *fakeListener) Extras() ([]net.Listener, func(bool), error) {
	f.mu.Lock()
	extras := f.extras
	f.mu.Unlock()
	return extras()
}

func (f *fakeListener) setExtras(extras func() ([]net.Listener, func(bool), error)) {
	f.mu.Lock()
	f.extras = extras
	f.mu.Unlock()
}

// testConfig returns the Config of a "unix" listener in a directory of
// the test's own.
func testConfig(t *testing.T) Config {
	dir := t.TempDir()
	return Config{
		Path:         filepath.Join(dir, "upgrade.sock"),
		Network:      "unix",
		Address:      filepath.Join(dir, "s.sock"),
		DrainTimeout: 10 * time.Second,
	}
}

// listenFirst makes the first generation of cfg, as the root package's
// Listen does.
func listenFirst(t *testing.T, cfg Config) (net.Listener, *Upgrader) {
	t.Helper()
	ln, u, err := Listen(cfg, func() (net.Listener, error) { return sock.ListenUnix(cfg.Address, 0o600) })
	require.NoError(t, err)
	return ln, u
}

// requireAccepts checks that ln accepts a connection dialed to address.
func requireAccepts(t *testing.T, ln net.Listener, address string) {
	t.Helper()
	c, err := net.Dial("unix", address)
	require.NoError(t, err)
	defer c.Close()
	ac, err := ln.Accept()
	require.NoError(t, err)
	ac.Close()
}

// When the sockets handed over beside the listener cannot be made (a
// "quic" listener's forwarding pair, here EMFILE), the old process refuses
// the request (reason 3), serves on, and grants the next request; the new
// process gets ErrHandoverFailed. It died of a nil-pointer panic: the
// failed Extras left its done func nil, and grant called it.
func TestUpgradeExtrasFailRefuses(t *testing.T) {
	cfg := testConfig(t)
	cfg.Extras = 1
	ln, a := listenFirst(t, cfg)
	defer ln.Close()
	fl := newFakeListener()
	fl.setExtras(func() ([]net.Listener, func(bool), error) {
		return nil, nil, os.NewSyscallError("socketpair", syscall.EMFILE)
	})
	a.Start(fl)
	defer a.Close()

	_, _, err := TakeOver(context.Background(), cfg, nil)
	require.ErrorIs(t, err, ErrHandoverFailed)
	require.ErrorContains(t, err, "could not make the sockets to hand over")
	requireAccepts(t, ln, cfg.Address)
	select {
	case <-fl.handedOver:
		t.Fatal("the old process handed over")
	default:
	}

	// The next request, once the sockets can be made, is granted (a nil
	// done is not called either).
	extra, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	defer extra.Close()
	fl.setExtras(func() ([]net.Listener, func(bool), error) { return []net.Listener{extra}, nil, nil })
	ln2, b, err := TakeOver(context.Background(), cfg, nil)
	require.NoError(t, err)
	defer ln2.Close()
	require.Equal(t, uint64(1), b.Epoch())
	require.Len(t, b.Received(), 1)
	defer b.Received()[0].Close()
	b.Start(newFakeListener())
	defer b.Close()
	require.Equal(t, uint64(1), <-fl.handedOver)
	select {
	case <-a.Upgraded():
	case <-time.After(10 * time.Second):
		t.Fatal("the old generation did not drain")
	}
}

// socketFd returns the descriptor of c, a socket, for use while c is open.
func socketFd(t *testing.T, c syscall.Conn) int {
	t.Helper()
	rc, err := c.SyscallConn()
	require.NoError(t, err)
	var fd int
	require.NoError(t, rc.Control(func(f uintptr) { fd = int(f) }))
	return fd
}

// openFds counts this process's open descriptors.
func openFds(t *testing.T) int {
	t.Helper()
	entries, err := os.ReadDir("/proc/self/fd")
	require.NoError(t, err)
	return len(entries)
}

// A connected socket sent in place of the listening socket, or of the
// upgrade socket, is refused before ready, with an error that says so,
// and nothing received stays open. net.FileListener took it: the new
// process sent ready, and its Accept then failed with EINVAL.
func TestUpgradeRefusesConnectedSocket(t *testing.T) {
	for _, bad := range []int{0, 1} {
		t.Run(fmt.Sprintf("descriptor %d", bad), func(t *testing.T) {
			cfg := testConfig(t)
			uln, err := sock.ListenUnix(cfg.Path, 0o600) // a fake old process's
			require.NoError(t, err)
			defer uln.Close()
			ln, err := sock.ListenUnix(cfg.Address, 0o600)
			require.NoError(t, err)
			defer ln.Close()
			conn, err := net.Dial("unix", cfg.Address)
			require.NoError(t, err)
			defer conn.Close()
			peer, err := ln.Accept()
			require.NoError(t, err)
			defer peer.Close()
			fds := []int{socketFd(t, ln), socketFd(t, uln)} // valid while they are open
			// The accepted end: its address is the listener's, so it
			// passes checkReceived.
			fds[bad] = socketFd(t, peer.(*net.UnixConn))
			before := openFds(t)

			// What the fake old process read after the sockets, once it
			// has closed its connection.
			answer := make(chan error, 1)
			go func() {
				c, err := uln.AcceptUnix()
				if err != nil {
					answer <- err
					return
				}
				_, err = readOp(c, opRequest)
				if err == nil {
					err = writeFrame(c, opGrant, 1)
				}
				if err == nil {
					_, _, err = c.WriteMsgUnix([]byte{0}, unix.UnixRights(fds...), nil)
				}
				if err == nil {
					_, _, err = readFrame(c)
				}
				c.Close()
				answer <- err
			}()
			_, _, err = TakeOver(context.Background(), cfg, nil)
			require.ErrorIs(t, err, sock.ErrNotListening)
			require.ErrorContains(t, err, fmt.Sprintf("descriptor %d received", bad))
			require.ErrorIs(t, <-answer, io.EOF, "the new process closes without ready")
			require.Equal(t, before, openFds(t), "descriptors left open")
		})
	}
}

// recordHandler is a slog.Handler that passes the records to a channel.
type recordHandler struct{ ch chan slog.Record }

func (h recordHandler) Enabled(context.Context, slog.Level) bool { return true }
func (h recordHandler) Handle(_ context.Context, r slog.Record) error {
	select {
	case h.ch <- r:
	default:
	}
	return nil
}
func (h recordHandler) WithAttrs([]slog.Attr) slog.Handler { return h }
func (h recordHandler) WithGroup(string) slog.Handler      { return h }

// An upgrade socket whose accept fails for good (EINVAL: it is not
// listening) is logged once as an error, and serving it stops; it was
// logged as a warning every 100 ms for ever.
func TestUpgradeServeStopsOnLastingError(t *testing.T) {
	cfg := testConfig(t)
	logs := recordHandler{make(chan slog.Record, 64)}
	cfg.Logger = slog.New(logs)
	ln, err := sock.ListenUnix(cfg.Address, 0o600)
	require.NoError(t, err)
	defer ln.Close()
	conn, err := net.Dial("unix", cfg.Address)
	require.NoError(t, err)
	defer conn.Close()
	f, err := conn.(*net.UnixConn).File()
	require.NoError(t, err)
	notListening, err := net.FileListener(f) // takes a connected socket
	f.Close()
	require.NoError(t, err)
	u := newUpgrader(cfg, notListening.(*net.UnixListener), ln, 0, stateServing)
	u.Start(newFakeListener())
	defer u.Close()

	select {
	case r := <-logs.ch:
		require.Equal(t, slog.LevelError, r.Level, "first record: %s", r.Message)
		require.Contains(t, r.Message, "no upgrade is possible")
	case <-time.After(10 * time.Second):
		t.Fatal("nothing logged")
	}
	served := make(chan struct{})
	go func() { u.wg.Wait(); close(served) }()
	select {
	case <-served:
	case <-time.After(10 * time.Second):
		t.Fatal("the upgrade socket is still served")
	}
	require.Empty(t, logs.ch, "logged again")
}

// requireServes checks that the sockets of the generation of ln serve:
// ln accepts, and the upgrade socket's file takes a connection.
func requireServes(t *testing.T, cfg Config, ln net.Listener) {
	t.Helper()
	requireAccepts(t, ln, cfg.Address)
	c, err := net.Dial("unix", cfg.Path)
	require.NoError(t, err, "the upgrade socket")
	c.Close()
}

// closeAndListenAfresh closes generation a without a handover, as
// Listener.Close does (Stop, then the listening socket), and listens
// afresh at cfg's paths, as a new process that finds no owner does.
func closeAndListenAfresh(t *testing.T, cfg Config, lnA net.Listener, a *Upgrader) (net.Listener, *Upgrader) {
	t.Helper()
	a.Stop()
	require.NoError(t, lnA.Close())
	_, _, err := TakeOver(context.Background(), cfg, nil)
	require.ErrorIs(t, err, ErrNoOwner)
	return listenFirst(t, cfg)
}

// closeLast closes the last generation, u, and checks that it removed
// both socket files.
func closeLast(t *testing.T, cfg Config, ln net.Listener, u *Upgrader) {
	t.Helper()
	u.Stop()
	require.NoError(t, ln.Close())
	u.Close()
	require.NoFileExists(t, cfg.Path)
	require.NoFileExists(t, cfg.Address)
}

// pendingGrant starts a generation a that has granted a request of a
// TakeOver and waits in Extras for an error from fail before it answers;
// granted receives TakeOver's error. It returns once a has granted.
func pendingGrant(t *testing.T) (cfg Config, lnA net.Listener, a *Upgrader, fail chan<- error, granted <-chan error) {
	t.Helper()
	cfg = testConfig(t)
	cfg.Extras = 1
	lnA, a = listenFirst(t, cfg)
	fl := newFakeListener()
	making := make(chan struct{})
	failc := make(chan error)
	fl.setExtras(func() ([]net.Listener, func(bool), error) {
		close(making)
		return nil, nil, <-failc
	})
	a.Start(fl)
	grantedc := make(chan error, 1)
	go func() {
		_, _, err := TakeOver(context.Background(), cfg, nil)
		grantedc <- err
	}()
	<-making // a granted the request, and has sent nothing yet
	return cfg, lnA, a, failc, grantedc
}

// A generation that closes without handing over leaves the socket files of
// a process that listened afresh meanwhile (its sockets closed, so that
// process removed their files as stale and bound its own): with no grant
// pending, Stop removes the files while the sockets still listen; with
// one, Close removes them after a failed handover only if the paths still
// name the files it had. Close removed both paths in both cases: the new
// process's files were gone.
func TestUpgradeCloseKeepsNewFiles(t *testing.T) {
	t.Run("no grant", func(t *testing.T) {
		cfg := testConfig(t)
		lnA, a := listenFirst(t, cfg)
		a.Start(newFakeListener())
		lnB, b := closeAndListenAfresh(t, cfg, lnA, a)
		a.Close()
		requireServes(t, cfg, lnB)

		closeLast(t, cfg, lnB, b)
	})
	t.Run("grant pending", func(t *testing.T) {
		cfg, lnA, a, fail, granted := pendingGrant(t)
		lnB, b := closeAndListenAfresh(t, cfg, lnA, a)
		fds := openFds(t)
		fail <- syscall.EMFILE
		require.ErrorIs(t, <-granted, ErrHandoverFailed)
		a.Close()
		requireServes(t, cfg, lnB)
		require.Less(t, openFds(t), fds, "a's references to its files closed")

		closeLast(t, cfg, lnB, b)
	})
	t.Run("grant pending, own files", func(t *testing.T) {
		// Nobody took the paths: a's Close removes its files.
		cfg, lnA, a, fail, granted := pendingGrant(t)
		a.Stop()
		require.NoError(t, lnA.Close())
		require.FileExists(t, cfg.Path, "the answer decides")
		fail <- syscall.EMFILE
		require.ErrorIs(t, <-granted, ErrHandoverFailed)
		a.Close()
		require.NoFileExists(t, cfg.Path)
		require.NoFileExists(t, cfg.Address)
	})
}
