#!/usr/bin/env python3
"""Exec to READY=1: start `BIN serve --models-dir models` with a unix
datagram socket as NOTIFY_SOCKET and time the first READY=1, RUNS times.

    cross/cold_start.py dist/edgeinfer-x86_64-unknown-linux-musl mqtt://127.0.0.1:18900 8
    cross/cold_start.py BIN embedded 6        # the embedded broker on 127.0.0.1:18950
"""
import os
import pathlib
import socket
import subprocess
import sys
import tempfile
import time

binary, broker = sys.argv[1], sys.argv[2]
runs = int(sys.argv[3]) if len(sys.argv) > 3 else 5
models = pathlib.Path(__file__).resolve().parent.parent / "models"
for run in range(runs):
    tmp = tempfile.mkdtemp()
    path = os.path.join(tmp, "notify")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    env = dict(os.environ, NOTIFY_SOCKET=path, EDGEINFER_HTTP__LISTEN="",
               EDGEINFER_NODE__STATE_DIR=os.path.join(tmp, "state"), EDGEINFER_NODE__ID=f"cold{run}")
    if broker == "embedded":
        env.update(EDGEINFER_MQTT__URL="mqtt://127.0.0.1:18950", EDGEINFER_MQTT__EMBEDDED_BROKER="true")
    else:
        env["EDGEINFER_MQTT__URL"] = broker
    start = time.monotonic()
    node = subprocess.Popen([binary, "serve", "--models-dir", str(models)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    while "READY=1" not in sock.recv(4096).decode():
        pass
    print(f"run {run}: READY after {(time.monotonic() - start) * 1e3:.1f} ms")
    node.terminate()
    node.wait()
