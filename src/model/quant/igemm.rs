//! Our i8 x i8 -> i32 matrix product for x86-64 AVX2 hosts, where
//! tract-linalg's `avx2_mmm_i32_8x8` widens each byte and multiplies in
//! 16-bit lanes one k at a time (4 multiply-adds a cycle, measured: 196 us
//! for a 16x144x1024 product; docs/BENCHMARKS.md). Here both operands are
//! widened to i16 *with their zero points subtracted* when they are packed,
//! so `vpmaddwd` does 16 exact multiply-adds per instruction (|x - z| <=
//! 255, so a pair sums to at most 130,050) and no zero-point correction is
//! left for the epilogue.
//!
//! Layout: the left operand in panels of `MR` rows and the right one in
//! panels of `NR = 16` columns, both as k-pairs: one u32 per row (or
//! column) and pair of k holding `(v[2p] - z) | (v[2p + 1] - z) << 16`.

#[cfg(target_arch = "x86_64")]
use super::cpu::{avx2, avx512};
use super::patches::PatchLayout;

/// Columns of a right-hand panel: two ymm registers of eight i32.
pub const NR: usize = 16;

/// A left operand packed in panels of `mr` rows.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Left {
    pub rows: usize,
    pub k: usize,
    pub mr: usize,
    data: Vec<u32>,
}

/// A right operand packed in panels of `NR` columns.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Right {
    pub cols: usize,
    pub k: usize,
    data: Vec<u32>,
}

#[inline(always)]
fn pair(a: i32, b: i32) -> u32 {
    (a as i16 as u16 as u32) | ((b as i16 as u16 as u32) << 16)
}

impl Left {
    /// `values` is row-major `rows x k`; `zero(r)` is row r's zero point.
    pub fn pack(values: &[i8], rows: usize, k: usize, mr: usize, zero: impl Fn(usize) -> i32) -> Left {
        let k2 = k.div_ceil(2);
        let panels = rows.div_ceil(mr);
        let mut data = vec![0u32; panels * k2 * mr];
        for r in 0..rows {
            let (p, i) = (r / mr, r % mr);
            let z = zero(r);
            let row = &values[r * k..(r + 1) * k];
            for kp in 0..k2 {
                let lo = row[2 * kp] as i32 - z;
                let hi = if 2 * kp + 1 < k { row[2 * kp + 1] as i32 - z } else { 0 };
                data[(p * k2 + kp) * mr + i] = pair(lo, hi);
            }
        }
        Left { rows, k, mr, data }
    }

    fn panel(&self, p: usize) -> &[u32] {
        let len = self.k.div_ceil(2) * self.mr;
        &self.data[p * len..(p + 1) * len]
    }
}

impl Right {
    /// Packs columns given as rows of `k` values (`cols x k`, row-major: a
    /// weight matrix stored per output, or a batch of dense inputs);
    /// `zero(c)` is column c's zero point.
    pub fn pack_transposed(values: &[i8], cols: usize, k: usize, zero: impl Fn(usize) -> i32) -> Right {
        let k2 = k.div_ceil(2);
        let mut right = Right { cols, k, data: vec![0u32; cols.div_ceil(NR) * k2 * NR] };
        for c in 0..cols {
            let z = zero(c);
            let col = &values[c * k..(c + 1) * k];
            let (p, j) = (c / NR, c % NR);
            for kp in 0..k2 {
                let lo = col[2 * kp] as i32 - z;
                let hi = if 2 * kp + 1 < k { col[2 * kp + 1] as i32 - z } else { 0 };
                right.data[(p * k2 + kp) * NR + j] = pair(lo, hi);
            }
        }
        right
    }

    /// Packs the patch matrix of an image already widened and padded
    /// (`patches::widen_padded`) as `layout` says: per panel and pair of
    /// rows, one 32-byte load per row and an interleave where the panel's
    /// columns are contiguous, a gather elsewhere.
    pub fn pack_patches(&mut self, plane: &[i16], layout: &PatchLayout) {
        let (k, cols) = (layout.row_offsets.len(), layout.column_offsets.len());
        self.cols = cols;
        self.k = k;
        // Every word is written below: no need to clear what is reused.
        self.data.resize(cols.div_ceil(NR) * k.div_ceil(2) * NR, 0);
        #[cfg(target_arch = "x86_64")]
        if avx2() {
            return unsafe { pack_patches_avx2(&mut self.data, plane, layout) };
        }
        pack_patches_portable(&mut self.data, plane, layout, 0..cols.div_ceil(NR));
    }

    fn panel(&self, p: usize) -> &[u32] {
        let len = self.k.div_ceil(2) * NR;
        &self.data[p * len..(p + 1) * len]
    }
}

