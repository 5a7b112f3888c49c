// Command benchtab prints the README's performance tables (section
// "Performance") from the output of `make bench`:
//
//	make bench BENCHCOUNT=5
//	go run ./internal/benchtab bench.txt
//
// bench.txt holds BENCHCOUNT rounds; the n-th result of a benchmark's name is
// its n-th round. Each cell is the median over the rounds. A ratio column
// compares the medians (uds against shmlink, so that above 1 is shmlink
// ahead); the busy-host table adds the lowest and highest of the per-round
// ratios, taken between runs of the same round, which were seconds apart.
package main

import (
	"bufio"
	"fmt"
	"io"
	"math"
	"os"
	"regexp"
	"slices"
	"strconv"
	"strings"
)

func main() {
	if len(os.Args) != 2 {
		fmt.Fprintln(os.Stderr, "usage: benchtab bench.txt")
		os.Exit(2)
	}
	f, err := os.Open(os.Args[1])
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	defer f.Close()
	rs, err := parse(f)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	write(os.Stdout, rs)
}

// results maps a benchmark's name, without its -GOMAXPROCS suffix, to its
// metrics (unit to value) per round, in the order of the file.
type results map[string][]map[string]float64

var lineRE = regexp.MustCompile(`^(Benchmark\S+?)(?:-\d+)?\s+\d+\s+(.*)$`)

// parse reads the output of go test -bench: lines "BenchmarkName-P N value
// unit value unit ...". Other lines are skipped.
func parse(r io.Reader) (results, error) {
	rs := make(results)
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		m := lineRE.FindStringSubmatch(sc.Text())
		if m == nil {
			continue
		}
		f := strings.Fields(m[2])
		if len(f)%2 != 0 {
			return nil, fmt.Errorf("benchtab: odd number of fields after %s", m[1])
		}
		ms := make(map[string]float64, len(f)/2)
		for i := 0; i < len(f); i += 2 {
			v, err := strconv.ParseFloat(f[i], 64)
			if err != nil {
				return nil, fmt.Errorf("benchtab: %s: %v", m[1], err)
			}
			ms[f[i+1]] = v
		}
		rs[m[1]] = append(rs[m[1]], ms)
	}
	return rs, sc.Err()
}

// median returns the median of unit over the rounds of name, and false if
// no round has it.
func (rs results) median(name, unit string) (float64, bool) {
	vs := rs.values(name, unit)
	if len(vs) == 0 {
		return 0, false
	}
	slices.Sort(vs)
	n := len(vs)
	if n%2 == 1 {
		return vs[n/2], true
	}
	return (vs[n/2-1] + vs[n/2]) / 2, true
}

// values returns unit's value in each round of name that has it.
func (rs results) values(name, unit string) []float64 {
	var vs []float64
	for _, m := range rs[name] {
		if v, ok := m[unit]; ok {
			vs = append(vs, v)
		}
	}
	return vs
}

// roundRatios returns, per round that has both, num's unit over den's.
func (rs results) roundRatios(num, den, unit string) []float64 {
	var out []float64
	a, b := rs[num], rs[den]
	for i := range min(len(a), len(b)) {
		x, ok1 := a[i][unit]
		y, ok2 := b[i][unit]
		if ok1 && ok2 && y != 0 {
			out = append(out, x/y)
		}
	}
	return out
}

var transports = []string{"shmlink", "shmlink-zerocopy", "uds", "tcp", "yamux", "quic"}

func write(w io.Writer, rs results) {
	sizeTable(w, rs, "PingPong", "`PingPong` (time per round trip)",
		[]string{"64B", "1KB", "4KB", "16KB", "64KB", "256KB", "1MB", "4MB"})
	sizeTable(w, rs, "PingPongParallel", "`PingPongParallel` (time per round trip, 64 streams)",
		[]string{"64B", "4KB", "1MB"})
	memoryBound(w, rs)
	sizeTable(w, rs, "Stream", "`Stream` (time per one-way message, one goroutine, default Config)",
		[]string{"10KB", "64KB", "1MB"})
	busyTable(w, rs)
}

