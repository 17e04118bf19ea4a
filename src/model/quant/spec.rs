//! What a convolution computes, before any packing, and its tensors in
//! and out: shared by the convolution ops (`QConv`, `QDepthwise`) and the
//! kernels under them (`planar`), so a kernel never imports an op.

use super::patches::{Geometry, Layout};
use super::requant::{self, Activation, QParam};
use tract_onnx::prelude::*;

/// What the op computes, before any packing: the part tests build directly.
#[derive(Debug, Clone, PartialEq)]
pub struct ConvSpec {
    pub geometry: Geometry,
    pub input: QParam,
    pub output: QParam,
    /// `[out_channels, in_channels * kh * kw]`, in the i8 domain.
    pub weights: Vec<i8>,
    /// Per output channel (one value broadcasts), in the i8 domain.
    pub weight_zero: Vec<i32>,
    /// Per output channel (one value broadcasts).
    pub weight_scale: Vec<f32>,
    /// In accumulator units (input scale x weight scale), per channel.
    pub bias: Vec<i32>,
    pub activation: Activation,
}

/// Runs a convolution op's `run_into` on its one input, in the i8 domain,
/// into an output of the output's type laid out as `output_layout`.
pub fn eval_conv(
    spec: &ConvSpec,
    inputs: &[TValue],
    output_layout: Layout,
    run_into: impl FnOnce(&[i8], usize, &mut [i8]) -> TractResult<()>,
) -> TractResult<TVec<TValue>> {
    let input = &inputs[0];
    let images = input.shape()[0];
    let x = spec.input.qtype.to_i8(requant::bytes_of(input)?);
    let g = spec.geometry;
    let [oh, ow] = g.output_hw()?;
    let shape = output_layout.shape([images, g.out_channels, oh, ow]);
    let y = requant::tensor_with(spec.output.qtype, &shape, |y| run_into(&x, images, y))?;
    Ok(tvec!(y.into_tvalue()))
}

/// The output's fact, `[N, out_channels, oh, ow]` in the output layout, for
/// an input of the spec's `[N, in_channels, height, width]` in the input's.
pub fn conv_output_facts(
    spec: &ConvSpec,
    inputs: &[&TypedFact],
    [input_layout, output_layout]: [Layout; 2],
) -> TractResult<TVec<TypedFact>> {
    let g = spec.geometry;
    let shape = &inputs[0].shape;
    let want =
        input_layout.shape([shape[0].clone(), g.in_channels.to_dim(), g.height.to_dim(), g.width.to_dim()]);
    anyhow::ensure!(shape.rank() == 4 && shape.iter().eq(want.iter()), "expects {want:?}, got {shape:?}");
    let [oh, ow] = g.output_hw()?;
    let dims = output_layout.shape([shape[0].clone(), g.out_channels.to_dim(), oh.to_dim(), ow.to_dim()]);
    Ok(tvec!(spec.output.qtype.datum_type().fact(dims)))
}
