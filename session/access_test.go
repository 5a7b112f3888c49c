package session

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"
	"unsafe"

	"github.com/shmlink/shmlink/internal/wire"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"
)

// fileHandshake plays a client that names meta in a file-path handshake,
// v3 over a Unix socket or v2 over a pipe, and returns the server's result.
func fileHandshake(t *testing.T, unixSocket bool, cfg *Config, meta wire.ShmMetadata) error {
	var cc, sc net.Conn
	if unixSocket {
		cc, sc = socketPair(t)
	} else {
		cc, sc = net.Pipe()
	}
	defer cc.Close()
	done := make(chan error, 1)
	go func() {
		s, err := Server(sc, cfg)
		if err == nil {
			s.Close()
		}
		done <- err
	}()
	if unixSocket {
		_, err := cc.Write(wire.AppendSimple(nil, 3, wire.TypeExchangeProtoVersion))
		require.NoError(t, err)
		readN(t, cc, 8)
		_, err = cc.Write(wire.AppendShareMemory(nil, 3, wire.TypeShareMemoryByFilePath, meta))
		require.NoError(t, err)
	} else {
		_, err := cc.Write(wire.AppendShareMemory(nil, 2, wire.TypeShareMemoryByFilePath, meta))
		require.NoError(t, err)
	}
	return <-done
}

// fileState is what must not change about a file the server must not touch.
type fileState struct {
	mode    os.FileMode
	size    int64
	mtime   time.Time
	ino     uint64
	uid     uint32
	content []byte // regular files only
}

func stateOf(t *testing.T, path string) fileState {
	fi, err := os.Lstat(path)
	require.NoError(t, err)
	st := fi.Sys().(*syscall.Stat_t)
	s := fileState{mode: fi.Mode(), size: fi.Size(), mtime: fi.ModTime(), ino: st.Ino, uid: st.Uid}
	if fi.Mode().IsRegular() {
		s.content, err = os.ReadFile(path)
		require.NoError(t, err)
	}
	return s
}

// untouched proves, with inotify, that nothing opens (or, for a file other
// processes may read, such as /etc/passwd: nothing writes, modifies or
// changes the attributes of) the watched files between its creation and
// check, and that their metadata and content are the same at the end.
type untouched struct {
	fd     int
	paths  map[int32]string // by watch descriptor
	before map[string]fileState
}

func watchUntouched(t *testing.T, paths []string, shared map[string]bool) *untouched {
	u := &untouched{paths: make(map[int32]string), before: make(map[string]fileState)}
	for _, p := range paths {
		u.before[p] = stateOf(t, p) // before watching: this reads the file
	}
	fd, err := unix.InotifyInit1(unix.IN_CLOEXEC | unix.IN_NONBLOCK)
	require.NoError(t, err)
	u.fd = fd
	t.Cleanup(func() { unix.Close(fd) })
	for _, p := range paths {
		mask := uint32(unix.IN_MODIFY | unix.IN_ATTRIB | unix.IN_CLOSE_WRITE)
		if !shared[p] {
			mask |= unix.IN_OPEN
		}
		wd, err := unix.InotifyAddWatch(fd, p, mask|unix.IN_DONT_FOLLOW)
		require.NoError(t, err)
		u.paths[int32(wd)] = p
	}
	return u
}

// check fails the test if a watched file was touched. Events are queued by
// the system call that causes them, so those of a handshake that has
// returned are all there.
func (u *untouched) check(t *testing.T) {
	t.Helper()
	buf := make([]byte, 64<<10)
	n, err := unix.Read(u.fd, buf)
	if !errors.Is(err, unix.EAGAIN) {
		require.NoError(t, err)
		var got []string
		for off := 0; off+unix.SizeofInotifyEvent <= n; {
			ev := (*unix.InotifyEvent)(unsafe.Pointer(&buf[off]))
			got = append(got, fmt.Sprintf("%s: mask %#x", u.paths[ev.Wd], ev.Mask))
			off += unix.SizeofInotifyEvent + int(ev.Len)
		}
		require.Empty(t, got, "touched")
	}
	for p, before := range u.before {
		require.Equal(t, before, stateOf(t, p), "%s changed", p)
	}
}

func openFdCount(t *testing.T) int {
	entries, err := os.ReadDir("/proc/self/fd")
	require.NoError(t, err)
	return len(entries)
}

