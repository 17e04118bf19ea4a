//! `QConv`: an int8 2-D convolution (group 1, NCHW, any kernel size,
//! stride, padding and dilation) as one matrix product per image on
//! tract-linalg's integer kernels. The patch matrix is built straight from
//! the int8 input (row copies, no `Im2col` node) and packed once; a 1x1
//! stride-1 convolution packs its input as it is. Bias, zero points,
//! per-channel requantization and the ReLU/ReLU6 clamp are one pass over
//! each output row.

use super::choice::Kernel;
use super::gemm::Weights;
use super::igemm;
use super::patches::{Layout, PatchLayout, flip_padded, im2col, pack_panels, widen_padded};
use super::requant::{multipliers, output_range, per, requantize_lanes, requantize_row};
#[cfg(target_arch = "x86_64")]
use super::requant::{requantize_tile_avx2, requantize_tile_avx512};
use super::spec::{ConvSpec, conv_output_facts, eval_conv};
use super::udot;
use std::sync::Arc;
use tract_onnx::prelude::*;
use tract_onnx::tract_core::internal::*;

/// Where the products run: our kernels (`igemm`) or tract-linalg's, as
/// timing both on the layer decided (`choice.rs`); tract-linalg's on hosts
/// without AVX2 (arm64 NEON/SDOT).
#[derive(Debug, Clone)]
pub(super) enum Backend {
    /// The byte dot-product tile, where the host has one and the weights'
    /// zero points are all 0 (`udot.rs`).
    Bytes(Arc<udot::Weights>, Arc<PatchLayout>, udot::TileKernel),
    Ours(Arc<igemm::Left>, Arc<PatchLayout>, igemm::TileKernel),
    Tract(Arc<Weights>),
}

#[derive(Debug, Clone)]
pub struct QConv {
    pub spec: Arc<ConvSpec>,
    backend: Backend,
    /// What is added to each output channel's exact sum: the bias, and on
    /// tract's kernels (which see raw i8 values) the zero-point corrections
    /// `- zx * sum(w) + K * zx * zw`.
    offsets: Arc<Vec<i32>>,
    multipliers: Arc<Vec<f32>>,
    any_weight_zero: bool,
    /// How the input sits in memory: channels-first, or channels-last from
    /// a depthwise layer before it (`taking_channels_last`).
    input_layout: Layout,
    /// How the output sits in memory: channels-first, or channels-last for
    /// the depthwise layers after it (`giving_channels_last`), computed by
    /// the channels-in-lanes tile with these weights.
    output_layout: Layout,
    pixel_weights: Option<Arc<udot::Weights>>,
    /// The byte tile a channels-last hand-off moves it to when it runs on
    /// the i16 tile: the fastest byte tile measured on this layer (none
    /// measured: the host's first).
    pub(super) hand_off_tile: Option<udot::TileKernel>,
}

impl PartialEq for QConv {
    fn eq(&self, other: &Self) -> bool {
        self.spec == other.spec
    }
}

impl QConv {
    /// On the given kernels (`choice::Chooser` picks them per layer among
    /// `candidates`).
    pub fn on(spec: ConvSpec, kernel: Kernel) -> TractResult<QConv> {
        let mut op = QConv::build(spec, kernel == Kernel::Tract)?;
        let (backend, offsets) = match kernel {
            Kernel::Bytes(tile) => {
                let zero = op.spec.weight_zero.iter().all(|&z| z == 0);
                anyhow::ensure!(zero, "the byte tile needs weight zero points of 0");
                QConv::bytes_backend(&op.spec, tile)?
            }
            Kernel::I16(tile) => QConv::i16_backend(&op.spec, tile)?,
            Kernel::Ours | Kernel::Tract | Kernel::Depthwise(_) => return Ok(op),
        };
        (op.backend, op.offsets) = (backend, Arc::new(offsets));
        Ok(op)
    }

    /// The kernels a layer of `spec` can run here, our default form first:
    /// each byte tile the host has (where the weights' zero points are 0),
    /// each of its i16 tiles and tract-linalg's.
    pub fn candidates(spec: &ConvSpec) -> Vec<Kernel> {
        let bytes = match spec.weight_zero.iter().all(|&z| z == 0) {
            true => udot::TileKernel::available(),
            false => Vec::new(),
        };
        let default = match bytes.first() {
            Some(&tile) if tile.dot_product() => Kernel::Bytes(tile),
            _ => Kernel::I16(igemm::TileKernel::best()),
        };
        let mut kernels = vec![default];
        let i16_tiles = igemm::TileKernel::timed().into_iter().map(Kernel::I16);
        let ours = bytes.into_iter().map(Kernel::Bytes).chain(i16_tiles);
        kernels.extend(ours.filter(|&k| k != default));
        kernels.push(Kernel::Tract);
        kernels
    }

