//! Making an edit, the one place that does it: the method (MEND, fine-tuning, none),
//! reading a trained editor, opening a model for it, an edit measured before and after,
//! greedy answers (with a KV cache) and writing an edited model.
//!
//! [`crate::edit::session::Session`] (and through it `dualedit edit` and `serve`), the demo and
//! `eval` all edit through these functions; [`crate::edit::eval`] keeps the metrics.
pub mod call;
pub mod capacity;
pub mod conflicts;
pub mod eval;
pub mod method;
pub mod score;
pub mod session;

use std::path::{Path, PathBuf};
use std::time::Instant;

use serde::Serialize;
use tch::{Kind, Tensor};
use tracing::info;

use crate::data::{EditExample, Example, TokenBatch};
use crate::device::DevicePlan;
use eval::RecordMetrics;
use crate::mend::ls::{Fact, KeyMemory, LsChoice, LsEditor};
use crate::mend::{checkpoint, Engine};
use crate::model::{load_model_split, ForwardInput, KvCache, LoadedModel, Overrides, ParamView};
use crate::model::vision::Grid;
use crate::model::VisionLanguage;
use crate::{Error, Result};
pub use method::{CallMethod, EditCall, EditMethod, FineTune, Mend, Unedited};

/// The method every interface edits with when none is named (the CLI's `--method`,
/// `serve --method`, the Python package's `method=`): [`MethodSpec::Auto`], one request
/// with `mend`, several or one after another with `mend-ls` and the editor for many edits.
pub const DEFAULT_METHOD: &str = "auto";

/// A method as the user names it, before anything is loaded.
#[derive(Debug, Clone)]
pub enum MethodSpec {
    Unedited,
    FineTune { lr: f64 },
    /// MEND with the editor trained into this directory.
    Mend { editor: PathBuf },
    /// `mend-ls`: that editor's updates combined by least squares ([`crate::mend::ls`]).
    MendLs {
        editor: PathBuf,
        /// The `--ls-*` settings given; the rest are the editor's (`MendConfig::ls`).
        ls: LsChoice,
        /// Lines of unrelated text whose keys the solve keeps (none: the editor's key
        /// statistics, [`crate::mend::stats`]; neither: λ only).
        unrelated: Option<PathBuf>,
    },
    /// The default (`--method auto`): `mend` with `editor` for one request; for several,
    /// or one after another (`many`), `mend-ls` with the editor for many edits that
    /// `editor`'s editor.json names (`many_editor`), or with `editor` itself when it has
    /// key statistics or a keep text is given, and plain `mend` (with a warning) when it
    /// has neither. Resolved by [`MethodSpec::resolved`] when the model is opened.
    Auto {
        editor: PathBuf,
        ls: LsChoice,
        unrelated: Option<PathBuf>,
        /// The run edits several requests or one after another, or cannot know (a
        /// server, a library session): a `mend-ls` session then makes a single request
        /// in one call with plain `mend` of the same editor.
        many: bool,
    },
}

impl MethodSpec {
    /// The ranges its settings must lie in (`--ls-*`, `--ft-lr`): one error naming the flag.
    pub fn check(&self) -> Result<()> {
        match self {
            MethodSpec::MendLs { ls, .. } | MethodSpec::Auto { ls, .. } => ls.check(),
            MethodSpec::FineTune { lr } if !(lr.is_finite() && *lr > 0.0) => {
                Err(Error::input(format!("--ft-lr must be a positive number, got {lr}")))
            }
            _ => Ok(()),
        }
    }

