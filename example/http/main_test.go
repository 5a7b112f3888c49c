package main

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"sync/atomic"
	"testing"

	"github.com/shmlink/shmlink"
	"github.com/stretchr/testify/require"
)

// The test binary re-executes itself as the server process when this
// variable names the server's directory (the pattern of
// go/src/internal/fuzz/worker_test.go).
const serverEnv = "SHMLINK_EXAMPLE_HTTP_SERVE"

func TestMain(m *testing.M) {
	if dir := os.Getenv(serverEnv); dir != "" {
		if err := runServer(dir, os.Stdin, os.Stdout); err != nil {
			fmt.Fprintln(os.Stderr, "server:", err)
			os.Exit(1)
		}
		os.Exit(0)
	}
	os.Exit(m.Run())
}

// The example's whole exchange, two processes as with go run: the client
// checks every response and the server's clean shutdown, and the temporary
// directory (socket and, for file memory, the shared-memory files) is left
// empty.
func TestExampleRuns(t *testing.T) {
	for _, mt := range []shmlink.MemoryType{shmlink.MemoryAuto, shmlink.MemoryFile} {
		t.Run(mt.String(), func(t *testing.T) {
			var dir string
			var out bytes.Buffer
			err := runClient(&out, mt, func(d string) *exec.Cmd {
				dir = d
				cmd := exec.Command(os.Args[0], "-test.run=^$")
				cmd.Env = append(os.Environ(), serverEnv+"="+d)
				return cmd
			})
			require.NoError(t, err, "output:\n%s", &out)
			for _, want := range []string{
				fmt.Sprintf("%d concurrent responses checked", numGets),
				"10 MiB uploaded",
				"server's sha256 " + patternSHA256(uploadSeed, uploadSize)[:16] + " matches",
				"64 chunks x 64 KiB streamed",
				fmt.Sprintf("server: %d requests, %d bytes hashed, %d bytes streamed; shut down cleanly",
					numGets+2, uploadSize, streamChunks*chunkSize),
				"left empty",
			} {
				require.Contains(t, out.String(), want)
			}
			_, err = os.Stat(dir)
			require.ErrorIs(t, err, os.ErrNotExist, "the client removes its directory")
		})
	}
}

// corrupt wraps h so that the byte at offset off of every response body is
// flipped (none when off is negative), or the response replaced by body
// when body is set.
type corrupt struct {
	h    http.Handler
	off  atomic.Int64
	body atomic.Pointer[string]
}

func (c *corrupt) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if body := c.body.Load(); body != nil {
		io.WriteString(w, *body)
		return
	}
	c.h.ServeHTTP(&flipWriter{ResponseWriter: w, at: int(c.off.Load())}, r)
}

// flipWriter flips the byte at offset at of what is written through it.
type flipWriter struct {
	http.ResponseWriter
	at, off int
}

func (f *flipWriter) Write(p []byte) (int, error) {
	if i := f.at - f.off; i >= 0 && i < len(p) {
		p = bytes.Clone(p)
		p[i] ^= 0x40
	}
	f.off += len(p)
	return f.ResponseWriter.Write(p)
}

// Unwrap lets http.ResponseController reach the Flusher.
func (f *flipWriter) Unwrap() http.ResponseWriter { return f.ResponseWriter }

// The client's checks catch a wrong byte, a wrong hash and a wrong greeting
// (in one process, through a shmlink listener).
func TestClientCatchesCorruption(t *testing.T) {
	dir := t.TempDir()
	lc := shmlink.ListenConfig{Config: &shmlink.Config{ShmDir: dir}}
	ln, err := lc.Listen(context.Background(), "unix", filepath.Join(dir, sockName))
	require.NoError(t, err)
	var stats serverStats
	handler := &corrupt{h: newHandler(&stats)}
	srv := &http.Server{Handler: handler}
	go srv.Serve(ln)
	defer srv.Close()

	d := &shmlink.Dialer{Config: &shmlink.Config{ShmDir: dir}}
	defer d.Close()
	tr := &http.Transport{DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
		return d.DialContext(ctx, "unix", ln.Addr().String())
	}}
	defer tr.CloseIdleConnections()
	c := &http.Client{Transport: tr, Timeout: timeout}
	const base = "http://shmlink"

	handler.off.Store(-1) // nothing to flip: the checks pass
	require.NoError(t, checkStream(c, base))
	require.NoError(t, checkHellos(c, base, os.Getpid()))
	_, err = checkUpload(c, base)
	require.NoError(t, err)

	handler.off.Store(3*chunkSize + 5)
	require.ErrorContains(t, checkStream(c, base), fmt.Sprintf("byte %d:", 3*chunkSize+5))
	handler.off.Store(0)
	require.ErrorContains(t, checkHellos(c, base, os.Getpid()), "GET /hello/")
	wrong := fmt.Sprintf("%064x %d\n", 0, uploadSize)
	handler.body.Store(&wrong)
	_, err = checkUpload(c, base)
	require.ErrorContains(t, err, "server says")
}
