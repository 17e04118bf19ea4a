//! i8 x i8 -> i32 matrix products on tract-linalg's integer kernels (VNNI
//! and AVX2 on x86-64, SDOT/NEON on arm64, picked by `MmmDispatch` for the
//! host), with the weights packed once at load and the activations packed
//! per run, straight into the kernel's panel layout where we know it.

use super::requant::per;
use tract_onnx::prelude::*;
use tract_onnx::tract_core::tract_linalg::WeightType;
use tract_onnx::tract_core::tract_linalg::mmm::{
    AsInputValue, EagerPackedInput, FusedSpec, MMMInputFormat, MMMInputValue, MatMatMul, PackedExoticFact,
};
use tract_onnx::tract_core::tract_linalg::pack::{PackedFormat, PackedI8K4};
use tract_onnx::tract_core::tract_linalg::{MmmDispatch, mmm::Query};

/// A constant `m x k` i8 matrix (the weights, one row per output channel),
/// packed for the kernel chosen for products with `n` columns.
pub struct Weights {
    mmm: Box<dyn MatMatMul>,
    packing: usize,
    a: Box<dyn MMMInputValue>,
    pub m: usize,
    pub k: usize,
    /// Sum of each row, for the activation zero-point correction.
    row_sums: Vec<i32>,
}

impl std::fmt::Debug for Weights {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Weights({}x{} on {})", self.m, self.k, self.mmm.name())
    }
}

impl Weights {
    /// `w` is row-major `m x k`; `n` is the expected number of columns of
    /// the other operand (it decides the kernel's tile shape).
    pub fn new(w: &[i8], m: usize, k: usize, n: Option<usize>) -> TractResult<Weights> {
        anyhow::ensure!(w.len() == m * k, "weights: {} values for {m}x{k}", w.len());
        let query = Query {
            weight: WeightType::Plain(DatumType::I8),
            activation: DatumType::I8,
            accumulators: tvec!(DatumType::I32),
            store: Some(DatumType::I32),
            allow_extractor: false,
            m: Some(m),
            k: Some(k),
            n,
        };
        let (mmm, packing, _) = MmmDispatch::native()
            .pick(&query)
            .ok_or_else(|| anyhow::anyhow!("tract-linalg has no i8 x i8 -> i32 kernel for this host"))?;
        let t = Tensor::from_shape(&[m, k], w)?;
        let a = mmm.packings()[packing].0.prepare_one(&t, 1, 0)?;
        let row_sums = w.chunks(k.max(1)).map(|r| r.iter().map(|&v| v as i32).sum()).collect();
        Ok(Weights { mmm, packing, a, m, k, row_sums })
    }

    /// What to add to each row's raw sum so it equals the sum over
    /// `(x - zx) * (w - zw)`: `bias - zx * sum(w) + k * zx * zw`. tract's
    /// kernels multiply raw stored values; the `- zw * sum(x)` term, when a
    /// weight zero point is not 0, is the caller's (it depends on x).
    pub fn offsets(&self, bias: &[i32], weight_zero: &[i32], zx: i32) -> Vec<i32> {
        (0..self.m)
            .map(|c| per(bias, c) - zx * self.row_sums[c] + self.k as i32 * zx * per(weight_zero, c))
            .collect()
    }

    pub fn kernel_name(&self) -> String {
        self.mmm.name().to_string()
    }

    fn b_format(&self) -> &dyn MMMInputFormat {
        &*self.mmm.packings()[self.packing].1
    }

    /// Packs `b`, a row-major `k x n` i8 matrix, for this kernel.
    pub fn pack_b(&self, b: &[i8], n: usize) -> TractResult<Box<dyn MMMInputValue>> {
        anyhow::ensure!(b.len() == self.k * n, "activations: {} values for {}x{n}", b.len(), self.k);
        let format = self.b_format();
        if let Some(k4) = format.downcast_ref::<PackedI8K4>() {
            return Ok(pack_k4(k4, b, self.k, n));
        }
        let t = Tensor::from_shape(&[self.k, n], b)?;
        format.prepare_one(&t, 0, 1)
    }

    /// The kernel's activation layout when it is tract-linalg's plain
    /// panels of bytes (AVX2, NEON), which `patches::pack_panels` writes.
    pub fn b_panels(&self) -> Option<&PackedFormat> {
        self.b_format().downcast_ref::<PackedFormat>().filter(|f| f.dt.size_of() == 1)
    }

