//! `FDepthwise`: the f32 twin of `QDepthwise`, for float models (and the
//! float twins users compare an INT8 model with). tract 0.23 runs an f32
//! depthwise convolution element by element: 31 us for one kws layer (64
//! channels, 25 x 5, 3 x 3), 59% of the model, where the same layer in INT8
//! takes 5. This op computes it the way `QDepthwise` does: the image
//! widened once into a padded channels-last plane, eight channels per
//! register, each tap one load and one fused multiply-add, the bias first
//! and the ReLU/ReLU6/Clip bounds last, NCHW at its boundary through 8 x 8
//! transposes in registers.
//!
//! Float sums depend on their order: results match tract's and
//! onnxruntime's within rounding, not bit for bit (the tests bound the
//! difference).

use super::patches::Geometry;
#[cfg(target_arch = "x86_64")]
use super::transpose::tiles;
use std::sync::Arc;
use tract_onnx::prelude::*;
use tract_onnx::tract_core::internal::*;

/// Channels one kernel step computes: 8 f32 lanes, one AVX register.
const BLOCK: usize = 8;

/// What the op computes: the ONNX Conv (group = channels) and the
/// activation after it, as bounds.
#[derive(Debug, Clone, PartialEq)]
pub struct FloatDepthwiseSpec {
    /// `in_channels == out_channels`; height and width from the typed model.
    pub geometry: Geometry,
    /// `[channels, kh * kw]`.
    pub weights: Vec<f32>,
    /// One per channel.
    pub bias: Vec<f32>,
    /// The activation as a clamp: `[-inf, inf]` for none, `[0, inf]` ReLU.
    pub lo: f32,
    pub hi: f32,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kernel {
    Portable,
    #[cfg(target_arch = "x86_64")]
    Avx2Fma,
}

impl Kernel {
    fn available() -> Vec<Kernel> {
        #[allow(unused_mut)] // pushed to only on x86-64
        let mut kernels = Vec::new();
        #[cfg(target_arch = "x86_64")]
        if super::cpu::avx2() && std::is_x86_feature_detected!("fma") {
            kernels.push(Kernel::Avx2Fma);
        }
        kernels.push(Kernel::Portable);
        kernels
    }

    fn name(self) -> &'static str {
        match self {
            Kernel::Portable => "edgeinfer portable f32",
            #[cfg(target_arch = "x86_64")]
            Kernel::Avx2Fma => "edgeinfer avx2 fma f32",
        }
    }
}

#[derive(Debug, Clone)]
pub struct FDepthwise {
    pub spec: Arc<FloatDepthwiseSpec>,
    kernel: Kernel,
    /// Channels rounded up to `BLOCK`.
    channels: usize,
    /// `[block][tap][BLOCK]`, zero past the last channel.
    weights: Arc<Vec<f32>>,
    /// Rounded up like the channels, zero past the last.
    bias: Arc<Vec<f32>>,
    /// Where input pixel `y * width + x` goes in the padded plane.
    pixel_offsets: Arc<Vec<usize>>,
    /// Where tap `t` reads, from the output pixel's window origin.
    tap_offsets: Arc<Vec<usize>>,
}

impl PartialEq for FDepthwise {
    fn eq(&self, other: &Self) -> bool {
        self.spec == other.spec
    }
}

// Weights, bias and bounds come from the model's constants; a NaN among
// them would only make the op unequal to itself, never wrong.
impl Eq for FDepthwise {}

impl FDepthwise {
    pub fn new(spec: FloatDepthwiseSpec) -> TractResult<FDepthwise> {
        FDepthwise::build(spec, Kernel::available()[0])
    }

    /// The op once per kernel this host can run (the tests compare them all).
    pub fn every_kernel(spec: FloatDepthwiseSpec) -> TractResult<Vec<FDepthwise>> {
        Kernel::available().into_iter().map(|kernel| FDepthwise::build(spec.clone(), kernel)).collect()
    }

