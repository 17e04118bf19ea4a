#!/usr/bin/env bash
# Where the CPU goes at saturation: 4 connections x 32 in flight through one
# mosquitto (set_tcp_nodelay true), first against the echo responder
# (`bench --echo`, in the load generator's own process), then against a node
# with the cache off. For 5 s in the middle of each 8 s run it reads the
# CPU time of the broker, the load generator and the node from /proc and
# prints it per 1,000 requests: on a machine where all three share the
# cores, the node reaches the echo floor's throughput only when its own
# cost per request comes near the echo responder's. docs/BENCHMARKS.md.
#
#   benches/cpu_split.sh [BINARY] [ENV=VALUE ...]
#   (default target/release/edgeinfer; each ENV=VALUE list is one more node
#   run, e.g. EDGEINFER_RUNTIME__IO_THREADS=1)
set -euo pipefail
cd "$(dirname "$0")/.."
bin=${1:-target/release/edgeinfer}
shift || true
source benches/mosquitto.sh
broker=$(pgrep -n mosquitto)
ticks() { awk '{print $14 + $15}' "/proc/$1/stat"; } # user + system, in clock ticks
hz=$(getconf CLK_TCK)
measure() { # label node-pid bench-flags...
  local label=$1 node=$2
  shift 2
  "$bin" bench "$@" --url "$url" --connections 4 -C 32 --duration 8 --json >"$work/run.json" &
  local client=$!
  sleep 2
  local b0 c0 n0=0 b1 c1 n1=0
  b0=$(ticks "$broker") c0=$(ticks $client)
  [ "$node" = - ] || n0=$(ticks "$node")
  sleep 5
  b1=$(ticks "$broker") c1=$(ticks $client)
  [ "$node" = - ] || n1=$(ticks "$node")
  wait $client
  python3 - "$label" "$hz" $((b1 - b0)) $((c1 - c0)) $((n1 - n0)) "$work/run.json" <<'PY'
import json, sys
label, hz, broker, client, node, path = sys.argv[1], *map(int, sys.argv[2:6]), sys.argv[6]
r = json.load(open(path))
per_k = lambda t: t / hz * 1e3 / (r["throughput_rps"] * 5 / 1e3)  # ms of CPU per 1,000 requests
print(f"| {label} | {r['throughput_rps']:,.0f} req/s | {per_k(broker):.1f} ms | {per_k(client):.1f} ms | "
      f"{per_k(node):.1f} ms | {r['errors']} |")
PY
}
echo "| run | throughput | broker CPU per 1k requests | load generator (+ echo) | node | errors |"
echo "| --- | --- | --- | --- | --- | --- |"
measure "echo responder" - --echo --node echo
for config in "" "$@"; do
  env $config EDGEINFER_NODE__ID=cpu EDGEINFER_NODE__STATE_DIR="$work/state" EDGEINFER_MQTT__URL=$url \
    EDGEINFER_HTTP__LISTEN= EDGEINFER_CACHE__ENABLED=false EDGEINFER_LOG=warn \
    "$bin" serve --models-dir models 2>"$work/node.log" &
  node=$!
  sleep 2
  measure "node, cache off${config:+, $config}" $node --node cpu
  kill $node && wait $node || true
done
