//! EasyEdit's multimodal edit data (E-VQA, E-IC) for vision-language models: the reader,
//! the five views of its `MultimodalTrainer` as tokenised examples, and the image features
//! a group of examples needs, computed once per image.
//!
//! Records carry `src`, `pred`, `alt`, `rephrase`, `image`, `image_rephrase`, `loc`,
//! `loc_ans`, `m_loc`, `m_loc_q`, `m_loc_a`. `image` and `m_loc` are relative to the COCO
//! root (`--image-root`), `image_rephrase` to the rephrase-image root
//! (`--rephrase-image-root`, default the first). As EasyEdit, records with an empty `alt`
//! are skipped; a record whose image is missing or unreadable is skipped and named (an
//! error under `--strict`), where EasyEdit would stop with a Python traceback. Every image
//! is decoded in full when the file is read, so a truncated PNG or JPEG whose header is
//! intact is skipped here, not found halfway through a training run. An empty `rephrase`
//! is absent (no rephrase accuracy for that record, counted), not a question.
//!
//! Views (per record): `edit_inner` (src + image → alt), `edit_outer` (rephrase + image →
//! alt), `edit_outer_image` (src + image_rephrase → alt), `loc` (the text-only NQ
//! question → loc_ans) and `loc_image` (`Question: {m_loc_q} Short answer:` + the m_loc
//! image → m_loc_a). Image prompts go through the checkpoint's chat template
//! ([`ChatTemplate`]; Qwen2-VL's default when it has none) with the image's
//! `<|image_pad|>` run; the answer follows as `" " + target` and only its tokens are
//! labelled.
use std::collections::HashMap;
use std::path::{Path, PathBuf};

use serde_json::Value;
use tch::{Device, Tensor};

use super::batch::{EditExample, Example, ImageRef, TokenBatch};
use super::easyedit::DatasetKind;
use super::examples::{OverLong, Prepared};
pub use crate::model::vision::ChatTemplate;
use crate::model::vision::{image, Grid, ImageProcessorConfig, PreparedImage};
use crate::model::{ParamView, Tokenizer, VisionLanguage};
use crate::{Error, Result};

/// Where the relative image paths of a multimodal file point.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ImageRoots {
    /// `image` and `m_loc` (EasyEdit's `coco_image`).
    pub image_root: PathBuf,
    /// `image_rephrase` (EasyEdit's `rephrase_image`); the image root when not given.
    pub rephrase_root: PathBuf,
}

impl ImageRoots {
    pub fn new(image_root: PathBuf, rephrase_root: Option<PathBuf>) -> Self {
        let rephrase_root = rephrase_root.unwrap_or_else(|| image_root.clone());
        Self { image_root, rephrase_root }
    }
}

/// An image file of a record, checked readable, with its size in pixels.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ImageFile {
    pub path: PathBuf,
    pub height: i64,
    pub width: i64,
}

/// One E-VQA / E-IC record with its images resolved. Only `src`, `alt` and `image` are
/// required, as in EasyEdit; a view whose fields are absent (or empty) is not built, and
/// the metrics that need it are absent, not zero.
#[derive(Debug, Clone, PartialEq)]
pub struct MmRecord {
    pub src: String,
    pub pred: Option<String>,
    pub alt: String,
    /// `None` when the record's `rephrase` is empty or absent.
    pub rephrase: Option<String>,
    pub image: ImageFile,
    pub image_rephrase: Option<ImageFile>,
    /// The text locality question and its answer (`loc`, `loc_ans`).
    pub loc: Option<(String, String)>,
    /// The image locality view: image, question, answer (`m_loc`, `m_loc_q`, `m_loc_a`).
    pub m_loc: Option<MultimodalLocality>,
}

/// An E-VQA record's unrelated image and question (EasyEdit's `m_loc`, `m_loc_q`, `m_loc_a`).
#[derive(Debug, Clone, PartialEq)]
pub struct MultimodalLocality {
    pub image: ImageFile,
    pub question: String,
    pub answer: String,
}

impl MmRecord {
    /// The record as a text edit request: `src` → `alt`, its rephrase and its NQ
    /// locality question (what metrics and reports name it by).
    pub fn as_edit_record(&self) -> crate::data::easyedit::EditRecord {
        crate::data::easyedit::EditRecord {
            prompt: self.src.clone(),
            target_new: self.alt.clone(),
            subject: None,
            ground_truth: self.pred.clone(),
            rephrase: self.rephrase.clone(),
            locality_prompt: self.loc.as_ref().map(|l| l.0.clone()),
            locality_ground_truth: self.loc.as_ref().map(|l| l.1.clone()),
            portability: Vec::new(),
        }
    }
}

