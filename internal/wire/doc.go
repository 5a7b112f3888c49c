// Package wire encodes and decodes the control messages of the shmipc
// protocol, v2 and v3, byte for byte as the existing peers send them; what
// shmlink does with each message is in docs/protocol.md, section 1
// (the control connection: messages and handshakes).
//
// Every message is an 8-byte big-endian header (Header; its byte map is
// beside HeaderSize) followed by its payload. The ten message types and
// their lengths in bytes, header included:
//
//	type                      length    payload
//	0 ShareMemoryByFilePath   12..8204  ShmMetadata
//	1 Polling                 8         none
//	2 StreamClose             12        u32 stream id
//	3 FallbackData            16+n      u32 stream id, u32 status, n data bytes
//	4 ExchangeProtoVersion    8         none: the version byte is the content
//	5 ShareMemoryByMemfd      12..8204  ShmMetadata
//	6 AckShareMemory          8         none
//	7 AckReadyRecvFD          8         none
//	8 HotRestart              16        u64 epoch
//	9 HotRestartAck           16        u64 epoch
//
// ShmMetadata is u16 length and bytes of the queue path, then u16 length
// and bytes of the buffer path; each path is 1..MaxPathLen bytes without
// NUL.
//
// The parsers treat every byte as untrusted: a bad message is a
// *ProtocolError wrapping ErrProtocol, never a panic. The appenders panic
// only on misuse by the caller (a type they do not encode, a path longer
// than MaxPathLen) and do not allocate when dst has room.
package wire
