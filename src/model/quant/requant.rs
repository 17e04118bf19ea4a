//! The arithmetic every integer op shares: the storage types at an op's
//! boundary and the requantization of i32 accumulators to 8 bits, rounded
//! and clamped as onnxruntime (MLAS) and TFLite do it.

use tract_onnx::prelude::*;

/// The 8-bit storage type of a tensor at an op's boundary. Inside, every op
/// works on i8: a u8 value `v` with zero point `z` is the i8 value `v - 128`
/// with zero point `z - 128`, which is exact.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum QType {
    I8,
    U8,
}

impl QType {
    pub fn of(dt: DatumType) -> Option<QType> {
        match dt.unquantized() {
            DatumType::I8 => Some(QType::I8),
            DatumType::U8 => Some(QType::U8),
            _ => None,
        }
    }

    pub fn datum_type(self) -> DatumType {
        match self {
            QType::I8 => DatumType::I8,
            QType::U8 => DatumType::U8,
        }
    }

    /// What to subtract from a stored value (and its zero point) to get i8.
    pub fn offset(self) -> i32 {
        match self {
            QType::I8 => 0,
            QType::U8 => 128,
        }
    }

    /// The stored bytes of `t` as i8 values (a copy only for u8).
    pub fn to_i8<'a>(self, bytes: &'a [u8]) -> std::borrow::Cow<'a, [i8]> {
        match self {
            // Same width and alignment; i8 and u8 share every bit pattern.
            QType::I8 => std::borrow::Cow::Borrowed(unsafe {
                std::slice::from_raw_parts(bytes.as_ptr() as *const i8, bytes.len())
            }),
            QType::U8 => std::borrow::Cow::Owned(bytes.iter().map(|&b| (b ^ 0x80) as i8).collect()),
        }
    }
}

/// Quantization parameters of one tensor: real = (q - zero_point) * scale.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct QParam {
    pub scale: f32,
    /// In the stored type's domain (0..=255 for u8).
    pub zero_point: i32,
    pub qtype: QType,
}

impl QParam {
    /// The zero point in the i8 domain the kernels work in.
    pub fn zero_i8(&self) -> i32 {
        self.zero_point - self.qtype.offset()
    }

    pub fn hash_into<H: std::hash::Hasher>(&self, state: &mut H) {
        use std::hash::Hash;
        self.scale.to_bits().hash(state);
        self.zero_point.hash(state);
        self.qtype.hash(state);
    }
}

/// Element `c` of a per-channel vector, or its only element.
pub fn per<T: Copy>(v: &[T], c: usize) -> T {
    if v.len() == 1 { v[0] } else { v[c] }
}

/// An activation folded into the output clamp: quantize is monotone, so
/// `quantize(relu(x)) = max(quantize(x), quantize(0))`, and likewise for the
/// upper bound of ReLU6.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Activation {
    None,
    Relu,
    Relu6,
}

/// The i8-domain output range `[lo, hi]` and zero point of an output with
/// `out` parameters after `act`.
pub fn output_range(out: &QParam, act: Activation) -> (i32, i32) {
    let z = out.zero_i8();
    let (mut lo, mut hi) = (-128, 127);
    if act != Activation::None {
        lo = lo.max(z);
    }
    if act == Activation::Relu6 {
        hi = hi.min(round_half_even(6.0 / out.scale) as i32 + z);
    }
    (lo, hi.max(lo))
}

/// 1.5 * 2^23: adding and subtracting it rounds an f32 of magnitude below
/// 2^22 to the nearest integer, ties to even, in the current (default)
/// rounding mode, as `cvtps2dq` does in MLAS; it vectorises on every target,
/// where `f32::round_ties_even` is a libm call without SSE4.1.
const ROUND: f32 = 12_582_912.0;

#[inline(always)]
pub fn round_half_even(v: f32) -> f32 {
    (v + ROUND) - ROUND
}

