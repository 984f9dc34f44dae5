//! `plan --data FILE`: the shape of the user's own records (tokens per example, labelled
//! positions, image sizes) instead of upper bounds.
//!
//! Without data the planner assumes every example is `max_length` tokens with every
//! position but the first labelled; for E-VQA's one- or two-word answers that overstates
//! the logits (and hides that `replica` then saves nothing on the main device). The records
//! are tokenised exactly as a run tokenises them (`examples::prepare_with`,
//! `multimodal::prepare_mm`: the chat template, the image's tokens) and each figure is taken
//! at a percentile over the records: the longest (100, the default: with a batch of one a
//! single long record sets a step's peak, and one step out of memory ends a run) or a lower
//! one the user chooses (`--percentile 95`) to see what the bulk of the data needs.
use std::path::{Path, PathBuf};

use serde::Serialize;

use crate::data::easyedit::{load_records, DatasetKind};
use crate::data::examples::{prepare_with, OverLong};
use crate::data::multimodal::{load_mm, prepare_mm, ImageRoots, VlPrompt};
use crate::data::{EditExample, Example};
use crate::model::vision::ImageProcessorConfig;
use crate::model::{Model, Tokenizer};
use crate::{Error, Result};

/// The default percentile: the longest record.
pub const DEFAULT_PERCENTILE: f64 = 100.0;

/// One figure over the records: the largest and the value at the percentile.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Spread {
    pub longest: i64,
    pub at_percentile: i64,
}

/// What the records need, per example.
#[derive(Debug, Clone, Serialize)]
pub struct DataShape {
    pub file: PathBuf,
    /// Records the run would use (empty targets and unreadable images left out, as a run does).
    pub records: usize,
    pub percentile: f64,
    /// Text tokens of the longest view of a record (for images: without the image's
    /// tokens, which the planner adds from the image size).
    pub text_tokens: Spread,
    /// Labelled (answer) positions of the record's longest answer.
    pub labelled: Spread,
    /// Multimodal: tokens of the text-only locality question (E-VQA's NQ `loc`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub loc_tokens: Option<Spread>,
    /// Multimodal: the largest image of a record `(width, height)` by pixels: the largest
    /// over all records and the one at the percentile.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub image_longest: Option<(i64, i64)>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub image_at_percentile: Option<(i64, i64)>,
}

/// The value at `p` percent of `v` (nearest rank: the smallest value with at least `p` %
/// of the values at or below it). `v` is sorted here.
fn nearest_rank<T: Copy + Ord>(v: &mut [T], p: f64) -> Option<T> {
    if v.is_empty() {
        return None;
    }
    v.sort_unstable();
    let rank = ((p / 100.0) * v.len() as f64).ceil().max(1.0) as usize;
    Some(v[rank.min(v.len()) - 1])
}

fn spread(mut v: Vec<i64>, p: f64) -> Spread {
    let longest = v.iter().copied().max().unwrap_or(0);
    Spread { longest, at_percentile: nearest_rank(&mut v, p).unwrap_or(0) }
}

/// Text tokens and labelled positions of one example (`image_pad` tokens not counted).
fn lens(e: &Example, image_pad: Option<i64>) -> (i64, i64) {
    let image = image_pad.map_or(0, |pad| e.ids.iter().filter(|&&t| t == pad).count());
    ((e.ids.len() - image) as i64, (e.ids.len() - e.answer_start) as i64)
}