// sizeTable prints one row per size: each transport's median ns/op, and uds's
// over shmlink's.
func sizeTable(w io.Writer, rs results, bench, title string, sizes []string) {
	fmt.Fprintf(w, "%s\n\n| size | %s | uds / shmlink |\n|---|", title, strings.Join(transports, " | "))
	fmt.Fprintf(w, "%s---|\n", strings.Repeat("---|", len(transports)))
	for _, size := range sizes {
		fmt.Fprintf(w, "| %s |", size)
		for _, t := range transports {
			v, ok := rs.median("Benchmark"+bench+"/"+t+"/"+size, "ns/op")
			fmt.Fprintf(w, " %s |", cell(ok, fmtNs(v)))
		}
		s, ok1 := rs.median("Benchmark"+bench+"/shmlink/"+size, "ns/op")
		u, ok2 := rs.median("Benchmark"+bench+"/uds/"+size, "ns/op")
		fmt.Fprintf(w, " %s |\n", cell(ok1 && ok2, fmt.Sprintf("%.1fx", u/s)))
	}
	fmt.Fprintln(w)
}

// memoryBound prints, under the PingPongParallel table, how the 1 MB
// Read/Write case compares with BenchmarkMemoryCopy: the four copies of its
// round trip with nothing else, a bound under the time of any transport
// that copies four times. Nothing when the run lacks any of the three.
func memoryBound(w io.Writer, rs results) {
	const bound = "BenchmarkMemoryCopy/PingPongParallel/1MB"
	const shm, uds = "BenchmarkPingPongParallel/shmlink/1MB", "BenchmarkPingPongParallel/uds/1MB"
	m, ok1 := rs.median(bound, "ns/op")
	s, ok2 := rs.median(shm, "ns/op")
	u, ok3 := rs.median(uds, "ns/op")
	if !ok1 || !ok2 || !ok3 {
		return
	}
	fmt.Fprintf(w, "The four copies of a 1 MB round trip alone (`BenchmarkMemoryCopy`: both CPUs copying at once "+
		"between buffers laid out as in this case, each piece through a buffer that stays in the CPU's cache) took "+
		"%s per round trip%s. So in this run no transport that copies each byte four times could beat uds's %s by "+
		"more than %.1fx%s; shmlink's Read/Write took %.2f times that bound, uds %.2f times.\n\n",
		fmtNs(m), rs.timeRange(bound),
		fmtNs(u), u/m, rangeOf(" (per round ", rs.roundRatios(uds, bound, "ns/op"), "x)"), s/m, u/m)
}

// timeRange is " (per round lo-hi)" of name's ns/op over its rounds, or
// nothing with fewer than two.
func (rs results) timeRange(name string) string {
	vs := rs.values(name, "ns/op")
	if len(vs) < 2 {
		return ""
	}
	return fmt.Sprintf(" (per round %s-%s)", fmtNs(slices.Min(vs)), fmtNs(slices.Max(vs)))
}

// rangeOf is pre lo-hi post for two or more values, else nothing.
func rangeOf(pre string, vs []float64, post string) string {
	if len(vs) < 2 {
		return ""
	}
	return fmt.Sprintf("%s%.1f-%.1f%s", pre, slices.Min(vs), slices.Max(vs), post)
}

// A row of the busy-host table: a case over shmlink and over uds.
type row struct {
	label string
	shm   string // benchmark name over shmlink
	uds   string // the same case over uds
	unit  string // "ns/op" (time), "p50-us" (paced), or a rate such as "req/s"
}