    /// Checks the settings a user gave before anything is loaded, naming the flag: a
    /// fine-tuning rate that is not a finite positive number (`--ft-lr`), `--ls-*` values
    /// out of range, an `--ls-keep-text` that is not a regular file (a FIFO would block),
    /// an editor folder that does not exist. [`open`] calls it first.
    pub fn validate(&self) -> Result<()> {
        match self {
            MethodSpec::Unedited | MethodSpec::FineTune { .. } => self.check(),
            MethodSpec::Mend { editor } => editor_exists(editor),
            MethodSpec::MendLs { editor, unrelated, .. } | MethodSpec::Auto { editor, unrelated, .. } => {
                self.check()?;
                editor_exists(editor)?;
                if let Some(path) = unrelated {
                    match std::fs::metadata(path) {
                        Ok(m) if m.is_file() => {}
                        Ok(_) => return Err(Error::file(path, "--ls-keep-text must name a regular file of text lines (not a directory, FIFO or device)")),
                        Err(e) => return Err(Error::io(path, e)),
                    }
                }
                Ok(())
            }
        }
    }

    /// The trained editor's directory, for both MEND methods.
    pub fn editor_dir(&self) -> Option<&Path> {
        match self {
            MethodSpec::Mend { editor } | MethodSpec::MendLs { editor, .. } | MethodSpec::Auto { editor, .. } => Some(editor),
            _ => None,
        }
    }

    /// `Auto` resolved to the method it runs (see [`MethodSpec::Auto`]), and whether that
    /// `mend-ls` makes a single-request call with plain `mend`; any other spec as it is.
    pub fn resolved(&self) -> Result<(MethodSpec, bool)> {
        let MethodSpec::Auto { editor, ls, unrelated, many } = self else { return Ok((self.clone(), false)) };
        editor_exists(editor)?;
        if !many {
            return Ok((MethodSpec::Mend { editor: editor.clone() }, false));
        }
        match many_editor(editor, unrelated.is_some())? {
            Some(dir) => Ok((MethodSpec::MendLs { editor: dir, ls: *ls, unrelated: unrelated.clone() }, true)),
            None => Ok((MethodSpec::Mend { editor: editor.clone() }, false)),
        }
    }
}

/// How many records a JSON request file holds (the length of its top-level array), before
/// any is read or checked: what `edit --method auto` chooses its method by. `None` when
/// the file is not a JSON array (the reader then names what is wrong with it).
pub fn request_count(path: &Path) -> Option<usize> {
    // Only a regular file is read here: a FIFO would block (the reader refuses it).
    let text = crate::io::read_text(path).ok()?;
    match serde_json::from_str::<serde_json::Value>(&text).ok()? {
        serde_json::Value::Array(a) => Some(a.len()),
        _ => None,
    }
}

/// The editor `--method auto` makes several edits with: the folder `dir`'s editor.json
/// names as `many_editor` (relative to `dir`), else `dir` itself when it has key
/// statistics (or `keep_text`: a keep text is given), else none. A named folder that does
/// not exist is an error naming the editor.json.
pub fn many_editor(dir: &Path, keep_text: bool) -> Result<Option<PathBuf>> {
    let meta = checkpoint::read_editor_json(dir)?;
    if let Some(rel) = &meta.many_editor {
        let many = dir.join(rel);
        if !many.join(checkpoint::EDITOR_JSON).is_file() {
            return Err(Error::file(dir.join(checkpoint::EDITOR_JSON), format!("names {rel:?} as its editor for many edits (many_editor), which holds no editor.json")));
        }
        return Ok(Some(many));
    }
    Ok((meta.key_stats.is_some() || keep_text).then(|| dir.to_path_buf()))
}

/// Where a model runs and how it is loaded.
#[derive(Debug, Clone, Copy)]
pub struct LoadOptions {
    /// Main device (frozen model, editor) and sub-device (edited forwards).
    pub plan: DevicePlan,
    /// Dtype of the model weights (editor maths is always f32).
    pub dtype: Kind,
}

impl Default for LoadOptions {
    /// CPU, f32.
    fn default() -> Self {
        Self { plan: DevicePlan::single(tch::Device::Cpu), dtype: Kind::Float }
    }
}

fn editor_exists(dir: &Path) -> Result<()> {
    if dir.is_dir() {
        Ok(())
    } else {
        Err(Error::file(dir, "editor directory not found (--editor)"))
    }
}