// A file-path handshake may only name regular files directly inside
// ShmDir that belong to the peer's uid. Everything else is refused with
// ErrPathRefused before it is opened: inotify sees no open of the target,
// and the target is unchanged. Over v2 (a pipe: the peer's uid is ours)
// and v3 (a Unix socket: SO_PEERCRED), with the bad path in either
// position.
func TestServerRefusesPaths(t *testing.T) {
	dir := t.TempDir()   // ShmDir
	other := t.TempDir() // a sibling of dir: outside it
	victim := filepath.Join(other, "victim")
	require.NoError(t, os.WriteFile(victim, []byte("must not be touched"), 0o600))
	good := filepath.Join(dir, "good")
	require.NoError(t, os.WriteFile(good, make([]byte, 4096), 0o600))
	link := filepath.Join(dir, "link")
	require.NoError(t, os.Symlink(victim, link))
	subdir := filepath.Join(dir, "subdir")
	require.NoError(t, os.Mkdir(subdir, 0o700))
	fifo := filepath.Join(dir, "fifo")
	require.NoError(t, unix.Mkfifo(fifo, 0o600))

	// A file of another uid in ShmDir. As root (the CI) we make one; as
	// another user, /etc/passwd is one (root's) directly inside /etc.
	theirDir, theirs := dir, filepath.Join(dir, "theirs")
	if os.Geteuid() == 0 {
		require.NoError(t, os.WriteFile(theirs, []byte("nobody's"), 0o600))
		require.NoError(t, os.Chown(theirs, 65534, 65534))
	} else {
		theirDir, theirs = "/etc", "/etc/passwd"
	}

	cases := []struct {
		name   string
		shmDir string
		path   string   // the refused path
		watch  []string // files that must stay untouched
		why    string
	}{
		{"/etc/passwd", dir, "/etc/passwd", []string{"/etc/passwd"}, "outside"},
		{"outside ShmDir", dir, victim, []string{victim}, "outside"},
		{"dot-dot to outside", dir, dir + "/../" + filepath.Base(other) + "/victim", []string{victim}, "outside"},
		{"dot-dot back inside", dir, dir + "/../" + filepath.Base(dir) + "/good", nil, "outside"},
		{"dot-dot to /etc/passwd", dir, dir + "/../../../../../../../../etc/passwd", []string{"/etc/passwd"}, "outside"},
		{"symlink to outside", dir, link, []string{victim, link}, "symbolic link"},
		{"file of another uid", theirDir, theirs, []string{theirs}, "owned by uid"},
		{"directory", dir, subdir, []string{subdir}, "directory"},
		{"FIFO", dir, fifo, []string{fifo}, "FIFO"},
	}
	for _, tc := range cases {
		for _, unixSocket := range []bool{true, false} {
			for _, second := range []bool{false, true} {
				name := fmt.Sprintf("%s/v2/buffer", tc.name)
				if unixSocket {
					name = strings.Replace(name, "v2", "v3", 1)
				}
				if second {
					name = strings.Replace(name, "buffer", "queue", 1)
				}
				t.Run(name, func(t *testing.T) {
					shared := map[string]bool{"/etc/passwd": true}
					u := watchUntouched(t, tc.watch, shared)
					meta := wire.ShmMetadata{BufferPath: tc.path, QueuePath: tc.path}
					if tc.shmDir == dir {
						// The other path is fine: the refusal is the bad one's.
						if second {
							meta.BufferPath = good
						} else {
							meta.QueuePath = good
						}
					}
					fds := openFdCount(t)
					err := fileHandshake(t, unixSocket, &Config{ShmDir: tc.shmDir, HandshakeTimeout: 10 * time.Second}, meta)
					require.ErrorIs(t, err, ErrPathRefused)
					require.ErrorIs(t, err, ErrHandshake)
					require.Contains(t, err.Error(), tc.why)
					require.Contains(t, err.Error(), tc.path)
					u.check(t)
					require.Equal(t, fds, openFdCount(t), "descriptors left open")
				})
			}
		}
	}
}

// The same harness accepts a real client's files (ours, in ShmDir), so the
// refusals above are about the paths, not the harness.
func TestServerAcceptsOwnFiles(t *testing.T) {
	for _, unixSocket := range []bool{true, false} {
		t.Run(fmt.Sprintf("unix=%v", unixSocket), func(t *testing.T) {
			dir := t.TempDir()
			cfg := &Config{ShmDir: dir, MemoryType: MemoryFile, BufferSize: 4 << 20, QueueCap: 64}
			var cc, sc net.Conn
			if unixSocket {
				cc, sc = socketPair(t)
			} else {
				cc, sc = net.Pipe()
			}
			type result struct {
				s   *Session
				err error
			}
			done := make(chan result, 1)
			go func() {
				s, err := Client(cc, cfg)
				done <- result{s, err}
			}()
			s, err := Server(sc, cfg)
			require.NoError(t, err)
			r := <-done
			require.NoError(t, r.err)
			require.NoError(t, r.s.Close())
			require.NoError(t, s.Close())
		})
	}
}

