//! `QAdd`: the requantized sum of two int8 tensors of one shape (ResNet
//! residuals), with the ReLU/ReLU6 that follows folded into the clamp:
//! `y = clamp(round((a - za) * sa / sy + (b - zb) * sb / sy) + zy)`.

use super::requant::{self, Activation, QParam, output_range, round_half_even};
use tract_onnx::prelude::*;
use tract_onnx::tract_core::internal::*;

#[derive(Debug, Clone, PartialEq)]
pub struct QAdd {
    pub a: QParam,
    pub b: QParam,
    pub output: QParam,
    pub activation: Activation,
}

impl QAdd {
    pub fn run(&self, a: &[i8], b: &[i8]) -> Vec<i8> {
        let mut out = vec![0i8; a.len().min(b.len())];
        self.run_into(a, b, &mut out);
        out
    }

    /// `run`, into `out` (as long as the shorter operand).
    pub fn run_into(&self, a: &[i8], b: &[i8], out: &mut [i8]) {
        let (ka, kb) = (self.a.scale / self.output.scale, self.b.scale / self.output.scale);
        let (za, zb) = (self.a.zero_i8(), self.b.zero_i8());
        let zy = self.output.zero_i8();
        let (lo, hi) = output_range(&self.output, self.activation);
        let (lo_f, hi_f) = ((lo - zy) as f32, (hi - zy) as f32);
        #[allow(unused_mut)] // assigned only on x86-64
        let mut done = 0;
        #[cfg(target_arch = "x86_64")]
        if super::cpu::avx2() {
            done = unsafe { add_avx2(a, b, [za, zb, zy], [ka, kb, lo_f, hi_f], out) };
        }
        for ((o, &x), &y) in out[done..].iter_mut().zip(&a[done..]).zip(&b[done..]) {
            let v = ((x as i32 - za) as f32 * ka + (y as i32 - zb) as f32 * kb).max(lo_f).min(hi_f);
            *o = (round_half_even(v) as i32 + zy) as i8;
        }
    }
}

/// Eight at a time, the same operations in the same order (no fused
/// multiply-add: it would round differently); returns how many it wrote.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn add_avx2(
    a: &[i8],
    b: &[i8],
    [za, zb, zy]: [i32; 3],
    [ka, kb, lo, hi]: [f32; 4],
    out: &mut [i8],
) -> usize {
    use std::arch::x86_64::*;
    let n = out.len() / 8 * 8;
    unsafe {
        let (vza, vzb, vzy) = (_mm256_set1_epi32(za), _mm256_set1_epi32(zb), _mm256_set1_epi32(zy));
        let (vka, vkb, vlo, vhi) =
            (_mm256_set1_ps(ka), _mm256_set1_ps(kb), _mm256_set1_ps(lo), _mm256_set1_ps(hi));
        for i in (0..n).step_by(8) {
            let x = _mm256_cvtepi8_epi32(_mm_loadl_epi64(a.as_ptr().add(i) as *const __m128i));
            let y = _mm256_cvtepi8_epi32(_mm_loadl_epi64(b.as_ptr().add(i) as *const __m128i));
            let fx = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(x, vza)), vka);
            let fy = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(y, vzb)), vkb);
            let v = _mm256_min_ps(_mm256_max_ps(_mm256_add_ps(fx, fy), vlo), vhi);
            let q = _mm256_add_epi32(_mm256_cvtps_epi32(v), vzy);
            let w = _mm_packs_epi32(_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1));
            _mm_storel_epi64(out.as_mut_ptr().add(i) as *mut __m128i, _mm_packs_epi16(w, w));
        }
    }
    n
}

// Scales are finite (checked when the op is built), so equality is reflexive.
impl Eq for QAdd {}

impl Op for QAdd {
    fn name(&self) -> StaticName {
        "edgeinfer.QAdd".into()
    }

    op_as_typed_op!();
}

impl EvalOp for QAdd {
    op_out_of_plan!();

    fn eval(&self, _ctx: &EvalContext, inputs: TVec<TValue>) -> TractResult<TVec<TValue>> {
        anyhow::ensure!(inputs[0].shape() == inputs[1].shape(), "QAdd: operands of different shapes");
        let a = self.a.qtype.to_i8(requant::bytes_of(&inputs[0])?);
        let b = self.b.qtype.to_i8(requant::bytes_of(&inputs[1])?);
        let y = requant::tensor_with(self.output.qtype, inputs[0].shape(), |y| {
            self.run_into(&a, &b, y);
            Ok(())
        })?;
        Ok(tvec!(y.into_tvalue()))
    }
}

impl TypedOp for QAdd {
    fn output_facts(&self, inputs: &[&TypedFact]) -> TractResult<TVec<TypedFact>> {
        anyhow::ensure!(inputs[0].shape == inputs[1].shape, "QAdd: operands of different shapes");
        Ok(tvec!(self.output.qtype.datum_type().fact(inputs[0].shape.clone())))
    }

    as_op!();
}
