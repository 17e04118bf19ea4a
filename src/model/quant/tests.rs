//! Every integer op against a scalar reference written from the ONNX
//! definitions (dequantize, compute exactly, quantize with round-half-even
//! and saturation), bit-exact, over random shapes, strides, paddings,
//! dilations, zero points and per-channel scales.

use super::add::QAdd;
use super::choice::Kernel;
use super::conv::QConv;
use super::dense::{DenseSpec, QDense};
use super::depthwise::QDepthwise;
use super::float_depthwise::{FDepthwise, FloatDepthwiseSpec};
use super::patches::Geometry;
use super::pool::{QAvgPool, QGlobalAvgPool, Window};
use super::requant::{Activation, QParam, QType, output_range};
use super::spec::ConvSpec;
use proptest::prelude::*;

/// Quantizes an exact accumulator with the per-channel multiplier, as
/// `QuantizeLinear` after the float op would, with the activation clamp.
fn quantize(acc: i64, multiplier: f32, out: &QParam, activation: Activation) -> i8 {
    let (lo, hi) = output_range(out, activation);
    let z = out.zero_i8();
    let v = (acc as f32 * multiplier).round_ties_even() as i64 + z as i64;
    v.clamp(lo as i64, hi as i64) as i8
}

fn per<T: Copy>(v: &[T], c: usize) -> T {
    if v.len() == 1 { v[0] } else { v[c] }
}

fn conv_reference(s: &ConvSpec, x: &[i8], images: usize) -> Vec<i8> {
    let g = &s.geometry;
    let [oh, ow] = g.output_hw().unwrap();
    let zx = s.input.zero_i8() as i64;
    let mut out = Vec::new();
    for n in 0..images {
        for co in 0..g.out_channels {
            let zw = per(&s.weight_zero, co) as i64;
            let m = s.input.scale * per(&s.weight_scale, co) / s.output.scale;
            for oy in 0..oh {
                for ox in 0..ow {
                    let mut acc = per(&s.bias, co) as i64;
                    for ci in 0..g.in_channels {
                        for ky in 0..g.kernel[0] {
                            for kx in 0..g.kernel[1] {
                                let iy = (oy * g.strides[0] + ky * g.dilations[0]) as i64 - g.pads[0] as i64;
                                let ix = (ox * g.strides[1] + kx * g.dilations[1]) as i64 - g.pads[1] as i64;
                                if iy < 0 || ix < 0 || iy >= g.height as i64 || ix >= g.width as i64 {
                                    continue; // padding is the real zero
                                }
                                let xv = x[((n * g.in_channels + ci) * g.height + iy as usize) * g.width
                                    + ix as usize];
                                let wv = s.weights
                                    [((co * g.in_channels + ci) * g.kernel[0] + ky) * g.kernel[1] + kx];
                                acc += (xv as i64 - zx) * (wv as i64 - zw);
                            }
                        }
                    }
                    out.push(quantize(acc, m, &s.output, s.activation));
                }
            }
        }
    }
    out
}

fn qparam() -> impl Strategy<Value = QParam> {
    (0.002f32..0.5, any::<i8>(), prop_oneof![Just(QType::I8), Just(QType::U8)])
        .prop_map(|(scale, z, qtype)| QParam { scale, zero_point: z as i32 + qtype.offset(), qtype })
}

fn activation() -> impl Strategy<Value = Activation> {
    prop_oneof![Just(Activation::None), Just(Activation::Relu), Just(Activation::Relu6)]
}

/// Per-channel values, or one for all.
fn channels<T: std::fmt::Debug + Clone>(
    s: impl Strategy<Value = T> + Clone,
    n: usize,
) -> impl Strategy<Value = Vec<T>> {
    prop_oneof![prop::collection::vec(s.clone(), 1), prop::collection::vec(s, n)]
}

