package shm

import (
	"fmt"
	"os"
	"sync"

	"golang.org/x/sys/unix"
)

// claimed holds the files that sessions of this process map from their
// peers. It is the package's one piece of state shared by the process: a
// peer that names the files of another live session must be refused
// whichever listener or session that is, and sessions share nothing else.
var claimed = struct {
	sync.Mutex
	ids map[FileID]struct{}
}{ids: make(map[FileID]struct{})}

// Claim records that a session maps the shared memory behind fd, a file
// or memfd it got from its peer, and returns the function that forgets it
// (call it once the mapping is gone; later calls do nothing). It fails
// with an error wrapping ErrClaimed when another session of this process
// maps that file already: a peer naming the files of another session
// would read and consume its events.
func Claim(fd int) (release func(), err error) {
	id, err := IDOf(fd)
	if err != nil {
		return nil, err
	}
	claimed.Lock()
	defer claimed.Unlock()
	if _, ok := claimed.ids[id]; ok {
		return nil, fmt.Errorf("%w: device %d inode %d", ErrClaimed, id.Dev, id.Ino)
	}
	claimed.ids[id] = struct{}{}
	var once sync.Once
	return func() {
		once.Do(func() {
			claimed.Lock()
			delete(claimed.ids, id)
			claimed.Unlock()
		})
	}, nil
}

// IDOf returns the file behind fd; it fails if fstat does.
func IDOf(fd int) (FileID, error) {
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		return FileID{}, os.NewSyscallError("fstat", err)
	}
	return FileID{uint64(st.Dev), uint64(st.Ino)}, nil
}
