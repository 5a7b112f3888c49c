package main

import (
	"context"
	"net"
	"os"
	"path/filepath"
	"runtime"
	"sync"
	"testing"
	"time"

	"github.com/shmlink/shmlink"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/protobuf/types/known/wrapperspb"
)

// grpc.Server.GracefulStop over a shmlink Listener lets a call in flight
// finish (#15: closing the listener ended its sessions, and the call
// failed while GracefulStop returned), and the listener's sessions end
// once their streams are done.
func TestGracefulStopFinishesInFlight(t *testing.T) {
	sock := filepath.Join(t.TempDir(), "grpc.sock")
	ln, err := (&shmlink.ListenConfig{}).Listen(context.Background(), "unix", sock)
	require.NoError(t, err)
	entered, release := make(chan struct{}), make(chan struct{})
	var once sync.Once
	srv := grpc.NewServer(grpc.UnaryInterceptor(func(ctx context.Context, req any, _ *grpc.UnaryServerInfo, h grpc.UnaryHandler) (any, error) {
		once.Do(func() { close(entered) })
		<-release // the call is in flight until the test lets it go
		return h(ctx, req)
	}))
	srv.RegisterService(&echoServiceDesc, &echoService{})
	served := make(chan error, 1)
	go func() { served <- srv.Serve(ln) }()

	var d shmlink.Dialer
	defer d.Close()
	cc, err := grpc.NewClient("passthrough:///shmlink",
		grpc.WithContextDialer(func(ctx context.Context, _ string) (net.Conn, error) {
			return d.DialContext(ctx, "unix", sock)
		}),
		grpc.WithTransportCredentials(insecure.NewCredentials()))
	require.NoError(t, err)
	defer cc.Close()
	reply := make(chan error, 1)
	go func() {
		out, err := echoClient{cc}.Echo(context.Background(), wrapperspb.Bytes([]byte("in flight")))
		if err == nil {
			err = check(out.GetValue(), []byte("in flight"))
		}
		reply <- err
	}()
	<-entered

	stopped := make(chan struct{})
	go func() { srv.GracefulStop(); close(stopped) }()
	for {
		// GracefulStop closes the listener first, which removes its socket.
		if _, err := os.Stat(sock); os.IsNotExist(err) {
			break
		}
		runtime.Gosched()
	}
	close(release)
	require.NoError(t, <-reply, "the call in flight")
	<-stopped
	require.NoError(t, <-served)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	require.NoError(t, ln.Shutdown(ctx), "the sessions end once their streams are closed")
	require.Zero(t, ln.NumSessions())
}