/// How a tile is computed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TileKernel {
    Portable,
    #[cfg(target_arch = "x86_64")]
    Avx2,
    /// One zmm register per row of the tile, `vpdpwssd` per pair of k.
    #[cfg(target_arch = "x86_64")]
    Avx512Vnni,
}

impl TileKernel {
    /// Every kernel this host can run, fastest first.
    pub fn available() -> Vec<TileKernel> {
        let mut kernels = Vec::new();
        #[cfg(target_arch = "x86_64")]
        {
            if avx512().is_some_and(|a| a.vnni) {
                kernels.push(TileKernel::Avx512Vnni);
            }
            if avx2() {
                kernels.push(TileKernel::Avx2);
            }
        }
        kernels.push(TileKernel::Portable);
        kernels
    }

    /// The best one here, found once: `product` runs on every inference,
    /// and `available` allocates and reads the environment.
    pub fn best() -> TileKernel {
        static BEST: std::sync::OnceLock<TileKernel> = std::sync::OnceLock::new();
        *BEST.get_or_init(|| TileKernel::available()[0])
    }

    /// The ones worth timing here: every SIMD kernel the host has (the
    /// portable one only where it has none).
    pub fn timed() -> Vec<TileKernel> {
        let all = TileKernel::available();
        let simd: Vec<TileKernel> = all.iter().copied().filter(|&k| k != TileKernel::Portable).collect();
        if simd.is_empty() { all } else { simd }
    }

    /// Every kernel this build has (whether or not the host runs it).
    const ALL: &[TileKernel] = &[
        TileKernel::Portable,
        #[cfg(target_arch = "x86_64")]
        TileKernel::Avx2,
        #[cfg(target_arch = "x86_64")]
        TileKernel::Avx512Vnni,
    ];

    /// A short name for the kernel choices (the cache file, the fail point).
    pub fn id(self) -> &'static str {
        match self {
            TileKernel::Portable => "i16_portable",
            #[cfg(target_arch = "x86_64")]
            TileKernel::Avx2 => "i16_avx2",
            #[cfg(target_arch = "x86_64")]
            TileKernel::Avx512Vnni => "i16_avx512_vnni",
        }
    }

    /// The kernel `id` names, if this build has it.
    pub fn from_id(id: &str) -> Option<TileKernel> {
        TileKernel::ALL.iter().copied().find(|k| k.id() == id)
    }

    /// As `models profile` and the plan's node info report it.
    pub fn name(self) -> &'static str {
        match self {
            TileKernel::Portable => "edgeinfer portable i16x2",
            #[cfg(target_arch = "x86_64")]
            TileKernel::Avx2 => "edgeinfer avx2 i16x2",
            #[cfg(target_arch = "x86_64")]
            TileKernel::Avx512Vnni => "edgeinfer avx512 vnni i16x2",
        }
    }
}

/// `left x right`, one `mr x NR` tile at a time, each handed to `emit(row,
/// col, tile)` with the tile's exact i32 sums (`tile[i * NR + j]` for row
/// `row + i`, column `col + j`; rows and columns past the ends are zero).
pub fn product(left: &Left, right: &Right, emit: impl FnMut(usize, usize, &[i32])) {
    product_on(TileKernel::best(), left, right, emit)
}

/// `product` on a given kernel (the tests compare them all).
pub fn product_on(
    kernel: TileKernel,
    left: &Left,
    right: &Right,
    mut emit: impl FnMut(usize, usize, &[i32]),
) {
    assert_eq!(left.k, right.k, "product: inner dimensions differ");
    let k2 = left.k.div_ceil(2);
    let mut tile = [0i32; 4 * NR];
    for cp in 0..right.cols.div_ceil(NR) {
        let b = right.panel(cp);
        for rp in 0..left.rows.div_ceil(left.mr) {
            let a = left.panel(rp);
            let tile = &mut tile[..left.mr * NR];
            // SAFETY: each kernel is chosen only where the host has its
            // features (`TileKernel::available`); the slices are checked.
            match (kernel, left.mr) {
                #[cfg(target_arch = "x86_64")]
                (TileKernel::Avx512Vnni, 4) => unsafe { avx512_vnni_tile::<4, false>(a, b, k2, tile) },
                #[cfg(target_arch = "x86_64")]
                (TileKernel::Avx512Vnni, 1) => unsafe { avx512_vnni_tile::<1, false>(a, b, k2, tile) },
                #[cfg(target_arch = "x86_64")]
                (TileKernel::Avx2, 4) => unsafe { avx2_tile::<4>(a, b, k2, tile) },
                #[cfg(target_arch = "x86_64")]
                (TileKernel::Avx2, 1) => unsafe { avx2_tile::<1>(a, b, k2, tile) },
                _ => portable_tile(a, b, k2, left.mr, tile),
            }
            emit(rp * left.mr, cp * NR, tile);
        }
    }
}

