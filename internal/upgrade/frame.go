package upgrade

import (
	"encoding/binary"
	"fmt"
	"io"
	"net"
)

// A frame of the upgrade socket (docs/protocol.md section 14): 16 bytes,
// big-endian.
//
//	+0  magic    u32  frameMagic ("SLUP")
//	+4  version  u8   frameVersion
//	+5  op       u8   opRequest, opGrant, opRefuse or opReady
//	+6  reserved u16  0
//	+8  arg      u64  request: the new process's pid; grant: its epoch;
//	                  refuse: refuseBusy, refuseClosing or refuseFailed;
//	                  ready: 0
const (
	frameMagic   = 0x534c5550 // "SLUP"
	frameVersion = 1

	offVersion = 4              // u8
	offOp      = offVersion + 1 // u8
	offArg     = offOp + 1 + 2  // u64, after the reserved u16
	frameLen   = offArg + 8     // 16 bytes
)

// op is the operation byte of a frame.
type op uint8

// The ops, in the order of a handover.
const (
	opRequest op = 1 // new -> old: hand the listener over; arg: the new process's pid
	opGrant   op = 2 // old -> new: granted, the listeners follow; arg: the new epoch
	opRefuse  op = 3 // old -> new: refused, and closed; arg: the reason
	opReady   op = 4 // new -> old: the new process accepts now; arg: 0
)

// String names o for errors and logs: "request", "grant", "refuse",
// "ready", or its number.
func (o op) String() string {
	switch o {
	case opRequest:
		return "request"
	case opGrant:
		return "grant"
	case opRefuse:
		return "refuse"
	case opReady:
		return "ready"
	}
	return fmt.Sprintf("%d", uint8(o))
}

// Reasons of a refuse frame.
const (
	refuseBusy    = 1 // a handover is underway, or the previous generation drains
	refuseClosing = 2 // the listener is being closed
	refuseFailed  = 3 // the old process could not make the sockets to send; it serves on
)

// writeFrame writes one frame of op with arg to c.
func writeFrame(c net.Conn, o op, arg uint64) error {
	var b [frameLen]byte
	binary.BigEndian.PutUint32(b[0:], frameMagic)
	b[offVersion], b[offOp] = frameVersion, byte(o)
	binary.BigEndian.PutUint64(b[offArg:], arg)
	_, err := c.Write(b[:])
	return err
}

// readFrame reads one frame from c, exactly its 16 bytes: a
// descriptor-carrying message may follow. A bad magic or version is an
// error wrapping ErrFrame; the reserved bytes are not checked.
func readFrame(c net.Conn) (o op, arg uint64, err error) {
	var b [frameLen]byte
	if _, err := io.ReadFull(c, b[:]); err != nil {
		return 0, 0, err
	}
	if m := binary.BigEndian.Uint32(b[0:]); m != frameMagic || b[offVersion] != frameVersion {
		return 0, 0, fmt.Errorf("%w: magic %#x version %d", ErrFrame, m, b[offVersion])
	}
	return op(b[offOp]), binary.BigEndian.Uint64(b[offArg:]), nil
}

// readOp reads one frame from c and returns its arg if its op is want,
// and an error wrapping ErrFrame otherwise.
func readOp(c net.Conn, want op) (uint64, error) {
	o, arg, err := readFrame(c)
	if err == nil && o != want {
		err = fmt.Errorf("%w: op %v, want %v", ErrFrame, o, want)
	}
	return arg, err
}
