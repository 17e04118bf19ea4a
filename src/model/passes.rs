//! Load-time graph passes over tract's typed model, before it is
//! decluttered. Each works around one tract 0.23 behaviour that makes an
//! INT8 model wrong, through tract's public patch API (no fork).

use tract_onnx::prelude::*;
use tract_onnx::tract_core::internal::*;
use tract_onnx::tract_core::ops::element_wise::ElementWiseOp;
use tract_onnx::tract_core::ops::nn::Softmax;
use tract_onnx::tract_core::ops::quant::{
    QuantizeLinearI8, QuantizeLinearU8, quantize_linear_f32_i8, quantize_linear_f32_u8,
};

/// What a pass changed, for `models verify` and the load log.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Applied {
    pub pass: &'static str,
    pub nodes: usize,
}

/// Runs every pass; returns those that changed something.
pub fn before_declutter(model: &mut TypedModel) -> TractResult<Vec<Applied>> {
    let mut applied = Vec::new();
    let n = keep_softmax_out_of_lookup_tables(model)?;
    if n > 0 {
        applied.push(Applied { pass: "softmax-requantize", nodes: n });
    }
    Ok(applied)
}

/// Runs the passes that need the decluttered graph; returns those that
/// changed something.
pub fn after_declutter(model: &mut TypedModel) -> TractResult<Vec<Applied>> {
    let n = move_channels_first_ourselves(model)?;
    Ok(if n > 0 { vec![Applied { pass: "int8-channels-first", nodes: n }] } else { Vec::new() })
}

/// Every move of an 8-bit channels-last tensor to channels-first that is
/// left once declutter has cancelled what it can becomes
/// [`ChannelsFirst`](super::quant::layout::ChannelsFirst): the same bytes,
/// 16 pixels a step instead of tract's element by element.
fn move_channels_first_ourselves(model: &mut TypedModel) -> TractResult<usize> {
    use super::quant::layout::ChannelsFirst;
    let targets: Vec<usize> = model
        .nodes()
        .iter()
        .filter(|node| node.op_as::<AxisOp>() == Some(&AxisOp::Move(3, 1)))
        .filter(|node| node.inputs.len() == 1)
        .filter(|node| model.outlet_fact(node.inputs[0]).is_ok_and(ChannelsFirst::fits))
        .map(|node| node.id)
        .collect();
    for &id in &targets {
        let node = model.node(id).clone();
        TypedModelPatch::replace_single_op(model, &node, &node.inputs, ChannelsFirst)?.apply(model)?;
    }
    Ok(targets.len())
}

/// tract's `DequantizeLinearF32::declutter` walks from a DequantizeLinear
/// through every op whose axes map one to one, and folds the chain up to a
/// QuantizeLinear into a 256-entry lookup table. Softmax maps its axes one
/// to one but is not element-wise (each output depends on the whole row),
/// so a quantized classifier head DequantizeLinear -> Softmax ->
/// QuantizeLinear becomes a table and answers 127 everywhere (MLPerf Tiny
/// kws, vww and ic). This replaces the QuantizeLinear after a Softmax with
/// [`Requantize`], the same arithmetic in an op the walker does not see
/// through: softmax runs in f32 on its whole row, as onnxruntime does.
fn keep_softmax_out_of_lookup_tables(model: &mut TypedModel) -> TractResult<usize> {
    let mut replaced = 0;
    loop {
        let target = model.nodes().iter().find_map(|node| {
            node.op_as::<Softmax>()?;
            let succ = model.single_succ(node.id).ok()??;
            let quant = succ.op_as::<ElementWiseOp>()?;
            let (scale, zero_point, unsigned) = if let Some(q) = quant.0.downcast_ref::<QuantizeLinearI8>() {
                (q.scale, q.zero_point as i32, false)
            } else {
                let q = quant.0.downcast_ref::<QuantizeLinearU8>()?;
                (q.scale, q.zero_point as i32, true)
            };
            let dt = succ.outputs[0].fact.datum_type;
            Some((succ.id, Requantize { scale_bits: scale.to_bits(), zero_point, unsigned, dt }))
        });
        let Some((id, op)) = target else { return Ok(replaced) };
        let node = model.node(id).clone();
        TypedModelPatch::replace_single_op(model, &node, &node.inputs, op)?.apply(model)?;
        replaced += 1;
    }
}

/// ONNX QuantizeLinear (`round_half_even(x * scale) + zero_point`, saturated;
/// `scale` is the reciprocal of ONNX's, as tract stores it), as an op of
/// ours so tract's dequantize fold stops at it.
#[derive(Debug, Clone, Hash, PartialEq, Eq)]
pub struct Requantize {
    /// f32 bits, so the op can be hashed.
    scale_bits: u32,
    zero_point: i32,
    unsigned: bool,
    /// The output type the replaced op had (i8/u8, possibly with qparams).
    dt: DatumType,
}

impl Op for Requantize {
    fn name(&self) -> StaticName {
        "edgeinfer.Requantize".into()
    }

    fn info(&self) -> TractResult<Vec<String>> {
        Ok(vec![format!("scale: {} zero_point: {}", f32::from_bits(self.scale_bits), self.zero_point)])
    }

    tract_onnx::tract_core::op_as_typed_op!();
}

impl EvalOp for Requantize {
    tract_onnx::tract_core::op_out_of_plan!();

    fn eval(&self, _ctx: &EvalContext, inputs: TVec<TValue>) -> TractResult<TVec<TValue>> {
        let input = inputs[0].cast_to::<f32>()?;
        let xs = input.try_as_plain_ram()?.as_slice::<f32>()?;
        let scale = f32::from_bits(self.scale_bits);
        let mut out = if self.unsigned {
            let v: Vec<u8> = xs.iter().map(|&x| quantize_linear_f32_u8(x, scale, self.zero_point)).collect();
            Tensor::from_shape(input.shape(), &v)?
        } else {
            let v: Vec<i8> = xs.iter().map(|&x| quantize_linear_f32_i8(x, scale, self.zero_point)).collect();
            Tensor::from_shape(input.shape(), &v)?
        };
        // Same storage; keeps quantization parameters the graph declared.
        unsafe { out.set_datum_type(self.dt) };
        Ok(tvec!(out.into_tvalue()))
    }
}

impl TypedOp for Requantize {
    fn output_facts(&self, inputs: &[&TypedFact]) -> TractResult<TVec<TypedFact>> {
        Ok(tvec!(self.dt.fact(inputs[0].shape.clone())))
    }

    tract_onnx::tract_core::as_op!();
}
