#!/usr/bin/env bash
# Rust<->Rust smoke test of the shmipc-interop binaries: builds (release, locked) and runs the
# client against the server over memfd (v3) and file (v2), 1 B..4 MiB, 100 concurrent streams,
# and a 1 MiB region (fallback path). Usage: interop/rust/smoke.sh [-j N]
set -euo pipefail
cd "$(dirname "$0")"
JOBS="${1:-}"; [[ "$JOBS" == -j ]] && JOBS="-j ${2:-1}" || JOBS="-j 1"
cargo build --release --locked $JOBS
BIN=target/release
SOCK="$(mktemp -u /tmp/shmipc-interop-XXXXXX.sock)"
OUT="$(mktemp)"
"$BIN/server" --unix "$SOCK" --quiet >"$OUT" 2>&1 &
SRV=$!
trap 'kill $SRV 2>/dev/null || true; rm -f "$SOCK" "$OUT"' EXIT
for _ in $(seq 100); do grep -q '^ready$' "$OUT" && break; sleep 0.05; done
grep -q '^ready$' "$OUT" || { echo "server did not become ready"; cat "$OUT"; exit 1; }
pass=0; fail=0
run() {
  local name="$1"; shift
  if "$BIN/client" --unix "$SOCK" "$@" >/tmp/shmipc-interop-client.log 2>&1; then
    echo "ok   $name"; pass=$((pass+1))
  else
    echo "FAIL $name"; sed 's/^/     /' /tmp/shmipc-interop-client.log | tail -15; fail=$((fail+1))
  fi
}
for mem in memfd file; do
  run "$mem 1 stream 1B..4MiB, no fallback" --mem "$mem" --expect-no-fallback
  run "$mem 100 streams 1B..4MiB" --mem "$mem" --streams 100
  run "$mem 100 streams x3 rounds, small sizes, no fallback" --mem "$mem" --streams 100 --rounds 3 \
      --sizes 1,100,4096,8172,8173,32748,131052,131053,300000 --expect-no-fallback
  run "$mem 1 MiB region (fallback) 1 stream" --mem "$mem" --buffer-size 1M --expect-fallback
  run "$mem 1 MiB region 4K slices (fallback) 100 streams" --mem "$mem" --buffer-size 1M \
      --slices 4096:100 --streams 100 --expect-fallback
done
kill $SRV; wait $SRV 2>/dev/null || true
tail -1 "$OUT"
echo "$pass passed, $fail failed"
[[ $fail -eq 0 ]]
