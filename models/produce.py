#!/usr/bin/env python3
"""Produce the shipped models from scikit-learn's bundled `load_digits` data.

No download: the 8x8 digit images ship inside the scikit-learn wheel.
Deterministic: fixed seeds, a fixed stratified held-out split, single-threaded
onnxruntime. Run `python models/produce.py` from the repository root (see
docs/MODELS.md "Regenerating the models"); it rewrites

  models/digits/1/        INT8 MLP (onnxruntime QOperator QLinearMatMul), the edge tier
  models/digits-f32/1/    the same MLP before quantisation, to measure what INT8 costs
  models/digits-large/1/  a larger f32 MLP trained on shifted copies too, the cloud tier
  models/digits-small/1/  a narrower INT8 MLP (8 hidden units): cheaper, less accurate,
                          so `edgeinfer models compare` has a real choice to make
  models/heldout/digits.csv   the held-out split (label, 64 pixels), for accuracy tests

`python models/produce.py --rollout-tests` writes instead, outside the served
models/ directory, the two bad candidates the rollout tests drop in as a new
`digits` version (tests/models/, docs/ROLLOUTS.md):

  tests/models/digits-wrong-labels/  digits trained on labels shifted by one: it
                                     disagrees with digits on nearly every input
  tests/models/digits-slow/          the f32 digits with a heavy branch (200 shared
                                     512x512 matmuls) that changes no answer: slow

Each version directory holds model.onnx, model.toml (the manifest the node reads)
and golden.json (inputs with onnxruntime's outputs and the tolerance the node
must meet at load).
"""
import hashlib
import json
import os
import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper
from onnxruntime.quantization import (CalibrationDataReader, QuantFormat,
                                      QuantType, quantize_static)
from scipy.ndimage import shift
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from sklearn.neural_network import MLPClassifier

SEED = 0
SCALE = 1.0 / 16.0  # pixels come as 0..16; the node scales them (manifest [preprocess])
ROOT = Path(__file__).resolve().parent
LABELS = [str(i) for i in range(10)]
GOLDEN_ROWS = 8


def session(path):
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    opts.inter_op_num_threads = 1
    return ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])


def mlp_to_onnx(clf, name):
    """MatMul + Add + Relu per hidden layer, then Softmax: ops tract runs natively."""
    nodes, inits = [], []
    x = "input"
    layers = list(zip(clf.coefs_, clf.intercepts_))
    for i, (w, b) in enumerate(layers):
        inits.append(numpy_helper.from_array(w.astype(np.float32), f"w{i}"))
        inits.append(numpy_helper.from_array(b.astype(np.float32), f"b{i}"))
        nodes.append(helper.make_node("MatMul", [x, f"w{i}"], [f"mm{i}"], name=f"matmul{i}"))
        last = i == len(layers) - 1
        out = "logits" if last else f"h{i}"
        nodes.append(helper.make_node("Add", [f"mm{i}", f"b{i}"], [out if last else f"pre{i}"], name=f"bias{i}"))
        if not last:
            nodes.append(helper.make_node("Relu", [f"pre{i}"], [out], name=f"relu{i}"))
        x = out
    nodes.append(helper.make_node("Softmax", ["logits"], ["probabilities"], axis=-1, name="softmax"))
    graph = helper.make_graph(
        nodes, name,
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["N", 64])],
        [helper.make_tensor_value_info("probabilities", TensorProto.FLOAT, ["N", 10])],
        inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)],
                              producer_name="edgeinfer models/produce.py")
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


class Calibration(CalibrationDataReader):
    def __init__(self, x):
        self.rows = iter([{"input": x[i:i + 32]} for i in range(0, len(x), 32)])

    def get_next(self):
        return next(self.rows, None)


def quantize(f32_path, int8_path, calibration_x):
    """QOperator with MatMul only: QLinearMatMul runs on tract's integer kernels and
    the final Softmax stays in f32 (no DequantizeLinear->Softmax->QuantizeLinear
    chain, which tract 0.23 folds wrongly into a lookup table)."""
    quantize_static(str(f32_path), str(int8_path), Calibration(calibration_x),
                    quant_format=QuantFormat.QOperator, op_types_to_quantize=["MatMul"],
                    activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8,
                    per_channel=False, reduce_range=False)


def accuracy(path, x, y):
    probs = session(path).run(None, {"input": x})[0]
    return float((probs.argmax(axis=1) == y).mean())


def shifted_copies(x, y):
    """Augment with one-pixel shifts: the large model's extra accuracy comes from here."""
    imgs = x.reshape(-1, 8, 8)
    out_x, out_y = [x], [y]
    for dy, dx in [(0, 1), (0, -1), (1, 0), (-1, 0)]:
        out_x.append(np.stack([shift(im, (dy, dx), order=0, mode="constant") for im in imgs]).reshape(-1, 64))
        out_y.append(y)
    return np.concatenate(out_x), np.concatenate(out_y)


