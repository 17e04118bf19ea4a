//! Integer inference: a load-time rewrite that replaces the quantized
//! patterns of an ONNX model (see `pattern`) with int8 ops of our own, so
//! activations stay 8-bit from the model's first quantize to its last
//! dequantize and the heavy products run on tract-linalg's integer kernels.
//!
//! It runs on tract's typed model before `declutter`, while every tensor
//! still carries its ONNX name: the match is made on the protobuf, the
//! replacement wired between the same named tensors, and what it replaced
//! (dequantize, float conv, relu, quantize) is left dead for declutter to
//! remove. Whatever does not match stays on tract's own ops.
//!
//! One float op rides on the same rewrite: `float_depthwise`, for the f32
//! depthwise convolutions tract runs element by element.

pub mod add;
pub mod choice;
pub mod conv;
mod cpu;
pub mod dense;
pub mod depthwise;
pub mod float_depthwise;
mod gemm;
pub mod igemm;
pub mod layout;
mod patches;
mod pattern;
mod planar;
pub mod pool;
pub mod requant;
pub mod spec;
mod transpose;
pub mod udot;

use choice::Kernel;
use pattern::{Found, Fusion};
use std::collections::HashMap;
use tract_onnx::data_resolver::ModelDataResolver;
use tract_onnx::pb::GraphProto;
use tract_onnx::prelude::*;
use tract_onnx::tract_core::internal::*;

/// How many nodes of each kind the rewrite replaced.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Rewritten {
    pub conv: usize,
    pub depthwise: usize,
    pub dense: usize,
    pub add: usize,
    pub pool: usize,
    /// Float depthwise layers (counted apart: not integer ops).
    pub float_depthwise: usize,
    /// Outputs handed over channels-last (counted apart: no op replaced):
    /// from depthwise to pointwise layers, and from pointwise to depthwise.
    pub channels_last: [usize; 2],
}

impl Rewritten {
    pub fn total(&self) -> usize {
        self.conv + self.depthwise + self.dense + self.add + self.pool
    }
}

/// Which kinds of op the rewrite may use: all by default; the variable
/// `EDGEINFER_INT8_OPS` (`off`, or a list of `conv`, `depthwise`, `dense`,
/// `add`, `pool`, and `depthwise-f32` for the one float op) narrows it, to
/// measure or to bisect a numeric difference.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Kinds(Vec<String>);

impl Kinds {
    pub fn all() -> Kinds {
        Kinds(["conv", "depthwise", "dense", "add", "pool", "depthwise-f32"].map(String::from).to_vec())
    }

    pub fn from_env() -> Kinds {
        match std::env::var("EDGEINFER_INT8_OPS") {
            Ok(v) if v == "off" => Kinds(Vec::new()),
            Ok(v) if !v.is_empty() => Kinds(v.split(',').map(|s| s.trim().to_string()).collect()),
            _ => Kinds::all(),
        }
    }

    fn allows(&self, fusion: &Fusion) -> bool {
        let kind = match fusion {
            Fusion::Conv(_) => "conv",
            Fusion::Depthwise(_) => "depthwise",
            Fusion::Dense(_) => "dense",
            Fusion::Add(_) => "add",
            Fusion::Pool(..) => "pool",
            Fusion::FloatDepthwise(_) => "depthwise-f32",
        };
        self.0.iter().any(|k| k == kind)
    }
}

/// Rewrites `model` (parsed from `graph`) in place.
pub fn rewrite(
    graph: &GraphProto,
    resolver: &dyn ModelDataResolver,
    model: &mut TypedModel,
    kinds: &Kinds,
    chooser: &mut choice::Chooser,
) -> TractResult<Rewritten> {
    let mut done = Rewritten::default();
    let mut outlets: HashMap<String, OutletId> =
        model.outlet_labels.iter().map(|(o, l)| (l.clone(), *o)).collect();
    for found in pattern::find(graph, resolver).into_iter().filter(|f| kinds.allows(&f.fusion)) {
        let Some(inputs) = found.inputs.iter().map(|n| outlets.get(n).copied()).collect::<Option<Vec<_>>>()
        else {
            continue;
        };
        let Some(&target) = outlets.get(&found.output) else { continue };
        let kind = match &found.fusion {
            Fusion::Conv(_) => &mut done.conv,
            Fusion::Depthwise(_) => &mut done.depthwise,
            Fusion::Dense(_) => &mut done.dense,
            Fusion::Add(_) => &mut done.add,
            Fusion::Pool(..) => &mut done.pool,
            Fusion::FloatDepthwise(_) => &mut done.float_depthwise,
        };
        let precision = if matches!(found.fusion, Fusion::FloatDepthwise(_)) { "f32" } else { "int8" };
        let name = format!("{}.{precision}", found.node);
        match replace(model, &found, &inputs, target, &name, chooser) {
            Ok(Some(new)) => {
                model.outlet_labels.remove(&target);
                model.set_outlet_label(new, found.output.clone())?;
                outlets.insert(found.output.clone(), new);
                *kind += 1;
            }
            Ok(None) => {}
            Err(e) => tracing::debug!("{}: left on tract's ops: {e:#}", found.node),
        }
    }
    done.channels_last = channels_last_handoffs(model)?;
    // A hand-off may move a layer to another tile (AVX2 alone: the byte
    // tile): what `models profile` names is what runs.
    for node in model.nodes() {
        let (Some(conv), Some(layer)) = (node.op_as::<conv::QConv>(), node.name.strip_suffix(".int8")) else {
            continue;
        };
        if let Some(choice) = chooser.made.iter_mut().find(|c| c.layer == layer) {
            choice.name = conv.kernel_name();
        }
    }
    Ok(done)
}

