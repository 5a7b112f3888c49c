// Package upgrade runs the hot upgrade of a shmlink listener: a new server
// process takes the listening socket over from the running one without
// closing it, through an upgrade socket that the live generation serves,
// and the running one then moves its clients over with the shmipc
// hot-restart messages and drains (docs/protocol.md section 14).
//
// A process calls TakeOver, which takes the listening socket over if a
// process serves the upgrade socket, and Listen, which makes the first
// generation, when TakeOver returns ErrNoOwner. Either way it gets the
// listening socket and an Upgrader, which it starts with Start once its
// listener serves; the Upgrader then serves the upgrade socket for the
// next generation and, once one took over, drives the listener through
// the Listener interface. It is internal: the root package's Listener
// owns the sessions and decides nothing about the handover.
//
// Goroutines, all started by Start and joined by Close: serve accepts on
// the upgrade socket; handle runs the old side of one handover per
// connection to it, and after a successful one drains the listener;
// watchPrev, in a generation that took over, waits until the previous
// generation has drained. One lock, Upgrader.mu, guards the state and the
// connections to other processes; it is never held while calling the
// Listener or doing I/O.
package upgrade