    fn build(spec: FloatDepthwiseSpec, kernel: Kernel) -> TractResult<FDepthwise> {
        let g = spec.geometry;
        g.output_hw()?;
        let c = g.in_channels;
        let taps = g.kernel[0] * g.kernel[1];
        anyhow::ensure!(
            g.out_channels == c && c > 0 && spec.weights.len() == c * taps && spec.bias.len() == c,
            "FDepthwise: {} weights and {} biases for {c} channels of {taps} taps",
            spec.weights.len(),
            spec.bias.len()
        );
        let channels = c.div_ceil(BLOCK) * BLOCK;
        let mut weights = vec![0f32; channels * taps];
        for ch in 0..c {
            for t in 0..taps {
                weights[((ch / BLOCK) * taps + t) * BLOCK + ch % BLOCK] = spec.weights[ch * taps + t];
            }
        }
        let mut bias = spec.bias.clone();
        bias.resize(channels, 0.0);
        let (tap_offsets, pixel_offsets) = g.channels_last_offsets(channels);
        Ok(FDepthwise {
            spec: Arc::new(spec),
            kernel,
            channels,
            weights: Arc::new(weights),
            bias: Arc::new(bias),
            pixel_offsets: Arc::new(pixel_offsets),
            tap_offsets: Arc::new(tap_offsets),
        })
    }

    pub fn kernel_name(&self) -> &'static str {
        self.kernel.name()
    }

    /// Convolves `images` NCHW images.
    pub fn run(&self, x: &[f32], images: usize) -> TractResult<Vec<f32>> {
        let mut out = vec![0f32; images * self.spec.geometry.output_len()?];
        self.run_into(x, images, &mut out)?;
        Ok(out)
    }

    /// `run`, writing every value of `out` (`images` NCHW outputs).
    pub fn run_into(&self, x: &[f32], images: usize, out: &mut [f32]) -> TractResult<()> {
        let g = self.spec.geometry;
        let [oh, ow] = g.output_hw()?;
        let (image_len, pixels) = (g.in_channels * g.height * g.width, oh * ow);
        anyhow::ensure!(x.len() == images * image_len, "FDepthwise: input of {} values", x.len());
        anyhow::ensure!(
            out.len() == images * g.in_channels * pixels,
            "FDepthwise: output of {} values",
            out.len()
        );
        let (hp, wp) = (g.height + g.pads[0] + g.pads[2], g.width + g.pads[1] + g.pads[3]);
        let (mut plane, mut last) = (Vec::new(), vec![0f32; pixels * self.channels]);
        for (image, y) in x.chunks(image_len.max(1)).zip(out.chunks_mut(g.in_channels * pixels)) {
            plane.clear();
            plane.resize(hp * wp * self.channels, 0f32);
            to_channels_last(image, g.in_channels, &self.pixel_offsets, &mut plane);
            let origins = (0..oh).flat_map(|oy| {
                (0..ow).map(move |ox| (oy * g.strides[0] * wp + ox * g.strides[1]) * self.channels)
            });
            for (origin, dst) in origins.zip(last.chunks_exact_mut(self.channels)) {
                match self.kernel {
                    // SAFETY: chosen only where AVX2 and FMA were detected;
                    // every read is inside the plane (the window fits the
                    // padded image, checked by `output_hw`).
                    #[cfg(target_arch = "x86_64")]
                    Kernel::Avx2Fma => unsafe { self.pixel_avx2(&plane, origin, dst) },
                    Kernel::Portable => self.pixel_portable(&plane, origin, dst),
                }
            }
            to_channels_first(&last, self.channels, g.in_channels, pixels, y);
        }
        Ok(())
    }

    /// One output pixel's channels: bias, then each tap in order, clamped.
    fn pixel_portable(&self, plane: &[f32], origin: usize, dst: &mut [f32]) {
        let taps = self.tap_offsets.len();
        for (ch, d) in dst.iter_mut().enumerate() {
            let (block, lane) = (ch / BLOCK, ch % BLOCK);
            let mut acc = self.bias[ch];
            for (t, &offset) in self.tap_offsets.iter().enumerate() {
                acc =
                    plane[origin + offset + ch].mul_add(self.weights[(block * taps + t) * BLOCK + lane], acc);
            }
            *d = acc.max(self.spec.lo).min(self.spec.hi);
        }
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn pixel_avx2(&self, plane: &[f32], origin: usize, dst: &mut [f32]) {
        use std::arch::x86_64::*;
        let taps = self.tap_offsets.len();
        let (lo, hi) = (_mm256_set1_ps(self.spec.lo), _mm256_set1_ps(self.spec.hi));
        debug_assert!(self.tap_offsets.iter().all(|o| origin + o + self.channels <= plane.len()));
        for block in 0..self.channels / BLOCK {
            // SAFETY: the block's lanes of the plane at each tap (see
            // `run_into`), of the weights and bias, and of dst.
            unsafe {
                let base = plane.as_ptr().add(origin + block * BLOCK);
                let w = self.weights.as_ptr().add(block * taps * BLOCK);
                let mut acc = _mm256_loadu_ps(self.bias.as_ptr().add(block * BLOCK));
                for (t, &offset) in self.tap_offsets.iter().enumerate() {
                    acc = _mm256_fmadd_ps(
                        _mm256_loadu_ps(base.add(offset)),
                        _mm256_loadu_ps(w.add(t * BLOCK)),
                        acc,
                    );
                }
                let v = _mm256_min_ps(_mm256_max_ps(acc, lo), hi);
                _mm256_storeu_ps(dst.as_mut_ptr().add(block * BLOCK), v);
            }
        }
    }
}

