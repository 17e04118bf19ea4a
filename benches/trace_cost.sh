#!/usr/bin/env bash
# What traces cost (issue 41). Each round starts a node (digits, cache off)
# on one mosquitto (set_tcp_nodelay true) three times: tracing off, on at 1%
# and on at 100%, exporting to a real OTLP receiver (tests/otlp/receiver.py,
# PyPI opentelemetry-proto). Each run: 4 connections x 32 in flight for 8 s
# (throughput, and the node's CPU per 1,000 requests over 5 s of it), then
# 1 in flight for 6 s (p50, p99). After the rounds, at 100%, the collector
# slow (each export answered 3 s late) and then down: the same runs, with
# the spans the node exported and dropped. The order of the three rotates
# by round, so drift on a shared machine does not favour one.
#
#   benches/trace_cost.sh [BINARY] [ROUNDS]   (default target/release/edgeinfer, 3)
#   OTLP_PYTHON: a Python with opentelemetry-proto (default python3)
#   BASE: a build from before tracing, run first in each round as "before"
set -euo pipefail
cd "$(dirname "$0")/.."
bin=${1:-target/release/edgeinfer}
rounds=${2:-3}
python=${OTLP_PYTHON:-python3}
source benches/mosquitto.sh
hz=$(getconf CLK_TCK)
ticks() { awk '{print $14 + $15}' "/proc/$1/stat"; }

receiver_pid=
start_receiver() { # SLEEP_S: sets $endpoint
  rm -f "$work/port"
  "$python" tests/otlp/receiver.py --out "$work/spans.jsonl" --port-file "$work/port" --sleep "$1" &
  receiver_pid=$!
  for _ in $(seq 100); do [ -f "$work/port" ] && break; sleep 0.1; done
  endpoint="http://127.0.0.1:$(cat "$work/port")/v1/traces"
}

run() { # LABEL ENV=VALUE... (BIN: the node's binary, default $bin; the load generator is $bin)
  local label=$1 node_bin=${BIN:-$bin}
  shift
  local http node
  for _ in 1 2 3; do # a random port may be taken: the node then exits, and starts again on another
    http=$((40000 + RANDOM % 20000))
    env "$@" EDGEINFER_NODE__ID=trace EDGEINFER_NODE__STATE_DIR="$work/state-$RANDOM" EDGEINFER_MQTT__URL="$url" \
      EDGEINFER_HTTP__LISTEN="127.0.0.1:$http" EDGEINFER_CACHE__ENABLED=false EDGEINFER_LOG=warn \
      "$node_bin" serve --models-dir models 2>"$work/node.log" &
    node=$!
    sleep 2
    kill -0 $node 2>/dev/null && break
    echo "the node exited at start: $(tail -n 2 "$work/node.log")" >&2
  done
  "$bin" bench --url "$url" --node trace --connections 4 -C 32 --duration 8 --json >"$work/saturated.json" &
  local client=$!
  sleep 2
  local n0 n1
  n0=$(ticks $node)
  sleep 5
  n1=$(ticks $node)
  wait $client
  "$bin" bench --url "$url" --node trace --connections 1 -C 1 --duration 6 --warmup 1 --json >"$work/one.json"
  sleep 1
  curl -s "127.0.0.1:$http/metrics" >"$work/metrics.txt"
  kill -TERM $node && wait $node || true
  python3 - "$label" "$hz" $((n1 - n0)) "$work/saturated.json" "$work/one.json" "$work/metrics.txt" <<'PY'
import json, sys
label, hz, node = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
sat, one = json.load(open(sys.argv[4])), json.load(open(sys.argv[5]))
metrics = open(sys.argv[6]).read().splitlines()
total = lambda name: sum(float(l.rsplit(" ", 1)[1]) for l in metrics if l.startswith(name))
cpu = node / hz * 1e3 / (sat["throughput_rps"] * 5 / 1e3)
print(f"| {label} | {sat['throughput_rps']:,.0f} req/s | {cpu:.1f} ms | {sat['latency_us']['p99'] / 1e3:.2f} ms | "
      f"{one['latency_us']['p50']} us | {one['latency_us']['p99']} us | {sat['errors'] + one['errors']} | "
      f"{total('edgeinfer_trace_spans_exported_total'):.0f} | {total('edgeinfer_trace_spans_dropped_total'):.0f} |")
PY
}

start_receiver 0
off=(EDGEINFER_TRACING__ENABLED=false)
one_pct=(EDGEINFER_TRACING__ENABLED=true "EDGEINFER_TRACING__ENDPOINT=$endpoint" EDGEINFER_TRACING__SAMPLE_RATIO=0.01)
all_pct=(EDGEINFER_TRACING__ENABLED=true "EDGEINFER_TRACING__ENDPOINT=$endpoint" EDGEINFER_TRACING__SAMPLE_RATIO=1)
echo "| run | 4 x 32 throughput | node CPU per 1k requests | 4 x 32 p99 | 1 in flight p50 | 1 in flight p99 | errors | spans exported | spans dropped |"
echo "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"
for round in $(seq "$rounds"); do
  order=("off" "1%" "100%")
  shift_by=$(((round - 1) % 3))
  order=("${order[@]:$shift_by}" "${order[@]:0:$shift_by}")
  if [ -n "${BASE:-}" ]; then BIN=$BASE run "round $round, before (no tracing in the build)"; fi
  for which in "${order[@]}"; do
    case $which in
      off) run "round $round, tracing off" "${off[@]}" ;;
      1%) run "round $round, on at 1%" "${one_pct[@]}" ;;
      100%) run "round $round, on at 100%" "${all_pct[@]}" ;;
    esac
  done
done
kill $receiver_pid && wait $receiver_pid 2>/dev/null || true
start_receiver 3
all_pct=(EDGEINFER_TRACING__ENABLED=true "EDGEINFER_TRACING__ENDPOINT=$endpoint" EDGEINFER_TRACING__SAMPLE_RATIO=1)
run "collector slow (3 s an export), on at 100%" "${all_pct[@]}"
kill $receiver_pid && wait $receiver_pid 2>/dev/null || true
run "collector down, on at 100%" "${all_pct[@]}"
run "tracing off, after" "${off[@]}"
