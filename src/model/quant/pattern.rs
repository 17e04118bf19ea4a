//! Finds the quantized patterns of an ONNX graph that our integer ops
//! replace: QDQ (DequantizeLinear -> Conv/MatMul/Gemm/Add/AveragePool ->
//! [Relu|Clip(0, 6)] -> QuantizeLinear, the form onnxruntime and tf2onnx
//! emit) and QOperator (QLinearConv, QLinearMatMul). Read from the ONNX
//! protobuf, where the int8 weights, scales and zero points are still
//! separate constants and every tensor has its ONNX name; `super::rewrite`
//! then finds the same tensors in tract's typed model by those names.

use super::add::QAdd;
use super::dense::{DenseSpec, FloatTail};
use super::float_depthwise::FloatDepthwiseSpec;
use super::patches::Geometry;
use super::pool::{QGlobalAvgPool, Window};
use super::requant::{Activation, QParam, QType, round_half_even};
use super::spec::ConvSpec;
use std::collections::HashMap;
use tract_onnx::data_resolver::ModelDataResolver;
use tract_onnx::pb::{GraphProto, NodeProto};
use tract_onnx::prelude::*;

/// One match: the op that replaces it, the ONNX names of its int8 inputs,
/// and the ONNX name of the int8 tensor it produces.
#[derive(Debug)]
pub struct Found {
    pub node: String,
    pub inputs: Vec<String>,
    pub output: String,
    pub fusion: Fusion,
}

#[derive(Debug)]
pub enum Fusion {
    Conv(ConvSpec),
    /// One filter per channel (`group` = channels, weights `[C, 1, kh, kw]`).
    Depthwise(ConvSpec),
    Dense(DenseSpec),
    Add(QAdd),
    /// The window (none for GlobalAveragePool): one that covers the whole
    /// image unpadded makes a `QGlobalAvgPool`, any other a `QAvgPool`.
    Pool(QGlobalAvgPool, Option<Window>),
    /// A float Conv with one filter per channel (and the Relu or Clip
    /// after it): `FDepthwise`.
    FloatDepthwise(FloatDepthwiseSpec),
}

/// A DequantizeLinear and what it reads.
struct Dequantize<'g> {
    input: &'g str,
    scale: Tensor,
    zero: Option<Tensor>,
    axis: i64,
}

struct Graph<'g> {
    producer: HashMap<&'g str, &'g NodeProto>,
    consumers: HashMap<&'g str, Vec<&'g NodeProto>>,
    constants: HashMap<&'g str, Tensor>,
    outputs: Vec<&'g str>,
}

pub fn find(graph: &GraphProto, resolver: &dyn ModelDataResolver) -> Vec<Found> {
    let g = Graph::new(graph, resolver);
    graph
        .node
        .iter()
        .filter_map(|node| {
            let found = match node.op_type.as_str() {
                "Conv" => g.conv(node).or_else(|| g.float_depthwise(node)),
                "QLinearConv" => g.qlinear_conv(node),
                "MatMul" | "Gemm" => g.dense(node),
                "QLinearMatMul" => g.qlinear_matmul(node),
                "Add" => g.add(node),
                "AveragePool" | "GlobalAveragePool" => g.pool(node),
                _ => None,
            };
            found.map(|(inputs, output, fusion)| Found { node: node_name(node), inputs, output, fusion })
        })
        .collect()
}

fn node_name(node: &NodeProto) -> String {
    if node.name.is_empty() { node.output.first().cloned().unwrap_or_default() } else { node.name.clone() }
}

type Match = (Vec<String>, String, Fusion);