    /// On tract-linalg's kernels whatever the host (tests compare both).
    pub fn on_tract_kernels(spec: ConvSpec) -> TractResult<QConv> {
        QConv::build(spec, true)
    }

    /// On our kernels (`igemm.rs`) whatever the host (tests compare both).
    pub fn on_our_kernels(spec: ConvSpec) -> TractResult<QConv> {
        QConv::build(spec, false)
    }

    /// On the byte tile `kernel` whatever the host has (tests run the
    /// portable one everywhere); the weights' zero points must be 0.
    #[cfg(test)]
    pub(super) fn on_byte_tile(spec: ConvSpec, kernel: udot::TileKernel) -> TractResult<QConv> {
        anyhow::ensure!(spec.weight_zero.iter().all(|&z| z == 0), "the byte tile needs zero points of 0");
        let mut op = QConv::build(spec, true)?;
        let (backend, offsets) = QConv::bytes_backend(&op.spec, kernel)?;
        (op.backend, op.offsets) = (backend, Arc::new(offsets));
        Ok(op)
    }

    /// On our i16 tile whatever the host has (a host whose byte tile
    /// lacks a dot product runs channels-first layers there).
    #[cfg(test)]
    pub(super) fn on_i16_tile(spec: ConvSpec) -> TractResult<QConv> {
        let mut op = QConv::build(spec, true)?;
        let (backend, offsets) = QConv::i16_backend(&op.spec, igemm::TileKernel::best())?;
        (op.backend, op.offsets) = (backend, Arc::new(offsets));
        Ok(op)
    }

    fn i16_backend(spec: &ConvSpec, tile: igemm::TileKernel) -> TractResult<(Backend, Vec<i32>)> {
        let g = spec.geometry;
        let left =
            igemm::Left::pack(&spec.weights, g.out_channels, g.patch_len(), 4, |c| per(&spec.weight_zero, c));
        let layout = PatchLayout::new(&g, igemm::NR)?;
        Ok((
            Backend::Ours(Arc::new(left), Arc::new(layout), tile),
            (0..g.out_channels).map(|c| per(&spec.bias, c)).collect(),
        ))
    }

    fn bytes_backend(spec: &ConvSpec, kernel: udot::TileKernel) -> TractResult<(Backend, Vec<i32>)> {
        let g = spec.geometry;
        let weights = udot::Weights::pack(&spec.weights, g.out_channels, g.patch_len());
        let zx = spec.input.zero_i8();
        let offsets = weights.weight_offsets(zx).enumerate().map(|(c, o)| o + per(&spec.bias, c)).collect();
        let layout = PatchLayout::new(&g, udot::NR)?;
        Ok((Backend::Bytes(Arc::new(weights), Arc::new(layout), kernel), offsets))
    }

    fn build(spec: ConvSpec, tract: bool) -> TractResult<QConv> {
        let g = spec.geometry;
        let [oh, ow] = g.output_hw()?;
        let k = g.patch_len();
        anyhow::ensure!(spec.weights.len() == g.out_channels * k, "QConv: weights do not match the geometry");
        let zx = spec.input.zero_i8();
        let (backend, offsets) = if tract {
            let weights = Weights::new(&spec.weights, g.out_channels, k, Some(oh * ow))?;
            let offsets = weights.offsets(&spec.bias, &spec.weight_zero, zx);
            (Backend::Tract(Arc::new(weights)), offsets)
        } else if let (Some(kernel), true, false) = (
            udot::TileKernel::best(),
            udot::TileKernel::best().is_some_and(udot::TileKernel::dot_product),
            spec.weight_zero.iter().any(|&z| z != 0),
        ) {
            QConv::bytes_backend(&spec, kernel)?
        } else {
            QConv::i16_backend(&spec, igemm::TileKernel::best())?
        };
        let multipliers = multipliers(&spec.input, &spec.weight_scale, &spec.output, g.out_channels);
        let any_weight_zero = spec.weight_zero.iter().any(|&z| z != 0);
        Ok(QConv {
            spec: Arc::new(spec),
            backend,
            offsets: Arc::new(offsets),
            multipliers: Arc::new(multipliers),
            any_weight_zero,
            input_layout: Layout::ChannelsFirst,
            output_layout: Layout::ChannelsFirst,
            pixel_weights: None,
            hand_off_tile: None,
        })
    }

