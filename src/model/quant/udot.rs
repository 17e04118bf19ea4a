//! Our u8 x s8 -> i32 matrix product for convolutions on hosts with a
//! byte dot-product instruction: `vpdpbusd` (AVX-512 VNNI, and AVX-VNNI's
//! 256-bit form on the Alder Lake-N / N100 class of gateway CPU) multiplies
//! four unsigned bytes by four signed bytes per 32-bit lane and adds the
//! four products to the lane: twice the multiply-adds per instruction of
//! the i16 tile (`igemm.rs`, `vpdpwssd`), and half the bytes to pack.
//! arm64 has `sdot` and I8MM's `usmmla` and `sudot`. AVX2 alone has no such
//! instruction; its form splits each quad into two i16 pairs for
//! `vpmaddwd`. On channels-first layers it is no faster than the i16 tile
//! (ic's ranged from 20% faster to 25% slower), so it runs only where the
//! hand-offs to and from depthwise layers save their passes
//! (`QConv::taking_channels_last`).
//!
//! The activations are the unsigned side: an i8 value x is stored as
//! `u = x + 128` (its top bit flipped), so each sum carries `128 * sum(w)`
//! on top of `sum(x * w)`; the op takes that, with the input zero point,
//! out of its bias once (`weight_offsets`). Weights with nonzero zero
//! points would need each column's sum too: those layers stay on the i16
//! tile.
//!
//! Layout: the weights in panels of `MR` rows and the patch matrix in
//! panels of `NR` columns, both as quads of k: one u32 per row (or column)
//! and quad holding its four bytes for k = 4q..4q+3, k padded to a multiple
//! of 4 with zero weights (so whatever the patch holds there contributes
//! nothing).

use super::patches::PatchLayout;

/// Columns of a patch panel: one zmm register (or two ymm) of 16 i32, as
/// in `igemm`, whose AVX-512 tile both products share.
pub const NR: usize = super::igemm::NR;
/// Rows of a weight panel: the tile is `MR x NR`.
pub const MR: usize = 4;

/// The weights (`rows x k`, i8) packed in panels of `height` rows: per
/// panel and quad of k, each row's four bytes. `MR` rows for `product_on`'s
/// tile (one broadcast a row), `LANES` for `pixel_rows` (one register a
/// quad, a row a lane).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Weights {
    pub rows: usize,
    pub k: usize,
    height: usize,
    data: Vec<u32>,
    /// Each row's sum of weights, for the +128 correction.
    pub row_sums: Vec<i32>,
}

#[inline(always)]
fn quad(bytes: [u8; 4]) -> u32 {
    u32::from_le_bytes(bytes)
}

impl Weights {
    /// `values` is row-major `rows x k` (one row per output channel),
    /// packed for `product_on`.
    pub fn pack(values: &[i8], rows: usize, k: usize) -> Weights {
        Weights::pack_in(values, rows, k, MR)
    }

    /// Packed in panels of `height` rows.
    pub fn pack_in(values: &[i8], rows: usize, k: usize, height: usize) -> Weights {
        assert_eq!(values.len(), rows * k, "udot::Weights: {} values for {rows}x{k}", values.len());
        let k4 = k.div_ceil(4);
        let mut data = vec![0u32; rows.div_ceil(height) * k4 * height];
        for r in 0..rows {
            let row = &values[r * k..(r + 1) * k];
            for q in 0..k4 {
                let byte = |t: usize| row.get(4 * q + t).map_or(0, |&v| v as u8);
                data[((r / height) * k4 + q) * height + r % height] =
                    quad([byte(0), byte(1), byte(2), byte(3)]);
            }
        }
        let row_sums =
            values.chunks(k.max(1)).take(rows).map(|r| r.iter().map(|&v| v as i32).sum()).collect();
        Weights { rows, k, height, data, row_sums }
    }

    /// What each output channel's sum must lose: `(128 + zx) * sum(w)`,
    /// the flipped top bit plus the input zero point (the weights'
    /// zero points being 0).
    pub fn weight_offsets(&self, input_zero: i32) -> impl Iterator<Item = i32> + '_ {
        self.row_sums.iter().map(move |&s| -(128 + input_zero) * s)
    }

    fn panel(&self, p: usize) -> &[u32] {
        let len = self.k.div_ceil(4) * self.height;
        &self.data[p * len..(p + 1) * len]
    }
}

/// Output channels in one register of the channels-in-lanes tile.
pub const LANES: usize = 16;
/// Pixels of one channels-in-lanes tile.
pub const PIXELS: usize = 8;

/// Whether `pixel_rows` has a vector tile here (each byte tile has one;
/// elsewhere it runs a portable loop, for the tests): what makes a
/// pointwise layer write channels-last.
pub fn pixel_rows_fast() -> bool {
    // Every byte tile has a channels-in-lanes form.
    TileKernel::best().is_some()
}

/// `weights x pixels` the other way round from `product_on`: output
/// channels in the lanes, pixels in the rows, so each tile row is one
/// pixel's 16 output channels, ready to store channels-last. `x` holds the
/// pixels' k values flipped to u8, `stride` bytes apart, readable 4 bytes
/// past the last quad of the last pixel. Each `PIXELS x LANES` tile goes
/// to `emit(pixel, channel, tile)` (`tile[p * LANES + c]`; rows past the
/// last pixel and lanes past the last channel hold nothing meaningful).
/// AVX-512 VNNI: one load of 16 channels' quad, one broadcast of a pixel's
/// quad, one `vpdpbusd` per pixel; arm64: a dot product by element per
/// quad of a register holding four of the pixel's quads.
pub fn pixel_rows(
    weights: &Weights,
    x: &[u8],
    stride: usize,
    pixels: usize,
    emit: impl FnMut(usize, usize, &[i32; PIXELS * LANES]),
) {
    pixel_rows_on(TileKernel::best().unwrap_or(TileKernel::Portable), weights, x, stride, pixels, emit)
}

