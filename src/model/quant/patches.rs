//! The patch matrix of a convolution (one row per input channel and kernel
//! tap, one column per output pixel), either as a plain matrix or written
//! straight into the column panels of tract-linalg's plain packed format
//! (the AVX2 and NEON integer kernels), which skips both a materialised
//! patch matrix and a second packing pass.

use tract_onnx::prelude::*;
use tract_onnx::tract_core::tract_linalg::pack::PackedFormat;

/// How an op's 4-D activations sit in memory. Between our ops and tract's
/// they are channels-first (NCHW, the ONNX layout); a depthwise layer
/// hands its output to the pointwise convolutions after it channels-last,
/// the layout it computes in, when they can read it (`mod.rs`,
/// `channels_last_handoffs`): no transpose back and none in the packing.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Layout {
    #[default]
    ChannelsFirst,
    ChannelsLast,
}

impl Layout {
    /// What an op's info adds for its input and output layouts: nothing
    /// for channels-first, `, channels-last in` / `out` otherwise.
    pub fn describe([input, output]: [Layout; 2]) -> String {
        let note = |layout: Layout, side: &str| match layout {
            Layout::ChannelsFirst => String::new(),
            Layout::ChannelsLast => format!(", channels-last {side}"),
        };
        note(input, "in") + &note(output, "out")
    }

    /// The 4-D shape of `[n, channels, h, w]` in this layout.
    pub fn shape<D: Clone>(self, [n, c, h, w]: [D; 4]) -> TVec<D> {
        match self {
            Layout::ChannelsFirst => tvec![n, c, h, w],
            Layout::ChannelsLast => tvec![n, h, w, c],
        }
    }
}

/// Shape of a convolution over one `[channels, height, width]` image.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Geometry {
    pub in_channels: usize,
    pub out_channels: usize,
    pub height: usize,
    pub width: usize,
    pub kernel: [usize; 2],
    pub strides: [usize; 2],
    pub dilations: [usize; 2],
    /// top, left, bottom, right (ONNX order: begins then ends).
    pub pads: [usize; 4],
}

impl Geometry {
    pub fn output_hw(&self) -> TractResult<[usize; 2]> {
        let dim = |size: usize, k: usize, s: usize, d: usize, p0: usize, p1: usize| {
            let span = d * (k - 1) + 1;
            let padded = size + p0 + p1;
            anyhow::ensure!(
                k > 0 && s > 0 && d > 0 && padded >= span,
                "convolution window larger than its input"
            );
            Ok((padded - span) / s + 1)
        };
        Ok([
            dim(self.height, self.kernel[0], self.strides[0], self.dilations[0], self.pads[0], self.pads[2])?,
            dim(self.width, self.kernel[1], self.strides[1], self.dilations[1], self.pads[1], self.pads[3])?,
        ])
    }

    /// Where each tap of the window reads and where each input pixel
    /// goes, in a padded channels-last plane of `channels` lanes a pixel
    /// (the depthwise kernels' layout): tap `ky * kw + kx` from the output
    /// pixel's window origin, input pixel `y * width + x` at its place.
    pub fn channels_last_offsets(&self, channels: usize) -> (Vec<usize>, Vec<usize>) {
        let wp = self.width + self.pads[1] + self.pads[3];
        let taps = (0..self.kernel[0])
            .flat_map(|ky| {
                (0..self.kernel[1])
                    .map(move |kx| (ky * self.dilations[0] * wp + kx * self.dilations[1]) * channels)
            })
            .collect();
        let pixels = (0..self.height)
            .flat_map(|y| {
                (0..self.width).map(move |x| ((y + self.pads[0]) * wp + x + self.pads[1]) * channels)
            })
            .collect();
        (taps, pixels)
    }

    /// Values in one image's output: `out_channels x oh x ow`.
    pub fn output_len(&self) -> TractResult<usize> {
        let [oh, ow] = self.output_hw()?;
        Ok(self.out_channels * oh * ow)
    }

    /// Rows of the patch matrix: one per input channel and kernel tap.
    pub fn patch_len(&self) -> usize {
        self.in_channels * self.kernel[0] * self.kernel[1]
    }

