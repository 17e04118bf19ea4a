//! Channels-first (NCHW, the layout between our ops) to channels-last and
//! back, for `QDepthwise`, which reads 16 adjacent channels per load.
//! Element by element these are strided scatters that cost more than the
//! convolution itself (measured: about 60% of the op on kws); with AVX2
//! they move 16 x 16 tiles through a byte transpose in registers.

/// Where each `width`-wide tile along `len` (at least `width`) starts; the
/// last one ends at `len` and may overlap the one before it, which only
/// writes the same values again.
#[cfg(target_arch = "x86_64")]
pub(super) fn tiles(len: usize, width: usize) -> impl Iterator<Item = usize> {
    (0..len.div_ceil(width)).map(move |t| (t * width).min(len - width))
}

/// `tiles`, or one partial tile at 0 for fewer than 16 channels.
#[cfg(target_arch = "x86_64")]
fn channel_tiles(channels: usize) -> impl Iterator<Item = usize> {
    tiles(channels.max(16), 16).map(move |c0| c0.min(channels.saturating_sub(16)))
}

/// `plane[offsets[p] + c] = x[c * pixels + p] - zero` for every channel `c`
/// and pixel `p < offsets.len()`: an NCHW image widened into a padded
/// channels-last plane. Fewer than 16 channels may also write lanes up to
/// the 16th of each pixel with anything (the depthwise weights there are
/// zero): the plane must have them.
pub fn widen_to_channels_last(x: &[i8], channels: usize, offsets: &[usize], zero: i32, plane: &mut [i16]) {
    let pixels = offsets.len();
    assert!(x.len() >= channels * pixels && offsets.iter().all(|&o| o + channels.max(16) <= plane.len()));
    #[cfg(target_arch = "x86_64")]
    if pixels >= 16 && super::cpu::avx2() {
        // SAFETY: AVX2 is present; the assert above bounds every access.
        return unsafe { widen_avx2(x, channels, offsets, zero, plane) };
    }
    for (c, row) in x.chunks(pixels.max(1)).take(channels).enumerate() {
        for (&v, &o) in row.iter().zip(offsets) {
            plane[o + c] = (v as i32 - zero) as i16;
        }
    }
}

/// `y[c * pixels + p] = src[p * stride + c]` for every channel `c <
/// channels` and pixel `p < pixels`: channels-last back to NCHW.
pub fn to_channels_first(src: &[i8], stride: usize, channels: usize, pixels: usize, y: &mut [i8]) {
    assert!(channels.max(16) <= stride && src.len() >= pixels * stride && y.len() >= channels * pixels);
    #[cfg(target_arch = "x86_64")]
    if pixels >= 16 && super::cpu::avx2() {
        // SAFETY: AVX2 is present; the assert above bounds every access.
        return unsafe { channels_first_avx2(src, stride, channels, pixels, y) };
    }
    for (c, row) in y.chunks_mut(pixels.max(1)).take(channels).enumerate() {
        for (p, v) in row.iter_mut().enumerate() {
            *v = src[p * stride + c];
        }
    }
}

/// `y[c * pixels + p] = x[p * channels + c]`: one NHWC image of bytes to
/// NCHW, as a model's channels-last input reaches its first convolution
/// (tract's generic axis move: 20 us for vww's 96 x 96 x 3 image).
pub fn image_to_channels_first(x: &[i8], channels: usize, pixels: usize, y: &mut [i8]) {
    assert!(x.len() >= channels * pixels && y.len() >= channels * pixels);
    if channels >= 16 {
        return to_channels_first(x, channels, channels, pixels, y);
    }
    #[allow(unused_mut)] // advanced only on x86-64
    let mut done = 0;
    #[cfg(target_arch = "x86_64")]
    if channels == 3 && super::cpu::avx2() {
        // SAFETY: AVX2 (and with it SSSE3) is present; the assert bounds
        // every access.
        done = unsafe { rgb_planes_ssse3(x, pixels, y) };
    }
    for p in done..pixels {
        for c in 0..channels {
            y[c * pixels + p] = x[p * channels + c];
        }
    }
}

