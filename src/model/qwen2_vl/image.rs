//! Image preprocessing as transformers' `Qwen2VLImageProcessor` (its PIL backend) does it,
//! so that the same file gives the same pixel values:
//!
//! 1. decode PNG / JPEG; grayscale, palette and 16-bit images become 8-bit RGB; an alpha
//!    channel (RGBA, LA, a palette or colour key with transparency) is composited onto
//!    white with Pillow's integer `alpha_composite` arithmetic;
//! 2. `smart_resize`: height and width rounded (half to even, as Python's `round`) to
//!    multiples of `patch_size · merge_size` (28), scaled into `[min_pixels, max_pixels]`;
//! 3. Pillow's bicubic resize of 8-bit images, re-implemented bit for bit (two separable
//!    passes, horizontal first, support scaled on downsampling, 22-bit fixed-point
//!    coefficients, rounding and clipping to 8 bits after each pass);
//! 4. rescale (`u8 as f64 · rescale_factor`, rounded to f32) and normalise
//!    (`(x − mean) / std` in f32);
//! 5. patches flattened in the processor's order: merge blocks row-major, the `m × m`
//!    patches of a block contiguous, each row `C · temporal_patch · patch · patch` with
//!    the frame repeated `temporal_patch_size` times.
//!
//! PNG decoding is exact. JPEG decoding (the `image` crate's decoder vs Pillow's
//! libjpeg-turbo) may differ by a few 8-bit levels where IDCT and chroma upsampling round
//! differently; see tests/vl.rs for the measured difference.
use std::path::{Path, PathBuf};

use serde::Deserialize;
use tch::Tensor;
use tracing::warn;

use super::vision::Grid;
use crate::{Error, Result};

/// CLIP's normalisation, the processor's default.
pub const CLIP_MEAN: [f64; 3] = [0.48145466, 0.4578275, 0.40821073];
pub const CLIP_STD: [f64; 3] = [0.26862954, 0.26130258, 0.27577711];

/// `preprocessor_config.json`, either as released checkpoints write it (`min_pixels`,
/// `max_pixels` at the top) or as transformers 5 does (`size: {shortest_edge, longest_edge}`).
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct ImageProcessorConfig {
    pub min_pixels: i64,
    pub max_pixels: i64,
    pub patch_size: i64,
    pub temporal_patch_size: i64,
    pub merge_size: i64,
    pub image_mean: [f64; 3],
    pub image_std: [f64; 3],
    pub rescale_factor: f64,
    pub do_resize: bool,
    pub do_rescale: bool,
    pub do_normalize: bool,
}

impl Default for ImageProcessorConfig {
    /// transformers' `Qwen2VLImageProcessor` defaults: 56² to 28²·1280 pixels, patch 14,
    /// temporal patch 2, merge 2, CLIP mean/std, rescale 1/255.
    fn default() -> Self {
        Self {
            min_pixels: 56 * 56,
            max_pixels: 28 * 28 * 1280,
            patch_size: 14,
            temporal_patch_size: 2,
            merge_size: 2,
            image_mean: CLIP_MEAN,
            image_std: CLIP_STD,
            rescale_factor: 1.0 / 255.0,
            do_resize: true,
            do_rescale: true,
            do_normalize: true,
        }
    }
}

#[derive(Deserialize)]
struct RawSize {
    shortest_edge: Option<i64>,
    longest_edge: Option<i64>,
    min_pixels: Option<i64>,
    max_pixels: Option<i64>,
}

#[derive(Deserialize)]
struct RawProcessor {
    min_pixels: Option<i64>,
    max_pixels: Option<i64>,
    size: Option<RawSize>,
    patch_size: Option<i64>,
    temporal_patch_size: Option<i64>,
    merge_size: Option<i64>,
    image_mean: Option<Vec<f64>>,
    image_std: Option<Vec<f64>>,
    rescale_factor: Option<f64>,
    do_resize: Option<bool>,
    do_rescale: Option<bool>,
    do_normalize: Option<bool>,
    /// PIL resampling filter; only 3 (bicubic) is implemented.
    resample: Option<i64>,
}

