package wire

import (
	"bytes"
	"encoding/hex"
	"errors"
	"strconv"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// wire builds message bytes from hex groups and quoted strings, such as
// wire("00000008", "7758", "03", "04").
func wire(parts ...string) []byte {
	var b []byte
	for _, p := range parts {
		if s, ok := strings.CutPrefix(p, `"`); ok {
			b = append(b, strings.TrimSuffix(s, `"`)...)
			continue
		}
		h, err := hex.DecodeString(strings.ReplaceAll(p, " ", ""))
		if err != nil {
			panic(err)
		}
		b = append(b, h...)
	}
	return b
}

// reencode decodes the payload of a message with header h and encodes what
// it decoded again, with the package's appenders.
func reencode(h Header, payload []byte) ([]byte, error) {
	switch h.Type {
	case TypeShareMemoryByFilePath, TypeShareMemoryByMemfd:
		m, err := ParseShmMetadata(payload)
		if err != nil {
			return nil, err
		}
		return AppendShareMemory(nil, h.Version, h.Type, m), nil
	case TypeStreamClose:
		id, err := ParseStreamClose(payload)
		if err != nil {
			return nil, err
		}
		return AppendStreamClose(nil, h.Version, id), nil
	case TypeFallbackData:
		id, status, data, err := ParseFallback(payload)
		if err != nil {
			return nil, err
		}
		return append(AppendFallbackHeader(nil, h.Version, id, status, len(data)), data...), nil
	case TypeHotRestart, TypeHotRestartAck:
		epoch, err := ParseEpoch(payload)
		if err != nil {
			return nil, err
		}
		return AppendHotRestart(nil, h.Version, h.Type, epoch), nil
	}
	return AppendSimple(nil, h.Version, h.Type), nil
}

// TestEncoding checks every message type's encoding against the bytes the
// existing peers send (the table in the package comment), and that it
// parses back.
func TestEncoding(t *testing.T) {
	longPath := "/dev/shm/" + strings.Repeat("p", MaxPathLen-len("/dev/shm/"))
	for _, tc := range []struct {
		name   string
		encode func(dst []byte) []byte
		want   []byte
		header Header
		value  any // what the payload parser returns
	}{
		{
			name: "v2 ShareMemoryByFilePath (1.3 example)",
			encode: func(dst []byte) []byte {
				return AppendShareMemory(dst, 2, TypeShareMemoryByFilePath,
					ShmMetadata{QueuePath: "/dev/shm/zzq_11817_0", BufferPath: "/dev/shm/zzb_0_buffer"})
			},
			want:   wire("00000035 7758 02 00", "0014", `"/dev/shm/zzq_11817_0"`, "0015", `"/dev/shm/zzb_0_buffer"`),
			header: Header{Length: 0x35, Version: 2, Type: TypeShareMemoryByFilePath},
			value:  ShmMetadata{QueuePath: "/dev/shm/zzq_11817_0", BufferPath: "/dev/shm/zzb_0_buffer"},
		},
		{
			name: "v3 ShareMemoryByMemfd",
			encode: func(dst []byte) []byte {
				return AppendShareMemory(dst, 3, TypeShareMemoryByMemfd, ShmMetadata{QueuePath: "q", BufferPath: "bb"})
			},
			want:   wire("0000000f 7758 03 05", "0001", `"q"`, "0002", `"bb"`),
			header: Header{Length: 15, Version: 3, Type: TypeShareMemoryByMemfd},
			value:  ShmMetadata{QueuePath: "q", BufferPath: "bb"},
		},
		{
			name: "ShareMemoryByFilePath with paths of MaxPathLen",
			encode: func(dst []byte) []byte {
				return AppendShareMemory(dst, 3, TypeShareMemoryByFilePath, ShmMetadata{QueuePath: longPath, BufferPath: longPath})
			},
			want:   wire("0000200c 7758 03 00", "1000", `"`+longPath+`"`, "1000", `"`+longPath+`"`),
			header: Header{Length: 8 + 2 + 4096 + 2 + 4096, Version: 3, Type: TypeShareMemoryByFilePath},
			value:  ShmMetadata{QueuePath: longPath, BufferPath: longPath},
		},
		{
			name:   "v3 ExchangeProtoVersion (1.4 step 1)",
			encode: func(dst []byte) []byte { return AppendSimple(dst, 3, TypeExchangeProtoVersion) },
			want:   wire("00000008 7758 03 04"),
			header: Header{Length: 8, Version: 3, Type: TypeExchangeProtoVersion},
		},
		{
			name:   "v3 AckReadyRecvFD (1.4 step 4)",
			encode: func(dst []byte) []byte { return AppendSimple(dst, 3, TypeAckReadyRecvFD) },
			want:   wire("00000008 7758 03 07"),
			header: Header{Length: 8, Version: 3, Type: TypeAckReadyRecvFD},
		},
		{
			name:   "v3 AckShareMemory (1.4 step 6)",
			encode: func(dst []byte) []byte { return AppendSimple(dst, 3, TypeAckShareMemory) },
			want:   wire("00000008 7758 03 06"),
			header: Header{Length: 8, Version: 3, Type: TypeAckShareMemory},
		},
		{
			name:   "v2 Polling",
			encode: func(dst []byte) []byte { return AppendSimple(dst, 2, TypePolling) },
			want:   wire("00000008 7758 02 01"),
			header: Header{Length: 8, Version: 2, Type: TypePolling},
		},
		{
			name:   "StreamClose",
			encode: func(dst []byte) []byte { return AppendStreamClose(dst, 3, 0x01020304) },
			want:   wire("0000000c 7758 03 02", "01020304"),
			header: Header{Length: 12, Version: 3, Type: TypeStreamClose},
			value:  uint32(0x01020304),
		},
		{
			name: "FallbackData",
			encode: func(dst []byte) []byte {
				return append(AppendFallbackHeader(dst, 2, 2, 1, 3), "abc"...)
			},
			want:   wire("00000013 7758 02 03", "00000002", "00000001", `"abc"`),
			header: Header{Length: 19, Version: 2, Type: TypeFallbackData},
			value:  [3]any{uint32(2), uint32(1), []byte("abc")},
		},
		{
			name:   "FallbackData without data",
			encode: func(dst []byte) []byte { return AppendFallbackHeader(dst, 3, 0xfffffffe, 0x101, 0) },
			want:   wire("00000010 7758 03 03", "fffffffe", "00000101"),
			header: Header{Length: 16, Version: 3, Type: TypeFallbackData},
			value:  [3]any{uint32(0xfffffffe), uint32(0x101), []byte{}},
		},
		{
			name:   "HotRestart",
			encode: func(dst []byte) []byte { return AppendHotRestart(dst, 3, TypeHotRestart, 0x0102030405060708) },
			want:   wire("00000010 7758 03 08", "0102030405060708"),
			header: Header{Length: 16, Version: 3, Type: TypeHotRestart},
			value:  uint64(0x0102030405060708),
		},
		{
			name:   "HotRestartAck",
			encode: func(dst []byte) []byte { return AppendHotRestart(dst, 2, TypeHotRestartAck, 7) },
			want:   wire("00000010 7758 02 09", "0000000000000007"),
			header: Header{Length: 16, Version: 2, Type: TypeHotRestartAck},
			value:  uint64(7),
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got := tc.encode(nil)
			require.Equal(t, tc.want, got)
			// Appending keeps what dst held.
			require.Equal(t, append([]byte("prefix"), tc.want...), tc.encode([]byte("prefix")))

			h, err := ParseHeader(got, 0)
			require.NoError(t, err)
			require.Equal(t, tc.header, h)
			require.Equal(t, tc.want[:HeaderSize], AppendHeader(nil, h))
			payload := got[HeaderSize:h.Length]
			require.Len(t, got, int(h.Length))

			var value any
			switch h.Type {
			case TypeShareMemoryByFilePath, TypeShareMemoryByMemfd:
				value, err = ParseShmMetadata(payload)
			case TypeStreamClose:
				value, err = ParseStreamClose(payload)
			case TypeFallbackData:
				id, status, data, perr := ParseFallback(payload)
				value, err = [3]any{id, status, data}, perr
			case TypeHotRestart, TypeHotRestartAck:
				value, err = ParseEpoch(payload)
			}
			require.NoError(t, err)
			require.Equal(t, tc.value, value)

			again, err := reencode(h, payload)
			require.NoError(t, err)
			require.Equal(t, tc.want, again)
		})
	}
}