    pub fn is_pointwise(&self) -> bool {
        self.kernel == [1, 1] && self.strides == [1, 1] && self.pads == [0; 4]
    }
}

/// The patch matrix of one image: row `(c * kh + ky) * kw + kx`, column
/// `oy * ow + ox`, holding the input at that tap or the zero point in the
/// padding (so the padding contributes exactly zero after the zero-point
/// correction). Each row is made of runs copied from an input row.
pub fn im2col(g: &Geometry, [oh, ow]: [usize; 2], x: &[i8], zero: i8, out: &mut [i8]) {
    let (h, w) = (g.height as isize, g.width as isize);
    let [sy, sx] = g.strides.map(|s| s as isize);
    let [dy, dx] = g.dilations.map(|d| d as isize);
    let (pt, pl) = (g.pads[0] as isize, g.pads[1] as isize);
    let n = oh * ow;
    let mut rows = out.chunks_mut(n);
    for c in 0..g.in_channels {
        let plane = &x[c * g.height * g.width..(c + 1) * g.height * g.width];
        for ky in 0..g.kernel[0] as isize {
            for kx in 0..g.kernel[1] as isize {
                let row = rows.next().expect("patch matrix has a row per tap");
                // Output columns whose input column is inside the image.
                let first = (pl - kx * dx).max(0);
                let ox_lo = ((first + sx - 1) / sx).min(ow as isize) as usize;
                let last = w - 1 + pl - kx * dx; // largest ox * sx allowed
                let ox_hi = if last < 0 {
                    0
                } else {
                    ((last / sx) + 1).min(ow as isize).max(ox_lo as isize) as usize
                };
                for oy in 0..oh {
                    let dst = &mut row[oy * ow..(oy + 1) * ow];
                    let iy = oy as isize * sy + ky * dy - pt;
                    if iy < 0 || iy >= h || ox_lo >= ox_hi {
                        dst.fill(zero);
                        continue;
                    }
                    let src = &plane[(iy * w) as usize..((iy + 1) * w) as usize];
                    dst[..ox_lo].fill(zero);
                    dst[ox_hi..].fill(zero);
                    let ix0 = (ox_lo as isize * sx + kx * dx - pl) as usize;
                    if sx == 1 {
                        dst[ox_lo..ox_hi].copy_from_slice(&src[ix0..ix0 + (ox_hi - ox_lo)]);
                    } else {
                        for (i, d) in dst[ox_lo..ox_hi].iter_mut().enumerate() {
                            *d = src[ix0 + i * sx as usize];
                        }
                    }
                }
            }
        }
    }
}

/// The patch matrix of one image packed as `format` lays out a `k x n`
/// operand (byte items): panels of `r` columns, each `k` rows of `r` bytes
/// then zero padding up to the panel length. Eight (or `r`) neighbouring
/// output pixels of one output row read neighbouring input bytes at a
/// stride-1 tap, so most rows of a panel are one unaligned word copy.
pub fn pack_panels(g: &Geometry, [oh, ow]: [usize; 2], x: &[i8], zero: i8, format: &PackedFormat) -> Blob {
    match format.r {
        4 => pack_panels_r::<4>(g, [oh, ow], x, zero, format),
        8 => pack_panels_r::<8>(g, [oh, ow], x, zero, format),
        16 => pack_panels_r::<16>(g, [oh, ow], x, zero, format),
        _ => pack_panels_any(g, [oh, ow], x, zero, format),
    }
}