/// The edited weight names a trained editor was made for, from its `editor.json`: the
/// engine must capture exactly those before the editor itself can be loaded and checked.
pub fn editor_params(dir: &Path) -> Result<Vec<String>> {
    Ok(checkpoint::read_editor_json(dir)?.params.into_iter().map(|p| p.name).collect())
}

/// Loads `model` on the main device (the replica on the sub-device when split) with the
/// weights `edit_names` marked for editing (empty: the family's default).
pub fn open_engine(model: &Path, opts: &LoadOptions, edit_names: &[String]) -> Result<Engine> {
    // A layer split reads its sub-side blocks straight onto the sub-device, and a chain's
    // blocks onto their devices.
    let plan = &opts.plan;
    let sub_side = match (plan.split, plan.placement, plan.boundary) {
        (true, crate::device::Placement::Balanced, Some(at)) => Some((plan.sub, at)),
        _ => None,
    };
    let chain: Vec<(tch::Device, usize)> = match sub_side {
        Some(_) => plan.chain.names().iter().map(|d| d.device()).zip(plan.chain.at().iter().copied()).collect(),
        None => Vec::new(),
    };
    let lm = load_model_split(model, plan.main, opts.dtype, sub_side, &chain)?;
    Engine::new(lm, opts.plan, edit_names)
}

/// Opens the engine and the method: with an editor, on the weights it was trained to edit
/// (a model without them is another model than the editor's, and the error says so).
pub fn open(model: &Path, opts: &LoadOptions, spec: &MethodSpec) -> Result<(Engine, Box<dyn EditMethod>)> {
    spec.validate()?;
    let (resolved, single_mend) = spec.resolved()?;
    match (spec, &resolved) {
        (MethodSpec::Auto { .. }, MethodSpec::MendLs { editor, .. }) => {
            info!(editor = %editor.display(), "several edits: mend-ls (least squares over the edits' keys; a single request: mend)")
        }
        (MethodSpec::Auto { many: true, editor, .. }, _) => tracing::warn!(
            editor = %editor.display(),
            "several edits with plain mend: the editor names no editor for many edits (many_editor) and has no key statistics; \
             summed MEND edits interfere (compute statistics with `dualedit stats`, or pass --method mend-ls --ls-keep-text FILE)"
        ),
        _ => {}
    }
    let spec = &resolved;
    let names = match spec.editor_dir() {
        Some(editor) => editor_params(editor)?,
        None => Vec::new(),
    };
    let engine = open_engine(model, opts, &names).map_err(|e| match (spec, e) {
        (MethodSpec::Mend { editor } | MethodSpec::MendLs { editor, .. } | MethodSpec::Auto { editor, .. }, Error::Input(msg)) => Error::file(
            editor.join(checkpoint::EDITOR_JSON),
            format!("editor was trained for another model than {}: {msg}", model.display()),
        ),
        (_, e) => e,
    })?;
    let method: Box<dyn EditMethod> = match spec {
        MethodSpec::Unedited => Box::new(Unedited),
        MethodSpec::FineTune { lr } => Box::new(FineTune { lr: *lr }),
        MethodSpec::Mend { editor } => {
            let (ed, meta) = checkpoint::load_editor(editor, &engine)?;
            info!(dir = %editor.display(), step = meta.step, "editor loaded");
            Box::new(Mend(ed))
        }
        MethodSpec::MendLs { editor, ls, unrelated } => {
            let (ed, meta) = checkpoint::load_editor(editor, &engine)?;
            let ls = ls.resolve(&ed.config.ls);
            ls.validate()?;
            info!(dir = %editor.display(), step = meta.step, lambda = ls.lambda, keep_weight = ls.cov_weight, rounds = ls.rounds, "editor loaded (least-squares aggregation)");
            let mut stats_text = None;
            let unrelated = match (unrelated, crate::mend::stats::editor_stats_path(editor)?) {
                (Some(path), _) => crate::mend::ls::unrelated_grams(&engine, &crate::mend::stats::read_keep_text(path)?)?,
                (None, Some(stats)) => {
                    let st = crate::mend::stats::KeyStats::load(&stats, &engine)?;
                    info!(file = %stats.display(), tokens = st.meta.tokens, "mend-ls solves against the editor's key statistics");
                    stats_text = crate::mend::stats::SummedText::find(&st.meta, editor);
                    st.grams()?
                }
                (None, None) => {
                    tracing::warn!(
                        editor = %editor.display(),
                        "mend-ls without key statistics or a keep text: nothing holds the unrelated text's answers (locality suffers); \
                         compute them once with `dualedit stats --model M --editor E --text FILE`"
                    );
                    Vec::new()
                }
            };
            Box::new(LsEditor { editor: ed, config: ls, memory: KeyMemory::default(), unrelated, stats_text, single_mend })
        }
        MethodSpec::Auto { .. } => return Err(Error::Internal("--method auto was not resolved".into())),
    };
    Ok((engine, method))
}

