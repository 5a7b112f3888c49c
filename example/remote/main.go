// Command remote shows shmlink's "quic" network: the same net.Conn streams
// as over shared memory, to a peer on another host, with TLS.
//
//	go run ./example/remote         # server certificate only
//	go run ./example/remote -mtls   # the server requires a client certificate too
//
// The program makes a certificate authority and a certificate for
// 127.0.0.1 on the spot, starts a copy of itself as the server process
// (127.0.0.1 stands in for the remote host), and dials it with a
// shmlink.Dialer: 32 concurrent streams each send requests of 1 B to
// 1 MiB and check every echoed byte. It prints what it did and exits with
// status 1 on any error.
//
// The server process gets its certificate, key and the CA through files
// in a directory of mode 0700 that the client removes at the end; in a
// deployment they come from wherever the service's certificates live.
package main

import (
	"bufio"
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"errors"
	"flag"
	"fmt"
	"io"
	"math/big"
	"net"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/shmlink/shmlink"
)

func main() {
	serve := flag.String("serve", "", "run as the server with the TLS files in this directory (used by the example itself)")
	mtls := flag.Bool("mtls", false, "require a client certificate (mutual TLS)")
	flag.Parse()
	var err error
	if *serve != "" {
		err = runServer(*serve, *mtls)
	} else {
		err = runClient(*mtls)
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "remote:", err)
		os.Exit(1)
	}
}

// runServer listens on "quic" at 127.0.0.1, prints "ready <addr>", and
// echoes every stream until standard input closes.
func runServer(dir string, mtls bool) error {
	cert, err := tls.LoadX509KeyPair(filepath.Join(dir, "server.pem"), filepath.Join(dir, "server.key"))
	if err != nil {
		return err
	}
	conf := &tls.Config{Certificates: []tls.Certificate{cert}}
	if mtls {
		pool, err := loadPool(filepath.Join(dir, "ca.pem"))
		if err != nil {
			return err
		}
		conf.ClientAuth = tls.RequireAndVerifyClientCert
		conf.ClientCAs = pool
	}
	lc := shmlink.ListenConfig{TLSConfig: conf}
	ln, err := lc.Listen(context.Background(), "quic", "127.0.0.1:0")
	if err != nil {
		return err
	}
	fmt.Println("ready", ln.Addr())
	go func() {
		io.Copy(io.Discard, os.Stdin) // the client closes our stdin, or died
		// End the connections too: a client that was killed would hold
		// them until the QUIC idle timeout.
		ln.CloseSessions()
	}()
	var streams sync.WaitGroup
	defer streams.Wait()
	for {
		conn, err := ln.Accept()
		if err != nil {
			if errors.Is(err, net.ErrClosed) {
				return nil
			}
			return err
		}
		streams.Add(1)
		go func() {
			defer streams.Done()
			defer conn.Close()
			io.Copy(conn, conn)
		}()
	}
}

// runClient makes the TLS material, starts the server process and drives
// the exchange.
func runClient(mtls bool) error {
	dir, err := os.MkdirTemp("", "shmlink-remote-") // mode 0700
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)
	// On Ctrl-C or SIGTERM, remove the key material before exiting; the
	// server exits when its standard input closes with us.
	sig := make(chan os.Signal, 1)
	signal.Notify(sig, os.Interrupt, syscall.SIGTERM)
	go func() {
		<-sig
		os.RemoveAll(dir)
		os.Exit(1)
	}()
	ca, caKey, err := writeTLS(dir)
	if err != nil {
		return err
	}

	exe, err := os.Executable()
	if err != nil {
		return err
	}
	args := []string{"-serve", dir}
	if mtls {
		args = append(args, "-mtls")
	}
	server := exec.Command(exe, args...)
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
	line, err := bufio.NewReader(stdout).ReadString('\n')
	addr, ok := strings.CutPrefix(strings.TrimSpace(line), "ready ")
	if err != nil || !ok {
		return fmt.Errorf("server did not start: %q %v", line, err)
	}
	fmt.Printf("client pid %d, server pid %d, QUIC at %s, mutual TLS %v\n", os.Getpid(), server.Process.Pid, addr, mtls)

	pool := x509.NewCertPool()
	pool.AddCert(ca)
	conf := &tls.Config{RootCAs: pool} // verifies the server's certificate for 127.0.0.1
	if mtls {
		cert, err := issue(ca, caKey, "client", x509.ExtKeyUsageClientAuth)
		if err != nil {
			return err
		}
		conf.Certificates = []tls.Certificate{cert}
	}
	d := &shmlink.Dialer{TLSConfig: conf}
	defer d.Close()

	const streams = 32
	sizes := []int{1, 100, 4 << 10, 64 << 10, 1 << 20}
	start := time.Now()
	errs := make(chan error, streams)
	for i := range streams {
		go func() { errs <- exchange(d, addr, sizes, byte(i)) }()
	}
	for range streams {
		if err := <-errs; err != nil {
			return err
		}
	}
	total := 0
	for _, n := range sizes {
		total += 2 * n * streams
	}
	st := d.Stats()
	fmt.Printf("ok: %d streams on %d QUIC connection, %d bytes echoed in %v, every byte checked (sent %d, received %d)\n",
		streams, d.NumSessions(), total, time.Since(start).Round(time.Millisecond), st.BytesSent, st.BytesReceived)
	return nil
}

