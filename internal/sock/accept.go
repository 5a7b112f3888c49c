package sock

import (
	"context"
	"errors"
	"net"
	"syscall"
	"time"
)

// Backoff of Accept after a temporary error: from acceptMinWait doubling
// to acceptMaxWait, as net/http.Server waits.
const (
	acceptMinWait = 5 * time.Millisecond
	acceptMaxWait = time.Second
)

// Accept accepts the next connection on ln. Errors that pass once the
// process has descriptors or memory again (EMFILE, ENFILE, ENOBUFS,
// ENOMEM) or that concern one connection only (ECONNABORTED, EPROTO,
// EINTR) are retried after a wait that grows from 5 ms to 1 s, each
// reported first to onRetry (nil: none). Accept returns the connection, or
// the error of ln that is not one of those, or ctx.Err() once ctx is done
// during a wait.
func Accept(ctx context.Context, ln net.Listener, onRetry func(err error, wait time.Duration)) (net.Conn, error) {
	wait := time.Duration(0)
	for {
		conn, err := ln.Accept()
		if err == nil || !Retryable(err) {
			return conn, err
		}
		wait = min(max(2*wait, acceptMinWait), acceptMaxWait)
		if onRetry != nil {
			onRetry(err, wait)
		}
		t := time.NewTimer(wait)
		select {
		case <-ctx.Done():
			t.Stop()
			return nil, ctx.Err()
		case <-t.C:
		}
	}
}

// Retryable reports whether an error of a listener's Accept is worth a
// retry after a wait: the process is out of descriptors or memory for now
// (EMFILE, ENFILE, ENOBUFS, ENOMEM), or the error concerns one connection
// only (ECONNABORTED, EPROTO, EINTR). Any other error, EINVAL from a
// socket that is not listening among them, will come again.
func Retryable(err error) bool {
	for _, e := range []syscall.Errno{syscall.EMFILE, syscall.ENFILE, syscall.ENOBUFS, syscall.ENOMEM,
		syscall.ECONNABORTED, syscall.EPROTO, syscall.EINTR} {
		if errors.Is(err, e) {
			return true
		}
	}
	return false
}