/// Computes the edited weights for the edit examples in `inner` (one batch; the update is
/// the sum over its examples) as the method was opened, rewriting no named fact.
pub fn make_edit(engine: &Engine, method: &mut dyn EditMethod, inner: &TokenBatch) -> Result<Overrides> {
    method::propose(engine, method, inner, &EditCall::batch())
}

/// An edit and what it did: the edited weights (not committed) and each example's metrics
/// against the weights before it.
pub struct Measured {
    pub overrides: Overrides,
    pub metrics: Vec<RecordMetrics>,
}

/// Measures `examples` before, makes one batch edit of all of them (rewriting `facts`,
/// see [`EditCall::facts`]), measures after.
pub fn measured_edit(engine: &Engine, method: &mut dyn EditMethod, examples: &[&EditExample], facts: &[Fact]) -> Result<Measured> {
    if examples.is_empty() {
        return Err(Error::input("no edit requests"));
    }
    // The frozen tower's features of every image of the edit, once, for all views.
    let images = engine.images(&eval::all_views(examples))?;
    let before = eval::measure_before(engine, examples, images.as_ref())?;
    let start = Instant::now();
    let inner: Vec<&Example> = examples.iter().map(|e| &e.inner).collect();
    let call = EditCall { facts, ..EditCall::batch() };
    let overrides = method::propose(engine, method, &engine.collate_with(&inner, images.as_ref())?, &call)?;
    let per_example = start.elapsed().as_secs_f64() / examples.len() as f64;
    let metrics = eval::measure_after(engine, &overrides, examples, &before, per_example, images.as_ref())?;
    Ok(Measured { overrides, metrics })
}

/// EasyEdit-style evaluation: each example is edited on its own, starting from the
/// unedited model, and measured before and after. `facts`: each example's fact (or
/// `None`; empty: none), for `mend-ls`.
pub fn evaluate(
    engine: &Engine,
    method: &mut dyn EditMethod,
    examples: &[EditExample],
    facts: &[Option<Fact>],
    mut on_record: impl FnMut(usize, &RecordMetrics),
) -> Result<Vec<RecordMetrics>> {
    let mut all = Vec::with_capacity(examples.len());
    for (i, e) in examples.iter().enumerate() {
        let fact: Vec<Fact> = facts.get(i).cloned().flatten().into_iter().collect();
        let m = measured_edit(engine, method, &[e], &fact)?.metrics.remove(0);
        on_record(i, &m);
        all.push(m);
    }
    Ok(all)
}

/// One edit request's outcome.
#[derive(Debug, Clone, Serialize)]
pub struct RequestResult {
    pub prompt: String,
    pub target_new: String,
    /// Greedy answer before this edit call committed anything (as many tokens as the
    /// target has).
    pub answer_before: String,
    /// Greedy answer after the edit (as many tokens as the target has).
    pub answer_after: String,
    /// The commit guard refused this request's edit: nothing of it was committed, and
    /// its metrics after are the weights' without it.
    pub refused: bool,
    /// The guard's reason when it refused the edit (`null` otherwise): its one line, as
    /// the report's `guard` entry has it.
    pub refused_reason: Option<String>,
    #[serde(flatten)]
    pub metrics: RecordMetrics,
}

