package shmlink

import "github.com/shmlink/shmlink/session"

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
