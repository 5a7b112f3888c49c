// Package sock holds the operating-system shims behind shmlink's Unix
// sockets: reading the credentials of the process at the other end of a
// connection (SO_PEERCRED), creating a listening socket whose file has a
// given mode before any client can connect to it, and passing listening sockets to another process with SCM_RIGHTS (the hot
// upgrade's handover, docs/protocol.md section 14).
//
// It is internal: package session decides which peers to allow, the root
// package which mode to give a socket and package internal/upgrade when to
// hand a listener over; this package only talks to the kernel.
package sock