/// Why a greedy continuation stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Finish {
    /// The requested number of tokens was generated.
    Length,
    /// An end-of-sequence token was generated (it is included in the tokens).
    Eos,
    /// The model's context is full.
    Context,
}

/// Greedy continuation of `prompt` ids under the weights seen through `params` (edited or
/// not), with a KV cache: the prompt runs once, then one token per step, and the LM head
/// runs on the last position only. Stops after `max_new` tokens, at any of `eos`, or when
/// the context is full.
pub fn greedy(lm: &LoadedModel, params: &ParamView, prompt: &[i64], max_new: usize, eos: &[i64]) -> Result<(Vec<i64>, Finish)> {
    if prompt.is_empty() {
        return Err(Error::input("prompt is empty (it encodes to no tokens)"));
    }
    let _g = tch::no_grad_guard();
    let device = params.device();
    let max = lm.model.info().max_positions.max(0) as usize;
    let none = Default::default();
    let mut cache = KvCache::new();
    let mut feed = prompt.to_vec();
    let mut out = Vec::new();
    while out.len() < max_new {
        if prompt.len() + out.len() >= max {
            return Ok((out, Finish::Context));
        }
        let (ids, keep) = crate::error::guard(|| {
            let n = feed.len() as i64;
            let ids = Tensor::from_slice(&feed).unsqueeze(0).to_device(device);
            Ok((ids, Tensor::arange(n, (Kind::Int64, device)).eq(n - 1).unsqueeze(0)))
        })?;
        let input = ForwardInput { keep: Some(&keep), ..ForwardInput::new(&ids, &none) };
        let logits = lm.model.forward_cached(params, &input, &mut cache)?.logits;
        let next = crate::error::guard(|| Ok(logits.reshape([-1]).argmax(0, false).int64_value(&[])))?;
        out.push(next);
        if eos.contains(&next) {
            return Ok((out, Finish::Eos));
        }
        feed = vec![next];
    }
    Ok((out, Finish::Length))
}

/// [`greedy`] for a prompt that shows images: `prompt` holds the image runs (whose
/// features `feats` `[Σ merged patches, D]` of `grids` the frozen tower computed once),
/// and each new token runs one full forward (the KV cache has no M-RoPE continuation
/// yet), with the LM head on the last position only. Vision tokens are never chosen: fed
/// back, they would open an image run with no image.
pub fn greedy_with_images(
    lm: &LoadedModel,
    params: &ParamView,
    (vl, feats, grids): (&dyn VisionLanguage, &Tensor, &[Grid]),
    prompt: &[i64],
    max_new: usize,
    eos: &[i64],
) -> Result<(Vec<i64>, Finish)> {
    if prompt.is_empty() {
        return Err(Error::input("prompt is empty (it encodes to no tokens)"));
    }
    let _g = tch::no_grad_guard();
    let device = params.device();
    let max = lm.model.info().max_positions.max(0) as usize;
    let t = vl.tokens();
    let vision = [t.image_pad, t.vision_start, t.vision_end];
    let none = Default::default();
    let mut ids = prompt.to_vec();
    let mut out = Vec::new();
    while out.len() < max_new {
        if ids.len() >= max {
            return Ok((out, Finish::Context));
        }
        let next = crate::error::guard(|| {
            let n = ids.len() as i64;
            let pos = vl.mrope_positions(&ids, grids)?.unsqueeze(1).to_device(device);
            let input_ids = Tensor::from_slice(&ids).unsqueeze(0).to_device(device);
            let keep = Tensor::arange(n, (Kind::Int64, device)).eq(n - 1).unsqueeze(0);
            let input = ForwardInput { keep: Some(&keep), position_ids: Some(&pos), image_embeds: Some(feats), ..ForwardInput::new(&input_ids, &none) };
            next_token(&lm.model.forward(params, &input)?.logits, &vision)
        })?;
        ids.push(next);
        out.push(next);
        if eos.contains(&next) {
            return Ok((out, Finish::Eos));
        }
    }
    Ok((out, Finish::Length))
}