// TestParseHeaderRejects covers headers that must end the session: a bad
// magic, version, type or length, several of which crash existing peers.
func TestParseHeaderRejects(t *testing.T) {
	for _, tc := range []struct {
		name   string
		msg    []byte
		maxLen uint32
		field  string
	}{
		{"short header", wire("00000008 7758 03"), 0, "header"},
		{"empty", nil, 0, "header"},
		{"bad magic", wire("00000008 5877 03 01"), 0, "magic"},
		{"zero magic", wire("00000008 0000 03 01"), 0, "magic"},
		{"version 0", wire("00000008 7758 00 01"), 0, "version"},
		{"version 1", wire("00000008 7758 01 01"), 0, "version"},
		{"version 4", wire("00000008 7758 04 04"), 0, "version"},
		{"Rust v4 message", wire("00000020 7758 00 0a"), 0, "version"},
		{"type 10", wire("00000008 7758 03 0a"), 0, "type"},
		{"type 255", wire("00000008 7758 02 ff"), 0, "type"},
		{"length 0", wire("00000000 7758 03 01"), 0, "length"},
		{"length 7", wire("00000007 7758 03 01"), 0, "length"},
		{"Polling of 9 bytes", wire("00000009 7758 03 01"), 0, "length"},
		{"ExchangeProtoVersion of 16 bytes", wire("00000010 7758 03 04"), 0, "length"},
		{"AckShareMemory of 12 bytes", wire("0000000c 7758 03 06"), 0, "length"},
		{"AckReadyRecvFD of 9 bytes", wire("00000009 7758 03 07"), 0, "length"},
		{"StreamClose of 8 bytes", wire("00000008 7758 03 02"), 0, "length"},
		{"StreamClose of 16 bytes", wire("00000010 7758 03 02"), 0, "length"},
		{"FallbackData of 15 bytes", wire("0000000f 7758 03 03"), 0, "length"},
		{"FallbackData of 8 bytes", wire("00000008 7758 03 03"), 0, "length"},
		{"FallbackData of 4 bytes", wire("00000004 7758 02 03"), 0, "length"},
		{"HotRestart of 12 bytes", wire("0000000c 7758 03 08"), 0, "length"},
		{"HotRestart of 8 bytes", wire("00000008 7758 03 08"), 0, "length"},
		{"HotRestartAck of 24 bytes", wire("00000018 7758 03 09"), 0, "length"},
		{"ShareMemory of 11 bytes", wire("0000000b 7758 02 00"), 0, "length"},
		{"ShareMemoryByMemfd of 8 bytes", wire("00000008 7758 03 05"), 0, "length"},
		{"ShareMemory with paths too long", wire("0000200d 7758 02 00"), 0, "length"},
		{"FallbackData above the default max", wire("02000001 7758 03 03"), 0, "length"},
		{"FallbackData above maxLen", wire("00010001 7758 03 03"), 1 << 16, "length"},
		{"largest length", wire("ffffffff 7758 03 03"), 0, "length"},
		{"ShareMemory above maxLen", wire("00000035 7758 02 00"), 0x34, "length"},
		{"handshake reply above maxLen 8", wire("00000010 7758 03 08"), HeaderSize, "length"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h, err := ParseHeader(tc.msg, tc.maxLen)
			require.ErrorIs(t, err, ErrProtocol)
			var pe *ProtocolError
			require.ErrorAs(t, err, &pe)
			require.Equal(t, tc.field, pe.Field, "%v", err)
			require.Zero(t, h)
		})
	}
}

