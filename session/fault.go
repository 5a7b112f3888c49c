package session

import (
	"fmt"
	"io"
	"net"
	"os"
	"runtime"
	"runtime/debug"

	"github.com/shmlink/shmlink/buffer"
)

// A peer may truncate the file or memfd behind our mapping of its shared
// memory; the next access past the new end faults (SIGBUS), which would
// kill the process. A memfd is sealed against that where the peer allows
// it (shm.SealShrink), but a file cannot be, so every access to the peer's
// memory runs with runtime/debug.SetPanicOnFault set: a fault becomes a
// panic that guard recovers as a *faultError, and the session ends with it
// (docs/protocol.md section 13). A write to a page of a sparse file that
// its file system has no room for faults the same way; the files this
// process creates have their blocks allocated (shm.CreateFile), but a
// peer's may not. Locks taken under a guard are released by
// deferred calls, so that nothing stays locked after such a panic.
//
// Bytes that zero-copy calls (Peek, ReadBytes, ReadChunk, Reserve) hand to
// the application are outside any guard: on memory the peer can truncate,
// the application's own access to them may fault. WriteTo and ReadFrom,
// which io.Copy calls without the application knowing, hand it shared
// memory only where that cannot fault (inProcessSafe): otherwise they copy
// through a buffer on the heap, under the guard (docs/protocol.md section
// 13.1).

// memSealed reports whether the peer cannot shrink the session's shared
// memory: memfds sealed against shrinking, by their creator or by us
// (shm.SealShrink). It is false once the memory is unmapped.
func (s *Session) memSealed() bool {
	s.shm.mu.RLock()
	defer s.shm.mu.RUnlock()
	return s.shm.mem != nil && s.shm.mem.sealed
}

// inProcessSafe reports whether shared memory of s may go to x, the
// writer of WriteTo or the reader of ReadFrom, as it is: when the peer
// cannot shrink the memory, or when x does not touch the bytes in this
// process. A socket or a file of package net or os hands them to the
// kernel, whose copy from or into a page the peer truncated away fails
// with EFAULT rather than fault (only these types: a wrapper may copy them
// itself); io.Discard does not read them. docs/protocol.md section 13.1
// has the rules that use it.
func (s *Session) inProcessSafe(x any) bool {
	switch x.(type) {
	case *net.TCPConn, *net.UnixConn, *os.File:
		return true
	}
	return x == io.Discard || s.memSealed()
}

// faultError is a fault on shared memory.
type faultError struct{ addr uintptr }

func (e *faultError) Error() string {
	return fmt.Sprintf("fault at address %#x: the shared memory was truncated, or its file system is full", e.addr)
}

// Unwrap makes a fault an error wrapping buffer.ErrCorrupt.
func (e *faultError) Unwrap() error { return buffer.ErrCorrupt }

// guard runs f with faults turned into an error (see above).
func guard(f func() error) (err error) {
	defer catchFault(&err, debug.SetPanicOnFault(true))
	return f()
}

// catchFault, deferred with the setting SetPanicOnFault returned, restores
// it and turns a fault panic into *err; any other panic goes on.
func catchFault(err *error, old bool) {
	debug.SetPanicOnFault(old)
	if r := recover(); r != nil {
		if fa, ok := r.(interface{ Addr() uintptr }); ok {
			*err = &faultError{fa.Addr()}
			return
		}
		if re, ok := r.(runtime.Error); ok && re.Error() == nilDeref {
			// qemu-user delivers SIGBUS without the faulting address,
			// and the runtime reports a fault at address 0 as a nil
			// dereference. The guarded code dereferences no nil
			// pointer of its own: its accesses are to the mapping.
			*err = &faultError{0}
			return
		}
		panic(r)
	}
}

// nilDeref is the message of the runtime's panic for a fault at an address
// below 4096 (runtime.panicmem).
const nilDeref = "runtime error: invalid memory address or nil pointer dereference"

// isFault reports whether err is, or wraps, a fault on shared memory. It
// walks the chain by hand: errors.As would move its target to the heap on
// every call, and this one runs on the read path.
func isFault(err error) bool {
	for err != nil {
		if _, ok := err.(*faultError); ok {
			return true
		}
		u, ok := err.(interface{ Unwrap() error })
		if !ok {
			return false
		}
		err = u.Unwrap()
	}
	return false
}