/// `pixel_rows` with `kernel`'s channels-in-lanes form (the tests run
/// each), the portable loop for a kernel without one.
fn pixel_rows_on(
    kernel: TileKernel,
    weights: &Weights,
    x: &[u8],
    stride: usize,
    pixels: usize,
    mut emit: impl FnMut(usize, usize, &[i32; PIXELS * LANES]),
) {
    let k4 = weights.k.div_ceil(4);
    assert!(weights.height == LANES, "pixel_rows: weights in panels of {} rows", weights.height);
    assert!(pixels == 0 || x.len() >= (pixels - 1) * stride + 4 * k4);
    let mut tile = [0i32; PIXELS * LANES];
    for p0 in (0..pixels).step_by(PIXELS) {
        let live = PIXELS.min(pixels - p0);
        for block in 0..weights.rows.div_ceil(LANES) {
            let w = weights.panel(block);
            // SAFETY: a kernel is chosen only where the host has its
            // features (`TileKernel::available`); the assert bounds the
            // reads of the live pixels.
            match kernel {
                #[cfg(target_arch = "x86_64")]
                TileKernel::Avx512Vnni => {
                    unsafe { pixel_tile_avx512(w, &x[p0 * stride..], stride, k4, live, &mut tile) };
                    emit(p0, block * LANES, &tile);
                    continue;
                }
                #[cfg(target_arch = "x86_64")]
                TileKernel::AvxVnni => {
                    unsafe { pixel_tile_avx_vnni(w, &x[p0 * stride..], stride, k4, live, &mut tile) };
                    emit(p0, block * LANES, &tile);
                    continue;
                }
                #[cfg(target_arch = "x86_64")]
                TileKernel::Avx2 => {
                    unsafe { pixel_tile_avx2(w, &x[p0 * stride..], stride, k4, live, &mut tile) };
                    emit(p0, block * LANES, &tile);
                    continue;
                }
                #[cfg(target_arch = "aarch64")]
                TileKernel::NeonI8mm => {
                    unsafe { neon::pixel_tile_sudot(w, &x[p0 * stride..], stride, k4, live, &mut tile) };
                    emit(p0, block * LANES, &tile);
                    continue;
                }
                #[cfg(target_arch = "aarch64")]
                TileKernel::NeonDot => {
                    // `sdot` sums (u - 128) * w: each lane starts 128 * sum(w) up.
                    let start =
                        std::array::from_fn(|c| 128 * weights.row_sums.get(block * LANES + c).unwrap_or(&0));
                    let x = &x[p0 * stride..];
                    unsafe { neon::pixel_tile_sdot(w, x, stride, k4, live, start, &mut tile) };
                    emit(p0, block * LANES, &tile);
                    continue;
                }
                _ => {}
            }
            tile.fill(0);
            for p in 0..live {
                for q in 0..k4 {
                    let at = (p0 + p) * stride + 4 * q;
                    let u = [x[at], x[at + 1], x[at + 2], x[at + 3]];
                    for c in 0..LANES {
                        let wv = w[q * LANES + c].to_le_bytes();
                        tile[p * LANES + c] += (0..4).map(|t| u[t] as i32 * wv[t] as i8 as i32).sum::<i32>();
                    }
                }
            }
            emit(p0, block * LANES, &tile);
        }
    }
}

/// Quad `q` of the 16 lanes' weights in two ymm, each as its even and odd
/// bytes widened to i16 pairs (`[even0, odd0, even1, odd1]`) for `vpmaddwd`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn lane_weights_avx2(w: &[u32], q: usize) -> [std::arch::x86_64::__m256i; 4] {
    use std::arch::x86_64::*;
    let at = &w[q * LANES..(q + 1) * LANES];
    // SAFETY: 16 u32 of the block.
    let [w0, w1] = [0, 8].map(|h| unsafe { _mm256_loadu_si256(at.as_ptr().add(h) as *const __m256i) });
    let [e0, o0] = split_signed(w0);
    let [e1, o1] = split_signed(w1);
    [e0, o0, e1, o1]
}

/// Each 32-bit lane's four signed bytes as two i16 pairs: bytes 0 and 2,
/// bytes 1 and 3.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn split_signed(v: std::arch::x86_64::__m256i) -> [std::arch::x86_64::__m256i; 2] {
    use std::arch::x86_64::*;
    [_mm256_srai_epi16(_mm256_slli_epi16(v, 8), 8), _mm256_srai_epi16(v, 8)]
}

/// Each 32-bit lane's four unsigned bytes as two i16 pairs, as
/// `split_signed` pairs them.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn split_unsigned(v: std::arch::x86_64::__m256i) -> [std::arch::x86_64::__m256i; 2] {
    use std::arch::x86_64::*;
    [_mm256_and_si256(v, _mm256_set1_epi32(0x00ff_00ff)), _mm256_srli_epi16(v, 8)]
}

/// `acc + u * w` over a quad, from the two halves `split_*` made: a sum of
/// two products of a byte and a signed byte is at most 65,280 in
/// magnitude, so `vpmaddwd` is exact.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn dot_split(
    acc: std::arch::x86_64::__m256i,
    [ue, uo]: [std::arch::x86_64::__m256i; 2],
    [we, wo]: [std::arch::x86_64::__m256i; 2],
) -> std::arch::x86_64::__m256i {
    use std::arch::x86_64::*;
    _mm256_add_epi32(acc, _mm256_add_epi32(_mm256_madd_epi16(ue, we), _mm256_madd_epi16(uo, wo)))
}

/// The 256-bit channels-in-lanes tiles, four rows at a time: 16
/// accumulators for 8 rows would leave none for the operands. Per quad `q`
/// of the block, `weights(q)` loads its 16 lanes once for every pixel, and
/// `dot(acc, u, weights)` adds a pixel's quad `u` times them to the
/// pixel's two accumulators. Inlined into each form, so its intrinsics
/// compile with that form's features.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn pixel_tile_ymm<W: Copy>(
    x: &[u8],
    stride: usize,
    k4: usize,
    live: usize,
    tile: &mut [i32; PIXELS * LANES],
    weights: impl Fn(usize) -> W,
    dot: impl Fn([std::arch::x86_64::__m256i; 2], i32, W) -> [std::arch::x86_64::__m256i; 2],
) {
    use std::arch::x86_64::*;
    for half in 0..2 {
        // SAFETY (here and below): AVX is present (every caller's features).
        let mut acc = [[unsafe { _mm256_setzero_si256() }; 2]; PIXELS / 2];
        // Rows past the live pixels read the last live one again.
        let rows: [usize; PIXELS / 2] =
            std::array::from_fn(|p| (half * PIXELS / 2 + p).min(live - 1) * stride);
        for q in 0..k4 {
            let w = weights(q);
            for (acc, &row) in acc.iter_mut().zip(&rows) {
                // SAFETY: quad q of each live pixel (the caller checks x's
                // length).
                let u = unsafe { (x.as_ptr().add(row + 4 * q) as *const i32).read_unaligned() };
                *acc = dot(*acc, u, w);
            }
        }
        for (p, acc) in acc.iter().enumerate() {
            let at = (half * PIXELS / 2 + p) * LANES;
            // SAFETY: row half * 4 + p of the tile, 16 i32.
            unsafe {
                _mm256_storeu_si256(tile.as_mut_ptr().add(at) as *mut __m256i, acc[0]);
                _mm256_storeu_si256(tile.as_mut_ptr().add(at + 8) as *mut __m256i, acc[1]);
            }
        }
    }
}

