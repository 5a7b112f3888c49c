// Package sock holds the operating-system shims behind shmlink's access
// control on Unix sockets: reading the credentials of the process at the
// other end of a connection (SO_PEERCRED), and creating a listening socket
// whose file has a given mode before any client can connect to it.
//
// It is internal: package session decides which peers to allow and the
// root package which mode to give a socket; this package only talks to the
// kernel.
package sock
