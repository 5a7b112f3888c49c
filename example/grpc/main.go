// Command grpc runs gRPC over shmlink between two processes.
//
//	cd example/grpc && go run .
//
// The program is the server process: it serves a hand-written Echo service
// (see service.go; no protoc needed) with a grpc.Server on a shmlink
// listener over a Unix socket in a temporary directory, and starts a copy
// of itself as the client process. The client reaches the server through
// grpc.NewClient with a shmlink.Dialer as its context dialer, so all of
// gRPC's HTTP/2 traffic goes through shared memory. It makes unary calls
// with 64 B and 1 MiB payloads, one server-streaming call and one
// bidirectional streaming call, checks every byte it gets back, and prints
// the counts and latencies. Then the server stops gracefully, prints what
// it served and removes the temporary directory. The exit status is 1 on
// any mismatch or error, in either process.
//
// This example is its own Go module, so that the shmlink module does not
// depend on gRPC.
package main

import (
	"bytes"
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/protobuf/types/known/wrapperspb"

	"github.com/shmlink/shmlink"
)

// Sizes of the unary calls' payloads, in bytes.
const (
	smallSize = 64
	largeSize = 1 << 20
)

// Time limits of a run.
const (
	// clientTimeout bounds all of the client's calls.
	clientTimeout = 2 * time.Minute
	// stopTimeout bounds the server's GracefulStop, after which it stops
	// hard and reports an error.
	stopTimeout = 10 * time.Second
)

// errMismatch is returned by the client when a message it got back is not
// the one it expected.
var errMismatch = errors.New("bytes differ")

// load is what the client process does.
type load struct {
	small    int // unary calls with a smallSize payload
	large    int // unary calls with a largeSize payload
	messages int // messages of the server-streaming call
	echoes   int // round trips of the bidirectional streaming call
}

// args returns the flags that give a client process l.
func (l load) args() []string {
	return []string{
		"-small", strconv.Itoa(l.small),
		"-large", strconv.Itoa(l.large),
		"-messages", strconv.Itoa(l.messages),
		"-echoes", strconv.Itoa(l.echoes),
	}
}

// options are the example's command line.
type options struct {
	client string // the server's socket path when running as the client
	load
}

// register defines the flags of o on fs.
func (o *options) register(fs *flag.FlagSet) {
	fs.StringVar(&o.client, "client", "", "run as the client of the server on this Unix socket path (used by the example itself)")
	fs.IntVar(&o.small, "small", 1000, "unary calls with a 64 B payload")
	fs.IntVar(&o.large, "large", 20, "unary calls with a 1 MiB payload")
	fs.IntVar(&o.messages, "messages", 100, "messages of the server-streaming call")
	fs.IntVar(&o.echoes, "echoes", 100, "round trips of the bidirectional streaming call")
}

func main() {
	var o options
	o.register(flag.CommandLine)
	flag.Parse()
	if o.client != "" {
		if err := runClient(os.Stdout, o.client, o.load); err != nil {
			fmt.Fprintln(os.Stderr, "grpc client:", err)
			os.Exit(1)
		}
		return
	}
	exe, err := os.Executable()
	if err == nil {
		var svc echoService
		err = runServer(os.Stdout, "", &svc, func(sock string) *exec.Cmd {
			cmd := exec.Command(exe, append([]string{"-client", sock}, o.args()...)...)
			cmd.Stdout = os.Stdout
			cmd.Stderr = os.Stderr
			return cmd
		})
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "grpc:", err)
		os.Exit(1)
	}
}

