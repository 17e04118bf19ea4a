#!/usr/bin/env python3
"""The peer a user would write instead of edgeinfer: paho-mqtt (MQTT 5) and
onnxruntime serving the same INT8 `digits` model on the same topic layout,
so `edgeinfer bench --node peer` measures it exactly as it measures a node.

It answers each request on its Response Topic with its Correlation Data,
QoS 1, with the probabilities and the label; no cache, no batching, one
paho network thread (what a short script does). Issue 19 compares the node
against it (docs/BENCHMARKS.md).

    python3 -m venv /tmp/peer && /tmp/peer/bin/pip install paho-mqtt onnxruntime numpy
    /tmp/peer/bin/python benches/peer_python.py --url mqtt://127.0.0.1:1883 &
    edgeinfer bench --url mqtt://127.0.0.1:1883 --node peer --no-cache --connections 1 -C 1
"""

import argparse
import json
import pathlib
import socket
import tomllib
from urllib.parse import urlparse

import numpy as np
import onnxruntime as ort
import paho.mqtt.client as mqtt
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

ROOT = pathlib.Path(__file__).resolve().parent.parent


def main():
    args = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    args.add_argument("--url", default="mqtt://127.0.0.1:1883")
    args.add_argument("--node", default="peer", help="the NODE of edgeinfer/NODE/infer/digits")
    args.add_argument("--model-dir", default=str(ROOT / "models/digits/1"))
    a = args.parse_args()

    model_dir = pathlib.Path(a.model_dir)
    manifest = tomllib.loads((model_dir / "model.toml").read_text())
    scale = manifest["preprocess"]["scale"]
    labels = manifest["labels"]
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    session = ort.InferenceSession(str(model_dir / manifest["file"]), options, providers=["CPUExecutionProvider"])
    input_name = session.get_inputs()[0].name

    def on_message(client, _userdata, msg):
        props = msg.properties
        reply_to = getattr(props, "ResponseTopic", None)
        if not reply_to:
            return
        reply = Properties(PacketTypes.PUBLISH)
        if getattr(props, "CorrelationData", None) is not None:
            reply.CorrelationData = props.CorrelationData
        try:
            request = json.loads(msg.payload)
            tensor = request["inputs"][0]
            x = np.asarray(tensor["data"], dtype=np.float32).reshape(tensor["shape"]) * scale
            probabilities = session.run(None, {input_name: x})[0]
            top = int(probabilities[0].argmax())
            body = {
                "id": request.get("id", ""),
                "model_name": "digits",
                "outputs": [
                    {
                        "name": "probabilities",
                        "shape": list(probabilities.shape),
                        "datatype": "FP32",
                        "data": probabilities.ravel().tolist(),
                    }
                ],
                "parameters": {"label": labels[top], "confidence": float(probabilities[0, top])},
            }
        except Exception as e:  # a bad request gets an error reply, as the node's would
            body = {"error": str(e), "parameters": {"code": "invalid_payload"}}
        client.publish(reply_to, json.dumps(body), qos=1, properties=reply)

    url = urlparse(a.url)
    client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=f"peer-{a.node}", protocol=mqtt.MQTTv5)
    client.on_message = on_message

    def on_connect(c, *_):
        # Without it replies wait for delayed ACKs (~40 ms); the node and
        # mosquitto (set_tcp_nodelay) both set it, so the peer does too.
        c.socket().setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        c.subscribe(f"edgeinfer/{a.node}/infer/digits", qos=1)

    client.on_connect = on_connect
    client.connect(url.hostname, url.port or 1883)
    client.loop_forever()


if __name__ == "__main__":
    main()
