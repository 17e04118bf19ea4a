#!/usr/bin/env bash
# What the session layer of our own (issue 36) saves by itself: the broker's
# echo floor measured with the responder on rumqttc's event loop (one write
# per packet: a reply and its PUBACK are two) and on the session layer
# (each wakeup's packets in one write), alternately, ROUNDS times, through
# one mosquitto (set_tcp_nodelay true), at 4 x 32 in flight and at 1.
# docs/BENCHMARKS.md.
#
#   benches/echo_session.sh [BINARY] [ROUNDS]   (default target/release/edgeinfer, 3)
set -euo pipefail
cd "$(dirname "$0")/.."
bin=${1:-target/release/edgeinfer} rounds=${2:-3}
source benches/mosquitto.sh
source benches/row.sh
echo "| echo responder on | 4 x 32 in flight | 1 in flight | errors |"
echo "| --- | --- | --- | --- |"
for round in $(seq 1 "$rounds"); do
  for client in rumqttc session; do
    node="echo-$client-$round"
    sat=$("$bin" bench --echo --echo-client "$client" --url "$url" --node "$node-a" --connections 4 -C 32 --duration 8 --json)
    low=$("$bin" bench --echo --echo-client "$client" --url "$url" --node "$node-b" --connections 1 -C 1 --duration 5 --json)
    row "$client (round $round)" "$sat" "$low"
  done
done