// runServer serves svc, with opts, on a shmlink listener over a Unix socket
// in a new temporary directory under parent ("" means os.TempDir()), and
// runs the command that client returns for the socket path as the client
// process. When that exits it stops the server gracefully, prints what the
// server served to w and removes the directory. It returns the client's,
// the server's and the clean-up's errors.
func runServer(w io.Writer, parent string, svc *echoService, client func(sock string) *exec.Cmd, opts ...grpc.ServerOption) (err error) {
	dir, err := os.MkdirTemp(parent, "shmlink-grpc-")
	if err != nil {
		return err
	}
	defer func() { err = errors.Join(err, os.RemoveAll(dir)) }()
	sock := filepath.Join(dir, "grpc.sock")

	ln, err := shmlink.Listen("unix", sock)
	if err != nil {
		return err
	}
	srv := grpc.NewServer(opts...)
	srv.RegisterService(&echoServiceDesc, svc)
	served := make(chan error, 1)
	go func() { served <- srv.Serve(ln) }()
	fmt.Fprintf(w, "server pid %d: gRPC on shmlink, socket %s\n", os.Getpid(), sock)

	var clientErr error
	if err := client(sock).Run(); err != nil {
		clientErr = fmt.Errorf("client process: %w", err)
	}
	// GracefulStop closes the listener, which stops accepting and
	// nothing more, then waits for the calls in flight to finish
	// (TestGracefulStopFinishesInFlight).
	stopErr := stopGracefully(srv, stopTimeout)
	serveErr := <-served
	if serveErr != nil {
		serveErr = fmt.Errorf("serve: %w", serveErr)
	}
	fmt.Fprintf(w, "server: %d unary calls, %d streaming calls, %d messages streamed, %d echoed; stopped gracefully\n",
		svc.unary.Load(), svc.streams.Load(), svc.messages.Load(), svc.echoes.Load())
	return errors.Join(clientErr, stopErr, serveErr)
}

// stopGracefully runs srv.GracefulStop; if that takes longer than timeout
// it stops srv hard and returns an error.
func stopGracefully(srv *grpc.Server, timeout time.Duration) error {
	done := make(chan struct{})
	go func() {
		srv.GracefulStop()
		close(done)
	}()
	t := time.NewTimer(timeout)
	defer t.Stop()
	select {
	case <-done:
		return nil
	case <-t.C:
		srv.Stop()
		<-done
		return fmt.Errorf("GracefulStop took longer than %v", timeout)
	}
}

// runClient connects to the server on the Unix socket path sock, makes the
// calls of l, checks every byte and prints counts and latencies to w.
func runClient(w io.Writer, sock string, l load) error {
	ctx, cancel := context.WithTimeout(context.Background(), clientTimeout)
	defer cancel()

	var d shmlink.Dialer
	defer d.Close()
	cc, err := grpc.NewClient("passthrough:///shmlink",
		grpc.WithContextDialer(func(ctx context.Context, _ string) (net.Conn, error) {
			return d.DialContext(ctx, "unix", sock)
		}),
		grpc.WithTransportCredentials(insecure.NewCredentials()),
	)
	if err != nil {
		return err
	}
	defer cc.Close()
	c := echoClient{cc}

	fmt.Fprintf(w, "client pid %d: grpc.NewClient with a shmlink.Dialer\n", os.Getpid())
	fmt.Fprintf(w, "%-16s %8s %10s %10s %10s\n", "call", "count", "p50", "p99", "max")
	if err := unary(ctx, w, c, smallSize, l.small); err != nil {
		return err
	}
	if err := unary(ctx, w, c, largeSize, l.large); err != nil {
		return err
	}
	if err := generate(ctx, w, c, l.messages); err != nil {
		return err
	}
	if err := echoStream(ctx, w, c, l.echoes); err != nil {
		return err
	}
	fmt.Fprintln(w, "client: ok, every byte checked")
	return nil
}

// unary makes n Echo calls with size-byte payloads and checks every echo.
func unary(ctx context.Context, w io.Writer, c echoClient, size, n int) error {
	name := "unary " + human(size)
	lat := make([]time.Duration, 0, n)
	for i := range n {
		want := payload(i, size)
		start := time.Now()
		resp, err := c.Echo(ctx, wrapperspb.Bytes(want))
		if err != nil {
			return fmt.Errorf("%s call %d: %w", name, i, err)
		}
		lat = append(lat, time.Since(start))
		if err := check(resp.GetValue(), want); err != nil {
			return fmt.Errorf("%s call %d: %w", name, i, err)
		}
	}
	report(w, name, lat)
	return nil
}

