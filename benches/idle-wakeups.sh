#!/usr/bin/env bash
# Wake-ups of an idle node: a node with the default config and the shipped
# models (cache on, HTTP on, watchdog off), connected to mosquitto and sent
# nothing. Reads every thread's context switches (voluntary + involuntary,
# /proc/PID/task/*/status) at the start and the end of a quiet window and
# prints each thread's wake-ups a second, then the process's (issue 43).
#
#   benches/idle-wakeups.sh [BINARY] [SECONDS]   (default target/release/edgeinfer, 60)
#   WARM=1: the node answers (and caches) one request before the window.
#   WATCHDOG=30: as under systemd with WatchdogSec=30.
set -euo pipefail
cd "$(dirname "$0")/.."
bin=${1:-target/release/edgeinfer}
secs=${2:-60}
source benches/mosquitto.sh
dir=$work
# With WATCHDOG=SECONDS the node runs as under systemd's WatchdogSec: a
# notify socket (read here, the WATCHDOG=1 messages counted) and
# WATCHDOG_USEC, so it pets at half the interval after a probe request
# (the python reader goes with the other jobs at exit).
watchdog_env=()
if [ -n "${WATCHDOG:-}" ]; then
  python3 - "$dir/notify" > "$dir/notify.log" <<'PY' &
import socket, sys
s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
s.bind(sys.argv[1])
while True:
    msg = s.recv(4096).decode()
    print(msg.replace("\n", " "), flush=True)
PY
  while [ ! -S "$dir/notify" ]; do sleep 0.1; done
  watchdog_env=(NOTIFY_SOCKET="$dir/notify" WATCHDOG_USEC=$((WATCHDOG * 1000000)))
fi
# WATCHDOG_PID is the node's own pid, as systemd sets it: bash's, kept by exec.
bash -c 'WATCHDOG_PID=$$ exec "$@"' _ env "${watchdog_env[@]}" EDGEINFER_MQTT__URL="$url" EDGEINFER_NODE__ID=idle \
  EDGEINFER_NODE__STATE_DIR="$dir/state" EDGEINFER_HTTP__LISTEN=127.0.0.1:$((port + 1)) \
  "$bin" serve --models-dir models > "$dir/node.log" 2>&1 &
node=$!
# Past the start (plans, the first status) before the window opens. With
# WARM=1 the node first answers (and caches) one request over HTTP: idle
# after work, not only idle from the start.
sleep 10
if [ "${WARM:-0}" = 1 ]; then
  python3 - "$((port + 1))" <<'PY'
import json, sys, urllib.request
row = [float(v) for v in open("models/heldout/digits.csv").read().split("\n")[1].split(",")[1:]]
body = json.dumps({"id": "warm", "inputs": [{"name": "input", "shape": [1, 64], "datatype": "FP32", "data": row}]})
req = urllib.request.Request(f"http://127.0.0.1:{sys.argv[1]}/v2/models/digits/infer", body.encode(), {"Content-Type": "application/json"})
print(json.load(urllib.request.urlopen(req))["parameters"]["label"], file=sys.stderr)
PY
  sleep 2
fi
switches() {
  for t in /proc/$node/task/*; do
    printf '%s %s %s\n' "$(basename "$t")" "$(tr ' ' _ < "$t/comm")" \
      "$(awk '/^(non)?voluntary_ctxt_switches/ {s += $2} END {print s}' "$t/status")"
  done | sort
}
switches > "$dir/before"
echo "idle for $secs s..." >&2
sleep "$secs"
switches > "$dir/after"
if [ -n "${WATCHDOG:-}" ]; then
  echo "WATCHDOG=1 messages over the run: $(grep -c 'WATCHDOG=1' "$dir/notify.log")" >&2
fi
join "$dir/before" "$dir/after" | awk -v s="$secs" '
  { d = $5 - $3; total += d; if (d > 0) printf "%-22s %6.2f/s\n", $2, d / s }
  END { printf "%-22s %6.2f/s (%d threads)\n", "whole process", total / s, NR }'