def sha256(path):
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def write_version(name, onnx_path_tmp, quantization, acc, produced_by, golden_x, tolerance, extra_acc=None,
                  vdir=None, version="1"):
    vdir = vdir or ROOT / name / version
    vdir.mkdir(parents=True, exist_ok=True)
    model_path = vdir / "model.onnx"
    os.replace(onnx_path_tmp, model_path)
    raw = golden_x / SCALE  # golden inputs are what a device sends: raw 0..16 pixels
    expected = session(model_path).run(None, {"input": golden_x})[0]
    golden = {
        "vectors": [
            {"input": [float(v) for v in raw[i]], "expected": [float(v) for v in expected[i]]}
            for i in range(len(raw))
        ],
    }
    (vdir / "golden.json").write_text(json.dumps(golden, indent=1) + "\n")
    acc_lines = [f"{quantization} = {acc:.4f}"]
    if extra_acc:
        acc_lines += [f"{k} = {v:.4f}" for k, v in extra_acc.items()]
    manifest = f"""# Produced by models/produce.py; do not edit by hand (the sha256 is checked at load).
name = "{name}"
version = "{version}"
file = "model.onnx"
sha256 = "{sha256(model_path)}"
task = "classification"
quantization = "{quantization}"
labels = {json.dumps(LABELS)}
produced_by = "{produced_by}"

[input]
name = "input"
datatype = "FP32"
shape = [-1, 64]

[[outputs]]
name = "probabilities"
datatype = "FP32"
shape = [-1, 10]

[preprocess]
scale = {SCALE}
offset = 0.0

[golden]
file = "golden.json"
tolerance = {tolerance}

[accuracy]
split = "models/heldout/digits.csv"
rows = {len(Y_TEST)}
{chr(10).join(acc_lines)}
"""
    (vdir / "model.toml").write_text(manifest)
    print(f"{name}: {quantization} held-out accuracy {acc:.4f} -> {vdir}")


def with_slow_branch(model, width=512, layers=200):
    """`model` plus a branch of `layers` matmuls sharing one width x width weight,
    summed and scaled by 1e-30 into the logits: the same answers, far more work."""
    rng = np.random.default_rng(SEED)
    g = model.graph
    g.initializer.extend([
        numpy_helper.from_array((rng.standard_normal((64, width)) * np.sqrt(2 / 64)).astype(np.float32), "slow_in"),
        numpy_helper.from_array((rng.standard_normal((width, width)) * np.sqrt(2 / width)).astype(np.float32), "slow_w"),
        numpy_helper.from_array(np.array(1e-30, dtype=np.float32), "slow_scale"),
    ])
    nodes = [helper.make_node("MatMul", ["input", "slow_in"], ["slow0"], name="slow_in_matmul")]
    for i in range(layers):
        nodes.append(helper.make_node("MatMul", [f"slow{i}", "slow_w"], [f"slow_mm{i}"], name=f"slow_mm{i}"))
        nodes.append(helper.make_node("Relu", [f"slow_mm{i}"], [f"slow{i + 1}"], name=f"slow_relu{i}"))
    nodes.append(helper.make_node("ReduceSum", [f"slow{layers}"], ["slow_sum"], keepdims=1, name="slow_sum"))
    nodes.append(helper.make_node("Mul", ["slow_sum", "slow_scale"], ["slow_tiny"], name="slow_scale_mul"))
    # The logits' producer now writes `fast_logits`; the branch joins there.
    for n in g.node:
        n.output[:] = ["fast_logits" if o == "logits" else o for o in n.output]
    nodes.append(helper.make_node("Add", ["fast_logits", "slow_tiny"], ["logits"], name="slow_join"))
    softmax = [n for n in g.node if n.op_type == "Softmax"]
    rest = [n for n in g.node if n.op_type != "Softmax"]
    del g.node[:]
    g.node.extend(rest + nodes + softmax)
    onnx.checker.check_model(model)
    return model


def rollout_tests(xs_tr, y_tr, xs_te, y_te, golden_x, f32_model):
    """The bad candidates of the rollout tests, under tests/models/."""
    out = ROOT.parent / "tests" / "models"
    tmp = ROOT / ".tmp"
    wrong = MLPClassifier(hidden_layer_sizes=(32,), max_iter=400, random_state=SEED, alpha=1e-3)
    wrong.fit(xs_tr, (y_tr + 1) % 10)
    wrong_f32 = tmp / "wrong_f32.onnx"
    onnx.save(mlp_to_onnx(wrong, "digits_wrong_labels"), wrong_f32)
    wrong_path = tmp / "wrong.onnx"
    quantize(wrong_f32, wrong_path, xs_tr)
    write_version("digits", wrong_path, "int8", accuracy(wrong_path, xs_te, y_te),
                  "models/produce.py --rollout-tests: digits trained on labels shifted by one ((y + 1) mod 10), "
                  "quantised as digits is: a wrong candidate",
                  golden_x, 0.02, vdir=out / "digits-wrong-labels", version="2")
    slow_path = tmp / "slow.onnx"
    onnx.save(with_slow_branch(f32_model), slow_path)
    write_version("digits", slow_path, "f32", accuracy(slow_path, xs_te, y_te),
                  "models/produce.py --rollout-tests: the f32 digits plus 200 shared 512x512 matmuls scaled "
                  "by 1e-30 into the logits: the same answers, much slower",
                  golden_x, 1e-4, vdir=out / "digits-slow", version="2")


