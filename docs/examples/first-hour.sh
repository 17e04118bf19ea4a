#!/usr/bin/env bash
# A newcomer's first hour: README.md's commands, in its order, each checked
# for what the README says it gives. CI runs this in its fresh clone
# (.ci/run), and tests/integration/docs.rs fails when a command of the
# README is missing here, so the front door cannot rot unnoticed.
#
#   docs/examples/first-hour.sh           # in a fresh clone of this checkout's HEAD
#   docs/examples/first-hour.sh --here    # in this checkout (CI's is a fresh clone)
#
# Two liberties, both for "A real site": its config is written to a scratch
# directory ($etc) instead of /etc/edgeinfer, and its broker (a site's
# mqtts://broker.site:8883) is the node's embedded one started above.
# A third only where CARGO_BUILD_TARGET is set (CI sets it to the static
# x86-64 target cross/build.sh has just built, so the release build is
# not done twice; the same sources, profile and features, for musl instead
# of the host's libc): `cargo run` then builds for that target, and the
# binary is looked for under target/TARGET/release.
# `cargo test --features failpoints` is left to .ci/run, which runs it on
# the same clean checkout. Needs what the README needs: a Rust toolchain,
# mosquitto-clients and curl, with 127.0.0.1:1883 and :9464 free or the
# former a broker.
set -euo pipefail
repo="$(cd "$(dirname "$0")/../.." && pwd)"
work="$(mktemp -d)"
node=
cleanup() {
    [ -z "$node" ] || kill "$node" 2>/dev/null || true
    [ -z "$node" ] || wait "$node" 2>/dev/null || true
    rm -rf "$work"
}
trap cleanup EXIT
fail() {
    echo "first-hour: $*" >&2
    [ ! -f "$work/serve.log" ] || tail -n 20 "$work/serve.log" >&2
    exit 1
}
step() { echo "== $*"; }
# A reply the README promises: the held-out 7 is answered as a 7.
answers_seven() { grep -q '"label":"7"' <<<"$1" || fail "$2 did not answer label 7: $1"; }

if [ "${1:-}" = --here ] || ! git -C "$repo" rev-parse --git-dir > /dev/null 2>&1; then
    cd "$repo"
else
    git clone --quiet "$repo" "$work/edgeinfer"
    cd "$work/edgeinfer"
fi

step "Set up: the main job on the embedded broker (builds first)"
cargo run --release -- serve > "$work/serve.log" 2>&1 &
node=$!
started=$SECONDS
note=60
until curl -sf localhost:9464/v2/health/ready > /dev/null; do
    kill -0 "$node" 2>/dev/null || fail "cargo run --release -- serve exited"
    [ $((SECONDS - started)) -lt 1800 ] || fail "serve not ready after 30 minutes"
    if [ $((SECONDS - started)) -ge $note ]; then
        echo "   building or starting: $((SECONDS - started)) s"
        note=$((note + 60))
    fi
    sleep 1
done
echo "   ready $((SECONDS - started)) s after cargo run"

step "The first request over MQTT"
reply=$(mosquitto_rr -h 127.0.0.1 -p 1883 -t "edgeinfer/$(hostname)/infer/digits" -e devices/cam-3/replies \
  -m "$(cat docs/examples/digits-request.json)" -W 5) || fail "mosquitto_rr got no reply"
answers_seven "$reply" "MQTT"

step "The same over HTTP"
reply=$(curl -s -XPOST localhost:9464/v2/models/digits/infer -d @docs/examples/digits-request.json)
answers_seven "$reply" "HTTP"

step "Without a network, through the same pipeline"
reply=$(cargo run --release -- infer --model digits --input docs/examples/digits-request.json 2> "$work/infer.log") \
    || fail "infer failed: $(cat "$work/infer.log")"
answers_seven "$reply" "infer"

step "A real site: the README's config, checked, and doctor"
etc="$work/etc/edgeinfer"
mkdir -p "$etc"
awk '/^```toml$/ { inside = 1; next } /^```$/ { inside = 0 } inside' README.md \
    | sed -e "s|/etc/edgeinfer|$etc|g" -e 's|mqtts://broker.site:8883|mqtt://127.0.0.1:1883|' > "$etc/edgeinfer.toml"
grep -q 'id = "gw-01"' "$etc/edgeinfer.toml" || fail "README.md lost its site config"
printf 'site-password\n' > "$etc/mqtt.password"
head -c 24 /dev/urandom | base64 > "$etc/admin.token"
chmod 0600 "$etc/mqtt.password" "$etc/admin.token"
PATH="$PWD/target/${CARGO_BUILD_TARGET:+$CARGO_BUILD_TARGET/}release:$PATH"
edgeinfer config check $etc/edgeinfer.toml   # every mistake at once, with the fix
edgeinfer --config $etc/edgeinfer.toml doctor # config, models, state dir, broker login and
                                              # round trip, systemd limits, clock, Redis, cloud
step "Feedback and field quality: the first request's answer, joined"
mosquitto_pub -V 5 -h 127.0.0.1 -p 1883 -t edgeinfer/feedback -m '{"id": "req-17", "label": "1"}'
reply=$(curl -s localhost:9464/v2/feedback -d '{"id": "req-17", "outcome": 0, "weight": 2}')
grep -q '"status":"joined"' <<<"$reply" || fail "the feedback did not join: $reply"
for _ in $(seq 50); do
    curl -s localhost:9464/metrics | grep -q '^edgeinfer_feedback_total{.*kind="label".*} 1' && break
    sleep 0.1
done
curl -s localhost:9464/metrics | grep -q '^edgeinfer_feedback_total{.*kind="label".*} 1' \
    || fail "the label on the site's topic was not joined"
echo "first-hour: every README command worked as written"
