//! Image preprocessing as transformers' `Qwen2VLImageProcessor` (its PIL backend, Pillow 13)
//! does it for `Image.open(path)`, so that the same file gives the same pixel values:
//!
//! 0. [`open_checked`]: the file is read only if it is a regular file of at most
//!    [`MAX_IMAGE_FILE_BYTES`] (a FIFO, a device or `/dev/zero` is refused before any read),
//!    the decoder is chosen by the file's content (PNG / JPEG signature), never its name, and
//!    the size in the header must be at most Pillow's `MAX_IMAGE_PIXELS` (178,956,970)
//!    before anything is decoded (a decompression bomb is refused from its header);
//! 1. decode to 8-bit RGB as Pillow's modes convert: `1`, `L`, `P`, `RGB` as they are;
//!    an alpha channel (`LA`, `RGBA`, a palette or colour key with transparency) is
//!    composited onto white with Pillow's integer `alpha_composite` arithmetic (the
//!    processor's `convert_to_rgb` in transformers 5; transformers 4 drops the alpha
//!    channel instead: [`AlphaMode::Drop`]); 16-bit grey (`I;16`) becomes `min(v, 255)` (Pillow's
//!    `I;16 → RGB`, so most 16-bit images come out white, as they do in transformers);
//!    16-bit RGB(A) and grey+alpha keep their high byte (Pillow opens them as 8-bit).
//!    The EXIF orientation is *not* applied: neither the processor nor
//!    `qwen_vl_utils.fetch_image` calls `exif_transpose` (transformers' `load_image`
//!    does, for a path or URL handed to it);
//! 2. `smart_resize`: height and width rounded (half to even, as Python's `round`) to
//!    multiples of `patch_size · merge_size` (28), scaled into `[min_pixels, max_pixels]`;
//!    an image that would take more than the limit's tokens is refused before any
//!    allocation ([`ImageProcessorConfig::with_max_tokens`]);
//! 3. Pillow's bicubic resize of 8-bit images, re-implemented bit for bit (two separable
//!    passes, support scaled on downsampling, 22-bit fixed-point coefficients, rounding
//!    and clipping to 8 bits after each pass; the horizontal pass first unless the height
//!    shrinks by more than twice as many pixels as the width, Pillow 13's order);
//! 4. rescale (`u8 as f64 · rescale_factor`, rounded to f32) and normalise
//!    (`(x − mean) / std` in f32); settings that could give a non-finite value are refused
//!    when `preprocessor_config.json` is read;
//! 5. patches flattened in the processor's order: merge blocks row-major, the `m × m`
//!    patches of a block contiguous, each row `C · temporal_patch · patch · patch` with
//!    the frame repeated `temporal_patch_size` times.
//!
//! Decoding is exact for both formats: PNG through the `image` crate, JPEG with
//! libjpeg-turbo's own arithmetic and Pillow's settings and conversions ([`super::jpeg`]);
//! tests/fast/jpeg.rs holds Pillow's pixels for every kind of JPEG.
use std::path::{Path, PathBuf};

use serde::Deserialize;
use tch::Tensor;
use tracing::warn;

use super::Grid;
use crate::{Error, Result};

/// CLIP's normalisation, the processor's default.
pub const CLIP_MEAN: [f64; 3] = [0.48145466, 0.4578275, 0.40821073];
pub const CLIP_STD: [f64; 3] = [0.26862954, 0.26130258, 0.27577711];

/// Pillow's `Image.MAX_IMAGE_PIXELS`: larger images are refused from their header (Pillow
/// warns above it and raises `DecompressionBombError` above twice it; dualedit refuses at
/// once, so a 48 KB PNG cannot make it allocate gigabytes).
pub const MAX_IMAGE_PIXELS: u64 = 178_956_970;

/// The largest image file read (256 MiB; a real photo is a few MB). Reads stop here, so
/// `--image /dev/zero`-like inputs cannot grow without bound.
pub const MAX_IMAGE_FILE_BYTES: u64 = 256 << 20;