func busyRows() []row {
	var rows []row
	add := func(label, shm, uds, unit string) { rows = append(rows, row{label, shm, uds, unit}) }
	c := "BenchmarkContended/"
	for _, load := range []string{"idle", "contended"} {
		add("64 B ping-pong, "+load, c+load+"/PingPong/64B/shmlink", c+load+"/PingPong/64B/uds", "ns/op")
	}
	for _, load := range []string{"idle", "contended"} {
		add("1 MB ping-pong Read/Write, "+load, c+load+"/PingPong/1MB/shmlink", c+load+"/PingPong/1MB/uds", "ns/op")
		add("1 MB ping-pong zero-copy, "+load, c+load+"/PingPong/1MB/shmlink-zerocopy", c+load+"/PingPong/1MB/uds", "ns/op")
	}
	for _, load := range []string{"idle", "contended"} {
		add("64 streams, 64 B, "+load, c+load+"/PingPongParallel/64B/shmlink", c+load+"/PingPongParallel/64B/uds", "ns/op")
	}
	for _, load := range []string{"idle", "contended"} {
		for _, api := range []string{"Read/Write", "zero-copy"} {
			t := "shmlink"
			if api == "zero-copy" {
				t = "shmlink-zerocopy"
			}
			add("64 streams, 1 MB, "+api+", "+load, c+load+"/PingPongParallel/1MB/"+t, c+load+"/PingPongParallel/1MB/uds", "ns/op")
		}
	}
	for _, size := range []string{"64KB", "1MB"} {
		add(spaced(size)+" one-way Read/Write, contended", c+"contended/Stream/"+size+"/shmlink", c+"contended/Stream/"+size+"/uds", "ns/op")
	}
	for _, load := range []string{"idle", "contended"} {
		for _, gap := range []string{"100µs", "1ms", "10ms"} {
			label := "paced " + spaced(gap)
			if load == "contended" {
				label += " contended"
			}
			p := "BenchmarkPaced/" + load + "/gap=" + gap + "/"
			add(label+", p50 (p99)", p+"shmlink", p+"uds", "p50-us")
		}
	}
	add("paced 10 ms, 8 sessions, p50 (p99)", "BenchmarkPacedSessions/shmlink", "BenchmarkPacedSessions/uds", "p50-us")
	for _, load := range []string{"idle", "contended"} {
		for _, size := range []string{"64B", "64KB"} {
			for _, clients := range []string{"1", "16"} {
				label := "HTTP/1.1 GET " + spaced(size) + ", " + count(clients, "client") + loadSuffix(load)
				p := "BenchmarkHTTP/" + load + "/GET-" + size + "/c" + clients + "/"
				add(label, p+"shmlink", p+"uds", "req/s")
			}
		}
	}
	g := "BenchmarkGRPC/"
	for _, load := range []string{"idle", "contended"} {
		sizes := []string{"64B", "4KB", "64KB"}
		if load == "contended" {
			sizes = sizes[:1]
		}
		for _, size := range sizes {
			for _, callers := range []string{"1", "16"} {
				label := "gRPC unary " + spaced(size) + ", " + count(callers, "caller") + loadSuffix(load)
				p := g + load + "/unary/" + size + "/c" + callers + "/"
				add(label, p+"shmlink", p+"uds", "calls/s")
			}
		}
		add("gRPC bidi stream 64 B"+loadSuffix(load), g+load+"/bidi/64B/shmlink", g+load+"/bidi/64B/uds", "calls/s")
	}
	for _, callers := range []string{"1", "16"} {
		p := "BenchmarkInProcessGRPC/unary/64B/c" + callers + "/"
		add("gRPC unary 64 B, "+count(callers, "caller")+", in one process", p+"shmlink", p+"uds", "calls/s")
	}
	for _, load := range []string{"idle", "contended"} {
		for _, size := range []string{"64B", "64KB"} {
			p := "BenchmarkInProcess/" + load + "/PingPong/" + size + "/"
			add(spaced(size)+" ping-pong, in one process, "+load, p+"shmlink", p+"uds", "ns/op")
		}
	}
	for _, load := range []string{"idle", "contended"} {
		p := "BenchmarkInProcess/" + load + "/Paced/gap=1ms/"
		add("paced 1 ms, in one process, "+load+", p50 (p99)", p+"shmlink", p+"uds", "p50-us")
	}
	return rows
}