// TestParseHeaderLimits checks the edges that are accepted.
func TestParseHeaderLimits(t *testing.T) {
	for _, tc := range []struct {
		msg    []byte
		maxLen uint32
	}{
		{wire("02000000 7758 03 03"), 0},       // FallbackData of exactly DefaultMaxMessageSize
		{wire("00010000 7758 03 03"), 1 << 16}, // exactly maxLen
		{wire("0000000c 7758 02 00"), 0},       // ShmMetadata of two length prefixes (parsing the payload fails later)
		{wire("0000200c 7758 02 05"), 0},       // ShmMetadata of two MaxPathLen paths
		{wire("00000008 7758 03 04 ffff"), 8},  // bytes after the header are not the header's business
	} {
		h, err := ParseHeader(tc.msg, tc.maxLen)
		require.NoError(t, err, "% x", tc.msg)
		require.Equal(t, tc.msg[:HeaderSize], AppendHeader(nil, h))
	}
}

func TestParseShmMetadataRejects(t *testing.T) {
	long := strings.Repeat("x", MaxPathLen+1)
	for _, tc := range []struct {
		name    string
		payload []byte
		field   string
	}{
		{"empty", nil, "queue path"},
		{"one byte", wire("00"), "queue path"},
		{"empty queue path", wire("0000", "0001", `"b"`), "queue path"},
		{"queue path beyond the payload", wire("0005", `"abcd"`), "queue path"},
		{"queue path beyond the payload by far", wire("ffff", `"abcd"`), "queue path"},
		{"queue path too long", wire("1001", `"`+long+`"`, "0001", `"b"`), "queue path"},
		{"NUL in the queue path", wire("0003", "610062", "0001", `"b"`), "queue path"},
		{"missing buffer path", wire("0001", `"q"`), "buffer path"},
		{"half a buffer length", wire("0001", `"q"`, "00"), "buffer path"},
		{"empty buffer path", wire("0001", `"q"`, "0000"), "buffer path"},
		{"buffer path beyond the payload", wire("0001", `"q"`, "0003", `"bb"`), "buffer path"},
		{"buffer path too long", wire("0001", `"q"`, "1001", `"`+long+`"`), "buffer path"},
		{"NUL at the end of the buffer path", wire("0001", `"q"`, "0002", "6200"), "buffer path"},
		{"trailing byte", wire("0001", `"q"`, "0001", `"b"`, "00"), "payload"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			m, err := ParseShmMetadata(tc.payload)
			require.ErrorIs(t, err, ErrProtocol)
			var pe *ProtocolError
			require.ErrorAs(t, err, &pe)
			require.Equal(t, tc.field, pe.Field, "%v", err)
			require.Zero(t, m)
		})
	}
}