/// A depthwise layer computes channels-last and its ops were wired
/// channels-first, so its output went through a transpose back to NCHW
/// and the pointwise convolution after it packed that into quads of
/// channels again (kws: a fifth of the model's time). Where every consumer
/// of a depthwise output is a pointwise convolution that can read it
/// channels-last (`QConv::taking_channels_last`), the two are rewired to
/// hand it over so; the tensor between them is then `[N, H, W, C]`. Then
/// the other way: a pointwise convolution that reads channels-last and
/// whose every consumer is a depthwise layer writes channels-last too,
/// where the host has the channels-in-lanes tile, and the depthwise layer
/// widens it without a transpose. Returns how many outputs were handed
/// over each way.
fn channels_last_handoffs(model: &mut TypedModel) -> TractResult<[usize; 2]> {
    let outputs = model.output_outlets()?.to_vec();
    let mut handed = [0; 2];
    for id in 0..model.nodes().len() {
        let (give, take) = (depthwise::QDepthwise::giving_channels_last, conv::QConv::taking_channels_last);
        handed[0] += hand_over(model, &outputs, id, give, take)? as usize;
    }
    for id in 0..model.nodes().len() {
        let (give, take) = (conv::QConv::giving_channels_last, depthwise::QDepthwise::taking_channels_last);
        handed[1] += hand_over(model, &outputs, id, give, take)? as usize;
    }
    Ok(handed)
}

/// Node `id`'s op (a `P`) giving its output channels-last, and every op
/// reading it (each a `C`) taking it so, when all of them can; the
/// output's fact becomes the channels-last one. Whether it was done.
fn hand_over<P: TypedOp + Clone, C: TypedOp + Clone>(
    model: &mut TypedModel,
    outputs: &[OutletId],
    id: usize,
    give: fn(&P) -> Option<P>,
    take: fn(&C) -> Option<C>,
) -> TractResult<bool> {
    let outlet = OutletId::new(id, 0);
    let Some(producer) = model.node(id).op_as::<P>() else { return Ok(false) };
    let consumers = model.outlet_successors(outlet);
    if outputs.contains(&outlet) || consumers.is_empty() {
        return Ok(false);
    }
    let Some(producer) = give(producer) else { return Ok(false) };
    let taking: Option<Vec<(usize, C)>> = consumers
        .iter()
        .map(|inlet| Some((inlet.node, take(model.node(inlet.node).op_as::<C>()?)?)))
        .collect();
    let Some(taking) = taking else { return Ok(false) };
    let input = model.outlet_fact(model.node(id).inputs[0])?.clone();
    let fact = producer.output_facts(&[&input])?.remove(0);
    let node = model.node_mut(id);
    node.op = Box::new(producer);
    node.outputs[0].fact = fact;
    for (consumer, op) in taking {
        model.node_mut(consumer).op = Box::new(op);
    }
    Ok(true)
}

