// Command http runs net/http over shmlink between two processes.
//
//	go run ./example/http
//
// The program starts a copy of itself as the server process: an
// http.Server serving on a shmlink listener on a Unix socket in a temporary
// directory. The first process is the client: an http.Client whose
// Transport dials streams with a shmlink.Dialer. It sends several GETs, a
// 10 MiB upload whose SHA-256 the server computes and returns, and a
// streamed response of 64 flushed chunks of 64 KiB; it checks every
// response, every streamed byte and the hashes, then shuts the server down
// and checks that the temporary directory is empty. It prints what it did
// and exits with status 1 on any mismatch or error.
package main

import (
	"bufio"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/shmlink/shmlink"
)

// What the client sends and the server streams. Both processes derive the
// bytes from pattern, so either side can check them.
const (
	// numGets is the number of concurrent GET /hello/{i} requests.
	numGets = 8
	// uploadSize is the size of the POST /sha256 body, in bytes.
	uploadSize = 10 << 20
	// uploadSeed seeds the pattern of the upload.
	uploadSeed = 1
	// streamChunks is the number of chunks GET /stream flushes.
	streamChunks = 64
	// chunkSize is the size of each streamed chunk, in bytes.
	chunkSize = 64 << 10
	// streamSeed seeds the pattern of the streamed response.
	streamSeed = 2
	// sockName is the name of the Unix socket in the temporary directory.
	sockName = "http.sock"
	// trailerSHA256 is the trailer in which GET /stream sends the SHA-256
	// of its body.
	trailerSHA256 = "X-Body-Sha256"
)

// timeout bounds each HTTP exchange and the server's shutdown; generous,
// for busy machines.
const timeout = 60 * time.Second

func main() {
	serve := flag.String("serve", "", "run as the server in this directory (used by the example itself)")
	memory := flag.String("memory", "auto", "shared memory of the client's sessions: auto, memfd or file")
	flag.Parse()
	mt, err := parseMemory(*memory)
	switch {
	case err != nil:
	case *serve != "":
		err = runServer(*serve, os.Stdin, os.Stdout)
	default:
		var exe string
		if exe, err = os.Executable(); err == nil {
			err = runClient(os.Stdout, mt, func(dir string) *exec.Cmd {
				return exec.Command(exe, "-serve", dir)
			})
		}
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "http:", err)
		os.Exit(1)
	}
}

// parseMemory returns the memory type named s.
func parseMemory(s string) (shmlink.MemoryType, error) {
	for _, mt := range []shmlink.MemoryType{shmlink.MemoryAuto, shmlink.MemoryMemfd, shmlink.MemoryFile} {
		if mt.String() == s {
			return mt, nil
		}
	}
	return 0, fmt.Errorf("unknown memory type %q (want auto, memfd or file)", s)
}

// pattern fills b with the bytes at offset off of the sequence seeded by
// seed. Every byte depends on its position, so a lost, repeated or
// reordered chunk is caught.
func pattern(b []byte, seed uint64, off int) {
	for i := range b {
		x := uint64(off+i)*0x9E3779B97F4A7C15 + seed
		b[i] = byte(x >> 56)
	}
}

// checkPattern returns an error naming the first byte of b that differs
// from the pattern at offset off.
func checkPattern(b []byte, seed uint64, off int) error {
	want := make([]byte, len(b))
	pattern(want, seed, off)
	for i := range b {
		if b[i] != want[i] {
			return fmt.Errorf("byte %d: got %#x, want %#x", off+i, b[i], want[i])
		}
	}
	return nil
}

// patternReader reads n bytes of the pattern seeded by seed.
type patternReader struct {
	seed   uint64
	off, n int
}

// Read fills p with the next bytes of the pattern.
func (r *patternReader) Read(p []byte) (int, error) {
	if r.off == r.n {
		return 0, io.EOF
	}
	p = p[:min(len(p), r.n-r.off)]
	pattern(p, r.seed, r.off)
	r.off += len(p)
	return len(p), nil
}

// patternSHA256 returns the hex SHA-256 of the first n bytes of the
// pattern seeded by seed.
func patternSHA256(seed uint64, n int) string {
	h := sha256.New()
	io.Copy(h, &patternReader{seed: seed, n: n})
	return hex.EncodeToString(h.Sum(nil))
}

// serverStats counts what the server handled.
type serverStats struct {
	requests atomic.Int64
	hashed   atomic.Int64 // bytes of uploads
	streamed atomic.Int64 // bytes of streamed responses
}

