#!/usr/bin/env bash
# A soak: open-loop load with distinct inputs (every request misses the
# cache, so both layers fill and then churn) against a node with the default
# config, through one mosquitto. Prints a row per minute: replies, errors,
# unanswered, p50 / p99 / p99.9 / max round trip, the node's resident memory
# (now and peak) and the size of its state directory; then the idle memory
# after start and whether memory stayed flat; then the node is restarted on
# the state directory the soak filled: its memory 10 s later, and how long
# it took to be ready.
# docs/BENCHMARKS.md.
#
#   benches/soak.sh [BINARY] [MINUTES] [RATE]
#   (defaults: target/release/edgeinfer, 5 minutes, 2000 req/s over 2 connections)
#
# Each minute is one `edgeinfer bench` run (58 s measured after 1 s of
# warm-up), numbering its requests from a new offset so none repeats.
# CLIENT=BINARY runs the load from another build (an older node binary may
# lack `bench --distinct-from`).
set -euo pipefail
cd "$(dirname "$0")/.."
bin=${1:-target/release/edgeinfer} minutes=${2:-5} rate=${3:-2000}
client=${CLIENT:-$bin}
source benches/mosquitto.sh
state="$work/state"
start() {
  EDGEINFER_NODE__ID=soak EDGEINFER_NODE__STATE_DIR="$state" EDGEINFER_MQTT__URL=$url EDGEINFER_HTTP__LISTEN= \
    EDGEINFER_LOG=warn,edgeinfer::node=info \
    "$bin" serve --models-dir models 2>"$work/node.log" &
  node=$!
}
start
sleep 3
kib() { awk -v k="$1" '$1 == k":" {print $2}' "/proc/$node/status"; }
idle=$(kib VmRSS)
echo "node $bin, $rate req/s, $minutes min; idle after start: RSS $((idle / 1024)) MiB"
echo "| minute | replies | errors | unanswered | p50 | p99 | p99.9 | max | RSS | peak RSS | state dir |"
echo "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"
rows="$work/rows"
for m in $(seq 1 "$minutes"); do
  report=$("$client" bench --url "$url" --node soak --distinct --distinct-from $((m * 200000)) \
    --rate "$rate" --connections 2 --duration 58 --warmup 1 --json)
  if ! kill -0 "$node" 2>/dev/null; then
    echo "the node exited; its log:" && tail -n 20 "$work/node.log" && exit 1
  fi
  rss=$(kib VmRSS) peak=$(kib VmHWM) disk=$(du -sb "$state" 2>/dev/null | cut -f1 || echo 0); disk=${disk:-0}
  python3 - "$m" "$report" "$rss" "$peak" "$disk" <<'PY' | tee -a "$rows"
import json, sys
m, r, rss, peak, disk = sys.argv[1], json.loads(sys.argv[2]), *map(int, sys.argv[3:])
l = r["latency_us"]
ms = lambda us: f"{us / 1000:.2f} ms"
print(f"| {m} | {r['requests']:,} | {r['errors']} | {r['unanswered']} | {ms(l['p50'])} | {ms(l['p99'])} | "
      f"{ms(l['p999'])} | {ms(l['max'])} | {rss / 1024:.1f} MiB | {peak / 1024:.1f} MiB | {disk / 2**20:.1f} MiB |")
PY
done
python3 - "$rows" <<'PY'
import sys
rows = [[c.strip() for c in line.strip().strip("|").split("|")] for line in open(sys.argv[1])]
rss = [float(r[8].split()[0]) for r in rows]
errors = sum(int(r[2]) for r in rows)
worst = max(float(r[6].split()[0]) for r in rows)
drift = (rss[-1] - rss[0]) / rss[0] * 100
print(f"errors {errors}; worst p99.9 {worst:.2f} ms; RSS at the end {rss[-1]:.1f} MiB, "
      f"{drift:+.1f}% against the first minute ({rss[0]:.1f} MiB)")
PY
kill "$node" && wait "$node" || true
start
sleep 10
echo "restarted on the full state dir ($(du -sb "$state" | awk '{printf "%.1f MiB", $1 / 2^20}')): RSS $(($(kib VmRSS) / 1024)) MiB 10 s later;" \
  $(grep -ho "ready [0-9.]* ms after start" "$work/node.log" | paste -sd ';' -)
kill "$node" && wait "$node" || true
