package session

import (
	"fmt"
	"io"
	"testing"
)

// memReader serves n bytes copied from a 64 KiB block, as a file in the
// page cache would; it has no WriteTo, so io.Copy uses the destination's
// ReadFrom if any.
type memReader struct {
	block []byte
	left  int64
}

func (r *memReader) Read(p []byte) (int, error) {
	if r.left == 0 {
		return 0, io.EOF
	}
	n := copy(p[:min(int64(len(p)), r.left)], r.block)
	r.left -= int64(n)
	return n, nil
}

// sink takes bytes as a socket's Write would: one copy out, here into a
// 64 KiB block; it has no ReadFrom.
type sink struct{ block []byte }

func (w *sink) Write(p []byte) (int, error) {
	n := len(p)
	for len(p) > 0 {
		p = p[copy(w.block, p):]
	}
	return n, nil
}

// BenchmarkIOCopy copies 1 GiB per op with io.Copy, into a stream from a
// reader (in) and out of a stream into a writer (out): through the
// stream's ReadFrom and WriteTo, and with them hidden (plain: io.Copy's
// 32 KiB buffer and Write/Read, as before they existed).
func BenchmarkIOCopy(b *testing.B) {
	const total = 1 << 30
	for _, tc := range []struct {
		name     string
		in, out  bool // the side that io.Copy under test runs on
		fastPath bool
	}{
		{"in/ReadFrom", true, false, true},
		{"in/plain", true, false, false},
		{"out/WriteTo", false, true, true},
		{"out/plain", false, true, false},
	} {
		b.Run(tc.name, func(b *testing.B) {
			client, server := pair(b, nil)
			b.SetBytes(total)
			b.ResetTimer()
			for range b.N {
				c, s := streamPair(b, client, server)
				done := make(chan error, 1)
				go func() { // the writing side, which ends with CloseWrite
					src := &memReader{block: make([]byte, 64<<10), left: total}
					var err error
					if tc.in && !tc.fastPath {
						_, err = io.Copy(struct{ io.Writer }{c}, src)
					} else {
						_, err = io.Copy(c, src)
					}
					if err == nil {
						err = c.CloseWrite()
					}
					done <- err
				}()
				dst := &sink{block: make([]byte, 64<<10)}
				var n int64
				var err error
				if tc.out && !tc.fastPath {
					n, err = io.Copy(dst, struct{ io.Reader }{s})
				} else {
					n, err = io.Copy(dst, s)
				}
				if err == nil && n != total {
					err = io.ErrUnexpectedEOF
				}
				if err != nil {
					b.Fatal(err)
				}
				if err := <-done; err != nil {
					b.Fatal(err)
				}
				c.Close()
				s.Close()
			}
		})
	}
}

// BenchmarkReadFromSocket copies 64 MiB per op with io.Copy from a Unix
// socket into a stream (ReadFrom, which waits for the socket's bytes
// before it takes a slice for them), the socket's writer writing messages
// of the sub-benchmark's size back to back; the stream's reader discards.
func BenchmarkReadFromSocket(b *testing.B) {
	const total = 64 << 20
	for _, size := range []int{64, 4 << 10, 64 << 10} {
		b.Run(fmt.Sprintf("%dB", size), func(b *testing.B) {
			client, server := pair(b, nil)
			b.SetBytes(total)
			b.ResetTimer()
			for range b.N {
				c, s := streamPair(b, client, server)
				in, src := socketPair(b)
				written := make(chan error, 1)
				go func() {
					msg := make([]byte, size)
					var err error
					for left := total; left > 0 && err == nil; left -= size {
						_, err = in.Write(msg)
					}
					if err == nil {
						err = in.Close()
					}
					written <- err
				}()
				copied := make(chan error, 1)
				go func() {
					_, err := io.Copy(c, src)
					if err == nil {
						err = c.CloseWrite()
					}
					copied <- err
				}()
				n, err := io.Copy(io.Discard, s)
				if err == nil && n != total {
					err = io.ErrUnexpectedEOF
				}
				for _, e := range []error{err, <-written, <-copied} {
					if e != nil {
						b.Fatal(e)
					}
				}
				src.Close()
				c.Close()
				s.Close()
			}
		})
	}
}
