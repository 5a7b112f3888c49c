// Package shm holds the operating-system shims behind shmlink's shared memory:
// creating memfds and files for a buffer region or an IO queue, mapping and
// unmapping them, and passing their descriptors over a Unix socket with
// SCM_RIGHTS (docs/protocol.md section 1.4, step 5).
//
// It is internal: the public packages decide what to create and how to lay it
// out; this package only talks to the kernel. Every descriptor it creates is
// close-on-exec, every memfd and file it creates is mode 0600 and every file
// is created with O_EXCL, so that another local user can neither read it
// nor pre-create it. A file named by a peer is only opened if it is a
// regular file of the expected owner (OpenFile).
package shm