fn pack_panels_r<const R: usize>(
    g: &Geometry,
    [oh, ow]: [usize; 2],
    x: &[i8],
    zero: i8,
    format: &PackedFormat,
) -> Blob {
    let k = g.patch_len();
    let n = oh * ow;
    let panel_len = format.single_panel_len(k);
    let panels = n.div_ceil(R);
    let mut blob = unsafe { Blob::new_for_size_and_align(panels * panel_len, format.alignment()) };
    let bytes = blob.as_bytes_mut();
    let (h, w) = (g.height as isize, g.width as isize);
    let [sy, sx] = g.strides.map(|s| s as isize);
    let [dy, dx] = g.dilations.map(|d| d as isize);
    let (pt, pl) = (g.pads[0] as isize, g.pads[1] as isize);
    let plane_len = g.height * g.width;
    let pointwise = g.is_pointwise();
    // Bytes from here on: the panels hold i8 values as raw bytes.
    let x: &[u8] = unsafe { std::slice::from_raw_parts(x.as_ptr() as *const u8, x.len()) };
    let zero = zero as u8;
    for p in 0..panels {
        let panel = &mut bytes[p * panel_len..(p + 1) * panel_len];
        let n0 = p * R;
        let width = R.min(n - n0);
        let (oy0, ox0) = ((n0 / ow) as isize, (n0 % ow) as isize);
        let one_row = (ox0 as usize) + width <= ow;
        let mut records = panel.chunks_exact_mut(R);
        for c in 0..g.in_channels {
            let plane = &x[c * plane_len..(c + 1) * plane_len];
            if pointwise {
                let dst = records.next().expect("a record per patch row");
                copy_run::<R>(dst, &plane[n0..n0 + width]);
                continue;
            }
            for ky in 0..g.kernel[0] as isize {
                for kx in 0..g.kernel[1] as isize {
                    let dst = records.next().expect("a record per patch row");
                    if !one_row {
                        // A panel that wraps to the next output row: pixel by pixel.
                        for (j, d) in dst.iter_mut().enumerate().take(width) {
                            let (oy, ox) = (((n0 + j) / ow) as isize, ((n0 + j) % ow) as isize);
                            let (iy, ix) = (oy * sy + ky * dy - pt, ox * sx + kx * dx - pl);
                            *d = if iy < 0 || iy >= h || ix < 0 || ix >= w {
                                zero
                            } else {
                                plane[(iy * w + ix) as usize]
                            };
                        }
                        dst[width..].fill(0);
                        continue;
                    }
                    let iy = oy0 * sy + ky * dy - pt;
                    if iy < 0 || iy >= h {
                        dst[..width].fill(zero);
                        dst[width..].fill(0);
                        continue;
                    }
                    let row = &plane[(iy * w) as usize..((iy + 1) * w) as usize];
                    let ix0 = ox0 * sx + kx * dx - pl;
                    if sx == 1 && ix0 >= 0 && ix0 + width as isize <= w {
                        copy_run::<R>(dst, &row[ix0 as usize..ix0 as usize + width]);
                    } else {
                        for (j, d) in dst.iter_mut().enumerate().take(width) {
                            let ix = ix0 + j as isize * sx;
                            *d = if ix < 0 || ix >= w { zero } else { row[ix as usize] };
                        }
                        dst[width..].fill(0);
                    }
                }
            }
        }
        panel[k * R..].fill(0);
    }
    blob
}

/// `src` (at most `R` values) into an `R`-byte record, zero after it: a
/// single word move when the run is full.
#[inline(always)]
fn copy_run<const R: usize>(dst: &mut [u8], src: &[u8]) {
    if src.len() == R {
        let dst: &mut [u8; R] = dst.try_into().expect("records are R bytes");
        *dst = src.try_into().expect("a full run is R bytes");
    } else {
        dst[..src.len()].copy_from_slice(src);
        dst[src.len()..].fill(0);
    }
}

/// Any other panel width: through a plain patch matrix.
fn pack_panels_any(g: &Geometry, [oh, ow]: [usize; 2], x: &[i8], zero: i8, format: &PackedFormat) -> Blob {
    let (k, n, r) = (g.patch_len(), oh * ow, format.r);
    let mut plain = vec![0i8; k * n];
    im2col(g, [oh, ow], x, zero, &mut plain);
    let panel_len = format.single_panel_len(k);
    let panels = n.div_ceil(r);
    let mut blob = unsafe { Blob::new_for_size_and_align(panels * panel_len, format.alignment()) };
    let bytes = blob.as_bytes_mut();
    bytes.fill(0);
    for p in 0..panels {
        let width = r.min(n - p * r);
        for kk in 0..k {
            for j in 0..width {
                bytes[p * panel_len + kk * r + j] = plain[kk * n + p * r + j] as u8;
            }
        }
    }
    blob
}