impl<'g> Graph<'g> {
    fn new(graph: &'g GraphProto, resolver: &dyn ModelDataResolver) -> Graph<'g> {
        let mut g = Graph {
            producer: HashMap::new(),
            consumers: HashMap::new(),
            constants: HashMap::new(),
            outputs: graph.output.iter().map(|o| o.name.as_str()).collect(),
        };
        for init in &graph.initializer {
            if let Ok(t) = tract_onnx::tensor::load_tensor(resolver, init, None) {
                g.constants.insert(init.name.as_str(), t);
            }
        }
        for node in &graph.node {
            for out in &node.output {
                g.producer.insert(out.as_str(), node);
            }
            for input in node.input.iter().filter(|i| !i.is_empty()) {
                g.consumers.entry(input.as_str()).or_default().push(node);
            }
            if node.op_type == "Constant"
                && let Some(value) =
                    node.attribute.iter().find(|a| a.name == "value").and_then(|a| a.t.as_ref())
                && let Ok(t) = tract_onnx::tensor::load_tensor(resolver, value, None)
                && let Some(out) = node.output.first()
            {
                g.constants.insert(out.as_str(), t);
            }
        }
        g
    }

    fn constant(&self, name: &str) -> Option<&Tensor> {
        self.constants.get(name)
    }

    fn dequantize(&self, name: &str) -> Option<Dequantize<'g>> {
        let node = self.producer.get(name)?;
        if node.op_type != "DequantizeLinear" {
            return None;
        }
        Some(Dequantize {
            input: node.input.first()?.as_str(),
            scale: self.constant(node.input.get(1)?)?.clone(),
            zero: node.input.get(2).filter(|z| !z.is_empty()).and_then(|z| self.constant(z)).cloned(),
            axis: node.get_attr_opt::<i64>("axis").ok().flatten().unwrap_or(1),
        })
    }

    /// A per-tensor DequantizeLinear of an 8-bit activation (not a constant).
    fn activation(&self, name: &str) -> Option<(String, QParam)> {
        let dq = self.dequantize(name)?;
        if self.constant(dq.input).is_some() {
            return None;
        }
        Some((dq.input.to_string(), qparam(&dq.scale, dq.zero.as_ref())?))
    }

