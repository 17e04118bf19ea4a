#!/usr/bin/env python3
"""tract's integer convolution path, measured: quantize MLPerf Tiny's
ic_f32 (ResNet-8) to QOperator form with onnxruntime (QLinearConv for every
Conv, u8 activations, s8 weights, 32 calibration inputs) and write a models
directory holding it (`ic_qop`) beside `ic_f32`, to compare in one run:

    python3 -m venv /tmp/ort && /tmp/ort/bin/pip install onnxruntime numpy onnx
    /tmp/ort/bin/python benches/int8_qoperator.py /tmp/qop
    EDGEINFER_RUNTIME__BATCH_SIZES="[1, 8]" edgeinfer models verify --models-dir /tmp/qop --iterations 300
    EDGEINFER_RUNTIME__BATCH_SIZES="[1, 8]" edgeinfer models profile ic_qop --models-dir /tmp/qop
"""
import hashlib
import pathlib
import sys

import numpy as np
import onnx
from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static

TINY = pathlib.Path(__file__).resolve().parent.parent.parent / "shared" / "mlperf-tiny"
out = pathlib.Path(sys.argv[1])
src = TINY / "ic_f32.onnx"
rows = np.load(TINY / "ic_f32_input.npy").astype(np.float32)
name = onnx.load(src).graph.input[0].name


class Calibration(CalibrationDataReader):
    def __init__(self):
        self.rows = iter([{name: rows[i : i + 1]} for i in range(32)])

    def get_next(self):
        return next(self.rows, None)


(out / "ic_qop" / "1").mkdir(parents=True, exist_ok=True)
(out / "ic_f32" / "1").mkdir(parents=True, exist_ok=True)
qop = out / "ic_qop" / "1" / "model.onnx"
# Conv and MatMul only: tract has no QLinearAdd or QLinearAveragePool.
quantize_static(str(src), str(qop), Calibration(), quant_format=QuantFormat.QOperator,
                activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8,
                op_types_to_quantize=["Conv", "MatMul"])
for model, path, quant in [("ic_qop", qop, "int8"), ("ic_f32", src, "f32")]:
    sha = hashlib.sha256(path.read_bytes()).hexdigest()
    (out / model / "1" / "model.toml").write_text(f'''name = "{model}"
version = "1"
file = "{path}"
sha256 = "{sha}"
task = "raw"
quantization = "{quant}"
produced_by = "benches/int8_qoperator.py from MLPerf Tiny ic_f32"
[input]
name = "{name}"
datatype = "FP32"
shape = [-1, 32, 32, 3]
[[outputs]]
name = "{onnx.load(path).graph.output[0].name}"
datatype = "FP32"
shape = [-1, 10]
''')
print(f"wrote {out}/ic_qop and {out}/ic_f32")
