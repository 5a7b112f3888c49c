//go:build !linux

package shm

import (
	"net"
	"os"
)

// CreateMemfd returns ErrUnsupported on this platform.
func CreateMemfd(name string, size int) (*os.File, error) { return nil, ErrUnsupported }

// RemoveStale removes nothing on this platform and reports false.
func RemoveStale(path string) bool { return false }

// Claim returns ErrUnsupported on this platform.
func Claim(fd int) (release func(), err error) { return nil, ErrUnsupported }

// IDOf returns ErrUnsupported on this platform.
func IDOf(fd int) (FileID, error) { return FileID{}, ErrUnsupported }

// SealShrink reports false on this platform.
func SealShrink(fd int) bool { return false }

// CreateFile returns ErrUnsupported on this platform.
func CreateFile(path string, size int) (*os.File, error) { return nil, ErrUnsupported }

// OpenFile returns ErrUnsupported on this platform.
func OpenFile(path string, uid int) (*os.File, error) { return nil, ErrUnsupported }

// Size returns ErrUnsupported on this platform.
func Size(fd int) (int, error) { return 0, ErrUnsupported }

// CheckMemfd returns ErrUnsupported on this platform.
func CheckMemfd(fd int) error { return ErrUnsupported }

// Map returns ErrUnsupported on this platform.
func Map(fd int, want int) ([]byte, error) { return nil, ErrUnsupported }

// Unmap returns ErrUnsupported on this platform.
func Unmap(mem []byte) error { return ErrUnsupported }

// SendFds returns ErrUnsupported on this platform.
func SendFds(c *net.UnixConn, fds ...int) error { return ErrUnsupported }

// RecvFds returns ErrUnsupported on this platform.
func RecvFds(c *net.UnixConn, want int) ([]int, error) { return nil, ErrUnsupported }

// CloseFd does nothing on this platform.
func CloseFd(fd int) {}
