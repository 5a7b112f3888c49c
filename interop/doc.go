// Package interop holds the interoperability tests of shmlink against a peer
// it did not write: the Rust crate shmipc (crates.io), whose echo server and
// checking client live in interop/rust.
//
// The tests are behind the build tag "interop", because they build the Rust
// binaries with cargo first:
//
//	make interop
//	go test -race -tags interop -count=1 -v ./interop/...
//
// They run both directions (shmlink client -> Rust server, Rust client ->
// shmlink server) over a Unix socket with memfd (protocol v3) and with
// file-backed memory (v2 from the Rust client, v3 with a file path from
// shmlink), and over TCP with files (v2). With the tag set, a missing cargo
// fails the run instead of skipping it.
package interop
