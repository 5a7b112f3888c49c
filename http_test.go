package shmlink_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/shmlink/shmlink"
	"github.com/shmlink/shmlink/internal/peertest"
	"github.com/stretchr/testify/require"
)

// httpRequests is the number of concurrent requests of TestHTTP.
const httpRequests = 200

// httpSizes are the body sizes TestHTTP mixes: empty, tiny, around the
// slice classes (8172, 32748 and 131052 bytes) and larger.
var httpSizes = []int{0, 1, 100, 4096, 8172, 8173, 32748, 65536, 131052, 131053, 300 << 10}

// httpBodySizes returns the sizes of the request body and of the response
// body of request i: both sides derive them, and the bytes, from i.
func httpBodySizes(i int) (req, resp int) {
	req = httpSizes[i%len(httpSizes)]
	resp = httpSizes[(i*7+3)%len(httpSizes)]
	switch i % 40 {
	case 7:
		req = 1 << 20
	case 23:
		resp = 1 << 20
	}
	return req, resp
}

// httpStride is the distance in the corpus between the bodies of
// consecutive requests; an odd number, so that no two bodies line up with
// the slice sizes alike.
const httpStride = 4099

// httpCorpus holds the bytes every body is cut from, a pattern whose bytes
// depend on their offset. Request i's body and its response's body start
// at offsets of their own, so a body of another request, or a part of a
// body at the wrong place, is caught. Both sides only read it.
type httpCorpus []byte

// newHTTPCorpus returns a corpus long enough for every body.
func newHTTPCorpus() httpCorpus {
	c := make(httpCorpus, httpRequests*httpStride+2<<20)
	peertest.Pattern(c, 0, 0)
	return c
}

// request returns the body of request i.
func (c httpCorpus) request(i int) []byte {
	n, _ := httpBodySizes(i)
	off := i * httpStride
	return c[off : off+n]
}

// response returns the body of the response to request i.
func (c httpCorpus) response(i int) []byte {
	_, n := httpBodySizes(i)
	off := i*httpStride + httpStride/2
	return c[off : off+n]
}

// check returns an error naming the first byte at which got differs from
// want, or the lengths if they differ.
func (c httpCorpus) check(got, want []byte) error {
	if bytes.Equal(got, want) {
		return nil
	}
	if len(got) != len(want) {
		return fmt.Errorf("got %d bytes, want %d", len(got), len(want))
	}
	i := 0
	for got[i] == want[i] {
		i++
	}
	return fmt.Errorf("byte %d: got %#x, want %#x", i, got[i], want[i])
}

// httpHandler serves POST /r/{i}: it checks that the body is request i's,
// byte for byte, and answers with response i's body in 32 KiB writes, with
// a Content-Length for even i and chunked for odd i. A wrong body gets 400
// and the reason.
func httpHandler(c httpCorpus, served *atomic.Int64) http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("POST /r/{i}", func(w http.ResponseWriter, r *http.Request) {
		i, err := strconv.Atoi(r.PathValue("i"))
		if err != nil || i < 0 || i >= httpRequests {
			http.Error(w, "bad request number", http.StatusBadRequest)
			return
		}
		body, err := io.ReadAll(r.Body)
		if err == nil {
			err = c.check(body, c.request(i))
		}
		if err != nil {
			http.Error(w, fmt.Sprintf("request %d: %v", i, err), http.StatusBadRequest)
			return
		}
		// Counted before the response goes out: a client may have all of
		// a response with a Content-Length before this handler returns.
		served.Add(1)
		resp := c.response(i)
		if i%2 == 0 {
			w.Header().Set("Content-Length", strconv.Itoa(len(resp)))
		}
		for off := 0; off < len(resp); off += 32 << 10 {
			if _, err := w.Write(resp[off:min(off+32<<10, len(resp))]); err != nil {
				return
			}
		}
	})
	return mux
}

// httpRoundTrip sends request i through cl and checks the response, byte
// for byte. A third of the requests have no Content-Length (chunked).
func httpRoundTrip(cl *http.Client, c httpCorpus, i int) error {
	var r io.Reader = bytes.NewReader(c.request(i))
	if i%3 == 0 {
		r = io.MultiReader(r) // hides the length
	}
	resp, err := cl.Post(fmt.Sprintf("http://shmlink/r/%d", i), "application/octet-stream", r)
	if err != nil {
		return fmt.Errorf("request %d: %w", i, err)
	}
	defer resp.Body.Close()
	got, err := io.ReadAll(resp.Body)
	if err != nil {
		return fmt.Errorf("request %d: reading response after %d bytes: %w", i, len(got), err)
	}
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("request %d: %s: %s", i, resp.Status, got)
	}
	if err := c.check(got, c.response(i)); err != nil {
		return fmt.Errorf("request %d: response: %w", i, err)
	}
	return nil
}

