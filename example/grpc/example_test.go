package main

import (
	"context"
	"fmt"
	"log"
	"net"
	"os"
	"path/filepath"

	"github.com/shmlink/shmlink"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/protobuf/types/known/wrapperspb"
)

// gRPC over shmlink: the server serves on a shmlink Listener; the client
// gives grpc.NewClient a passthrough target and a context dialer that
// dials with a shmlink.Dialer, which pools the sessions.
// GracefulStop finishes the calls in flight.
func Example_grpc() {
	dir, err := os.MkdirTemp("", "shmlink-grpc-example-")
	if err != nil {
		log.Fatal(err)
	}
	defer os.RemoveAll(dir)
	sock := filepath.Join(dir, "grpc.sock")

	ln, err := shmlink.Listen("unix", sock)
	if err != nil {
		log.Fatal(err)
	}
	srv := grpc.NewServer()
	srv.RegisterService(&echoServiceDesc, &echoService{})
	go srv.Serve(ln)
	defer srv.GracefulStop()

	var d shmlink.Dialer
	defer d.Close()
	cc, err := grpc.NewClient("passthrough:///shmlink", // no name resolution
		grpc.WithContextDialer(func(ctx context.Context, _ string) (net.Conn, error) {
			return d.DialContext(ctx, "unix", sock)
		}),
		grpc.WithTransportCredentials(insecure.NewCredentials()), // one host, no TLS
	)
	if err != nil {
		log.Fatal(err)
	}
	defer cc.Close()
	out, err := echoClient{cc}.Echo(context.Background(), wrapperspb.Bytes([]byte("ping")))
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println(string(out.GetValue()))
	// Output: ping
}