/// One output row (one output channel): `out[i] = clamp(round((acc[i] +
/// bias) * scale) + zero, lo, hi)`, the clamp applied in float before the
/// rounding as MLAS does (the same result, and it keeps the rounding in
/// range). Eight at a time with AVX2 (`cvtps2dq` rounds half to even in
/// the default mode), the rest one by one.
#[inline]
pub fn requantize_row(acc: &[i32], bias: i32, scale: f32, zero: i32, lo: i32, hi: i32, out: &mut [i8]) {
    let (lo_f, hi_f) = ((lo - zero) as f32, (hi - zero) as f32);
    #[allow(unused_mut)] // assigned only on x86-64
    let mut done = 0;
    #[cfg(target_arch = "x86_64")]
    if acc.len() >= 8 && super::cpu::avx2() {
        done = unsafe { requantize_avx2(acc, bias, scale, zero, lo_f, hi_f, out) };
    }
    for (o, &a) in out[done..].iter_mut().zip(&acc[done..]) {
        *o = requantize_one(a, bias, scale, zero, lo_f, hi_f);
    }
}

/// One value of `requantize_row`, with the clamp bounds `lo - zero` and
/// `hi - zero` as f32.
#[inline(always)]
pub fn requantize_one(acc: i32, bias: i32, scale: f32, zero: i32, lo_f: f32, hi_f: f32) -> i8 {
    let v = (acc.wrapping_add(bias) as f32 * scale).max(lo_f).min(hi_f);
    (round_half_even(v) as i32 + zero) as i8
}

/// Eight sums requantized as `requantize_one` does each, the same
/// operations in the same order, packed to eight i16 (`vpackssdw`): the
/// AVX2 step every vector requantizer below is made of.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
#[inline]
fn words8(
    sums: std::arch::x86_64::__m256i,
    bias: std::arch::x86_64::__m256i,
    scale: std::arch::x86_64::__m256,
    [lo, hi]: [std::arch::x86_64::__m256; 2],
    zero: std::arch::x86_64::__m256i,
) -> std::arch::x86_64::__m128i {
    use std::arch::x86_64::*;
    let v = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(sums, bias)), scale);
    let q = _mm256_add_epi32(_mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(v, lo), hi)), zero);
    // Already in [-128, 127]: the packs do not saturate anything.
    _mm_packs_epi32(_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1))
}

/// `words8` on sixteen lanes with AVX-512, to bytes (`vpmovdb` truncates:
/// the values are already in range).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[inline]
fn bytes16(
    sums: std::arch::x86_64::__m512i,
    bias: std::arch::x86_64::__m512i,
    scale: std::arch::x86_64::__m512,
    [lo, hi]: [std::arch::x86_64::__m512; 2],
    zero: std::arch::x86_64::__m512i,
) -> std::arch::x86_64::__m128i {
    use std::arch::x86_64::*;
    let v = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(sums, bias)), scale);
    _mm512_cvtepi32_epi8(_mm512_add_epi32(_mm512_cvtps_epi32(_mm512_min_ps(_mm512_max_ps(v, lo), hi)), zero))
}

/// The first `out.len()` (at most 16) of 16 bytes into `out`.
#[cfg(target_arch = "x86_64")]
#[inline]
fn store_first(bytes: std::arch::x86_64::__m128i, out: &mut [i8]) {
    use std::arch::x86_64::*;
    let mut row = [0i8; 16];
    let dst = if out.len() == 16 { out.as_mut_ptr() } else { row.as_mut_ptr() };
    // SAFETY: 16 bytes into `out` when it holds 16, else into `row`.
    unsafe { _mm_storeu_si128(dst as *mut __m128i, bytes) };
    if out.len() < 16 {
        let n = out.len();
        out.copy_from_slice(&row[..n]);
    }
}