/// The argmax of the last scored position's logits (`[.., V]`), never one of `vision`.
fn next_token(logits: &Tensor, vision: &[i64]) -> Result<i64> {
    let vocab = logits.size().last().copied().unwrap_or(1);
    let last = logits.f_reshape([-1, vocab])?.f_get(-1)?.f_to_kind(Kind::Float)?;
    for &v in vision.iter().filter(|&&v| (0..vocab).contains(&v)) {
        let _ = last.f_get(v)?.f_fill_(f64::NEG_INFINITY)?;
    }
    Ok(last.f_argmax(-1, false)?.f_int64_value(&[])?)
}

/// The greedy answer to an example's prompt under the engine's current weights, as many
/// tokens as its target. Text prompts decode with the KV cache ([`greedy`]). Prompts with
/// an image run one full forward per new token (the image's features are computed once):
/// the cache has no M-RoPE continuation yet. Vision tokens are never chosen there: fed
/// back, they would open an image run with no image.
pub fn answer(engine: &Engine, e: &Example) -> Result<String> {
    let lm = &engine.lm;
    if e.image.is_none() {
        let (ids, _) = greedy(lm, &ParamView::frozen(&lm.params), &e.ids[..e.answer_start], e.answer().len(), &[])?;
        return lm.tokenizer.decode(&ids);
    }
    let images = engine.images(&[e])?;
    let vision: Vec<i64> = match lm.model.family().vision_language() {
        Some(vl) => {
            let t = vl.tokens();
            vec![t.image_pad, t.vision_start, t.vision_end]
        }
        None => Vec::new(),
    };
    let mut ids = e.ids[..e.answer_start].to_vec();
    let mut out = Vec::with_capacity(e.answer().len());
    for _ in 0..e.answer().len() {
        // A placeholder last token makes the one scored position the one that predicts
        // the token after `ids` (causal attention: the placeholder changes nothing before it).
        let probe = Example { ids: [ids.as_slice(), &[0]].concat(), answer_start: ids.len(), image: e.image.clone() };
        let logits = engine.base_logits(&engine.collate_with(&[&probe], images.as_ref())?)?;
        let next = crate::error::guard(|| next_token(&logits, &vision))?;
        ids.push(next);
        out.push(next);
    }
    lm.tokenizer.decode(&out)
}

/// Refuses to write a model into a folder that already holds one (the source model or any
/// other), which would replace it or leave a mix of two models' files.
pub fn check_new_model_dir(dir: &Path) -> Result<()> {
    for f in ["config.json", "model.safetensors", "model.safetensors.index.json"] {
        if dir.join(f).exists() {
            return Err(Error::file(dir, format!("already holds a model ({f}); choose a new or empty folder")));
        }
    }
    Ok(())
}

/// Whether a file name is a weight file or a weight index (what [`save_model`] writes
/// itself, in the source's layout, and never copies).
fn is_weight_file(name: &str) -> bool {
    const EXT: [&str; 9] = [".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf", ".onnx"];
    name.ends_with(".safetensors.index.json") || name.ends_with(".bin.index.json") || EXT.iter().any(|e| name.ends_with(e))
}

/// What a folder a save may go to holds.
enum SaveDir {
    /// Absent or empty.
    Fresh,
    /// Only what an interrupted save of an older dualedit left (`config.json`,
    /// `tokenizer.json`, hidden temporary files): no weights, so no model; removed when
    /// the new save is in place.
    Leftovers(Vec<PathBuf>),
}

