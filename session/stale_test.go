package session

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/shmlink/shmlink/internal/shm"
	"github.com/stretchr/testify/require"
)

// removeStale keeps the files of a live owner, even one whose pid means
// nothing here (another pid namespace: containers sharing /dev/shm), and
// removes those whose owner is gone (#14).
func TestRemoveStaleAcrossPIDNamespaces(t *testing.T) {
	dir := t.TempDir()
	// A pid that exists in no namespace of ours, as another container's.
	live := filepath.Join(dir, "shmlink_999999999_e0_0123456789abcdef_buffer")
	dead := filepath.Join(dir, "shmlink_999999998_e0_0123456789abcdef_buffer")
	f, err := shm.CreateFile(live, 4096) // open: its owner is alive
	require.NoError(t, err)
	defer f.Close()
	g, err := shm.CreateFile(dead, 4096)
	require.NoError(t, err)
	require.NoError(t, g.Close())        // its owner died
	other := filepath.Join(dir, "other") // not ours: never touched
	require.NoError(t, os.WriteFile(other, nil, 0o600))

	removeStale(dir)
	_, err = os.Stat(other)
	require.NoError(t, err)
	_, err = os.Stat(live)
	require.NoError(t, err, "a live owner's file was removed")
	_, err = os.Stat(dead)
	require.ErrorIs(t, err, os.ErrNotExist, "a dead owner's file stayed")
}
