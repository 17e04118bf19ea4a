#!/usr/bin/env bash
# Idle memory with the disk layer's store fresh and full: the node's RSS 10 s
# after start on an empty state directory, after SECONDS of open-loop
# distinct-input load (every answer goes to the store), and 10 s after a
# restart on that same state directory, with how long the restarted node
# took to be ready.
# docs/BENCHMARKS.md, "Idle after a restart".
#
#   benches/idle_restart.sh [BINARY] [SECONDS] [RATE]
#   (defaults: target/release/edgeinfer, 60, 2000 req/s over 2 connections)
#
# EDGEINFER_* variables in the environment reach the node (for example
# EDGEINFER_CACHE__DISK_BYTES=33554432).
set -euo pipefail
cd "$(dirname "$0")/.."
bin=${1:-target/release/edgeinfer} seconds=${2:-60} rate=${3:-2000}
source benches/mosquitto.sh
state="$work/state"
kib() { awk -v k="$1" '$1 == k":" {print $2}' "/proc/$node/status"; }
show() { # what
  awk -v what="$1" -v rss="$(kib VmRSS)" -v anon="$(kib RssAnon)" -v threads="$(kib Threads)" \
    -v disk="$(du -sb "$state" | cut -f1)" 'BEGIN {
      printf "| %s | %.1f MiB | %.1f MiB | %d | %.1f MiB |\n", what, rss / 1024, anon / 1024, threads, disk / 2^20 }'
}
start() {
  EDGEINFER_NODE__ID=idle EDGEINFER_NODE__STATE_DIR="$state" EDGEINFER_MQTT__URL=$url \
    EDGEINFER_LOG=warn,edgeinfer::node=info \
    "$bin" serve --models-dir models 2>>"$work/node.log" &
  node=$!
  sleep 10
}
echo "| node | RSS | of it anonymous | threads | state dir |"
echo "| --- | --- | --- | --- | --- |"
start
show "10 s after start, empty state dir"
"$bin" bench --url "$url" --node idle --distinct --rate "$rate" --duration "$seconds" --connections 2 \
  --json >/dev/null
show "after $seconds s at $rate req/s, distinct inputs"
kill "$node" && wait "$node" || true
: >"$work/node.log"
start
show "10 s after a restart on that state dir"
kill "$node" && wait "$node" || true
echo
grep -ho "ready [0-9.]* ms after start" "$work/node.log" | sed 's/^/restarted: /'