/// Checks that an edited model may be saved to `dir`: it must be new or empty, or hold
/// only the leftovers of an interrupted save (no weights). A folder with weights
/// "already holds a model"; any other file is the user's and is never overwritten.
pub fn check_save_dir(dir: &Path) -> Result<()> {
    save_dir(dir).map(|_| ())
}

fn save_dir(dir: &Path) -> Result<SaveDir> {
    let entries = match std::fs::read_dir(dir) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(SaveDir::Fresh),
        Err(_) if dir.exists() && !dir.is_dir() => return Err(Error::file(dir, "exists and is not a folder; choose a new or empty folder")),
        Err(e) => return Err(Error::io(dir, e)),
    };
    let mut leftovers = Vec::new();
    let mut other = Vec::new();
    for e in entries {
        let e = e.map_err(|e| Error::io(dir, e))?;
        let name = e.file_name().to_string_lossy().into_owned();
        if is_weight_file(&name) {
            return Err(Error::file(dir, format!("already holds a model ({name}); choose a new or empty folder")));
        }
        let partial = name == "config.json" || name == "tokenizer.json" || (name.starts_with('.') && name.contains(".tmp."));
        if partial && e.file_type().map(|t| t.is_file()).unwrap_or(false) {
            leftovers.push(e.path());
        } else {
            other.push(name);
        }
    }
    if !other.is_empty() {
        other.sort();
        let shown: Vec<&str> = other.iter().take(3).map(String::as_str).collect();
        return Err(Error::file(dir, format!("is not empty (holds {}); choose a new or empty folder", shown.join(", "))));
    }
    Ok(if leftovers.is_empty() { SaveDir::Fresh } else { SaveDir::Leftovers(leftovers) })
}

/// Prefix of the temporary sibling folder a save of `name` is written into.
fn temp_prefix(name: &str) -> String {
    format!(".{name}.dualedit-save-")
}

/// Writes the (edited) model as a Hugging Face folder that `score` and transformers load:
/// every non-weight file of the source folder (configs, tokenizer files, preprocessor
/// and chat template, ...) copied, and the weights in the source's layout (tensor names,
/// shards and their index, dtype per tensor).
///
/// Whole or nothing: everything is written into a temporary sibling folder, flushed, and
/// renamed into place; a save that is interrupted leaves no `dir` (the next save removes
/// its temporary folder). `dir` must be new or empty ([`check_save_dir`]).
pub fn save_model(lm: &LoadedModel, dir: &Path) -> Result<()> {
    let state = save_dir(dir)?;
    let name = dir
        .file_name()
        .and_then(|n| n.to_str())
        .filter(|n| *n != "..")
        .ok_or_else(|| Error::file(dir, "cannot save a model here: name a folder"))?
        .to_string();
    let parent = dir.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
    std::fs::create_dir_all(parent).map_err(|e| Error::io(parent, e))?;
    crate::io::remove_stale_temp_dirs(parent, &temp_prefix(&name), "save");
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos()).unwrap_or(0);
    let tmp = parent.join(format!("{}{}-{nanos}", temp_prefix(&name), std::process::id()));
    std::fs::create_dir(&tmp).map_err(|e| Error::io(&tmp, e))?;
    let result = (|| -> Result<()> {
        write_model_files(lm, &tmp)?;
        crate::io::sync_dir(&tmp);
        if let SaveDir::Leftovers(files) = &state {
            for f in files {
                std::fs::remove_file(f).map_err(|e| Error::io(f, e))?;
            }
            tracing::warn!(dir = %dir.display(), files = files.len(), "removed what an interrupted save left (no weights)");
        }
        // Replaces an empty folder; refuses (ENOTEMPTY) if someone wrote into it meanwhile.
        std::fs::rename(&tmp, dir).map_err(|e| Error::file(dir, format!("cannot move the saved model into place: {e}")))?;
        crate::io::sync_dir(parent);
        Ok(())
    })();
    if result.is_err() {
        let _ = std::fs::remove_dir_all(&tmp);
    }
    result?;
    info!(dir = %dir.display(), "edited model saved");
    Ok(())
}

