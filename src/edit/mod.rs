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
pub mod options;
pub mod score;
pub mod session;

use std::path::{Path, PathBuf};
use std::time::Instant;

use serde::Serialize;
use tch::Kind;
use tracing::info;

use crate::data::{EditExample, Example, TokenBatch};
use crate::device::DevicePlan;
use eval::RecordMetrics;
use crate::mend::ls::{Fact, KeyMemory, LsChoice, LsEditor};
use crate::mend::{checkpoint, Engine};
use crate::model::{load_model_split, Overrides};
use crate::{Error, Result};
pub use method::{CallMethod, EditCall, EditMethod, FineTune, Mend, Unedited};
pub use options::{MethodName, MethodOptions, DEFAULT_FT_LR};

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
    /// The ranges its settings must lie in (`ls_*`, `ft_lr`): one error naming the field.
    pub fn check(&self) -> Result<()> {
        match self {
            MethodSpec::MendLs { ls, .. } | MethodSpec::Auto { ls, .. } => ls.check(),
            MethodSpec::FineTune { lr } if !(lr.is_finite() && *lr > 0.0) => {
                Err(Error::input(format!("ft_lr must be a positive number, got {lr}")))
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
                        Ok(_) => return Err(Error::file(path, "`ls_keep_text` must name a regular file of text lines (not a directory, FIFO or device)")),
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
        Err(Error::file(dir, "editor directory not found (`editor`)"))
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
             summed MEND edits interfere (compute statistics with `dualedit stats`, or give `method`=mend-ls with `ls_keep_text`=FILE)"
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
                    if !stats.exists() {
                        // The real default's editor.json names statistics its preparation builds.
                        return Err(Error::file(
                            &stats,
                            "the key statistics this editor's editor.json names are not built: compute them once with \
                             `dualedit stats --model M --editor E --text FILE` (the real default's: `./x demo --real`)",
                        ));
                    }
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
        MethodSpec::Auto { .. } => return Err(Error::Internal("method auto was not resolved".into())),
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