/// The channels-in-lanes tile on AVX2 alone: as `pixel_tile_avx_vnni`,
/// each `vpdpbusd` two `vpmaddwd` on the quads' even and odd bytes.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn pixel_tile_avx2(
    w: &[u32],
    x: &[u8],
    stride: usize,
    k4: usize,
    live: usize,
    tile: &mut [i32; PIXELS * LANES],
) {
    use std::arch::x86_64::*;
    let weights = |q| lane_weights_avx2(w, q);
    pixel_tile_ymm(x, stride, k4, live, tile, weights, |[a0, a1], u, [e0, o0, e1, o1]| {
        let u = split_unsigned(_mm256_set1_epi32(u));
        [dot_split(a0, u, [e0, o0]), dot_split(a1, u, [e1, o1])]
    })
}

/// `pixel_tile_avx512` in 256-bit registers (`pixel_tile_ymm`).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,avxvnni")]
unsafe fn pixel_tile_avx_vnni(
    w: &[u32],
    x: &[u8],
    stride: usize,
    k4: usize,
    live: usize,
    tile: &mut [i32; PIXELS * LANES],
) {
    use std::arch::x86_64::*;
    let at = |q: usize, h: usize| &w[q * LANES + h..q * LANES + h + 8];
    // SAFETY: 8 u32 of quad q of the block.
    let weights = |q| [0, 8].map(|h| unsafe { _mm256_loadu_si256(at(q, h).as_ptr() as *const __m256i) });
    pixel_tile_ymm(x, stride, k4, live, tile, weights, |[a0, a1], u, [w0, w1]| {
        let u = _mm256_set1_epi32(u);
        [_mm256_dpbusd_avx_epi32(a0, u, w0), _mm256_dpbusd_avx_epi32(a1, u, w1)]
    })
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512vnni")]
unsafe fn pixel_tile_avx512(
    w: &[u32],
    x: &[u8],
    stride: usize,
    k4: usize,
    live: usize,
    tile: &mut [i32; PIXELS * LANES],
) {
    use std::arch::x86_64::*;
    let mut acc = [_mm512_setzero_si512(); PIXELS];
    // Rows past the live pixels read the last live one again.
    let rows: [usize; PIXELS] = std::array::from_fn(|p| p.min(live - 1) * stride);
    for q in 0..k4 {
        // SAFETY: quad q of the block, and of each live pixel (the caller
        // checks x's length).
        unsafe {
            let wv = _mm512_loadu_si512(w.as_ptr().add(q * LANES) as *const __m512i);
            for (acc, &row) in acc.iter_mut().zip(&rows) {
                let u = (x.as_ptr().add(row + 4 * q) as *const i32).read_unaligned();
                *acc = _mm512_dpbusd_epi32(*acc, _mm512_set1_epi32(u), wv);
            }
        }
    }
    for (p, acc) in acc.iter().enumerate() {
        // SAFETY: row p of the tile, 16 i32.
        unsafe { _mm512_storeu_si512(tile.as_mut_ptr().add(p * LANES) as *mut __m512i, *acc) };
    }
}

/// The patch matrix of one image, packed in panels of `NR` columns.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Patches {
    pub cols: usize,
    pub k: usize,
    data: Vec<u32>,
}

impl Patches {
    /// Packs the patches of an image already flipped to u8 and padded
    /// (`patches::flip_padded`) as `layout` says: per panel and quad of
    /// rows, four 16-byte loads and an interleave where the panel's columns
    /// are contiguous, a gather elsewhere. The rows past k of the last quad
    /// repeat its first row: their weights are 0, so any byte does.
    pub fn pack(&mut self, plane: &[u8], layout: &PatchLayout) {
        let (k, cols) = (layout.row_offsets.len(), layout.column_offsets.len());
        (self.cols, self.k) = (cols, k);
        let k4 = k.div_ceil(4);
        // Every word is written below: no need to clear what is reused.
        self.data.resize(cols.div_ceil(NR) * k4 * NR, 0);
        for p in 0..cols.div_ceil(NR) {
            let panel = &mut self.data[p * k4 * NR..(p + 1) * k4 * NR];
            let columns = &layout.column_offsets[p * NR..cols.min((p + 1) * NR)];
            for (q, out) in panel.chunks_exact_mut(NR).enumerate() {
                let first = layout.row_offsets[4 * q];
                let rows: [usize; 4] =
                    std::array::from_fn(|t| *layout.row_offsets.get(4 * q + t).unwrap_or(&first));
                #[cfg(target_arch = "x86_64")]
                if layout.contiguous[p] {
                    let at = columns[0];
                    let row = |t: usize| &plane[rows[t] + at..][..NR];
                    interleave_quads(out, [row(0), row(1), row(2), row(3)]);
                    continue;
                }
                #[cfg(target_arch = "x86_64")]
                if layout.every_other[p] && super::cpu::avx2() {
                    // Two 16-byte loads a row; the last column's odd byte
                    // may be past the plane, so the panel must fit whole.
                    let at = columns[0];
                    let row = |t: usize| plane.get(rows[t] + at..rows[t] + at + 2 * NR);
                    if let [Some(a), Some(b), Some(c), Some(d)] = [row(0), row(1), row(2), row(3)] {
                        // SAFETY: AVX2 hosts have SSSE3.
                        unsafe { interleave_quads_every_other(out, [a, b, c, d]) };
                        continue;
                    }
                }
                let [r0, r1, r2, r3] = rows;
                for (o, &col) in out.iter_mut().zip(columns) {
                    *o = quad([plane[r0 + col], plane[r1 + col], plane[r2 + col], plane[r3 + col]]);
                }
                out[columns.len()..].fill(0);
            }
        }
    }

