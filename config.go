package shmlink

import (
	"github.com/shmlink/shmlink/buffer"
	"github.com/shmlink/shmlink/session"
)

// Config tunes sessions; the zero value works. See session.Config for the
// fields, their units and defaults.
type Config = session.Config

// MemoryType selects memfd or file-backed shared memory (session.MemoryType).
type MemoryType = session.MemoryType

// Memory types, as in package session.
const (
	MemoryAuto  = session.MemoryAuto
	MemoryMemfd = session.MemoryMemfd
	MemoryFile  = session.MemoryFile
)

// SizeClass is one class of slices of the buffer region, for
// Config.SizeClasses (buffer.SizeClass): slice size in bytes and the
// percentage of the region it gets.
type SizeClass = buffer.SizeClass

// Stats holds a session's counters (session.Stats), from
// Stream.Session().Stats().
type Stats = session.Stats
