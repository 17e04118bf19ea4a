//! `QDense`: an int8 fully connected layer (MatMul, Gemm, QLinearMatMul),
//! `[rows, in] x [in, out]` as one product on tract-linalg's integer
//! kernels with the requantization of `QConv`.

use super::choice::Kernel;
use super::gemm::Weights;
use super::igemm;
use super::requant::{
    self, Activation, QParam, multipliers, output_range, per, requantize_one, round_half_even,
};
use std::sync::Arc;
use tract_onnx::prelude::*;
use tract_onnx::tract_core::internal::*;

#[derive(Debug, Clone, PartialEq)]
pub struct DenseSpec {
    pub inputs: usize,
    pub outputs: usize,
    pub input: QParam,
    pub output: QParam,
    /// `[outputs, inputs]` (the transpose of ONNX MatMul's B), i8 domain.
    pub weights: Vec<i8>,
    pub weight_zero: Vec<i32>,
    pub weight_scale: Vec<f32>,
    /// In accumulator units, per output.
    pub bias: Vec<i32>,
    pub activation: Activation,
    /// A float bias added after the product was quantized (QLinearMatMul ->
    /// DequantizeLinear -> Add), then either quantized again or left f32.
    pub tail: Option<FloatTail>,
}

/// What a QOperator export does after QLinearMatMul, folded into the op so
/// it is one pass instead of three to five tract nodes: `v = (t - zt) * st
/// + bias[c]` in f32 for each quantized product `t` (in `output`), then
/// `quantize(activation(v))` with `requantize`, or `v` itself when `None`.
#[derive(Debug, Clone, PartialEq)]
pub struct FloatTail {
    pub bias: Vec<f32>,
    pub requantize: Option<(Activation, QParam)>,
}

impl FloatTail {
    /// The dequantized sums plus bias, `rows x outputs`.
    fn biased(&self, t: &[i8], mid: &QParam, outputs: usize) -> Vec<f32> {
        let z = mid.zero_i8();
        t.chunks(outputs.max(1))
            .flat_map(|row| {
                row.iter()
                    .enumerate()
                    .map(move |(c, &v)| (v as i32 - z) as f32 * mid.scale + per(&self.bias, c))
            })
            .collect()
    }

    /// `quantize(activation(v))`, ONNX QuantizeLinear: `round(v / scale) + zero`.
    fn quantize(v: &[f32], activation: Activation, out: &QParam) -> Vec<i8> {
        let (lo, hi) = output_range(out, activation);
        let z = out.zero_i8();
        v.iter()
            .map(|&v| {
                let q = (v / out.scale).max((lo - z) as f32).min((hi - z) as f32);
                (round_half_even(q) as i32 + z) as i8
            })
            .collect()
    }
}

/// Where the product runs (see `QConv`): our kernel with the weights as
/// the right operand (columns = outputs, so one input row is a one-row
/// tile), or tract-linalg's kernels.
#[derive(Debug, Clone)]
enum Backend {
    Ours(Arc<igemm::Right>, igemm::TileKernel),
    Tract(Arc<Weights>),
}

#[derive(Debug, Clone)]
pub struct QDense {
    pub spec: Arc<DenseSpec>,
    backend: Backend,
    offsets: Arc<Vec<i32>>,
    multipliers: Arc<Vec<f32>>,
}

impl PartialEq for QDense {
    fn eq(&self, other: &Self) -> bool {
        self.spec == other.spec
    }
}

impl QDense {
    /// On the given kernels (`choice::Chooser` picks them per layer).
    pub fn on(spec: DenseSpec, kernel: Kernel) -> TractResult<QDense> {
        anyhow::ensure!(!matches!(kernel, Kernel::Bytes(_)), "a dense layer has no byte tile");
        let mut op = QDense::build(spec, kernel == Kernel::Tract)?;
        if let (Kernel::I16(tile), Backend::Ours(right, _)) = (kernel, &op.backend) {
            op.backend = Backend::Ours(right.clone(), tile);
        }
        Ok(op)
    }

