// Command helloworld is shmlink's main example: a real two-process exchange.
//
//	go run ./example/helloworld
//
// The program starts a copy of itself as the server process, dials it over a
// Unix socket, sends requests of 64 B to 4 MiB on one stream, checks every
// echoed byte, and prints the count, bytes and round-trip latency
// percentiles per size. It exits with status 1 on any mismatch or error.
package main

import (
	"bufio"
	"bytes"
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"time"

	"github.com/shmlink/shmlink"
)

func main() {
	serve := flag.String("serve", "", "run as the server on this Unix socket path (used by the example itself)")
	rounds := flag.Int("rounds", 2000, "round trips per size (fewer for sizes above 64 KiB)")
	flag.Parse()
	var err error
	if *serve != "" {
		err = runServer(*serve)
	} else {
		err = runClient(*rounds)
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "helloworld:", err)
		os.Exit(1)
	}
}

// runServer echoes every stream until standard input closes.
func runServer(path string) error {
	ln, err := shmlink.Listen("unix", path)
	if err != nil {
		return err
	}
	fmt.Println("ready")
	go func() {
		io.Copy(io.Discard, os.Stdin) // the client closes our stdin to stop us
		ln.Close()
	}()
	for {
		conn, err := ln.Accept()
		if err != nil {
			if errors.Is(err, net.ErrClosed) {
				return nil
			}
			return err
		}
		go func() {
			defer conn.Close()
			io.Copy(conn, conn)
		}()
	}
}

// runClient starts the server process and drives the exchange.
func runClient(rounds int) error {
	dir, err := os.MkdirTemp("", "shmlink-helloworld-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)
	sock := filepath.Join(dir, "echo.sock")

	exe, err := os.Executable()
	if err != nil {
		return err
	}
	server := exec.Command(exe, "-serve", sock)
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
	defer func() {
		stdin.Close()
		server.Wait()
	}()
	if line, err := bufio.NewReader(stdout).ReadString('\n'); err != nil || line != "ready\n" {
		return fmt.Errorf("server did not start: %q %v", line, err)
	}
	fmt.Printf("client pid %d, server pid %d, socket %s\n", os.Getpid(), server.Process.Pid, sock)

	conn, err := shmlink.Dial("unix", sock)
	if err != nil {
		return err
	}
	defer conn.Close()

	fmt.Printf("%8s %7s %12s %10s %10s %10s\n", "size", "count", "bytes", "p50", "p99", "max")
	total := 0
	for size := 64; size <= 4<<20; size *= 4 {
		n := rounds
		if size > 64<<10 {
			n = max(rounds/(size>>16), 20)
		}
		lat, err := exchange(conn, size, n)
		if err != nil {
			return fmt.Errorf("size %d: %w", size, err)
		}
		slices.Sort(lat)
		fmt.Printf("%8s %7d %12d %10v %10v %10v\n", human(size), n, 2*n*size,
			lat[len(lat)/2], lat[len(lat)*99/100], lat[len(lat)-1])
		total += 2 * n * size
	}
	fmt.Printf("ok: %d bytes exchanged through shared memory, every byte checked\n", total)
	return nil
}

// exchange sends n requests of size bytes and checks each echo.
func exchange(conn net.Conn, size, n int) ([]time.Duration, error) {
	req := make([]byte, size)
	resp := make([]byte, size)
	lat := make([]time.Duration, 0, n)
	for i := range n {
		for j := range req {
			req[j] = byte(i + j*31)
		}
		start := time.Now()
		if _, err := conn.Write(req); err != nil {
			return nil, err
		}
		if _, err := io.ReadFull(conn, resp); err != nil {
			return nil, err
		}
		lat = append(lat, time.Since(start))
		if !bytes.Equal(req, resp) {
			return nil, fmt.Errorf("round %d: echoed bytes differ", i)
		}
	}
	return lat, nil
}

func human(n int) string {
	switch {
	case n >= 1<<20:
		return fmt.Sprintf("%dMiB", n>>20)
	case n >= 1<<10:
		return fmt.Sprintf("%dKiB", n>>10)
	}
	return fmt.Sprintf("%dB", n)
}
