#!/usr/bin/env bash
# What the request journal (issue 36, `mqtt.journal`) costs, in one run
# through one mosquitto (set_tcp_nodelay true): the broker's echo floor,
# then the node with the journal off (replies at QoS 1), on without fsync,
# on with fsync and replies at QoS 1, and the defaults (fsync, replies at
# QoS 2 with their packet ids journaled), each saturated (4 x 32 in
# flight) and at one request in flight, the cache off. The journal lives in a scratch directory on the
# disk that holds $TMPDIR (a tmpfs there makes fsync free: point TMPDIR at
# the card the node will run on). Two echo floors: replies at QoS 1, and
# at QoS 2 (the floor of the QoS 2 default: the broker delivers a QoS 2
# reply once it has the PUBREL, a round trip later). docs/BENCHMARKS.md.
#
#   benches/journal.sh [BINARY] [ROUNDS]   (default target/release/edgeinfer, 1)
#   ECHO_BIN=...: the binary whose `bench` runs the load and the echo (one
#   with `--echo-reply-qos`, for an older node); default BINARY.
set -euo pipefail
cd "$(dirname "$0")/.."
node_bin=${1:-target/release/edgeinfer}
bin=${ECHO_BIN:-$node_bin}
rounds=${2:-1}
source benches/mosquitto.sh
source benches/row.sh
echo "journal directory on: $(df --output=source,fstype "${TMPDIR:-/tmp}" | tail -n 1)"
echo "| setup | 4 x 32 in flight | 1 in flight | errors |"
echo "| --- | --- | --- | --- |"
for round in $(seq "$rounds"); do
  measure echo --echo
  row "broker echo floor" "$sat" "$low"
  measure echo --echo --echo-reply-qos 2
  row "broker echo floor, replies at QoS 2" "$sat" "$low"
  for setup in "off 0 true 1" "on-no-fsync-qos1 67108864 false 1" "on-fsync-qos1 67108864 true 1" \
    "on-fsync-qos2-default 67108864 true 2"; do
    read -r name bytes fsync qos <<<"$setup"
    node_row "node, journal $name" jn EDGEINFER_CACHE__ENABLED=false \
      EDGEINFER_MQTT__JOURNAL__MAX_BYTES=$bytes EDGEINFER_MQTT__JOURNAL__FSYNC=$fsync EDGEINFER_MQTT__REPLY_QOS=$qos
  done
done
