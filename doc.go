// Package shmlink carries net.Conn streams between processes on one Linux
// host through shared memory instead of the kernel's socket buffers.
//
// It is the front door, shaped like package net: Listen and Dial, with
// ListenConfig and Dialer carrying a Config. Underneath, each client
// connection is a session (package session) that multiplexes streams over a
// buffer region of slices in shared memory (package buffer) and an IO queue
// of events per direction (package queue), with a Unix-socket or TCP control
// connection for the handshake, wakeups and fallback data. The wire and
// shared-memory layout is that of the shmipc protocol, so shmlink talks to
// the existing shmipc peers (the Go module cloudwego/shmipc-go and the Rust
// crate shmipc).
//
// A server:
//
//	ln, err := shmlink.Listen("unix", "/run/app.sock")
//	for {
//		conn, err := ln.Accept() // one stream from any client process
//		go serve(conn)
//	}
//
// A client:
//
//	var d shmlink.Dialer // reuses one session per address for many streams
//	conn, err := d.Dial("unix", "/run/app.sock")
//
// # Access control
//
// By default only processes of the same user meet. A Unix listener's socket
// file is mode 0600 (ListenConfig.SocketMode), and both ends check the
// other's credentials (SO_PEERCRED; over loopback TCP, the uid that owns
// the peer's socket) before the handshake: the same effective uid, or
// Config.AllowUIDs, or Config.PeerCheck; a refused client's connection is
// closed, logged and counted (Listener.PeersRefused). A TCP listener must
// be on loopback unless ListenConfig.AllowNonLoopback. A server maps only
// regular files directly inside Config.ShmDir that belong to the client's
// uid (this process's between hosts), and refuses any other path before
// opening it. Shared-memory files
// and memfds are created 0600, close-on-exec, files with O_EXCL.
package shmlink