// busyTable prints the table of section "Busy hosts, paced requests, gRPC
// and HTTP". Ratios are uds over shmlink for times, shmlink over uds for
// rates: above 1 is shmlink ahead. A ratio below 1, and shmlink's CPU per
// operation above uds's, are bold.
func busyTable(w io.Writer, rs results) {
	fmt.Fprintln(w, "| case | shmlink | uds | ratio | per round | CPU/op shmlink | CPU/op uds |")
	fmt.Fprintln(w, "|---|---|---|---|---|---|---|")
	for _, r := range busyRows() {
		s, ok1 := rs.median(r.shm, r.unit)
		u, ok2 := rs.median(r.uds, r.unit)
		if !ok1 || !ok2 {
			continue
		}
		var sv, uv string
		var ratio float64
		var per []float64
		switch r.unit {
		case "ns/op":
			sv, uv, ratio = fmtNs(s), fmtNs(u), u/s
			per = rs.roundRatios(r.uds, r.shm, r.unit)
		case "p50-us":
			s99, _ := rs.median(r.shm, "p99-us")
			u99, _ := rs.median(r.uds, "p99-us")
			sv = fmt.Sprintf("%.0f µs (%.0f)", s, s99)
			uv = fmt.Sprintf("%.0f µs (%.0f)", u, u99)
			ratio = u / s
			per = rs.roundRatios(r.uds, r.shm, r.unit)
		default:
			sv, uv, ratio = fmtRate(s, r.unit), fmtRate(u, r.unit), s/u
			per = rs.roundRatios(r.shm, r.uds, r.unit)
		}
		rv := fmt.Sprintf("%.2fx", ratio)
		if ratio < 1 {
			rv = "**" + rv + "**"
		}
		pr := "–"
		if len(per) > 1 {
			pr = fmt.Sprintf("%.2f-%.2f", slices.Min(per), slices.Max(per))
		}
		sc, okc1 := rs.median(r.shm, "cpu-us/op")
		uc, okc2 := rs.median(r.uds, "cpu-us/op")
		scv, ucv := cell(okc1, fmtCPU(sc)), cell(okc2, fmtCPU(uc))
		if okc1 && okc2 && sc > uc {
			scv = "**" + scv + "**"
		}
		fmt.Fprintf(w, "| %s | %s | %s | %s | %s | %s | %s |\n", r.label, sv, uv, rv, pr, scv, ucv)
	}
	fmt.Fprintln(w)
}

// count is n noun, in the plural unless n is "1": "16 clients".
func count(n, noun string) string {
	if n == "1" {
		return n + " " + noun
	}
	return n + " " + noun + "s"
}

// loadSuffix is what a row's label adds for its load: nothing when idle.
func loadSuffix(load string) string {
	if load == "contended" {
		return ", contended"
	}
	return ""
}

// spaced puts a space between a size's or duration's number and its unit, as
// prose writes it: "64KB" is "64 KB", "100µs" is "100 µs".
func spaced(s string) string {
	i := strings.IndexFunc(s, func(r rune) bool { return r < '0' || r > '9' })
	if i <= 0 {
		return s
	}
	return s[:i] + " " + s[i:]
}

func cell(ok bool, s string) string {
	if !ok {
		return "–"
	}
	return s
}

// fmtNs formats a time in nanoseconds with 3 or 4 significant digits.
func fmtNs(ns float64) string {
	switch {
	case ns < 1e3:
		return fmt.Sprintf("%.0f ns", ns)
	case ns < 1e4:
		return fmt.Sprintf("%.2f µs", ns/1e3)
	case ns < 1e6:
		return fmt.Sprintf("%.1f µs", ns/1e3)
	default:
		return fmt.Sprintf("%.2f ms", ns/1e6)
	}
}

// fmtCPU formats a CPU time per operation in microseconds.
func fmtCPU(us float64) string {
	if us < 10 {
		return fmt.Sprintf("%.1f µs", us)
	}
	return fmt.Sprintf("%.0f µs", us)
}

// fmtRate formats a rate with thousands separators: 82207.3, "req/s" is
// "82,207 req/s".
func fmtRate(v float64, unit string) string {
	s := strconv.FormatInt(int64(math.Round(v)), 10)
	var b strings.Builder
	for i, c := range s {
		if i > 0 && (len(s)-i)%3 == 0 {
			b.WriteByte(',')
		}
		b.WriteRune(c)
	}
	return b.String() + " " + unit
}