/// The keys of a record that name images, and whether each is relative to the rephrase
/// root (otherwise the image root).
pub const IMAGE_KEYS: [(&str, bool); 3] = [("image", false), ("image_rephrase", true), ("m_loc", false)];

/// Confines the image names of `records` (a JSON array of E-VQA records that a remote
/// client sent) to their roots: each is resolved with [`crate::io::resolve_under`] (no
/// absolute path, no `..`, no symbolic link out of the root) and replaced by the resolved
/// absolute path, which [`parse_mm`] then takes as it is (joining an absolute path to a
/// root gives the path). A name that leaves its root is an [`Error::Input`] naming the
/// record and the key; a missing or non-string key is left for [`parse_mm`] to report.
pub fn confine_images(records: &mut Value, roots: &ImageRoots) -> Result<()> {
    let Value::Array(items) = records else { return Ok(()) };
    for (i, item) in items.iter_mut().enumerate() {
        let Value::Object(obj) = item else { continue };
        for (key, rephrase) in IMAGE_KEYS {
            let Some(Value::String(name)) = obj.get(key) else { continue };
            let root = if rephrase { &roots.rephrase_root } else { &roots.image_root };
            let resolved = crate::io::resolve_under(root, Path::new(name)).map_err(|e| match e {
                Error::Input(m) => Error::input(format!("record {i}: key {key:?}: {m}")),
                e => e,
            })?;
            let resolved = resolved
                .to_str()
                .ok_or_else(|| Error::input(format!("record {i}: key {key:?}: the resolved image path is not UTF-8")))?
                .to_string();
            obj.insert(key.to_string(), Value::String(resolved));
        }
    }
    Ok(())
}

/// What the reader kept and what it left out.
#[derive(Debug, Clone, Default)]
pub struct MmLoad {
    pub records: Vec<MmRecord>,
    /// Index in the file of each kept record.
    pub file_index: Vec<usize>,
    /// Records in the file.
    pub in_file: usize,
    /// Records with an empty `alt` (EasyEdit skips them too).
    pub skipped_empty: Vec<(usize, String)>,
    /// Records with a missing or unreadable image.
    pub skipped_image: Vec<(usize, String)>,
    /// Kept records whose `rephrase` is empty (their rephrase accuracy is not measured).
    pub no_rephrase: usize,
}

pub use crate::model::vision::image::MAX_IMAGE_PIXELS;

/// Opens and decodes the whole image at `p` the one way every image is read
/// ([`image::open_checked`]: regular file, size cap, PNG or JPEG by content, pixel bound
/// from the header, full decode), so a file whose header is fine but whose data is
/// truncated or corrupt is found now. Returns `(height, width)`; the reason, naming the
/// file, otherwise.
pub fn decode_check(p: &Path) -> std::result::Result<(i64, i64), String> {
    image::open_checked(p).map(|img| (img.height as i64, img.width as i64)).map_err(|e| e.to_string())
}

/// Reads an E-VQA (`DatasetKind::Vqa`) or E-IC (`DatasetKind::Caption`) file.
pub fn load_mm(path: &Path, kind: DatasetKind, roots: &ImageRoots, strict: bool) -> Result<MmLoad> {
    let text = crate::io::read_text(path)?;
    parse_mm(&text, path, kind, roots, strict)
}

/// An optional string key: absent, `null` or blank is `None`.
fn opt_key<'a>(obj: &'a serde_json::Map<String, Value>, i: usize, key: &str) -> std::result::Result<Option<&'a str>, String> {
    match obj.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok((!s.trim().is_empty()).then_some(s.as_str())),
        Some(_) => Err(format!("record {i}: key {key:?} must be a string")),
    }
}

/// Keys that make one view together: all given, or none (one alone is a mistake, named).
fn group<'a, const N: usize>(obj: &'a serde_json::Map<String, Value>, i: usize, keys: [&str; N]) -> std::result::Result<Option<[&'a str; N]>, String> {
    let vals = keys.map(|k| opt_key(obj, i, k));
    let mut out = [""; N];
    let mut given = Vec::new();
    for (n, v) in vals.into_iter().enumerate() {
        if let Some(v) = v? {
            out[n] = v;
            given.push(keys[n]);
        }
    }
    match given.len() {
        0 => Ok(None),
        n if n == N => Ok(Some(out)),
        _ => {
            let missing: Vec<&str> = keys.iter().filter(|k| !given.contains(k)).copied().collect();
            Err(format!("record {i}: {} given without {} (they make one view: give all or none)", given.join(", "), missing.join(", ")))
        }
    }
}