// exchange opens a stream, sends a request of each size and checks its
// echo, then half-closes and waits for the server's end.
func exchange(d *shmlink.Dialer, addr string, sizes []int, seed byte) error {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	conn, err := d.DialContext(ctx, "quic", addr)
	if err != nil {
		return err
	}
	defer conn.Close()
	conn.SetDeadline(time.Now().Add(time.Minute))
	for _, n := range sizes {
		req := make([]byte, n)
		for j := range req {
			req[j] = seed + byte(j*31)
		}
		werr := make(chan error, 1)
		go func() { _, err := conn.Write(req); werr <- err }()
		resp := make([]byte, n)
		if _, err := io.ReadFull(conn, resp); err != nil {
			return fmt.Errorf("%d bytes: %w", n, err)
		}
		if err := <-werr; err != nil {
			return err
		}
		if string(req) != string(resp) {
			return fmt.Errorf("%d bytes: the echo differs", n)
		}
	}
	if err := conn.(interface{ CloseWrite() error }).CloseWrite(); err != nil {
		return err
	}
	if _, err := conn.Read(make([]byte, 1)); err != io.EOF {
		return fmt.Errorf("after the last echo: %v, want EOF", err)
	}
	return nil
}

// writeTLS makes a CA and a server certificate for 127.0.0.1 and
// localhost, writes the CA and the server's certificate and key to dir
// (mode 0600), and returns the CA for the client.
func writeTLS(dir string) (*x509.Certificate, *ecdsa.PrivateKey, error) {
	caKey, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, nil, err
	}
	tmpl := &x509.Certificate{
		SerialNumber:          big.NewInt(1),
		Subject:               pkix.Name{CommonName: "shmlink example CA"},
		NotBefore:             time.Now().Add(-time.Hour),
		NotAfter:              time.Now().Add(24 * time.Hour),
		KeyUsage:              x509.KeyUsageCertSign,
		BasicConstraintsValid: true,
		IsCA:                  true,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &caKey.PublicKey, caKey)
	if err != nil {
		return nil, nil, err
	}
	ca, err := x509.ParseCertificate(der)
	if err != nil {
		return nil, nil, err
	}
	server, err := issue(ca, caKey, "server", x509.ExtKeyUsageServerAuth)
	if err != nil {
		return nil, nil, err
	}
	key, err := x509.MarshalECPrivateKey(server.PrivateKey.(*ecdsa.PrivateKey))
	if err != nil {
		return nil, nil, err
	}
	err = errors.Join(
		os.WriteFile(filepath.Join(dir, "ca.pem"), pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}), 0o600),
		os.WriteFile(filepath.Join(dir, "server.pem"), pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: server.Certificate[0]}), 0o600),
		os.WriteFile(filepath.Join(dir, "server.key"), pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: key}), 0o600))
	return ca, caKey, err
}

// issue returns a certificate for 127.0.0.1 and localhost signed by ca,
// with a fresh key, for use.
func issue(ca *x509.Certificate, caKey *ecdsa.PrivateKey, name string, use x509.ExtKeyUsage) (tls.Certificate, error) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return tls.Certificate{}, err
	}
	serial, err := rand.Int(rand.Reader, big.NewInt(1<<62))
	if err != nil {
		return tls.Certificate{}, err
	}
	tmpl := &x509.Certificate{
		SerialNumber: serial,
		Subject:      pkix.Name{CommonName: "shmlink example " + name},
		NotBefore:    time.Now().Add(-time.Hour),
		NotAfter:     time.Now().Add(24 * time.Hour),
		DNSNames:     []string{"localhost"},
		IPAddresses:  []net.IP{net.IPv4(127, 0, 0, 1)},
		KeyUsage:     x509.KeyUsageDigitalSignature,
		ExtKeyUsage:  []x509.ExtKeyUsage{use},
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, ca, &key.PublicKey, caKey)
	if err != nil {
		return tls.Certificate{}, err
	}
	return tls.Certificate{Certificate: [][]byte{der}, PrivateKey: key}, nil
}

// loadPool returns a pool holding the certificates of the PEM file path.
func loadPool(path string) (*x509.CertPool, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(b) {
		return nil, fmt.Errorf("no certificate in %s", path)
	}
	return pool, nil
}
