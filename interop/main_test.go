//go:build interop

package interop_test

import (
	"bufio"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// rustDir is the Cargo project of the Rust peer, relative to this package.
const rustDir = "rust"

// Paths of the Rust binaries, set by TestMain once cargo has built them.
var (
	rustServerBin string
	rustClientBin string
)

// TestMain builds the Rust peer (cargo build --release --locked, into
// interop/rust/target) before any test runs. Without cargo the run fails:
// the interop tag asks for these tests, so they are never skipped.
func TestMain(m *testing.M) {
	if err := buildRust(); err != nil {
		fmt.Fprintln(os.Stderr, "interop:", err)
		os.Exit(1)
	}
	os.Exit(m.Run())
}

func buildRust() error {
	cargo, err := exec.LookPath("cargo")
	if err != nil {
		return fmt.Errorf("cargo not found in PATH: the interop tests build the Rust peer in interop/%s with it (install Rust with rustup): %w", rustDir, err)
	}
	version, err := crateVersion(filepath.Join(rustDir, "Cargo.lock"), "shmipc")
	if err != nil {
		return err
	}
	target, err := filepath.Abs(filepath.Join(rustDir, "target"))
	if err != nil {
		return err
	}
	start := time.Now()
	cmd := exec.Command(cargo, "build", "--release", "--locked", "--target-dir", target)
	cmd.Dir = rustDir
	cmd.Stdout = os.Stderr
	cmd.Stderr = os.Stderr
	if err := cmd.Run(); err != nil {
		return fmt.Errorf("cargo build --release --locked in %s: %w", rustDir, err)
	}
	rustServerBin = filepath.Join(target, "release", "server")
	rustClientBin = filepath.Join(target, "release", "client")
	fmt.Printf("interop: Rust peer: crate shmipc %s (Cargo.lock), built by cargo in %v\n",
		version, time.Since(start).Round(10*time.Millisecond))
	return nil
}

// crateVersion returns the version of package name in a Cargo.lock.
func crateVersion(lockFile, name string) (string, error) {
	f, err := os.Open(lockFile)
	if err != nil {
		return "", err
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	inPackage := false
	for sc.Scan() {
		line := strings.TrimSpace(sc.Text())
		switch {
		case line == "[[package]]":
			inPackage = false
		case line == fmt.Sprintf("name = %q", name):
			inPackage = true
		case inPackage && strings.HasPrefix(line, "version = "):
			return strings.Trim(strings.TrimPrefix(line, "version = "), `"`), nil
		}
	}
	if err := sc.Err(); err != nil {
		return "", err
	}
	return "", fmt.Errorf("%s: no package %q", lockFile, name)
}