/// Reads `path` as `ds` records with `model_dir`'s tokenizer (and, for `vqa`/`caption`, its
/// image processor and the images under `image_root`) and measures them at `percentile`.
pub fn data_shape(model_dir: &Path, model: &Model, path: &Path, ds: DatasetKind, image_root: Option<&Path>, percentile: f64) -> Result<DataShape> {
    if !(percentile > 0.0 && percentile <= 100.0) {
        return Err(Error::input(format!("`percentile` {percentile}: give a value in (0, 100] (100: the longest record)")));
    }
    let tok_path = model_dir.join("tokenizer.json");
    if !tok_path.is_file() {
        return Err(Error::file(&tok_path, "plan `data` counts tokens with the model's tokenizer: tokenizer.json not found in `model`"));
    }
    let tok = Tokenizer::from_file(&tok_path)?;
    // No length limit: the plan is to see how long the records are.
    let (unlimited, context) = (usize::MAX / 2, usize::MAX / 2);
    let (examples, records): (Vec<EditExample>, usize);
    let mut images: Vec<(i64, i64)> = Vec::new();
    let mut image_pad = None;
    if ds.is_multimodal() {
        let vl = model.family().vision_language().ok_or_else(|| Error::input(format!("`ds` {} needs a vision-language model; {} is text-only", ds.as_str(), model_dir.display())))?;
        let root = image_root.ok_or_else(|| Error::input(format!("plan `data` with `ds` {}: give `image_root` (the folder of the records' images)", ds.as_str())))?;
        let proc = ImageProcessorConfig::load(&model_dir.join("preprocessor_config.json"))?;
        let load = load_mm(path, ds, &ImageRoots::new(root.to_path_buf(), None), false)?;
        images = load
            .records
            .iter()
            .map(|r| {
                [Some(&r.image), r.image_rephrase.as_ref(), r.m_loc.as_ref().map(|m| &m.image)]
                    .into_iter()
                    .flatten()
                    .map(|i| (i.width, i.height))
                    .max_by_key(|(w, h)| w * h)
                    .unwrap_or((0, 0))
            })
            .collect();
        let template = vl.chat_template(model_dir)?;
        let p = prepare_mm(&tok, VlPrompt { vl, proc: &proc, template: &template }, &load, unlimited, context, OverLong::Skip, path)?;
        image_pad = Some(vl.tokens().image_pad);
        records = p.examples.len();
        examples = p.examples;
    } else {
        let (recs, _) = load_records(path, ds)?;
        let index: Vec<usize> = (0..recs.len()).collect();
        let p = prepare_with(&tok, &recs, &index, unlimited, OverLong::Skip, path)?;
        records = p.examples.len();
        examples = p.examples;
    }
    let (mut text, mut kept, mut loc) = (Vec::new(), Vec::new(), Vec::new());
    for e in &examples {
        // The image views (or inner/outer) and the locality views: the longest of each.
        let views: Vec<&Example> = [Some(&e.inner), Some(&e.outer), e.outer_image.as_ref(), e.loc_image.as_ref()].into_iter().flatten().collect();
        let (t, k) = views.iter().map(|v| lens(v, image_pad)).fold((0, 0), |a, b| (a.0.max(b.0), a.1.max(b.1)));
        let l = e.loc.as_ref().map(|v| lens(v, None));
        if ds.is_multimodal() {
            text.push(t);
            if let Some(l) = l {
                loc.push(l.0);
            }
            kept.push(k.max(l.map_or(0, |l| l.1)));
        } else {
            text.push(t.max(l.map_or(0, |l| l.0)));
            kept.push(k.max(l.map_or(0, |l| l.1)));
        }
    }
    let (image_longest, image_at_percentile) = images_by_area(&images, percentile);
    Ok(DataShape {
        file: path.to_path_buf(),
        records,
        percentile,
        text_tokens: spread(text, percentile),
        labelled: spread(kept, percentile),
        loc_tokens: (!loc.is_empty()).then(|| spread(loc, percentile)),
        image_longest,
        image_at_percentile,
    })
}

/// The largest image `(width, height)` and the one at `percentile`, both ordered by area,
/// then width, then height: at P100 the two are the same picture (not 768x1024 and
/// 1024x768, of equal area).
fn images_by_area(images: &[(i64, i64)], percentile: f64) -> (Option<(i64, i64)>, Option<(i64, i64)>) {
    let mut keyed: Vec<(i64, i64, i64)> = images.iter().map(|&(w, h)| (w * h, w, h)).collect();
    let largest = keyed.iter().copied().max().map(|(_, w, h)| (w, h));
    (largest, nearest_rank(&mut keyed, percentile).map(|(_, w, h)| (w, h)))
}

impl DataShape {
    /// One line for `plan`'s text.
    pub fn text(&self) -> String {
        let s = |x: &Spread| format!("longest {}, at P{} {}", x.longest, self.percentile, x.at_percentile);
        let mut out = format!(
            "data: {} ({} records): text tokens {}; labelled positions {}",
            self.file.display(),
            self.records,
            s(&self.text_tokens),
            s(&self.labelled)
        );
        if let Some(l) = &self.loc_tokens {
            out.push_str(&format!("; text-only locality tokens {}", s(l)));
        }
        if let (Some(a), Some(b)) = (self.image_longest, self.image_at_percentile) {
            out.push_str(&format!("; largest image {}x{}, at P{} {}x{}", a.0, a.1, self.percentile, b.0, b.1));
        }
        out.push_str(&format!("; planned at P{}\n", self.percentile));
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_rank_percentiles() {
        let v = || (1..=20).collect::<Vec<i64>>();
        assert_eq!(nearest_rank(&mut v(), 100.0), Some(20));
        assert_eq!(nearest_rank(&mut v(), 95.0), Some(19));
        assert_eq!(nearest_rank(&mut v(), 50.0), Some(10));
        assert_eq!(nearest_rank(&mut v(), 0.1), Some(1));
        assert_eq!(nearest_rank(&mut Vec::<i64>::new(), 50.0), None);
        assert_eq!(spread(vec![5, 1, 9], 50.0), Spread { longest: 9, at_percentile: 5 });
    }

    #[test]
    fn largest_image_and_p100_agree_on_ties_of_area() {
        for images in [vec![(768, 1024), (1024, 768), (10, 10)], vec![(1024, 768), (768, 1024), (10, 10)]] {
            let (largest, p100) = images_by_area(&images, 100.0);
            assert_eq!(largest, p100, "{images:?}");
            assert_eq!(largest, Some((1024, 768)));
        }
        assert_eq!(images_by_area(&[], 50.0), (None, None));
    }
}