fn str_key<'a>(obj: &'a serde_json::Map<String, Value>, i: usize, key: &str) -> std::result::Result<&'a str, String> {
    match obj.get(key) {
        Some(Value::String(s)) => Ok(s),
        None => Err(format!("record {i}: missing key {key:?}")),
        Some(_) => Err(format!("record {i}: key {key:?} must be a string")),
    }
}

/// Parses the text of a multimodal file (`path` only for messages) and checks every image
/// it names: a PNG/JPEG under its root that decodes in full ([`decode_check`]).
/// `strict`: a bad image is an error.
pub fn parse_mm(text: &str, path: &Path, kind: DatasetKind, roots: &ImageRoots, strict: bool) -> Result<MmLoad> {
    if !kind.is_multimodal() {
        return Err(Error::file(path, format!("{kind} is not a multimodal dataset kind (vqa or caption)")));
    }
    for root in [&roots.image_root, &roots.rephrase_root] {
        if !root.is_dir() {
            return Err(Error::file(root, "image root is not a directory"));
        }
    }
    let root: Value = serde_json::from_str(text).map_err(|e| Error::file(path, format!("malformed JSON: {e}")))?;
    let Value::Array(items) = root else {
        return Err(Error::file(path, format!("top level must be a JSON array of {kind} records")));
    };
    if items.is_empty() {
        return Err(Error::file(path, "no records (the top-level array is empty)"));
    }
    let mut out = MmLoad { in_file: items.len(), ..Default::default() };
    let mut sizes: HashMap<PathBuf, std::result::Result<(i64, i64), String>> = HashMap::new();
    let mut check = |root: &Path, rel: &str| -> std::result::Result<ImageFile, String> {
        let p = root.join(rel);
        let r = sizes.entry(p.clone()).or_insert_with(|| decode_check(&p)).clone()?;
        Ok(ImageFile { path: p, height: r.0, width: r.1 })
    };
    for (i, item) in items.iter().enumerate() {
        let Value::Object(obj) = item else {
            return Err(Error::file(path, format!("record {i}: expected a JSON object")));
        };
        let s = |key: &str| str_key(obj, i, key).map_err(|m| Error::file(path, m));
        let (src, alt, img) = (s("src")?, s("alt")?, s("image")?);
        let fail = |m: String| Error::file(path, m);
        let rephrase = opt_key(obj, i, "rephrase").map_err(fail)?;
        let img_rephrase = opt_key(obj, i, "image_rephrase").map_err(fail)?;
        let loc = group(obj, i, ["loc", "loc_ans"]).map_err(fail)?;
        let m_loc = group(obj, i, ["m_loc", "m_loc_q", "m_loc_a"]).map_err(fail)?;
        let pred = match obj.get("pred") {
            Some(Value::String(p)) if !p.trim().is_empty() => Some(p.clone()),
            _ => None,
        };
        if alt.trim().is_empty() {
            out.skipped_empty.push((i, "empty \"alt\" (target)".into()));
            continue;
        }
        if src.trim().is_empty() {
            out.skipped_empty.push((i, "empty \"src\" (prompt)".into()));
            continue;
        }
        let images = (|| -> std::result::Result<_, String> {
            Ok((
                check(&roots.image_root, img)?,
                img_rephrase.map(|p| check(&roots.rephrase_root, p)).transpose()?,
                m_loc.map(|[p, _, _]| check(&roots.image_root, p)).transpose()?,
            ))
        })();
        let (image, image_rephrase, m_loc_image) = match images {
            Ok(t) => t,
            Err(why) if strict => return Err(Error::file(path, format!("record {i}: {why}"))),
            Err(why) => {
                tracing::warn!(file = %path.display(), "record {i} skipped: {why}");
                out.skipped_image.push((i, why));
                continue;
            }
        };
        let rephrase = rephrase.map(str::to_string);
        out.no_rephrase += usize::from(rephrase.is_none());
        out.records.push(MmRecord {
            src: src.to_string(),
            pred,
            alt: alt.to_string(),
            rephrase,
            image,
            image_rephrase,
            loc: loc.map(|[q, a]| (q.to_string(), a.to_string())),
            m_loc: m_loc.zip(m_loc_image).map(|([_, q, a], image)| MultimodalLocality { image, question: q.to_string(), answer: a.to_string() }),
        });
        out.file_index.push(i);
    }
    if out.records.is_empty() {
        let first = out.skipped_empty.iter().chain(&out.skipped_image).min_by_key(|(i, _)| *i);
        let why = first.map(|(i, w)| format!(" (first: record {i}: {w})")).unwrap_or_default();
        return Err(Error::file(path, format!("no usable records: all {} were skipped{why}", out.in_file)));
    }
    if out.no_rephrase > 0 {
        tracing::warn!(file = %path.display(), "{} of {} records have an empty \"rephrase\": their rephrase accuracy is not measured", out.no_rephrase, out.records.len());
    }
    let partial = out.records.iter().filter(|r| r.image_rephrase.is_none() || r.loc.is_none() || r.m_loc.is_none()).count();
    if partial > 0 {
        tracing::info!(file = %path.display(), "{partial} of {} records leave out image_rephrase, loc / loc_ans or m_loc / m_loc_q / m_loc_a: the metrics of those views are absent for them", out.records.len());
    }
    if !out.skipped_empty.is_empty() || !out.skipped_image.is_empty() {
        tracing::warn!(
            file = %path.display(),
            "skipped {} of {} records: {} with an empty target, {} with a missing or unreadable image{}",
            out.skipped_empty.len() + out.skipped_image.len(),
            out.in_file,
            out.skipped_empty.len(),
            out.skipped_image.len(),
            if strict { "" } else { " (`strict`=true makes a bad image an error)" }
        );
    }
    Ok(out)
}