/// 16 RGB pixels (48 bytes, three loads) at a time: each output plane's 16
/// bytes are three byte shuffles OR-ed, one per load; returns the pixels
/// done (a multiple of 16).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn rgb_planes_ssse3(x: &[i8], pixels: usize, y: &mut [i8]) -> usize {
    use std::arch::x86_64::*;
    // masks[c][v], lane j: where pixel j's channel c sits in load v, or
    // 0x80 (a zero byte) when it is in another load.
    let masks: [[__m128i; 3]; 3] = std::array::from_fn(|c| {
        std::array::from_fn(|v| {
            let lanes: [i8; 16] =
                std::array::from_fn(|j| if (3 * j + c) / 16 == v { ((3 * j + c) % 16) as i8 } else { -128 });
            // SAFETY: 16 bytes read from a 16-byte array.
            unsafe { _mm_loadu_si128(lanes.as_ptr() as *const __m128i) }
        })
    });
    let done = pixels / 16 * 16;
    for p0 in (0..done).step_by(16) {
        // SAFETY: pixels p0..p0 + 16 exist in x (48 bytes) and in each plane.
        unsafe {
            let loads: [__m128i; 3] =
                std::array::from_fn(|v| _mm_loadu_si128(x.as_ptr().add(3 * p0 + 16 * v) as *const __m128i));
            for (c, masks) in masks.iter().enumerate() {
                let plane = _mm_or_si128(
                    _mm_or_si128(_mm_shuffle_epi8(loads[0], masks[0]), _mm_shuffle_epi8(loads[1], masks[1])),
                    _mm_shuffle_epi8(loads[2], masks[2]),
                );
                _mm_storeu_si128(y.as_mut_ptr().add(c * pixels + p0) as *mut __m128i, plane);
            }
        }
    }
    done
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn widen_avx2(x: &[i8], channels: usize, offsets: &[usize], zero: i32, plane: &mut [i16]) {
    use std::arch::x86_64::*;
    let pixels = offsets.len();
    let z = _mm256_set1_epi16(zero as i16);
    for c0 in channel_tiles(channels) {
        for p0 in tiles(pixels, 16) {
            unsafe {
                let rows = std::array::from_fn(|i| match c0 + i < channels {
                    true => _mm_loadu_si128(x.as_ptr().add((c0 + i) * pixels + p0) as *const __m128i),
                    false => _mm_setzero_si128(),
                });
                // Column j: pixel p0 + j, its 16 channels.
                for (j, column) in transpose16(rows).into_iter().enumerate() {
                    let wide = _mm256_sub_epi16(_mm256_cvtepi8_epi16(column), z);
                    _mm256_storeu_si256(plane.as_mut_ptr().add(offsets[p0 + j] + c0) as *mut __m256i, wide);
                }
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn channels_first_avx2(src: &[i8], stride: usize, channels: usize, pixels: usize, y: &mut [i8]) {
    use std::arch::x86_64::*;
    for p0 in tiles(pixels, 16) {
        for c0 in channel_tiles(channels) {
            unsafe {
                let rows = std::array::from_fn(|i| {
                    _mm_loadu_si128(src.as_ptr().add((p0 + i) * stride + c0) as *const __m128i)
                });
                // Column j: channel c0 + j, its 16 pixels.
                for (j, column) in transpose16(rows).into_iter().enumerate().take(channels - c0) {
                    _mm_storeu_si128(y.as_mut_ptr().add((c0 + j) * pixels + p0) as *mut __m128i, column);
                }
            }
        }
    }
}

/// A 16 x 16 byte matrix transposed: byte `j` of row `i` becomes byte `i`
/// of row `j`. Four rounds of interleaving, of bytes, then 16-, 32- and
/// 64-bit groups, each doubling the run of one column held together.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
#[inline]
pub(super) fn transpose16(r: [std::arch::x86_64::__m128i; 16]) -> [std::arch::x86_64::__m128i; 16] {
    use std::arch::x86_64::*;
    // Pairs of rows: columns 0-7 (lo) and 8-15 (hi), two rows interleaved.
    let t: [__m128i; 16] = std::array::from_fn(|i| {
        let (a, b) = (r[i / 2 * 2], r[i / 2 * 2 + 1]);
        if i % 2 == 0 { _mm_unpacklo_epi8(a, b) } else { _mm_unpackhi_epi8(a, b) }
    });
    // Quads of rows: u[4q + k] holds columns 4k..4k+4 of rows 4q..4q+4.
    let u: [__m128i; 16] = std::array::from_fn(|i| {
        let (q, k) = (i / 4, i % 4);
        let (a, b) = (t[4 * q + k / 2], t[4 * q + 2 + k / 2]);
        if k % 2 == 0 { _mm_unpacklo_epi16(a, b) } else { _mm_unpackhi_epi16(a, b) }
    });
    // Octets of rows: v[8h + k] holds columns 2k, 2k+1 of rows 8h..8h+8.
    let v: [__m128i; 16] = std::array::from_fn(|i| {
        let (h, k) = (i / 8, i % 8);
        let (a, b) = (u[8 * h + k / 2], u[8 * h + 4 + k / 2]);
        if k % 2 == 0 { _mm_unpacklo_epi32(a, b) } else { _mm_unpackhi_epi32(a, b) }
    });
    // All 16 rows: column j.
    std::array::from_fn(|j| {
        let (a, b) = (v[j / 2], v[8 + j / 2]);
        if j % 2 == 0 { _mm_unpacklo_epi64(a, b) } else { _mm_unpackhi_epi64(a, b) }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn both_directions_match_the_element_by_element_definition() {
        for (channels, pixels) in [(1usize, 1usize), (3, 40), (16, 16), (17, 33), (64, 125), (40, 15)] {
            let x: Vec<i8> = (0..channels * pixels).map(|i| (i * 37 % 251) as i8).collect();
            // Padded like a plane: a gap of 3 elements between pixels.
            let stride = channels.div_ceil(16) * 16 + 3;
            let offsets: Vec<usize> = (0..pixels).map(|p| p * stride).collect();
            let mut plane = vec![0i16; pixels * stride];
            widen_to_channels_last(&x, channels, &offsets, -5, &mut plane);
            for c in 0..channels {
                for p in 0..pixels {
                    assert_eq!(
                        plane[p * stride + c],
                        x[c * pixels + p] as i16 + 5,
                        "{channels}x{pixels} c{c} p{p}"
                    );
                }
            }
            let last: Vec<i8> = plane.iter().map(|&v| v as i8).collect();
            let mut y = vec![0i8; channels * pixels];
            to_channels_first(&last, stride, channels, pixels, &mut y);
            let want: Vec<i8> = x.iter().map(|&v| (v as i16 + 5) as i8).collect();
            assert_eq!(y, want, "{channels}x{pixels}");
        }
    }

    #[test]
    fn an_image_to_channels_first_matches_the_element_by_element_definition() {
        for (channels, pixels) in [(3usize, 9216usize), (3, 47), (3, 5), (1, 20), (5, 33), (16, 16), (24, 50)]
        {
            let x: Vec<i8> = (0..channels * pixels).map(|i| (i * 37 % 251) as i8).collect();
            let mut y = vec![0i8; channels * pixels];
            image_to_channels_first(&x, channels, pixels, &mut y);
            for c in 0..channels {
                for p in 0..pixels {
                    assert_eq!(y[c * pixels + p], x[p * channels + c], "{channels}x{pixels} c{c} p{p}");
                }
            }
        }
    }
}
