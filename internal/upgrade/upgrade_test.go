package upgrade

import (
	"errors"
	"net"
	"testing"

	"github.com/stretchr/testify/require"
)

// The frame's byte map (docs/protocol.md section 14).
func TestFrameLayout(t *testing.T) {
	a, b := net.Pipe()
	defer a.Close()
	defer b.Close()
	go writeFrame(a, opGrant, 0x0102030405060708)
	var got [frameLen]byte
	_, err := b.Read(got[:])
	require.NoError(t, err)
	want := []byte{'S', 'L', 'U', 'P', 1, 2, 0, 0, 1, 2, 3, 4, 5, 6, 7, 8}
	require.Equal(t, want, got[:])
	require.Equal(t, 16, frameLen)
}

func TestFrameRoundTrip(t *testing.T) {
	for _, tc := range []struct {
		o   op
		arg uint64
	}{{opRequest, 4242}, {opGrant, 1}, {opRefuse, refuseBusy}, {opReady, 0}} {
		a, b := net.Pipe()
		go writeFrame(a, tc.o, tc.arg)
		o, arg, err := readFrame(b)
		require.NoError(t, err)
		require.Equal(t, tc.o, o)
		require.Equal(t, tc.arg, arg)
		go writeFrame(a, tc.o, tc.arg)
		_, err = readOp(b, tc.o+1)
		require.ErrorIs(t, err, ErrFrame)
		a.Close()
		b.Close()
	}
}

// A bad magic or version is ErrFrame.
func TestFrameBad(t *testing.T) {
	for _, raw := range [][]byte{
		{'S', 'L', 'U', 'Q', 1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0},
		{'S', 'L', 'U', 'P', 2, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0},
	} {
		a, b := net.Pipe()
		go a.Write(raw)
		_, _, err := readFrame(b)
		require.True(t, errors.Is(err, ErrFrame), "got %v for % x", err, raw)
		a.Close()
		b.Close()
	}
	a, b := net.Pipe()
	go func() { a.Write([]byte("SLUP")); a.Close() }()
	_, _, err := readFrame(b)
	require.Error(t, err, "a short frame")
	b.Close()
}

// Every edge of the state machine, and that nothing else moves it.
func TestStateEdges(t *testing.T) {
	edges := map[state]map[event]state{
		stateFollowing:        {evPrevDrained: stateServing, evClose: stateClosed},
		stateServing:          {evGrant: stateGranting, evClose: stateClosed},
		stateGranting:         {evFail: stateServing, evReady: stateHandedOver, evClose: stateClosingGranting},
		stateHandedOver:       {evClose: stateClosedHandedOver},
		stateClosingGranting:  {evFail: stateClosed, evReady: stateClosedHandedOver},
		stateClosed:           {},
		stateClosedHandedOver: {},
	}
	for s := stateFollowing; s <= stateClosedHandedOver; s++ {
		for ev := evPrevDrained; ev <= evClose; ev++ {
			want, ok := edges[s][ev]
			if !ok {
				want = s
			}
			got, moved := s.next(ev)
			require.Equal(t, ok, moved, "state %d event %d", s, ev)
			require.Equal(t, want, got, "state %d event %d", s, ev)
		}
	}
	require.Zero(t, stateServing.refusal())
	require.EqualValues(t, refuseBusy, stateFollowing.refusal())
	require.EqualValues(t, refuseBusy, stateGranting.refusal())
	require.EqualValues(t, refuseBusy, stateHandedOver.refusal())
	for _, s := range []state{stateClosingGranting, stateClosed, stateClosedHandedOver} {
		require.EqualValues(t, refuseClosing, s.refusal())
	}
}