fn portable_tile(a: &[u32], b: &[u32], k2: usize, mr: usize, tile: &mut [i32]) {
    tile.fill(0);
    let half = |v: u32, hi: bool| (if hi { v >> 16 } else { v } as u16 as i16) as i32;
    for kp in 0..k2 {
        for i in 0..mr {
            let av = a[kp * mr + i];
            let (a0, a1) = (half(av, false), half(av, true));
            for j in 0..NR {
                let bv = b[kp * NR + j];
                tile[i * NR + j] += a0 * half(bv, false) + a1 * half(bv, true);
            }
        }
    }
}

/// Panels `panels` of the patch matrix, one column at a time.
fn pack_patches_portable(
    data: &mut [u32],
    plane: &[i16],
    layout: &PatchLayout,
    panels: std::ops::Range<usize>,
) {
    let (k, cols) = (layout.row_offsets.len(), layout.column_offsets.len());
    let k2 = k.div_ceil(2);
    for p in panels {
        let columns = &layout.column_offsets[p * NR..cols.min((p + 1) * NR)];
        let panel = &mut data[p * k2 * NR..(p + 1) * k2 * NR];
        for (kp, out) in panel.chunks_exact_mut(NR).enumerate() {
            let r0 = layout.row_offsets[2 * kp];
            let r1 = layout.row_offsets.get(2 * kp + 1).copied();
            for (o, &col) in out.iter_mut().zip(columns) {
                let hi = r1.map(|r| plane[r + col]).unwrap_or(0);
                *o = pair(plane[r0 + col] as i32, hi as i32);
            }
            out[columns.len()..].fill(0);
        }
    }
}

/// The contiguous panels with two loads and an interleave per pair of
/// rows (inlined here, where AVX2 is enabled), the others portably.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn pack_patches_avx2(data: &mut [u32], plane: &[i16], layout: &PatchLayout) {
    let (k, cols) = (layout.row_offsets.len(), layout.column_offsets.len());
    let k2 = k.div_ceil(2);
    for p in 0..cols.div_ceil(NR) {
        if !layout.contiguous[p] {
            pack_patches_portable(data, plane, layout, p..p + 1);
            continue;
        }
        let first = layout.column_offsets[p * NR];
        let panel = &mut data[p * k2 * NR..(p + 1) * k2 * NR];
        for (kp, out) in panel.chunks_exact_mut(NR).enumerate() {
            let a = &plane[layout.row_offsets[2 * kp] + first..][..NR];
            let b = layout.row_offsets.get(2 * kp + 1).map(|&r| &plane[r + first..][..NR]);
            unsafe { interleave_avx2(out, a, b) };
        }
    }
}

/// `out[j] = a[j] | b[j] << 16` for 16 columns: unpack the two rows' i16
/// lanes (which interleaves within each 128-bit half) and put the halves
/// back in column order.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
#[inline]
unsafe fn interleave_avx2(out: &mut [u32], a: &[i16], b: Option<&[i16]>) {
    use std::arch::x86_64::*;
    assert!(out.len() >= NR && a.len() >= NR && b.is_none_or(|b| b.len() >= NR));
    unsafe {
        let va = _mm256_loadu_si256(a.as_ptr() as *const __m256i);
        let vb = match b {
            Some(b) => _mm256_loadu_si256(b.as_ptr() as *const __m256i),
            None => _mm256_setzero_si256(),
        };
        let lo = _mm256_unpacklo_epi16(va, vb); // columns 0-3 | 8-11
        let hi = _mm256_unpackhi_epi16(va, vb); // columns 4-7 | 12-15
        let first = _mm256_permute2x128_si256(lo, hi, 0x20);
        let second = _mm256_permute2x128_si256(lo, hi, 0x31);
        _mm256_storeu_si256(out.as_mut_ptr() as *mut __m256i, first);
        _mm256_storeu_si256(out.as_mut_ptr().add(8) as *mut __m256i, second);
    }
}

