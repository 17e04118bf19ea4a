#!/usr/bin/env python3
"""The onnxruntime columns beside `cargo bench --bench int8`: the same ONNX
files (the shipped digits pair and the MLPerf Tiny models in
../shared/mlperf-tiny), one thread, batch 1 and 8, per-item microseconds,
each model's INT8 file and its f32 twin side by side, and the faster of the
two at batch 1 (what a user compares an INT8 model with: on an AVX-512 host
onnxruntime's f32 path often beats its INT8 one).

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
    """(model, its INT8 file and input, its f32 twin's file and input)."""
    pixels = (np.arange(8 * 64) * 7 % 17).astype(np.float32).reshape(8, 64) * 0.0625
    models = ROOT / "models"
    yield "digits", (models / "digits" / "1" / "model.onnx", pixels), (
        models / "digits-f32" / "1" / "model.onnx",
        pixels,
    )
    if not TINY.is_dir():
        print("SKIPPED the MLPerf Tiny models: ../shared/mlperf-tiny is absent")
        return
    for key in ["kws", "vww", "ic", "ad"]:
        yield key, *(
            (TINY / f"{key}_{v}.onnx", np.load(TINY / f"{key}_{v}_input.npy")) for v in ["int8", "f32"]
        )


print(f"onnxruntime {ort.__version__}, one thread; per item, us")
print("| model | INT8 b1 | f32 b1 | faster b1 | INT8 b8 | f32 b8 |")
print("| --- | --- | --- | --- | --- | --- |")
for name, (int8, int8_rows), (f32, f32_rows) in subjects():
    q, f = session(int8), session(f32)
    q1, f1 = per_item_us(q, int8_rows, 1), per_item_us(f, f32_rows, 1)
    q8, f8 = per_item_us(q, int8_rows, 8), per_item_us(f, f32_rows, 8)
    print(f"| {name} | {q1:.1f} | {f1:.1f} | {min(q1, f1):.1f} | {q8:.1f} | {f8:.1f} |")