    /// The one node reading `name`, when nothing else (not even the graph's
    /// outputs) does.
    fn only_consumer(&self, name: &str) -> Option<&'g NodeProto> {
        match self.consumers.get(name).map(|c| &c[..]) {
            Some([one]) if !self.outputs.contains(&name) => Some(one),
            _ => None,
        }
    }

    /// From a float result to the QuantizeLinear that ends the pattern,
    /// through at most one Relu or Clip(0, 6).
    fn tail(&self, name: &str) -> Option<(Activation, QParam, String)> {
        let mut next = self.only_consumer(name)?;
        let mut activation = Activation::None;
        match next.op_type.as_str() {
            "Relu" => activation = Activation::Relu,
            "Clip" => {
                let bound = |i: usize| -> Option<f32> {
                    let t = self.constant(next.input.get(i)?)?;
                    t.cast_to_scalar::<f32>().ok()
                };
                activation = match (bound(1), bound(2)) {
                    (Some(lo), Some(hi)) if lo == 0.0 && hi == 6.0 => Activation::Relu6,
                    (Some(lo), None) if lo == 0.0 && next.input.len() == 2 => Activation::Relu,
                    _ => return None,
                };
            }
            _ => {}
        }
        if activation != Activation::None {
            next = self.only_consumer(next.output.first()?)?;
        }
        if next.op_type != "QuantizeLinear" {
            return None;
        }
        let scale = self.constant(next.input.get(1)?)?;
        let zero = next.input.get(2).and_then(|z| self.constant(z));
        Some((activation, qparam(scale, zero)?, next.output.first()?.clone()))
    }

    fn conv(&self, node: &'g NodeProto) -> Option<Match> {
        let (x, input) = self.activation(node.input.first()?)?;
        let w = self.dequantize(node.input.get(1)?)?;
        let weights = self.constant(w.input)?;
        let (activation, output, q) = self.tail(node.output.first()?)?;
        let geometry = geometry(node, weights.shape())?;
        let qw = quantized_weights(weights, &w.scale, w.zero.as_ref(), w.axis == 0, geometry.out_channels)?;
        let bias = match node.input.get(2).filter(|b| !b.is_empty()) {
            Some(b) => self.bias(b, &input, &qw.scale, geometry.out_channels)?,
            None => vec![0],
        };
        let spec = ConvSpec {
            geometry,
            input,
            output,
            weights: qw.values,
            weight_zero: qw.zero,
            weight_scale: qw.scale,
            bias,
            activation,
        };
        Some((vec![x], q, conv_fusion(node, spec)?))
    }

    /// Conv(x, W[, B]) on f32 constants with group = channels, then at most
    /// one Relu or Clip with constant bounds, which become the op's clamp.
    fn float_depthwise(&self, node: &'g NodeProto) -> Option<Match> {
        let x = node.input.first()?;
        let weights = self.constant(node.input.get(1)?)?;
        if weights.datum_type() != f32::datum_type()
            || self.constant(x).is_some()
            || self.producer.get(x.as_str()).is_some_and(|p| p.op_type == "DequantizeLinear")
        {
            return None;
        }
        let mut geometry = geometry(node, weights.shape())?;
        let group = node.get_attr_opt::<i64>("group").ok().flatten().unwrap_or(1);
        let channels = geometry.out_channels;
        if geometry.in_channels != 1 || group != channels as i64 || channels < 2 {
            return None;
        }
        geometry.in_channels = channels;
        let floats = |t: &Tensor| Some(t.try_as_plain_ram().ok()?.as_slice::<f32>().ok()?.to_vec());
        let bias = match node.input.get(2).filter(|b| !b.is_empty()) {
            Some(b) => floats(self.constant(b)?).filter(|b| b.len() == channels)?,
            None => vec![0.0; channels],
        };
        let conv_out = node.output.first()?;
        let bound = |clip: &NodeProto, i: usize| -> Option<Option<f32>> {
            match clip.input.get(i).filter(|n| !n.is_empty()) {
                None => Some(None),
                Some(n) => Some(Some(self.constant(n)?.cast_to_scalar::<f32>().ok()?)),
            }
        };
        let (lo, hi, output) = match self.only_consumer(conv_out) {
            Some(next) if next.op_type == "Relu" => (0.0, f32::INFINITY, next.output.first()?.clone()),
            Some(next) if next.op_type == "Clip" && next.attribute.is_empty() => {
                match (bound(next, 1), bound(next, 2)) {
                    (Some(lo), Some(hi)) => (
                        lo.unwrap_or(f32::NEG_INFINITY),
                        hi.unwrap_or(f32::INFINITY),
                        next.output.first()?.clone(),
                    ),
                    _ => (f32::NEG_INFINITY, f32::INFINITY, conv_out.clone()),
                }
            }
            _ => (f32::NEG_INFINITY, f32::INFINITY, conv_out.clone()),
        };
        let spec = FloatDepthwiseSpec { geometry, weights: floats(weights)?, bias, lo, hi };
        Some((vec![x.clone()], output, Fusion::FloatDepthwise(spec)))
    }

    fn qlinear_conv(&self, node: &'g NodeProto) -> Option<Match> {
        let c = |i: usize| node.input.get(i).and_then(|n| self.constant(n));
        let input = qparam(c(1)?, c(2))?;
        let weights = c(3)?;
        let geometry = geometry(node, weights.shape())?;
        // QLinearConv's per-channel parameters are along the output channels.
        let qw = quantized_weights(weights, c(4)?, c(5), true, geometry.out_channels)?;
        let output = qparam(c(6)?, c(7))?;
        let bias = match c(8) {
            Some(b) => b.cast_to::<i32>().ok()?.try_as_plain_ram().ok()?.as_slice::<i32>().ok()?.to_vec(),
            None => vec![0],
        };
        let spec = ConvSpec {
            geometry,
            input,
            output,
            weights: qw.values,
            weight_zero: qw.zero,
            weight_scale: qw.scale,
            bias,
            activation: Activation::None,
        };
        Some((vec![node.input.first()?.clone()], node.output.first()?.clone(), conv_fusion(node, spec)?))
    }

    /// MatMul(DQ(x), DQ(W)) [+ bias], or Gemm(DQ(x), DQ(W), bias), then the tail.
    fn dense(&self, node: &'g NodeProto) -> Option<Match> {
        let gemm = node.op_type == "Gemm";
        if gemm {
            let one = |a: &str| node.get_attr_opt::<f32>(a).ok().flatten().unwrap_or(1.0) == 1.0;
            if !one("alpha")
                || !one("beta")
                || node.get_attr_opt::<i64>("transA").ok().flatten().unwrap_or(0) != 0
            {
                return None;
            }
        }
        let trans_b = gemm && node.get_attr_opt::<i64>("transB").ok().flatten().unwrap_or(0) == 1;
        let (x, input) = self.activation(node.input.first()?)?;
        let w = self.dequantize(node.input.get(1)?)?;
        let weights = self.constant(w.input)?;
        let [k, m] = match (weights.shape(), trans_b) {
            (&[k, m], false) => [k, m],
            (&[m, k], true) => [k, m],
            _ => return None,
        };
        // Per output column: axis 1 of [K, M], axis 0 of a transposed [M, K].
        let along_outputs = w.axis == if trans_b { 0 } else { 1 };
        let transposed =
            if trans_b { weights.clone() } else { weights.clone().permute_axes(&[1, 0]).ok()? };
        let qw = quantized_weights(&transposed, &w.scale, w.zero.as_ref(), along_outputs, m)?;
        let weight_scale = qw.scale;
        let mut out = node.output.first()?.as_str();
        let mut bias = vec![0];
        if gemm {
            if let Some(b) = node.input.get(2).filter(|b| !b.is_empty()) {
                bias = self.bias(b, &input, &weight_scale, m)?;
            }
        } else if let Some(add) = self.only_consumer(out).filter(|n| n.op_type == "Add") {
            let other = add.input.iter().find(|i| i.as_str() != out)?;
            if let Some(b) = self.bias(other, &input, &weight_scale, m) {
                bias = b;
                out = add.output.first()?.as_str();
            }
        }
        let (activation, output, q) = self.tail(out)?;
        let spec = DenseSpec {
            inputs: k,
            outputs: m,
            input,
            output,
            weights: qw.values,
            weight_zero: qw.zero,
            weight_scale,
            bias,
            activation,
            tail: None,
        };
        Some((vec![x], q, Fusion::Dense(spec)))
    }

    fn qlinear_matmul(&self, node: &'g NodeProto) -> Option<Match> {
        let c = |i: usize| node.input.get(i).and_then(|n| self.constant(n));
        let input = qparam(c(1)?, c(2))?;
        let weights = c(3)?;
        let &[k, m] = weights.shape() else { return None };
        let transposed = weights.clone().permute_axes(&[1, 0]).ok()?;
        // QLinearMatMul's per-column parameters of b are along the outputs.
        let qw = quantized_weights(&transposed, c(4)?, c(5), true, m)?;
        let output = qparam(c(6)?, c(7))?;
        let (tail, end) = match self.float_tail(node.output.first()?, &output, m) {
            Some((tail, end)) => (Some(tail), end),
            None => (None, node.output.first()?.clone()),
        };
        let spec = DenseSpec {
            inputs: k,
            outputs: m,
            input,
            output,
            weights: qw.values,
            weight_zero: qw.zero,
            weight_scale: qw.scale,
            bias: vec![0],
            activation: Activation::None,
            tail,
        };
        Some((vec![node.input.first()?.clone()], end, Fusion::Dense(spec)))
    }

    /// After a QLinearMatMul producing `name` with `params`: DequantizeLinear
    /// (same parameters) -> Add(constant float bias), then the usual tail
    /// to a QuantizeLinear, or nothing (a float result, e.g. the logits
    /// before a Softmax). Returns the tail and the tensor it ends at.
    fn float_tail(&self, name: &str, params: &QParam, outputs: usize) -> Option<(FloatTail, String)> {
        let dq = self.only_consumer(name).filter(|n| n.op_type == "DequantizeLinear")?;
        let c = |i: usize| dq.input.get(i).and_then(|n| self.constant(n));
        if qparam(c(1)?, c(2)).as_ref() != Some(params) {
            return None;
        }
        let dequantized = dq.output.first()?;
        let add = self.only_consumer(dequantized).filter(|n| n.op_type == "Add")?;
        let other = add.input.iter().find(|i| *i != dequantized)?;
        let bias = self.constant(other)?.cast_to::<f32>().ok()?;
        let bias = bias.try_as_plain_ram().ok()?.as_slice::<f32>().ok()?.to_vec();
        if bias.len() != outputs && bias.len() != 1 {
            return None;
        }
        let sum = add.output.first()?;
        Some(match self.tail(sum) {
            Some((activation, out, q)) => (FloatTail { bias, requantize: Some((activation, out)) }, q),
            None => (FloatTail { bias, requantize: None }, sum.clone()),
        })
    }

    fn add(&self, node: &'g NodeProto) -> Option<Match> {
        let (a, pa) = self.activation(node.input.first()?)?;
        let (b, pb) = self.activation(node.input.get(1)?)?;
        let (activation, output, q) = self.tail(node.output.first()?)?;
        Some((vec![a, b], q, Fusion::Add(QAdd { a: pa, b: pb, output, activation })))
    }

    fn pool(&self, node: &'g NodeProto) -> Option<Match> {
        let (x, input) = self.activation(node.input.first()?)?;
        let window = if node.op_type == "AveragePool" {
            let pair = |name: &str, default: i64| -> Option<Vec<i64>> {
                Some(node.get_attr_opt_vec::<i64>(name).ok().flatten().unwrap_or(vec![default; 2]))
            };
            let kernel = node.get_attr_opt_vec::<i64>("kernel_shape").ok().flatten()?;
            let strides = pair("strides", 1)?;
            let pads = node.get_attr_opt_vec::<i64>("pads").ok().flatten().unwrap_or(vec![0; 4]);
            let auto_pad = node.get_attr_opt::<String>("auto_pad").ok().flatten().unwrap_or_default();
            let int = |name: &str| node.get_attr_opt::<i64>(name).ok().flatten().unwrap_or(0);
            if kernel.len() != 2
                || strides.len() != 2
                || pads.len() != 4
                || kernel.iter().chain(&strides).any(|&v| v <= 0)
                || pads.iter().any(|&p| p < 0)
                || int("ceil_mode") != 0
                || node
                    .get_attr_opt_vec::<i64>("dilations")
                    .ok()
                    .flatten()
                    .is_some_and(|d| d.iter().any(|&v| v != 1))
                || !matches!(auto_pad.as_str(), "" | "NOTSET" | "VALID")
            {
                return None;
            }
            let u = |v: &[i64]| v.iter().map(|&x| x as usize).collect::<Vec<_>>();
            let (k, st, p) = (u(&kernel), u(&strides), u(&pads));
            Some(Window {
                kernel: [k[0], k[1]],
                strides: [st[0], st[1]],
                pads: [p[0], p[1], p[2], p[3]],
                count_include_pad: int("count_include_pad") != 0,
            })
        } else {
            None
        };
        let (activation, output, q) = self.tail(node.output.first()?)?;
        if activation != Activation::None {
            return None;
        }
        Some((vec![x], q, Fusion::Pool(QGlobalAvgPool { input, output }, window)))
    }

    /// A bias in accumulator units (input scale x weight scale): an int32
    /// DequantizeLinear whose scale is that product (the QDQ norm), or
    /// anything constant, rescaled and rounded.
    fn bias(&self, name: &str, input: &QParam, weight_scale: &[f32], channels: usize) -> Option<Vec<i32>> {
        let (values, scale): (Vec<f64>, Vec<f32>) = match self.dequantize(name) {
            Some(dq) => {
                let b = self.constant(dq.input)?.cast_to::<f64>().ok()?.into_owned();
                let b = b.try_as_plain_ram().ok()?.as_slice::<f64>().ok()?.to_vec();
                let zero = match &dq.zero {
                    Some(z) => {
                        z.cast_to::<f64>().ok()?.try_as_plain_ram().ok()?.as_slice::<f64>().ok()?.to_vec()
                    }
                    None => vec![0.0],
                };
                let values = b
                    .iter()
                    .enumerate()
                    .map(|(i, v)| v - zero[if zero.len() == 1 { 0 } else { i }])
                    .collect();
                (values, per_channel(&dq.scale, b.len())?)
            }
            None => {
                let b = self.constant(name)?.cast_to::<f64>().ok()?.into_owned();
                (b.try_as_plain_ram().ok()?.as_slice::<f64>().ok()?.to_vec(), vec![1.0])
            }
        };
        if values.len() != channels {
            return None;
        }
        Some(
            (0..channels)
                .map(|c| {
                    let acc_scale = input.scale as f64 * super::requant::per(weight_scale, c) as f64;
                    let real = values[c] * super::requant::per(&scale, c) as f64;
                    let units = real / acc_scale;
                    // Exactly the stored integer when the scales agree (the norm).
                    if (units - units.round()).abs() < 1e-3 {
                        units.round() as i32
                    } else {
                        round_half_even(units as f32) as i32
                    }
                })
                .collect(),
        )
    }
}