impl ImageProcessorConfig {
    /// Reads `path`; a missing file gives the defaults (logged, naming them), a malformed
    /// one an error naming it.
    pub fn load(path: &Path) -> Result<Self> {
        let text = match std::fs::read_to_string(path) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                let d = Self::default();
                warn!(
                    file = %path.display(),
                    "no preprocessor_config.json: using Qwen2VLImageProcessor's defaults (min_pixels {}, max_pixels {}, patch 14, temporal patch 2, merge 2, CLIP mean/std)",
                    d.min_pixels, d.max_pixels
                );
                return Ok(d);
            }
            Err(e) => return Err(Error::io(path, e)),
        };
        let raw: RawProcessor =
            serde_json::from_str(&text).map_err(|e| Error::file(path, format!("malformed preprocessor config: {e}")))?;
        let d = Self::default();
        let size = raw.size.as_ref();
        let three = |v: Option<Vec<f64>>, name: &str, default: [f64; 3]| -> Result<[f64; 3]> {
            match v {
                None => Ok(default),
                Some(v) => v.try_into().map_err(|v: Vec<f64>| Error::file(path, format!("{name} has {} values, expected 3", v.len()))),
            }
        };
        let c = Self {
            min_pixels: raw.min_pixels.or(size.and_then(|s| s.shortest_edge.or(s.min_pixels))).unwrap_or(d.min_pixels),
            max_pixels: raw.max_pixels.or(size.and_then(|s| s.longest_edge.or(s.max_pixels))).unwrap_or(d.max_pixels),
            patch_size: raw.patch_size.unwrap_or(d.patch_size),
            temporal_patch_size: raw.temporal_patch_size.unwrap_or(d.temporal_patch_size),
            merge_size: raw.merge_size.unwrap_or(d.merge_size),
            image_mean: three(raw.image_mean, "image_mean", d.image_mean)?,
            image_std: three(raw.image_std, "image_std", d.image_std)?,
            rescale_factor: raw.rescale_factor.unwrap_or(d.rescale_factor),
            do_resize: raw.do_resize.unwrap_or(true),
            do_rescale: raw.do_rescale.unwrap_or(true),
            do_normalize: raw.do_normalize.unwrap_or(true),
        };
        if let Some(r) = raw.resample.filter(|&r| r != 3) {
            return Err(Error::file(path, format!("resample = {r} is not supported (only 3, bicubic)")));
        }
        if c.min_pixels < 1 || c.max_pixels < c.min_pixels {
            return Err(Error::file(path, format!("min_pixels {} / max_pixels {} are not a valid range", c.min_pixels, c.max_pixels)));
        }
        if [c.patch_size, c.temporal_patch_size, c.merge_size].iter().any(|&v| !(1..=1024).contains(&v)) {
            return Err(Error::file(path, "patch_size, temporal_patch_size and merge_size must be 1 to 1024"));
        }
        if c.image_std.contains(&0.0) {
            return Err(Error::file(path, "image_std has a zero entry"));
        }
        Ok(c)
    }

    /// Pixels per side of one merged token (28).
    pub fn factor(&self) -> i64 {
        self.patch_size * self.merge_size
    }

    /// The grid `[1, h, w]` (in patches) an image of `height × width` pixels gets.
    pub fn grid_for(&self, height: i64, width: i64) -> Result<Grid> {
        let (h, w) = if self.do_resize { smart_resize(height, width, self.factor(), self.min_pixels, self.max_pixels)? } else { (height, width) };
        Ok([1, h / self.patch_size, w / self.patch_size])
    }
}

