//! `QDepthwise`: an int8 depthwise convolution (one filter per channel,
//! group = channels, any kernel size, stride, padding and dilation) with
//! bias, zero points, per-channel requantization and the ReLU/ReLU6 clamp.
//!
//! tract has no integer depthwise kernel, so without this op every
//! depthwise layer of an int8 MobileNet or DS-CNN runs in f32 between a
//! dequantize and a quantize. A depthwise layer does few multiply-adds per
//! byte it reads, so the layout decides its speed: the image is widened
//! once into a padded channels-last plane of i16 (`x - zx`, zeros in the
//! border), where every tap of every output pixel reads 16 adjacent
//! channels with one load, whatever the stride or dilation. The op keeps
//! NCHW at its boundary, like `QConv`, so it slots between the ops around
//! it; the two transposes (`transpose.rs`, 16 x 16 tiles in registers)
//! cost about as much as the convolution itself, a few microseconds a
//! layer (docs/BENCHMARKS.md).
//!
//! Kernels: AVX2 on x86-64 (`vpmaddwd` on tap pairs, requantization fused),
//! NEON on arm64 (`smlal` per tap), and a portable one; all are tested
//! bit-exact against the same scalar reference.

use super::patches::Layout;
use super::planar;
use super::requant::{output_range, per, requantize_one};
use super::spec::{ConvSpec, conv_output_facts, eval_conv};
use super::transpose;
use std::sync::Arc;
use tract_onnx::prelude::*;
use tract_onnx::tract_core::internal::*;

/// Channels one kernel step computes: 16 i16 lanes, one AVX2 register.
const BLOCK: usize = 16;

/// How a depthwise layer runs channels-last (or `Planar`): one form per
/// instruction set, timed per layer against each other (`choice.rs`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kernel {
    Portable,
    #[cfg(target_arch = "x86_64")]
    Avx2,
    /// Two blocks (32 channels) a step; the last odd block on AVX2.
    #[cfg(target_arch = "x86_64")]
    Avx512,
    /// `Avx512` with `vpdpwssd` doing `vpmaddwd` and the add in one.
    #[cfg(target_arch = "x86_64")]
    Avx512Vnni,
    #[cfg(target_arch = "aarch64")]
    Neon,
    /// NCHW, one channel at a time across 16 output pixels (`planar.rs`);
    /// never `best`: chosen per layer by measurement.
    #[cfg(target_arch = "x86_64")]
    Planar,
}

impl Kernel {
    /// Every kernel this host can run, fastest first (`EDGEINFER_AVX512=off`
    /// leaves the AVX-512 ones out, see `cpu::avx512`).
    fn available() -> Vec<Kernel> {
        let mut kernels = Vec::new();
        #[cfg(target_arch = "x86_64")]
        {
            let avx512 = super::cpu::avx512();
            if avx512.is_some_and(|a| a.vnni) {
                kernels.push(Kernel::Avx512Vnni);
            }
            if avx512.is_some() {
                kernels.push(Kernel::Avx512);
            }
            if super::cpu::avx2() {
                kernels.push(Kernel::Avx2);
            }
        }
        #[cfg(target_arch = "aarch64")]
        if std::arch::is_aarch64_feature_detected!("neon") {
            kernels.push(Kernel::Neon);
        }
        kernels.push(Kernel::Portable);
        kernels
    }

    fn best() -> Kernel {
        Kernel::available()[0]
    }

    /// Every form this build has (whether or not the host runs it).
    const ALL: &[Kernel] = &[
        Kernel::Portable,
        #[cfg(target_arch = "x86_64")]
        Kernel::Avx2,
        #[cfg(target_arch = "x86_64")]
        Kernel::Avx512,
        #[cfg(target_arch = "x86_64")]
        Kernel::Avx512Vnni,
        #[cfg(target_arch = "aarch64")]
        Kernel::Neon,
        #[cfg(target_arch = "x86_64")]
        Kernel::Planar,
    ];