def main():
    global Y_TEST
    digits = load_digits()
    x_all = digits.data.astype(np.float32)
    y_all = digits.target.astype(np.int64)
    x_tr, x_te, y_tr, y_te = train_test_split(
        x_all, y_all, test_size=0.2, random_state=SEED, stratify=y_all)
    Y_TEST = y_te
    xs_tr, xs_te = (x_tr * SCALE).astype(np.float32), (x_te * SCALE).astype(np.float32)

    heldout = ROOT / "heldout"
    heldout.mkdir(exist_ok=True)
    with open(heldout / "digits.csv", "w") as f:
        f.write("# load_digits held-out split (test_size=0.2, stratified, random_state=0): label, 64 raw pixels\n")
        for label, row in zip(y_te, x_te):
            f.write(",".join([str(int(label))] + [str(int(v)) for v in row]) + "\n")

    tmp = ROOT / ".tmp"
    tmp.mkdir(exist_ok=True)
    golden_x = xs_te[:GOLDEN_ROWS]

    small = MLPClassifier(hidden_layer_sizes=(32,), max_iter=400, random_state=SEED, alpha=1e-3)
    small.fit(xs_tr, y_tr)
    f32_path = tmp / "digits_f32.onnx"
    onnx.save(mlp_to_onnx(small, "digits_f32"), f32_path)
    acc_f32 = accuracy(f32_path, xs_te, y_te)

    int8_path = tmp / "digits_int8.onnx"
    quantize(f32_path, int8_path, xs_tr)
    acc_int8 = accuracy(int8_path, xs_te, y_te)

    narrow = MLPClassifier(hidden_layer_sizes=(8,), max_iter=400, random_state=SEED, alpha=1e-3)
    narrow.fit(xs_tr, y_tr)
    narrow_f32_path = tmp / "digits_small_f32.onnx"
    onnx.save(mlp_to_onnx(narrow, "digits_small"), narrow_f32_path)
    narrow_path = tmp / "digits_small.onnx"
    quantize(narrow_f32_path, narrow_path, xs_tr)
    acc_narrow = accuracy(narrow_path, xs_te, y_te)

    xa, ya = shifted_copies(x_tr, y_tr)
    large = MLPClassifier(hidden_layer_sizes=(256, 128), max_iter=400, random_state=SEED, alpha=1e-4)
    large.fit((xa * SCALE).astype(np.float32), ya)
    large_path = tmp / "digits_large.onnx"
    onnx.save(mlp_to_onnx(large, "digits_large"), large_path)
    acc_large = accuracy(large_path, xs_te, y_te)

    if "--rollout-tests" in sys.argv:
        rollout_tests(xs_tr, y_tr, xs_te, y_te, golden_x, mlp_to_onnx(small, "digits_slow"))
        for p in tmp.iterdir():
            p.unlink()
        tmp.rmdir()
        return 0

    write_version("digits", int8_path, "int8", acc_int8,
                  "models/produce.py: MLP 64-32-10 (scikit-learn MLPClassifier, seed 0) on load_digits, "
                  "onnxruntime quantize_static QOperator QLinearMatMul, u8 activations, s8 weights",
                  golden_x, 0.02, {"f32_twin": acc_f32})
    write_version("digits-f32", f32_path, "f32", acc_f32,
                  "models/produce.py: the f32 twin of digits before quantisation",
                  golden_x, 1e-4)
    write_version("digits-large", large_path, "f32", acc_large,
                  "models/produce.py: MLP 64-256-128-10 (scikit-learn MLPClassifier, seed 0) on load_digits "
                  "plus one-pixel shifted copies",
                  golden_x, 1e-4)
    write_version("digits-small", narrow_path, "int8", acc_narrow,
                  "models/produce.py: MLP 64-8-10 (scikit-learn MLPClassifier, seed 0) on load_digits, "
                  "quantised as digits is",
                  golden_x, 0.02)
    for p in tmp.iterdir():
        p.unlink()
    tmp.rmdir()
    return 0


if __name__ == "__main__":
    sys.exit(main())
