package session

import (
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"path/filepath"
	"runtime/debug"
	"strings"
	"syscall"
	"time"

	"github.com/shmlink/shmlink/buffer"
	"github.com/shmlink/shmlink/internal/shm"
	"github.com/shmlink/shmlink/internal/wire"
	"github.com/shmlink/shmlink/queue"
)

// maxHandshakeMessage bounds a handshake message: header, two length
// prefixes and two paths.
const maxHandshakeMessage = wire.HeaderSize + 2 + wire.MaxPathLen + 2 + wire.MaxPathLen

// memory is the shared memory of one session: the buffer region and the IO
// queue, both mapped, plus the files to remove when the session ends.
type memory struct {
	bufMem, queueMem []byte
	region           *buffer.Region
	send, recv       *queue.Ring
	remove           []string   // file paths this side created and still has to unlink
	sealed           bool       // the peer cannot shrink the memory (shm.SealShrink)
	features         uint32     // what the peer marked: a client's server (markedFeatures), a server's client (clientFeatures)
	unclaim          []func()   // a server's shm.Claim of the peer's files, undone on release
	queueID          shm.FileID // the queue's file: created by a client, mapped by a server
	queueKnown       bool       // queueID was read
}

// release unmaps both mappings and removes the files still owned.
func (m *memory) release() {
	shm.Unmap(m.bufMem)
	shm.Unmap(m.queueMem)
	for _, p := range m.remove {
		os.Remove(p)
	}
	for _, f := range m.unclaim {
		f()
	}
	*m = memory{}
}

// randomName returns a name for shared-memory objects that another local
// user cannot predict: "shmlink_<pid>_e<epoch>_<16 hex digits>", where
// epoch is the server generation's hot-restart epoch (Config.Epoch), so
// that the objects of two generations never share a name; the pid tells a
// person whose they are.
func randomName(epoch uint64) string {
	var b [8]byte
	rand.Read(b[:])
	return fmt.Sprintf("shmlink_%d_e%d_%s", os.Getpid(), epoch, hex.EncodeToString(b[:]))
}

// removeStale removes, from dir, the shared-memory files of earlier
// clients that died (kill -9, a crash) before their server spoke: files
// named by randomName, of our uid, whose owner's lock is gone
// (shm.RemoveStale: unlike a pid, the lock holds across pid namespaces,
// for containers that share dir, and a file being created holds it
// already). Errors are ignored: a file that stays is only wasted space.
func removeStale(dir string) {
	entries, err := os.ReadDir(dir)
	if err != nil {
		return
	}
	uid := os.Geteuid()
	for _, e := range entries {
		if !strings.HasPrefix(e.Name(), "shmlink_") || !e.Type().IsRegular() {
			continue
		}
		info, err := e.Info()
		if err != nil {
			continue
		}
		if st, ok := info.Sys().(*syscall.Stat_t); ok && int(st.Uid) == uid {
			shm.RemoveStale(filepath.Join(dir, e.Name()))
		}
	}
}

// handshakeError wraps err as a handshake failure of op.
func handshakeError(op string, err error) error {
	return &SessionError{Op: "handshake", Err: fmt.Errorf("%w: %s: %w", ErrHandshake, op, err)}
}

// clientHandshake creates the client's buffer region and IO queue, shares
// them with the server over conn (docs/protocol.md section 1.4), and
// returns the negotiated version. On error everything it created is
// released; conn is left to the caller.
func clientHandshake(conn net.Conn, cfg *Config) (_ *memory, version uint8, err error) {
	return clientHandshakeMarking(conn, cfg, true)
}

// clientHandshakeMarking is clientHandshake that writes the client's
// marker into its region (marker.go) only if mark is set; tests play
// clients of other kinds with it.
func clientHandshakeMarking(conn net.Conn, cfg *Config, mark bool) (_ *memory, version uint8, err error) {
	uc, isUnix := conn.(*net.UnixConn)
	if _, err := checkPeer(conn, cfg); err != nil {
		return nil, 0, err
	}
	mt := cfg.MemoryType
	if mt == MemoryAuto {
		mt = MemoryFile
		if isUnix {
			mt = MemoryMemfd
		}
	}
	defer explainClose(&err, mt, cfg.ShmDir)
	if mt == MemoryMemfd && !isUnix {
		return nil, 0, handshakeError("config", errors.New("memfd needs a Unix socket"))
	}
	if err := conn.SetDeadline(time.Now().Add(cfg.HandshakeTimeout)); err != nil {
		return nil, 0, handshakeError("set deadline", err)
	}
	defer conn.SetDeadline(time.Time{})

	name := randomName(cfg.Epoch)
	meta := wire.ShmMetadata{
		QueuePath:  filepath.Join(cfg.ShmDir, name+"_queue_0"),
		BufferPath: filepath.Join(cfg.ShmDir, name+"_buffer"),
	}
	mem, files, err := createShared(cfg, mt, meta)
	if err != nil {
		return nil, 0, err
	}
	defer closeFiles(files)
	if mark {
		// Our own fresh mapping, whose blocks are allocated; guarded for
		// a file system without fallocate, as createShared's format.
		if err = guard(func() error { markClientRegion(mem.bufMem); return nil }); err != nil {
			mem.release()
			return nil, 0, handshakeError("marker", err)
		}
	}
	if version, err = shareV3(conn, uc, mt, meta, files); err != nil {
		mem.release()
		return nil, 0, err
	}
	if err = guard(func() error { mem.features = markedFeatures(mem.bufMem); return nil }); err != nil {
		mem.release()
		return nil, 0, handshakeError("marker", err)
	}
	// The server has mapped both: the names are no longer needed.
	for _, p := range mem.remove {
		os.Remove(p)
	}
	mem.remove = nil
	return mem, version, nil
}

