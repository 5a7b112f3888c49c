package session

import (
	"bytes"
	"io"
	"os"
	"os/exec"
	"runtime"
	"testing"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"
)

// oneCPU holds when both processes may run only on the same single CPU,
// and, where the peer's CPUs are not known, when the host has a single CPU
// online; not when it cannot tell.
func TestOneCPU(t *testing.T) {
	set := func(cpus ...int) (s unix.CPUSet) {
		for _, c := range cpus {
			s.Set(c)
		}
		return s
	}
	online := func(n int) func() int { return func() int { return n } }
	for _, tc := range []struct {
		name      string
		own, peer unix.CPUSet
		known     bool
		online    int
		want      bool
	}{
		{"both on CPU 0", set(0), set(0), true, 2, true},
		{"both on CPU 3", set(3), set(3), true, 8, true},
		{"one CPU each, not the same", set(0), set(1), true, 2, false},
		{"the peer may use two", set(0), set(0, 1), true, 2, false},
		{"we may use two", set(0, 1), set(0), true, 2, false},
		{"peer unknown, one CPU online", set(0), unix.CPUSet{}, false, 1, true},
		{"peer unknown, two CPUs online", set(0), unix.CPUSet{}, false, 2, false},
		{"peer unknown, online unknown", set(0), unix.CPUSet{}, false, 0, false},
	} {
		require.Equal(t, tc.want, oneCPU(tc.own, tc.peer, tc.known, online(tc.online)), tc.name)
	}
}

// countCPUList counts the CPUs of a kernel CPU list and rejects malformed
// ones with 0.
func TestCountCPUList(t *testing.T) {
	for list, want := range map[string]int{
		"0": 1, "7": 1, "0-1": 2, "0,2-5": 5, "0-3,8-11": 8, "5-5": 1,
		"": 0, "1-0": 0, "a": 0, "0-": 0, "-1": 0, "0,,1": 0, "0-1-2": 0, "12345678": 0, " 0": 0,
	} {
		require.Equal(t, want, countCPUList(list), "%q", list)
	}
	require.Positive(t, onlineCPUs(), "this host's /sys/devices/system/cpu/online")
}

// oneCPUEnv makes TestOneCPUNoPolling run as the child it starts.
const oneCPUEnv = "SHMLINK_TEST_ONE_CPU"

// emulatorEnv names the emulator that runs the test binary, as
// internal/peertest.EmulatorEnv does (make arm64 runs it under qemu-user),
// which cannot be imported here: it imports this package.
const emulatorEnv = "SHMLINK_TEST_EMULATOR"

// A session whose two processes may run only on one CPU does not poll:
// every wait sleeps (docs/protocol.md section 12.8). The test runs itself
// again in a child process bound to one CPU, where both sessions of a pair
// see that CPU (the peer of a socketpair is the process itself). Here, on
// a host with more than one CPU, sessions poll.
func TestOneCPUNoPolling(t *testing.T) {
	if os.Getenv(oneCPUEnv) != "" {
		oneCPUChild(t)
		return
	}
	var own unix.CPUSet
	require.NoError(t, unix.SchedGetaffinity(0, &own))
	if own.Count() > 1 {
		client, server := pair(t, nil)
		require.Positive(t, client.cfg.PollTime, "more than one CPU: the client polls")
		require.Positive(t, server.cfg.PollTime, "more than one CPU: the server polls")
	}
	var one unix.CPUSet
	for cpu := 0; one.Count() == 0; cpu++ {
		if own.IsSet(cpu) {
			one.Set(cpu)
		}
	}
	var out bytes.Buffer
	name, args := os.Args[0], []string{"-test.run=^TestOneCPUNoPolling$", "-test.v", "-test.timeout=60s"}
	if em := os.Getenv(emulatorEnv); em != "" {
		name, args = em, append([]string{name}, args...)
	}
	cmd := exec.Command(name, args...)
	cmd.Env = append(os.Environ(), oneCPUEnv+"=1")
	cmd.Stdout, cmd.Stderr = &out, &out
	started := make(chan error, 1)
	go func() {
		// Never unlocked: the thread ends with this goroutine, and the
		// one-CPU binding that the child inherits ends with it.
		runtime.LockOSThread()
		if err := unix.SchedSetaffinity(0, &one); err != nil {
			started <- err
			return
		}
		started <- cmd.Start()
	}()
	require.NoError(t, <-started)
	require.NoError(t, cmd.Wait(), "child:\n%s", out.String())
	require.Contains(t, out.String(), "--- PASS: TestOneCPUNoPolling", "child:\n%s", out.String())
}

// oneCPUChild is TestOneCPUNoPolling in the child bound to one CPU.
func oneCPUChild(t *testing.T) {
	var own unix.CPUSet
	require.NoError(t, unix.SchedGetaffinity(0, &own))
	require.Equal(t, 1, own.Count(), "the child may run on one CPU")
	client, server := pair(t, nil)
	require.Negative(t, client.cfg.PollTime, "one CPU: the client does not poll")
	require.Negative(t, server.cfg.PollTime, "one CPU: the server does not poll")
	c, s := streamPair(t, client, server)
	go func() {
		b := make([]byte, 8)
		for {
			if _, err := io.ReadFull(s, b); err != nil {
				return
			}
			if _, err := s.Write(b); err != nil {
				return
			}
		}
	}()
	before := client.Stats()
	req, resp := []byte("request!"), make([]byte, 8)
	for range 20 {
		_, err := c.Write(req)
		require.NoError(t, err)
		_, err = io.ReadFull(c, resp)
		require.NoError(t, err)
		require.Equal(t, req, resp)
	}
	st := client.Stats()
	require.Equal(t, before.SpinHits+before.SpinMisses, st.SpinHits+st.SpinMisses, "no wait polled: %+v", st)
	require.Greater(t, st.Parks, before.Parks, "the reads waited: %+v", st)
}
