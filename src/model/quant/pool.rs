//! `QGlobalAvgPool`: the mean of each channel of an int8 NCHW tensor (a
//! GlobalAveragePool, or an AveragePool whose window is the whole image),
//! computed as onnxruntime's QLinearAveragePool does: each value
//! dequantized to f32, summed in order, divided by the count, then
//! quantized (`round(mean / sy) + zy`). The exact integer mean would differ
//! on ties (a sum of 160 over 64 values is 2.5), and one step in a pooled
//! feature moves the MLPerf ResNet-8's softmax by up to 31 steps.

use super::requant::{self, QParam, round_half_even};
#[cfg(target_arch = "x86_64")]
use super::transpose::transpose16;
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
        let mut out = vec![0i8; x.len() / plane.max(1)];
        self.run_into(x, plane, &mut out);
        out
    }

    /// `run`, into `out` (one value per plane).
    pub fn run_into(&self, x: &[i8], plane: usize, out: &mut [i8]) {
        let (zx, sx) = (self.input.zero_i8(), self.input.scale);
        let (zy, sy) = (self.output.zero_i8(), self.output.scale);
        let mut sums = vec![0f32; out.len()];
        plane_sums(x, plane, zx, sx, &mut sums);
        for (y, sum) in out.iter_mut().zip(sums) {
            let v = (sum / plane as f32 / sy).clamp((-128 - zy) as f32, (127 - zy) as f32);
            *y = (round_half_even(v) as i32 + zy) as i8;
        }
    }
}

/// `sums[p]` = the f32 sum, in pixel order, of `(v - zx) * sx` over plane
/// `p`: onnxruntime's order of operations, so the same rounding.
fn plane_sums(x: &[i8], plane: usize, zx: i32, sx: f32, sums: &mut [f32]) {
    assert!(x.len() >= sums.len() * plane);
    #[cfg(target_arch = "x86_64")]
    if plane >= 16 && super::cpu::avx2() {
        // SAFETY: AVX2 is present; the assert above bounds every read.
        return unsafe { plane_sums_avx2(x, plane, zx, sx, sums) };
    }
    for (p, sum) in x.chunks(plane.max(1)).zip(sums) {
        *sum = p.iter().fold(0f32, |acc, &v| acc + (v as i32 - zx) as f32 * sx);
    }
}

/// 16 planes at a time, one f32 lane each, so each plane's sum keeps its
/// own order: a plane is a row of the 16 x 16 byte tiles `transpose16`
/// turns into one vector per pixel. Multiply, then add (no fused
/// multiply-add: it would round differently).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn plane_sums_avx2(x: &[i8], plane: usize, zx: i32, sx: f32, sums: &mut [f32]) {
    use std::arch::x86_64::*;
    let (z, s) = (_mm256_set1_epi32(zx), _mm256_set1_ps(sx));
    #[target_feature(enable = "avx2")]
    #[inline]
    fn add(column: __m128i, z: __m256i, s: __m256, acc: &mut [__m256; 2]) {
        let halves = [column, _mm_unpackhi_epi64(column, column)];
        for (acc, half) in acc.iter_mut().zip(halves) {
            let v = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_cvtepi8_epi32(half), z));
            *acc = _mm256_add_ps(*acc, _mm256_mul_ps(v, s));
        }
    }
    let full = plane / 16 * 16;
    for p0 in (0..sums.len()).step_by(16) {
        let live = (sums.len() - p0).min(16);
        let mut acc = [_mm256_setzero_ps(); 2];
        for i0 in (0..full).step_by(16) {
            let rows = std::array::from_fn(|r| match r < live {
                // SAFETY: plane p0 + r exists and i0 + 16 <= plane.
                true => unsafe { _mm_loadu_si128(x.as_ptr().add((p0 + r) * plane + i0) as *const __m128i) },
                false => _mm_setzero_si128(),
            });
            for column in transpose16(rows) {
                add(column, z, s, &mut acc);
            }
        }
        for i in full..plane {
            let column: [i8; 16] =
                std::array::from_fn(|r| if r < live { x[(p0 + r) * plane + i] } else { 0 });
            // SAFETY: 16 bytes read from a 16-byte array.
            add(unsafe { _mm_loadu_si128(column.as_ptr() as *const __m128i) }, z, s, &mut acc);
        }
        let mut lanes = [0f32; 16];
        // SAFETY: two 8-lane stores into 16 floats.
        unsafe {
            _mm256_storeu_ps(lanes.as_mut_ptr(), acc[0]);
            _mm256_storeu_ps(lanes.as_mut_ptr().add(8), acc[1]);
        }
        sums[p0..p0 + live].copy_from_slice(&lanes[..live]);
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
        let y = requant::tensor_with(self.output.qtype, &[shape[0], shape[1], 1, 1], |y| {
            self.run_into(&x, shape[2] * shape[3], y);
            Ok(())
        })?;
        Ok(tvec!(y.into_tvalue()))
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

/// An AveragePool window: kernel, strides, pads (top, left, bottom, right,
/// ONNX order) and whether padded positions count in the divisor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Window {
    pub kernel: [usize; 2],
    pub strides: [usize; 2],
    pub pads: [usize; 4],
    pub count_include_pad: bool,
}

