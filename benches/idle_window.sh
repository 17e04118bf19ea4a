#!/usr/bin/env bash
# The batching window at low load and saturated, in one run through one
# mosquitto (set_tcp_nodelay true): the broker's echo floor, a node with the
# default batching config (max_batch 32, max_delay_us 2000), and the same node
# with max_delay_us = 0, each at one request in flight and at 4 x 32, the
# cache off (distinct inputs are not needed: --no-cache). docs/BENCHMARKS.md.
#
#   benches/idle_window.sh [BINARY]        (default target/release/edgeinfer)
#
# With PEER_PYTHON=/path/to/python (one with paho-mqtt, onnxruntime and
# numpy; see benches/peer_python.py) a last row measures the Python peer a
# user would write instead, on the same broker.
set -euo pipefail
cd "$(dirname "$0")/.."
bin=${1:-target/release/edgeinfer}
source benches/mosquitto.sh
source benches/row.sh
echo "| setup | 4 x 32 in flight | 1 in flight | errors |"
echo "| --- | --- | --- | --- |"
measure echo --echo
row "broker echo floor" "$sat" "$low"
for delay in 2000 0; do
  node_row "node, max_batch 32, max_delay_us $delay" iw \
    EDGEINFER_RUNTIME__MAX_DELAY_US=$delay EDGEINFER_CACHE__ENABLED=false
done
if [ -n "${PEER_PYTHON:-}" ]; then
  "$PEER_PYTHON" benches/peer_python.py --url "$url" --node peer 2>"$work/peer.log" &
  peer=$!
  sleep 2
  measure peer --no-cache
  kill $peer
  row "Python peer (paho-mqtt + onnxruntime, benches/peer_python.py)" "$sat" "$low"
fi