func TestParsePayloadRejects(t *testing.T) {
	for n := range 20 {
		p := make([]byte, n)
		if _, err := ParseStreamClose(p); n != 4 {
			require.ErrorIs(t, err, ErrProtocol, "StreamClose payload of %d bytes", n)
		} else {
			require.NoError(t, err)
		}
		if _, err := ParseEpoch(p); n != 8 {
			require.ErrorIs(t, err, ErrProtocol, "epoch payload of %d bytes", n)
		} else {
			require.NoError(t, err)
		}
		id, status, data, err := ParseFallback(p)
		if n < 8 {
			require.ErrorIs(t, err, ErrProtocol, "FallbackData payload of %d bytes", n)
			require.Zero(t, id)
			require.Zero(t, status)
			require.Nil(t, data)
		} else {
			require.NoError(t, err)
			require.Len(t, data, n-8)
		}
	}
}

func TestAppendPanicsOnMisuse(t *testing.T) {
	require.Panics(t, func() { AppendSimple(nil, 3, TypeStreamClose) })
	require.Panics(t, func() { AppendSimple(nil, 3, MsgType(10)) })
	require.Panics(t, func() { AppendShareMemory(nil, 3, TypePolling, ShmMetadata{QueuePath: "q", BufferPath: "b"}) })
	require.Panics(t, func() {
		AppendShareMemory(nil, 3, TypeShareMemoryByMemfd, ShmMetadata{QueuePath: strings.Repeat("q", MaxPathLen+1), BufferPath: "b"})
	})
	require.Panics(t, func() { AppendHotRestart(nil, 3, TypeFallbackData, 1) })
	require.Panics(t, func() { AppendFallbackHeader(nil, 3, 1, 0, -1) })
	tooMuch := uint64(1<<32 - 16) // 16+n does not fit in the 32-bit length
	require.Panics(t, func() { AppendFallbackHeader(nil, 3, 1, 0, int(tooMuch)) })
	if strconv.IntSize == 64 { // else int(tooMuch-1) is negative
		require.NotPanics(t, func() { AppendFallbackHeader(nil, 3, 1, 0, int(tooMuch-1)) })
	}
}