    /// A short name for the kernel choices (the cache file, the fail point).
    pub fn id(self) -> &'static str {
        match self {
            Kernel::Portable => "dw_portable",
            #[cfg(target_arch = "x86_64")]
            Kernel::Avx2 => "dw_avx2",
            #[cfg(target_arch = "x86_64")]
            Kernel::Avx512 => "dw_avx512",
            #[cfg(target_arch = "x86_64")]
            Kernel::Avx512Vnni => "dw_avx512_vnni",
            #[cfg(target_arch = "aarch64")]
            Kernel::Neon => "dw_neon",
            #[cfg(target_arch = "x86_64")]
            Kernel::Planar => "planar",
        }
    }

    pub fn from_id(id: &str) -> Option<Kernel> {
        Kernel::ALL.iter().copied().find(|k| k.id() == id)
    }

    fn name(self) -> &'static str {
        match self {
            Kernel::Portable => "edgeinfer portable",
            #[cfg(target_arch = "x86_64")]
            Kernel::Avx2 => "edgeinfer avx2 i16x2",
            #[cfg(target_arch = "x86_64")]
            Kernel::Avx512 => "edgeinfer avx512 i16x2",
            #[cfg(target_arch = "x86_64")]
            Kernel::Avx512Vnni => "edgeinfer avx512 vnni i16x2",
            #[cfg(target_arch = "aarch64")]
            Kernel::Neon => "edgeinfer neon i16",
            #[cfg(target_arch = "x86_64")]
            Kernel::Planar => "edgeinfer avx2 planar i16x2",
        }
    }
}

/// Everything fixed when the op is built: the filters widened and laid out
/// per channel block, and per channel the bias and multiplier.
#[derive(Debug, Clone)]
// The AVX2 layouts (`pairs`, `lane_*`) are built everywhere, read on x86-64.
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
struct Packed {
    /// Channels rounded up to `BLOCK`.
    channels: usize,
    /// Kernel taps rounded up to even (a zero tap pairs the last one).
    taps: usize,
    /// Where input pixel `y * width + x` goes in the padded plane.
    pixel_offsets: Vec<usize>,
    /// Where tap `t` reads, in plane elements from the output pixel's
    /// window origin; the padding tap reads offset 0 with weight 0.
    tap_offsets: Vec<usize>,
    /// `[block][tap][BLOCK]` weights `w - zw`, channel order.
    weights: Vec<i16>,
    /// The AVX2 order of `weights`: per block and tap pair, the
    /// `unpacklo`/`unpackhi` interleavings of the pair (see `block_avx2`).
    pairs: Vec<i16>,
    bias: Vec<i32>,
    multipliers: Vec<f32>,
    /// `bias` and `multipliers` per block in the AVX2 accumulators' lane
    /// order: `LO` then `HI`.
    lane_bias: Vec<i32>,
    lane_multipliers: Vec<f32>,
    /// For the AVX-512 kernels, per pair of blocks: `pairs`, `lane_bias`
    /// and `lane_multipliers` of the two blocks side by side, one 256-bit
    /// half each (see `wide_layout`). Empty for the other kernels.
    wide_pairs: Vec<i16>,
    wide_bias: Vec<i32>,
    wide_multipliers: Vec<f32>,
}

impl Packed {
    /// The AVX-512 order: a 512-bit register holds block `2i` in its low
    /// half and block `2i + 1` in its high half, and `unpacklo/hi_epi16`
    /// work per 128-bit lane, so each half sees exactly the AVX2 layout of
    /// its block: the wide vectors are the two blocks' AVX2 vectors joined.
    #[cfg(target_arch = "x86_64")]
    fn with_wide_layout(mut self) -> Packed {
        /// `a0 b0 a1 b1 ...`: per pair of blocks, their vectors of `n`
        /// values (`per_block` values a block) interleaved.
        fn join<T: Copy>(values: &[T], per_block: usize, n: usize) -> Vec<T> {
            let pairs = values.len() / per_block / 2;
            (0..pairs)
                .flat_map(|i| {
                    let (a, b) = values[2 * i * per_block..(2 * i + 2) * per_block].split_at(per_block);
                    a.chunks(n).zip(b.chunks(n)).flat_map(|(x, y)| x.iter().chain(y).copied())
                })
                .collect()
        }
        self.wide_pairs = join(&self.pairs, self.taps * BLOCK, BLOCK);
        self.wide_bias = join(&self.lane_bias, BLOCK, BLOCK / 2);
        self.wide_multipliers = join(&self.lane_multipliers, BLOCK, BLOCK / 2);
        self
    }
}