// createShared creates, maps and formats the buffer region and the IO
// queue of a client, as memfds or as files at meta's paths. It returns the
// open files, buffer first, which the caller closes. On error everything
// it created is released.
func createShared(cfg *Config, mt MemoryType, meta wire.ShmMetadata) (*memory, []*os.File, error) {
	mem := &memory{}
	var files []*os.File
	fail := func(op string, err error) (*memory, []*os.File, error) {
		closeFiles(files)
		mem.release()
		return nil, nil, handshakeError(op, err)
	}
	if mt == MemoryFile {
		removeStale(cfg.ShmDir)
	}
	queueSize := queue.Size(cfg.QueueCap)
	for _, f := range []struct {
		what, path string
		size       int
	}{{"buffer", meta.BufferPath, cfg.BufferSize}, {"queue", meta.QueuePath, queueSize}} {
		var file *os.File
		var err error
		if mt == MemoryMemfd {
			file, err = shm.CreateMemfd("shmipc"+f.path, f.size)
		} else if file, err = shm.CreateFile(f.path, f.size); err == nil {
			mem.remove = append(mem.remove, f.path)
		}
		if err != nil {
			return fail("create "+f.what, err)
		}
		files = append(files, file)
	}
	var err error
	if mem.bufMem, err = shm.Map(int(files[0].Fd()), cfg.BufferSize); err != nil {
		return fail("map buffer", err)
	}
	if mem.queueMem, err = shm.Map(int(files[1].Fd()), queueSize); err != nil {
		return fail("map queue", err)
	}
	// Our memfds are sealed (shm.CreateMemfd): the peer cannot shrink them.
	mem.sealed = mt == MemoryMemfd
	var idErr error
	mem.queueID, idErr = shm.IDOf(int(files[1].Fd()))
	mem.queueKnown = idErr == nil
	// Formatting writes a header into every slice. A file's blocks were
	// allocated when it was created (shm.CreateFile), but on a file
	// system without fallocate a write may still find no room and fault:
	// the guard makes that an error (fault.go).
	err = guard(func() error {
		// The last markerSize bytes stay out of the region, for the
		// client's marker (clientHandshakeMarking) and then the server's
		// (marker.go).
		var err error
		if mem.region, err = buffer.Format(mem.bufMem[:len(mem.bufMem)-markerSize], cfg.SizeClasses); err != nil {
			return fmt.Errorf("buffer: %w", err)
		}
		// The client sends on the first half and receives on the second
		// (docs/protocol.md section 3).
		if mem.send, mem.recv, err = queue.FormatPair(mem.queueMem, cfg.QueueCap); err != nil {
			return fmt.Errorf("queue: %w", err)
		}
		return nil
	})
	if err != nil {
		return fail("format", err)
	}
	return mem, files, nil
}

// shareV3 runs the v3 exchange of a client (docs/protocol.md section 1.4):
// versions, then the memory by memfd (files: buffer, queue) or by path,
// then the server's ack. It returns the negotiated version.
func shareV3(conn net.Conn, uc *net.UnixConn, mt MemoryType, meta wire.ShmMetadata, files []*os.File) (uint8, error) {
	if _, err := conn.Write(wire.AppendSimple(nil, wire.ProtocolVersion, wire.TypeExchangeProtoVersion)); err != nil {
		return 0, handshakeError("send version", err)
	}
	h, err := readHandshakeHeader(conn, wire.TypeExchangeProtoVersion)
	if err != nil {
		return 0, err
	}
	version := min(h.Version, wire.ProtocolVersion)
	if version < 3 {
		return 0, handshakeError("version", fmt.Errorf("server speaks version %d; this client speaks v3 only", h.Version))
	}
	if mt == MemoryMemfd {
		if _, err = conn.Write(wire.AppendShareMemory(nil, version, wire.TypeShareMemoryByMemfd, meta)); err != nil {
			return 0, handshakeError("send metadata", err)
		}
		if _, err = readHandshakeHeader(conn, wire.TypeAckReadyRecvFD); err != nil {
			return 0, err
		}
		// Exactly two descriptors, buffer first (section 1.4 step 5).
		if err = shm.SendFds(uc, int(files[0].Fd()), int(files[1].Fd())); err != nil {
			return 0, handshakeError("send fds", err)
		}
	} else if _, err = conn.Write(wire.AppendShareMemory(nil, version, wire.TypeShareMemoryByFilePath, meta)); err != nil {
		return 0, handshakeError("send metadata", err)
	}
	if _, err = readHandshakeHeader(conn, wire.TypeAckShareMemory); err != nil {
		return 0, err
	}
	return version, nil
}

