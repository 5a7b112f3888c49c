package upgrade

import (
	"context"
	"net"
	"os"
	"path/filepath"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/shmlink/shmlink/internal/sock"
	"github.com/stretchr/testify/require"
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