/// A scalar scale and an optional scalar zero point (u8 when absent, as
/// ONNX says).
fn qparam(scale: &Tensor, zero: Option<&Tensor>) -> Option<QParam> {
    if scale.len() != 1 || zero.is_some_and(|z| z.len() != 1) {
        return None;
    }
    let scale = scale.cast_to_scalar::<f32>().ok()?;
    let (qtype, zero_point) = match zero {
        Some(z) => (QType::of(z.datum_type())?, z.cast_to_scalar::<i32>().ok()?),
        None => (QType::U8, 0),
    };
    (scale > 0.0 && scale.is_finite()).then_some(QParam { scale, zero_point, qtype })
}

/// One scale per output channel, or one for all.
fn per_channel(scale: &Tensor, channels: usize) -> Option<Vec<f32>> {
    let s = scale.cast_to::<f32>().ok()?;
    let s = s.try_as_plain_ram().ok()?.as_slice::<f32>().ok()?.to_vec();
    (s.len() == 1 || s.len() == channels).then_some(s).filter(|s| s.iter().all(|v| *v > 0.0 && v.is_finite()))
}

/// Constant 8-bit weights `[channels, ...]` in the i8 domain (u8 weights
/// shift by 128, exactly), with one scale and zero point per channel or one
/// for all. `along_channels` says whether per-channel parameters were given
/// along that first axis; any other axis is refused.
struct QuantizedWeights {
    values: Vec<i8>,
    zero: Vec<i32>,
    scale: Vec<f32>,
}

