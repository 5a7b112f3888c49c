package wire

import (
	"encoding/binary"
	"fmt"
	"math"
	"strings"
)

// Control-message framing. Every message starts with an 8-byte big-endian
// header:
//
//	+0 length  u32  whole message in bytes, header included
//	+4 magic   u16  Magic
//	+6 version u8   2 or 3
//	+7 type    u8   MsgType
//	+8 payload length-8 bytes
const (
	// HeaderSize is the size in bytes of a control-message header.
	HeaderSize = 8

	// Magic is the value of every header's magic field.
	Magic = 0x7758

	// DefaultMaxMessageSize is the largest control message, in bytes with
	// the header, ParseHeader accepts when its maxLen is 0: 32 MiB, the
	// Rust crate's read buffer (docs/protocol.md section 13).
	DefaultMaxMessageSize = 32 << 20

	// ProtocolVersion is the highest shmipc protocol version this module
	// speaks (docs/protocol.md section 1.4).
	ProtocolVersion = 3

	// MaxPathLen is the longest queue or buffer path, in bytes, that
	// ShmMetadata may carry; Linux's PATH_MAX.
	MaxPathLen = 4096

	// minVersion and maxVersion bound the header's version byte: v2 and
	// v3 (docs/protocol.md section 1.4).
	minVersion = 2
	maxVersion = ProtocolVersion

	// Offsets of the header fields, each after the previous one.
	hdrOffLength  = 0
	hdrOffMagic   = hdrOffLength + 4
	hdrOffVersion = hdrOffMagic + 2
	hdrOffType    = hdrOffVersion + 1

	// Fixed message lengths in bytes, header included (the table in the
	// package comment).
	streamCloseLen    = HeaderSize + 4     // u32 stream id
	fallbackHeaderLen = HeaderSize + 4 + 4 // u32 stream id, u32 status, data
	hotRestartLen     = HeaderSize + 8     // u64 epoch
	shmMetadataMinLen = HeaderSize + 2 + 2
	shmMetadataMaxLen = HeaderSize + 2 + MaxPathLen + 2 + MaxPathLen
)

// MsgType is the type byte of a control message.
type MsgType uint8

// The message types of the shmipc protocol, v2 and v3.
const (
	// TypeShareMemoryByFilePath (C->S handshake) carries ShmMetadata naming
	// files the server opens.
	TypeShareMemoryByFilePath MsgType = 0
	// TypePolling (both ways, 8 bytes) asks the receiver to drain its
	// receive queue: the spec's "SyncEvent".
	TypePolling MsgType = 1
	// TypeStreamClose (both ways, 12 bytes) closes a stream when the IO
	// queue is full: u32 stream id.
	TypeStreamClose MsgType = 2
	// TypeFallbackData (both ways, 16+n bytes) carries a stream's data on
	// the socket when shared memory is exhausted: u32 id, u32 status, data.
	TypeFallbackData MsgType = 3
	// TypeExchangeProtoVersion (handshake, 8 bytes): the header's version
	// byte is the content.
	TypeExchangeProtoVersion MsgType = 4
	// TypeShareMemoryByMemfd (C->S handshake) carries ShmMetadata whose
	// memfds follow.
	TypeShareMemoryByMemfd MsgType = 5
	// TypeAckShareMemory (S->C handshake, 8 bytes): both regions mapped.
	TypeAckShareMemory MsgType = 6
	// TypeAckReadyRecvFD (S->C handshake, 8 bytes): send the memfds now.
	TypeAckReadyRecvFD MsgType = 7
	// TypeHotRestart (old server -> client, 16 bytes): u64 epoch.
	TypeHotRestart MsgType = 8
	// TypeHotRestartAck (client -> old server, 16 bytes): u64 epoch.
	TypeHotRestartAck MsgType = 9

	maxMsgType = TypeHotRestartAck
)