// generate makes one Generate call for n messages and checks each; the
// latencies printed are the times between messages.
func generate(ctx context.Context, w io.Writer, c echoClient, n int) error {
	name := "server stream"
	start := time.Now()
	stream, err := c.Generate(ctx, wrapperspb.UInt32(uint32(n)))
	if err != nil {
		return fmt.Errorf("%s: %w", name, err)
	}
	lat := make([]time.Duration, 0, n)
	for i := 0; ; i++ {
		msg, err := stream.Recv()
		if errors.Is(err, io.EOF) && i == n {
			break
		}
		if err != nil {
			return fmt.Errorf("%s message %d of %d: %w", name, i, n, err)
		}
		now := time.Now()
		lat = append(lat, now.Sub(start))
		start = now
		if i == n {
			return fmt.Errorf("%s: more than %d messages", name, n)
		}
		if err := check(msg.GetValue(), payload(i, messageSize(i))); err != nil {
			return fmt.Errorf("%s message %d: %w", name, i, err)
		}
	}
	report(w, name, lat)
	return nil
}

// echoStream makes one EchoStream call with n round trips and checks every
// echo, then that the server ends the call after the client's side closes.
func echoStream(ctx context.Context, w io.Writer, c echoClient, n int) error {
	name := "bidi stream"
	stream, err := c.EchoStream(ctx)
	if err != nil {
		return fmt.Errorf("%s: %w", name, err)
	}
	lat := make([]time.Duration, 0, n)
	for i := range n {
		want := payload(i, messageSize(i))
		start := time.Now()
		if err := stream.Send(wrapperspb.Bytes(want)); err != nil {
			if errors.Is(err, io.EOF) { // the call ended: Recv has its status
				_, err = stream.Recv()
			}
			return fmt.Errorf("%s send %d: %w", name, i, err)
		}
		resp, err := stream.Recv()
		if err != nil {
			return fmt.Errorf("%s echo %d: %w", name, i, err)
		}
		lat = append(lat, time.Since(start))
		if err := check(resp.GetValue(), want); err != nil {
			return fmt.Errorf("%s echo %d: %w", name, i, err)
		}
	}
	if err := stream.CloseSend(); err != nil {
		return fmt.Errorf("%s: %w", name, err)
	}
	if _, err := stream.Recv(); !errors.Is(err, io.EOF) {
		return fmt.Errorf("%s after %d echoes: got %v, want the end of the call", name, n, err)
	}
	report(w, name, lat)
	return nil
}

// check returns nil if got equals want, and an error wrapping errMismatch
// that locates the first difference otherwise.
func check(got, want []byte) error {
	if bytes.Equal(got, want) {
		return nil
	}
	i := 0
	for i < min(len(got), len(want)) && got[i] == want[i] {
		i++
	}
	return fmt.Errorf("%w: got %d bytes, want %d, first difference at byte %d", errMismatch, len(got), len(want), i)
}

// report prints one line of the client's table: the count and latency
// percentiles of lat.
func report(w io.Writer, name string, lat []time.Duration) {
	if len(lat) == 0 {
		fmt.Fprintf(w, "%-16s %8d\n", name, 0)
		return
	}
	slices.Sort(lat)
	fmt.Fprintf(w, "%-16s %8d %10v %10v %10v\n", name, len(lat),
		round(lat[len(lat)/2]), round(lat[len(lat)*99/100]), round(lat[len(lat)-1]))
}

// round rounds d to a precision that suits a table of latencies.
func round(d time.Duration) time.Duration {
	if d >= time.Millisecond {
		return d.Round(10 * time.Microsecond)
	}
	return d.Round(100 * time.Nanosecond)
}

// human formats a size in bytes.
func human(n int) string {
	switch {
	case n >= 1<<20:
		return fmt.Sprintf("%dMiB", n>>20)
	case n >= 1<<10:
		return fmt.Sprintf("%dKiB", n>>10)
	}
	return fmt.Sprintf("%dB", n)
}