// newHandler returns the server's routes:
//
//	GET /hello/{name}  "hello, {name}, from pid {pid}\n"
//	POST /sha256       the hex SHA-256 and the size of the body: "{hex} {n}\n"
//	GET /stream        streamChunks flushed chunks of the streamSeed pattern,
//	                   with the body's SHA-256 in the trailerSHA256 trailer
func newHandler(stats *serverStats) http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("GET /hello/{name}", func(w http.ResponseWriter, r *http.Request) {
		stats.requests.Add(1)
		fmt.Fprintf(w, "hello, %s, from pid %d\n", r.PathValue("name"), os.Getpid())
	})
	mux.HandleFunc("POST /sha256", func(w http.ResponseWriter, r *http.Request) {
		stats.requests.Add(1)
		h := sha256.New()
		n, err := io.Copy(h, r.Body)
		if err != nil {
			http.Error(w, "reading body: "+err.Error(), http.StatusBadRequest)
			return
		}
		stats.hashed.Add(n)
		fmt.Fprintf(w, "%x %d\n", h.Sum(nil), n)
	})
	mux.HandleFunc("GET /stream", func(w http.ResponseWriter, r *http.Request) {
		stats.requests.Add(1)
		rc := http.NewResponseController(w)
		w.Header().Set("Trailer", trailerSHA256)
		w.Header().Set("Content-Type", "application/octet-stream")
		h := sha256.New()
		chunk := make([]byte, chunkSize)
		for i := range streamChunks {
			pattern(chunk, streamSeed, i*chunkSize)
			h.Write(chunk)
			if _, err := w.Write(chunk); err != nil {
				return // the client went away
			}
			if err := rc.Flush(); err != nil {
				return
			}
			stats.streamed.Add(chunkSize)
		}
		w.Header().Set(trailerSHA256, hex.EncodeToString(h.Sum(nil)))
	})
	return mux
}

// runServer serves HTTP on a shmlink listener on the socket in dir, prints
// "ready" to out, and shuts the server down when stop reaches EOF (the
// client closes our standard input). It then prints what it served.
func runServer(dir string, stop io.Reader, out io.Writer) error {
	lc := shmlink.ListenConfig{Config: &shmlink.Config{ShmDir: dir}}
	ln, err := lc.Listen(context.Background(), "unix", filepath.Join(dir, sockName))
	if err != nil {
		return err
	}
	var stats serverStats
	srv := &http.Server{Handler: newHandler(&stats), ReadHeaderTimeout: timeout}
	served := make(chan error, 1)
	go func() { served <- srv.Serve(ln) }()
	fmt.Fprintln(out, "ready")

	io.Copy(io.Discard, stop)
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	if err := srv.Shutdown(ctx); err != nil {
		srv.Close()
		return fmt.Errorf("shutdown: %w", err)
	}
	if err := <-served; !errors.Is(err, http.ErrServerClosed) {
		return fmt.Errorf("serve: %w", err)
	}
	fmt.Fprintf(out, "server: %d requests, %d bytes hashed, %d bytes streamed; shut down cleanly\n",
		stats.requests.Load(), stats.hashed.Load(), stats.streamed.Load())
	return nil
}

// runClient creates a temporary directory, starts the server process made
// by serverCmd for it, runs the exchange through an HTTP client on a
// shmlink.Dialer with memory type mt, stops the server and checks that the
// directory is left empty. It prints to out what it did.
func runClient(out io.Writer, mt shmlink.MemoryType, serverCmd func(dir string) *exec.Cmd) error {
	dir, err := os.MkdirTemp("", "shmlink-http-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)
	sock := filepath.Join(dir, sockName)

	server := serverCmd(dir)
	server.Stderr = os.Stderr
	stdin, err := server.StdinPipe()
	if err != nil {
		return err
	}
	stdout, err := server.StdoutPipe()
	if err != nil {
		return err
	}
	if err := server.Start(); err != nil {
		return err
	}
	waited := false
	defer func() {
		if !waited {
			stdin.Close()
			server.Wait()
		}
	}()
	serverOut := bufio.NewReader(stdout)
	if line, err := serverOut.ReadString('\n'); err != nil || line != "ready\n" {
		return fmt.Errorf("server did not start: %q %v", line, err)
	}
	fmt.Fprintf(out, "client pid %d, server pid %d, socket %s, memory %v\n", os.Getpid(), server.Process.Pid, sock, mt)

	d := &shmlink.Dialer{Config: &shmlink.Config{ShmDir: dir, MemoryType: mt}}
	defer d.Close()
	tr := &http.Transport{
		DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
			return d.DialContext(ctx, "unix", sock)
		},
		DisableCompression: true,
	}
	defer tr.CloseIdleConnections()
	c := &http.Client{Transport: tr, Timeout: timeout}
	// The host is a label: every connection goes to the socket.
	const base = "http://shmlink"

	if err := exchange(out, c, base, server.Process.Pid); err != nil {
		return err
	}

	// Stop: close our streams and sessions, then the server's stdin.
	tr.CloseIdleConnections()
	d.Close()
	stdin.Close()
	io.Copy(out, serverOut)
	waited = true
	if err := server.Wait(); err != nil {
		return fmt.Errorf("server: %w", err)
	}
	if err := checkEmpty(dir); err != nil {
		return err
	}
	fmt.Fprintf(out, "ok: every response checked, %s left empty\n", dir)
	return nil
}

