#!/bin/bash
# What a dead Redis costs a node: open-loop latency of one node (mosquitto,
# the shared Redis layer on, timeout_ms at its default) in four runs, side
# by side: the cache off (`parameters.cache = false`), Redis up, Redis hung
# (SIGSTOP: lookups wait out the timeout) and Redis killed (connections
# refused), each 3 s into the measured run (after the 1 s warm-up). Every
# request is distinct, so each one misses and (with the cache on) looks
# Redis up.
# Usage: benches/redis-down.sh BIN [RATE] [SECONDS], e.g.
#   benches/redis-down.sh target/release/edgeinfer 1000 10
BIN=$1; RATE=${2:-1000}; SECS=${3:-10}
MODELS="$(dirname "$0")/../models"
D=$(mktemp -d)
trap 'kill $NODE $MOSQ $RED 2>/dev/null; kill -CONT $RED 2>/dev/null; rm -rf $D' EXIT
. "$(dirname "$0")/site-parts.sh"
start_broker_and_redis 23000
EDGEINFER_NODE__ID=gw-1 EDGEINFER_NODE__STATE_DIR=$D/s EDGEINFER_MQTT__URL=mqtt://127.0.0.1:$MP \
EDGEINFER_HTTP__LISTEN=127.0.0.1:$((MP + 2000)) EDGEINFER_CACHE__REDIS__ENABLED=true \
EDGEINFER_CACHE__REDIS__URL=redis://127.0.0.1:$RP \
  $BIN --models-dir "$MODELS" serve > $D/node.log 2>&1 & NODE=$!
sleep 2
run() { # NAME FROM [bench args...]
  local name=$1 from=$2; shift 2
  EDGEINFER_MQTT__URL=mqtt://127.0.0.1:$MP $BIN --models-dir "$MODELS" bench --node gw-1 --rate $RATE \
    --duration $SECS --distinct --distinct-from $from --json "$@" > $D/$name.json 2> $D/$name.err
  python3 - "$name" "$D/$name.json" <<'P'
import json, sys
r = json.load(open(sys.argv[2]))
l = r["latency_us"]
print(f"{sys.argv[1]:<20} answered {r['requests']:>7}  errors {r['errors']:>3}  unanswered {r['unanswered']:>3}  "
      f"p50 {l['p50'] / 1000:6.2f} ms  p99 {l['p99'] / 1000:6.2f} ms  p99.9 {l['p999'] / 1000:6.2f} ms")
P
}
echo "one node, $RATE req/s open loop, ${SECS} s per run, distinct inputs"
run cache-off 0 --no-cache
run redis-up 10000000
( sleep 4; kill -STOP $RED ) & KILLER=$!
run redis-hung-at-3s 20000000
wait $KILLER
kill -CONT $RED
sleep 6  # the layer's rest (up to 5 s) ends and a lookup finds it back
( sleep 4; kill $RED ) & KILLER=$!
run redis-killed-at-3s 30000000
wait $KILLER
curl -s 127.0.0.1:$((MP + 2000))/metrics | grep -E '^edgeinfer_cache_redis_(up|errors_total)'
python3 - $D <<'P'
import json, sys
runs = ("cache-off", "redis-up", "redis-hung-at-3s", "redis-killed-at-3s")
p99 = {n: json.load(open(f"{sys.argv[1]}/{n}.json"))["latency_us"]["p99"] for n in runs}
print("p99 against the cache off: " + ", ".join(f"{n} {p99[n] / p99['cache-off']:.2f}x" for n in runs[1:]))
P