/// The files of a save (see [`save_model`]) written into `out`.
fn write_model_files(lm: &LoadedModel, out: &Path) -> Result<()> {
    let src = &lm.dir;
    let entries = std::fs::read_dir(src).map_err(|e| Error::io(src, e))?;
    for e in entries {
        let e = e.map_err(|e| Error::io(src, e))?;
        let name = e.file_name().to_string_lossy().into_owned();
        // Hidden files are temporary files or VCS metadata, not part of the model.
        if name.starts_with('.') || is_weight_file(&name) {
            continue;
        }
        let path = e.path();
        if path.is_file() {
            crate::io::copy_synced(&path, &out.join(&name))?;
        } else {
            tracing::debug!(path = %path.display(), "not copied: not a file");
        }
    }
    if !out.join("tokenizer.json").exists() {
        crate::io::copy_synced(lm.tokenizer.path(), &out.join("tokenizer.json"))?;
    }
    if !out.join("config.json").exists() {
        crate::io::write_json_atomic(&out.join("config.json"), &lm.config_json)?;
    }
    // The source's shards, in the source's tensor names and dtypes.
    let index_path = src.join("model.safetensors.index.json");
    let files = crate::model::loader::weight_files(src)?;
    let family = lm.model.family();
    let mut written = std::collections::HashSet::new();
    let mut total = 0u64;
    for file in &files {
        let (f, _) = crate::io::open_regular(file)?;
        // SAFETY: read-only map, used only while this iteration copies headers and the
        // bytes of tensors the model does not hold.
        let mmap = unsafe { memmap2::Mmap::map(&f) }.map_err(|e| Error::io(file, e))?;
        let bad = |e: safetensors::SafeTensorError| Error::file(file, format!("not a valid safetensors file: {e}"));
        let (_, header) = safetensors::SafeTensors::read_metadata(&mmap).map_err(bad)?;
        let st = safetensors::SafeTensors::deserialize(&mmap).map_err(bad)?;
        let mut tensors = Vec::new();
        for (tname, view) in st.tensors() {
            let canonical = family.canonical_name(&tname);
            let shape: Vec<i64> = view.shape().iter().map(|&d| d as i64).collect();
            let held = lm.params.get(&canonical).filter(|t| t.size() == shape);
            let stored = match (held, crate::io::kind_of(view.dtype())) {
                (Some(t), Some(kind)) => {
                    written.insert(canonical);
                    crate::io::Stored::Tensor(t.shallow_clone(), kind)
                }
                _ => crate::io::Stored::Raw { dtype: view.dtype(), shape: view.shape().to_vec(), bytes: view.data().to_vec() },
            };
            tensors.push((tname, stored));
        }
        let meta = header.metadata().clone().unwrap_or_default();
        let file_name = file.file_name().ok_or_else(|| Error::file(file, "weights file has no name"))?;
        total += crate::io::write_safetensors_stored(&out.join(file_name), tensors, meta)?;
    }
    let mut missing: Vec<&String> = lm.params.names().filter(|n| !written.contains(*n)).collect();
    if !missing.is_empty() {
        missing.sort();
        tracing::debug!(tensors = ?missing, "not stored: the source stores no tensor of these names (tied weights)");
    }
    if index_path.exists() {
        let text = crate::io::read_text(&index_path)?;
        let mut index: serde_json::Value =
            serde_json::from_str(&text).map_err(|e| Error::file(&index_path, format!("malformed JSON: {e}")))?;
        if let Some(obj) = index.as_object_mut() {
            let meta = obj.entry("metadata").or_insert_with(|| serde_json::json!({}));
            if let Some(m) = meta.as_object_mut() {
                m.insert("total_size".into(), serde_json::Value::from(total));
            }
        }
        crate::io::write_json_atomic(&out.join("model.safetensors.index.json"), &index)?;
    }
    Ok(())
}
