#!/usr/bin/env bash
# Smoke test of a static edgeinfer binary, under qemu-user for a foreign
# architecture: it is static, within the size budget, its kernels pass the
# golden vectors (`models verify`), and `serve` with the embedded broker
# answers one MQTT request.
#
#   cross/smoke.sh dist/edgeinfer-aarch64-unknown-linux-musl
#
# Needs file, mosquitto_rr (mosquitto-clients) and, for arm64 on x86-64,
# qemu-user-static.
set -euo pipefail
cd "$(dirname "$0")/.."
bin=$1
# The speed build's budget; the size profile (`cross/build.sh --small`) has 20 MiB.
budget=$((32 * 1024 * 1024))
case "$bin" in *-small) budget=$((20 * 1024 * 1024)) ;; esac
run=()
case "$(file -b "$bin")" in
    *aarch64*) [ "$(uname -m)" = aarch64 ] || run=(qemu-aarch64-static) ;;
    *x86-64*) [ "$(uname -m)" = x86_64 ] || run=(qemu-x86_64-static) ;;
esac

echo "-- file: $(file -b "$bin")"
# Rust's musl targets link static-pie: static, with ASLR for the binary too.
file -b "$bin" | grep -Eq "statically linked|static-pie linked" || { echo "FAIL: $bin is not statically linked" >&2; exit 1; }
size=$(stat -c %s "$bin")
echo "-- size: $size bytes (budget $budget)"
[ "$size" -le "$budget" ] || { echo "FAIL: $bin is larger than its budget of $budget bytes" >&2; exit 1; }

echo "-- models verify ${run[*]:-(native)}"
"${run[@]}" "$bin" models verify --models-dir models --iterations 20

echo "-- serve, one MQTT request"
port=$((20000 + RANDOM % 20000))
state=$(mktemp -d)
trap 'kill "$pid" 2>/dev/null || true; rm -rf "$state"' EXIT
EDGEINFER_NODE__ID=smoke EDGEINFER_MQTT__URL="mqtt://127.0.0.1:$port" EDGEINFER_MQTT__EMBEDDED_BROKER=true \
    EDGEINFER_HTTP__LISTEN="" EDGEINFER_NODE__STATE_DIR="$state" \
    "${run[@]}" "$bin" serve --models-dir models > "$state/log" 2>&1 &
pid=$!
for _ in $(seq 1 300); do
    grep -q "MQTT connected" "$state/log" && break
    kill -0 "$pid" 2>/dev/null || { cat "$state/log"; echo "FAIL: serve exited" >&2; exit 1; }
    sleep 0.1
done
grep -q "MQTT connected" "$state/log" || { cat "$state/log"; echo "FAIL: serve never connected" >&2; exit 1; }
reply=$(mosquitto_rr -V mqttv5 -h 127.0.0.1 -p "$port" -t edgeinfer/smoke/infer/digits -e smoke/replies \
    -m "$(cat docs/examples/digits-request.json)" -W 30)
echo "-- reply: $reply"
echo "$reply" | grep -q '"label":"7"' || { echo "FAIL: no label 7 in the reply" >&2; exit 1; }
kill -TERM "$pid"
wait "$pid" || { cat "$state/log"; echo "FAIL: serve did not exit 0 on SIGTERM" >&2; exit 1; }
echo "-- ok"