    /// Packs a channels-last image (`pixels x channels`, i8 domain) as
    /// the patches of a pointwise convolution: a quad of rows is four
    /// adjacent channels of a pixel, so each word is one unaligned load,
    /// its top bits flipped to u8. Bytes past the last channel belong to
    /// the next pixel (or are 0 at the end): their weights are 0.
    pub fn pack_channels_last(&mut self, x: &[i8], pixels: usize, channels: usize) {
        assert!(x.len() >= pixels * channels);
        (self.cols, self.k) = (pixels, channels);
        let k4 = channels.div_ceil(4);
        self.data.resize(pixels.div_ceil(NR) * k4 * NR, 0);
        let word = |at: usize| match x.get(at..at + 4) {
            Some(b) => quad([b[0] as u8, b[1] as u8, b[2] as u8, b[3] as u8]),
            None => quad(std::array::from_fn(|t| x.get(at + t).map_or(0, |&v| v as u8))),
        };
        #[allow(unused_mut)] // advanced only on x86-64
        let mut first = 0;
        #[cfg(target_arch = "x86_64")]
        if channels.is_multiple_of(4) && super::cpu::avx512().is_some() {
            // SAFETY: AVX-512 F is present; every gathered word is inside
            // x (whole quads of whole pixels).
            first = unsafe { gather_channels_last(x, pixels, channels, &mut self.data) };
        }
        for (p, panel) in self.data.chunks_exact_mut(k4 * NR).enumerate().skip(first) {
            let live = NR.min(pixels - p * NR);
            for (q, out) in panel.chunks_exact_mut(NR).enumerate() {
                for (j, o) in out[..live].iter_mut().enumerate() {
                    *o = word((p * NR + j) * channels + 4 * q) ^ 0x8080_8080;
                }
                out[live..].fill(0);
            }
        }
    }

    fn panel(&self, p: usize) -> &[u32] {
        let len = self.k.div_ceil(4) * NR;
        &self.data[p * len..(p + 1) * len]
    }
}

/// `Patches::pack_channels_last`'s whole panels, a quad of rows in one
/// gather of 16 words (one per pixel, `channels` bytes apart); returns the
/// panels done.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn gather_channels_last(x: &[i8], pixels: usize, channels: usize, data: &mut [u32]) -> usize {
    use std::arch::x86_64::*;
    let (panels, k4) = (pixels / NR, channels / 4);
    let steps: [i32; NR] = std::array::from_fn(|j| (j * channels) as i32);
    // SAFETY: 16 i32 from a 16-element array.
    let offsets = unsafe { _mm512_loadu_si512(steps.as_ptr() as *const __m512i) };
    let flip = _mm512_set1_epi32(0x8080_8080u32 as i32);
    for p in 0..panels {
        for q in 0..k4 {
            // SAFETY: pixel p * NR + j, channels 4q..4q + 4, inside x; the
            // panel's quad q inside data.
            unsafe {
                let base = x.as_ptr().add(p * NR * channels + 4 * q) as *const i32;
                let words = _mm512_i32gather_epi32::<1>(offsets, base);
                let out = data.as_mut_ptr().add((p * k4 + q) * NR) as *mut __m512i;
                _mm512_storeu_si512(out, _mm512_xor_si512(words, flip));
            }
        }
    }
    panels
}

/// `out[j]` = the four rows' bytes of column j, for 16 columns: byte
/// unpacks pair rows 0-1 and 2-3, word unpacks pair the pairs. SSE2, so
/// every x86-64 host has it.
#[cfg(target_arch = "x86_64")]
#[inline]
fn interleave_quads(out: &mut [u32], [a, b, c, d]: [&[u8]; 4]) {
    use std::arch::x86_64::*;
    assert!(out.len() >= NR && a.len() >= NR && b.len() >= NR && c.len() >= NR && d.len() >= NR);
    // SAFETY: SSE2 is part of x86-64; the lengths are checked above.
    unsafe {
        let a = _mm_loadu_si128(a.as_ptr() as *const __m128i);
        let b = _mm_loadu_si128(b.as_ptr() as *const __m128i);
        let c = _mm_loadu_si128(c.as_ptr() as *const __m128i);
        let d = _mm_loadu_si128(d.as_ptr() as *const __m128i);
        let (ab_lo, ab_hi) = (_mm_unpacklo_epi8(a, b), _mm_unpackhi_epi8(a, b));
        let (cd_lo, cd_hi) = (_mm_unpacklo_epi8(c, d), _mm_unpackhi_epi8(c, d));
        let o = out.as_mut_ptr() as *mut __m128i;
        _mm_storeu_si128(o, _mm_unpacklo_epi16(ab_lo, cd_lo)); // columns 0-3
        _mm_storeu_si128(o.add(1), _mm_unpackhi_epi16(ab_lo, cd_lo)); // 4-7
        _mm_storeu_si128(o.add(2), _mm_unpacklo_epi16(ab_hi, cd_hi)); // 8-11
        _mm_storeu_si128(o.add(3), _mm_unpackhi_epi16(ab_hi, cd_hi)); // 12-15
    }
}

/// `interleave_quads` of the even bytes of four 32-byte rows: the
/// columns of one output row of a stride-2 convolution (the stems of vww
/// and ic, their stride-2 1x1 and 3x3 layers), which the gather took a
/// byte at a time.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "ssse3")]
unsafe fn interleave_quads_every_other(out: &mut [u32], rows: [&[u8]; 4]) {
    use std::arch::x86_64::*;
    assert!(rows.iter().all(|r| r.len() >= 2 * NR));
    // Even bytes to the low half of each 16-byte load, then both halves.
    let evens = _mm_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, -1, -1, -1, -1, -1, -1, -1, -1);
    let mut packed = [[0u8; NR]; 4];
    for (row, dst) in rows.iter().zip(&mut packed) {
        // SAFETY: 32 bytes checked above; `dst` is 16 bytes.
        unsafe {
            let lo = _mm_shuffle_epi8(_mm_loadu_si128(row.as_ptr() as *const __m128i), evens);
            let hi = _mm_shuffle_epi8(_mm_loadu_si128(row.as_ptr().add(NR) as *const __m128i), evens);
            _mm_storeu_si128(dst.as_mut_ptr() as *mut __m128i, _mm_unpacklo_epi64(lo, hi));
        }
    }
    let [a, b, c, d] = &packed;
    interleave_quads(out, [a, b, c, d]);
}

/// How a tile is computed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TileKernel {
    /// The reference the tests compare the others with; no op runs it (a
    /// host without AVX2 or a byte dot product runs the i16 tile instead).
    #[cfg_attr(not(test), allow(dead_code))]
    Portable,
    /// One zmm per row of the tile.
    #[cfg(target_arch = "x86_64")]
    Avx512Vnni,
    /// Two ymm per row of the tile (AVX-VNNI, no AVX-512 needed).
    #[cfg(target_arch = "x86_64")]
    AvxVnni,
    /// AVX2 alone: each quad as two i16 pairs (its even and odd bytes),
    /// `vpmaddwd` on each, so AVX2-only hosts (Zen 2 and 3, Skylake) share
    /// the byte packing and the channels-last paths.
    #[cfg(target_arch = "x86_64")]
    Avx2,
    /// Armv8.2 `sdot` (signed x signed), four columns a register: the
    /// bytes flipped back to i8, each row started at `128 * sum(w)`.
    #[cfg(target_arch = "aarch64")]
    NeonDot,
    /// Armv8.6 I8MM `usmmla`: u8 x s8 as the x86 tiles compute it, 2 x 2
    /// blocks of sums from eight bytes a side.
    #[cfg(target_arch = "aarch64")]
    NeonI8mm,
}

