//go:build !(armbe || arm64be || m68k || mips || mips64 || mips64p32 || ppc || ppc64 || s390 || s390x || shbe || sparc || sparc64)

package buffer

// flagShift is the left shift that moves the flags byte (slice header +16)
// to its place in the native-order u32 word at +16..+19 that the atomics
// use: on a little-endian host the first byte is the low byte.
const flagShift = 0