/// transformers' `smart_resize`: `(height, width)` rounded to multiples of `factor`,
/// scaled (keeping the aspect ratio) into `[min_pixels, max_pixels]`.
pub fn smart_resize(height: i64, width: i64, factor: i64, min_pixels: i64, max_pixels: i64) -> Result<(i64, i64)> {
    let (hf, wf, f) = (height as f64, width as f64, factor as f64);
    if hf.max(wf) / hf.min(wf) > 200.0 {
        return Err(Error::input(format!("aspect ratio {}:{} is more than 200:1", width, height)));
    }
    let mut h = ((hf / f).round_ties_even() as i64) * factor;
    let mut w = ((wf / f).round_ties_even() as i64) * factor;
    if h * w > max_pixels {
        let beta = (hf * wf / max_pixels as f64).sqrt();
        h = factor.max(((hf / beta / f).floor() as i64) * factor);
        w = factor.max(((wf / beta / f).floor() as i64) * factor);
    } else if h * w < min_pixels {
        let beta = (min_pixels as f64 / (hf * wf)).sqrt();
        h = ((hf * beta / f).ceil() as i64) * factor;
        w = ((wf * beta / f).ceil() as i64) * factor;
    }
    Ok((h, w))
}

/// An 8-bit RGB image, row-major `[H, W, 3]`.
#[derive(Debug, Clone, PartialEq)]
pub struct Rgb8 {
    pub height: usize,
    pub width: usize,
    pub data: Vec<u8>,
}

/// Pillow's `alpha_composite` of a pixel onto opaque white (8-bit, 7 extra bits of precision).
fn over_white(c: u8, a: u8) -> u8 {
    if a == 0 {
        return 255;
    }
    const PREC: u32 = 7;
    let (a, c) = (a as u32, c as u32);
    let blend = 255 * (255 - a);
    let outa255 = a * 255 + blend;
    let coef1 = a * 255 * 255 * (1 << PREC) / outa255;
    let coef2 = 255 * (1 << PREC) - coef1;
    let tmp = c * coef1 + 255 * coef2 + (0x80 << PREC);
    ((((tmp >> 8) + tmp) >> 8) >> PREC) as u8
}

/// Reads and decodes an image file to 8-bit RGB. Every failure names `path`.
pub fn decode(path: &Path) -> Result<Rgb8> {
    let bytes = std::fs::read(path).map_err(|e| match e.kind() {
        std::io::ErrorKind::NotFound => Error::file(path, "image file not found"),
        _ if path.is_dir() => Error::file(path, "is a directory, expected an image file"),
        _ => Error::io(path, e),
    })?;
    if bytes.is_empty() {
        return Err(Error::file(path, "image file is empty"));
    }
    let format = image::guess_format(&bytes)
        .map_err(|_| Error::file(path, "not a PNG or JPEG image (unrecognised file signature)"))?;
    if !matches!(format, image::ImageFormat::Png | image::ImageFormat::Jpeg) {
        return Err(Error::file(path, format!("{format:?} images are not supported (PNG or JPEG)")));
    }
    let img = image::load_from_memory_with_format(&bytes, format)
        .map_err(|e| Error::file(path, format!("cannot decode the {format:?} image (truncated or corrupt?): {e}")))?;
    let (width, height) = (img.width() as usize, img.height() as usize);
    if width == 0 || height == 0 {
        return Err(Error::file(path, "image has no pixels"));
    }
    use image::DynamicImage as D;
    let has_alpha = img.color().has_alpha();
    let data: Vec<u8> = match img {
        D::ImageRgb8(b) => b.into_raw(),
        D::ImageLuma8(b) => b.into_raw().into_iter().flat_map(|l| [l, l, l]).collect(),
        // 16-bit samples keep their high byte, as Pillow does when it opens them as 8-bit RGB(A).
        other if has_alpha => other
            .to_rgba16()
            .pixels()
            .flat_map(|p| {
                let a = (p.0[3] >> 8) as u8;
                [0, 1, 2].map(|i| over_white((p.0[i] >> 8) as u8, a))
            })
            .collect(),
        other => other.to_rgb16().pixels().flat_map(|p| p.0.map(|v| (v >> 8) as u8)).collect(),
    };
    Ok(Rgb8 { height, width, data })
}

