package buffer

import (
	"bufio"
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"strconv"
	"sync"
	"testing"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"
)

// peerEnv makes the test binary run as the peer process of
// TestTwoProcesses instead of running tests (the pattern of
// go/src/internal/fuzz/worker_test.go).
const peerEnv = "SHMLINK_BUFFER_TEST_PEER"

func TestMain(m *testing.M) {
	if iters := os.Getenv(peerEnv); iters != "" {
		n, _ := strconv.Atoi(iters)
		if err := runPeer(n); err != nil {
			fmt.Fprintln(os.Stderr, "peer:", err)
			os.Exit(1)
		}
		os.Exit(0)
	}
	os.Exit(m.Run())
}

// message is what the test process sends the peer for each chain: its
// head, size and pattern seed.
type message struct {
	Head uint32
	Size uint32
	Seed uint32
}

// churn allocates and frees iters slices of r, stamping each with a mark
// unique to this process and goroutine and checking it before the free, so
// that a slice handed to both processes at once shows.
func churn(r *Region, iters int, mark uint32) error {
	sizes := []int{1, 100, 1000, 4, 124, 1}
	var held []uint32
	for i := range iters {
		off, err := r.Alloc(sizes[i%len(sizes)])
		if err != nil {
			return err
		}
		d, _ := r.dataAt(off)
		binary.NativeEndian.PutUint32(d, mark)
		held = append(held, off)
		if len(held) > i%5 {
			off := held[0]
			held = held[1:]
			if d, _ := r.dataAt(off); binary.NativeEndian.Uint32(d) != mark {
				return fmt.Errorf("slice %d: mark %#x, want %#x: handed out twice", off, binary.NativeEndian.Uint32(d), mark)
			}
			if err := r.Free(off); err != nil {
				return err
			}
		}
	}
	for _, off := range held {
		if err := r.Free(off); err != nil {
			return err
		}
	}
	return nil
}

// runPeer is the peer process: it attaches the region on fd 3, churns it
// on two goroutines, and reads, checks and frees the chains whose heads
// arrive on stdin.
func runPeer(iters int) error {
	f := os.NewFile(3, "region")
	mem, err := unix.Mmap(int(f.Fd()), 0, defaultRegionSize, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		return err
	}
	r, err := Attach(mem)
	if err != nil {
		return err
	}
	var wg sync.WaitGroup
	errs := make(chan error, 3)
	for g := range 2 {
		wg.Go(func() { errs <- churn(r, iters, 0xbeef0000|uint32(g)) })
	}
	wg.Go(func() {
		in := bufio.NewReader(os.Stdin)
		var c ChainReader
		buf := make([]byte, 64<<10)
		for {
			var m message
			if err := binary.Read(in, binary.NativeEndian, &m); err != nil {
				if err != io.EOF {
					errs <- err
				}
				return
			}
			if err := c.Reset(r, m.Head); err != nil {
				errs <- err
				return
			}
			if _, err := io.ReadFull(chainIO{&c}, buf[:m.Size]); err != nil {
				errs <- err
				return
			}
			if !bytes.Equal(buf[:m.Size], pattern(int(m.Size), byte(m.Seed))) {
				errs <- errors.New("chain payload differs")
				return
			}
			if _, err := r.FreeChain(m.Head); err != nil {
				errs <- err
				return
			}
		}
	})
	wg.Wait()
	close(errs)
	return errors.Join(<-errs, <-errs, <-errs)
}

// TestTwoProcesses shares a memfd region with a peer process: both churn
// the free lists at once, and the peer receives, checks and recycles the
// chains this process writes, as a session's receiver does.
func TestTwoProcesses(t *testing.T) {
	if testing.Short() {
		t.Skip("re-executes the test binary")
	}
	fd, err := unix.MemfdCreate("shmlink-buffer-test", unix.MFD_CLOEXEC)
	require.NoError(t, err)
	f := os.NewFile(uintptr(fd), "region")
	defer f.Close()
	require.NoError(t, f.Truncate(defaultRegionSize))
	mem, err := unix.Mmap(fd, 0, defaultRegionSize, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	require.NoError(t, err)
	defer unix.Munmap(mem)
	// Long lists: see concurrentClasses. The test pops about 10000, 7000
	// and 8000 slices from them, well under their caps.
	r, err := Format(mem, concurrentClasses)
	require.NoError(t, err)

	const iters = 5000
	cmd := selfCommand("-test.run=^$")
	cmd.Env = append(os.Environ(), peerEnv+"="+strconv.Itoa(iters))
	cmd.ExtraFiles = []*os.File{f}
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	stdin, err := cmd.StdinPipe()
	require.NoError(t, err)
	require.NoError(t, cmd.Start())

	var wg sync.WaitGroup
	errs := make(chan error, 3)
	for g := range 2 {
		wg.Go(func() { errs <- churn(r, iters, 0xcafe0000|uint32(g)) })
	}
	wg.Go(func() {
		defer stdin.Close()
		var w ChainWriter
		w.Reset(r)
		out := bufio.NewWriter(stdin)
		for i := range 500 {
			m := message{Size: uint32(1 + i*131%(16<<10)), Seed: uint32(i)}
			if _, err := w.Write(pattern(int(m.Size), byte(m.Seed))); err != nil {
				errs <- err
				return
			}
			head, _ := w.Finish()
			m.Head = head
			if err := binary.Write(out, binary.NativeEndian, m); err != nil {
				errs <- err
				return
			}
		}
		errs <- out.Flush()
	})
	wg.Wait()
	close(errs)
	for err := range errs {
		require.NoError(t, err)
	}
	require.NoError(t, cmd.Wait(), "peer: %s", stderr.String())
	require.Equal(t, []int{0, 0, 0}, r.InUse())
}

// selfCommand returns the command that runs this test binary with args,
// through the emulator named by SHMLINK_TEST_EMULATOR if set (a binary of
// another architecture, run under qemu-user without binfmt_misc, cannot
// exec itself directly).
func selfCommand(args ...string) *exec.Cmd {
	if em := os.Getenv("SHMLINK_TEST_EMULATOR"); em != "" {
		return exec.Command(em, append([]string{os.Args[0]}, args...)...)
	}
	return exec.Command(os.Args[0], args...)
}