// String returns the protocol's name of t, or "MsgType(n)" for an unknown
// type.
func (t MsgType) String() string {
	switch t {
	case TypeShareMemoryByFilePath:
		return "ShareMemoryByFilePath"
	case TypePolling:
		return "Polling"
	case TypeStreamClose:
		return "StreamClose"
	case TypeFallbackData:
		return "FallbackData"
	case TypeExchangeProtoVersion:
		return "ExchangeProtoVersion"
	case TypeShareMemoryByMemfd:
		return "ShareMemoryByMemfd"
	case TypeAckShareMemory:
		return "AckShareMemory"
	case TypeAckReadyRecvFD:
		return "AckReadyRecvFD"
	case TypeHotRestart:
		return "HotRestart"
	case TypeHotRestartAck:
		return "HotRestartAck"
	}
	return fmt.Sprintf("MsgType(%d)", uint8(t))
}

// lengthRange returns the smallest and largest length in bytes, header
// included, that a message of type t may have.
func lengthRange(t MsgType) (lo, hi uint32) {
	switch t {
	case TypeShareMemoryByFilePath, TypeShareMemoryByMemfd:
		return shmMetadataMinLen, shmMetadataMaxLen
	case TypeStreamClose:
		return streamCloseLen, streamCloseLen
	case TypeFallbackData:
		return fallbackHeaderLen, math.MaxUint32
	case TypeHotRestart, TypeHotRestartAck:
		return hotRestartLen, hotRestartLen
	}
	return HeaderSize, HeaderSize // Polling, ExchangeProtoVersion, Ack*
}

// Header is a decoded control-message header.
type Header struct {
	Length  uint32  // whole message in bytes, header included
	Version uint8   // protocol version, 2 or 3
	Type    MsgType // message type
}

// ParseHeader decodes and checks the header in the first HeaderSize bytes
// of b. It checks the magic, the version (2 or 3), the type (0..9), the
// length the type requires (exactly 8 bytes for
// Polling, ExchangeProtoVersion and the acks, 12 for StreamClose, 16 for
// HotRestart and HotRestartAck, at least 16 for FallbackData, 12 to
// 8+2+MaxPathLen+2+MaxPathLen for ShmMetadata), and that the length is at
// most maxLen bytes; maxLen 0 means DefaultMaxMessageSize. Any failure is
// a *ProtocolError wrapping ErrProtocol, so no length a peer sends is
// used before it is checked.
//
// The payload is the next Length-HeaderSize bytes on the connection.
func ParseHeader(b []byte, maxLen uint32) (Header, error) {
	if len(b) < HeaderSize {
		return Header{}, &ProtocolError{Field: "header", Reason: fmt.Sprintf("%d bytes, want %d", len(b), HeaderSize)}
	}
	if maxLen == 0 {
		maxLen = DefaultMaxMessageSize
	}
	h := Header{
		Length:  binary.BigEndian.Uint32(b[hdrOffLength:]),
		Version: b[hdrOffVersion],
		Type:    MsgType(b[hdrOffType]),
	}
	if m := binary.BigEndian.Uint16(b[hdrOffMagic:]); m != Magic {
		return Header{}, &ProtocolError{Field: "magic", Reason: fmt.Sprintf("%#04x, want %#04x", m, Magic)}
	}
	if h.Version < minVersion || h.Version > maxVersion {
		return Header{}, &ProtocolError{Field: "version", Reason: fmt.Sprintf("%d, want %d..%d", h.Version, minVersion, maxVersion)}
	}
	if h.Type > maxMsgType {
		return Header{}, &ProtocolError{Field: "type", Reason: fmt.Sprintf("%d, want 0..%d", uint8(h.Type), uint8(maxMsgType))}
	}
	switch lo, hi := lengthRange(h.Type); {
	case lo == hi && h.Length != lo:
		return Header{}, &ProtocolError{Field: "length", Reason: fmt.Sprintf("%v of %d bytes, want %d", h.Type, h.Length, lo)}
	case h.Length < lo || h.Length > hi:
		return Header{}, &ProtocolError{Field: "length", Reason: fmt.Sprintf("%v of %d bytes, want %d..%d", h.Type, h.Length, lo, hi)}
	case h.Length > maxLen:
		return Header{}, &ProtocolError{Field: "length", Reason: fmt.Sprintf("%v of %d bytes exceeds the limit of %d", h.Type, h.Length, maxLen)}
	}
	return h, nil
}