#[derive(Debug, Clone)]
pub struct QDepthwise {
    pub spec: Arc<ConvSpec>,
    packed: Arc<Packed>,
    kernel: Kernel,
    /// The planar kernel's filters, when it is the one.
    planar: Option<Arc<planar::Filters>>,
    /// How the output sits in memory: channels-first, or channels-last for
    /// the pointwise convolutions after it (`giving_channels_last`).
    output_layout: Layout,
    /// How the input sits in memory: channels-first, or channels-last from
    /// the pointwise convolution before it (`taking_channels_last`).
    input_layout: Layout,
}

impl PartialEq for QDepthwise {
    fn eq(&self, other: &Self) -> bool {
        self.spec == other.spec
    }
}

// Scales are finite (checked when the op is built), so equality is reflexive.
impl Eq for QDepthwise {}

/// Lane order of the AVX2 accumulators: `unpacklo_epi16` of two 16-lane
/// vectors holds channels 0-3 and 8-11 (one pair per i32), `unpackhi`
/// channels 4-7 and 12-15.
const LO: [usize; 8] = [0, 1, 2, 3, 8, 9, 10, 11];
const HI: [usize; 8] = [4, 5, 6, 7, 12, 13, 14, 15];

/// `acc + madd(a, b)`, in two instructions or one (VNNI). Macros, not
/// functions: intrinsics inline only into a function that enables their
/// target features.
#[cfg(target_arch = "x86_64")]
macro_rules! madd_add {
    ($acc:expr, $a:expr, $b:expr) => {
        _mm512_add_epi32($acc, _mm512_madd_epi16($a, $b))
    };
}
#[cfg(target_arch = "x86_64")]
macro_rules! dpwssd {
    ($acc:expr, $a:expr, $b:expr) => {
        _mm512_dpwssd_epi32($acc, $a, $b)
    };
}