/// What turns text + image into the tokens of a vision-language model.
#[derive(Clone, Copy)]
pub struct VlPrompt<'a> {
    pub vl: &'a dyn VisionLanguage,
    pub proc: &'a ImageProcessorConfig,
    /// The checkpoint's chat template ([`ChatTemplate::load`]; [`ChatTemplate::qwen2_vl`]
    /// for Qwen2-VL's default).
    pub template: &'a ChatTemplate,
}

impl VlPrompt<'_> {
    /// The example `chat(image, text) + " " + answer`, labelled on the answer, with the
    /// template's one `<|image_pad|>` expanded to the image's merged-patch count: the ids
    /// transformers' processor gives for `apply_chat_template(..., add_generation_prompt=True)
    /// + " " + answer` with the image.
    pub fn image_example(&self, tok: &Tokenizer, img: &ImageFile, text: &str, answer: &str) -> Result<Example> {
        let grid = self.proc.grid_for(img.height, img.width).map_err(|e| Error::file(&img.path, e.to_string()))?;
        let answer = answer.trim();
        if answer.is_empty() {
            return Err(Error::input(format!("empty answer for {text:?}")));
        }
        // `<|image_pad|>` or `<|im_end|>` as a target would be edited in as that token
        // (an image slot, the end of a turn), not as text.
        if let Some(special) = tok.special_in(answer) {
            return Err(Error::input(format!("answer {answer:?} for {text:?} contains the special token {special} (tokenizer {}); an answer is text", tok.path().display())));
        }
        let prompt = self.template.image_prompt(text)?;
        let full = tok.encode(&format!("{prompt} {answer}"))?;
        let prompt_ids = tok.encode(&prompt)?;
        let start = prompt_ids.iter().zip(&full).take_while(|(a, b)| a == b).count();
        if start >= full.len() {
            return Err(Error::input(format!("answer {answer:?} adds no token after {text:?}")));
        }
        let pad = self.vl.tokens().image_pad;
        let at: Vec<usize> = full[..start].iter().enumerate().filter(|(_, &t)| t == pad).map(|(i, _)| i).collect();
        if at.len() != 1 {
            return Err(Error::input(format!(
                "the chat template gives {} <|image_pad|> token(s) with {} (tokenizer {}), expected 1",
                at.len(),
                text.chars().take(40).collect::<String>(),
                tok.path().display()
            )));
        }
        let run = self.vl.image_prompt(&grid);
        let n = run.len() - 2; // without vision_start / vision_end
        let mut ids = Vec::with_capacity(full.len() + n);
        ids.extend_from_slice(&full[..at[0]]);
        ids.extend(std::iter::repeat_n(pad, n));
        ids.extend_from_slice(&full[at[0] + 1..]);
        Ok(Example { ids, answer_start: start + n - 1, image: Some(ImageRef { path: img.path.clone(), grid }) })
    }
}