fn geometry() -> impl Strategy<Value = Geometry> {
    (
        prop_oneof![1usize..5, Just(8usize)],
        1usize..19,
        1usize..11,
        prop_oneof![1usize..11, 16usize..40],
        [1usize..4, 1usize..4],
        [1usize..3, 1usize..3],
        [1usize..3, 1usize..3],
        [0usize..3, 0usize..3, 0usize..3, 0usize..3],
    )
        .prop_map(|(ci, co, h, w, kernel, strides, dilations, pads)| Geometry {
            in_channels: ci,
            out_channels: co,
            height: h,
            width: w,
            kernel,
            strides,
            dilations,
            pads,
        })
        .prop_filter("window inside the padded input", |g| g.output_hw().is_ok())
}

/// A depthwise geometry: the same channels in and out, from one to five
/// kernel blocks (two AVX-512 block pairs and an odd one), partial blocks
/// included.
fn depthwise_geometry() -> impl Strategy<Value = Geometry> {
    (geometry(), prop_oneof![1usize..20, 30usize..40, 60usize..70]).prop_map(|(g, channels)| Geometry {
        in_channels: channels,
        out_channels: channels,
        ..g
    })
}

/// A random spec for `geometries` (random weights, zero points, scales,
/// bias, activation) and a batch of random input images; `weights` says
/// how many weights a geometry has.
fn conv_case_of(
    geometries: impl Strategy<Value = Geometry>,
    weights: fn(&Geometry) -> usize,
) -> impl Strategy<Value = (ConvSpec, Vec<i8>, usize)> {
    (geometries, 1usize..3).prop_flat_map(move |(g, images)| {
        let co = g.out_channels;
        let zero_weights = prop_oneof![Just(vec![0]), channels(-20i32..20, co)];
        (
            qparam(),
            qparam(),
            prop::collection::vec(any::<i8>(), weights(&g)),
            zero_weights,
            channels(0.001f32..0.05, co),
            channels(-20_000i32..20_000, co),
            activation(),
            prop::collection::vec(any::<i8>(), images * g.in_channels * g.height * g.width),
        )
            .prop_map(
                move |(input, output, weights, weight_zero, weight_scale, bias, activation, x)| {
                    (
                        ConvSpec {
                            geometry: g,
                            input,
                            output,
                            weights,
                            weight_zero,
                            weight_scale,
                            bias,
                            activation,
                        },
                        x,
                        images,
                    )
                },
            )
    })
}

/// `images` images of `[channels, pixels]` moved to `[pixels, channels]`.
fn channels_last(x: &[i8], images: usize, channels: usize) -> Vec<i8> {
    let pixels = x.len() / images.max(1) / channels.max(1);
    x.chunks(channels * pixels)
        .flat_map(|image| (0..pixels).flat_map(move |p| (0..channels).map(move |c| image[c * pixels + p])))
        .collect()
}

/// A 1 x 1, stride 1, unpadded convolution: what reads a depthwise
/// layer's output channels-last.
fn pointwise_case() -> impl Strategy<Value = (ConvSpec, Vec<i8>, usize)> {
    let pointwise = (1usize..70, 1usize..40, 1usize..9, 1usize..21).prop_map(|(ci, co, h, w)| Geometry {
        in_channels: ci,
        out_channels: co,
        height: h,
        width: w,
        kernel: [1, 1],
        strides: [1, 1],
        dilations: [1, 1],
        pads: [0; 4],
    });
    conv_case_of(pointwise, |g| g.out_channels * g.patch_len())
        .prop_map(|(spec, x, images)| (ConvSpec { weight_zero: vec![0], ..spec }, x, images))
}

fn conv_case() -> impl Strategy<Value = (ConvSpec, Vec<i8>, usize)> {
    conv_case_of(geometry(), |g| g.out_channels * g.patch_len())
}

fn depthwise_case() -> impl Strategy<Value = (ConvSpec, Vec<i8>, usize)> {
    conv_case_of(depthwise_geometry(), |g| g.out_channels * g.kernel[0] * g.kernel[1])
}

