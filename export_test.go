package shmlink

import (
	"context"
	"time"

	"github.com/shmlink/shmlink/session"
)

// SessionDialer dials one session of a Dialer's pool: see SetDialHook.
type SessionDialer func(ctx context.Context, cfg *Config, network, address string) (*session.Session, error)

// SetDialHook makes d dial its sessions with hook, which gets the real
// dial to call or not, and wait retry after a failed dial to grow a pool
// before growing it again. Call it before d's first Dial.
func SetDialHook(d *Dialer, retry time.Duration, hook func(real SessionDialer) SessionDialer) {
	d.dialSession = hook(dialSession)
	d.growRetry = retry
}

// SetWaitHook makes d call onWait whenever a Dial starts waiting for
// another Dial's new session. Call it before d's first Dial.
func SetWaitHook(d *Dialer, onWait func()) {
	d.onWait = onWait
}
