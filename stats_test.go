package shmlink

import (
	"reflect"
	"testing"

	"github.com/stretchr/testify/require"
)

// addStats sums every counter of Stats: a field added to session.Stats
// and forgotten here would read 0 in Listener.Stats and Dialer.Stats.
func TestAddStatsSumsEveryCounter(t *testing.T) {
	var one Stats
	v := reflect.ValueOf(&one).Elem()
	for i := range v.NumField() {
		switch f := v.Field(i); f.Kind() {
		case reflect.Uint64:
			f.SetUint(uint64(i + 1))
		case reflect.Int:
			f.SetInt(int64(i + 1))
		}
	}
	var sum Stats
	addStats(&sum, one)
	addStats(&sum, one)
	sv := reflect.ValueOf(sum)
	for i := range sv.NumField() {
		name := sv.Type().Field(i).Name
		switch f := sv.Field(i); f.Kind() {
		case reflect.Uint64:
			require.Equal(t, uint64(2*(i+1)), f.Uint(), name)
		case reflect.Int:
			require.Equal(t, int64(2*(i+1)), f.Int(), name)
		case reflect.Slice:
			require.Nil(t, f.Interface(), "%s: the lists of different regions are not summed", name)
		default:
			t.Fatalf("Stats.%s: a %v field addStats does not know", name, f.Kind())
		}
	}
}