// exchange runs the checks through c on the server of pid at base:
// concurrent GETs, an upload and a streamed download. It prints to out
// what each did.
func exchange(out io.Writer, c *http.Client, base string, pid int) error {
	if err := checkHellos(c, base, pid); err != nil {
		return err
	}
	fmt.Fprintf(out, "GET  /hello/{0..%d}  %d concurrent responses checked\n", numGets-1, numGets)

	start := time.Now()
	sum, err := checkUpload(c, base)
	if err != nil {
		return err
	}
	fmt.Fprintf(out, "POST /sha256       %d MiB uploaded in %v, server's sha256 %s matches\n",
		uploadSize>>20, time.Since(start).Round(time.Millisecond), sum[:16])

	start = time.Now()
	if err := checkStream(c, base); err != nil {
		return err
	}
	fmt.Fprintf(out, "GET  /stream       %d chunks x %d KiB streamed in %v, every byte checked, trailer sha256 matches\n",
		streamChunks, chunkSize>>10, time.Since(start).Round(time.Millisecond))
	return nil
}

// checkEmpty returns an error naming the files left in dir, if any.
func checkEmpty(dir string) error {
	entries, err := os.ReadDir(dir)
	if err != nil {
		return err
	}
	if len(entries) != 0 {
		names := make([]string, len(entries))
		for i, e := range entries {
			names[i] = e.Name()
		}
		return fmt.Errorf("files left in %s: %q", dir, names)
	}
	return nil
}

// get sends a GET for url and returns the body of its 200 response.
func get(c *http.Client, url string) ([]byte, *http.Response, error) {
	resp, err := c.Get(url)
	if err != nil {
		return nil, nil, err
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		return nil, nil, fmt.Errorf("GET %s: reading body: %w", url, err)
	}
	if resp.StatusCode != http.StatusOK {
		return nil, nil, fmt.Errorf("GET %s: %s: %q", url, resp.Status, body)
	}
	return body, resp, nil
}

// checkHellos sends numGets concurrent GET /hello/{i} and checks that each
// answer names i and the server's pid.
func checkHellos(c *http.Client, base string, pid int) error {
	errs := make([]error, numGets)
	var wg sync.WaitGroup
	for i := range numGets {
		wg.Go(func() {
			body, _, err := get(c, base+"/hello/"+strconv.Itoa(i))
			if err == nil {
				if want := fmt.Sprintf("hello, %d, from pid %d\n", i, pid); string(body) != want {
					err = fmt.Errorf("GET /hello/%d: got %q, want %q", i, body, want)
				}
			}
			errs[i] = err
		})
	}
	wg.Wait()
	return errors.Join(errs...)
}

// checkUpload posts uploadSize bytes of the uploadSeed pattern to
// /sha256 and checks the server's answer against the local hash, which it
// returns.
func checkUpload(c *http.Client, base string) (string, error) {
	want := patternSHA256(uploadSeed, uploadSize)
	req, err := http.NewRequest(http.MethodPost, base+"/sha256", &patternReader{seed: uploadSeed, n: uploadSize})
	if err != nil {
		return "", err
	}
	req.ContentLength = uploadSize
	req.Header.Set("Content-Type", "application/octet-stream")
	resp, err := c.Do(req)
	if err != nil {
		return "", err
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		return "", fmt.Errorf("POST /sha256: reading body: %w", err)
	}
	if resp.StatusCode != http.StatusOK {
		return "", fmt.Errorf("POST /sha256: %s: %q", resp.Status, body)
	}
	if got := fmt.Sprintf("%s %d\n", want, uploadSize); string(body) != got {
		return "", fmt.Errorf("POST /sha256: server says %q, want %q", body, got)
	}
	return want, nil
}

// checkStream reads GET /stream, checks every byte against the streamSeed
// pattern, the length, the chunked encoding and the SHA-256 trailer.
func checkStream(c *http.Client, base string) error {
	resp, err := c.Get(base + "/stream")
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("GET /stream: %s", resp.Status)
	}
	if resp.ContentLength != -1 || len(resp.TransferEncoding) != 1 || resp.TransferEncoding[0] != "chunked" {
		return fmt.Errorf("GET /stream: length %d, encoding %q: want a chunked stream", resp.ContentLength, resp.TransferEncoding)
	}
	const total = streamChunks * chunkSize
	h := sha256.New()
	buf := make([]byte, 32<<10)
	got := 0
	for {
		n, err := resp.Body.Read(buf)
		if got+n > total {
			return fmt.Errorf("GET /stream: more than %d bytes", total)
		}
		if err := checkPattern(buf[:n], streamSeed, got); err != nil {
			return fmt.Errorf("GET /stream: %w", err)
		}
		h.Write(buf[:n])
		got += n
		if err == io.EOF {
			break
		}
		if err != nil {
			return fmt.Errorf("GET /stream: after %d bytes: %w", got, err)
		}
	}
	if got != total {
		return fmt.Errorf("GET /stream: got %d bytes, want %d", got, total)
	}
	// The trailer is set once the body has been read to EOF.
	if sum, want := resp.Trailer.Get(trailerSHA256), hex.EncodeToString(h.Sum(nil)); sum != want {
		return fmt.Errorf("GET /stream: trailer sha256 %q, want %q", sum, want)
	}
	return nil
}
