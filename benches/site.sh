#!/bin/bash
# A site on this machine: mosquitto, one redis-server, N nodes in one share
# group; `edgeinfer bench --shared --distinct --keys K` against it.
# Usage: benches/site.sh BIN N [bench args...], e.g.
#   benches/site.sh target/release/edgeinfer 3 --distinct --keys 20000 --duration 10
BIN=$1; N=$2; shift 2
D=$(mktemp -d)
. "$(dirname "$0")/site-parts.sh"
start_broker_and_redis 21000
PIDS=()
for i in $(seq 1 $N); do
  EDGEINFER_NODE__ID=gw-$i EDGEINFER_NODE__STATE_DIR=$D/s$i EDGEINFER_MQTT__URL=mqtt://127.0.0.1:$MP \
  EDGEINFER_HTTP__LISTEN= EDGEINFER_CACHE__REDIS__ENABLED=true EDGEINFER_CACHE__REDIS__URL=redis://127.0.0.1:$RP \
  $BIN --models-dir "$(dirname "$0")/../models" serve > $D/node$i.log 2>&1 & PIDS+=($!)
done
sleep 2
EDGEINFER_MQTT__URL=mqtt://127.0.0.1:$MP $BIN --models-dir "$(dirname "$0")/../models" bench --shared "$@"
kill ${PIDS[@]} $MOSQ $RED 2>/dev/null; wait 2>/dev/null
rm -rf $D
