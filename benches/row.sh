# Sourced by the scripts in benches/ that print one table row per setup
# from two `edgeinfer bench --json` reports: saturated (4 x 32 in flight)
# and at one request in flight. `measure` takes the pair with $bin against
# the broker at $url (benches/mosquitto.sh); `node_row` starts a node
# ($node_bin, default $bin), measures it, stops it and prints its row.
measure() { # NODE [bench flags]: sets $sat (4 x 32 in flight) and $low (1 in flight)
  local node=$1
  shift
  sat=$("$bin" bench "$@" --url "$url" --node "$node" --connections 4 -C 32 --duration 8 --json)
  low=$("$bin" bench "$@" --url "$url" --node "$node" --connections 1 -C 1 --duration 5 --json)
}
row() { # name saturated-json low-json
  python3 - "$@" <<'PY'
import json, sys
name, sat, low = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])
l, m = sat["latency_us"], low["latency_us"]
print(f"| {name} | {sat['throughput_rps']:,.0f} req/s, p50 {l['p50']/1e3:.2f} ms, p99 {l['p99']/1e3:.2f} ms | "
      f"{low['throughput_rps']:,.0f} req/s, p50 {m['p50']:.0f} us, p99 {m['p99']:.0f} us | {sat['errors']+low['errors']} |")
PY
}
node_row() { # LABEL NODE [ENV=VALUE ...]: a node on $url with these settings (a state directory of its own)
  local label=$1 id=$2
  shift 2
  env EDGEINFER_NODE__ID="$id" EDGEINFER_NODE__STATE_DIR="$(mktemp -d "$work/state.XXXX")" \
    EDGEINFER_MQTT__URL="$url" EDGEINFER_HTTP__LISTEN= EDGEINFER_LOG=warn "$@" \
    "${node_bin:-$bin}" serve --models-dir models 2>"$work/node.log" &
  local node=$!
  sleep 2
  measure "$id"
  kill -TERM $node && wait $node || true
  row "$label" "$sat" "$low"
}