/// The most tokens one image may take when the caller gives no tighter limit (the model's
/// context, [`ImageProcessorConfig::with_max_tokens`]): 131,072 merged patches, about 100
/// million pixels after resizing.
pub const DEFAULT_MAX_IMAGE_TOKENS: i64 = 1 << 17;

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
    /// Most tokens (merged patches) one image may take; checked on the grid, before the
    /// resized image is allocated. [`DEFAULT_MAX_IMAGE_TOKENS`] unless the caller sets the
    /// model's limit with [`ImageProcessorConfig::with_max_tokens`].
    #[serde(skip)]
    pub max_tokens: i64,
    /// Transparency onto white (transformers 5, the default) or dropped (transformers 4).
    #[serde(skip)]
    pub alpha: AlphaMode,
    /// The file the settings came from (named in errors); `None` for the defaults.
    #[serde(skip)]
    pub source: Option<PathBuf>,
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
            max_tokens: DEFAULT_MAX_IMAGE_TOKENS,
            alpha: AlphaMode::OntoWhite,
            source: None,
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
        let text = match std::fs::symlink_metadata(path) {
            Ok(_) => crate::io::read_text(path)?,
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
            max_tokens: DEFAULT_MAX_IMAGE_TOKENS,
            alpha: AlphaMode::OntoWhite,
            source: Some(path.to_path_buf()),
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
        c.check_finite().map_err(|m| Error::file(path, m))?;
        // The smallest image is scaled up to min_pixels: if even that is over the limit,
        // no image can be used (min_pixels = max_pixels = 1e12 would allocate terabytes).
        if c.do_resize {
            let f = c.factor() as f64;
            let min_tokens = (c.min_pixels as f64 / (f * f)).ceil();
            if min_tokens > c.max_tokens as f64 {
                return Err(Error::file(
                    path,
                    format!(
                        "min_pixels {} makes every image at least {min_tokens} tokens, more than the {} an image may take",
                        c.min_pixels, c.max_tokens
                    ),
                ));
            }
        }
        Ok(c)
    }

    /// Refuses settings under which some 8-bit value would normalise to a non-finite f32
    /// (`rescale_factor: 1e308`, `image_std: [1e-320, 1, 1]`, a NaN anywhere): the values
    /// are computed as [`pixel_values`] computes them, at 0 and 255.
    fn check_finite(&self) -> std::result::Result<(), String> {
        let named = [("rescale_factor", self.rescale_factor)]
            .into_iter()
            .chain(self.image_mean.iter().map(|&v| ("image_mean", v)))
            .chain(self.image_std.iter().map(|&v| ("image_std", v)));
        for (name, v) in named {
            if !v.is_finite() {
                return Err(format!("{name} has the non-finite value {v}"));
            }
        }
        for ch in 0..3 {
            for u in [0u8, 255] {
                let v = normalise(u, ch, self);
                if !v.is_finite() {
                    return Err(format!(
                        "rescale_factor {} / image_mean {} / image_std {} turn the pixel value {u} of channel {ch} into {v} (not a finite f32)",
                        self.rescale_factor, self.image_mean[ch], self.image_std[ch]
                    ));
                }
            }
        }
        Ok(())
    }

    /// The same settings with at most `max_tokens` tokens per image (the model's context,
    /// say); an image that would take more is refused before it is resized.
    pub fn with_max_tokens(mut self, max_tokens: i64) -> Self {
        self.max_tokens = max_tokens.max(1);
        self
    }

    /// The same settings with transparency treated as `alpha` says ([`AlphaMode::Drop`]
    /// for parity with transformers 4.x).
    pub fn with_alpha(mut self, alpha: AlphaMode) -> Self {
        self.alpha = alpha;
        self
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

/// What an image file's header says, read without decoding the pixels.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ImageHeader {
    /// Chosen from the file's signature (its first bytes), never from its name.
    pub format: ImageKind,
    pub width: u32,
    pub height: u32,
}

/// The image formats read (the decoder is picked by content).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub enum ImageKind {
    Png,
    Jpeg,
}

impl ImageKind {
    /// The usual file extension (`png`, `jpg`).
    pub fn extension(self) -> &'static str {
        match self {
            ImageKind::Png => "png",
            ImageKind::Jpeg => "jpg",
        }
    }
}

/// The format, by signature, and the size, from the header, of an image given as bytes;
/// `what` names it in errors. Refuses other formats, empty images and images above
/// [`MAX_IMAGE_PIXELS`].
fn header_of(bytes: &[u8], what: &Path) -> Result<ImageHeader> {
    if bytes.is_empty() {
        return Err(Error::file(what, "image file is empty"));
    }
    let format = match image::guess_format(bytes) {
        Ok(image::ImageFormat::Png) => ImageKind::Png,
        Ok(image::ImageFormat::Jpeg) => ImageKind::Jpeg,
        Ok(other) => return Err(Error::file(what, format!("{other:?} images are not supported (PNG or JPEG)"))),
        Err(_) => return Err(Error::file(what, "not a PNG or JPEG image (unrecognised file signature)")),
    };
    let header_error = |e: String| Error::file(what, format!("cannot read the {} header (truncated or corrupt?): {e}", format.extension()));
    let (width, height) = match format {
        ImageKind::Jpeg => super::jpeg::dimensions(bytes).map_err(header_error)?,
        ImageKind::Png => image::io::Reader::with_format(std::io::Cursor::new(bytes), image::ImageFormat::Png)
            .into_dimensions()
            .map_err(|e| header_error(e.to_string()))?,
    };
    if width == 0 || height == 0 {
        return Err(Error::file(what, "image has no pixels"));
    }
    let pixels = width as u64 * height as u64;
    if pixels > MAX_IMAGE_PIXELS {
        return Err(Error::file(
            what,
            format!("image is {width}×{height} = {pixels} pixels, more than the {MAX_IMAGE_PIXELS} allowed (Pillow's MAX_IMAGE_PIXELS: a decompression bomb?)"),
        ));
    }
    Ok(ImageHeader { format, width, height })
}

