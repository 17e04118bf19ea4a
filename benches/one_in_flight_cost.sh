#!/usr/bin/env bash
# What one request costs the node at one request in flight: for each
# ENV=VALUE list, a node (cache off, digits) through one mosquitto
# (set_tcp_nodelay true) under `bench --connections 1 -C 1`, and `perf
# stat` of the node for 5 s in the middle: CPU, context switches and
# write/writev/futex calls per request, with the p50 of that run. Needs
# perf (linux-perf) and perf_event_paranoid <= 1 (or root). Used for the
# journal's cost in docs/BENCHMARKS.md (issue 36).
#
#   benches/one_in_flight_cost.sh BINARY "ENV=VALUE ..." ["ENV=VALUE ..." ...]
set -euo pipefail
cd "$(dirname "$0")/.."
bin=$1
shift
source benches/mosquitto.sh
echo "| node | p50 | CPU per request | context switches | write | writev | futex |"
echo "| --- | --- | --- | --- | --- | --- | --- |"
for config in "$@"; do
  env $config EDGEINFER_NODE__ID=cost EDGEINFER_NODE__STATE_DIR="$work/state-$RANDOM" EDGEINFER_MQTT__URL=$url \
    EDGEINFER_HTTP__LISTEN= EDGEINFER_CACHE__ENABLED=false EDGEINFER_LOG=warn \
    "$bin" serve --models-dir models 2>"$work/node.log" &
  node=$!
  sleep 2
  "$bin" bench --url "$url" --node cost --connections 1 -C 1 --duration 8 --warmup 1 --json >"$work/run.json" &
  client=$!
  sleep 2
  perf stat -x, -o "$work/stat.txt" -p $node \
    -e task-clock,context-switches,syscalls:sys_enter_write,syscalls:sys_enter_writev,syscalls:sys_enter_futex \
    -- sleep 5
  wait $client
  kill -TERM $node && wait $node || true
  python3 - "$config" "$work/run.json" "$work/stat.txt" <<'PY'
import json, sys
config, run, stat = sys.argv[1], json.load(open(sys.argv[2])), sys.argv[3]
n = run["throughput_rps"] * 5
counts = {f[2]: float(f[0]) for f in (l.split(",") for l in open(stat) if l[:1].isdigit())}
per = lambda name: counts.get(name, 0) / n
print(f"| {config} | {run['latency_us']['p50']:.0f} us | {per('task-clock') * 1e3:.0f} us | "
      f"{per('context-switches'):.2f} | {per('syscalls:sys_enter_write'):.2f} | "
      f"{per('syscalls:sys_enter_writev'):.2f} | {per('syscalls:sys_enter_futex'):.2f} |")
PY
done
