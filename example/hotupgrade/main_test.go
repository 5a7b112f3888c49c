package main

import (
	"os/exec"
	"strings"
	"testing"
)

// Run the example as a user would: three server generations under load,
// every byte checked, no error; it prints the latency during upgrades.
func TestExampleRuns(t *testing.T) {
	if testing.Short() {
		t.Skip("builds and runs the example binary")
	}
	out, err := exec.Command("go", "run", ".", "-upgrades", "2", "-interval", "200ms").CombinedOutput()
	if err != nil {
		t.Fatalf("go run ./example/hotupgrade: %v\n%s", err, out)
	}
	for _, want := range []string{"upgrade 1:", "upgrade 2:", " 0 errors, 2 upgrades", "every byte checked", "latency during upgrades: median"} {
		if !strings.Contains(string(out), want) {
			t.Errorf("output lacks %q:\n%s", want, out)
		}
	}
	t.Logf("%s", out)
}
