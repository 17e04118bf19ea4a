#!/usr/bin/env python3
"""The onnxruntime column beside `cargo bench --bench int8`: the same ONNX
files (the shipped digits pair and the MLPerf Tiny models in
../shared/mlperf-tiny), one thread, batch 1 and 8, per-item microseconds.

    python3 -m venv /tmp/ort && /tmp/ort/bin/pip install onnxruntime numpy
    /tmp/ort/bin/python benches/int8_onnxruntime.py
"""
import pathlib
import time

import numpy as np
import onnxruntime as ort

ROOT = pathlib.Path(__file__).resolve().parent.parent
TINY = ROOT.parent / "shared" / "mlperf-tiny"


def session(path):
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    opts.inter_op_num_threads = 1
    opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    return ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])


def per_item_us(sess, rows, batch, budget=1.0):
    name = sess.get_inputs()[0].name
    x = rows[:batch]
    sess.run(None, {name: x})
    runs, start = 0, time.perf_counter()
    while time.perf_counter() - start < budget or runs < 10:
        sess.run(None, {name: x})
        runs += 1
    return (time.perf_counter() - start) / (runs * batch) * 1e6


def subjects():
    pixels = (np.arange(8 * 64) * 7 % 17).astype(np.float32).reshape(8, 64) * 0.0625
    for name in ["digits", "digits-f32"]:
        yield name, ROOT / "models" / name / "1" / "model.onnx", pixels
    if not TINY.is_dir():
        print("SKIPPED the MLPerf Tiny models: ../shared/mlperf-tiny is absent")
        return
    for key in ["kws", "vww", "ic", "ad"]:
        for variant in ["int8", "f32"]:
            stem = f"{key}_{variant}"
            yield stem, TINY / f"{stem}.onnx", np.load(TINY / f"{stem}_input.npy")


print(f"onnxruntime {ort.__version__}, one thread; per item, us")
print("| model | b1 | b8 |")
print("| --- | --- | --- |")
for name, path, rows in subjects():
    sess = session(path)
    b1, b8 = (per_item_us(sess, rows, b) for b in (1, 8))
    print(f"| {name} | {b1:.1f} | {b8:.1f} |")
