// Package session runs the shmipc protocol over one control connection
// (docs/protocol.md): a Session is the handshake's result, a buffer region
// and an IO queue per direction in shared memory, and it multiplexes
// Streams, each a net.Conn.
//
// # Words
//
//   - harvest: pop the events of the receive queue and dispatch each to its
//     stream (the receive loop does it after a Polling).
//   - Polling: the control message that wakes a peer whose working flag is
//     clear (docs/protocol.md section 3.3). A wakeup is one Polling.
//   - spin: a reader with nothing to read checks the receive queue itself
//     for up to Config.PollTime (a quarter of it, unless its answers
//     lately came later) instead of sleeping until a Polling.
//   - lease: a reader whose spin got its data keeps the working flag set
//     for its next read; settle: clear the flag, then harvest what came
//     (docs/protocol.md section 12).
//   - route: find the stream an event is for; unroute: stop doing so once
//     both closes were exchanged, so that the id can be reused.
//   - live: a stream not yet closed locally; it may still hold shared memory.
//   - copy out (spill): move a stalled reader's unread data from shared
//     memory to the heap (docs/protocol.md section 13).
//   - draining: a session that got (client) or sent (server) a HotRestart
//     and ends once its streams are done (docs/protocol.md section 5); a
//     client that acked ends it itself if the server has not within
//     min(HandshakeTimeout, 5 s).
//   - unmap: release the shared memory once the session ended and no stream
//     can read from it.
//   - pair: a client and a server session of one process find each other
//     by their queue's file and hand each other their wakeups instead of
//     Pollings (local.go, docs/protocol.md section 12.9).
//
// # Goroutines
//
//   - The receive loop (recvLoop), one per session: reads control messages,
//     harvests after a Polling, delivers StreamClose and FallbackData, and
//     answers hot restart messages. It ends when the connection does.
//   - The harvester (localHarvest), one per paired session: harvests for
//     the wakeups its peer session hands it while no reader sleeps in its
//     place (sleepLocal). It ends with the session.
//   - Application goroutines calling Stream and Session methods. A reader
//     may spin and harvest in place of the receive loop (Stream.spin), and
//     a reader whose waits run long reads the control connection in its
//     place while it sleeps (ctlIn, docs/protocol.md section 12.1).
//   - Timers: the session's timer (tick.go: leaseTick settles the working
//     flag, handBackTick has the receive loop take the connection back
//     from a reader that left it), the idle timer (idleExpired), a
//     draining client's ack timer (ackUnanswered) and deadline timers
//     (they only close channels).
//
// Session.Close waits for the receive loop; timers are stopped by the
// session's end.
//
// # Locks
//
// In the order they are taken; a goroutine holding one takes only those
// after it:
//
//  1. Stream.rmu, Stream.wmu: one read call, one write call per stream;
//     rmu guards the read bookkeeping, wmu the chain being written and the
//     stream's send path (viaSocket, pending).
//  2. receiver.mu: the receive queue's single consumer, held while
//     harvesting and dispatching.
//  3. sharedMem.mu (read): held by whoever touches the shared memory;
//     write-held only to unmap it. A spinning reader holds it and only
//     tries receiver.mu (TryLock), which cannot deadlock; so does a writer
//     that leases the flag before waking the peer (expectReply).
//  4. Session.putMu: the send queue's single producer; and
//     ctlWriter.sem, a channel so that writers wait for it within their
//     deadlines: held while writing on the control connection (ctl.go).
//     Their holders take no lock but Session.mu, to end the session.
//  5. Session.mu: the stream table, the session's error, idle and hot
//     restart state.
//  6. Stream.mu: a stream's state and receive buffer. Innermost.
//
// A function whose name ends in Locked expects its caller to hold the
// locks its doc comment names; where that is sharedMem.mu's read lock, the
// *memory it guards is passed in. No function returns with a lock held
// that it took.
package session
