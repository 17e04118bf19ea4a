#!/usr/bin/env bash
# Issue 36's cache-hit figure: the same request again and again (`bench`
# without --distinct, the cache on, every other setting default), the node
# with replies at QoS 2 (the default) and at QoS 1, beside the broker's echo
# floor, through one mosquitto (set_tcp_nodelay true), ROUNDS times, each
# saturated (4 x 32 in flight) and at one request in flight.
# docs/BENCHMARKS.md.
#
#   benches/cache_hit.sh [BINARY] [ROUNDS]   (default target/release/edgeinfer, 2)
set -euo pipefail
cd "$(dirname "$0")/.."
bin=${1:-target/release/edgeinfer}
rounds=${2:-2}
source benches/mosquitto.sh
source benches/row.sh
echo "| setup | 4 x 32 in flight | 1 in flight | errors |"
echo "| --- | --- | --- | --- |"
for round in $(seq "$rounds"); do
  measure echo --echo
  row "broker echo floor" "$sat" "$low"
  for qos in 2 1; do
    node_row "node, cache hits, reply_qos $qos" ch EDGEINFER_MQTT__REPLY_QOS=$qos
  done
done
