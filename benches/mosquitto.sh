# Sourced by the scripts in benches/: a scratch directory ($work, removed on
# exit with every background job) and a mosquitto on a random port with
# set_tcp_nodelay (the setting that matters for latency), reachable at $url.
port=$((20000 + RANDOM % 20000))
work=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null || true; rm -rf "$work"' EXIT
printf 'listener %s 127.0.0.1\nallow_anonymous true\nset_tcp_nodelay true\n' "$port" >"$work/mosquitto.conf"
mosquitto -c "$work/mosquitto.conf" >"$work/mosquitto.log" 2>&1 &
sleep 0.5
url=mqtt://127.0.0.1:$port