impl TileKernel {
    /// The byte tiles this host can run, fastest first; empty where it has
    /// none (the op then uses the i16 tile).
    pub fn available() -> Vec<TileKernel> {
        #[allow(unused_mut)] // pushed to only on x86-64 and arm64
        let mut kernels = Vec::new();
        #[cfg(target_arch = "aarch64")]
        {
            if std::arch::is_aarch64_feature_detected!("i8mm") {
                kernels.push(TileKernel::NeonI8mm);
            }
            if std::arch::is_aarch64_feature_detected!("dotprod") {
                kernels.push(TileKernel::NeonDot);
            }
        }
        #[cfg(target_arch = "x86_64")]
        {
            if super::cpu::avx512().is_some_and(|a| a.vnni) {
                kernels.push(TileKernel::Avx512Vnni);
            }
            if std::is_x86_feature_detected!("avxvnni") && super::cpu::vnni() {
                kernels.push(TileKernel::AvxVnni);
            }
            if super::cpu::avx2() {
                kernels.push(TileKernel::Avx2);
            }
        }
        kernels
    }

    /// Whether this tile has a dot-product instruction of bytes. AVX2
    /// alone does not, and on channels-first layers the i16 tile
    /// (`igemm.rs`) is as fast there, on some faster (one of ic's: 41
    /// against 51 us), so those layers stay on it.
    pub fn dot_product(self) -> bool {
        #[cfg(target_arch = "x86_64")]
        if self == TileKernel::Avx2 {
            return false;
        }
        self != TileKernel::Portable
    }

    /// The best one here, found once; `None` without AVX2 or a byte dot
    /// product.
    pub fn best() -> Option<TileKernel> {
        static BEST: std::sync::OnceLock<Option<TileKernel>> = std::sync::OnceLock::new();
        *BEST.get_or_init(|| TileKernel::available().first().copied())
    }

    pub fn name(self) -> &'static str {
        match self {
            TileKernel::Portable => "edgeinfer portable u8xs8",
            #[cfg(target_arch = "x86_64")]
            TileKernel::Avx512Vnni => "edgeinfer avx512 vnni u8xs8",
            #[cfg(target_arch = "x86_64")]
            TileKernel::AvxVnni => "edgeinfer avx-vnni u8xs8",
            #[cfg(target_arch = "x86_64")]
            TileKernel::Avx2 => "edgeinfer avx2 u8xs8",
            #[cfg(target_arch = "aarch64")]
            TileKernel::NeonDot => "edgeinfer neon sdot u8xs8",
            #[cfg(target_arch = "aarch64")]
            TileKernel::NeonI8mm => "edgeinfer neon i8mm usmmla u8xs8",
        }
    }

    /// Every tile this build has (whether or not the host runs it).
    const ALL: &[TileKernel] = &[
        TileKernel::Portable,
        #[cfg(target_arch = "x86_64")]
        TileKernel::Avx512Vnni,
        #[cfg(target_arch = "x86_64")]
        TileKernel::AvxVnni,
        #[cfg(target_arch = "x86_64")]
        TileKernel::Avx2,
        #[cfg(target_arch = "aarch64")]
        TileKernel::NeonDot,
        #[cfg(target_arch = "aarch64")]
        TileKernel::NeonI8mm,
    ];

    /// A short name for the kernel choices (the cache file, the fail point).
    pub fn id(self) -> &'static str {
        match self {
            TileKernel::Portable => "portable_bytes",
            #[cfg(target_arch = "x86_64")]
            TileKernel::Avx512Vnni => "avx512_vnni",
            #[cfg(target_arch = "x86_64")]
            TileKernel::AvxVnni => "avx_vnni",
            #[cfg(target_arch = "x86_64")]
            TileKernel::Avx2 => "avx2_bytes",
            #[cfg(target_arch = "aarch64")]
            TileKernel::NeonDot => "neon_sdot",
            #[cfg(target_arch = "aarch64")]
            TileKernel::NeonI8mm => "neon_i8mm",
        }
    }

    /// The tile `id` names, if this build has it.
    pub fn from_id(id: &str) -> Option<TileKernel> {
        TileKernel::ALL.iter().copied().find(|k| k.id() == id)
    }
}

/// `weights x patches`, one `MR x NR` tile at a time, each handed to
/// `emit(row, col, tile)` with the tile's i32 sums of `u * w` (`tile[i *
/// NR + j]` for row `row + i`, column `col + j`; rows and columns past the
/// ends hold nothing meaningful).
pub fn product_on(
    kernel: TileKernel,
    weights: &Weights,
    patches: &Patches,
    mut emit: impl FnMut(usize, usize, &[i32]),
) {
    assert_eq!(weights.k, patches.k, "udot::product: inner dimensions differ");
    let k4 = weights.k.div_ceil(4);
    let mut tile = [0i32; MR * NR];
    for cp in 0..patches.cols.div_ceil(NR) {
        let b = patches.panel(cp);
        for rp in 0..weights.rows.div_ceil(MR) {
            let a = weights.panel(rp);
            // SAFETY: a kernel is chosen only where the host has its
            // features (`TileKernel::available`); the slices are checked.
            match kernel {
                #[cfg(target_arch = "x86_64")]
                TileKernel::Avx512Vnni => unsafe {
                    super::igemm::avx512_vnni_tile::<MR, true>(a, b, k4, &mut tile)
                },
                #[cfg(target_arch = "x86_64")]
                TileKernel::AvxVnni => unsafe { avx_vnni_tile(a, b, k4, &mut tile) },
                #[cfg(target_arch = "x86_64")]
                TileKernel::Avx2 => unsafe { avx2_tile(a, b, k4, &mut tile) },
                #[cfg(target_arch = "aarch64")]
                TileKernel::NeonDot => unsafe {
                    // `sdot` sums (u - 128) * w: each row starts 128 * sum(w) up.
                    let start =
                        std::array::from_fn(|i| 128 * weights.row_sums.get(rp * MR + i).unwrap_or(&0));
                    neon::sdot_tile(a, b, k4, start, &mut tile)
                },
                #[cfg(target_arch = "aarch64")]
                TileKernel::NeonI8mm => unsafe { neon::usmmla_tile(a, b, k4, &mut tile) },
                TileKernel::Portable => portable_tile(a, b, k4, &mut tile),
            }
            emit(rp * MR, cp * NR, &tile);
        }
    }
}