    /// Activations already packed as `b_panels` says, `n` columns.
    pub fn packed_b(&self, packed: Blob, n: usize) -> Box<dyn MMMInputValue> {
        let format = self.b_panels().expect("packed_b only follows b_panels").clone();
        let panel_bytes = format.single_panel_len(self.k);
        Box::new(EagerPackedInput {
            fact: PackedExoticFact { format: Box::new(format), mn: n.to_dim(), k: self.k },
            packed: Arc::new(packed),
            panel_bytes,
            mn: n,
        })
    }

    /// Packs the transpose of `x`, a row-major `n x k` matrix (one row per
    /// column of the product: a batch of dense inputs).
    pub fn pack_b_transposed(&self, x: &[i8], n: usize) -> TractResult<Box<dyn MMMInputValue>> {
        anyhow::ensure!(x.len() == self.k * n, "activations: {} values for {n}x{}", x.len(), self.k);
        if self.b_format().downcast_ref::<PackedI8K4>().is_some() {
            // Through `pack_k4`, for the room the AMX kernels read past k.
            let b: Vec<i8> = (0..self.k * n).map(|i| x[(i % n) * self.k + i / n]).collect();
            return self.pack_b(&b, n);
        }
        let t = Tensor::from_shape(&[n, self.k], x)?;
        self.b_format().prepare_one(&t, 1, 0)
    }

    /// `c = self x b` as i32, `c` of shape `[m, n]` (or `[n, m]` when
    /// `transposed`), row-major.
    pub fn product(
        &self,
        b: &dyn MMMInputValue,
        n: usize,
        c: &mut Tensor,
        transposed: bool,
    ) -> TractResult<()> {
        let expected: &[usize] = if transposed { &[n, self.m] } else { &[self.m, n] };
        anyhow::ensure!(c.shape() == expected && c.datum_type() == DatumType::I32, "product: bad output");
        unsafe {
            let spec = if transposed {
                self.mmm.c_view(Some(1), Some(0))
            } else {
                self.mmm.c_view(Some(0), Some(1))
            };
            let store = spec.wrap(&c.view_mut());
            let ops = [
                FusedSpec::AddMatMul {
                    a: AsInputValue::Borrowed(&*self.a),
                    b: AsInputValue::Borrowed(b),
                    packing: self.packing,
                },
                FusedSpec::Store(store),
            ];
            self.mmm.run(self.m, n, &ops)
        }
    }
}

/// tract-linalg's K=4-inner panels (the VNNI and dot-product layout): for
/// each panel of `r` columns and each group of four rows,
/// `out[(k / 4) * r * 4 + col * 4 + k % 4] = b[k][col]`, rows padded with
/// zeros to a multiple of four. Four source rows are interleaved a word at a
/// time, which the compiler vectorises; tract's generic packer goes a byte
/// at a time through strides.
///
/// The blob ends with zeros up to k rounded to 64 past the last panel:
/// tract-linalg 0.23.9's AMX kernels (`avx512amx_mmm_i32_8x8`, `_16x16`)
/// load B in tiles of 64 k whatever k is, so on the last panel they read
/// past a buffer padded to 4 only (their results stay exact: A is padded
/// with zeros to 64), and crashed the process (SIGSEGV) where that read
/// crossed into an unmapped page: seen here in `qconv_is_bit_exact`.
fn pack_k4(format: &PackedI8K4, b: &[i8], k: usize, n: usize) -> Box<dyn MMMInputValue> {
    let r = format.r;
    let kp = k.div_ceil(4) * 4;
    let panel = kp * r;
    let panels = n.div_ceil(r);
    let over_read = (k.div_ceil(64) * 64 - kp) * r;
    let mut blob = unsafe { Blob::new_for_size_and_align(panels * panel + over_read, format.alignment()) };
    blob.as_bytes_mut()[panels * panel..].fill(0);
    let words = as_words(&mut blob.as_bytes_mut()[..panels * panel]);
    let zeros = vec![0i8; if k.is_multiple_of(4) { 0 } else { n }];
    for kb in 0..kp / 4 {
        let row = |i: usize| -> &[i8] {
            let kk = kb * 4 + i;
            if kk < k { &b[kk * n..(kk + 1) * n] } else { &zeros }
        };
        let rows = [row(0), row(1), row(2), row(3)];
        for p in 0..panels {
            let c0 = p * r;
            let width = r.min(n - c0);
            let dst = &mut words[(p * panel + kb * r * 4) / 4..][..r];
            interleave4(&mut dst[..width], rows.map(|row| &row[c0..c0 + width]));
            dst[width..].fill(0);
        }
    }
    Box::new(EagerPackedInput {
        fact: PackedExoticFact { format: Box::new(format.clone()), mn: n.to_dim(), k },
        packed: Arc::new(blob),
        panel_bytes: panel,
        mn: n,
    })
}

