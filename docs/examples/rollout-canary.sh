#!/bin/bash
# docs/ROLLOUTS.md's worked example: a canary of digits v2 against v1 on a release node.
# Run from the repository root after `cargo build --release`; it takes about 45 s.
set -e
B=${EDGEINFER:-target/release/edgeinfer}
W=$(mktemp -d)
mkdir -p $W/models/digits
cp -r ./models/digits/1 $W/models/digits/1
cp -r ./models/digits/1 $W/models/digits/2
sed -i 's/version = "1"/version = "2"/' $W/models/digits/2/model.toml
# Rollout commands over HTTP need the admin token; the node and the commands read it from here.
echo "example-admin-token" > $W/admin.token
export EDGEINFER_HTTP__ADMIN_TOKEN_FILE=$W/admin.token
export EDGEINFER_NODE__STATE_DIR=$W/state EDGEINFER_HTTP__LISTEN=127.0.0.1:19464 EDGEINFER_MQTT__EMBEDDED_BROKER=true EDGEINFER_MQTT__URL=mqtt://127.0.0.1:11883 EDGEINFER_NODE__ID=gw-1
$B --models-dir $W/models models promote digits 1 >/dev/null
$B --models-dir $W/models serve --log warn &
NODE=$!
sleep 1.5
python3 - <<'PY' &
import http.client, json, time, csv
rows=[l.strip().split(',') for l in open('./models/heldout/digits.csv') if not l.startswith('#')]
c=http.client.HTTPConnection('127.0.0.1',19464)
t=time.time(); i=0
while time.time()-t<40:
    r=rows[i%len(rows)]
    body=json.dumps({"id":f"req-{i}","inputs":[{"name":"input","shape":[1,64],"datatype":"FP32","data":[float(x) for x in r[1:]]}]})
    # 200 devices, each naming itself: a rollout splits HTTP clients by X-Device-Id.
    c.request('POST','/v2/models/digits/infer',body,{'Content-Type':'application/json','X-Device-Id':f"dev-{i%200}"}); c.getresponse().read()
    i+=1; time.sleep(0.005)
PY
LOAD=$!
sleep 1
echo '$ edgeinfer models rollout digits 2 --gates bake_s=5,min_requests=30'
$B --models-dir $W/models models rollout digits 2 --gates bake_s=5,min_requests=30 --url http://127.0.0.1:19464
sleep 3
echo
echo '$ edgeinfer models status digits'
$B --models-dir $W/models models status digits --url http://127.0.0.1:19464
sleep 22
echo
echo '$ edgeinfer models status digits'
$B --models-dir $W/models models status digits --url http://127.0.0.1:19464
wait $LOAD || true
kill $NODE; wait $NODE 2>/dev/null || true
rm -rf $W
