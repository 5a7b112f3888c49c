package main

import (
	"os/exec"
	"strings"
	"testing"
)

// The README's first command must keep working: run the example as a user
// would (two processes, every byte checked) and look at what it printed.
func TestExampleRuns(t *testing.T) {
	if testing.Short() {
		t.Skip("builds and runs the example binary")
	}
	out, err := exec.Command("go", "run", ".", "-rounds", "40").CombinedOutput()
	if err != nil {
		t.Fatalf("go run ./example/helloworld: %v\n%s", err, out)
	}
	for _, want := range []string{"4MiB", "every byte checked", "server pid"} {
		if !strings.Contains(string(out), want) {
			t.Errorf("output lacks %q:\n%s", want, out)
		}
	}
}
