//! A depthwise convolution one channel at a time, 16 output pixels a step,
//! for layers with few channels: vww's first depthwise layer has 8, so the
//! channels-last kernels (`depthwise.rs`) fill half of each 16-lane
//! register with padding and pay two transposes around it. This one reads
//! the padded NCHW plane of `x - zx` that `patches::widen_padded` makes
//! (the layout of the ops around it, so no transpose) and needs stride 1:
//! 16 adjacent output pixels then read 16 adjacent inputs at every tap.
//! Which layout a layer runs is measured at load (`choice.rs`).
//!
//! Per pair of taps, `vpmaddwd` of the two taps' inputs interleaved
//! (`unpacklo/hi`) against the pair of weights adds both products per
//! pixel in one i32 lane; the lanes then hold pixels 0-3, 8-11 (`lo`) and
//! 4-7, 12-15 (`hi`), put back in order by a 128-bit permute.

// Built everywhere, run only where `Filters::fits` (x86-64 with AVX2).
#![cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]

use super::patches::widen_padded;
use super::requant::{output_range, per, requantize_row};
use super::spec::ConvSpec;

/// Output pixels one step computes: 16 i16 lanes, one AVX2 register.
const STEP: usize = 16;

/// The filters of every channel, fixed when the op is built.
#[derive(Debug, Clone, PartialEq)]
pub struct Filters {
    /// Where each tap reads, from the output pixel's window origin in the
    /// padded plane; an odd count gets a last tap of weight 0 at offset 0.
    offsets: Vec<usize>,
    /// Per channel and pair of taps: `(w0 - zw) | (w1 - zw) << 16`.
    pairs: Vec<u32>,
    bias: Vec<i32>,
    multipliers: Vec<f32>,
}

impl Filters {
    /// Whether this layout can run the layer here (stride 1, AVX2).
    pub fn fits(spec: &ConvSpec) -> bool {
        spec.geometry.strides == [1, 1] && super::cpu::avx2()
    }

    pub fn new(spec: &ConvSpec) -> Filters {
        let g = &spec.geometry;
        let wp = g.width + g.pads[1] + g.pads[3];
        let taps = g.kernel[0] * g.kernel[1];
        let mut offsets: Vec<usize> = (0..g.kernel[0])
            .flat_map(|ky| (0..g.kernel[1]).map(move |kx| ky * g.dilations[0] * wp + kx * g.dilations[1]))
            .collect();
        if taps % 2 == 1 {
            offsets.push(0);
        }
        let mut pairs = Vec::with_capacity(g.in_channels * offsets.len() / 2);
        for c in 0..g.in_channels {
            let zw = per(&spec.weight_zero, c);
            let w = |t: usize| {
                if t < taps { (spec.weights[c * taps + t] as i32 - zw) as i16 as u16 as u32 } else { 0 }
            };
            pairs.extend((0..offsets.len() / 2).map(|p| w(2 * p) | w(2 * p + 1) << 16));
        }
        let scale = |c: usize| spec.input.scale * per(&spec.weight_scale, c) / spec.output.scale;
        Filters {
            offsets,
            pairs,
            bias: (0..g.in_channels).map(|c| per(&spec.bias, c)).collect(),
            multipliers: (0..g.in_channels).map(scale).collect(),
        }
    }

    /// Convolves one NCHW image into `out` (`channels x oh x ow`).
    pub fn run(&self, spec: &ConvSpec, image: &[i8], plane: &mut Vec<i16>, out: &mut [i8]) {
        let g = &spec.geometry;
        let [oh, ow] = g.output_hw().expect("checked when the op was built");
        let (hp, wp) = (g.height + g.pads[0] + g.pads[2], g.width + g.pads[1] + g.pads[3]);
        widen_padded(g, image, spec.input.zero_i8(), plane);
        // The last step of a row reads up to 15 pixels past it: room for
        // the last row of the last channel.
        plane.resize(plane.len() + STEP, 0);
        let (lo, hi) = output_range(&spec.output, spec.activation);
        let zy = spec.output.zero_i8();
        let mut sums = vec![0i32; ow.div_ceil(STEP) * STEP];
        let pairs_per_channel = self.offsets.len() / 2;
        for c in 0..g.in_channels {
            let channel = &plane[c * hp * wp..];
            let pairs = &self.pairs[c * pairs_per_channel..(c + 1) * pairs_per_channel];
            for oy in 0..oh {
                // SAFETY: `fits` checked AVX2; `row_sums` checks its reads.
                unsafe { row_sums_avx2(channel, oy * wp, &self.offsets, pairs, &mut sums) };
                let dst = &mut out[(c * oh + oy) * ow..(c * oh + oy + 1) * ow];
                requantize_row(&sums[..ow], self.bias[c], self.multipliers[c], zy, lo, hi, dst);
            }
        }
    }
}

/// The i32 sums of one output row, `sums.len() / 16` steps from `origin`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn row_sums_avx2(plane: &[i16], origin: usize, offsets: &[usize], pairs: &[u32], sums: &mut [i32]) {
    use std::arch::x86_64::*;
    let furthest = origin + sums.len() + offsets.iter().max().copied().unwrap_or(0);
    assert!(furthest <= plane.len() && pairs.len() * 2 == offsets.len() && sums.len().is_multiple_of(STEP));
    unsafe {
        for (step, out) in sums.chunks_exact_mut(STEP).enumerate() {
            let base = plane.as_ptr().add(origin + step * STEP);
            let (mut lo, mut hi) = (_mm256_setzero_si256(), _mm256_setzero_si256());
            for (taps, &w) in offsets.chunks_exact(2).zip(pairs) {
                let a = _mm256_loadu_si256(base.add(taps[0]) as *const __m256i);
                let b = _mm256_loadu_si256(base.add(taps[1]) as *const __m256i);
                let w = _mm256_set1_epi32(w as i32);
                lo = _mm256_add_epi32(lo, _mm256_madd_epi16(_mm256_unpacklo_epi16(a, b), w));
                hi = _mm256_add_epi32(hi, _mm256_madd_epi16(_mm256_unpackhi_epi16(a, b), w));
            }
            let o = out.as_mut_ptr() as *mut __m256i;
            _mm256_storeu_si256(o, _mm256_permute2x128_si256(lo, hi, 0x20)); // pixels 0-7
            _mm256_storeu_si256(o.add(1), _mm256_permute2x128_si256(lo, hi, 0x31)); // 8-15
        }
    }
}

#[cfg(not(target_arch = "x86_64"))]
unsafe fn row_sums_avx2(_: &[i16], _: usize, _: &[usize], _: &[u32], _: &mut [i32]) {
    unreachable!("Filters::fits is false without AVX2")
}
