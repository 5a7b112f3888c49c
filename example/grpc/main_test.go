package main

import (
	"bytes"
	"context"
	"flag"
	"fmt"
	"os"
	"os/exec"
	"testing"

	"github.com/shmlink/shmlink/internal/peertest"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/protobuf/types/known/wrapperspb"
)

// TestMain runs the test binary as the example's client process when it
// is given -client, as runServer does in the tests, and as the server of
// BenchmarkGRPC in the peertest role benchRole; otherwise it runs the
// tests and benchmarks.
func TestMain(m *testing.M) {
	peertest.Main(map[string]func(peertest.Params) int{benchRole: runBenchServer})
	var o options
	o.register(flag.CommandLine)
	flag.Parse()
	if o.client != "" {
		if err := runClient(os.Stdout, o.client, o.load); err != nil {
			fmt.Fprintln(os.Stderr, "grpc client:", err)
			os.Exit(1)
		}
		os.Exit(0)
	}
	code := m.Run()
	stopBenchServer()
	os.Exit(code)
}

// run runs the example's two processes, with the test binary as the client
// process doing l, and returns the output of both processes, the
// service's counters and runServer's error. It checks that the temporary
// directory is gone.
func run(t *testing.T, l load, opts ...grpc.ServerOption) (string, *echoService, error) {
	t.Helper()
	exe, err := os.Executable()
	require.NoError(t, err)
	parent := t.TempDir()
	var out bytes.Buffer
	var svc echoService
	err = runServer(&out, parent, &svc, func(sock string) *exec.Cmd {
		cmd := exec.Command(exe, append([]string{"-client", sock}, l.args()...)...)
		cmd.Stdout = &out
		cmd.Stderr = &out
		return cmd
	}, opts...)
	left, rerr := os.ReadDir(parent)
	require.NoError(t, rerr)
	require.Empty(t, left, "runServer left its temporary directory")
	return out.String(), &svc, err
}

// The whole exchange, as `go run .` does it but smaller: every call
// succeeds, every byte is checked, and the server served exactly what the
// client asked for before it stopped gracefully.
func TestTwoProcesses(t *testing.T) {
	if testing.Short() {
		t.Skip("runs two processes")
	}
	l := load{small: 200, large: 8, messages: 100, echoes: 100}
	out, svc, err := run(t, l)
	require.NoError(t, err, out)
	t.Log("\n" + out)
	require.Contains(t, out, "client: ok, every byte checked")
	require.Contains(t, out, "stopped gracefully")
	for _, row := range []string{"unary 64B", "unary 1MiB", "server stream", "bidi stream"} {
		require.Contains(t, out, row)
	}
	require.EqualValues(t, l.small+l.large, svc.unary.Load(), "unary calls served")
	require.EqualValues(t, l.messages, svc.messages.Load(), "messages streamed")
	require.EqualValues(t, l.echoes, svc.echoes.Load(), "messages echoed")
	require.EqualValues(t, 2, svc.streams.Load(), "streaming calls finished")
}

// A server that changes one byte of a 1 MiB echo makes the client process
// fail with the place of the difference, and the example with it.
func TestMismatchFails(t *testing.T) {
	if testing.Short() {
		t.Skip("runs two processes")
	}
	corrupt := grpc.UnaryInterceptor(func(ctx context.Context, req any, _ *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
		resp, err := handler(ctx, req)
		if b, ok := resp.(*wrapperspb.BytesValue); ok && len(b.Value) == largeSize {
			b.Value[largeSize/2] ^= 1
		}
		return resp, err
	})
	out, svc, err := run(t, load{small: 5, large: 2, messages: 10, echoes: 10}, corrupt)
	var exit *exec.ExitError
	require.ErrorAs(t, err, &exit, out)
	require.Equal(t, 1, exit.ExitCode(), out)
	require.Contains(t, out, fmt.Sprintf("unary 1MiB call 0: bytes differ: got %d bytes, want %d, first difference at byte %d",
		largeSize, largeSize, largeSize/2))
	require.NotContains(t, out, "every byte checked")
	require.Contains(t, out, "stopped gracefully")
	require.EqualValues(t, 6, svc.unary.Load(), "the client stops at the first mismatch")
}

// check finds the first difference, including a length difference.
func TestCheck(t *testing.T) {
	for _, tc := range []struct {
		got, want string
		diff      int // first difference, or -1 for none
	}{
		{"", "", -1},
		{"abc", "abc", -1},
		{"abd", "abc", 2},
		{"ab", "abc", 2},
		{"abcd", "abc", 3},
		{"", "a", 0},
	} {
		err := check([]byte(tc.got), []byte(tc.want))
		if tc.diff < 0 {
			require.NoError(t, err, "%q %q", tc.got, tc.want)
			continue
		}
		require.ErrorIs(t, err, errMismatch)
		require.ErrorContains(t, err, fmt.Sprintf("got %d bytes, want %d, first difference at byte %d", len(tc.got), len(tc.want), tc.diff))
	}
}

// payload is deterministic, differs between seeds, and a longer payload of
// a seed extends a shorter one.
func TestPayload(t *testing.T) {
	require.Equal(t, payload(7, 1000), payload(7, 1000))
	require.NotEqual(t, payload(7, 1000), payload(8, 1000))
	require.Equal(t, payload(7, 100), payload(7, 1000)[:100])
	require.Len(t, payload(3, 0), 0)
	for i := range 1000 {
		require.True(t, messageSize(i) >= 1 && messageSize(i) <= 16<<10, "messageSize(%d) = %d", i, messageSize(i))
	}
}
