package shmlink

import "github.com/shmlink/shmlink/session"

// addStats adds the counters of s to t, ActiveStreams included. It leaves
// SlicesInUse alone: the regions of different sessions have different
// lists.
func addStats(t *Stats, s session.Stats) {
	t.BytesSent += s.BytesSent
	t.BytesReceived += s.BytesReceived
	t.EventsSent += s.EventsSent
	t.EventsReceived += s.EventsReceived
	t.WakeupsSent += s.WakeupsSent
	t.WakeupsReceived += s.WakeupsReceived
	t.LocalWakeups += s.LocalWakeups
	t.FallbackWrites += s.FallbackWrites
	t.FallbackReads += s.FallbackReads
	t.QueueFull += s.QueueFull
	t.MemoryFull += s.MemoryFull
	t.Spilled += s.Spilled
	t.StreamsRefused += s.StreamsRefused
	t.AcksIgnored += s.AcksIgnored
	t.SpinHits += s.SpinHits
	t.SpinMisses += s.SpinMisses
	t.Parks += s.Parks
	t.SelfWakes += s.SelfWakes
	t.ActiveStreams += s.ActiveStreams
}

// addEnded adds to t the counters of a session (or QUIC connection) that
// ended, without its streams: they are not active any more, whether or
// not the application closed them.
func addEnded(t *Stats, s session.Stats) {
	s.ActiveStreams = 0
	addStats(t, s)
}

// sumStats returns ended plus the counters of every session in live.
func sumStats(ended Stats, live map[*session.Session]struct{}) Stats {
	t := ended
	for s := range live {
		addStats(&t, s.Stats())
	}
	return t
}
