package shmlink_test

import (
	"context"
	"encoding/json"
	"expvar"
	"fmt"
	"io"
	"log"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"time"

	"github.com/shmlink/shmlink"
)

// A server listens on a Unix socket and echoes each stream; a client
// dials one stream, writes and reads the echo. In real use
// the two sides are two processes.
func ExampleListen() {
	dir, err := os.MkdirTemp("", "shmlink-example-")
	if err != nil {
		log.Fatal(err)
	}
	defer os.RemoveAll(dir)
	sock := filepath.Join(dir, "echo.sock")

	ln, err := shmlink.Listen("unix", sock)
	if err != nil {
		log.Fatal(err)
	}
	defer ln.Close()
	go func() {
		for {
			c, err := ln.Accept() // a *shmlink.Stream, a net.Conn
			if err != nil {
				return // the listener was closed
			}
			go func() {
				defer c.Close()
				io.Copy(c, c)
			}()
		}
	}()

	c, err := shmlink.Dial("unix", sock) // one stream on a session of its own
	if err != nil {
		log.Fatal(err)
	}
	defer c.Close()
	msg := "hello over shared memory"
	io.WriteString(c, msg)
	echo := make([]byte, len(msg))
	if _, err := io.ReadFull(c, echo); err != nil {
		log.Fatal(err)
	}
	fmt.Println(string(echo))
	// Output: hello over shared memory
}

// A Dialer keeps sessions to each address and opens many streams on each:
// dial it as often as a client needs connections.
func ExampleDialer() {
	dir, err := os.MkdirTemp("", "shmlink-example-")
	if err != nil {
		log.Fatal(err)
	}
	defer os.RemoveAll(dir)
	sock := filepath.Join(dir, "s.sock")
	ln, err := shmlink.Listen("unix", sock)
	if err != nil {
		log.Fatal(err)
	}
	defer ln.Close()
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				io.Copy(c, c)
			}()
		}
	}()

	d := &shmlink.Dialer{IdleTimeout: time.Minute}
	defer d.Close()
	for i := range 3 {
		c, err := d.Dial("unix", sock)
		if err != nil {
			log.Fatal(err)
		}
		fmt.Fprintf(c, "request %d", i)
		buf := make([]byte, 9)
		io.ReadFull(c, buf)
		fmt.Println(string(buf))
		c.Close()
	}
	fmt.Println("sessions:", d.NumSessions())
	// Output:
	// request 0
	// request 1
	// request 2
	// sessions: 1
}

// net/http over shmlink: the server serves on a Listener, the client's
// Transport dials with a Dialer. Shutdown finishes the requests in flight
// (Listener.Close stops accepting and nothing more).
func Example_http() {
	dir, err := os.MkdirTemp("", "shmlink-example-")
	if err != nil {
		log.Fatal(err)
	}
	defer os.RemoveAll(dir)
	sock := filepath.Join(dir, "http.sock")
	ln, err := shmlink.Listen("unix", sock)
	if err != nil {
		log.Fatal(err)
	}
	srv := &http.Server{
		Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			fmt.Fprintf(w, "hello, %s", r.URL.Path[1:])
		}),
		ReadHeaderTimeout: 10 * time.Second,
	}
	go srv.Serve(ln)

	var d shmlink.Dialer
	defer d.Close()
	client := &http.Client{Transport: &http.Transport{
		DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
			return d.DialContext(ctx, "unix", sock)
		},
	}}
	resp, err := client.Get("http://shmlink/gopher") // the host is not looked up
	if err != nil {
		log.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	fmt.Println(string(body))

	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	client.CloseIdleConnections()
	if err := srv.Shutdown(ctx); err != nil {
		log.Fatal(err)
	}
	// Output: hello, gopher
}

// The zero-copy calls: Reserve hands out bytes of shared memory to fill,
// Flush sends them; ReadBytes returns the bytes where they arrived.
// DialStream and AcceptStream return *Stream, which has them.
func ExampleStream_Reserve() {
	dir, err := os.MkdirTemp("", "shmlink-example-")
	if err != nil {
		log.Fatal(err)
	}
	defer os.RemoveAll(dir)
	sock := filepath.Join(dir, "zc.sock")
	var lc shmlink.ListenConfig
	ln, err := lc.Listen(context.Background(), "unix", sock)
	if err != nil {
		log.Fatal(err)
	}
	defer ln.Close()
	var d shmlink.Dialer
	defer d.Close()
	c, err := d.DialStream(context.Background(), "unix", sock)
	if err != nil {
		log.Fatal(err)
	}
	defer c.Close()
	s, err := ln.AcceptStream()
	if err != nil {
		log.Fatal(err)
	}
	defer s.Close()

	b, err := c.Reserve(5) // bytes in shared memory, ours until Flush
	if err != nil {
		log.Fatal(err)
	}
	copy(b, "zero!")
	if err := c.Flush(); err != nil {
		log.Fatal(err)
	}
	got, err := s.ReadBytes(5) // valid until ReleasePreviousRead
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println(string(got))
	s.ReleasePreviousRead()
	// Output: zero!
}

// The counters of all the listener's sessions, published with expvar
// (the standard library) so that /debug/vars shows them; a Dialer has
// Stats too.
func ExampleListener_Stats() {
	dir, err := os.MkdirTemp("", "shmlink-example-")
	if err != nil {
		log.Fatal(err)
	}
	defer os.RemoveAll(dir)
	var lc shmlink.ListenConfig
	ln, err := lc.Listen(context.Background(), "unix", filepath.Join(dir, "s.sock"))
	if err != nil {
		log.Fatal(err)
	}
	defer ln.Close()
	expvar.Publish("shmlink_example_listener", expvar.Func(func() any { return ln.Stats() }))

	c, err := shmlink.Dial("unix", ln.Addr().String())
	if err != nil {
		log.Fatal(err)
	}
	s, err := ln.Accept()
	if err != nil {
		log.Fatal(err)
	}
	io.WriteString(c, "twelve bytes")
	io.ReadFull(s, make([]byte, 12))

	var stats shmlink.Stats // what /debug/vars would show, as JSON
	json.Unmarshal([]byte(expvar.Get("shmlink_example_listener").String()), &stats)
	fmt.Println("bytes received:", stats.BytesReceived, "streams:", stats.ActiveStreams)
	// Output: bytes received: 12 streams: 1
}