/// Where each element of the patch matrix lives in the input once it is
/// widened to i16 and padded (`widen_padded`): row `k` of the patch matrix
/// reads `plane[row_offsets[k] + column_offsets[n]]`. Built once per op, so
/// packing an image is loads and stores only, with no bounds checks and no
/// division.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PatchLayout {
    pub row_offsets: Vec<usize>,
    pub column_offsets: Vec<usize>,
    /// Per panel of `igemm::NR` columns: its columns read consecutive
    /// elements (one output row, stride 1), so a row of it is one load.
    pub contiguous: Vec<bool>,
    /// Per panel: its columns read every other element (one output row of
    /// a stride-2 convolution), so a row of it is two loads and a shuffle.
    pub every_other: Vec<bool>,
    pub padded: [usize; 2],
}

impl PatchLayout {
    pub fn new(g: &Geometry, panel: usize) -> TractResult<PatchLayout> {
        let [oh, ow] = g.output_hw()?;
        let hp = g.height + g.pads[0] + g.pads[2];
        let wp = g.width + g.pads[1] + g.pads[3];
        let mut row_offsets = Vec::with_capacity(g.patch_len());
        for c in 0..g.in_channels {
            for ky in 0..g.kernel[0] {
                for kx in 0..g.kernel[1] {
                    row_offsets.push(c * hp * wp + ky * g.dilations[0] * wp + kx * g.dilations[1]);
                }
            }
        }
        let column_offsets: Vec<usize> =
            (0..oh * ow).map(|n| (n / ow) * g.strides[0] * wp + (n % ow) * g.strides[1]).collect();
        let steps = |step: usize| -> Vec<bool> {
            let full = |cols: &[usize]| cols.len() == panel && cols.windows(2).all(|w| w[1] == w[0] + step);
            column_offsets.chunks(panel).map(full).collect()
        };
        let (contiguous, every_other) = (steps(1), steps(2));
        Ok(PatchLayout { row_offsets, column_offsets, contiguous, every_other, padded: [hp, wp] })
    }
}

/// The image as u8 with its top bit flipped (`x + 128`, what `udot`'s
/// unsigned side reads), inside a border of the flipped zero point: a
/// padded tap holds the input's real zero, as in `widen_padded`.
pub fn flip_padded(g: &Geometry, x: &[i8], zero: i32, out: &mut Vec<u8>) {
    pad_into(g, x, (zero + 128) as u8, |s| s as u8 ^ 0x80, out);
}

/// The image as i16 with its zero point subtracted, inside a border of
/// zeros for the padding (a padded tap then contributes exactly nothing).
pub fn widen_padded(g: &Geometry, x: &[i8], zero: i32, out: &mut Vec<i16>) {
    pad_into(g, x, 0, |s| (s as i32 - zero) as i16, out);
}

/// The NCHW image `x`, each value mapped by `value`, inside a border of
/// `border` as wide as the geometry's padding.
fn pad_into<T: Copy>(g: &Geometry, x: &[i8], border: T, value: impl Fn(i8) -> T, out: &mut Vec<T>) {
    let (hp, wp) = (g.height + g.pads[0] + g.pads[2], g.width + g.pads[1] + g.pads[3]);
    out.clear();
    if g.pads == [0; 4] {
        // One pass, not one per image row (kws's rows are 5 values).
        out.extend(x[..g.in_channels * g.height * g.width].iter().map(|&s| value(s)));
        return;
    }
    out.resize(g.in_channels * hp * wp, border);
    for c in 0..g.in_channels {
        for y in 0..g.height {
            let src = &x[(c * g.height + y) * g.width..(c * g.height + y + 1) * g.width];
            let start = c * hp * wp + (y + g.pads[0]) * wp + g.pads[1];
            for (d, &s) in out[start..start + g.width].iter_mut().zip(src) {
                *d = value(s);
            }
        }
    }
}