// net/http over shmlink, both ways: an http.Server on a Listener and an
// http.Client whose Transport dials with a Dialer. 200 concurrent requests
// of 0 B to 1 MiB each way, every body checked byte for byte on the side
// that receives it. Closing the idle connections empties the pools of both
// sides, and shutting down leaves no goroutine, descriptor or file behind.
func TestHTTP(t *testing.T) {
	for _, network := range []string{"unix", "tcp"} {
		t.Run(network, func(t *testing.T) {
			corpus := newHTTPCorpus()
			base := snapshot(t)
			ln, cfg := listen(t, network)
			var served atomic.Int64
			srv := &http.Server{Handler: httpHandler(corpus, &served), ReadHeaderTimeout: time.Minute}
			serveErr := make(chan error, 1)
			go func() { serveErr <- srv.Serve(ln) }()

			// Small StreamsPerSession, so the pool grows past one session;
			// short IdleTimeout, so sessions without streams end promptly.
			d := &shmlink.Dialer{Config: cfg, StreamsPerSession: 32, IdleTimeout: 50 * time.Millisecond}
			defer d.Close()
			var dials atomic.Int64
			tr := &http.Transport{
				DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
					dials.Add(1)
					return d.DialContext(ctx, network, ln.Addr().String())
				},
				MaxIdleConnsPerHost: httpRequests,
				DisableCompression:  true,
			}
			defer tr.CloseIdleConnections()
			c := &http.Client{Transport: tr, Timeout: time.Minute}

			errs := make([]error, httpRequests)
			var wg sync.WaitGroup
			for i := range httpRequests {
				wg.Go(func() { errs[i] = httpRoundTrip(c, corpus, i) })
			}
			wg.Wait()
			require.NoError(t, errors.Join(errs...))
			require.Equal(t, int64(httpRequests), served.Load(), "the server checked every request body")
			require.Positive(t, dials.Load())
			require.Positive(t, d.NumSessions(), "idle connections keep their streams and sessions")
			require.Positive(t, ln.NumSessions())

			// Keep-alive connections carry further requests.
			for i := range 10 {
				require.NoError(t, httpRoundTrip(c, corpus, i))
			}

			tr.CloseIdleConnections()
			require.Eventually(t, func() bool { return d.NumSessions() == 0 }, 10*time.Second, 5*time.Millisecond,
				"the Dialer's sessions end once their streams are closed")
			require.Eventually(t, func() bool { return ln.NumSessions() == 0 }, 10*time.Second, 5*time.Millisecond,
				"and so do the listener's")

			ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
			defer cancel()
			require.NoError(t, srv.Shutdown(ctx))
			require.ErrorIs(t, <-serveErr, http.ErrServerClosed)
			require.NoError(t, d.Close())
			// Sessions that ended by their idle timeout remove their files
			// on their own goroutine: requireNoLeaks polls for them.
			requireNoLeaks(t, base, cfg.ShmDir)
			entries, err := os.ReadDir(cfg.ShmDir)
			require.NoError(t, err)
			require.Empty(t, entries, "no socket or shared-memory file left")
		})
	}
}

// http.Server.Shutdown over a shmlink Listener lets a request in flight
// finish, as over a Unix socket (#15: closing the listener ended its
// sessions; the request failed with "peer closed the session" while
// Shutdown returned nil). The listener's sessions then end.
func TestHTTPShutdownFinishesInFlight(t *testing.T) {
	ln, cfg := listen(t, "unix")
	entered, release := make(chan struct{}), make(chan struct{})
	srv := &http.Server{ReadHeaderTimeout: time.Minute, Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		close(entered)
		<-release // in flight until the test lets it go
		io.WriteString(w, "finished")
	})}
	serveErr := make(chan error, 1)
	go func() { serveErr <- srv.Serve(ln) }()
	d := &shmlink.Dialer{Config: cfg}
	defer d.Close()
	tr := &http.Transport{DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
		return d.DialContext(ctx, "unix", ln.Addr().String())
	}}
	defer tr.CloseIdleConnections()
	reply := make(chan error, 1)
	go func() {
		resp, err := (&http.Client{Transport: tr}).Get("http://shmlink/")
		if err == nil {
			var body []byte
			body, err = io.ReadAll(resp.Body)
			resp.Body.Close()
			if err == nil && string(body) != "finished" {
				err = fmt.Errorf("body %q", body)
			}
		}
		reply <- err
	}()
	<-entered

	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	shutdown := make(chan error, 1)
	go func() { shutdown <- srv.Shutdown(ctx) }()
	require.ErrorIs(t, <-serveErr, http.ErrServerClosed) // Shutdown closed the listener
	close(release)
	require.NoError(t, <-reply, "the request in flight")
	require.NoError(t, <-shutdown)
	tr.CloseIdleConnections()
	require.NoError(t, ln.Shutdown(ctx), "the sessions end once their streams are closed")
	require.Zero(t, ln.NumSessions())
}
