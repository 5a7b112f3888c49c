package main

import (
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// Three rounds of two cases, with the noise go test prints around them.
const sample = `goos: linux
cpu: AMD EPYC
BenchmarkContended/idle/PingPong/64B/shmlink-2   	  100	      1000 ns/op	  3.0 cpu-us/op	  0 B/op	  0 allocs/op
BenchmarkContended/idle/PingPong/64B/uds-2       	  100	     30000 ns/op	 40.0 cpu-us/op
PASS
BenchmarkContended/idle/PingPong/64B/shmlink-2   	  100	      3000 ns/op	  5.0 cpu-us/op
BenchmarkContended/idle/PingPong/64B/uds-2       	  100	     20000 ns/op	 30.0 cpu-us/op
some log line
BenchmarkContended/idle/PingPong/64B/shmlink-2   	  100	      2000 ns/op	 50.0 cpu-us/op
BenchmarkContended/idle/PingPong/64B/uds-2       	  100	      1000 ns/op	 20.0 cpu-us/op
BenchmarkHTTP/idle/GET-64B/c1/shmlink-2 	 100	 5 ns/op	 1000.4 req/s
BenchmarkHTTP/idle/GET-64B/c1/uds-2     	 100	 5 ns/op	 2000 req/s
`

func TestParseRounds(t *testing.T) {
	rs, err := parse(strings.NewReader(sample))
	require.NoError(t, err)
	require.Len(t, rs["BenchmarkContended/idle/PingPong/64B/shmlink"], 3)
	assert.Equal(t, 3000.0, rs["BenchmarkContended/idle/PingPong/64B/shmlink"][1]["ns/op"])
	assert.Equal(t, 0.0, rs["BenchmarkContended/idle/PingPong/64B/shmlink"][0]["allocs/op"])

	m, ok := rs.median("BenchmarkContended/idle/PingPong/64B/shmlink", "ns/op")
	assert.True(t, ok)
	assert.Equal(t, 2000.0, m)
	_, ok = rs.median("BenchmarkContended/idle/PingPong/64B/shmlink", "p50-us")
	assert.False(t, ok)

	// Per round: 30, 6.67, 0.5; the medians' ratio (20000/2000 = 10) is none of them.
	per := rs.roundRatios("BenchmarkContended/idle/PingPong/64B/uds", "BenchmarkContended/idle/PingPong/64B/shmlink", "ns/op")
	require.Len(t, per, 3)
	assert.InDelta(t, 30, per[0], 1e-9)
	assert.InDelta(t, 0.5, per[2], 1e-9)
}

func TestParseRejectsOddFields(t *testing.T) {
	_, err := parse(strings.NewReader("BenchmarkX-2 \t 10 \t 5 ns/op 7\n"))
	assert.ErrorContains(t, err, "odd number of fields")
	_, err = parse(strings.NewReader("BenchmarkX-2 \t 10 \t five ns/op\n"))
	assert.ErrorContains(t, err, "BenchmarkX")
}

func TestBusyTable(t *testing.T) {
	rs, err := parse(strings.NewReader(sample))
	require.NoError(t, err)
	var b strings.Builder
	busyTable(&b, rs)
	out := b.String()
	// Cases without data are left out.
	assert.NotContains(t, out, "contended |")
	// Time: uds over shmlink, per-round range; shmlink's CPU (5.0) is not above uds's (30.0).
	assert.Contains(t, out, "| 64 B ping-pong, idle | 2.00 µs | 20.0 µs | 10.00x | 0.50-30.00 | 5.0 µs | 30 µs |")
	// Rate: shmlink over uds, bold below 1.
	assert.Contains(t, out, "| HTTP/1.1 GET 64 B, 1 client | 1,000 req/s | 2,000 req/s | **0.50x** | – | – | – |")
}

func TestFormats(t *testing.T) {
	for _, c := range []struct {
		ns   float64
		want string
	}{{982, "982 ns"}, {1049, "1.05 µs"}, {37612, "37.6 µs"}, {150012, "150.0 µs"}, {1163000, "1.16 ms"}} {
		assert.Equal(t, c.want, fmtNs(c.ns))
	}
	assert.Equal(t, "82,207 req/s", fmtRate(82207.3, "req/s"))
	assert.Equal(t, "999 calls/s", fmtRate(999, "calls/s"))
	assert.Equal(t, "1,000,000 msg/s", fmtRate(1e6, "msg/s"))
	assert.Equal(t, "2.0 µs", fmtCPU(2.04))
	assert.Equal(t, "38 µs", fmtCPU(37.6))
	assert.Equal(t, "64 KB", spaced("64KB"))
	assert.Equal(t, "100 µs", spaced("100µs"))
	assert.Equal(t, "x", spaced("x"))
}

func TestMemoryBound(t *testing.T) {
	const run = `BenchmarkPingPongParallel/shmlink/1MB-2 	 100	 200000 ns/op
BenchmarkPingPongParallel/uds/1MB-2     	 100	 400000 ns/op
BenchmarkMemoryCopy/PingPongParallel/1MB-2 	 100	 160000 ns/op
BenchmarkPingPongParallel/shmlink/1MB-2 	 100	 300000 ns/op
BenchmarkPingPongParallel/uds/1MB-2     	 100	 450000 ns/op
BenchmarkMemoryCopy/PingPongParallel/1MB-2 	 100	 150000 ns/op
`
	rs, err := parse(strings.NewReader(run))
	require.NoError(t, err)
	var b strings.Builder
	memoryBound(&b, rs)
	out := b.String()
	// Medians of two rounds: bound 155 µs, shmlink 250 µs, uds 425 µs;
	// per round uds over the bound: 2.5x and 3.0x.
	assert.Contains(t, out, "took 155.0 µs per round trip (per round 150.0 µs-160.0 µs)")
	assert.Contains(t, out, "uds's 425.0 µs by more than 2.7x (per round 2.5-3.0x)")
	assert.Contains(t, out, "Read/Write took 1.61 times that bound, uds 2.74 times.")

	// A run without the bound prints nothing.
	rs, err = parse(strings.NewReader(sample))
	require.NoError(t, err)
	b.Reset()
	memoryBound(&b, rs)
	assert.Empty(t, b.String())
}
