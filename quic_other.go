//go:build !linux

package shmlink

import "net"

// forceUDPBuffers does nothing outside Linux: the buffers stay as the
// kernel capped them.
func forceUDPBuffers(c *net.UDPConn) {}