    /// The kernels a dense layer runs here, the host's best first: each of
    /// our i16 tiles and tract-linalg's.
    pub fn candidates() -> Vec<Kernel> {
        let mut kernels: Vec<Kernel> = igemm::TileKernel::timed().into_iter().map(Kernel::I16).collect();
        kernels.push(Kernel::Tract);
        kernels
    }

    /// On tract-linalg's kernels whatever the host (tests compare both).
    pub fn on_tract_kernels(spec: DenseSpec) -> TractResult<QDense> {
        QDense::build(spec, true)
    }

    /// On our kernels (`igemm.rs`) whatever the host (tests compare both).
    pub fn on_our_kernels(spec: DenseSpec) -> TractResult<QDense> {
        QDense::build(spec, false)
    }

    fn build(spec: DenseSpec, tract: bool) -> TractResult<QDense> {
        let (m, k) = (spec.outputs, spec.inputs);
        anyhow::ensure!(spec.weights.len() == m * k, "QDense: weights do not match {k} -> {m}");
        let zx = spec.input.zero_i8();
        let (backend, offsets) = if tract {
            let weights = Weights::new(&spec.weights, m, k, Some(1))?;
            let offsets = weights.offsets(&spec.bias, &spec.weight_zero, zx);
            (Backend::Tract(Arc::new(weights)), offsets)
        } else {
            let right = igemm::Right::pack_transposed(&spec.weights, m, k, |c| per(&spec.weight_zero, c));
            let tile = igemm::TileKernel::best();
            (Backend::Ours(Arc::new(right), tile), (0..m).map(|c| per(&spec.bias, c)).collect())
        };
        let multipliers = multipliers(&spec.input, &spec.weight_scale, &spec.output, m);
        Ok(QDense {
            spec: Arc::new(spec),
            backend,
            offsets: Arc::new(offsets),
            multipliers: Arc::new(multipliers),
        })
    }

    pub(super) fn kernel_name(&self) -> String {
        match &self.backend {
            Backend::Ours(_, tile) => tile.name().into(),
            Backend::Tract(w) => w.kernel_name(),
        }
    }

    /// `rows` input rows of i8-domain values to `rows` output rows.
    pub fn run(&self, x: &[i8], rows: usize) -> TractResult<Vec<i8>> {
        let (m, k) = (self.spec.outputs, self.spec.inputs);
        anyhow::ensure!(x.len() == rows * k, "QDense: input of {} values for {rows} rows of {k}", x.len());
        let (lo, hi) = output_range(&self.spec.output, self.spec.activation);
        let zy = self.spec.output.zero_i8();
        let (lo_f, hi_f) = ((lo - zy) as f32, (hi - zy) as f32);
        let mut out = vec![0i8; rows * m];
        match &self.backend {
            Backend::Ours(right, tile) => {
                let zx = self.spec.input.zero_i8();
                let left = igemm::Left::pack(x, rows, k, if rows >= 4 { 4 } else { 1 }, |_| zx);
                igemm::product_on(*tile, &left, right, |r0, c0, tile| {
                    let width = igemm::NR.min(m - c0);
                    for i in 0..left.mr.min(rows - r0) {
                        let y = &mut out[(r0 + i) * m + c0..(r0 + i) * m + c0 + width];
                        for (j, y) in y.iter_mut().enumerate() {
                            let c = c0 + j;
                            *y = requantize_one(
                                tile[i * igemm::NR + j],
                                self.offsets[c],
                                self.multipliers[c],
                                zy,
                                lo_f,
                                hi_f,
                            );
                        }
                    }
                });
            }
            Backend::Tract(weights) => {
                let packed = weights.pack_b_transposed(x, rows)?;
                let mut acc = Tensor::zero::<i32>(&[rows, m])?;
                weights.product(&*packed, rows, &mut acc, true)?;
                let acc = acc.try_as_plain_ram()?.as_slice::<i32>()?;
                let corrects = self.spec.weight_zero.iter().any(|&z| z != 0);
                for (r, (y, a)) in out.chunks_mut(m).zip(acc.chunks(m)).enumerate() {
                    // tract's kernels see raw values: subtract zw * (row sum).
                    let row_sum: i32 =
                        if corrects { x[r * k..(r + 1) * k].iter().map(|&v| v as i32).sum() } else { 0 };
                    for c in 0..m {
                        let sum = a[c] - per(&self.spec.weight_zero, c) * row_sum;
                        y[c] = requantize_one(sum, self.offsets[c], self.multipliers[c], zy, lo_f, hi_f);
                    }
                }
            }
        }
        Ok(out)
    }
}

