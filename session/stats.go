package session

import "sync/atomic"

// Stats is a snapshot of a session's counters since it started. Counts are
// messages or events; bytes are payload bytes of streams.
type Stats struct {
	BytesSent       uint64 // stream bytes handed to the peer, both paths
	BytesReceived   uint64 // stream bytes received from the peer, both paths
	EventsSent      uint64 // IO-queue events put (data and close)
	EventsReceived  uint64 // IO-queue events popped
	WakeupsSent     uint64 // Polling messages sent, LocalWakeups included
	WakeupsReceived uint64 // Polling messages received, local wakeups included
	LocalWakeups    uint64 // of WakeupsSent: handed to the peer session in this process, not sent (docs/protocol.md section 12.9)
	FallbackWrites  uint64 // FallbackData messages sent
	FallbackReads   uint64 // FallbackData messages received
	QueueFull       uint64 // puts that found the send queue full
	MemoryFull      uint64 // writes that found the buffer region exhausted
	Spilled         uint64 // bytes received that were copied out of shared memory (Config.StreamMemoryLimit)
	StreamsRefused  uint64 // streams a server refused: accept backlog or Config.MaxStreams full
	AcksIgnored     uint64 // HotRestartAck messages that answered no HotRestart of ours
	SpinHits        uint64 // reader waits that ended while spinning (docs/protocol.md section 12)
	SpinMisses      uint64 // spins that ran out of their budget (Config.PollTime at most) before data came
	Parks           uint64 // reader waits that slept until a Polling (or the receive loop) delivered
	SelfWakes       uint64 // of Parks: the reader took its wakeup itself: it read the control connection (docs/protocol.md section 12.1), or harvested a local wakeup (section 12.9)
	ActiveStreams   int    // streams the session tracks now
	SlicesInUse     []int  // allocated slices per buffer list, by both sides
}

// counters are the session's statistics, updated with atomics.
type counters struct {
	bytesSent, bytesReceived     atomic.Uint64
	eventsSent, eventsReceived   atomic.Uint64
	wakeupsSent, wakeupsReceived atomic.Uint64
	localWakeups                 atomic.Uint64
	fallbackWrites, fallbackRead atomic.Uint64
	queueFull, memoryFull        atomic.Uint64
	spilled                      atomic.Uint64
	streamsRefused, acksIgnored  atomic.Uint64
	spinHits, spinMisses, parks  atomic.Uint64
	selfWakes                    atomic.Uint64
}

// Stats returns a snapshot of the session's counters. SlicesInUse is nil
// once the session's shared memory is released.
func (s *Session) Stats() Stats {
	st := Stats{
		BytesSent:       s.ctr.bytesSent.Load(),
		BytesReceived:   s.ctr.bytesReceived.Load(),
		EventsSent:      s.ctr.eventsSent.Load(),
		EventsReceived:  s.ctr.eventsReceived.Load(),
		WakeupsSent:     s.ctr.wakeupsSent.Load(),
		WakeupsReceived: s.ctr.wakeupsReceived.Load(),
		LocalWakeups:    s.ctr.localWakeups.Load(),
		FallbackWrites:  s.ctr.fallbackWrites.Load(),
		FallbackReads:   s.ctr.fallbackRead.Load(),
		QueueFull:       s.ctr.queueFull.Load(),
		MemoryFull:      s.ctr.memoryFull.Load(),
		Spilled:         s.ctr.spilled.Load(),
		StreamsRefused:  s.ctr.streamsRefused.Load(),
		AcksIgnored:     s.ctr.acksIgnored.Load(),
		SpinHits:        s.ctr.spinHits.Load(),
		SpinMisses:      s.ctr.spinMisses.Load(),
		Parks:           s.ctr.parks.Load(),
		SelfWakes:       s.ctr.selfWakes.Load(),
		ActiveStreams:   s.NumStreams(),
	}
	s.withMem(func(m *memory) error {
		st.SlicesInUse = m.region.InUse()
		return nil
	})
	return st
}