    pub(super) fn kernel_name(&self) -> String {
        match &self.backend {
            Backend::Bytes(.., kernel) => kernel.name().into(),
            Backend::Ours(.., tile) => tile.name().into(),
            Backend::Tract(w) => w.kernel_name(),
        }
    }

    /// This op reading its input channels-last, where it can: a pointwise
    /// convolution on a byte tile (or on our i16 tile, which the timing
    /// chose on this layer, then moved to the fastest byte tile measured
    /// on it), whose packing then loads a pixel's channels four at a time
    /// instead of transposing. On tract-linalg's kernels it cannot.
    pub fn taking_channels_last(&self) -> Option<QConv> {
        if !self.spec.geometry.is_pointwise() {
            return None;
        }
        let mut op = QConv { input_layout: Layout::ChannelsLast, ..self.clone() };
        match (&self.backend, self.hand_off_tile.or(udot::TileKernel::best())) {
            (Backend::Bytes(..), _) => Some(op),
            // The byte tile then, for what the hand-off saves.
            (Backend::Ours(..), Some(kernel)) if !self.any_weight_zero => {
                let (backend, offsets) = QConv::bytes_backend(&self.spec, kernel).ok()?;
                (op.backend, op.offsets) = (backend, Arc::new(offsets));
                Some(op)
            }
            _ => None,
        }
    }

    /// This op, already reading channels-last, also writing channels-last,
    /// where the host has the channels-in-lanes tile (any byte tile): each
    /// tile row is one pixel's 16 output channels, stored as they are.
    pub fn giving_channels_last(&self) -> Option<QConv> {
        if self.input_layout != Layout::ChannelsLast || !udot::pixel_rows_fast() {
            return None;
        }
        let g = self.spec.geometry;
        let lanes = g.out_channels.div_ceil(udot::LANES) * udot::LANES;
        let (mut offsets, mut multipliers) = ((*self.offsets).clone(), (*self.multipliers).clone());
        offsets.resize(lanes, 0);
        multipliers.resize(lanes, 0.0);
        Some(QConv {
            output_layout: Layout::ChannelsLast,
            pixel_weights: Some(Arc::new(udot::Weights::pack_in(
                &self.spec.weights,
                g.out_channels,
                g.patch_len(),
                udot::LANES,
            ))),
            offsets: Arc::new(offsets),
            multipliers: Arc::new(multipliers),
            ..self.clone()
        })
    }

    /// Convolves `images` NCHW images held as i8-domain values.
    pub fn run(&self, x: &[i8], images: usize) -> TractResult<Vec<i8>> {
        let mut out = vec![0i8; images * self.spec.geometry.output_len()?];
        self.run_into(x, images, &mut out)?;
        Ok(out)
    }

    /// `run`, writing every value of `out` (`images` NCHW outputs); the
    /// images are channels-last if the op is `taking_channels_last`.
    pub fn run_into(&self, x: &[i8], images: usize, out: &mut [i8]) -> TractResult<()> {
        let g = self.spec.geometry;
        let channels_last = self.input_layout == Layout::ChannelsLast;
        let [oh, ow] = g.output_hw()?;
        let image_len = g.in_channels * g.height * g.width;
        anyhow::ensure!(x.len() == images * image_len, "QConv: input of {} values", x.len());
        let n = oh * ow;
        anyhow::ensure!(out.len() == images * g.out_channels * n, "QConv: output of {} values", out.len());
        if let Some(weights) = &self.pixel_weights {
            return self.run_pixel_rows(weights, x, images, out);
        }
        match &self.backend {
            Backend::Bytes(weights, layout, kernel) => {
                let (mut patches, mut plane) = (udot::Patches::default(), Vec::new());
                for (image, y) in x.chunks(image_len.max(1)).zip(out.chunks_mut(g.out_channels * n)) {
                    if channels_last {
                        patches.pack_channels_last(image, n, g.in_channels);
                    } else {
                        flip_padded(&g, image, self.spec.input.zero_i8(), &mut plane);
                        patches.pack(&plane, layout);
                    }
                    self.requantize_tiles(udot::MR, udot::NR, n, y, |emit| {
                        udot::product_on(*kernel, weights, &patches, emit)
                    });
                }
            }
            _ if channels_last => anyhow::bail!("QConv: a channels-last input off the byte tile"),
            Backend::Ours(left, layout, tile) => {
                let (mut right, mut plane) = (igemm::Right::default(), Vec::new());
                for (image, y) in x.chunks(image_len.max(1)).zip(out.chunks_mut(g.out_channels * n)) {
                    widen_padded(&g, image, self.spec.input.zero_i8(), &mut plane);
                    right.pack_patches(&plane, layout);
                    self.requantize_tiles(left.mr, igemm::NR, n, y, |emit| {
                        igemm::product_on(*tile, left, &right, emit)
                    });
                }
            }
            Backend::Tract(weights) => {
                for (image, y) in x.chunks(image_len.max(1)).zip(out.chunks_mut(g.out_channels * n)) {
                    self.run_tract(weights, image, y)?;
                }
            }
        }
        Ok(())
    }