/// The register tile: `MR` rows x 16 columns in `2 * MR` ymm accumulators;
/// per pair of k, two loads of the right panel, `MR` broadcasts of the left
/// and `2 * MR` `vpmaddwd`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn avx2_tile<const MR: usize>(a: &[u32], b: &[u32], k2: usize, tile: &mut [i32]) {
    use std::arch::x86_64::*;
    assert!(a.len() >= k2 * MR && b.len() >= k2 * NR && tile.len() >= MR * NR);
    unsafe {
        let mut acc = [[_mm256_setzero_si256(); 2]; MR];
        let (pa, pb) = (a.as_ptr(), b.as_ptr());
        for kp in 0..k2 {
            let b0 = _mm256_loadu_si256(pb.add(kp * NR) as *const __m256i);
            let b1 = _mm256_loadu_si256(pb.add(kp * NR + 8) as *const __m256i);
            for (i, row) in acc.iter_mut().enumerate() {
                let av = _mm256_set1_epi32(*pa.add(kp * MR + i) as i32);
                row[0] = _mm256_add_epi32(row[0], _mm256_madd_epi16(av, b0));
                row[1] = _mm256_add_epi32(row[1], _mm256_madd_epi16(av, b1));
            }
        }
        let out = tile.as_mut_ptr();
        for (i, row) in acc.iter().enumerate() {
            _mm256_storeu_si256(out.add(i * NR) as *mut __m256i, row[0]);
            _mm256_storeu_si256(out.add(i * NR + 8) as *mut __m256i, row[1]);
        }
    }
}

/// The register tile on AVX-512 VNNI, for our products on i16 pairs and on
/// byte quads (`udot.rs`) alike: a whole 16-column panel is one zmm, so per
/// step of k it takes one load of the panel, `MR` broadcasts and `MR` dot
/// products: `vpdpwssd` on i16 pairs, or with `QUADS` `vpdpbusd` on u8 x s8
/// quads (the panel is the unsigned side). Even and odd steps go to separate
/// accumulators, so the additions of one row do not wait on each other.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
pub(super) unsafe fn avx512_vnni_tile<const MR: usize, const QUADS: bool>(
    a: &[u32],
    b: &[u32],
    steps: usize,
    tile: &mut [i32],
) {
    use std::arch::x86_64::*;
    assert!(a.len() >= steps * MR && b.len() >= steps * NR && tile.len() >= MR * NR);
    unsafe {
        let mut even = [_mm512_setzero_si512(); MR];
        let mut odd = [_mm512_setzero_si512(); MR];
        let (pa, pb) = (a.as_ptr(), b.as_ptr());
        // A macro, not a closure: closures do not inherit the function's
        // target features, so their intrinsics would become calls.
        macro_rules! step {
            ($acc:ident, $k:expr) => {
                let panel = _mm512_loadu_si512(pb.add($k * NR) as *const __m512i);
                for (i, row) in $acc.iter_mut().enumerate() {
                    let w = _mm512_set1_epi32(*pa.add($k * MR + i) as i32);
                    *row = if QUADS {
                        _mm512_dpbusd_epi32(*row, panel, w)
                    } else {
                        _mm512_dpwssd_epi32(*row, panel, w)
                    };
                }
            };
        }
        let mut k = 0;
        while k + 1 < steps {
            step!(even, k);
            step!(odd, k + 1);
            k += 2;
        }
        if k < steps {
            step!(even, k);
        }
        let out = tile.as_mut_ptr();
        for i in 0..MR {
            _mm512_storeu_si512(out.add(i * NR) as *mut __m512i, _mm512_add_epi32(even[i], odd[i]));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn products_are_exact_with_zero_points_on_every_tile_edge() {
        let mut rng = fastrand::Rng::with_seed(11);
        for &(m, k, n, mr) in &[
            (1, 1, 1, 1),
            (3, 5, 7, 4),
            (16, 27, 1024, 4),
            (5, 64, 33, 1),
            (9, 145, 17, 4),
            (64, 576, 64, 4),
        ] {
            let a: Vec<i8> = (0..m * k).map(|_| rng.i8(..)).collect();
            let b: Vec<i8> = (0..k * n).map(|_| rng.i8(..)).collect();
            let za: Vec<i32> = (0..m).map(|_| rng.i32(-128..128)).collect();
            let zb = rng.i32(-128..128);
            let left = Left::pack(&a, m, k, mr, |r| za[r]);
            let bt: Vec<i8> = (0..n * k).map(|i| b[(i % k) * n + i / k]).collect();
            let right = Right::pack_transposed(&bt, n, k, |_| zb);
            for kernel in TileKernel::available() {
                let mut got = vec![0i32; m * n];
                product_on(kernel, &left, &right, |r0, c0, tile| {
                    for i in 0..mr.min(m - r0) {
                        for j in 0..NR.min(n - c0) {
                            got[(r0 + i) * n + c0 + j] = tile[i * NR + j];
                        }
                    }
                });
                for i in 0..m {
                    for j in 0..n {
                        let want: i32 =
                            (0..k).map(|x| (a[i * k + x] as i32 - za[i]) * (b[x * n + j] as i32 - zb)).sum();
                        let kernel = kernel.name();
                        assert_eq!(got[i * n + j], want, "{kernel}: {m}x{k}x{n} mr {mr} at {i},{j}");
                    }
                }
            }
        }
    }
}