// readHandshakeHeader reads one header-only handshake message of type want.
func readHandshakeHeader(conn net.Conn, want wire.MsgType) (wire.Header, error) {
	var b [wire.HeaderSize]byte
	if _, err := io.ReadFull(conn, b[:]); err != nil {
		return wire.Header{}, handshakeError("read "+want.String(), err)
	}
	h, err := wire.ParseHeader(b[:], wire.HeaderSize)
	if err != nil {
		return wire.Header{}, handshakeError("read "+want.String(), err)
	}
	if h.Type != want {
		return wire.Header{}, handshakeError("read "+want.String(), fmt.Errorf("%w: got %v", ErrProtocol, h.Type))
	}
	return h, nil
}

// serverHandshake answers a client's v2 or v3 handshake on conn, picking the
// variant by the type and version of the first message (docs/protocol.md
// section 1.4), and maps the client's buffer region and IO queue. On error
// nothing stays mapped or open; conn is left to the caller, who must close
// it.
func serverHandshake(conn net.Conn, cfg *Config) (mem *memory, version uint8, err error) {
	return serverHandshakeMarking(conn, cfg, true)
}

// serverHandshakeMarking is serverHandshake that writes the shmlink marker
// into a v3 client's region before AckShareMemory only if mark is set;
// tests play servers of other kinds with it.
func serverHandshakeMarking(conn net.Conn, cfg *Config, mark bool) (mem *memory, version uint8, err error) {
	// mem is only ever set on success paths below.
	peerUID, err := checkPeer(conn, cfg)
	if err != nil {
		return nil, 0, err
	}
	if err := conn.SetDeadline(time.Now().Add(cfg.HandshakeTimeout)); err != nil {
		return nil, 0, handshakeError("set deadline", err)
	}
	defer conn.SetDeadline(time.Time{})

	h, payload, err := readHandshakeMessage(conn)
	if err != nil {
		return nil, 0, err
	}
	var meta wire.ShmMetadata
	switch {
	case h.Version == 2 && h.Type == wire.TypeShareMemoryByFilePath:
		if meta, err = wire.ParseShmMetadata(payload); err != nil {
			return nil, 0, handshakeError("metadata", err)
		}
		mem, err = mapFiles(meta, cfg, peerUID)
		return mem, 2, err
	case h.Version >= 3 && h.Type == wire.TypeExchangeProtoVersion:
		version = min(h.Version, wire.ProtocolVersion)
	default:
		return nil, 0, handshakeError("first message", fmt.Errorf("%w: %v version %d", ErrProtocol, h.Type, h.Version))
	}
	if _, err = conn.Write(wire.AppendSimple(nil, wire.ProtocolVersion, wire.TypeExchangeProtoVersion)); err != nil {
		return nil, 0, handshakeError("send version", err)
	}
	if h, payload, err = readHandshakeMessage(conn); err != nil {
		return nil, 0, err
	}
	if h.Type != wire.TypeShareMemoryByMemfd && h.Type != wire.TypeShareMemoryByFilePath {
		return nil, 0, handshakeError("metadata", fmt.Errorf("%w: got %v", ErrProtocol, h.Type))
	}
	if meta, err = wire.ParseShmMetadata(payload); err != nil {
		return nil, 0, handshakeError("metadata", err)
	}
	if h.Type == wire.TypeShareMemoryByFilePath {
		mem, err = mapFiles(meta, cfg, peerUID)
	} else {
		mem, err = recvMemfds(conn, version)
	}
	if err != nil {
		return nil, 0, err
	}
	if mark {
		if err = guard(func() error {
			mem.features = clientFeatures(mem.bufMem)
			markRegion(mem.bufMem)
			return nil
		}); err != nil {
			mem.release()
			return nil, 0, handshakeError("marker", err)
		}
	}
	if _, err = conn.Write(wire.AppendSimple(nil, version, wire.TypeAckShareMemory)); err != nil {
		mem.release()
		return nil, 0, handshakeError("send ack", err)
	}
	return mem, version, nil
}