// AppendHeader appends the 8-byte encoding of h to dst and returns the
// extended slice. It does not check h. It
// does not allocate when dst has room.
func AppendHeader(dst []byte, h Header) []byte {
	dst = binary.BigEndian.AppendUint32(dst, h.Length)
	dst = binary.BigEndian.AppendUint16(dst, Magic)
	return append(dst, h.Version, byte(h.Type))
}

// AppendSimple appends a header-only message of type t (Polling,
// ExchangeProtoVersion, AckShareMemory or AckReadyRecvFD; 8 bytes) to dst.
// It panics for any other type. It does not allocate when dst has room.
func AppendSimple(dst []byte, version uint8, t MsgType) []byte {
	switch t {
	case TypePolling, TypeExchangeProtoVersion, TypeAckShareMemory, TypeAckReadyRecvFD:
	default:
		panic("wire: AppendSimple of " + t.String())
	}
	return AppendHeader(dst, Header{Length: HeaderSize, Version: version, Type: t})
}

// ShmMetadata is the payload of ShareMemoryByFilePath and
// ShareMemoryByMemfd (docs/protocol.md section 1.3): the paths of the IO queue
// and of the buffer region, or in memfd mode only their names.
type ShmMetadata struct {
	QueuePath  string // IO queue file; sent first
	BufferPath string // buffer region file
}

// AppendShareMemory appends a ShareMemoryByFilePath or ShareMemoryByMemfd
// message (t) carrying m to dst: u16 BE length and bytes of the queue
// path, then the same for the buffer path. It
// panics if t is another type or a path is longer than MaxPathLen bytes
// (creating such a file fails first). It does not check the paths
// otherwise. It does not allocate when dst has room.
func AppendShareMemory(dst []byte, version uint8, t MsgType, m ShmMetadata) []byte {
	if t != TypeShareMemoryByFilePath && t != TypeShareMemoryByMemfd {
		panic("wire: AppendShareMemory of " + t.String())
	}
	if len(m.QueuePath) > MaxPathLen || len(m.BufferPath) > MaxPathLen {
		panic("wire: AppendShareMemory: path longer than MaxPathLen")
	}
	n := HeaderSize + 2 + len(m.QueuePath) + 2 + len(m.BufferPath)
	dst = AppendHeader(dst, Header{Length: uint32(n), Version: version, Type: t})
	dst = binary.BigEndian.AppendUint16(dst, uint16(len(m.QueuePath)))
	dst = append(dst, m.QueuePath...)
	dst = binary.BigEndian.AppendUint16(dst, uint16(len(m.BufferPath)))
	return append(dst, m.BufferPath...)
}

// ParseShmMetadata decodes the payload of a ShareMemoryByFilePath or
// ShareMemoryByMemfd message (the bytes after the header). It is strict:
// each path must be 1..MaxPathLen bytes without NUL, the lengths must cover
// the payload exactly, and no bytes may trail. Any failure is a *ProtocolError wrapping ErrProtocol. Whether a
// path is acceptable to open is the caller's decision.
func ParseShmMetadata(payload []byte) (ShmMetadata, error) {
	queuePath, rest, err := parsePath(payload, "queue path")
	if err != nil {
		return ShmMetadata{}, err
	}
	bufferPath, rest, err := parsePath(rest, "buffer path")
	if err != nil {
		return ShmMetadata{}, err
	}
	if len(rest) != 0 {
		return ShmMetadata{}, &ProtocolError{Field: "payload", Reason: fmt.Sprintf("%d bytes after the buffer path", len(rest))}
	}
	return ShmMetadata{QueuePath: queuePath, BufferPath: bufferPath}, nil
}

// parsePath decodes one u16 BE length-prefixed path from the front of b
// and returns it and the bytes after it.
func parsePath(b []byte, field string) (path string, rest []byte, err error) {
	if len(b) < 2 {
		return "", nil, &ProtocolError{Field: field, Reason: "missing length"}
	}
	n := int(binary.BigEndian.Uint16(b))
	b = b[2:]
	switch {
	case n == 0:
		return "", nil, &ProtocolError{Field: field, Reason: "empty"}
	case n > MaxPathLen:
		return "", nil, &ProtocolError{Field: field, Reason: fmt.Sprintf("%d bytes, longer than %d", n, MaxPathLen)}
	case n > len(b):
		return "", nil, &ProtocolError{Field: field, Reason: fmt.Sprintf("%d bytes, only %d left in the message", n, len(b))}
	}
	path = string(b[:n])
	if strings.IndexByte(path, 0) >= 0 {
		return "", nil, &ProtocolError{Field: field, Reason: "contains NUL"}
	}
	return path, b[n:], nil
}