/// An AVX-512 kernel for two blocks (32 channels) of one output pixel:
/// `block_avx2` with block `2 * pair` in the low half of each register and
/// the next block in the high half (`Packed::wide_layout`).
macro_rules! avx512_pair {
    ($(#[$doc:meta])* $name:ident, $features:literal, $dot:ident) => {
        $(#[$doc])*
        #[cfg(target_arch = "x86_64")]
        #[target_feature(enable = $features)]
        unsafe fn $name(&self, plane: &[i16], at: usize, pair: usize, b: &Bounds, dst: &mut [i8]) {
            use std::arch::x86_64::*;
            let p = &*self.packed;
            let tap_pairs = p.taps / 2;
            debug_assert!(
                dst.len() == 2 * BLOCK && p.tap_offsets.iter().all(|o| at + o + 2 * BLOCK <= plane.len())
            );
            unsafe {
                let base = plane.as_ptr().add(at);
                let mut w = p.wide_pairs.as_ptr().add(pair * tap_pairs * 4 * BLOCK) as *const __m512i;
                let (mut lo, mut hi) = (_mm512_setzero_si512(), _mm512_setzero_si512());
                for taps in p.tap_offsets.chunks_exact(2) {
                    let xa = _mm512_loadu_si512(base.add(taps[0]) as *const __m512i);
                    let xb = _mm512_loadu_si512(base.add(taps[1]) as *const __m512i);
                    lo = $dot!(lo, _mm512_unpacklo_epi16(xa, xb), _mm512_loadu_si512(w));
                    hi = $dot!(hi, _mm512_unpackhi_epi16(xa, xb), _mm512_loadu_si512(w.add(1)));
                    w = w.add(2);
                }
                // Requantize exactly as `block_avx2` does, 32 lanes at once.
                let at = pair * 2 * BLOCK;
                let bias = p.wide_bias.as_ptr().add(at) as *const __m512i;
                let scale = p.wide_multipliers.as_ptr().add(at);
                let (vlo, vhi, vz) = (_mm512_set1_ps(b.lo), _mm512_set1_ps(b.hi), _mm512_set1_epi32(b.zero));
                let lo = _mm512_add_epi32(lo, _mm512_loadu_si512(bias));
                let hi = _mm512_add_epi32(hi, _mm512_loadu_si512(bias.add(1)));
                let lo = _mm512_mul_ps(_mm512_cvtepi32_ps(lo), _mm512_loadu_ps(scale));
                let hi = _mm512_mul_ps(_mm512_cvtepi32_ps(hi), _mm512_loadu_ps(scale.add(16)));
                let lo = _mm512_add_epi32(_mm512_cvtps_epi32(_mm512_min_ps(_mm512_max_ps(lo, vlo), vhi)), vz);
                let hi = _mm512_add_epi32(_mm512_cvtps_epi32(_mm512_min_ps(_mm512_max_ps(hi, vlo), vhi)), vz);
                // Per 128-bit lane, LO's four then HI's four: channels 0-7,
                // 8-15 of the first block, then of the second. The values
                // are already inside i8, so truncating to bytes is exact.
                let words = _mm512_packs_epi32(lo, hi);
                _mm256_storeu_si256(dst.as_mut_ptr() as *mut __m256i, _mm512_cvtepi16_epi8(words));
            }
        }
    };
}

impl QDepthwise {
    /// `spec.weights` is `[channels, kh * kw]`; `geometry` has as many
    /// output channels as input channels.
    pub fn new(spec: ConvSpec) -> TractResult<QDepthwise> {
        QDepthwise::build(spec, Kernel::best())
    }

    /// The kernels a layer can run on here, the host's best first: each
    /// channels-last one it has (the portable one only where it has no
    /// other), and `Planar` where it fits (`choice.rs` times them).
    pub fn kernels(spec: &ConvSpec) -> Vec<Kernel> {
        let available = Kernel::available();
        let simd: Vec<Kernel> = available.iter().copied().filter(|&k| k != Kernel::Portable).collect();
        #[allow(unused_mut)] // pushed to only on x86-64
        let mut kernels = if simd.is_empty() { vec![Kernel::Portable] } else { simd };
        #[cfg(target_arch = "x86_64")]
        if planar::Filters::fits(spec) {
            kernels.push(Kernel::Planar);
        }
        #[cfg(not(target_arch = "x86_64"))]
        let _ = spec;
        kernels
    }

    /// On `kernel`, one of `kernels`.
    pub fn on(spec: ConvSpec, kernel: Kernel) -> TractResult<QDepthwise> {
        #[cfg(target_arch = "x86_64")]
        if kernel == Kernel::Planar {
            anyhow::ensure!(
                planar::Filters::fits(&spec),
                "QDepthwise: the planar kernel does not fit this layer"
            );
        }
        QDepthwise::build(spec, kernel)
    }

    /// The op once per kernel this host can run (the tests compare them all).
    pub fn every_kernel(spec: ConvSpec) -> TractResult<Vec<QDepthwise>> {
        #[allow(unused_mut)] // pushed to only on x86-64
        let mut kernels = Kernel::available();
        #[cfg(target_arch = "x86_64")]
        if planar::Filters::fits(&spec) {
            kernels.push(Kernel::Planar);
        }
        kernels.into_iter().map(|kernel| QDepthwise::build(spec.clone(), kernel)).collect()
    }

    fn build(spec: ConvSpec, kernel: Kernel) -> TractResult<QDepthwise> {
        let g = spec.geometry;
        g.output_hw()?;
        let c = g.in_channels;
        let taps = g.kernel[0] * g.kernel[1];
        anyhow::ensure!(
            g.out_channels == c && c > 0 && spec.weights.len() == c * taps,
            "QDepthwise: {} weights for {c} channels of {taps} taps",
            spec.weights.len()
        );
        let channels = c.div_ceil(BLOCK) * BLOCK;
        let (mut tap_offsets, pixel_offsets) = g.channels_last_offsets(channels);
        if taps % 2 == 1 {
            tap_offsets.push(0);
        }
        let padded_taps = tap_offsets.len();
        let mut weights = vec![0i16; channels / BLOCK * padded_taps * BLOCK];
        for ch in 0..c {
            let zw = per(&spec.weight_zero, ch);
            for t in 0..taps {
                let (block, lane) = (ch / BLOCK, ch % BLOCK);
                weights[(block * padded_taps + t) * BLOCK + lane] =
                    (spec.weights[ch * taps + t] as i32 - zw) as i16;
            }
        }
        let mut pairs = Vec::with_capacity(weights.len());
        for block in weights.chunks(padded_taps * BLOCK) {
            for pair in block.chunks(2 * BLOCK) {
                let (a, b) = pair.split_at(BLOCK);
                for order in [LO, HI] {
                    pairs.extend(order.iter().flat_map(|&ch| [a[ch], b[ch]]));
                }
            }
        }
        let scale = |ch: usize| spec.input.scale * per(&spec.weight_scale, ch) / spec.output.scale;
        let bias: Vec<i32> = (0..channels).map(|ch| if ch < c { per(&spec.bias, ch) } else { 0 }).collect();
        let multipliers: Vec<f32> = (0..channels).map(|ch| if ch < c { scale(ch) } else { 0.0 }).collect();
        let lanes = |block: usize| LO.into_iter().chain(HI).map(move |lane| block * BLOCK + lane);
        let lane_bias = (0..channels / BLOCK).flat_map(lanes).map(|ch| bias[ch]).collect();
        let lane_multipliers = (0..channels / BLOCK).flat_map(lanes).map(|ch| multipliers[ch]).collect();
        let packed = Packed {
            channels,
            pixel_offsets,
            taps: padded_taps,
            tap_offsets,
            weights,
            pairs,
            bias,
            multipliers,
            lane_bias,
            lane_multipliers,
            wide_pairs: Vec::new(),
            wide_bias: Vec::new(),
            wide_multipliers: Vec::new(),
        };
        #[cfg(target_arch = "x86_64")]
        let packed = match kernel {
            Kernel::Avx512 | Kernel::Avx512Vnni => packed.with_wide_layout(),
            _ => packed,
        };
        #[cfg(target_arch = "x86_64")]
        let planar = (kernel == Kernel::Planar).then(|| Arc::new(planar::Filters::new(&spec)));
        #[cfg(not(target_arch = "x86_64"))]
        let planar = None;
        Ok(QDepthwise {
            spec: Arc::new(spec),
            packed: Arc::new(packed),
            kernel,
            planar,
            output_layout: Layout::ChannelsFirst,
            input_layout: Layout::ChannelsFirst,
        })
    }

    /// This op giving its output channels-last, the layout it computes
    /// in, so no transpose back: not on the planar kernel, which computes
    /// channels-first.
    pub fn giving_channels_last(&self) -> Option<QDepthwise> {
        self.planar.is_none().then(|| QDepthwise { output_layout: Layout::ChannelsLast, ..self.clone() })
    }

    /// This op reading its input channels-last: its plane is then widened
    /// pixel by pixel, no transpose (not on the planar kernel).
    pub fn taking_channels_last(&self) -> Option<QDepthwise> {
        self.planar.is_none().then(|| QDepthwise { input_layout: Layout::ChannelsLast, ..self.clone() })
    }

    /// Convolves `images` NCHW images held as i8-domain values.
    pub fn run(&self, x: &[i8], images: usize) -> TractResult<Vec<i8>> {
        let mut out = vec![0i8; images * self.spec.geometry.output_len()?];
        self.run_into(x, images, &mut out)?;
        Ok(out)
    }

    /// `run`, writing every value of `out` (`images` outputs, NCHW or, if
    /// the op is `giving_channels_last`, NHWC).
    pub fn run_into(&self, x: &[i8], images: usize, out: &mut [i8]) -> TractResult<()> {
        let g = self.spec.geometry;
        let [oh, ow] = g.output_hw()?;
        let image_len = g.in_channels * g.height * g.width;
        anyhow::ensure!(x.len() == images * image_len, "QDepthwise: input of {} values", x.len());
        let pixels = oh * ow;
        anyhow::ensure!(
            out.len() == images * g.in_channels * pixels,
            "QDepthwise: output of {} values",
            out.len()
        );
        let channels_last = self.output_layout == Layout::ChannelsLast;
        if let Some(filters) = &self.planar {
            anyhow::ensure!(!channels_last, "QDepthwise: a channels-last output from the planar kernel");
            let mut plane = Vec::new();
            for (image, y) in x.chunks(image_len.max(1)).zip(out.chunks_mut(g.in_channels * pixels)) {
                filters.run(&self.spec, image, &mut plane, y);
            }
            return Ok(());
        }
        // Channels-last with whole blocks, the output is written in place;
        // otherwise through `last`, `pixels x packed.channels`.
        let direct = channels_last && self.packed.channels == g.in_channels;
        let (mut plane, mut last) =
            (Vec::new(), vec![0i8; if direct { 0 } else { pixels * self.packed.channels }]);
        for (image, y) in x.chunks(image_len.max(1)).zip(out.chunks_mut(g.in_channels * pixels)) {
            self.widen_channels_last(image, &mut plane);
            if direct {
                self.convolve(&plane, [oh, ow], y);
                continue;
            }
            self.convolve(&plane, [oh, ow], &mut last);
            if channels_last {
                // The lanes past the last channel of each pixel dropped.
                for (src, dst) in
                    last.chunks_exact(self.packed.channels).zip(y.chunks_exact_mut(g.in_channels))
                {
                    dst.copy_from_slice(&src[..g.in_channels]);
                }
                continue;
            }
            // Back to NCHW, the layout of the ops around this one.
            transpose::to_channels_first(&last, self.packed.channels, g.in_channels, pixels, y);
        }
        Ok(())
    }

    /// The image as a padded `[hp][wp][channels]` plane of `x - zx`, zero
    /// in the border, so that padded taps add exactly nothing (lanes past
    /// the last channel meet zero weights).
    fn widen_channels_last(&self, x: &[i8], plane: &mut Vec<i16>) {
        let g = self.spec.geometry;
        let hp = g.height + g.pads[0] + g.pads[2];
        let wp = g.width + g.pads[1] + g.pads[3];
        plane.clear();
        plane.resize(hp * wp * self.packed.channels, 0);
        let zero = self.spec.input.zero_i8();
        if self.input_layout == Layout::ChannelsLast {
            let c = g.in_channels;
            for (pixel, &at) in x.chunks_exact(c).zip(self.packed.pixel_offsets.iter()) {
                for (d, &v) in plane[at..at + c].iter_mut().zip(pixel) {
                    *d = (v as i32 - zero) as i16;
                }
            }
            return;
        }
        transpose::widen_to_channels_last(x, g.in_channels, &self.packed.pixel_offsets, zero, plane);
    }

    /// Every output pixel, channels last: `out[p * channels + ch]`.
    fn convolve(&self, plane: &[i16], [oh, ow]: [usize; 2], out: &mut [i8]) {
        let g = self.spec.geometry;
        let channels = self.packed.channels;
        let wp = g.width + g.pads[1] + g.pads[3];
        let origins = (0..oh)
            .flat_map(|oy| (0..ow).map(move |ox| (oy * g.strides[0] * wp + ox * g.strides[1]) * channels));
        let (lo, hi) = output_range(&self.spec.output, self.spec.activation);
        let zy = self.spec.output.zero_i8();
        let bounds = Bounds { zero: zy, lo: (lo - zy) as f32, hi: (hi - zy) as f32 };
        let blocks = channels / BLOCK;
        for (origin, dst) in origins.zip(out.chunks_mut(channels)) {
            #[cfg(target_arch = "x86_64")]
            let first = self.block_pairs(plane, origin, &bounds, dst);
            #[cfg(not(target_arch = "x86_64"))]
            let first = 0;
            for block in first..blocks {
                let at = origin + block * BLOCK;
                let dst = &mut dst[block * BLOCK..(block + 1) * BLOCK];
                match self.kernel {
                    #[cfg(target_arch = "x86_64")]
                    // SAFETY: chosen only where AVX2 (implied by AVX-512)
                    // was detected; every read is inside the plane (the
                    // window fits the padded image, checked by `output_hw`).
                    Kernel::Avx2 | Kernel::Avx512 | Kernel::Avx512Vnni => unsafe {
                        self.block_avx2(plane, at, block, &bounds, dst)
                    },
                    #[cfg(target_arch = "aarch64")]
                    // SAFETY: as above, where NEON was detected.
                    Kernel::Neon => unsafe { self.block_neon(plane, at, block, &bounds, dst) },
                    Kernel::Portable => self.block_portable(plane, at, block, &bounds, dst),
                    #[cfg(target_arch = "x86_64")]
                    Kernel::Planar => unreachable!("the planar kernel runs in `run`, not per pixel"),
                }
            }
        }
    }

    /// On the AVX-512 kernels, the pixel's blocks two at a time; returns
    /// the first block left (the odd last one, or all on other kernels).
    #[cfg(target_arch = "x86_64")]
    fn block_pairs(&self, plane: &[i16], origin: usize, bounds: &Bounds, dst: &mut [i8]) -> usize {
        if !matches!(self.kernel, Kernel::Avx512 | Kernel::Avx512Vnni) {
            return 0;
        }
        let pairs = self.packed.channels / BLOCK / 2;
        for pair in 0..pairs {
            let at = origin + pair * 2 * BLOCK;
            let dst = &mut dst[pair * 2 * BLOCK..(pair + 1) * 2 * BLOCK];
            // SAFETY: chosen only where AVX-512 F and BW (and VNNI for that
            // kernel) were detected; reads as for AVX2.
            match self.kernel {
                Kernel::Avx512Vnni => unsafe { self.pair_avx512_vnni(plane, at, pair, bounds, dst) },
                _ => unsafe { self.pair_avx512(plane, at, pair, bounds, dst) },
            }
        }
        2 * pairs
    }

    fn block_weights(&self, block: usize) -> &[i16] {
        let len = self.packed.taps * BLOCK;
        &self.packed.weights[block * len..(block + 1) * len]
    }

    fn block_portable(&self, plane: &[i16], at: usize, block: usize, bounds: &Bounds, dst: &mut [i8]) {
        let mut acc = [0i32; BLOCK];
        for (&offset, w) in self.packed.tap_offsets.iter().zip(self.block_weights(block).chunks(BLOCK)) {
            for ((a, &x), &w) in acc.iter_mut().zip(&plane[at + offset..at + offset + BLOCK]).zip(w) {
                *a += x as i32 * w as i32;
            }
        }
        self.requantize(block, &acc, bounds, dst);
    }

    /// One block of accumulators in channel order, one value at a time.
    fn requantize(&self, block: usize, acc: &[i32; BLOCK], b: &Bounds, dst: &mut [i8]) {
        let p = &self.packed;
        for (lane, (d, &a)) in dst.iter_mut().zip(acc).enumerate() {
            let ch = block * BLOCK + lane;
            *d = requantize_one(a, p.bias[ch], p.multipliers[ch], b.zero, b.lo, b.hi);
        }
    }

    /// Tap pairs: the two taps' 16 channels interleaved (`unpacklo/hi`)
    /// make `vpmaddwd` add both products per channel in one i32 lane; the
    /// interleaved accumulators hold channels in `LO`/`HI` order, which
    /// `packs_epi32` restores to channel order while narrowing.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2")]
    unsafe fn block_avx2(&self, plane: &[i16], at: usize, block: usize, b: &Bounds, dst: &mut [i8]) {
        use std::arch::x86_64::*;
        let p = &*self.packed;
        let pairs = p.taps / 2;
        debug_assert!(dst.len() == BLOCK && p.tap_offsets.iter().all(|o| at + o + BLOCK <= plane.len()));
        unsafe {
            let base = plane.as_ptr().add(at);
            let mut w = p.pairs.as_ptr().add(block * pairs * 2 * BLOCK) as *const __m256i;
            let (mut lo, mut hi) = (_mm256_setzero_si256(), _mm256_setzero_si256());
            for pair in p.tap_offsets.chunks_exact(2) {
                let xa = _mm256_loadu_si256(base.add(pair[0]) as *const __m256i);
                let xb = _mm256_loadu_si256(base.add(pair[1]) as *const __m256i);
                lo = _mm256_add_epi32(
                    lo,
                    _mm256_madd_epi16(_mm256_unpacklo_epi16(xa, xb), _mm256_loadu_si256(w)),
                );
                hi = _mm256_add_epi32(
                    hi,
                    _mm256_madd_epi16(_mm256_unpackhi_epi16(xa, xb), _mm256_loadu_si256(w.add(1))),
                );
                w = w.add(2);
            }
            // Requantize: the same f32 operations as `requantize_one`, on
            // the bias and multipliers stored in the accumulators' order.
            let at = block * BLOCK;
            let bias = p.lane_bias.as_ptr().add(at) as *const __m256i;
            let scale = p.lane_multipliers.as_ptr().add(at);
            let (vlo, vhi, vz) = (_mm256_set1_ps(b.lo), _mm256_set1_ps(b.hi), _mm256_set1_epi32(b.zero));
            let lo = _mm256_add_epi32(lo, _mm256_loadu_si256(bias));
            let hi = _mm256_add_epi32(hi, _mm256_loadu_si256(bias.add(1)));
            let lo = _mm256_mul_ps(_mm256_cvtepi32_ps(lo), _mm256_loadu_ps(scale));
            let hi = _mm256_mul_ps(_mm256_cvtepi32_ps(hi), _mm256_loadu_ps(scale.add(8)));
            let lo = _mm256_add_epi32(_mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(lo, vlo), vhi)), vz);
            let hi = _mm256_add_epi32(_mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(hi, vlo), vhi)), vz);
            // Per 128-bit lane: LO's four then HI's four, channels 0-7 | 8-15.
            let words = _mm256_packs_epi32(lo, hi);
            let bytes = _mm_packs_epi16(_mm256_castsi256_si128(words), _mm256_extracti128_si256(words, 1));
            _mm_storeu_si128(dst.as_mut_ptr() as *mut __m128i, bytes);
        }
    }

    avx512_pair!(
        /// Two blocks at once: the AVX2 kernel on 512-bit registers.
        pair_avx512,
        "avx512f,avx512bw",
        madd_add
    );
    avx512_pair!(
        /// `pair_avx512` with VNNI's `vpdpwssd` (multiply pairs, add both
        /// products and the accumulator) in place of `vpmaddwd` + `vpaddd`.
        pair_avx512_vnni,
        "avx512f,avx512bw,avx512vnni",
        dpwssd
    );

    /// Per tap, `smlal`/`smlal2` widen and accumulate 16 channels.
    #[cfg(target_arch = "aarch64")]
    #[target_feature(enable = "neon")]
    unsafe fn block_neon(&self, plane: &[i16], at: usize, block: usize, b: &Bounds, dst: &mut [i8]) {
        use std::arch::aarch64::*;
        let p = &*self.packed;
        debug_assert!(dst.len() == BLOCK && p.tap_offsets.iter().all(|o| at + o + BLOCK <= plane.len()));
        let mut acc = [0i32; BLOCK];
        unsafe {
            let base = plane.as_ptr().add(at);
            let w = self.block_weights(block).as_ptr();
            let mut a = [vdupq_n_s32(0); 4];
            for (t, &offset) in p.tap_offsets.iter().enumerate() {
                for half in 0..2 {
                    let x = vld1q_s16(base.add(offset + half * 8));
                    let k = vld1q_s16(w.add(t * BLOCK + half * 8));
                    a[half * 2] = vmlal_s16(a[half * 2], vget_low_s16(x), vget_low_s16(k));
                    a[half * 2 + 1] = vmlal_high_s16(a[half * 2 + 1], x, k);
                }
            }
            for (i, v) in a.iter().enumerate() {
                vst1q_s32(acc.as_mut_ptr().add(i * 4), *v);
            }
        }
        self.requantize(block, &acc, b, dst);
    }

    pub fn kernel_name(&self) -> &'static str {
        self.kernel.name()
    }
}