    /// `run_into` for a channels-last input and output (pointwise): the
    /// image's bytes flipped to u8 once, then `udot::pixel_rows`, each tile
    /// row requantized into its pixel's channels.
    fn run_pixel_rows(
        &self,
        weights: &udot::Weights,
        x: &[i8],
        images: usize,
        out: &mut [i8],
    ) -> TractResult<()> {
        let g = self.spec.geometry;
        let (n, k, co) = (g.height * g.width, g.in_channels, g.out_channels);
        let (lo, hi) = output_range(&self.spec.output, self.spec.activation);
        let zy = self.spec.output.zero_i8();
        let mut flipped: Vec<u8> = Vec::with_capacity(n * k + 4);
        for (image, y) in x.chunks(n * k).zip(out.chunks_mut(n * co)).take(images) {
            // Pointwise, so unpadded: each byte flipped in place, whatever
            // the layout.
            flip_padded(&g, image, self.spec.input.zero_i8(), &mut flipped);
            // The last pixel's last quad may read past its k bytes.
            flipped.extend([0u8; 4]);
            udot::pixel_rows(weights, &flipped, k, n, |p0, c0, tile| {
                let (rows, width) = (udot::PIXELS.min(n - p0), udot::LANES.min(co - c0));
                let (biases, scales) = (&self.offsets[c0..], &self.multipliers[c0..]);
                requantize_lanes(tile, rows, width, biases, scales, [zy, lo, hi], &mut y[p0 * co + c0..], co);
            });
        }
        Ok(())
    }

    /// Requantizes the `mr x nr` tiles a product hands to its `emit` into
    /// `y` (`out_channels x n`). With AVX2 and 16-column tiles, each tile
    /// goes straight to `y` in registers (`requantize_tile_avx2`, or
    /// `_avx512` with one register a row); elsewhere the tiles are gathered
    /// into one i32 row per channel and each row requantized in one call,
    /// since per tile the scalar code costs as much as the arithmetic.
    fn requantize_tiles(
        &self,
        mr: usize,
        nr: usize,
        n: usize,
        y: &mut [i8],
        product: impl FnOnce(&mut dyn FnMut(usize, usize, &[i32])),
    ) {
        #[cfg(target_arch = "x86_64")]
        if nr == 16 && super::cpu::avx2() {
            let channels = self.spec.geometry.out_channels;
            let (lo, hi) = output_range(&self.spec.output, self.spec.activation);
            let zy = self.spec.output.zero_i8();
            let avx512 = super::cpu::avx512().is_some();
            return product(&mut |r0, c0, tile| {
                let (rows, width) = (mr.min(channels - r0), nr.min(n - c0));
                let (biases, scales) = (&self.offsets[r0..r0 + rows], &self.multipliers[r0..r0 + rows]);
                let (tile, y) = (&tile[..rows * nr], &mut y[r0 * n + c0..]);
                // SAFETY: AVX2 (or AVX-512) is present; rows r0.. of y hold
                // n values.
                unsafe {
                    match avx512 {
                        true => requantize_tile_avx512(tile, width, biases, scales, [zy, lo, hi], y, n),
                        false => requantize_tile_avx2(tile, width, biases, scales, [zy, lo, hi], y, n),
                    }
                }
            });
        }
        self.requantize_gathered(mr, nr, n, y, product)
    }