// What the client handshake creates is mode 0600 and close-on-exec: the
// memfds (v3) and the files (v3 with a path), inspected while the client
// waits for the server's next message and still holds them.
func TestClientSharedMemoryModes(t *testing.T) {
	for _, mt := range []MemoryType{MemoryMemfd, MemoryFile} {
		t.Run(mt.String(), func(t *testing.T) {
			dir := t.TempDir()
			cc, sc := socketPair(t)
			defer sc.Close()
			type result struct {
				s   *Session
				err error
			}
			done := make(chan result, 1)
			go func() {
				s, err := Client(cc, &Config{MemoryType: mt, ShmDir: dir, BufferSize: 4 << 20, QueueCap: 64})
				done <- result{s, err}
			}()
			readN(t, sc, 8) // ExchangeProtoVersion
			_, err := sc.Write(wire.AppendSimple(nil, 3, wire.TypeExchangeProtoVersion))
			require.NoError(t, err)
			hdr := readN(t, sc, 8)
			meta, err := wire.ParseShmMetadata(readN(t, sc, int(binary.BigEndian.Uint32(hdr))-8))
			require.NoError(t, err)

			// The client now waits for AckReadyRecvFD or AckShareMemory,
			// holding both descriptors.
			want := map[string]string{meta.BufferPath: "buffer", meta.QueuePath: "queue"}
			if mt == MemoryMemfd {
				want = map[string]string{
					"/memfd:shmipc" + meta.BufferPath + " (deleted)": "buffer",
					"/memfd:shmipc" + meta.QueuePath + " (deleted)":  "queue",
				}
			}
			found := map[string]bool{}
			entries, err := os.ReadDir("/proc/self/fd")
			require.NoError(t, err)
			for _, e := range entries {
				target, err := os.Readlink("/proc/self/fd/" + e.Name())
				if err != nil || want[target] == "" {
					continue
				}
				fd, err := strconv.Atoi(e.Name())
				require.NoError(t, err)
				var st unix.Stat_t
				require.NoError(t, unix.Fstat(fd, &st))
				require.Equal(t, uint32(0o600), st.Mode&0o7777, "%s mode", want[target])
				require.EqualValues(t, os.Geteuid(), st.Uid)
				flags, err := unix.FcntlInt(uintptr(fd), unix.F_GETFD, 0)
				require.NoError(t, err)
				require.NotZero(t, flags&unix.FD_CLOEXEC, "%s close-on-exec", want[target])
				found[want[target]] = true
			}
			require.Equal(t, map[string]bool{"buffer": true, "queue": true}, found)
			if mt == MemoryFile {
				for _, p := range []string{meta.BufferPath, meta.QueuePath} {
					fi, err := os.Lstat(p)
					require.NoError(t, err)
					require.Equal(t, os.FileMode(0o600), fi.Mode(), p)
				}
			} else {
				_, err = sc.Write(wire.AppendSimple(nil, 3, wire.TypeAckReadyRecvFD))
				require.NoError(t, err)
				fds := make([]int, 0, 2)
				data, oob := make([]byte, 1), make([]byte, 64)
				_, oobn, _, _, err := sc.ReadMsgUnix(data, oob)
				require.NoError(t, err)
				msgs, err := unix.ParseSocketControlMessage(oob[:oobn])
				require.NoError(t, err)
				for _, m := range msgs {
					got, err := unix.ParseUnixRights(&m)
					require.NoError(t, err)
					fds = append(fds, got...)
				}
				require.Len(t, fds, 2)
				for _, fd := range fds {
					var st unix.Stat_t
					require.NoError(t, unix.Fstat(fd, &st))
					require.Equal(t, uint32(0o600), st.Mode&0o7777, "memfd as received")
					unix.Close(fd)
				}
			}
			_, err = sc.Write(wire.AppendSimple(nil, 3, wire.TypeAckShareMemory))
			require.NoError(t, err)
			r := <-done
			require.NoError(t, r.err)
			require.NoError(t, r.s.Close())
		})
	}
}

