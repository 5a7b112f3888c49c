package peertest

import (
	"crypto/sha256"
	"encoding/binary"
	"fmt"
	"hash"
	"io"
	"net"
	"sync"
)

// The in-stream protocol of the test peers: a stream starts with a
// 9-byte command, a command byte and a big-endian u64 argument.
const (
	CmdEcho     = 'E' // echo every byte until EOF, then close
	CmdGenerate = 'G' // write arg bytes of Pattern(arg), then close
	CmdCounted  = 'C' // echo every byte until EOF, and count the request
	// CmdDigest hashes every byte until EOF with io.Copy into a SHA-256
	// (the stream's WriteTo), writing one byte back after each piece the
	// hash takes, then the 32-byte sum.
	CmdDigest = 'D'
)

// Command returns the 9 bytes of command cmd with argument arg.
func Command(cmd byte, arg uint64) []byte {
	b := make([]byte, 9)
	b[0] = cmd
	binary.BigEndian.PutUint64(b[1:], arg)
	return b
}

// ReadCommand reads a command from r.
func ReadCommand(r io.Reader) (cmd byte, arg uint64, err error) {
	var hdr [9]byte
	if _, err := io.ReadFull(r, hdr[:]); err != nil {
		return 0, 0, fmt.Errorf("read command: %w", err)
	}
	return hdr[0], binary.BigEndian.Uint64(hdr[1:]), nil
}

// Pattern fills b with a sequence that depends on seed and position, so
// that bytes of another stream or at another offset are caught.
func Pattern(b []byte, seed uint64, off int) {
	for i := range b {
		x := uint64(off+i)*0x9E3779B97F4A7C15 + seed
		b[i] = byte(x >> 56)
	}
}

// CheckPattern returns an error naming the first offset at which b
// differs from Pattern(seed) at off.
func CheckPattern(b []byte, seed uint64, off int) error {
	for i, got := range b {
		x := uint64(off+i)*0x9E3779B97F4A7C15 + seed
		if want := byte(x >> 56); got != want {
			return fmt.Errorf("byte %d: got %#x want %#x", off+i, got, want)
		}
	}
	return nil
}

// Echo writes n bytes of Pattern(seed) to c while it reads n bytes back
// and checks each: one exchange with a peer that echoes.
func Echo(c net.Conn, n int, seed uint64) error {
	errc := make(chan error, 1)
	go func() {
		buf := make([]byte, 64<<10)
		for off := 0; off < n; off += len(buf) {
			b := buf[:min(len(buf), n-off)]
			Pattern(b, seed, off)
			if _, err := c.Write(b); err != nil {
				errc <- fmt.Errorf("write at %d: %w", off, err)
				return
			}
		}
		errc <- nil
	}()
	buf := make([]byte, 256<<10)
	got := 0
	for got < n {
		k, err := c.Read(buf[:min(len(buf), n-got)])
		if err := CheckPattern(buf[:k], seed, got); err != nil {
			return err
		}
		got += k
		if err != nil {
			return fmt.Errorf("read after %d of %d bytes: %w", got, n, err)
		}
	}
	return <-errc
}

// ServeStream serves one stream of the protocol: CmdEcho and CmdCounted
// echo until EOF, CmdGenerate writes its bytes; it returns when done.
func ServeStream(conn net.Conn) error {
	cmd, arg, err := ReadCommand(conn)
	if err != nil {
		return err
	}
	switch cmd {
	case CmdEcho, CmdCounted:
		_, err := io.Copy(conn, conn)
		return err
	case CmdDigest:
		h := &progressHash{Hash: sha256.New(), conn: conn}
		if _, err := io.Copy(h, conn); err != nil {
			return err
		}
		_, err := conn.Write(h.Sum(nil))
		return err
	case CmdGenerate:
		buf := make([]byte, 64<<10)
		for off := 0; off < int(arg); off += len(buf) {
			b := buf[:min(len(buf), int(arg)-off)]
			Pattern(b, arg, off)
			if _, err := conn.Write(b); err != nil {
				return err
			}
		}
		return nil
	}
	return fmt.Errorf("unknown command %q", cmd)
}

// progressHash is CmdDigest's hash: each Write hashes p, then writes one
// byte to conn.
type progressHash struct {
	hash.Hash
	conn net.Conn
}

func (h *progressHash) Write(p []byte) (int, error) {
	h.Hash.Write(p)
	if _, err := h.conn.Write([]byte{1}); err != nil {
		return 0, err
	}
	return len(p), nil
}

// ServeEach accepts streams on ln until it is closed and runs handle on
// each in a goroutine of its own, closing the stream after; the returned
// wait waits for the accept loop and every handler.
func ServeEach(ln net.Listener, handle func(net.Conn)) (wait func()) {
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			wg.Add(1)
			go func() {
				defer wg.Done()
				defer c.Close()
				handle(c)
			}()
		}
	}()
	return wg.Wait
}
