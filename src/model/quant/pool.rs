//! `QGlobalAvgPool`: the mean of each channel of an int8 NCHW tensor (a
//! GlobalAveragePool, or an AveragePool whose window is the whole image),
//! computed as onnxruntime's QLinearAveragePool does: each value
//! dequantized to f32, summed in order, divided by the count, then
//! quantized (`round(mean / sy) + zy`). The exact integer mean would differ
//! on ties (a sum of 160 over 64 values is 2.5), and one step in a pooled
//! feature moves the MLPerf ResNet-8's softmax by up to 31 steps.

use super::requant::{self, QParam, round_half_even};
use tract_onnx::prelude::*;
use tract_onnx::tract_core::internal::*;

#[derive(Debug, Clone, PartialEq)]
pub struct QGlobalAvgPool {
    pub input: QParam,
    pub output: QParam,
}

impl QGlobalAvgPool {
    /// `planes` planes of `plane` values each, to one value per plane.
    pub fn run(&self, x: &[i8], plane: usize) -> Vec<i8> {
        let (zx, sx) = (self.input.zero_i8(), self.input.scale);
        let (zy, sy) = (self.output.zero_i8(), self.output.scale);
        x.chunks(plane.max(1))
            .map(|p| {
                let sum = p.iter().fold(0f32, |acc, &v| acc + (v as i32 - zx) as f32 * sx);
                let v = (sum / plane as f32 / sy).clamp((-128 - zy) as f32, (127 - zy) as f32);
                (round_half_even(v) as i32 + zy) as i8
            })
            .collect()
    }
}

// Scales are finite (checked when the op is built), so equality is reflexive.
impl Eq for QGlobalAvgPool {}

impl Op for QGlobalAvgPool {
    fn name(&self) -> StaticName {
        "edgeinfer.QGlobalAvgPool".into()
    }

    op_as_typed_op!();
}

impl EvalOp for QGlobalAvgPool {
    op_out_of_plan!();

    fn eval(&self, _ctx: &EvalContext, inputs: TVec<TValue>) -> TractResult<TVec<TValue>> {
        let shape = inputs[0].shape();
        anyhow::ensure!(shape.len() == 4, "QGlobalAvgPool: input of rank {}", shape.len());
        let x = self.input.qtype.to_i8(requant::bytes_of(&inputs[0])?);
        let y = self.run(&x, shape[2] * shape[3]);
        Ok(tvec!(requant::tensor(self.output.qtype, &[shape[0], shape[1], 1, 1], y)?.into_tvalue()))
    }
}

impl TypedOp for QGlobalAvgPool {
    fn output_facts(&self, inputs: &[&TypedFact]) -> TractResult<TVec<TypedFact>> {
        let shape = &inputs[0].shape;
        anyhow::ensure!(shape.rank() == 4, "QGlobalAvgPool expects NCHW, got {shape:?}");
        let dims: TVec<TDim> = tvec![shape[0].clone(), shape[1].clone(), 1.to_dim(), 1.to_dim()];
        Ok(tvec!(self.output.qtype.datum_type().fact(dims)))
    }

    as_op!();
}