/// Reads `path` as [`open_checked`] does (regular file, size cap, format by content,
/// pixel count from the header) without decoding the pixels: for checking a data set's
/// images at load.
pub fn read_header(path: &Path) -> Result<ImageHeader> {
    let bytes = crate::io::read_regular_capped(path, MAX_IMAGE_FILE_BYTES)?;
    header_of(&bytes, path)
}

/// What becomes of transparency when an image is turned into RGB. transformers changed
/// it between major versions: 5.x's `convert_to_rgb` composites onto white, 4.x's (and
/// EasyEdit's `Image.open(...).convert("RGB")`) drops the alpha channel and keeps the
/// colours under it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize)]
pub enum AlphaMode {
    /// Composite onto opaque white with Pillow's `alpha_composite` (transformers 5).
    #[default]
    OntoWhite,
    /// Drop the alpha channel (transformers 4, `convert("RGB")`).
    Drop,
}

/// Reads and decodes the image file at `path` to 8-bit RGB, the one way every image is
/// read: a regular file of at most [`MAX_IMAGE_FILE_BYTES`] (a FIFO or device is refused
/// before `open` can block), PNG or JPEG by content, at most [`MAX_IMAGE_PIXELS`] from
/// the header, then decoded fully (a truncated file is an error here, not later). Every
/// failure names `path`.
pub fn open_checked(path: &Path) -> Result<Rgb8> {
    open_checked_with(path, AlphaMode::default())
}

/// [`open_checked`] with the given treatment of transparency.
pub fn open_checked_with(path: &Path, alpha: AlphaMode) -> Result<Rgb8> {
    let bytes = crate::io::read_regular_capped(path, MAX_IMAGE_FILE_BYTES)?;
    decode_bytes_with(&bytes, path, alpha)
}

/// [`open_checked`] for bytes already in memory (an upload); `what` names them in errors.
pub fn decode_bytes(bytes: &[u8], what: &Path) -> Result<Rgb8> {
    decode_bytes_with(bytes, what, AlphaMode::default())
}

/// [`decode_bytes`] with the given treatment of transparency.
pub fn decode_bytes_with(bytes: &[u8], what: &Path, alpha: AlphaMode) -> Result<Rgb8> {
    let header = header_of(bytes, what)?;
    if header.format == ImageKind::Jpeg {
        let (width, height, data) = super::jpeg::decode(bytes, MAX_IMAGE_PIXELS)
            .map_err(|e| Error::file(what, format!("cannot decode the jpg image (truncated or corrupt?): {e}")))?;
        return Ok(Rgb8 { height, width, data });
    }
    let mut reader = image::io::Reader::with_format(std::io::Cursor::new(bytes), image::ImageFormat::Png);
    let mut limits = image::io::Limits::default();
    limits.max_image_width = Some(header.width);
    limits.max_image_height = Some(header.height);
    // RGBA at 16 bits is the most a PNG decodes to; anything more is not this image.
    limits.max_alloc = Some(header.width as u64 * header.height as u64 * 8 + (1 << 20));
    reader.limits(limits);
    let img = reader.decode().map_err(|e| {
        Error::file(what, format!("cannot decode the png image (truncated or corrupt?): {e}"))
    })?;
    let (width, height) = (img.width() as usize, img.height() as usize);
    if width == 0 || height == 0 {
        return Err(Error::file(what, "image has no pixels"));
    }
    Ok(Rgb8 { height, width, data: to_rgb8(img, alpha) })
}