/// The arm64 tiles: one 128-bit register holds four columns' sums of one
/// row, so the `MR x NR` tile is 16 accumulators; per quad of k, one load
/// of the four rows' weights (a lane each) and four of the 16 columns'
/// bytes, then 16 dot products by element. The instructions are written
/// in `asm!`: their intrinsics are not stable Rust.
#[cfg(target_arch = "aarch64")]
mod neon {
    use super::{LANES, MR, NR, PIXELS};
    use std::arch::aarch64::*;

    /// `acc += dot(b, a[LANE])` per 32-bit lane, with `$op` (`sdot` or
    /// `usdot`, whose `b` is unsigned).
    macro_rules! dot_by_element {
        ($op:literal, $acc:expr, $b:expr, $a:expr, $lane:literal) => {
            std::arch::asm!(
                concat!($op, " {acc:v}.4s, {b:v}.16b, {a:v}.4b[", $lane, "]"),
                acc = inout(vreg) $acc,
                b = in(vreg) $b,
                a = in(vreg) $a,
                options(pure, nomem, nostack, preserves_flags),
            )
        };
    }

    /// The tile of `(u - 128) * w` plus `start[i]` per row: `sdot` is
    /// signed x signed, so the columns' bytes (`u = x + 128`) go back to
    /// `x` with their top bit flipped.
    #[target_feature(enable = "dotprod")]
    pub(super) unsafe fn sdot_tile(
        a: &[u32],
        b: &[u32],
        k4: usize,
        start: [i32; MR],
        tile: &mut [i32; MR * NR],
    ) {
        assert!(a.len() >= k4 * MR && b.len() >= k4 * NR);
        let flip = vdupq_n_u8(0x80);
        let mut acc: [[int32x4_t; 4]; MR] = [[vdupq_n_s32(0); 4]; MR];
        for (row, &s) in acc.iter_mut().zip(&start) {
            *row = [vdupq_n_s32(s); 4];
        }
        for q in 0..k4 {
            // SAFETY: quad q of both panels, inside the slices (asserted);
            // the host has the dot product (the target feature).
            unsafe {
                let w = vreinterpretq_s8_u32(vld1q_u32(a.as_ptr().add(q * MR)));
                let cols = b.as_ptr().add(q * NR) as *const u8;
                for g in 0..4 {
                    let x = vreinterpretq_s8_u8(veorq_u8(vld1q_u8(cols.add(16 * g)), flip));
                    dot_by_element!("sdot", acc[0][g], x, w, "0");
                    dot_by_element!("sdot", acc[1][g], x, w, "1");
                    dot_by_element!("sdot", acc[2][g], x, w, "2");
                    dot_by_element!("sdot", acc[3][g], x, w, "3");
                }
            }
        }
        store(&acc, tile);
    }

    /// The tile of `u * w` with `usmmla` (I8MM's 2 x 8 by 8 x 2 matrix
    /// multiply-accumulate, unsigned columns by signed weights): per pair of
    /// quads, two columns' eight bytes against two rows' eight give a 2 x 2
    /// block of sums, twice the multiply-adds of a dot product by element.
    /// The panels' quads are zipped in pairs into those eight-byte rows.
    #[target_feature(enable = "neon,i8mm")]
    pub(super) unsafe fn usmmla_tile(a: &[u32], b: &[u32], k4: usize, tile: &mut [i32; MR * NR]) {
        assert!(a.len() >= k4 * MR && b.len() >= k4 * NR);
        // acc[r][c]: rows 2r, 2r + 1 by columns 2c, 2c + 1, lanes ordered
        // (2c, 2r), (2c, 2r + 1), (2c + 1, 2r), (2c + 1, 2r + 1).
        let mut acc = [[vdupq_n_s32(0); NR / 2]; MR / 2];
        let zero = vdupq_n_u32(0);
        for q in (0..k4).step_by(2) {
            // SAFETY: quads q and q + 1 (when there is one) of both panels,
            // inside the slices (asserted); the host has I8MM.
            unsafe {
                let next = q + 1 < k4;
                let load = |p: *const u32, at: usize, second: bool| match second {
                    true if !next => zero,
                    _ => vld1q_u32(p.add(at)),
                };
                let (w0, w1) = (load(a.as_ptr(), q * MR, false), load(a.as_ptr(), (q + 1) * MR, true));
                let rows =
                    [vreinterpretq_s8_u32(vzip1q_u32(w0, w1)), vreinterpretq_s8_u32(vzip2q_u32(w0, w1))];
                for g in 0..NR / 4 {
                    let b0 = load(b.as_ptr(), q * NR + 4 * g, false);
                    let b1 = load(b.as_ptr(), (q + 1) * NR + 4 * g, true);
                    let cols =
                        [vreinterpretq_u8_u32(vzip1q_u32(b0, b1)), vreinterpretq_u8_u32(vzip2q_u32(b0, b1))];
                    for (r, &w) in rows.iter().enumerate() {
                        for (h, &u) in cols.iter().enumerate() {
                            std::arch::asm!(
                                "usmmla {acc:v}.4s, {u:v}.16b, {w:v}.16b",
                                acc = inout(vreg) acc[r][2 * g + h],
                                u = in(vreg) u,
                                w = in(vreg) w,
                                options(pure, nomem, nostack, preserves_flags),
                            );
                        }
                    }
                }
            }
        }
        for (r, pairs) in acc.iter().enumerate() {
            for c in (0..NR / 2).step_by(2) {
                let (lo, hi) = (pairs[c], pairs[c + 1]);
                // SAFETY: four i32 of rows 2r and 2r + 1, columns 2c..2c + 4.
                unsafe {
                    vst1q_s32(tile.as_mut_ptr().add(2 * r * NR + 2 * c), vuzp1q_s32(lo, hi));
                    vst1q_s32(tile.as_mut_ptr().add((2 * r + 1) * NR + 2 * c), vuzp2q_s32(lo, hi));
                }
            }
        }
    }

