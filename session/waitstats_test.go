package session

import (
	"testing"

	"github.com/stretchr/testify/require"
)

// Stats counts how a reader's waits ended: with polling off every wait
// sleeps; with an endless PollTime every wait ends in its spin.
func TestWaitStats(t *testing.T) {
	for _, tc := range []struct {
		name   string
		cfg    func(t *testing.T) *Config
		spins  bool
		sleeps bool
	}{
		{"polling off", func(*testing.T) *Config { return &Config{PollTime: -1} }, false, true},
		{"endless polls", func(t *testing.T) *Config { return &Config{PollTime: endlessPolls(t)} }, true, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			client, server := pair(t, tc.cfg(t))
			c, s := streamPair(t, client, server)
			before := client.Stats()
			got := make([]byte, 1)
			for i := range 20 {
				done := readAsync(c, got)
				// Write only once the reader waits, so that every read
				// call waits once.
				waitFor(t, "the reader waits", func() bool {
					return client.rx.spinning.Load() || client.rx.waiters.Load() > 0
				})
				_, err := s.Write([]byte{byte(i)})
				require.NoError(t, err)
				require.NoError(t, <-done)
				require.Equal(t, byte(i), got[0])
			}
			st := client.Stats()
			if tc.spins {
				require.Equal(t, before.SpinHits+20, st.SpinHits, "%+v", st)
				require.Equal(t, before.Parks, st.Parks)
			}
			if tc.sleeps {
				require.Equal(t, before.Parks+20, st.Parks, "%+v", st)
				require.Equal(t, before.SpinHits, st.SpinHits)
				require.Equal(t, before.SpinMisses, st.SpinMisses)
			}
		})
	}
}