/// `plane[offsets[p] + c] = x[c * pixels + p]`: an NCHW image into a
/// padded channels-last plane (rounded up to `BLOCK` lanes a pixel).
fn to_channels_last(x: &[f32], channels: usize, offsets: &[usize], plane: &mut [f32]) {
    let pixels = offsets.len();
    assert!(
        x.len() >= channels * pixels
            && offsets.iter().all(|&o| o + channels.div_ceil(BLOCK) * BLOCK <= plane.len())
    );
    #[cfg(target_arch = "x86_64")]
    if pixels >= BLOCK && super::cpu::avx2() {
        // SAFETY: AVX2 is present; the assert above bounds every access.
        return unsafe { to_channels_last_avx2(x, channels, offsets, plane) };
    }
    for (c, row) in x.chunks(pixels.max(1)).take(channels).enumerate() {
        for (&v, &o) in row.iter().zip(offsets) {
            plane[o + c] = v;
        }
    }
}

/// `y[c * pixels + p] = src[p * stride + c]`: channels-last back to NCHW.
fn to_channels_first(src: &[f32], stride: usize, channels: usize, pixels: usize, y: &mut [f32]) {
    assert!(channels <= stride && src.len() >= pixels * stride && y.len() >= channels * pixels);
    #[cfg(target_arch = "x86_64")]
    if pixels >= BLOCK && stride.is_multiple_of(BLOCK) && super::cpu::avx2() {
        // SAFETY: AVX2 is present; the assert above bounds every access.
        return unsafe { to_channels_first_avx2(src, stride, channels, pixels, y) };
    }
    for (c, row) in y.chunks_mut(pixels.max(1)).take(channels).enumerate() {
        for (p, v) in row.iter_mut().enumerate() {
            *v = src[p * stride + c];
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn to_channels_last_avx2(x: &[f32], channels: usize, offsets: &[usize], plane: &mut [f32]) {
    use std::arch::x86_64::*;
    let pixels = offsets.len();
    for c0 in (0..channels).step_by(BLOCK) {
        for p0 in tiles(pixels, BLOCK) {
            // SAFETY: rows c0.. below `channels` hold `pixels` values from
            // p0 + 8 <= pixels; each pixel's block of 8 lanes is in the plane.
            unsafe {
                let rows = std::array::from_fn(|i| match c0 + i < channels {
                    true => _mm256_loadu_ps(x.as_ptr().add((c0 + i) * pixels + p0)),
                    false => _mm256_setzero_ps(),
                });
                for (j, column) in transpose8(rows).into_iter().enumerate() {
                    _mm256_storeu_ps(plane.as_mut_ptr().add(offsets[p0 + j] + c0), column);
                }
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn to_channels_first_avx2(src: &[f32], stride: usize, channels: usize, pixels: usize, y: &mut [f32]) {
    use std::arch::x86_64::*;
    for p0 in tiles(pixels, BLOCK) {
        for c0 in (0..channels).step_by(BLOCK) {
            // SAFETY: pixels p0..p0 + 8 hold `stride` (a multiple of 8)
            // values each; the columns written are channels below `channels`.
            unsafe {
                let rows = std::array::from_fn(|i| _mm256_loadu_ps(src.as_ptr().add((p0 + i) * stride + c0)));
                for (j, column) in transpose8(rows).into_iter().enumerate().take(channels - c0) {
                    _mm256_storeu_ps(y.as_mut_ptr().add((c0 + j) * pixels + p0), column);
                }
            }
        }
    }
}

/// An 8 x 8 f32 matrix transposed: element `j` of row `i` becomes element
/// `i` of row `j` (unpacks pair rows, shuffles pair the pairs, the 128-bit
/// permutes join the halves).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
#[inline]
fn transpose8(r: [std::arch::x86_64::__m256; 8]) -> [std::arch::x86_64::__m256; 8] {
    use std::arch::x86_64::*;
    let t: [__m256; 8] = std::array::from_fn(|i| {
        let (a, b) = (r[i / 2 * 2], r[i / 2 * 2 + 1]);
        if i % 2 == 0 { _mm256_unpacklo_ps(a, b) } else { _mm256_unpackhi_ps(a, b) }
    });
    // u[4h + k]: from rows 4h..4h + 4, columns k, k + 4 (low and high lane).
    let u: [__m256; 8] = std::array::from_fn(|i| {
        let (h, k) = (i / 4, i % 4);
        let (a, b) = (t[4 * h + k / 2], t[4 * h + 2 + k / 2]);
        if k % 2 == 0 { _mm256_shuffle_ps::<0x44>(a, b) } else { _mm256_shuffle_ps::<0xEE>(a, b) }
    });
    std::array::from_fn(|j| {
        let (a, b) = (u[j % 4], u[4 + j % 4]);
        if j < 4 { _mm256_permute2f128_ps::<0x20>(a, b) } else { _mm256_permute2f128_ps::<0x31>(a, b) }
    })
}

impl Op for FDepthwise {
    fn name(&self) -> StaticName {
        "edgeinfer.FDepthwise".into()
    }

    fn info(&self) -> TractResult<Vec<String>> {
        let g = &self.spec.geometry;
        Ok(vec![format!(
            "{} channels k{:?} s{:?} d{:?} p{:?} clamp [{}, {}] on {}",
            g.in_channels,
            g.kernel,
            g.strides,
            g.dilations,
            g.pads,
            self.spec.lo,
            self.spec.hi,
            self.kernel_name()
        )])
    }

    op_as_typed_op!();
}

impl EvalOp for FDepthwise {
    op_out_of_plan!();

    fn eval(&self, _ctx: &EvalContext, inputs: TVec<TValue>) -> TractResult<TVec<TValue>> {
        let input = &inputs[0];
        let images = input.shape()[0];
        let x = input.try_as_plain_ram()?.as_slice::<f32>()?;
        let g = self.spec.geometry;
        let [oh, ow] = g.output_hw()?;
        let mut y = Tensor::zero::<f32>(&[images, g.out_channels, oh, ow])?;
        {
            let mut view = y.try_as_plain_ram_mut()?;
            self.run_into(x, images, view.as_slice_mut::<f32>()?)?;
        }
        Ok(tvec!(y.into_tvalue()))
    }
}

impl TypedOp for FDepthwise {
    fn output_facts(&self, inputs: &[&TypedFact]) -> TractResult<TVec<TypedFact>> {
        let g = self.spec.geometry;
        let shape = &inputs[0].shape;
        anyhow::ensure!(
            inputs[0].datum_type == f32::datum_type()
                && shape.rank() == 4
                && shape[1] == g.in_channels.to_dim()
                && shape[2] == g.height.to_dim()
                && shape[3] == g.width.to_dim(),
            "FDepthwise expects f32 [N, {}, {}, {}], got {:?} {shape:?}",
            g.in_channels,
            g.height,
            g.width,
            inputs[0].datum_type
        );
        let [oh, ow] = g.output_hw()?;
        Ok(tvec!(f32::fact(tvec![shape[0].clone(), g.out_channels.to_dim(), oh.to_dim(), ow.to_dim()])))
    }

    as_op!();
}