    /// The channels-in-lanes tile (`pixel_rows`) by dot products by
    /// element, four pixels at a time (16 accumulators): per pixel one
    /// register of four quads of its bytes, per quad the block's 16
    /// channels' weights in four registers, a channel a lane. `$op` is
    /// `sudot` (I8MM: signed weights by unsigned bytes) or `sdot` (bytes
    /// flipped back to i8 by `$flip`, lanes started at `$start`).
    macro_rules! pixel_tile {
        ($op:literal, $w:ident, $x:ident, $stride:ident, $k4:ident, $live:ident, $start:expr, $flip:expr, $tile:ident) => {{
            const HALF: usize = PIXELS / 2;
            assert!($w.len() >= $k4 * LANES);
            for half in 0..2 {
                let mut acc: [[int32x4_t; 4]; HALF] = [$start; HALF];
                // Rows past the live pixels read the last live one again.
                let rows: [usize; HALF] = std::array::from_fn(|p| (half * HALF + p).min($live - 1) * $stride);
                for q in (0..$k4).step_by(4) {
                    let quads = 4.min($k4 - q);
                    // SAFETY: quads q.. of each live pixel (the caller checks
                    // x's length; a short group is copied out first) and of
                    // the block (asserted); the host has the instruction
                    // (the target feature).
                    unsafe {
                        let bytes: [int8x16_t; HALF] = std::array::from_fn(|p| {
                            let at = rows[p] + 4 * q;
                            let mut short = [0u8; 16];
                            let v = match quads {
                                4 => vld1q_u8($x.as_ptr().add(at)),
                                _ => {
                                    short[..4 * quads].copy_from_slice(&$x[at..at + 4 * quads]);
                                    vld1q_u8(short.as_ptr())
                                }
                            };
                            vreinterpretq_s8_u8(veorq_u8(v, $flip))
                        });
                        macro_rules! quad {
                            ($lane:literal, $l:literal) => {
                                if $l < quads {
                                    let w: [int8x16_t; 4] = std::array::from_fn(|g| {
                                        vld1q_s8($w.as_ptr().add((q + $l) * LANES + 4 * g) as *const i8)
                                    });
                                    for (acc, &b) in acc.iter_mut().zip(&bytes) {
                                        for (acc, &w) in acc.iter_mut().zip(&w) {
                                            dot_by_element!($op, *acc, w, b, $lane);
                                        }
                                    }
                                }
                            };
                        }
                        quad!("0", 0);
                        quad!("1", 1);
                        quad!("2", 2);
                        quad!("3", 3);
                    }
                }
                for (p, acc) in acc.iter().enumerate() {
                    for (g, &v) in acc.iter().enumerate() {
                        // SAFETY: four i32 of row half * HALF + p of the tile.
                        unsafe { vst1q_s32($tile.as_mut_ptr().add((half * HALF + p) * LANES + 4 * g), v) };
                    }
                }
            }
        }};
    }

    /// `pixel_tile!` with I8MM's `sudot`: u8 x s8 as the x86 tiles.
    #[target_feature(enable = "neon,i8mm")]
    pub(super) unsafe fn pixel_tile_sudot(
        w: &[u32],
        x: &[u8],
        stride: usize,
        k4: usize,
        live: usize,
        tile: &mut [i32; PIXELS * LANES],
    ) {
        pixel_tile!("sudot", w, x, stride, k4, live, [vdupq_n_s32(0); 4], vdupq_n_u8(0), tile)
    }

    /// `pixel_tile!` with `sdot`: the bytes flipped back, each lane started
    /// at `start` (128 * its channel's sum of weights).
    #[target_feature(enable = "dotprod")]
    pub(super) unsafe fn pixel_tile_sdot(
        w: &[u32],
        x: &[u8],
        stride: usize,
        k4: usize,
        live: usize,
        start: [i32; LANES],
        tile: &mut [i32; PIXELS * LANES],
    ) {
        // SAFETY: four i32 of the 16.
        let start = std::array::from_fn(|g| unsafe { vld1q_s32(start.as_ptr().add(4 * g)) });
        pixel_tile!("sdot", w, x, stride, k4, live, start, vdupq_n_u8(0x80), tile)
    }

    /// Row `i`'s four registers to `tile[i * NR..]`, columns in order.
    fn store(acc: &[[int32x4_t; 4]; MR], tile: &mut [i32; MR * NR]) {
        for (row, out) in acc.iter().zip(tile.chunks_exact_mut(NR)) {
            for (g, &v) in row.iter().enumerate() {
                // SAFETY: four i32 into the row's 16.
                unsafe { vst1q_s32(out.as_mut_ptr().add(4 * g), v) };
            }
        }
    }
}

fn portable_tile(a: &[u32], b: &[u32], k4: usize, tile: &mut [i32; MR * NR]) {
    tile.fill(0);
    for q in 0..k4 {
        for i in 0..MR {
            let w = a[q * MR + i].to_le_bytes().map(|v| v as i8 as i32);
            for j in 0..NR {
                let u = b[q * NR + j].to_le_bytes().map(|v| v as i32);
                tile[i * NR + j] += (0..4).map(|t| u[t] * w[t]).sum::<i32>();
            }
        }
    }
}

/// On AVX-VNNI: a panel is two ymm, so `2 * MR` accumulators.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,avxvnni")]
unsafe fn avx_vnni_tile(a: &[u32], b: &[u32], k4: usize, tile: &mut [i32; MR * NR]) {
    use std::arch::x86_64::*;
    assert!(a.len() >= k4 * MR && b.len() >= k4 * NR);
    unsafe {
        let mut acc = [[_mm256_setzero_si256(); 2]; MR];
        let (pa, pb) = (a.as_ptr(), b.as_ptr());
        for q in 0..k4 {
            let u0 = _mm256_loadu_si256(pb.add(q * NR) as *const __m256i);
            let u1 = _mm256_loadu_si256(pb.add(q * NR + 8) as *const __m256i);
            for (i, row) in acc.iter_mut().enumerate() {
                let w = _mm256_set1_epi32(*pa.add(q * MR + i) as i32);
                row[0] = _mm256_dpbusd_avx_epi32(row[0], u0, w);
                row[1] = _mm256_dpbusd_avx_epi32(row[1], u1, w);
            }
        }
        let out = tile.as_mut_ptr();
        for (i, row) in acc.iter().enumerate() {
            _mm256_storeu_si256(out.add(i * NR) as *mut __m256i, row[0]);
            _mm256_storeu_si256(out.add(i * NR + 8) as *mut __m256i, row[1]);
        }
    }
}