/// Returns how many leading values it wrote (a multiple of 8).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn requantize_avx2(
    acc: &[i32],
    bias: i32,
    scale: f32,
    zero: i32,
    lo_f: f32,
    hi_f: f32,
    out: &mut [i8],
) -> usize {
    use std::arch::x86_64::*;
    let n = acc.len().min(out.len()) / 8 * 8;
    let (vb, vs, vz) = (_mm256_set1_epi32(bias), _mm256_set1_ps(scale), _mm256_set1_epi32(zero));
    let bounds = [_mm256_set1_ps(lo_f), _mm256_set1_ps(hi_f)];
    for i in (0..n).step_by(8) {
        // SAFETY: values i..i + 8 of acc and of out (n bounds both).
        unsafe {
            let w = words8(_mm256_loadu_si256(acc.as_ptr().add(i) as *const __m256i), vb, vs, bounds, vz);
            _mm_storel_epi64(out.as_mut_ptr().add(i) as *mut __m128i, _mm_packs_epi16(w, w));
        }
    }
    n
}

/// `requantize_row` for a tile of 16 columns, straight from the tile:
/// row `i` (of `tile.len() / 16`) is output channel `channel0 + i`, its
/// first `width` (at most 16) sums go to `y[i * stride..][..width]`,
/// clamped to `[lo, hi]` around the output's `zero`. The
/// same operations as `requantize_avx2`, so the same bytes; one call a
/// tile, so the rows' loop stays in registers.
///
/// # Safety
/// The host must have AVX2; `y` must hold every row written.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
#[allow(clippy::too_many_arguments)]
pub unsafe fn requantize_tile_avx2(
    tile: &[i32],
    width: usize,
    biases: &[i32],
    scales: &[f32],
    [zero, lo, hi]: [i32; 3],
    y: &mut [i8],
    stride: usize,
) {
    use std::arch::x86_64::*;
    let bounds = [_mm256_set1_ps((lo - zero) as f32), _mm256_set1_ps((hi - zero) as f32)];
    let vz = _mm256_set1_epi32(zero);
    for (i, ((sums, &bias), &scale)) in tile.chunks_exact(16).zip(biases).zip(scales).enumerate() {
        let (vb, vs) = (_mm256_set1_epi32(bias), _mm256_set1_ps(scale));
        // SAFETY: the row's 16 sums, 8 at a time.
        let [w0, w1] = [0, 8].map(|h| {
            words8(unsafe { _mm256_loadu_si256(sums.as_ptr().add(h) as *const __m256i) }, vb, vs, bounds, vz)
        });
        store_first(_mm_packs_epi16(w0, w1), &mut y[i * stride..i * stride + width]);
    }
}

/// `requantize_tile_avx2` on one 512-bit register a row.
///
/// # Safety
/// The host must have AVX-512 F; `y` must hold every row written.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
pub unsafe fn requantize_tile_avx512(
    tile: &[i32],
    width: usize,
    biases: &[i32],
    scales: &[f32],
    [zero, lo, hi]: [i32; 3],
    y: &mut [i8],
    stride: usize,
) {
    use std::arch::x86_64::*;
    let bounds = [_mm512_set1_ps((lo - zero) as f32), _mm512_set1_ps((hi - zero) as f32)];
    let vz = _mm512_set1_epi32(zero);
    for (i, ((sums, &bias), &scale)) in tile.chunks_exact(16).zip(biases).zip(scales).enumerate() {
        // SAFETY: the row's 16 sums.
        let a = unsafe { _mm512_loadu_si512(sums.as_ptr() as *const __m512i) };
        let bytes = bytes16(a, _mm512_set1_epi32(bias), _mm512_set1_ps(scale), bounds, vz);
        store_first(bytes, &mut y[i * stride..i * stride + width]);
    }
}