/// A depthwise convolution computed as ONNX defines it (group = channels):
/// channel `c` of the output reads channel `c` of the input only.
fn depthwise_reference(s: &ConvSpec, x: &[i8], images: usize) -> Vec<i8> {
    let g = &s.geometry;
    let [oh, ow] = g.output_hw().unwrap();
    let (zx, taps) = (s.input.zero_i8() as i64, g.kernel[0] * g.kernel[1]);
    let mut out = Vec::new();
    for n in 0..images {
        for c in 0..g.in_channels {
            let zw = per(&s.weight_zero, c) as i64;
            let m = s.input.scale * per(&s.weight_scale, c) / s.output.scale;
            let plane = &x[(n * g.in_channels + c) * g.height * g.width..][..g.height * g.width];
            for oy in 0..oh {
                for ox in 0..ow {
                    let mut acc = per(&s.bias, c) as i64;
                    for ky in 0..g.kernel[0] {
                        for kx in 0..g.kernel[1] {
                            let iy = (oy * g.strides[0] + ky * g.dilations[0]) as i64 - g.pads[0] as i64;
                            let ix = (ox * g.strides[1] + kx * g.dilations[1]) as i64 - g.pads[1] as i64;
                            if iy < 0 || ix < 0 || iy >= g.height as i64 || ix >= g.width as i64 {
                                continue;
                            }
                            let xv = plane[iy as usize * g.width + ix as usize] as i64;
                            let wv = s.weights[c * taps + ky * g.kernel[1] + kx] as i64;
                            acc += (xv - zx) * (wv - zw);
                        }
                    }
                    out.push(quantize(acc, m, &s.output, s.activation));
                }
            }
        }
    }
    out
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 96, ..ProptestConfig::default() })]

    #[test]
    fn qdepthwise_is_bit_exact((spec, x, images) in depthwise_case()) {
        let want = depthwise_reference(&spec, &x, images);
        let want_last = channels_last(&want, images, spec.geometry.out_channels);
        let x_last = channels_last(&x, images, spec.geometry.in_channels);
        // Each form the timing may choose is one `every_kernel` checks.
        let names: Vec<&str> = QDepthwise::every_kernel(spec.clone()).unwrap().iter().map(|op| op.kernel_name()).collect();
        for kernel in QDepthwise::kernels(&spec) {
            let op = QDepthwise::on(spec.clone(), kernel).unwrap();
            prop_assert!(names.contains(&op.kernel_name()), "{:?}: {} not in {:?}", kernel, op.kernel_name(), names);
        }
        for op in QDepthwise::every_kernel(spec.clone()).unwrap() {
            let got = op.run(&x, images).unwrap();
            prop_assert_eq!(&got, &want, "{}, {:?}", op.kernel_name(), spec.geometry);
            if let Some(op) = op.giving_channels_last() {
                let got = op.run(&x, images).unwrap();
                prop_assert_eq!(&got, &want_last, "{} channels-last, {:?}", op.kernel_name(), spec.geometry);
            }
            if let Some(op) = op.taking_channels_last() {
                let got = op.run(&x_last, images).unwrap();
                prop_assert_eq!(&got, &want, "{} channels-last in, {:?}", op.kernel_name(), spec.geometry);
                let op = op.giving_channels_last().unwrap();
                let got = op.run(&x_last, images).unwrap();
                prop_assert_eq!(&got, &want_last, "{} channels-last in and out, {:?}", op.kernel_name(), spec.geometry);
            }
        }
    }

    #[test]
    fn qconv_is_bit_exact((spec, x, images) in conv_case()) {
        let want = conv_reference(&spec, &x, images);
        let tract = QConv::on_tract_kernels(spec.clone()).unwrap().run(&x, images).unwrap();
        prop_assert_eq!(&tract, &want, "tract kernels, {:?}", spec.geometry);
        let ours = QConv::on_our_kernels(spec.clone()).unwrap().run(&x, images).unwrap();
        prop_assert_eq!(&ours, &want, "our kernels, {:?}", spec.geometry);
        // Every kernel the load-time timing may choose gives the same bits.
        let candidates = QConv::candidates(&spec);
        prop_assert!(candidates.iter().any(|k| matches!(k, Kernel::I16(_))) && candidates.contains(&Kernel::Tract), "{:?}", candidates);
        for kernel in candidates {
            let op = QConv::on(spec.clone(), kernel).unwrap();
            prop_assert_eq!(&op.run(&x, images).unwrap(), &want, "{:?} ({}), {:?}", kernel, op.kernel_name(), spec.geometry);
        }
    }

    #[test]
    fn qconv_reads_channels_last_bit_exact((spec, x, images) in pointwise_case()) {
        let want = conv_reference(&spec, &x, images);
        let x_last = channels_last(&x, images, spec.geometry.in_channels);
        let mut tiles = super::udot::TileKernel::available();
        tiles.push(super::udot::TileKernel::Portable);
        for tile in tiles {
            let op = QConv::on_byte_tile(spec.clone(), tile).unwrap();
            prop_assert_eq!(&op.run(&x, images).unwrap(), &want, "{:?} channels-first", tile);
            let op = op.taking_channels_last().expect("a pointwise layer on the byte tile reads channels-last");
            prop_assert_eq!(&op.run(&x_last, images).unwrap(), &want, "{:?} channels-last, {:?}", tile, spec.geometry);
            if let Some(op) = op.giving_channels_last() {
                let want_last = channels_last(&want, images, spec.geometry.out_channels);
                prop_assert_eq!(&op.run(&x_last, images).unwrap(), &want_last, "channels-last out, {:?}", spec.geometry);
            }
        }
        // On the i16 tile (a host whose byte tile lacks a dot product), a
        // layer taking channels-last moves to the byte tile.
        let op = QConv::on_i16_tile(spec.clone()).unwrap();
        prop_assert!(op.kernel_name().contains("i16x2"), "{}", op.kernel_name());
        prop_assert_eq!(&op.run(&x, images).unwrap(), &want, "i16 tile, {:?}", spec.geometry);
        if let Some(best) = super::udot::TileKernel::best() {
            let moved = op.taking_channels_last().expect("a pointwise layer with a byte tile here reads channels-last");
            prop_assert_eq!(moved.kernel_name(), best.name());
            prop_assert_eq!(&moved.run(&x_last, images).unwrap(), &want, "from the i16 tile, {:?}", spec.geometry);
            // To the byte tile that was fastest on the layer, where one was measured.
            let last = *super::udot::TileKernel::available().last().unwrap();
            let mut measured = op.clone();
            measured.hand_off_tile = Some(last);
            let moved = measured.taking_channels_last().unwrap();
            prop_assert_eq!(moved.kernel_name(), last.name());
            prop_assert_eq!(&moved.run(&x_last, images).unwrap(), &want, "to {:?}, {:?}", last, spec.geometry);
        }
    }

    /// The float depthwise op against the definition summed in f64: within
    /// f32 rounding (the sums' order differs), and every kernel here gives
    /// the portable one's bits (the same fused multiply-adds in order).
    #[test]
    fn fdepthwise_matches_the_definition(
        g in depthwise_geometry(), images in 1usize..3, relu in 0usize..3, seed in any::<u64>(),
    ) {
        let mut rng = fastrand::Rng::with_seed(seed);
        let (c, taps) = (g.in_channels, g.kernel[0] * g.kernel[1]);
        let weights: Vec<f32> = (0..c * taps).map(|_| rng.f32() * 2.0 - 1.0).collect();
        let bias: Vec<f32> = (0..c).map(|_| rng.f32() - 0.5).collect();
        let x: Vec<f32> = (0..images * c * g.height * g.width).map(|_| rng.f32() * 4.0 - 2.0).collect();
        let (lo, hi) = [(f32::NEG_INFINITY, f32::INFINITY), (0.0, f32::INFINITY), (0.0, 6.0)][relu];
        let spec = FloatDepthwiseSpec { geometry: g, weights: weights.clone(), bias: bias.clone(), lo, hi };
        let [oh, ow] = g.output_hw().unwrap();
        let mut want = Vec::new();
        for n in 0..images {
            for ch in 0..c {
                for oy in 0..oh {
                    for ox in 0..ow {
                        let mut acc = bias[ch] as f64;
                        for ky in 0..g.kernel[0] {
                            for kx in 0..g.kernel[1] {
                                let iy = (oy * g.strides[0] + ky * g.dilations[0]) as i64 - g.pads[0] as i64;
                                let ix = (ox * g.strides[1] + kx * g.dilations[1]) as i64 - g.pads[1] as i64;
                                if iy >= 0 && ix >= 0 && (iy as usize) < g.height && (ix as usize) < g.width {
                                    let v = x[((n * c + ch) * g.height + iy as usize) * g.width + ix as usize];
                                    acc += v as f64 * weights[ch * taps + ky * g.kernel[1] + kx] as f64;
                                }
                            }
                        }
                        want.push(acc.max(lo as f64).min(hi as f64));
                    }
                }
            }
        }
        let ops = FDepthwise::every_kernel(spec).unwrap();
        let reference = ops.last().unwrap().run(&x, images).unwrap();
        for op in &ops {
            let got = op.run(&x, images).unwrap();
            prop_assert_eq!(&got, &reference, "{} against the portable kernel, {:?}", op.kernel_name(), g);
        }
        for (i, (&got, &want)) in reference.iter().zip(&want).enumerate() {
            let tolerance = 1e-5 * (1.0 + taps as f64 * 2.0);
            prop_assert!((got as f64 - want).abs() <= tolerance, "{i}: {got} against {want}, {g:?}");
        }
    }

    #[test]
    fn qdense_is_bit_exact(
        (k, m, rows) in (1usize..70, 1usize..40, 1usize..9),
        input in qparam(), output in qparam(), activation in activation(),
        seed in any::<u64>(),
    ) {
        let mut rng = fastrand::Rng::with_seed(seed);
        let weights: Vec<i8> = (0..m * k).map(|_| rng.i8(..)).collect();
        let weight_zero = if rng.bool() { vec![0] } else { (0..m).map(|_| rng.i32(-10..10)).collect() };
        let weight_scale: Vec<f32> = (0..m).map(|_| rng.f32() * 0.05 + 0.001).collect();
        let bias: Vec<i32> = (0..m).map(|_| rng.i32(-9000..9000)).collect();
        let x: Vec<i8> = (0..rows * k).map(|_| rng.i8(..)).collect();
        let spec = DenseSpec { inputs: k, outputs: m, input, output, weights, weight_zero, weight_scale, bias, activation, tail: None };
        let zx = input.zero_i8() as i64;
        let mut want = Vec::new();
        for r in 0..rows {
            for c in 0..m {
                let zw = per(&spec.weight_zero, c) as i64;
                let acc = spec.bias[c] as i64
                    + (0..k).map(|i| (x[r * k + i] as i64 - zx) * (spec.weights[c * k + i] as i64 - zw)).sum::<i64>();
                want.push(quantize(acc, input.scale * spec.weight_scale[c] / output.scale, &output, activation));
            }
        }
        prop_assert_eq!(&QDense::on_tract_kernels(spec.clone()).unwrap().run(&x, rows).unwrap(), &want, "tract kernels");
        prop_assert_eq!(&QDense::on_our_kernels(spec.clone()).unwrap().run(&x, rows).unwrap(), &want, "our kernels");
        for kernel in QDense::candidates() {
            let op = QDense::on(spec.clone(), kernel).unwrap();
            prop_assert_eq!(&op.run(&x, rows).unwrap(), &want, "{:?}", kernel);
        }
    }

    #[test]
    fn qadd_is_bit_exact(a in qparam(), b in qparam(), output in qparam(), activation in activation(),
                         xs in prop::collection::vec((any::<i8>(), any::<i8>()), 1..200)) {
        let op = QAdd { a, b, output, activation };
        let (xa, xb): (Vec<i8>, Vec<i8>) = xs.iter().copied().unzip();
        let (lo, hi) = output_range(&output, activation);
        let want: Vec<i8> = xs.iter().map(|&(p, q)| {
            let v = (p as i32 - a.zero_i8()) as f32 * (a.scale / output.scale)
                + (q as i32 - b.zero_i8()) as f32 * (b.scale / output.scale);
            ((v.round_ties_even() as i64 + output.zero_i8() as i64).clamp(lo as i64, hi as i64)) as i8
        }).collect();
        prop_assert_eq!(op.run(&xa, &xb), want);
    }

    #[test]
    fn qglobal_avg_pool_is_bit_exact(input in qparam(), output in qparam(), plane in 1usize..100, planes in 1usize..40, seed in any::<u64>()) {
        let mut rng = fastrand::Rng::with_seed(seed);
        let x: Vec<i8> = (0..plane * planes).map(|_| rng.i8(..)).collect();
        // Dequantize, average in f32, quantize: the float graph onnxruntime runs.
        let want: Vec<i8> = x.chunks(plane).map(|p| {
            let mut sum = 0f32;
            for &v in p {
                sum += (v as i32 - input.zero_i8()) as f32 * input.scale;
            }
            let v = (sum / plane as f32 / output.scale).round_ties_even();
            (v as i64 + output.zero_i8() as i64).clamp(-128, 127) as i8
        }).collect();
        prop_assert_eq!(QGlobalAvgPool { input, output }.run(&x, plane), want);
    }

    #[test]
    fn qavg_pool_is_bit_exact(
        input in qparam(), output in qparam(), (h, w) in (1usize..12, 1usize..12), planes in 1usize..4,
        kernel in [1usize..5, 1usize..5], strides in [1usize..4, 1usize..4], pads in [0usize..3, 0usize..3, 0usize..3, 0usize..3],
        count_include_pad in any::<bool>(), seed in any::<u64>(),
    ) {
        let window = Window { kernel, strides, pads, count_include_pad };
        prop_assume!(window.output_hw([h, w]).is_ok());
        let [oh, ow] = window.output_hw([h, w]).unwrap();
        let mut rng = fastrand::Rng::with_seed(seed);
        let x: Vec<i8> = (0..planes * h * w).map(|_| rng.i8(..)).collect();
        // Dequantize, average the window in f32 (the divisor per count_include_pad), quantize.
        let mut want = Vec::new();
        for p in 0..planes {
            for oy in 0..oh {
                for ox in 0..ow {
                    let (mut sum, mut n) = (0f32, 0usize);
                    for ky in 0..kernel[0] {
                        for kx in 0..kernel[1] {
                            let (iy, ix) = ((oy * strides[0] + ky) as i64 - pads[0] as i64, (ox * strides[1] + kx) as i64 - pads[1] as i64);
                            if iy >= 0 && ix >= 0 && (iy as usize) < h && (ix as usize) < w {
                                sum += (x[p * h * w + iy as usize * w + ix as usize] as i32 - input.zero_i8()) as f32 * input.scale;
                                n += 1;
                            }
                        }
                    }
                    let divisor = if count_include_pad { kernel[0] * kernel[1] } else { n.max(1) };
                    let v = (sum / divisor as f32 / output.scale).round_ties_even();
                    want.push((v as i64 + output.zero_i8() as i64).clamp(-128, 127) as i8);
                }
            }
        }
        prop_assert_eq!(QAvgPool { input, output, window }.run(&x, [h, w]).unwrap(), want);
    }
}