const PRECISION_BITS: u32 = 32 - 8 - 2;

fn bicubic(x: f64) -> f64 {
    const A: f64 = -0.5;
    let x = x.abs();
    if x < 1.0 {
        ((A + 2.0) * x - (A + 3.0)) * x * x + 1.0
    } else if x < 2.0 {
        (((x - 5.0) * x + 8.0) * x - 4.0) * A
    } else {
        0.0
    }
}

/// Pillow's `precompute_coeffs` + `normalize_coeffs_8bpc`: for each output index, the
/// first input index and the fixed-point weights of the inputs it reads.
fn coefficients(in_size: usize, out_size: usize) -> Vec<(usize, Vec<i32>)> {
    let scale = in_size as f64 / out_size as f64;
    let filterscale = scale.max(1.0);
    let support = 2.0 * filterscale;
    (0..out_size)
        .map(|xx| {
            let center = (xx as f64 + 0.5) * scale;
            let ss = 1.0 / filterscale;
            let xmin = ((center - support + 0.5) as i64).max(0) as usize;
            let xmax = ((center + support + 0.5) as i64).min(in_size as i64) as usize;
            let n = xmax.saturating_sub(xmin);
            let w: Vec<f64> = (0..n).map(|x| bicubic((x as f64 + xmin as f64 - center + 0.5) * ss)).collect();
            let total: f64 = w.iter().sum();
            let k = w
                .iter()
                .map(|&v| {
                    let v = if total != 0.0 { v / total } else { v };
                    let s = v * (1u32 << PRECISION_BITS) as f64;
                    (if v < 0.0 { s - 0.5 } else { s + 0.5 }) as i32
                })
                .collect();
            (xmin, k)
        })
        .collect()
}

fn clip8(ss: i64) -> u8 {
    (ss >> PRECISION_BITS).clamp(0, 255) as u8
}

/// Pillow's bicubic `Image.resize` of an 8-bit RGB image (horizontal pass, then vertical).
pub fn resize_bicubic(img: &Rgb8, height: usize, width: usize) -> Rgb8 {
    let mut cur = img.clone();
    if width != cur.width {
        let coeffs = coefficients(cur.width, width);
        let mut out = vec![0u8; cur.height * width * 3];
        for y in 0..cur.height {
            let row = &cur.data[y * cur.width * 3..(y + 1) * cur.width * 3];
            for (xx, (xmin, k)) in coeffs.iter().enumerate() {
                for c in 0..3 {
                    let mut ss: i64 = 1 << (PRECISION_BITS - 1);
                    for (i, &kv) in k.iter().enumerate() {
                        ss += row[(xmin + i) * 3 + c] as i64 * kv as i64;
                    }
                    out[(y * width + xx) * 3 + c] = clip8(ss);
                }
            }
        }
        cur = Rgb8 { height: cur.height, width, data: out };
    }
    if height != cur.height {
        let coeffs = coefficients(cur.height, height);
        let w = cur.width;
        let mut out = vec![0u8; height * w * 3];
        for (yy, (ymin, k)) in coeffs.iter().enumerate() {
            for x in 0..w * 3 {
                let mut ss: i64 = 1 << (PRECISION_BITS - 1);
                for (i, &kv) in k.iter().enumerate() {
                    ss += cur.data[(ymin + i) * w * 3 + x] as i64 * kv as i64;
                }
                out[yy * w * 3 + x] = clip8(ss);
            }
        }
        cur = Rgb8 { height, width: w, data: out };
    }
    cur
}

/// One image ready for the vision tower.
#[derive(Debug)]
pub struct PreparedImage {
    pub path: PathBuf,
    /// `[patches, C · temporal_patch · patch · patch]`, f32 (`pixel_values`).
    pub pixel_values: Tensor,
    /// `image_grid_thw`: `[1, height / patch, width / patch]`.
    pub grid: Grid,
    /// Size after `smart_resize`, `(height, width)` in pixels.
    pub resized: (i64, i64),
}