// readHandshakeMessage reads one whole handshake message, bounded by
// maxHandshakeMessage, and returns its header and payload.
func readHandshakeMessage(conn net.Conn) (wire.Header, []byte, error) {
	var b [wire.HeaderSize]byte
	if _, err := io.ReadFull(conn, b[:]); err != nil {
		return wire.Header{}, nil, handshakeError("read", err)
	}
	h, err := wire.ParseHeader(b[:], maxHandshakeMessage)
	if err != nil {
		return wire.Header{}, nil, handshakeError("read", err)
	}
	payload := make([]byte, h.Length-wire.HeaderSize)
	if _, err := io.ReadFull(conn, payload); err != nil {
		return wire.Header{}, nil, handshakeError("read", err)
	}
	return h, payload, nil
}

// recvMemfds asks for and receives the client's [buffer, queue] memfds and
// maps them.
func recvMemfds(conn net.Conn, version uint8) (*memory, error) {
	uc, ok := conn.(*net.UnixConn)
	if !ok {
		return nil, handshakeError("memfd", errors.New("memfd handshake over a non-Unix connection"))
	}
	if _, err := conn.Write(wire.AppendSimple(nil, version, wire.TypeAckReadyRecvFD)); err != nil {
		return nil, handshakeError("send ready", err)
	}
	fds, err := shm.RecvFds(uc, 2)
	if err != nil {
		return nil, handshakeError("receive fds", err)
	}
	defer shm.CloseFd(fds[0])
	defer shm.CloseFd(fds[1])
	for _, fd := range fds {
		if err := shm.CheckMemfd(fd); err != nil {
			return nil, handshakeError("memfd", err)
		}
	}
	return mapShared(fds[0], fds[1])
}

// mapFiles opens and maps the files named in meta. Both must be regular
// files directly inside cfg.ShmDir that belong to uid, the peer's; anything
// else is refused, with ErrPathRefused, before it is opened (openShared).
func mapFiles(meta wire.ShmMetadata, cfg *Config, uid int) (*memory, error) {
	var files [2]*os.File
	for i, p := range []string{meta.BufferPath, meta.QueuePath} {
		if !inDir(p, cfg.ShmDir) {
			closeFiles(files[:])
			return nil, handshakeError("metadata", fmt.Errorf("%w: %q is outside %s", ErrPathRefused, p, cfg.ShmDir))
		}
		f, err := openShared(p, uid)
		if err != nil {
			closeFiles(files[:])
			return nil, handshakeError("open", err)
		}
		files[i] = f
	}
	defer closeFiles(files[:])
	return mapShared(int(files[0].Fd()), int(files[1].Fd()))
}

func closeFiles(fs []*os.File) {
	for _, f := range fs {
		if f != nil {
			f.Close()
		}
	}
}

// inDir reports whether path names an entry directly inside dir.
func inDir(path, dir string) bool {
	return filepath.IsAbs(path) && filepath.Clean(path) == path &&
		filepath.Dir(path) == dir && !strings.HasPrefix(filepath.Base(path), ".")
}

// mapShared maps a peer's buffer region and IO queue and checks their
// layouts. A server sends on the second half of the queue (3).
func mapShared(bufFd, queueFd int) (_ *memory, err error) {
	mem := &memory{}
	defer func() {
		if err != nil {
			mem.release()
		}
	}()
	// A peer that truncates its memory under our mapping makes our next
	// access fault: seal it where the peer allows; every access goes
	// through the fault guard anyway (fault.go).
	// A file another session of ours maps belongs to that session: a
	// peer that names it would consume that session's events
	// (docs/protocol.md section 9).
	for _, fd := range []int{bufFd, queueFd} {
		release, err := shm.Claim(fd)
		if err != nil {
			return nil, handshakeError("map", fmt.Errorf("%w: %w", ErrPathRefused, err))
		}
		mem.unclaim = append(mem.unclaim, release)
	}
	mem.sealed = shm.SealShrink(bufFd) && shm.SealShrink(queueFd)
	defer catchFault(&err, debug.SetPanicOnFault(true))
	if mem.bufMem, err = shm.Map(bufFd, 0); err != nil {
		return nil, handshakeError("map buffer", err)
	}
	if mem.queueMem, err = shm.Map(queueFd, 0); err != nil {
		return nil, handshakeError("map queue", err)
	}
	var idErr error
	mem.queueID, idErr = shm.IDOf(queueFd)
	mem.queueKnown = idErr == nil
	if mem.region, err = buffer.Attach(mem.bufMem); err != nil {
		return nil, handshakeError("buffer layout", err)
	}
	if mem.recv, mem.send, err = queue.AttachPair(mem.queueMem); err != nil {
		return nil, handshakeError("queue layout", err)
	}
	return mem, nil
}
