package main

import (
	"os/exec"
	"strings"
	"testing"
)

// The README's remote example must keep working, with and without mutual
// TLS: run it as a user would (two processes over QUIC, every byte
// checked) and look at what it printed.
func TestExampleRuns(t *testing.T) {
	if testing.Short() {
		t.Skip("builds and runs the example binary")
	}
	for _, args := range [][]string{nil, {"-mtls"}} {
		out, err := exec.Command("go", append([]string{"run", "."}, args...)...).CombinedOutput()
		if err != nil {
			t.Fatalf("go run ./example/remote %v: %v\n%s", args, err, out)
		}
		for _, want := range []string{"ok: 32 streams on 1 QUIC connection", "every byte checked", "mutual TLS " + map[bool]string{true: "true", false: "false"}[args != nil]} {
			if !strings.Contains(string(out), want) {
				t.Errorf("output of %v lacks %q:\n%s", args, want, out)
			}
		}
	}
}