impl Window {
    /// Output height and width over an `[h, w]` image (ceil_mode 0).
    pub fn output_hw(&self, [h, w]: [usize; 2]) -> TractResult<[usize; 2]> {
        let dim = |size: usize, k: usize, s: usize, p: usize| {
            anyhow::ensure!(k > 0 && s > 0 && size + p >= k, "pooling window larger than its input");
            Ok((size + p - k) / s + 1)
        };
        Ok([
            dim(h, self.kernel[0], self.strides[0], self.pads[0] + self.pads[2])?,
            dim(w, self.kernel[1], self.strides[1], self.pads[1] + self.pads[3])?,
        ])
    }
}

/// `QAvgPool`: AveragePool with any window, stride and padding over int8
/// NCHW, with the arithmetic of `QGlobalAvgPool` per output pixel (values
/// dequantized to f32 and summed in row-major order, divided by the count,
/// quantized).
#[derive(Debug, Clone, PartialEq)]
pub struct QAvgPool {
    pub input: QParam,
    pub output: QParam,
    pub window: Window,
}

impl QAvgPool {
    /// `planes` planes of `[h, w]` i8-domain values.
    pub fn run(&self, x: &[i8], [h, w]: [usize; 2]) -> TractResult<Vec<i8>> {
        let [oh, ow] = self.window.output_hw([h, w])?;
        let Window { kernel: [kh, kw], strides: [sy, sx], pads, count_include_pad } = self.window;
        let (zx, sx_scale) = (self.input.zero_i8(), self.input.scale);
        let (zy, sy_scale) = (self.output.zero_i8(), self.output.scale);
        let mut out = Vec::with_capacity(x.len() / (h * w).max(1) * oh * ow);
        for plane in x.chunks((h * w).max(1)) {
            for oy in 0..oh {
                for ox in 0..ow {
                    let (mut sum, mut count) = (0f32, 0usize);
                    for ky in 0..kh {
                        for kx in 0..kw {
                            let iy = (oy * sy + ky) as isize - pads[0] as isize;
                            let ix = (ox * sx + kx) as isize - pads[1] as isize;
                            if iy < 0 || ix < 0 || iy >= h as isize || ix >= w as isize {
                                continue;
                            }
                            sum += (plane[iy as usize * w + ix as usize] as i32 - zx) as f32 * sx_scale;
                            count += 1;
                        }
                    }
                    let divisor = if count_include_pad { kh * kw } else { count.max(1) };
                    let v = (sum / divisor as f32 / sy_scale).clamp((-128 - zy) as f32, (127 - zy) as f32);
                    out.push((round_half_even(v) as i32 + zy) as i8);
                }
            }
        }
        Ok(out)
    }
}

// Scales are finite (checked when the op is built), so equality is reflexive.
impl Eq for QAvgPool {}

impl Op for QAvgPool {
    fn name(&self) -> StaticName {
        "edgeinfer.QAvgPool".into()
    }

    op_as_typed_op!();
}

impl EvalOp for QAvgPool {
    op_out_of_plan!();

    fn eval(&self, _ctx: &EvalContext, inputs: TVec<TValue>) -> TractResult<TVec<TValue>> {
        let shape = inputs[0].shape();
        anyhow::ensure!(shape.len() == 4, "QAvgPool: input of rank {}", shape.len());
        let x = self.input.qtype.to_i8(requant::bytes_of(&inputs[0])?);
        let y = self.run(&x, [shape[2], shape[3]])?;
        let [oh, ow] = self.window.output_hw([shape[2], shape[3]])?;
        Ok(tvec!(requant::tensor(self.output.qtype, &[shape[0], shape[1], oh, ow], y)?.into_tvalue()))
    }
}

impl TypedOp for QAvgPool {
    fn output_facts(&self, inputs: &[&TypedFact]) -> TractResult<TVec<TypedFact>> {
        let shape = &inputs[0].shape;
        anyhow::ensure!(shape.rank() == 4, "QAvgPool expects NCHW, got {shape:?}");
        let [oh, ow] = self.window.output_hw([shape[2].to_usize()?, shape[3].to_usize()?])?;
        let dims: TVec<TDim> = tvec![shape[0].clone(), shape[1].clone(), oh.to_dim(), ow.to_dim()];
        Ok(tvec!(self.output.qtype.datum_type().fact(dims)))
    }

    as_op!();
}