/// `dst[i]` = the i-th bytes of the four rows, in memory order: equal-length
/// slices so the bounds checks go and the loop vectorises (byte unpacks).
#[inline]
fn interleave4(dst: &mut [u32], [a, b, c, d]: [&[i8]; 4]) {
    let len = dst.len();
    let (a, b, c, d) = (&a[..len], &b[..len], &c[..len], &d[..len]);
    for i in 0..len {
        dst[i] = u32::from_ne_bytes([a[i] as u8, b[i] as u8, c[i] as u8, d[i] as u8]);
    }
}

/// A 4-byte-aligned byte slice as words (the blob is aligned to 16 and its
/// length, panels of `4 * r` bytes, a multiple of 4).
fn as_words(bytes: &mut [u8]) -> &mut [u32] {
    assert!((bytes.as_ptr() as usize).is_multiple_of(4) && bytes.len().is_multiple_of(4));
    unsafe { std::slice::from_raw_parts_mut(bytes.as_mut_ptr() as *mut u32, bytes.len() / 4) }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reference(a: &[i8], b: &[i8], m: usize, k: usize, n: usize) -> Vec<i32> {
        let mut c = vec![0i32; m * n];
        for i in 0..m {
            for j in 0..n {
                c[i * n + j] = (0..k).map(|x| a[i * k + x] as i32 * b[x * n + j] as i32).sum();
            }
        }
        c
    }

    #[test]
    fn products_match_the_scalar_reference_on_awkward_shapes() {
        let mut rng = fastrand::Rng::with_seed(7);
        for &(m, k, n) in &[(1, 1, 1), (3, 5, 7), (16, 27, 1024), (10, 64, 1), (33, 145, 9), (64, 576, 64)] {
            let a: Vec<i8> = (0..m * k).map(|_| rng.i8(..)).collect();
            let b: Vec<i8> = (0..k * n).map(|_| rng.i8(..)).collect();
            let w = Weights::new(&a, m, k, Some(n)).unwrap();
            let packed = w.pack_b(&b, n).unwrap();
            let mut c = Tensor::zero::<i32>(&[m, n]).unwrap();
            w.product(&*packed, n, &mut c, false).unwrap();
            let want = reference(&a, &b, m, k, n);
            assert_eq!(
                c.try_as_plain_ram().unwrap().as_slice::<i32>().unwrap(),
                &want[..],
                "{m}x{k}x{n} on {w:?}"
            );
        }
    }

    #[test]
    fn our_k4_packing_lays_bytes_out_as_tracts_own() {
        let mut rng = fastrand::Rng::with_seed(3);
        for &(k, n, r) in &[(1, 1, 8), (5, 9, 8), (27, 33, 16), (64, 8, 8)] {
            let b: Vec<i8> = (0..k * n).map(|_| rng.i8(..)).collect();
            let format = PackedI8K4::new(r);
            let ours = pack_k4(&format, &b, k, n);
            let theirs = format.prepare_one(&Tensor::from_shape(&[k, n], &b).unwrap(), 0, 1).unwrap();
            let bytes = |v: &dyn MMMInputValue| {
                let e = v.downcast_ref::<EagerPackedInput>().unwrap();
                (e.packed.as_bytes().to_vec(), e.panel_bytes, e.mn)
            };
            let (mut ours, theirs) = (bytes(&*ours), bytes(&*theirs));
            // Then zeros, as far as a kernel reading k in blocks of 64 goes.
            let tail = ours.0.split_off(theirs.0.len());
            assert_eq!(ours, theirs, "k {k} n {n} r {r}");
            assert_eq!(tail, vec![0; (k.div_ceil(64) * 64 - k.div_ceil(4) * 4) * r], "k {k} n {n} r {r}");
        }
    }
}