/// The output zero point and the clamp bounds `lo - zero`, `hi - zero`.
struct Bounds {
    zero: i32,
    lo: f32,
    hi: f32,
}

impl Op for QDepthwise {
    fn name(&self) -> StaticName {
        "edgeinfer.QDepthwise".into()
    }

    fn info(&self) -> TractResult<Vec<String>> {
        let g = &self.spec.geometry;
        Ok(vec![
            format!(
                "{} channels k{:?} s{:?} d{:?} p{:?} {:?} on {}",
                g.in_channels,
                g.kernel,
                g.strides,
                g.dilations,
                g.pads,
                self.spec.activation,
                self.kernel_name()
            ) + &Layout::describe([self.input_layout, self.output_layout]),
        ])
    }

    op_as_typed_op!();
}

impl EvalOp for QDepthwise {
    op_out_of_plan!();

    fn eval(&self, _ctx: &EvalContext, inputs: TVec<TValue>) -> TractResult<TVec<TValue>> {
        eval_conv(&self.spec, &inputs, self.output_layout, |x, images, y| self.run_into(x, images, y))
    }
}

impl TypedOp for QDepthwise {
    fn output_facts(&self, inputs: &[&TypedFact]) -> TractResult<TVec<TypedFact>> {
        conv_output_facts(&self.spec, inputs, [self.input_layout, self.output_layout])
    }

    as_op!();
}