// Peer credentials on a Unix socket: refused by AllowUIDs or PeerCheck on
// either side before any handshake byte, allowed by default for our own
// uid, not checked on a connection without credentials.
func TestPeerCredentials(t *testing.T) {
	me := PeerCred{PID: os.Getpid(), UID: os.Geteuid(), GID: os.Getegid()}
	errPolicy := errors.New("refused by the test's policy")
	refuse := func(PeerCred) error { return errPolicy }
	for _, tc := range []struct {
		name       string
		server     *Config
		client     *Config
		refusedBy  string // "server", "client" or ""
		policyErr  bool   // the error wraps errPolicy
		clientSays string // in the client's error when the server refused
	}{
		{name: "default allows our uid"},
		{name: "AllowUIDs with our uid", server: &Config{AllowUIDs: []int{12345, me.UID}}, client: &Config{AllowUIDs: []int{me.UID}}},
		{name: "server AllowUIDs", server: &Config{AllowUIDs: []int{12345}}, refusedBy: "server", clientSays: "the server closed the connection"},
		{name: "server PeerCheck", server: &Config{PeerCheck: refuse}, refusedBy: "server", policyErr: true},
		{name: "client AllowUIDs", client: &Config{AllowUIDs: []int{12345}}, refusedBy: "client"},
		{name: "client PeerCheck", client: &Config{PeerCheck: refuse}, refusedBy: "client", policyErr: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cc, sc := socketPair(t)
			type result struct {
				s   *Session
				err error
			}
			done := make(chan result, 1)
			go func() {
				s, err := Server(sc, tc.server)
				done <- result{s, err}
			}()
			cs, cerr := Client(cc, tc.client)
			r := <-done
			switch tc.refusedBy {
			case "":
				require.NoError(t, cerr)
				require.NoError(t, r.err)
				require.NoError(t, cs.Close())
				require.NoError(t, r.s.Close())
				return
			case "server":
				require.Error(t, cerr, "the server closed the connection")
				require.NotErrorIs(t, cerr, os.ErrDeadlineExceeded, "refused at once, not timed out")
				require.Contains(t, cerr.Error(), tc.clientSays)
				cerr, r.err = r.err, cerr
			case "client":
				if r.s != nil {
					r.s.Close()
				}
			}
			err := cerr // the refusing side's error
			require.ErrorIs(t, err, ErrPeerRefused)
			require.ErrorIs(t, err, ErrHandshake)
			var pe *PeerError
			require.ErrorAs(t, err, &pe)
			require.Equal(t, me, pe.Cred, "both ends are this process")
			if tc.policyErr {
				require.ErrorIs(t, err, errPolicy)
			} else {
				require.Contains(t, err.Error(), "uid "+strconv.Itoa(me.UID))
			}
		})
	}

	// No credentials on a pipe (or TCP): PeerCheck is not called.
	cc, sc := net.Pipe()
	called := make(chan PeerCred, 2)
	cfg := &Config{ShmDir: t.TempDir(), PeerCheck: func(c PeerCred) error { called <- c; return errPolicy }}
	done := make(chan error, 1)
	var ss *Session
	go func() {
		var err error
		ss, err = Server(sc, cfg)
		done <- err
	}()
	cs, err := Client(cc, cfg)
	require.NoError(t, err)
	require.NoError(t, <-done)
	require.Empty(t, called)
	cs.Close()
	ss.Close()
}

// A client refused by its own check creates no shared memory.
func TestClientRefusesBeforeCreating(t *testing.T) {
	dir := t.TempDir()
	cc, sc := socketPair(t)
	defer sc.Close()
	_, err := Client(cc, &Config{ShmDir: dir, MemoryType: MemoryFile, AllowUIDs: []int{12345}})
	require.ErrorIs(t, err, ErrPeerRefused)
	entries, err := os.ReadDir(dir)
	require.NoError(t, err)
	require.Empty(t, entries)
	// The client closed the connection without a byte.
	b, err := io.ReadAll(sc)
	require.NoError(t, err)
	require.Empty(t, b)
}

func TestConfigAccessValidate(t *testing.T) {
	for _, tc := range []struct {
		cfg    Config
		reason string
	}{
		{Config{AllowUIDs: []int{-1}}, "out of range"},
		{Config{AllowUIDs: []int{1 << 32}}, "out of range"},
		{Config{AllowUIDs: []int{0}, PeerCheck: func(PeerCred) error { return nil }}, "not both"},
	} {
		err := tc.cfg.Validate()
		var ce *ConfigError
		require.ErrorAs(t, err, &ce)
		require.Equal(t, "AllowUIDs", ce.Field)
		require.Contains(t, ce.Reason, tc.reason)
	}
	require.NoError(t, (&Config{AllowUIDs: []int{0, 65534}}).Validate())

	// The list is copied when a session starts.
	uids := []int{os.Geteuid()}
	c := (&Config{AllowUIDs: uids}).withDefaults()
	uids[0] = 12345
	require.Equal(t, []int{os.Geteuid()}, c.AllowUIDs)
}
