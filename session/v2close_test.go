package session

import (
	"io"
	"runtime"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// A v2 client that writes a stream, closes it and ends its session before
// the server has even read the handshake still delivers the data: the end
// waits for the server to take the events before the files it has yet to
// open are unlinked (#14: the soak lost such a stream, its server's
// handshake failing on the missing files). The session ends by Close, or
// by its idle timeout as a Dialer's pooled sessions do.
func TestV2EndBeforeServerMaps(t *testing.T) {
	for _, how := range []string{"close", "idle"} {
		t.Run(how, func(t *testing.T) {
			cfg := &Config{ShmDir: t.TempDir(), HandshakeTimeout: time.Minute}
			cc, sc := tcpPair(t)
			client, err := Client(cc, cfg)
			require.NoError(t, err)
			require.EqualValues(t, 2, client.Version())
			c, err := client.OpenStream(t.Context())
			require.NoError(t, err)
			_, err = c.Write([]byte("written before the end"))
			require.NoError(t, err)
			require.NoError(t, c.Close())
			closed := make(chan error, 1)
			if how == "close" {
				go func() { closed <- client.Close() }()
				for !client.closeCalled.Load() {
					runtime.Gosched() // Close has begun once the flag is set
				}
			} else {
				client.SetIdleTimeout(time.Nanosecond)
				// The idle timer fires at once; before the fix it ended
				// the session there and then.
				closed <- nil
			}

			server, err := Server(sc, cfg)
			require.NoError(t, err, "the server could not open the client's files")
			defer server.Close()
			st := accept(t, server)
			require.NoError(t, st.SetReadDeadline(time.Now().Add(10*time.Second)))
			got, err := io.ReadAll(st)
			require.NoError(t, err)
			require.Equal(t, "written before the end", string(got))
			require.NoError(t, <-closed)
			if how == "idle" {
				waitDone(t, client.Done(), "the idle session's end once the server has its events")
			}
		})
	}
}