/// Wires the op for `found` from `inputs` in place of `target`; `None`
/// when the typed model's facts say it does not fit (types, shapes).
fn replace(
    model: &mut TypedModel,
    found: &Found,
    inputs: &[OutletId],
    target: OutletId,
    name: &str,
    chooser: &mut choice::Chooser,
) -> TractResult<Option<OutletId>> {
    let facts: Vec<TypedFact> =
        inputs.iter().map(|o| model.outlet_fact(*o).cloned()).collect::<TractResult<_>>()?;
    let op: Box<dyn TypedOp> = match &found.fusion {
        Fusion::Conv(spec) => {
            let spec = sized(spec, &facts[0])?;
            let g = spec.geometry;
            let image: Vec<i8> = sample(g.in_channels * g.height * g.width);
            let mut op = chooser.pick(
                &found.node,
                &conv::QConv::candidates(&spec),
                |kernel| conv::QConv::on(spec.clone(), kernel),
                conv::QConv::kernel_name,
                |op| op.run(&image, 1).map(drop),
            )?;
            // Where a channels-last hand-off moves it onto a byte tile: the
            // one that was fastest on this layer.
            op.hand_off_tile = chooser.fastest_byte_tile(&found.node);
            Box::new(op)
        }
        Fusion::Depthwise(spec) => {
            let spec = sized(spec, &facts[0])?;
            let candidates: Vec<Kernel> =
                depthwise::QDepthwise::kernels(&spec).into_iter().map(Kernel::Depthwise).collect();
            if candidates.len() == 1 {
                Box::new(depthwise::QDepthwise::new(spec)?)
            } else {
                let g = spec.geometry;
                let image: Vec<i8> = sample(g.in_channels * g.height * g.width);
                Box::new(chooser.pick(
                    &found.node,
                    &candidates,
                    |kernel| match kernel {
                        Kernel::Depthwise(form) => depthwise::QDepthwise::on(spec.clone(), form),
                        _ => depthwise::QDepthwise::new(spec.clone()),
                    },
                    |op| op.kernel_name().into(),
                    |op| op.run(&image, 1).map(drop),
                )?)
            }
        }
        Fusion::Dense(spec) => {
            anyhow::ensure!(
                types_match(&facts[0], spec.input.qtype),
                "dense input of type {:?}",
                facts[0].datum_type
            );
            let row = sample(spec.inputs);
            Box::new(chooser.pick(
                &found.node,
                &dense::QDense::candidates(),
                |kernel| dense::QDense::on(spec.clone(), kernel),
                dense::QDense::kernel_name,
                |op| op.run(&row, 1).map(drop),
            )?)
        }
        Fusion::Add(op) => {
            anyhow::ensure!(
                types_match(&facts[0], op.a.qtype) && types_match(&facts[1], op.b.qtype),
                "add operand types"
            );
            Box::new(op.clone())
        }
        Fusion::FloatDepthwise(spec) => {
            let shape = &facts[0].shape;
            anyhow::ensure!(
                shape.rank() == 4 && facts[0].datum_type == f32::datum_type(),
                "float depthwise input {:?} {shape:?}",
                facts[0].datum_type
            );
            let mut spec = spec.clone();
            spec.geometry.height = shape[2].to_usize()?;
            spec.geometry.width = shape[3].to_usize()?;
            Box::new(float_depthwise::FDepthwise::new(spec)?)
        }
        Fusion::Pool(op, window) => {
            let shape = &facts[0].shape;
            anyhow::ensure!(shape.rank() == 4 && types_match(&facts[0], op.input.qtype), "pool input");
            let image = [shape[2].to_usize()?, shape[3].to_usize()?];
            match window {
                Some(w) if w.kernel != image || w.pads != [0; 4] => {
                    Box::new(pool::QAvgPool { input: op.input, output: op.output, window: *w })
                }
                _ => Box::new(op.clone()),
            }
        }
    };
    let fact_refs: Vec<&TypedFact> = facts.iter().collect();
    let out = op.output_facts(&fact_refs)?;
    let want = model.outlet_fact(target)?;
    if out[0].shape != want.shape || out[0].datum_type.unquantized() != want.datum_type.unquantized() {
        return Ok(None);
    }
    let mut patch = TypedModelPatch::default();
    let taps = inputs.iter().map(|o| patch.tap_model(model, *o)).collect::<TractResult<TVec<_>>>()?;
    let wire = patch.wire_node(name, op, &taps)?;
    patch.shunt_outside(model, target, wire[0])?;
    patch.apply(model)?;
    Ok(Some(OutletId::new(model.node_id_by_name(name)?, 0)))
}

/// `len` input values to time a layer on: the kernels' speed does not
/// depend on them, but a pattern keeps nothing special about zeros.
fn sample(len: usize) -> Vec<i8> {
    (0..len).map(|i| (i.wrapping_mul(37) % 251) as u8 as i8).collect()
}

/// A convolution's spec with the height and width of its input, which the
/// typed model knows and the ONNX attributes do not.
fn sized(spec: &spec::ConvSpec, input: &TypedFact) -> TractResult<spec::ConvSpec> {
    let mut spec = spec.clone();
    let shape = &input.shape;
    anyhow::ensure!(shape.rank() == 4, "conv input of rank {}", shape.rank());
    spec.geometry.height = shape[2].to_usize()?;
    spec.geometry.width = shape[3].to_usize()?;
    anyhow::ensure!(types_match(input, spec.input.qtype), "conv input of type {:?}", input.datum_type);
    Ok(spec)
}

fn types_match(fact: &TypedFact, qtype: requant::QType) -> bool {
    requant::QType::of(fact.datum_type) == Some(qtype)
}
#[cfg(test)]
mod tests;