impl PreparedImage {
    /// Text tokens the image takes: `t · h · w / merge²`.
    pub fn n_tokens(&self, merge: i64) -> i64 {
        self.grid.iter().product::<i64>() / (merge * merge)
    }
}

/// Normalised, patch-flattened pixel values of an RGB image (after any resize).
pub fn pixel_values(img: &Rgb8, c: &ImageProcessorConfig) -> Result<(Tensor, Grid)> {
    let (h, w) = (img.height as i64, img.width as i64);
    let (ps, m, tp) = (c.patch_size, c.merge_size, c.temporal_patch_size);
    if h % (ps * m) != 0 || w % (ps * m) != 0 {
        return Err(Error::input(format!("image of {w}×{h} pixels is not a multiple of {} on each side (do_resize is off)", ps * m)));
    }
    let (hw, n) = (img.height * img.width, img.data.len());
    let mut planar = vec![0f32; n];
    let mean = c.image_mean.map(|v| v as f32);
    let std = c.image_std.map(|v| v as f32);
    for (i, &u) in img.data.iter().enumerate() {
        let ch = i % 3;
        let mut v = if c.do_rescale { (u as f64 * c.rescale_factor) as f32 } else { u as f32 };
        if c.do_normalize {
            v = (v - mean[ch]) / std[ch];
        }
        planar[ch * hw + i / 3] = v;
    }
    let (gh, gw) = (h / ps, w / ps);
    let t = crate::error::guard(|| {
        Ok(Tensor::from_slice(&planar)
            .reshape([3, gh / m, m, ps, gw / m, m, ps])
            .permute([1, 4, 2, 5, 0, 3, 6])
            .unsqueeze(5)
            .expand([gh / m, gw / m, m, m, 3, tp, ps, ps], false)
            .reshape([gh * gw, 3 * tp * ps * ps]))
    })?;
    Ok((t, [1, gh, gw]))
}

/// Decodes, resizes, normalises and patches the image at `path`.
pub fn prepare(path: &Path, c: &ImageProcessorConfig) -> Result<PreparedImage> {
    let img = decode(path)?;
    let grid = c.grid_for(img.height as i64, img.width as i64).map_err(|e| Error::file(path, e.to_string()))?;
    let (h, w) = (grid[1] * c.patch_size, grid[2] * c.patch_size);
    let img = if c.do_resize { resize_bicubic(&img, h as usize, w as usize) } else { img };
    let (pixel_values, grid) = pixel_values(&img, c).map_err(|e| Error::file(path, e.to_string()))?;
    Ok(PreparedImage { path: path.to_path_buf(), pixel_values, grid, resized: (h, w) })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn smart_resize_matches_transformers_cases() {
        // Worked by hand from transformers' smart_resize (Python's round: half to even).
        assert_eq!(smart_resize(40, 75, 28, 3136, 12544).unwrap(), (56, 84));
        assert_eq!(smart_resize(300, 400, 28, 3136, 12544).unwrap(), (84, 112));
        assert_eq!(smart_resize(42, 70, 28, 1, 1 << 30).unwrap(), (56, 56)); // 1.5 -> 2, 2.5 -> 2
        assert!(smart_resize(1, 500, 28, 3136, 12544).is_err());
    }

    #[test]
    fn compositing_onto_white_is_pillows() {
        assert_eq!(over_white(10, 255), 10);
        assert_eq!(over_white(10, 0), 255);
        assert_eq!(over_white(0, 128), 127);
    }

    #[test]
    fn same_size_resize_is_identity() {
        let img = Rgb8 { height: 2, width: 3, data: (0..18).map(|v| v as u8 * 13).collect() };
        assert_eq!(resize_bicubic(&img, 2, 3), img);
    }
}