// AppendStreamClose appends a 12-byte StreamClose message for stream id to
// dst. It does not allocate when dst has room.
func AppendStreamClose(dst []byte, version uint8, id uint32) []byte {
	dst = AppendHeader(dst, Header{Length: streamCloseLen, Version: version, Type: TypeStreamClose})
	return binary.BigEndian.AppendUint32(dst, id)
}

// ParseStreamClose decodes the payload of a StreamClose message, exactly 4
// bytes, and returns the stream id. A bad length is a *ProtocolError
// wrapping ErrProtocol.
func ParseStreamClose(payload []byte) (uint32, error) {
	if len(payload) != streamCloseLen-HeaderSize {
		return 0, &ProtocolError{Field: "payload", Reason: fmt.Sprintf("StreamClose payload of %d bytes, want %d", len(payload), streamCloseLen-HeaderSize)}
	}
	return binary.BigEndian.Uint32(payload), nil
}

// AppendFallbackHeader appends the first 16 bytes of a FallbackData
// message that carries n data bytes for stream id with the given status
// (docs/protocol.md section 1.2): the header with length 16+n, then id and
// status. The caller appends or writes the n data bytes after it. It
// panics if n is negative or 16+n does not fit in 32 bits. It does not
// allocate when dst has room.
func AppendFallbackHeader(dst []byte, version uint8, id, status uint32, n int) []byte {
	if n < 0 || uint64(n) > math.MaxUint32-fallbackHeaderLen {
		panic(fmt.Sprintf("wire: AppendFallbackHeader of %d data bytes", n))
	}
	dst = AppendHeader(dst, Header{Length: fallbackHeaderLen + uint32(n), Version: version, Type: TypeFallbackData})
	dst = binary.BigEndian.AppendUint32(dst, id)
	return binary.BigEndian.AppendUint32(dst, status)
}

// ParseFallback decodes the payload of a FallbackData message: stream id,
// status (low byte = stream state) and the data, which aliases payload.
// A payload shorter than 8 bytes is a *ProtocolError wrapping ErrProtocol
// (the shmipc-go peer crashes on one).
func ParseFallback(payload []byte) (id, status uint32, data []byte, err error) {
	if len(payload) < fallbackHeaderLen-HeaderSize {
		return 0, 0, nil, &ProtocolError{Field: "payload", Reason: fmt.Sprintf("FallbackData payload of %d bytes, want at least %d", len(payload), fallbackHeaderLen-HeaderSize)}
	}
	return binary.BigEndian.Uint32(payload), binary.BigEndian.Uint32(payload[4:]), payload[8:], nil
}

// AppendHotRestart appends a 16-byte HotRestart or HotRestartAck message
// (t) carrying epoch to dst (docs/protocol.md section 5). It panics if
// t is another type. It does not allocate when dst has room.
func AppendHotRestart(dst []byte, version uint8, t MsgType, epoch uint64) []byte {
	if t != TypeHotRestart && t != TypeHotRestartAck {
		panic("wire: AppendHotRestart of " + t.String())
	}
	dst = AppendHeader(dst, Header{Length: hotRestartLen, Version: version, Type: t})
	return binary.BigEndian.AppendUint64(dst, epoch)
}

// ParseEpoch decodes the payload of a HotRestart or HotRestartAck message,
// exactly 8 bytes, and returns the epoch. A bad length is a
// *ProtocolError wrapping ErrProtocol.
func ParseEpoch(payload []byte) (uint64, error) {
	if len(payload) != hotRestartLen-HeaderSize {
		return 0, &ProtocolError{Field: "payload", Reason: fmt.Sprintf("epoch payload of %d bytes, want %d", len(payload), hotRestartLen-HeaderSize)}
	}
	return binary.BigEndian.Uint64(payload), nil
}