/// A channels-in-lanes tile (`udot::pixel_rows`) requantized: row `p` (of
/// `rows`) is a pixel, lane `c` an output channel; its first `width` (at
/// most 16) lanes go to `y[p * stride..][..width]`, each as
/// `requantize_one(sums, biases[c], scales[c], ...)`. With AVX-512 the
/// lanes' biases and scales stay in two registers for the whole tile.
#[allow(clippy::too_many_arguments)]
pub fn requantize_lanes(
    tile: &[i32],
    rows: usize,
    width: usize,
    biases: &[i32],
    scales: &[f32],
    [zero, lo, hi]: [i32; 3],
    y: &mut [i8],
    stride: usize,
) {
    assert!(width <= 16 && tile.len() >= rows * 16 && (rows == 0 || y.len() >= (rows - 1) * stride + width));
    #[cfg(target_arch = "x86_64")]
    if biases.len() >= 16 && scales.len() >= 16 && super::cpu::avx512().is_some() {
        // SAFETY: AVX-512 F is present; 16 biases and scales are there,
        // and the assert bounds the tile and y.
        return unsafe {
            requantize_lanes_avx512(tile, rows, width, biases, scales, [zero, lo, hi], y, stride)
        };
    }
    #[cfg(target_arch = "x86_64")]
    if biases.len() >= 16 && scales.len() >= 16 && super::cpu::avx2() {
        // SAFETY: AVX2 is present; as above.
        return unsafe {
            requantize_lanes_avx2(tile, rows, width, biases, scales, [zero, lo, hi], y, stride)
        };
    }
    let (lo_f, hi_f) = ((lo - zero) as f32, (hi - zero) as f32);
    for p in 0..rows {
        for c in 0..width {
            y[p * stride + c] = requantize_one(tile[p * 16 + c], biases[c], scales[c], zero, lo_f, hi_f);
        }
    }
}

