#!/usr/bin/env bash
# Issue 36: what one slow request does to the fast ones beside it. A node
# at RATE (200) fast requests a second (open loop, Poisson, 1 connection)
# for 6 s, without and then with a slow request (SLOW_MS, 2000) sent every
# 2 s among them,
# with the request journal off and on (the default), through one mosquitto
# (set_tcp_nodelay true, mosquitto's default window of 20 unacknowledged
# messages a client), cache off. Without the journal a request is
# acknowledged after its reply, in arrival order, so a slow one holds the
# acknowledgements of every request behind it, the broker's window fills,
# and the fast ones wait for it; with the journal they are acknowledged
# once journaled. docs/BENCHMARKS.md.
#
#   benches/slow_request.sh [BINARY]   (default target/release/edgeinfer)
#   SLOW_MS=5000 RATE=200 benches/slow_request.sh BINARY   (other figures)
#
# The slow request is the fail point `request_delay` (the request with id
# "slow" takes 2 s): BINARY must be built with it,
#   cargo build --release --features failpoints
set -euo pipefail
cd "$(dirname "$0")/.."
bin=${1:-target/release/edgeinfer}
slow_ms=${SLOW_MS:-2000}
rate=${RATE:-200}
command -v mosquitto_pub >/dev/null || { echo "slow_request.sh: apt-get install mosquitto-clients" >&2; exit 1; }
source benches/mosquitto.sh
slow_payload=$(sed 's/"id": "[^"]*"/"id": "slow"/' docs/examples/digits-request.json)
echo "slow request: $slow_ms ms; fast requests: $rate a second"
echo "| journal | slow requests | fast requests | fast p50 | fast p99 | fast max | errors, unanswered |"
echo "| --- | --- | --- | --- | --- | --- | --- |"
for journal in 0 67108864; do
  EDGEINFER_NODE__ID=sr EDGEINFER_NODE__STATE_DIR="$work/state-$journal" EDGEINFER_MQTT__URL=$url \
    EDGEINFER_HTTP__LISTEN= EDGEINFER_CACHE__ENABLED=false EDGEINFER_LOG=warn \
    EDGEINFER_MQTT__JOURNAL__MAX_BYTES=$journal FAILPOINTS="request_delay=return(slow:$slow_ms)" \
    "$bin" serve --models-dir models 2>"$work/node.log" &
  node=$!
  sleep 2
  # Is the slow request slow? (A build without the fail point answers it at once.)
  started=$(date +%s%N)
  mosquitto_rr -V mqttv5 -L "$url/edgeinfer/sr/infer/digits" -e dev/slow/replies -W $((slow_ms / 1000 + 5)) -m "$slow_payload" >/dev/null
  [ $(( ($(date +%s%N) - started) / 1000000 )) -ge $((slow_ms - 100)) ] \
    || { echo "slow_request.sh: $bin answers the slow request at once: build it with --features failpoints" >&2; exit 1; }
  for slow in none every-2-s; do
    "$bin" bench --url "$url" --node sr --connections 1 --rate "$rate" --warmup 1 --duration 6 --json >"$work/run.json" &
    bench=$!
    sent=0
    if [ "$slow" != none ]; then
      for _ in 1 2 3; do
        sleep 2
        mosquitto_pub -V mqttv5 -q 1 -L "$url/edgeinfer/sr/infer/digits" \
          -D publish response-topic dev/slow/replies -m "$slow_payload"
        sent=$((sent + 1))
      done
    fi
    wait $bench
    python3 - "$journal" "$sent" "$work/run.json" <<'PY'
import json, sys
journal, sent, r = sys.argv[1], sys.argv[2], json.load(open(sys.argv[3]))
l = r["latency_us"]
print(f"| {'off' if journal == '0' else 'on'} | {sent} | {r['requests']:,} | {l['p50']/1e3:.2f} ms | "
      f"{l['p99']/1e3:.2f} ms | {l['max']/1e3:.2f} ms | {r['errors']}, {r['unanswered']} |")
PY
  done
  kill -TERM $node && wait $node || true
done