func TestAppendAllocs(t *testing.T) {
	dst := make([]byte, 0, 256)
	meta := ShmMetadata{QueuePath: "/dev/shm/zzq_11817_0", BufferPath: "/dev/shm/zzb_0_buffer"}
	allocs := testing.AllocsPerRun(100, func() {
		b := AppendSimple(dst[:0], 3, TypePolling)
		b = AppendStreamClose(b, 3, 2)
		b = AppendFallbackHeader(b, 3, 2, 0, 100)
		b = AppendHotRestart(b, 3, TypeHotRestart, 1)
		b = AppendShareMemory(b, 3, TypeShareMemoryByMemfd, meta)
		b = AppendHeader(b, Header{Length: 8, Version: 3, Type: TypeAckShareMemory})
		if _, err := ParseHeader(b, 0); err != nil {
			t.Fatal(err)
		}
	})
	require.Zero(t, allocs)
}

func TestMsgTypeString(t *testing.T) {
	names := []string{
		"ShareMemoryByFilePath", "Polling", "StreamClose", "FallbackData", "ExchangeProtoVersion",
		"ShareMemoryByMemfd", "AckShareMemory", "AckReadyRecvFD", "HotRestart", "HotRestartAck",
	}
	for i, name := range names {
		require.Equal(t, name, MsgType(i).String())
	}
	require.Equal(t, "MsgType(10)", MsgType(10).String())
}

func TestProtocolError(t *testing.T) {
	_, err := ParseHeader(wire("00000008 7758 03 0a"), 0)
	require.EqualError(t, err, "shmlink: protocol error: type: 10, want 0..9")
	require.True(t, errors.Is(err, ErrProtocol))
}

// FuzzDecode feeds arbitrary bytes to ParseHeader and every payload
// parser: none may panic, every error must be a *ProtocolError, and a
// message whose header and payload are accepted must encode back to the
// same bytes. The seeds are in testdata/fuzz/FuzzDecode.
func FuzzDecode(f *testing.F) {
	f.Add(wire("00000008 7758 03 04"))
	f.Add(wire("00000013 7758 02 03", "00000002", "00000001", `"abc"`))
	f.Fuzz(func(t *testing.T, msg []byte) {
		isProtocolError := func(err error) {
			t.Helper()
			var pe *ProtocolError
			require.ErrorAs(t, err, &pe)
			require.ErrorIs(t, err, ErrProtocol)
		}
		// Payload parsers on anything.
		if len(msg) > 0 {
			payload := msg[1:]
			if _, err := ParseShmMetadata(payload); err != nil {
				isProtocolError(err)
			}
			if _, err := ParseStreamClose(payload); err != nil {
				isProtocolError(err)
			}
			if _, _, _, err := ParseFallback(payload); err != nil {
				isProtocolError(err)
			}
			if _, err := ParseEpoch(payload); err != nil {
				isProtocolError(err)
			}
		}

		const maxLen = 1 << 16
		h, err := ParseHeader(msg, maxLen)
		if err != nil {
			isProtocolError(err)
			return
		}
		require.GreaterOrEqual(t, h.Length, uint32(HeaderSize))
		require.LessOrEqual(t, h.Length, uint32(maxLen))
		require.Equal(t, msg[:HeaderSize], AppendHeader(nil, h))
		if len(msg) < int(h.Length) {
			return // the rest of the message has not arrived
		}
		again, err := reencode(h, msg[HeaderSize:h.Length])
		if err != nil {
			// Only ShmMetadata has a payload the header cannot vouch for.
			require.Contains(t, []MsgType{TypeShareMemoryByFilePath, TypeShareMemoryByMemfd}, h.Type, "%v", err)
			isProtocolError(err)
			return
		}
		require.True(t, bytes.Equal(msg[:h.Length], again), "round trip of % x gave % x", msg[:h.Length], again)
	})
}
