#!/usr/bin/env bash
# What traces cost a node in instructions, which do not move with the
# machine's load: the node (digits, cache off) runs under callgrind, its
# counters are zeroed after a warm-up, then `bench` sends requests one at a
# time for 20 s, and the instructions of every thread of the node are
# divided by the requests answered. Tracing off, on at 1% and on at 100%
# (exporting to tests/otlp/receiver.py), one after the other.
#
#   benches/trace_instructions.sh [BINARY]   (default target/release/edgeinfer)
#   IN_FLIGHT=N: N connections x 8 in flight instead of one request at a
#   time, so the node's work per second (timers, the exporter's posts) is
#   shared by more requests
#   OTLP_PYTHON: a Python with opentelemetry-proto (default python3)
set -euo pipefail
cd "$(dirname "$0")/.."
bin=${1:-target/release/edgeinfer}
python=${OTLP_PYTHON:-python3}
source benches/mosquitto.sh
"$python" tests/otlp/receiver.py --out "$work/spans.jsonl" --port-file "$work/port" &
for _ in $(seq 100); do [ -f "$work/port" ] && break; sleep 0.1; done
endpoint="http://127.0.0.1:$(cat "$work/port")/v1/traces"
echo "| node | requests | instructions per request |"
echo "| --- | --- | --- |"
for ratio in off 0.01 1; do
  tracing=(EDGEINFER_TRACING__ENABLED=false)
  [ "$ratio" = off ] || tracing=(EDGEINFER_TRACING__ENABLED=true "EDGEINFER_TRACING__ENDPOINT=$endpoint" "EDGEINFER_TRACING__SAMPLE_RATIO=$ratio")
  env "${tracing[@]}" EDGEINFER_NODE__ID=cg EDGEINFER_NODE__STATE_DIR="$work/state-$ratio" EDGEINFER_MQTT__URL="$url" \
    EDGEINFER_HTTP__LISTEN= EDGEINFER_CACHE__ENABLED=false EDGEINFER_LOG=${LOG:-info} \
    valgrind --tool=callgrind --callgrind-out-file="$work/cg-$ratio.out" "$bin" serve --models-dir models \
    2>"$work/node-$ratio.log" &
  node=$!
  for _ in $(seq 600); do grep -q "ready" "$work/node-$ratio.log" && break; sleep 0.5; done
  "$bin" bench --url "$url" --node cg --connections 1 -C 1 --duration 5 --json >/dev/null
  callgrind_control -z $node >/dev/null
  if [ -n "${IN_FLIGHT:-}" ]; then load=(--connections "$IN_FLIGHT" -C 8); else load=(--connections 1 -C 1); fi
  "$bin" bench --url "$url" --node cg "${load[@]}" --duration 20 --json >"$work/run.json"
  callgrind_control -d $node >/dev/null
  kill -TERM $node && wait $node || true
  [ -z "${KEEP:-}" ] || cp "$work"/cg-"$ratio".out.* "$KEEP"/
  python3 - "$ratio" "$work/run.json" "$work" <<'PY'
import glob, json, sys
ratio, run, work = sys.argv[1], json.load(open(sys.argv[2])), sys.argv[3]
# The dump taken after the zeroing: the newest numbered file.
dumps = sorted(glob.glob(f"{work}/cg-{ratio}.out.*"), key=lambda p: int(p.rsplit(".", 1)[1]))
total = 0
for line in open(dumps[-1]):
    if line.startswith(("summary:", "totals:")):
        total = int(line.split()[1])
label = "tracing off" if ratio == "off" else f"on at {float(ratio):.0%}"
print(f"| {label} | {run['requests']} | {total / run['requests']:,.0f} |")
PY
done