fn quantized_weights(
    w: &Tensor,
    scale: &Tensor,
    zero: Option<&Tensor>,
    along_channels: bool,
    channels: usize,
) -> Option<QuantizedWeights> {
    if (scale.len() > 1 || zero.is_some_and(|z| z.len() > 1)) && !along_channels {
        return None;
    }
    let qtype = QType::of(w.datum_type())?;
    let values = qtype.to_i8(w.try_as_plain_ram().ok()?.as_bytes()).into_owned();
    let zero: Vec<i32> = match zero {
        Some(z) => {
            let z = z.cast_to::<i32>().ok()?;
            z.try_as_plain_ram().ok()?.as_slice::<i32>().ok()?.iter().map(|v| v - qtype.offset()).collect()
        }
        None => vec![-qtype.offset()],
    };
    let scale = per_channel(scale, channels)?;
    (zero.len() == 1 || zero.len() == channels).then_some(QuantizedWeights { values, zero, scale })
}

/// `QConv` for group 1, `QDepthwise` for one filter per channel (its
/// geometry then has the group's channels in and out); other groupings
/// stay on tract's ops.
fn conv_fusion(node: &NodeProto, mut spec: ConvSpec) -> Option<Fusion> {
    let group = node.get_attr_opt::<i64>("group").ok().flatten().unwrap_or(1);
    let g = &mut spec.geometry;
    if group == 1 {
        return Some(Fusion::Conv(spec));
    }
    if g.in_channels != 1 || group != g.out_channels as i64 {
        return None;
    }
    g.in_channels = g.out_channels;
    Some(Fusion::Depthwise(spec))
}