/// `requantize_lanes_avx512` in two 8-lane halves.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
#[allow(clippy::too_many_arguments)]
unsafe fn requantize_lanes_avx2(
    tile: &[i32],
    rows: usize,
    width: usize,
    biases: &[i32],
    scales: &[f32],
    [zero, lo, hi]: [i32; 3],
    y: &mut [i8],
    stride: usize,
) {
    use std::arch::x86_64::*;
    // SAFETY: 16 biases and scales (checked by the caller).
    let vb = [0, 8].map(|h| unsafe { _mm256_loadu_si256(biases.as_ptr().add(h) as *const __m256i) });
    let vs = [0, 8].map(|h| unsafe { _mm256_loadu_ps(scales.as_ptr().add(h)) });
    let bounds = [_mm256_set1_ps((lo - zero) as f32), _mm256_set1_ps((hi - zero) as f32)];
    let vz = _mm256_set1_epi32(zero);
    for p in 0..rows {
        // SAFETY: the row's 16 sums, 8 at a time (the caller's assert).
        let [w0, w1] = [0, 8].map(|h| {
            let sums = unsafe { _mm256_loadu_si256(tile.as_ptr().add(p * 16 + h) as *const __m256i) };
            words8(sums, vb[h / 8], vs[h / 8], bounds, vz)
        });
        store_first(_mm_packs_epi16(w0, w1), &mut y[p * stride..p * stride + width]);
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[allow(clippy::too_many_arguments)]
unsafe fn requantize_lanes_avx512(
    tile: &[i32],
    rows: usize,
    width: usize,
    biases: &[i32],
    scales: &[f32],
    [zero, lo, hi]: [i32; 3],
    y: &mut [i8],
    stride: usize,
) {
    use std::arch::x86_64::*;
    // SAFETY: 16 biases and scales (checked by the caller).
    let (vb, vs) =
        unsafe { (_mm512_loadu_si512(biases.as_ptr() as *const __m512i), _mm512_loadu_ps(scales.as_ptr())) };
    let bounds = [_mm512_set1_ps((lo - zero) as f32), _mm512_set1_ps((hi - zero) as f32)];
    let vz = _mm512_set1_epi32(zero);
    for p in 0..rows {
        // SAFETY: the row's 16 sums (the caller's assert).
        let sums = unsafe { _mm512_loadu_si512(tile.as_ptr().add(p * 16) as *const __m512i) };
        store_first(bytes16(sums, vb, vs, bounds, vz), &mut y[p * stride..p * stride + width]);
    }
}

/// i8-domain values back to the stored type, in place.
pub fn store(qtype: QType, data: &mut [i8]) {
    if qtype == QType::U8 {
        for v in data {
            *v ^= -128;
        }
    }
}

/// A tensor of `shape` holding i8-domain `data`, stored as `qtype`.
pub fn tensor(qtype: QType, shape: &[usize], data: Vec<i8>) -> TractResult<Tensor> {
    tensor_with(qtype, shape, |y| {
        y.copy_from_slice(&data);
        Ok(())
    })
}

/// A tensor of `shape` stored as `qtype`, its i8-domain values written by
/// `fill` straight into the tensor's own storage: an op's output built in
/// a `Vec` and copied into a tensor cost a copy and an allocation per op
/// (kws: 8% of the model's time).
pub fn tensor_with(
    qtype: QType,
    shape: &[usize],
    fill: impl FnOnce(&mut [i8]) -> TractResult<()>,
) -> TractResult<Tensor> {
    let mut t = Tensor::zero::<i8>(shape)?;
    {
        let mut view = t.try_as_plain_ram_mut()?;
        let data = view.as_slice_mut::<i8>()?;
        fill(data)?;
        store(qtype, data);
    }
    if qtype == QType::U8 {
        // Same bytes; only the declared type differs.
        unsafe { t.set_datum_type(DatumType::U8) };
    }
    Ok(t)
}

/// The stored bytes of a plain 8-bit tensor.
pub fn bytes_of(t: &Tensor) -> TractResult<&[u8]> {
    Ok(t.try_as_plain_ram()?.as_bytes())
}

/// Per-channel multiplier `input_scale * weight_scale[c] / output_scale`,
/// in that order of f32 operations, as onnxruntime computes it.
pub fn multipliers(input: &QParam, weight_scale: &[f32], output: &QParam, channels: usize) -> Vec<f32> {
    (0..channels).map(|c| input.scale * per(weight_scale, c) / output.scale).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rounding_is_half_to_even_like_cvtps2dq() {
        for (v, r) in
            [(0.5, 0.0), (1.5, 2.0), (2.5, 2.0), (-0.5, 0.0), (-1.5, -2.0), (3.49, 3.0), (-3.51, -4.0)]
        {
            assert_eq!(round_half_even(v), r, "{v}");
        }
    }

    #[test]
    fn relu_and_relu6_become_the_clamp() {
        let out = QParam { scale: 0.05, zero_point: -100, qtype: QType::I8 };
        assert_eq!(output_range(&out, Activation::None), (-128, 127));
        assert_eq!(output_range(&out, Activation::Relu), (-100, 127));
        // 6 / 0.05 = 120 steps above the zero point.
        assert_eq!(output_range(&out, Activation::Relu6), (-100, 20));
        let u = QParam { scale: 0.1, zero_point: 10, qtype: QType::U8 };
        assert_eq!(output_range(&u, Activation::Relu), (10 - 128, 127));
    }

    #[test]
    fn requantize_clamps_and_rounds_per_row() {
        let mut out = [0i8; 5];
        requantize_row(&[10, 15, -1000, 1000, 25], 0, 0.1, 3, -128, 127, &mut out);
        // 1.0, 1.5 -> 2 (even), -100 -> clamp, 100 -> 103, 2.5 -> 2
        assert_eq!(out, [4, 5, -97, 103, 5]);
        requantize_row(&[10, 15, -1000, 1000, 25], 5, 0.1, 3, 0, 50, &mut out);
        assert_eq!(out, [5, 5, 0, 50, 6]);
    }

    #[cfg(target_arch = "x86_64")]
    type TileKernel = unsafe fn(&[i32], usize, &[i32], &[f32], [i32; 3], &mut [i8], usize);

    /// The channels-in-lanes requantizers (portable, AVX2, AVX-512) write
    /// `requantize_one` of each lane with that lane's bias and scale, on
    /// every width, and nothing past it.
    #[test]
    fn lane_requantization_matches_one_value_at_a_time() {
        let mut rng = fastrand::Rng::with_seed(41);
        for case in 0..300 {
            let (rows, width, stride) = (rng.usize(1..=8), rng.usize(1..=16), 16 + rng.usize(0..5));
            let tile: Vec<i32> = (0..rows * 16).map(|_| rng.i32(-40_000..40_000)).collect();
            let biases: Vec<i32> = (0..16).map(|_| rng.i32(-5000..5000)).collect();
            let scales: Vec<f32> = (0..16).map(|_| rng.f32() * 0.02).collect();
            let zero = rng.i32(-128..128);
            let (lo, hi) = if rng.bool() { (-128, 127) } else { (zero, 127.min(zero + rng.i32(0..100))) };
            let (lo_f, hi_f) = ((lo - zero) as f32, (hi - zero) as f32);
            let mut want = vec![7i8; rows * stride];
            for p in 0..rows {
                for c in 0..width {
                    want[p * stride + c] =
                        requantize_one(tile[p * 16 + c], biases[c], scales[c], zero, lo_f, hi_f);
                }
            }
            let mut got = vec![7i8; rows * stride];
            requantize_lanes(&tile, rows, width, &biases, &scales, [zero, lo, hi], &mut got, stride);
            assert_eq!(got, want, "dispatched, case {case}");
            #[cfg(target_arch = "x86_64")]
            {
                let mut kernels: Vec<(&str, LaneKernel)> = Vec::new();
                if super::super::cpu::avx2() {
                    kernels.push(("avx2", requantize_lanes_avx2));
                }
                if super::super::cpu::avx512().is_some() {
                    kernels.push(("avx512", requantize_lanes_avx512));
                }
                for (name, kernel) in kernels {
                    let mut got = vec![7i8; rows * stride];
                    // SAFETY: the host has the kernel's features; got holds every row.
                    unsafe { kernel(&tile, rows, width, &biases, &scales, [zero, lo, hi], &mut got, stride) };
                    assert_eq!(got, want, "{name}, case {case}: {rows} rows of {width}");
                }
            }
        }
    }

    #[cfg(target_arch = "x86_64")]
    type LaneKernel = unsafe fn(&[i32], usize, usize, &[i32], &[f32], [i32; 3], &mut [i8], usize);

    /// Both tile kernels write what `requantize_row` writes, row by row,
    /// on every width (a partial last panel), and nothing past it.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn tile_requantization_matches_the_row_one_on_every_width() {
        let mut rng = fastrand::Rng::with_seed(38);
        for case in 0..400 {
            let (rows, width, stride) = (rng.usize(1..=4), rng.usize(1..=16), 16 + rng.usize(0..5));
            let tile: Vec<i32> = (0..rows * 16).map(|_| rng.i32(-40_000..40_000)).collect();
            let biases: Vec<i32> = (0..rows).map(|_| rng.i32(-5000..5000)).collect();
            let scales: Vec<f32> = (0..rows).map(|_| rng.f32() * 0.02).collect();
            let zero = rng.i32(-128..128);
            let (lo, hi) = if rng.bool() { (-128, 127) } else { (zero, 127.min(zero + rng.i32(0..100))) };
            let mut want = vec![7i8; rows * stride];
            for i in 0..rows {
                let sums = &tile[i * 16..i * 16 + width];
                requantize_row(
                    sums,
                    biases[i],
                    scales[i],
                    zero,
                    lo,
                    hi,
                    &mut want[i * stride..i * stride + width],
                );
            }
            let mut kernels: Vec<(&str, TileKernel)> = Vec::new();
            if super::super::cpu::avx2() {
                kernels.push(("avx2", requantize_tile_avx2));
            }
            if super::super::cpu::avx512().is_some() {
                kernels.push(("avx512", requantize_tile_avx512));
            }
            for (name, kernel) in kernels {
                let mut got = vec![7i8; rows * stride];
                // SAFETY: the host has the kernel's features; got holds every row.
                unsafe { kernel(&tile, width, &biases, &scales, [zero, lo, hi], &mut got, stride) };
                assert_eq!(got, want, "{name}, case {case}: {rows} rows of {width}");
            }
        }
    }
}
