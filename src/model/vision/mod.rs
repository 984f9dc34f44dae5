//! The image side that vision-language families share, apart from any one family: an
//! image file checked, decoded (PNG by the `image` crate, JPEG bit for bit as Pillow by
//! libjpeg-turbo: [`jpeg`]) and preprocessed into patches ([`image`]: the processor's
//! `preprocessor_config.json`, `smart_resize`, Pillow's bicubic, normalisation), the
//! prompt's special tokens ([`VisionTokens`]), the checkpoint's chat template
//! ([`ChatTemplate`]) and the check of a tower's output. A family reaches the rest of the
//! crate through [`super::VisionLanguage`]; callers outside `model/` use this module and
//! that trait, never a concrete family.
pub mod chat_template;
pub mod image;
mod jpeg;

use tch::{Kind, Tensor};

pub use chat_template::ChatTemplate;
pub use image::{ImageProcessorConfig, PreparedImage};

use crate::{Error, Result};

/// One image's patch grid: temporal, height and width in patches (`image_grid_thw`).
pub type Grid = [i64; 3];

/// Special token ids a VL prompt is built from.
#[derive(Debug, Clone, Copy, serde::Serialize)]
pub struct VisionTokens {
    pub image_pad: i64,
    pub vision_start: i64,
    pub vision_end: i64,
}

/// Refuses a vision-tower output with a NaN or infinity, naming the image it came from:
/// `feats` is `[Σ merged patches, D]`, the images' rows in order (`grids`, merge size
/// `merge`), `paths[i]` the file of image `i`. A non-finite feature would otherwise
/// flow into log-probabilities and metrics as if it were a number.
pub fn check_finite_features(feats: &Tensor, grids: &[Grid], merge: i64, paths: &[&std::path::Path]) -> Result<()> {
    let (bad, finite_rows) = crate::error::guard(|| {
        let _g = tch::no_grad_guard();
        let rows = feats.isfinite().all_dim(-1, false).to_device(tch::Device::Cpu);
        let bad = i64::try_from(rows.logical_not().sum(Kind::Int64))?;
        Ok((bad, Vec::<bool>::try_from(rows)?))
    })?;
    if bad == 0 {
        return Ok(());
    }
    let mut start = 0usize;
    for (i, g) in grids.iter().enumerate() {
        let n = (g.iter().product::<i64>() / (merge * merge)) as usize;
        let end = (start + n).min(finite_rows.len());
        if finite_rows[start..end].iter().any(|ok| !ok) {
            let msg = "the vision tower gave non-finite features (NaN or infinity) for this image; check the model's weights and preprocessor_config.json";
            return Err(match paths.get(i) {
                Some(p) => Error::file(p, msg),
                None => Error::input(format!("image {i}: {msg}")),
            });
        }
        start = end;
    }
    Err(Error::input(format!("the vision tower gave {bad} rows of non-finite features")))
}

/// `448x448` (or `448×448`) to `(width, height)`.
pub fn parse_image_size(s: &str) -> std::result::Result<(i64, i64), String> {
    let bad = || format!("{s:?} is not an image size WIDTHxHEIGHT (e.g. 448x448)");
    let (w, h) = s.split_once(['x', 'X', '×']).ok_or_else(bad)?;
    let (w, h) = (w.trim().parse::<i64>().map_err(|_| bad())?, h.trim().parse::<i64>().map_err(|_| bad())?);
    if w < 1 || h < 1 {
        return Err(bad());
    }
    Ok((w, h))
}