/// On AVX2 alone: as `avx_vnni_tile`, each `vpdpbusd` two `vpmaddwd` on
/// the quads' even and odd bytes.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn avx2_tile(a: &[u32], b: &[u32], k4: usize, tile: &mut [i32; MR * NR]) {
    use std::arch::x86_64::*;
    assert!(a.len() >= k4 * MR && b.len() >= k4 * NR);
    let mut acc = [[_mm256_setzero_si256(); 2]; MR];
    for q in 0..k4 {
        // SAFETY: quad q of both panels, inside the slices (asserted).
        let [u0, u1] =
            [0, 8].map(|h| unsafe { _mm256_loadu_si256(b.as_ptr().add(q * NR + h) as *const __m256i) });
        let (u0, u1) = (split_unsigned(u0), split_unsigned(u1));
        for (i, row) in acc.iter_mut().enumerate() {
            let w = split_signed(_mm256_set1_epi32(a[q * MR + i] as i32));
            row[0] = dot_split(row[0], u0, w);
            row[1] = dot_split(row[1], u1, w);
        }
    }
    for (i, row) in acc.iter().enumerate() {
        // SAFETY: row i of the tile, 16 i32.
        unsafe {
            _mm256_storeu_si256(tile.as_mut_ptr().add(i * NR) as *mut __m256i, row[0]);
            _mm256_storeu_si256(tile.as_mut_ptr().add(i * NR + 8) as *mut __m256i, row[1]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::quant::patches::{Geometry, flip_padded};

    /// Every panel, packed by loads and interleaves (stride 1), by loads
    /// and shuffles (stride 2) or by the gather, holds the bytes the layout
    /// names; the rows past k are free (their weights are 0).
    #[test]
    fn patches_hold_the_bytes_the_layout_names_on_every_path() {
        let mut rng = fastrand::Rng::with_seed(5);
        for (width, stride, pad, kernel) in
            [(40, 2, 1, 3), (64, 2, 0, 1), (33, 2, 1, 3), (16, 1, 1, 3), (5, 1, 0, 1), (95, 2, 0, 3)]
        {
            let g = Geometry {
                in_channels: 3,
                out_channels: 8,
                height: 9,
                width,
                kernel: [kernel, kernel],
                strides: [stride, stride],
                dilations: [1, 1],
                pads: [pad; 4],
            };
            let x: Vec<i8> = (0..3 * 9 * width).map(|_| rng.i8(..)).collect();
            let layout = PatchLayout::new(&g, NR).unwrap();
            if stride == 2 && width >= 32 {
                assert!(layout.every_other.iter().any(|&e| e), "{g:?} exercises the shuffle");
            }
            let (mut plane, mut patches) = (Vec::new(), Patches::default());
            flip_padded(&g, &x, rng.i32(-128..128), &mut plane);
            patches.pack(&plane, &layout);
            let (k, cols) = (layout.row_offsets.len(), layout.column_offsets.len());
            for p in 0..cols.div_ceil(NR) {
                let panel = patches.panel(p);
                for q in 0..k.div_ceil(4) {
                    for (j, &col) in layout.column_offsets[p * NR..cols.min((p + 1) * NR)].iter().enumerate()
                    {
                        let bytes = panel[q * NR + j].to_le_bytes();
                        for t in (0..4).filter(|t| 4 * q + t < k) {
                            let want = plane[layout.row_offsets[4 * q + t] + col];
                            assert_eq!(bytes[t], want, "{g:?}: panel {p} quad {q} column {j} row {t}");
                        }
                    }
                }
            }
        }
    }

    /// The channels-in-lanes tile, fast and portable, against sums from the
    /// unpacked values, on pixel rows, channel blocks and quads cut at
    /// every edge.
    #[test]
    fn pixel_rows_are_exact_on_every_edge() {
        let mut rng = fastrand::Rng::with_seed(29);
        for &(m, k, n) in &[(1, 1, 1), (3, 5, 7), (16, 4, 8), (17, 27, 9), (64, 64, 125), (40, 33, 17)] {
            let w: Vec<i8> = (0..m * k).map(|_| rng.i8(..)).collect();
            let mut x: Vec<u8> = (0..n * k).map(|_| rng.u8(..)).collect();
            x.extend([0u8; 4]);
            let weights = Weights::pack_in(&w, m, k, LANES);
            for kernel in [TileKernel::Portable].into_iter().chain(TileKernel::available()) {
                let mut got = vec![0i32; n * m];
                pixel_rows_on(kernel, &weights, &x, k, n, |p0, c0, tile| {
                    for p in 0..PIXELS.min(n - p0) {
                        for c in 0..LANES.min(m - c0) {
                            got[(p0 + p) * m + c0 + c] = tile[p * LANES + c];
                        }
                    }
                });
                for p in 0..n {
                    for c in 0..m {
                        let want: i32 = (0..k).map(|i| x[p * k + i] as i32 * w[c * k + i] as i32).sum();
                        assert_eq!(got[p * m + c], want, "{kernel:?}, {m}x{k}x{n}: pixel {p} channel {c}");
                    }
                }
            }
        }
    }

    /// Every kernel here, and the portable one, against sums computed
    /// from the unpacked values, on panels and quads cut at every edge.
    #[test]
    fn products_are_exact_on_every_tile_and_quad_edge() {
        let mut rng = fastrand::Rng::with_seed(17);
        for &(m, k, n) in
            &[(1, 1, 1), (3, 5, 7), (4, 4, 16), (16, 27, 1024), (9, 145, 17), (64, 576, 64), (5, 3, 33)]
        {
            let w: Vec<i8> = (0..m * k).map(|_| rng.i8(..)).collect();
            let x: Vec<i8> = (0..k * n).map(|_| rng.i8(..)).collect();
            // A 1x1 convolution of k channels over a 1 x n image: its patch
            // matrix is x itself (k x n), contiguous columns.
            let g = Geometry {
                in_channels: k,
                out_channels: m,
                height: 1,
                width: n,
                kernel: [1, 1],
                strides: [1, 1],
                dilations: [1, 1],
                pads: [0; 4],
            };
            let layout = PatchLayout::new(&g, NR).unwrap();
            let (mut plane, mut patches) = (Vec::new(), Patches::default());
            flip_padded(&g, &x, 0, &mut plane);
            patches.pack(&plane, &layout);
            let weights = Weights::pack(&w, m, k);
            for kernel in [TileKernel::Portable].into_iter().chain(TileKernel::available()) {
                let mut got = vec![0i32; m * n];
                product_on(kernel, &weights, &patches, |r0, c0, tile| {
                    for i in 0..MR.min(m - r0) {
                        for j in 0..NR.min(n - c0) {
                            got[(r0 + i) * n + c0 + j] = tile[i * NR + j];
                        }
                    }
                });
                for i in 0..m {
                    for j in 0..n {
                        let dot: i32 = (0..k).map(|t| w[i * k + t] as i32 * x[t * n + j] as i32).sum();
                        // With zx = 0 the correction takes out exactly the +128.
                        let corrected = got[i * n + j] + weights.weight_offsets(0).nth(i).unwrap();
                        assert_eq!(corrected, dot, "{}: {m}x{k}x{n} at {i},{j}", kernel.name());
                    }
                }
            }
        }
    }
}
