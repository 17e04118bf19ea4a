#!/usr/bin/env bash
# Two edgeinfer builds side by side through the same mosquitto, in one run:
# for each round and each build, a node with no batching (max_batch 1) is
# measured saturated (4 connections x 32 in flight) and at low load (one in
# flight) with the second build's `bench` as the client. For changes that
# should not move the request path's speed (docs/BENCHMARKS.md).
#
#   benches/pipeline_ab.sh BEFORE_BINARY AFTER_BINARY [ROUNDS]
#
# Needs mosquitto. Prints one line per measurement.
set -euo pipefail
cd "$(dirname "$0")/.."
before=$1 after=$2 rounds=${3:-2}
source benches/mosquitto.sh
measure() { # name binary
  local name=$1 bin=$2 state="$work/state-$1-$RANDOM"
  EDGEINFER_NODE__ID=ab EDGEINFER_NODE__STATE_DIR="$state" EDGEINFER_MQTT__URL=$url \
    EDGEINFER_HTTP__LISTEN= EDGEINFER_RUNTIME__MAX_BATCH=1 EDGEINFER_LOG=warn \
    "$bin" serve --models-dir models 2>"$work/node.log" &
  local node=$!
  sleep 2
  local saturated low
  saturated=$("$after" bench --url "$url" --node ab --connections 4 -C 32 --duration 8 --json)
  low=$("$after" bench --url "$url" --node ab --connections 1 -C 1 --duration 5 --json)
  kill -TERM $node && wait $node || true
  python3 - "$name" "$saturated" "$low" <<'PY'
import json, sys
name, sat, low = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])
l, m = sat["latency_us"], low["latency_us"]
print(f"{name:7} 4x32: {sat['throughput_rps']:8.0f} req/s p50 {l['p50']/1e3:6.2f} ms p99 {l['p99']/1e3:6.2f} ms | "
      f"1 in flight: {low['throughput_rps']:6.0f} req/s p50 {m['p50']:5.0f} us p99 {m['p99']:6.0f} us | errors {sat['errors']+low['errors']}")
PY
}
# Alternate which build goes first, so neither always meets a fresh broker.
for round in $(seq 1 "$rounds"); do
  echo "round $round"
  if ((round % 2)); then
    measure before "$before"
    measure after "$after"
  else
    measure after "$after"
    measure before "$before"
  fi
done