/// The convolution's geometry from its attributes and its `[co, ci, kh,
/// kw]` weights; `None` for what QConv does not do (auto_pad SAME, 1-D or
/// 3-D). Height and width come from the typed model at rewrite time.
fn geometry(node: &NodeProto, w: &[usize]) -> Option<Geometry> {
    let &[co, ci, kh, kw] = w else { return None };
    let auto_pad = node.get_attr_opt::<String>("auto_pad").ok().flatten().unwrap_or_default();
    if !matches!(auto_pad.as_str(), "" | "NOTSET" | "VALID") {
        return None;
    }
    let pair = |name: &str| -> Option<[usize; 2]> {
        match node.get_attr_opt_vec::<i64>(name).ok().flatten() {
            None => Some([1, 1]),
            Some(v) if v.len() == 2 && v.iter().all(|&x| x > 0) => Some([v[0] as usize, v[1] as usize]),
            _ => None,
        }
    };
    let pads = match node.get_attr_opt_vec::<i64>("pads").ok().flatten() {
        None => [0; 4],
        Some(v) if v.len() == 4 && v.iter().all(|&x| x >= 0) => {
            [v[0] as usize, v[1] as usize, v[2] as usize, v[3] as usize]
        }
        _ => return None,
    };
    if let Some(k) = node.get_attr_opt_vec::<i64>("kernel_shape").ok().flatten()
        && k != [kh as i64, kw as i64]
    {
        return None;
    }
    Some(Geometry {
        in_channels: ci,
        out_channels: co,
        height: 0,
        width: 0,
        kernel: [kh, kw],
        strides: pair("strides")?,
        dilations: pair("dilations")?,
        pads,
    })
}