// Scales are finite (checked when the op is built), so equality is reflexive.
impl Eq for QDense {}

impl Op for QDense {
    fn name(&self) -> StaticName {
        "edgeinfer.QDense".into()
    }

    fn info(&self) -> TractResult<Vec<String>> {
        Ok(vec![format!(
            "{}->{} {:?} on {}",
            self.spec.inputs,
            self.spec.outputs,
            self.spec.activation,
            self.kernel_name()
        )])
    }

    op_as_typed_op!();
}

impl EvalOp for QDense {
    op_out_of_plan!();

    fn eval(&self, _ctx: &EvalContext, inputs: TVec<TValue>) -> TractResult<TVec<TValue>> {
        let input = &inputs[0];
        let rows = input.shape()[0];
        let x = self.spec.input.qtype.to_i8(requant::bytes_of(input)?);
        let y = self.run(&x, rows)?;
        let shape = [rows, self.spec.outputs];
        let out = match &self.spec.tail {
            None => requant::tensor(self.spec.output.qtype, &shape, y)?,
            Some(tail) => {
                let v = tail.biased(&y, &self.spec.output, self.spec.outputs);
                match &tail.requantize {
                    Some((activation, out)) => {
                        requant::tensor(out.qtype, &shape, FloatTail::quantize(&v, *activation, out))?
                    }
                    None => Tensor::from_shape(&shape, &v)?,
                }
            }
        };
        Ok(tvec!(out.into_tvalue()))
    }
}

impl TypedOp for QDense {
    fn output_facts(&self, inputs: &[&TypedFact]) -> TractResult<TVec<TypedFact>> {
        let shape = &inputs[0].shape;
        anyhow::ensure!(
            shape.rank() == 2 && shape[1] == self.spec.inputs.to_dim(),
            "QDense expects [N, {}], got {shape:?}",
            self.spec.inputs
        );
        let dt = match &self.spec.tail {
            None => self.spec.output.qtype.datum_type(),
            Some(FloatTail { requantize: Some((_, out)), .. }) => out.qtype.datum_type(),
            Some(FloatTail { requantize: None, .. }) => DatumType::F32,
        };
        Ok(tvec!(dt.fact(tvec![shape[0].clone(), self.spec.outputs.to_dim()])))
    }

    as_op!();
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::quant::requant::QType;

    #[test]
    fn the_float_tail_dequantizes_adds_the_bias_and_quantizes_again() {
        let mid = QParam { scale: 0.5, zero_point: 100, qtype: QType::U8 };
        let t: Vec<i8> = [100u8, 104, 90, 255].iter().map(|&v| (v ^ 0x80) as i8).collect();
        let tail = FloatTail { bias: vec![0.25, -1.0], requantize: None };
        // (t - 100) * 0.5 + bias, per column of two outputs.
        assert_eq!(tail.biased(&t, &mid, 2), vec![0.25, 1.0, -4.75, 76.5]);
        let out = QParam { scale: 0.5, zero_point: 0, qtype: QType::U8 };
        // relu, then round(v / 0.5): 0.5 -> 0 (ties to even), 2, 0, 153.
        let q = FloatTail::quantize(&[0.25, 1.0, -4.75, 76.5], Activation::Relu, &out);
        let stored: Vec<u8> = q.iter().map(|&v| (v as u8) ^ 0x80).collect();
        assert_eq!(stored, vec![0, 2, 0, 153]);
    }
}