/// Pillow's conversion of what it opens to RGB (`convert_to_rgb` of the processor).
fn to_rgb8(img: image::DynamicImage, alpha: AlphaMode) -> Vec<u8> {
    use image::DynamicImage as D;
    match img {
        D::ImageRgb8(b) => b.into_raw(),
        D::ImageLuma8(b) => b.into_raw().into_iter().flat_map(|l| [l, l, l]).collect(),
        // 16-bit grey opens as `I;16`, whose conversion to RGB is `min(v, 255)`.
        D::ImageLuma16(b) => b.into_raw().into_iter().flat_map(|v| [v.min(255) as u8; 3]).collect(),
        // Alpha (RGBA, LA, palette or colour-key transparency, expanded by the decoder):
        // onto white. 16-bit samples keep their high byte, as Pillow's `RGBA;16B` /
        // `LA;16B` unpackers do.
        other if other.color().has_alpha() && alpha == AlphaMode::OntoWhite => other
            .to_rgba16()
            .pixels()
            .flat_map(|p| {
                let a = (p.0[3] >> 8) as u8;
                [0, 1, 2].map(|i| over_white((p.0[i] >> 8) as u8, a))
            })
            .collect(),
        // 16-bit RGB opens as 8-bit `RGB` (`RGB;16B`: the high byte).
        other => other.to_rgb16().pixels().flat_map(|p| p.0.map(|v| (v >> 8) as u8)).collect(),
    }
}

/// Reads and decodes an image file to 8-bit RGB ([`open_checked`]).
pub fn decode(path: &Path) -> Result<Rgb8> {
    open_checked(path)
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

/// Pillow 13's bicubic `Image.resize` of an 8-bit RGB image: two passes, each rounding
/// and clipping to 8 bits; the horizontal one first unless the height shrinks by more
/// than twice as many pixels as the width does (`ImagingResampleInner`'s
/// `horizontal_first`), in which case the vertical one runs first. The order changes the
/// result wherever the first pass clips (edges, noise, saturated colours).
pub fn resize_bicubic(img: &Rgb8, height: usize, width: usize) -> Rgb8 {
    let (dy, dx) = (img.height as i64 - height as i64, img.width as i64 - width as i64);
    let horizontal_first = !(dy > 0 && dy > dx * 2);
    let mut cur = img.clone();
    if horizontal_first {
        cur = resize_horizontal(&cur, width);
        cur = resize_vertical(&cur, height);
    } else {
        cur = resize_vertical(&cur, height);
        cur = resize_horizontal(&cur, width);
    }
    cur
}

/// Pillow's `ImagingResampleHorizontal_8bpc` (a no-op when the width does not change).
fn resize_horizontal(cur: &Rgb8, width: usize) -> Rgb8 {
    if width == cur.width {
        return cur.clone();
    }
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
    Rgb8 { height: cur.height, width, data: out }
}

/// Pillow's `ImagingResampleVertical_8bpc` (a no-op when the height does not change).
fn resize_vertical(cur: &Rgb8, height: usize) -> Rgb8 {
    if height == cur.height {
        return cur.clone();
    }
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
    Rgb8 { height, width: w, data: out }
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

/// One 8-bit level of channel `ch` rescaled and normalised as the processor does it:
/// `u · rescale_factor` in f64 rounded to f32, then `(v − mean) / std` in f32.
fn normalise(u: u8, ch: usize, c: &ImageProcessorConfig) -> f32 {
    let mut v = if c.do_rescale { (u as f64 * c.rescale_factor) as f32 } else { u as f32 };
    if c.do_normalize {
        v = (v - c.image_mean[ch] as f32) / c.image_std[ch] as f32;
    }
    v
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
    // 256 levels × 3 channels: a table instead of the arithmetic per pixel.
    let table: Vec<[f32; 3]> = (0..=255u8).map(|u| [0, 1, 2].map(|ch| normalise(u, ch, c))).collect();
    for (i, &u) in img.data.iter().enumerate() {
        let ch = i % 3;
        planar[ch * hw + i / 3] = table[u as usize][ch];
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

/// Decodes ([`open_checked`]), resizes, normalises and patches the image at `path`. An
/// image that would take more than `c.max_tokens` tokens is refused before it is resized.
pub fn prepare(path: &Path, c: &ImageProcessorConfig) -> Result<PreparedImage> {
    let img = open_checked_with(path, c.alpha)?;
    prepare_rgb(img, path, c)
}

/// [`prepare`] of an image already decoded; `path` names it in errors.
pub fn prepare_rgb(img: Rgb8, path: &Path, c: &ImageProcessorConfig) -> Result<PreparedImage> {
    let grid = c.grid_for(img.height as i64, img.width as i64).map_err(|e| Error::file(path, e.to_string()))?;
    let (h, w) = (grid[1] * c.patch_size, grid[2] * c.patch_size);
    let tokens = grid.iter().product::<i64>() / (c.merge_size * c.merge_size);
    if tokens > c.max_tokens {
        let from = c.source.as_ref().map_or("the processor's defaults".to_string(), |p| p.display().to_string());
        return Err(Error::file(
            path,
            format!(
                "the image would take {tokens} tokens ({w}×{h} pixels after resizing to min_pixels {} / max_pixels {} of {from}), more than the {} an image may take (the model's context, or the processor's limit)",
                c.min_pixels, c.max_pixels, c.max_tokens
            ),
        ));
    }
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
