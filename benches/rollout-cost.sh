#!/bin/bash
# What a rollout costs a node: closed-loop throughput and latency of one node
# (mosquitto, digits v1 stable beside its twin v2, cache off per request) in
# three runs side by side: no rollout, a canary at 100% of devices (every
# answer comes from v2 and is run again on v1 to compare: the most a canary
# costs at compare_share = 1.0), and shadow (every answer is v1's, and run
# again on v2). The gates are set so the rollout never ends during the runs.
# Usage: benches/rollout-cost.sh BIN [SECONDS], e.g.
#   benches/rollout-cost.sh target/release/edgeinfer 10
BIN=$1; SECS=${2:-10}
REPO="$(dirname "$0")/.."
D=$(mktemp -d)
trap 'kill $NODE $MOSQ $RED 2>/dev/null; rm -rf $D' EXIT
. "$(dirname "$0")/site-parts.sh"
start_broker_and_redis 25000
mkdir -p $D/models/digits
cp -r "$REPO/models/digits/1" $D/models/digits/1
cp -r "$REPO/models/digits/1" $D/models/digits/2
sed -i 's/version = "1"/version = "2"/' $D/models/digits/2/model.toml
# Rollout commands over HTTP need the admin token; the node and the commands read it from here.
echo "bench-admin-token" > $D/admin.token
export EDGEINFER_HTTP__ADMIN_TOKEN_FILE=$D/admin.token
export EDGEINFER_NODE__STATE_DIR=$D/s EDGEINFER_HTTP__LISTEN=127.0.0.1:$((MP + 2000))
$BIN --models-dir $D/models models promote digits 1 > /dev/null
EDGEINFER_NODE__ID=gw-1 EDGEINFER_MQTT__URL=mqtt://127.0.0.1:$MP \
  $BIN --models-dir $D/models serve > $D/node.log 2>&1 & NODE=$!
sleep 2
URL=http://127.0.0.1:$((MP + 2000))
run() { # NAME
  EDGEINFER_MQTT__URL=mqtt://127.0.0.1:$MP $BIN --models-dir $D/models bench --node gw-1 \
    --duration $SECS --no-cache --json > $D/$1.json 2> $D/$1.err
  python3 - "$1" "$D/$1.json" <<'P'
import json, sys
r = json.load(open(sys.argv[2]))
l = r["latency_us"]
print(f"{sys.argv[1]:<22} {r['throughput_rps']:>8.0f} req/s  errors {r['errors']:>3}  "
      f"p50 {l['p50'] / 1000:6.2f} ms  p99 {l['p99'] / 1000:6.2f} ms")
P
}
never="bake_s=100000,min_requests=100000000,max_wait_s=100000"
echo "one node, closed loop (4 connections x 32 in flight), ${SECS} s per run, cache off"
run no-rollout
$BIN --models-dir $D/models models rollout digits 2 --steps 100 --gates $never --url $URL > /dev/null
run canary-100%-compared
$BIN --models-dir $D/models models rollback digits --url $URL > /dev/null
$BIN --models-dir $D/models models rollout digits 2 --mode shadow --gates $never --url $URL > /dev/null
run shadow
$BIN --models-dir $D/models models status digits --url $URL | grep -E "stable |candidate "