    /// The gathering half of `requantize_tiles`.
    fn requantize_gathered(
        &self,
        mr: usize,
        nr: usize,
        n: usize,
        y: &mut [i8],
        product: impl FnOnce(&mut dyn FnMut(usize, usize, &[i32])),
    ) {
        let channels = self.spec.geometry.out_channels;
        let (lo, hi) = output_range(&self.spec.output, self.spec.activation);
        let zy = self.spec.output.zero_i8();
        if n == 0 {
            return;
        }
        ACC.with_borrow_mut(|acc| {
            acc.resize(channels * n, 0);
            product(&mut |r0, c0, tile| {
                let width = nr.min(n - c0);
                for i in 0..mr.min(channels - r0) {
                    let at = (r0 + i) * n + c0;
                    acc[at..at + width].copy_from_slice(&tile[i * nr..i * nr + width]);
                }
            });
            for (c, (sums, dst)) in acc.chunks_exact(n).zip(y.chunks_exact_mut(n)).enumerate() {
                requantize_row(sums, self.offsets[c], self.multipliers[c], zy, lo, hi, dst);
            }
        });
    }

    fn run_tract(&self, weights: &Weights, image: &[i8], y: &mut [i8]) -> TractResult<()> {
        let g = self.spec.geometry;
        let [oh, ow] = g.output_hw()?;
        let (n, k) = (oh * ow, g.patch_len());
        let zx = self.spec.input.zero_i8() as i8;
        let (lo, hi) = output_range(&self.spec.output, self.spec.activation);
        let zy = self.spec.output.zero_i8();
        let mut acc = Tensor::zero::<i32>(&[g.out_channels, n])?;
        let requantize = |acc: &[i32], y: &mut [i8]| {
            for c in 0..g.out_channels {
                let row = c * n..(c + 1) * n;
                requantize_row(
                    &acc[row.clone()],
                    self.offsets[c],
                    self.multipliers[c],
                    zy,
                    lo,
                    hi,
                    &mut y[row],
                );
            }
        };
        if let (Some(panels), false) = (weights.b_panels(), self.any_weight_zero) {
            // Straight from the image into the kernel's panels.
            let packed = weights.packed_b(pack_panels(&g, [oh, ow], image, zx, panels), n);
            weights.product(&*packed, n, &mut acc, false)?;
            requantize(acc.try_as_plain_ram()?.as_slice::<i32>()?, y);
            return Ok(());
        }
        let mut patches = Vec::new();
        let b: &[i8] = if g.is_pointwise() {
            image
        } else {
            patches.resize(k * n, 0);
            im2col(&g, [oh, ow], image, zx, &mut patches);
            &patches
        };
        let packed = weights.pack_b(b, n)?;
        weights.product(&*packed, n, &mut acc, false)?;
        let mut plain = acc.try_as_plain_ram_mut()?;
        let acc = plain.as_slice_mut::<i32>()?;
        if self.any_weight_zero {
            // tract's kernels see raw values: subtract zw * (column sums).
            let mut col_sums = vec![0i32; n];
            for row in b.chunks(n) {
                for (s, &v) in col_sums.iter_mut().zip(row) {
                    *s += v as i32;
                }
            }
            for c in 0..g.out_channels {
                let zw = per(&self.spec.weight_zero, c);
                for (a, s) in acc[c * n..(c + 1) * n].iter_mut().zip(&col_sums) {
                    *a -= zw * s;
                }
            }
        }
        requantize(acc, y);
        Ok(())
    }
}

thread_local! {
    /// A convolution's i32 sums before requantization, reused across runs
    /// on this thread (a model's largest layer: 64 KB for vww's).
    static ACC: std::cell::RefCell<Vec<i32>> = const { std::cell::RefCell::new(Vec::new()) };
}

// Scales are finite (checked when the op is built), so equality is reflexive.
impl Eq for QConv {}

impl Op for QConv {
    fn name(&self) -> StaticName {
        "edgeinfer.QConv".into()
    }

    fn info(&self) -> TractResult<Vec<String>> {
        let g = &self.spec.geometry;
        Ok(vec![
            format!(
                "{}->{} k{:?} s{:?} d{:?} p{:?} {:?} on {}",
                g.in_channels,
                g.out_channels,
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

impl EvalOp for QConv {
    op_out_of_plan!();

    fn eval(&self, _ctx: &EvalContext, inputs: TVec<TValue>) -> TractResult<TVec<TValue>> {
        eval_conv(&self.spec, &inputs, self.output_layout, |x, images, y| self.run_into(x, images, y))
    }
}

impl TypedOp for QConv {
    fn output_facts(&self, inputs: &[&TypedFact]) -> TractResult<TVec<TypedFact>> {
        conv_output_facts(&self.spec, inputs, [self.input_layout, self.output_layout])
    }

    as_op!();
}