/// The five views of each record. An example longer than the model's context, or whose
/// text (image tokens not counted) is longer than `max_len`, is skipped (`Strict`: an
/// error; `Truncate` cannot cut an image prompt and skips too).
pub fn prepare_mm(tok: &Tokenizer, vp: VlPrompt, load: &MmLoad, max_len: usize, context: usize, policy: OverLong, path: &Path) -> Result<Prepared> {
    let mut out = Prepared::default();
    for (pos, (r, &i)) in load.records.iter().zip(&load.file_index).enumerate() {
        let fail = |e: Error| Error::file(path, format!("record {i}: {e}"));
        let views = (|| -> Result<std::result::Result<EditExample, String>> {
            // Absent views are not built (their metrics are absent); no rephrase: the edit
            // prompt stands in for `edit_outer`, which is then not measured (`rephrased: false`).
            let built = [
                ("edit_inner", Some(vp.image_example(tok, &r.image, &r.src, &r.alt))),
                ("edit_outer", Some(vp.image_example(tok, &r.image, r.rephrase.as_deref().unwrap_or(&r.src), &r.alt))),
                ("edit_outer_image", r.image_rephrase.as_ref().map(|i| vp.image_example(tok, i, &r.src, &r.alt))),
                ("loc", r.loc.as_ref().map(|(q, a)| Example::new(tok, q, a))),
                (
                    "loc_image",
                    r.m_loc.as_ref().map(|m| vp.image_example(tok, &m.image, &format!("Question: {} Short answer:", m.question.trim()), &m.answer)),
                ),
            ];
            let mut views = Vec::with_capacity(5);
            for (name, e) in built {
                let Some(e) = e else {
                    views.push(None);
                    continue;
                };
                let e = e.map_err(fail)?;
                let image_tokens = e.ids.iter().filter(|&&t| t == vp.vl.tokens().image_pad).count();
                let text = e.ids.len() - image_tokens;
                let why = if e.ids.len() > context {
                    Some(format!("{name} is {} tokens, longer than the model's context of {context}", e.ids.len()))
                } else if text > max_len {
                    Some(format!("{name} has {text} text tokens, more than the maximum of {max_len}"))
                } else {
                    None
                };
                match (why, policy) {
                    (Some(w), OverLong::Strict) => return Err(fail(Error::input(w))),
                    (Some(w), _) => return Ok(Err(w)),
                    (None, _) => views.push(Some(e)),
                }
            }
            let [inner, outer, outer_image, loc, loc_image]: [Option<Example>; 5] =
                views.try_into().map_err(|_| Error::Internal("five views expected".into()))?;
            let (Some(inner), Some(outer)) = (inner, outer) else {
                return Err(Error::Internal("the edit views are always built".into()));
            };
            Ok(Ok(EditExample { inner, outer, rephrased: r.rephrase.is_some(), loc, portability: Vec::new(), outer_image, loc_image, neighbours: Vec::new() }))
        })()?;
        match views {
            Ok(e) => {
                out.examples.push(e);
                out.kept.push(pos);
            }
            Err(why) => out.skipped.push((i, why)),
        }
    }
    if out.examples.is_empty() {
        let first = out.skipped.first().map(|(i, w)| format!(" (first: record {i}: {w})")).unwrap_or_default();
        return Err(Error::file(path, format!("no record fits: all {} were skipped{first}", out.skipped.len())));
    }
    if !out.skipped.is_empty() {
        tracing::warn!(file = %path.display(), "skipped {} records too long ({})", out.skipped.len(), super::examples::shown(&out.skipped));
    }
    Ok(out)
}

/// The frozen vision tower's features of every distinct image of a group of examples
/// (one optimiser micro-step, one evaluated edit), computed once and shared by every view
/// that shows the image; on the device of the weights they were computed with (main).
pub struct StepImages<'a> {
    vl: &'a dyn VisionLanguage,
    feats: HashMap<PathBuf, Tensor>,
}

impl<'a> StepImages<'a> {
    /// Features `[n_i, D]` of each distinct image of `examples`, from one tower forward;
    /// `None` when no example has an image.
    pub fn compute(vl: &'a dyn VisionLanguage, params: &ParamView, proc: &ImageProcessorConfig, examples: &[&Example]) -> Result<Option<Self>> {
        Self::compute_with(vl, params, proc, examples, false)
    }

    /// [`StepImages::compute`] with the vision tower in the autograd graph, for
    /// pretraining, which trains the tower through the features.
    pub fn compute_trainable(vl: &'a dyn VisionLanguage, params: &ParamView, proc: &ImageProcessorConfig, examples: &[&Example]) -> Result<Option<Self>> {
        Self::compute_with(vl, params, proc, examples, true)
    }

    fn compute_with(vl: &'a dyn VisionLanguage, params: &ParamView, proc: &ImageProcessorConfig, examples: &[&Example], trainable: bool) -> Result<Option<Self>> {
        let mut order: Vec<&ImageRef> = Vec::new();
        for r in examples.iter().filter_map(|e| e.image.as_ref()) {
            if !order.iter().any(|o| o.path == r.path) {
                order.push(r);
            }
        }
        if order.is_empty() {
            return Ok(None);
        }
        let mut prepared = Vec::with_capacity(order.len());
        for r in &order {
            let p = image::prepare(&r.path, proc)?;
            if p.grid != r.grid {
                return Err(Error::file(&r.path, format!("image grid {:?} differs from {:?} when the data was read (file changed?)", p.grid, r.grid)));
            }
            prepared.push(p);
        }
        Self::tower(vl, params, &prepared, trainable).map(Some)
    }

    /// [`StepImages::compute`] from images already read and preprocessed (distinct
    /// paths): the tower alone. What a caller holding pixel values runs (the bench's
    /// like-for-like timing against a PyTorch side that is given pixel values).
    pub fn from_prepared(vl: &'a dyn VisionLanguage, params: &ParamView, prepared: &[PreparedImage]) -> Result<Self> {
        Self::tower(vl, params, prepared, false)
    }

    fn tower(vl: &'a dyn VisionLanguage, params: &ParamView, prepared: &[PreparedImage], trainable: bool) -> Result<Self> {
        let pixels: Vec<&Tensor> = prepared.iter().map(|p| &p.pixel_values).collect();
        let grids: Vec<Grid> = prepared.iter().map(|p| p.grid).collect();
        let feats = crate::error::guard(|| {
            let pixels = Tensor::cat(&pixels, 0).to_device(params.device());
            let all = if trainable { vl.image_features_trainable(params, &pixels, &grids)? } else { vl.image_features(params, &pixels, &grids)? };
            let merge = vl.merge_unit();
            let sizes: Vec<i64> = grids.iter().map(|g| g.iter().product::<i64>() / merge).collect();
            Ok(all.split_with_sizes(sizes.as_slice(), 0))
        })?;
        Ok(Self { vl, feats: prepared.iter().map(|p| p.path.clone()).zip(feats).collect() })
    }

    /// Distinct images computed.
    pub fn len(&self) -> usize {
        self.feats.len()
    }

    pub fn is_empty(&self) -> bool {
        self.feats.is_empty()
    }

    /// [`TokenBatch::collate`] plus, when a row shows an image, the M-RoPE positions
    /// `[3, B, T]` of every row (text rows: plain positions on all three streams, padding
    /// 0) and the rows' image features in row order `[Σ n_i, D]`.
    pub fn collate(&self, examples: &[&Example], pad_id: i64, device: Device) -> Result<TokenBatch> {
        let mut b = TokenBatch::collate(examples, pad_id, device);
        if examples.iter().all(|e| e.image.is_none()) {
            return Ok(b);
        }
        let t = b.input_ids.size()[1] as usize;
        let n_rows = examples.len();
        let mut pos = vec![0i64; 3 * n_rows * t];
        let mut feats = Vec::new();
        for (row, e) in examples.iter().enumerate() {
            let n = e.ids.len().saturating_sub(1).max(1).min(e.ids.len());
            let grids: Vec<Grid> = e.image.iter().map(|r| r.grid).collect();
            let p = Vec::<i64>::try_from(self.vl.mrope_positions(&e.ids[..n], &grids)?.reshape([-1]))?;
            for s in 0..3 {
                let at = (s * n_rows + row) * t;
                pos[at..at + n].copy_from_slice(&p[s * n..(s + 1) * n]);
            }
            if let Some(r) = &e.image {
                let f = self.feats.get(&r.path).ok_or_else(|| Error::file(&r.path, "image features were not computed for this step"))?;
                feats.push(f.shallow_clone());
            }
        }
        crate::error::guard(|| {
            b.position_ids = Some(Tensor::from_slice(&pos).reshape([3, n_rows as i64, t as i64]).to_device(device));
            b.image_embeds = Some(Tensor::cat(&feats, 0).to_device(device));
            Ok(())
        })?;
        Ok(b)
    }
}
