//! dualedit as a library: one editing session over one loaded model.
//!
//! A [`Session`] loads a Hugging Face model directory and, optionally, a trained MEND
//! editor once, then serves edits, scores, greedy generations, resets and saves for as
//! long as the caller keeps it. It is what `dualedit serve` puts behind HTTP, and what a
//! program embedding dualedit as its editing backend uses directly.
//!
//! ```
//! use std::path::Path;
//! use dualedit::edit::session::{Session, SessionOptions};
//!
//! let model = Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/gpt2"));
//! let session = Session::open(model, None, &SessionOptions::default())?;
//! let s = session.score("The capital of France is Paris")?;
//! assert_eq!(s.logprobs.len(), s.tokens.len() - 1);
//! let g = session.generate("The capital of France is", 3)?;
//! assert!(g.tokens.len() <= 3);
//! # Ok::<(), dualedit::Error>(())
//! ```
//!
//! Everything a caller can get wrong (a missing directory, an editor for another model,
//! an over-long prompt, editing without an editor) comes back as an [`Error`], never as a
//! panic; libtorch failures inside a forward pass are caught the same way.
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::Instant;

use serde::Serialize;
use tch::Tensor;

use crate::data::easyedit::{DatasetKind, EditRecord};
use crate::data::examples::{prepare, OverLong};
use crate::data::multimodal::{parse_mm, prepare_mm, ImageRoots, MmLoad, MmRecord, VlPrompt};
use crate::data::{EditExample, Example};
use crate::mend::ls::Fact;
use crate::device::memory::{self, MemorySample};
use crate::device::DevicePlan;
use crate::edit::conflicts::{self, Conflict};
use crate::edit::call::{CallGuard, Commits};
use crate::edit::{self, CallMethod, EditCall, EditMethod, Mend, MethodSpec, RequestResult};
use crate::placed::generate::{self, Finish};
use crate::edit::eval::{self, RecordMetrics, Summary};
use crate::mend::guard::{self, GuardConfig, GuardReport};
use crate::mend::stepwise::Stepwise;
use crate::mend::{Editor, Engine};
use crate::model::{ModelInfo, Overrides, ParamView};
use crate::edit::score::{check_length, image_prompt, score_text, score_with_images, ImagePrompt, Score};
use crate::{Error, Result};

/// Where a session runs and in which dtype (the same options every edit path loads with).
pub type SessionOptions = edit::LoadOptions;

/// A greedy continuation.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Generation {
    /// The decoded new tokens (the prompt is not repeated).
    pub text: String,
    /// The new token ids.
    pub tokens: Vec<i64>,
    /// Tokens in the prompt.
    pub prompt_tokens: usize,
    /// `"length"` (max_new_tokens reached), `"eos"` (end-of-sequence token generated; it
    /// is included in `tokens`) or `"context"` (the model's context is full).
    pub finish_reason: Finish,
}

/// The result of one [`Session::edit`] call: the one result type of an edit, which
/// `dualedit edit --json` (and its report), `serve`'s `/edit` and Python's `edit` render
/// with the same keys (each adds what only it knows: the CLI the saved folder, the server
/// the guard settings of the request, Python the call's seconds).
#[derive(Debug, Clone, Serialize)]
pub struct EditOutcome {
    /// The method this call ran: the session's, except `mend` for a single request of
    /// a session opened with `--method auto` ([`crate::edit::MethodSpec::Auto`]).
    pub method: &'static str,
    /// Whether the requests were edited one after another (else as one batch).
    pub sequential: bool,
    /// Means over `requests` (at the top level of the JSON).
    #[serde(flatten)]
    pub summary: Summary,
    /// Per request, in order: its metrics and the model's greedy answers before and after.
    pub requests: Vec<RequestResult>,
    /// Requests committed into this session's weights since it was opened or last reset.
    pub edits_total: usize,
    /// The commit guard's decision on each edit (one per request, or per step with
    /// `stepwise`, when sequential; one for a batch); empty without a guard.
    pub guard: Vec<GuardReport>,
    /// Edits of this call the guard refused (nothing of them was committed). When it
    /// equals the number of requests nothing was committed at all: `dualedit edit` turns
    /// that into an error ([`EditOutcome::refused_error`]); a server and the library
    /// answer with it here and a warning in the log.
    pub refused: usize,
    /// Requests of this call that cannot be judged as independent edits
    /// ([`conflicts`]): locality prompts naming a subject the call edits (left out of
    /// the guard's verdict) and contradictory requests.
    pub conflicts: Vec<Conflict>,
}

impl EditOutcome {
    /// When the guard refused every edit of the call (nothing committed): the error that
    /// says so, with the guard's numbers and the flags that loosen it.
    pub fn refused_error(&self) -> Option<Error> {
        let n = self.requests.len();
        if n == 0 || self.refused < n {
            return None;
        }
        let what = match n {
            1 => "the edit".to_string(),
            n => format!("all {n} edits"),
        };
        let why = self.guard.iter().rev().find(|r| r.decision == guard::Decision::Refused).map_or_else(String::new, |r| format!(": {}", r.message));
        Some(Error::input(format!(
            "the commit guard refused {what}, so nothing was committed{why}. Loosen it (`guard_min_agreement`, \
             `guard_max_drop`, `guard_max_kl`), edit fewer requests at once, or turn the guard off (`guard`=false)"
        )))
    }
}

/// Memory figures of one device the session uses.
#[derive(Debug, Clone, Serialize)]
pub struct DeviceMemory {
    /// `main` or `sub`.
    pub role: &'static str,
    /// `cpu`, `cuda:0`, ...
    pub device: String,
    #[serde(flatten)]
    pub sample: MemorySample,
}

/// Memory figures of every device of `plan` (one entry when it is a single-device plan).
///
/// CUDA devices report the caching allocator's statistics; the CPU reports the whole
/// process's resident set (`process_wide: true`).
pub fn device_memory(plan: &DevicePlan) -> Result<Vec<DeviceMemory>> {
    let roles = if plan.split { plan.roles() } else { vec![("main", plan.main)] };
    roles
        .into_iter()
        .map(|(role, d)| Ok(DeviceMemory { role, device: memory::device_name(d), sample: memory::sample(d)? }))
        .collect()
}

/// One loaded model (and editor) that edits, scores, generates, resets and saves.
///
/// Edits are committed into the weights, so every later call sees them; [`Session::reset`]
/// puts back the exact tensors the model was loaded with. Not `Sync`: one thread owns a
/// session (the HTTP service serialises requests into its model thread).
pub struct Session {
    engine: Engine,
    method: Option<Box<dyn EditMethod>>,
    editor_dir: Option<PathBuf>,
    /// The loaded tensors of every parameter an edit has changed, taken before the first
    /// change. Commits replace tensors in the stores rather than writing into them, so
    /// holding these handles costs no copy until an edit actually replaces a weight.
    originals: HashMap<String, Tensor>,
    edits_total: usize,
    eos: Vec<i64>,
    /// Measure each edit on the requests' locality prompts before committing it, and scale
    /// it back or refuse it beyond these limits ([`crate::mend::guard`]); `None` commits
    /// every edit as the editor makes it.
    pub guard: Option<GuardConfig>,
    /// Sequential edits in small committed steps ([`crate::mend::stepwise`], experimental).
    pub stepwise: Option<Stepwise>,
    /// Test builds (`fault-injection`): fail an edit call after this many of its commits,
    /// to show that a failed call leaves the weights as they were.
    fault_after_commits: Option<usize>,
    /// The method the next edit calls ask for ([`CallMethod`]; `Auto`: as opened).
    pub call_method: CallMethod,
}

impl std::fmt::Debug for Session {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Session")
            .field("model", &self.engine.lm.dir)
            .field("editor", &self.editor_dir)
            .field("plan", &self.engine.plan)
            .field("edits_total", &self.edits_total)
            .finish()
    }
}

impl Session {
    /// Loads `model` (a Hugging Face directory) on `opts.plan.main`, the replica on the
    /// sub-device when the plan is split, and the trained editor in `editor` if given.
    /// Without an editor the session scores and generates, and [`Session::edit`] refuses.
    pub fn open(model: &Path, editor: Option<&Path>, opts: &SessionOptions) -> Result<Self> {
        match editor {
            Some(dir) => Self::open_method(model, &MethodSpec::Mend { editor: dir.to_path_buf() }, opts),
            None => Ok(Self::from_parts(edit::open_engine(model, opts, &[])?, None)),
        }
    }

    /// Loads `model` for editing with `spec` (MEND with a trained editor, the fine-tuning
    /// baseline, or no edit at all, which measures the unedited model).
    pub fn open_method(model: &Path, spec: &MethodSpec, opts: &SessionOptions) -> Result<Self> {
        let (engine, method) = edit::open(model, opts, spec)?;
        let mut s = Self::with_method(engine, method);
        // `--method auto` may have opened the editor for many edits its editor names.
        s.editor_dir = spec.resolved()?.0.editor_dir().map(Path::to_path_buf);
        Ok(s)
    }

    /// A session over an engine and editor the caller built (an editor trained in the
    /// same process, for example).
    pub fn from_parts(engine: Engine, editor: Option<Editor>) -> Self {
        Self::new(engine, editor.map(|e| Box::new(Mend(e)) as Box<dyn EditMethod>))
    }

    /// A session that edits with `method`, any [`EditMethod`] (one defined outside the
    /// crate included): the session runs its calls, guard, commits and rollback.
    pub fn with_method(engine: Engine, method: Box<dyn EditMethod>) -> Self {
        Self::new(engine, Some(method))
    }

    fn new(engine: Engine, method: Option<Box<dyn EditMethod>>) -> Self {
        let eos = eos_ids(&engine.lm.config_json);
        Self {
            engine,
            method,
            editor_dir: None,
            originals: HashMap::new(),
            edits_total: 0,
            eos,
            guard: None,
            stepwise: None,
            fault_after_commits: None,
            call_method: CallMethod::Auto,
        }
    }

    /// Test builds only: make each later edit call fail right after its `n`-th commit
    /// (`None`: never), as a failure in the sequential loop or while answering would.
    #[cfg(feature = "fault-injection")]
    pub fn inject_fault_after_commits(&mut self, n: Option<usize>) {
        self.fault_after_commits = n;
    }

    /// The engine underneath (model, device plan, edited weight names).
    pub fn engine(&self) -> &Engine {
        &self.engine
    }

    pub fn info(&self) -> ModelInfo {
        self.engine.lm.model.info()
    }

    pub fn model_dir(&self) -> &Path {
        &self.engine.lm.dir
    }

    pub fn editor_dir(&self) -> Option<&Path> {
        self.editor_dir.as_deref()
    }

    /// The edit method's name (`mend`, `ft`, ...; `none` without an editor).
    pub fn method_name(&self) -> &'static str {
        self.method.as_ref().map_or("none", |m| m.name())
    }

    /// The `mend-ls` settings in use, when the method is `mend-ls`.
    pub fn ls_config(&self) -> Option<crate::mend::ls::LsConfig> {
        self.method.as_ref().and_then(|m| m.ls_config())
    }

    pub fn has_editor(&self) -> bool {
        self.method.is_some()
    }

    /// Requests committed since the session was opened or last reset.
    pub fn edits_total(&self) -> usize {
        self.edits_total
    }

    /// The model's context: the longest token sequence it accepts.
    pub fn max_positions(&self) -> usize {
        self.info().max_positions.max(0) as usize
    }

    /// Applies `requests` as one MEND batch edit and commits it into the weights, so later
    /// scores, generations and saves see it. Returns, per request, EasyEdit's metrics
    /// (measured against the weights before this call) and the greedy answer after it.
    ///
    /// ```
    /// # use std::path::Path;
    /// # use dualedit::edit::session::{Session, SessionOptions};
    /// # use dualedit::mend::{Editor, Engine};
    /// # use dualedit::config::MendConfig;
    /// # use dualedit::data::EditRecord;
    /// let model = Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/gpt2"));
    /// // Normally: Session::open(model, Some(editor_dir), &opts). An untrained editor
    /// // (a plain gradient step of size edit_lr) keeps the example self-contained.
    /// let lm = dualedit::model::load_model(model, tch::Device::Cpu, tch::Kind::Float)?;
    /// let engine = Engine::new(lm, dualedit::device::DevicePlan::single(tch::Device::Cpu), &[])?;
    /// let cfg = MendConfig { rank: 8, ..MendConfig::default() };
    /// let editor = Editor::new(&cfg, engine.edit_params.clone(), tch::Device::Cpu, 0)?;
    /// let mut session = Session::from_parts(engine, Some(editor));
    ///
    /// let request = EditRecord {
    ///     prompt: "The capital of France is".into(),
    ///     target_new: "Rome".into(),
    ///     subject: None, ground_truth: None, rephrase: None,
    ///     locality_prompt: None, locality_ground_truth: None, portability: vec![],
    /// };
    /// let out = session.edit(&[request])?;
    /// println!("reliability {:.2}", out.requests[0].metrics.reliability);
    /// assert_eq!(session.edits_total(), 1);
    /// session.reset()?;
    /// assert_eq!(session.edits_total(), 0);
    /// # Ok::<(), dualedit::Error>(())
    /// ```
    pub fn edit(&mut self, requests: &[EditRecord]) -> Result<EditOutcome> {
        if self.method.is_none() {
            return Err(Error::input("this session has no editor: open it with a trained editor directory to edit"));
        }
        let max_len = self.max_positions();
        // Records arrive from the caller, not from a file: report them as input errors.
        let examples =
            prepare(&self.engine.lm.tokenizer, requests, max_len, Path::new("requests")).map_err(|e| Error::input(e.to_string()))?;
        self.edit_examples(requests, &examples, false)
    }

    /// Applies E-VQA / E-IC records (images resolved, see [`parse_mm`]) as one MEND batch
    /// edit with images, committed like [`Session::edit`]: each record's five views
    /// (question + image → `alt`, its rephrase, the rephrase image, the NQ locality
    /// question and the image locality question) go through the model's chat template.
    /// Metrics and answers name each record by its `src` → `alt`. A text-only model, a
    /// session without an editor, an unreadable image or a record longer than the model's
    /// context is an [`Error::Input`] naming the record.
    pub fn edit_images(&mut self, records: &[MmRecord]) -> Result<EditOutcome> {
        if self.method.is_none() {
            return Err(Error::input("this session has no editor: open it with a trained editor directory to edit"));
        }
        if records.is_empty() {
            return Err(Error::input("no edit requests"));
        }
        // Strict: a request that does not fit is refused, never silently dropped.
        let (text, examples) = self.image_examples(records, usize::MAX)?;
        self.edit_examples(&text, &examples, false)
    }

    /// The five views of E-VQA / E-IC records as this session's model prepares them (its
    /// chat template and image processor), prompt + target at most `max_length` tokens
    /// (capped by the context; longer is an [`Error::Input`]), with the records as text
    /// (`src` → `alt`).
    pub fn image_examples(&self, records: &[MmRecord], max_length: usize) -> Result<(Vec<EditRecord>, Vec<EditExample>)> {
        let engine = &self.engine;
        let (Some(vl), Some(proc)) = (engine.lm.model.family().vision_language(), engine.image_proc.as_ref()) else {
            return Err(Error::input(format!(
                "{} is a text-only model ({}); image edit requests need a Qwen2-VL or Qwen2.5-VL model",
                engine.lm.dir.display(),
                engine.lm.model.info().architecture
            )));
        };
        let load = MmLoad { records: records.to_vec(), file_index: (0..records.len()).collect(), in_file: records.len(), ..MmLoad::default() };
        let context = self.max_positions();
        let template = vl.chat_template(&engine.lm.dir)?;
        let vp = VlPrompt { vl, proc, template: &template };
        let prepared = prepare_mm(&engine.lm.tokenizer, vp, &load, max_length.min(context), context, OverLong::Strict, Path::new("requests"))
            .map_err(|e| Error::input(e.to_string()))?;
        Ok((records.iter().map(MmRecord::as_edit_record).collect(), prepared.examples))
    }

    /// [`Session::edit_images`] on the text of a JSON array of E-VQA records, whose image
    /// names are relative to `roots` (joined as the dataset reader joins them: a caller
    /// that takes names from someone untrusted confines them first with
    /// [`crate::data::multimodal::confine_images`]). A record with an empty `src` or
    /// `alt`, or a missing or unreadable image, is an error naming it.
    pub fn edit_image_requests(&mut self, requests: &str, roots: &ImageRoots) -> Result<EditOutcome> {
        let records = read_image_requests(requests, roots)?;
        self.edit_images(&records)
    }

    /// Applies tokenised requests (`records[i]` tokenised as `examples[i]`) as one batch
    /// edit, or with `sequential` one after another, each committed before the next is
    /// made; then measures every request against the weights before this call and reads
    /// each one's greedy answer.
    ///
    /// All or nothing: when anything fails after a commit (a later request of a
    /// sequential call, the measurement, an answer), every weight this call changed is put
    /// back as it was before the call (the exact tensors, on both devices), and
    /// [`Session::edits_total`], what [`Session::reset`] restores and the edits `mend-ls`
    /// remembers are as before; the error is returned.
    pub fn edit_examples(&mut self, records: &[EditRecord], examples: &[EditExample], sequential: bool) -> Result<EditOutcome> {
        // The tensors of every weight this call replaces, taken before its first change.
        let mut before_call: HashMap<String, Tensor> = HashMap::new();
        let had_original: std::collections::HashSet<String> = self.originals.keys().cloned().collect();
        let total = self.edits_total;
        let remembered = self.method.as_ref().map(|m| m.snapshot());
        let result = self.apply_examples(records, examples, sequential, &mut before_call);
        let Err(e) = result else { return result };
        if let (Some(m), Some(r)) = (self.method.as_mut(), remembered) {
            m.restore(r);
        }
        if before_call.is_empty() {
            return Err(e);
        }
        let restore: Overrides = before_call.iter().map(|(n, t)| (n.clone(), t.shallow_clone())).collect();
        if let Err(re) = self.engine.commit(&restore) {
            tracing::error!("an edit failed ({e}) and putting the weights back failed too ({re}): reset the session");
            return Err(Error::Torch(format!("{e}; putting back the weights this edit changed also failed ({re}): call reset")));
        }
        self.originals.retain(|name, _| had_original.contains(name));
        self.edits_total = total;
        tracing::warn!(params = before_call.len(), "edit failed after committing: the weights are back as they were before it");
        Err(e)
    }

    /// What an edit call needs before it touches anything: an editor, requests, a method
    /// that composes with the session's settings, and guard settings in range.
    fn check_edit_call(&self, records: &[EditRecord], examples: &[EditExample]) -> Result<()> {
        let Some(method) = self.method.as_ref() else {
            return Err(Error::input("this session has no editor: open it with a trained editor directory to edit"));
        };
        if examples.is_empty() {
            return Err(Error::input("no edit requests"));
        }
        if records.len() != examples.len() {
            // Results, facts and examples are paired one for one.
            return Err(Error::Internal(format!("{} records for {} edit examples", records.len(), examples.len())));
        }
        method.check(&EditCall { call: self.call_method, sequential: false, facts: &[], stepwise: self.stepwise.as_ref() })?;
        if let Some(cfg) = &self.guard {
            cfg.validate()?;
        }
        Ok(())
    }

    /// Each request with its greedy answer at the current weights and its metrics.
    /// Each request's result; `refusals[i]`: the guard's reason when it refused request
    /// `i`'s edit.
    /// `answers_before[i]`: request `i`'s greedy answer before this call committed anything.
    fn request_results(
        &self,
        records: &[EditRecord],
        examples: &[EditExample],
        answers_before: Vec<String>,
        metrics: Vec<RecordMetrics>,
        refusals: Vec<Option<String>>,
    ) -> Result<Vec<RequestResult>> {
        records
            .iter()
            .zip(examples)
            .zip(answers_before)
            .zip(metrics)
            .zip(refusals)
            .map(|((((r, e), before), m), why)| {
                Ok(RequestResult {
                    prompt: r.prompt.clone(),
                    target_new: r.target_new.clone(),
                    answer_before: before,
                    answer_after: generate::answer(&self.engine, &e.inner)?,
                    refused: why.is_some(),
                    refused_reason: why,
                    metrics: m,
                })
            })
            .collect()
    }

    /// [`Session::edit_examples`] without the restore on failure; every commit keeps the
    /// tensors it replaces (first time in this call) in `before_call`.
    fn apply_examples(
        &mut self,
        records: &[EditRecord],
        examples: &[EditExample],
        sequential: bool,
        before_call: &mut HashMap<String, Tensor>,
    ) -> Result<EditOutcome> {
        self.check_edit_call(records, examples)?;
        // The method is out of the session while the call runs (the engine's weights
        // change under it) and back whatever the call's end.
        let mut method = self.method.take().ok_or_else(|| Error::Internal("check_edit_call let a session without an editor edit".into()))?;
        let result = self.apply_with(method.as_mut(), records, examples, sequential, before_call);
        self.method = Some(method);
        result
    }

    /// The edit call itself: conflicts, the guard's probes, the proposals (one batch, or
    /// one after another), their commits, the measurement after and the outcome.
    fn apply_with(
        &mut self,
        method: &mut dyn EditMethod,
        records: &[EditRecord],
        examples: &[EditExample],
        sequential: bool,
        before_call: &mut HashMap<String, Tensor>,
    ) -> Result<EditOutcome> {
        let refs: Vec<&EditExample> = examples.iter().collect();
        let answers_before = examples.iter().map(|e| generate::answer(&self.engine, &e.inner)).collect::<Result<Vec<_>>>()?;
        // Each request's fact, for mend-ls's statistics (multimodal records name none).
        let facts: Vec<Option<Fact>> = records.iter().map(Fact::of).collect();
        let images: Vec<Option<&Path>> = examples.iter().map(|e| e.inner.image.as_ref().map(|i| i.path.as_path())).collect();
        let conflicts = conflicts::find(records, &images);
        if let Some(line) = conflicts::describe(&conflicts, records) {
            tracing::warn!("{line}");
        }
        // The guard's probes: the requests' locality prompts (text, and image + question
        // for multimodal requests), against the weights now; not a text prompt that names
        // a subject this call edits (its answer is meant to move).
        let excluded = conflicts::probe_excluded(&conflicts, examples.len());
        let loc: Vec<&Example> = examples
            .iter()
            .zip(&excluded)
            .flat_map(|(e, &x)| e.loc.iter().filter(move |_| !x).chain(&e.loc_image))
            .collect();
        let mut guard = CallGuard::new(&self.engine, self.guard.as_ref(), &loc, excluded.contains(&true))?;
        // Image features borrow the engine, which each commit changes: computed before
        // and after the commits (the tower is frozen, so they are the same features).
        let before = {
            let images = self.engine.images(&eval::all_views(&refs))?;
            eval::measure_before(&self.engine, &refs, images.as_ref())?
        };
        let start = Instant::now();
        let method_name = method.name_for(self.call_method, examples.len(), sequential);
        let mut commits = Commits::new(before_call, &mut self.originals, self.fault_after_commits);
        // What is left to commit after the measurement (a batch's kept proposal; a
        // sequential run's edits are committed already), and per request the guard's
        // reason when it refused its edit.
        let (overrides, refusals) = if sequential {
            let refusals = edit_one_by_one(&mut self.engine, method, examples, &facts, self.call_method, self.stepwise.as_ref(), &mut guard, &mut commits)?;
            (Overrides::new(), refusals)
        } else {
            let inner: Vec<&Example> = examples.iter().map(|e| &e.inner).collect();
            let batch = self.engine.collate(&inner)?;
            let facts: Vec<Fact> = facts.into_iter().flatten().collect();
            let call = EditCall { call: self.call_method, sequential: false, facts: &facts, stepwise: None };
            let proposal = edit::method::propose(&self.engine, method, &batch, &call)?;
            let kept = guard.check(&self.engine, proposal, &batch)?;
            method.committed(guard.committed_scale(kept.is_some()));
            let refusals = match (&kept, guard.on()) {
                (None, true) => {
                    tracing::warn!("the commit guard refused the batch of {} edits: nothing was committed ({})", examples.len(), guard.last_reason());
                    vec![Some(format!("the batch of {} edits: {}", examples.len(), guard.last_reason())); examples.len()]
                }
                _ => vec![None; examples.len()],
            };
            (kept.unwrap_or_default(), refusals)
        };
        let per_request = start.elapsed().as_secs_f64() / examples.len() as f64;
        let metrics = {
            let images = self.engine.images(&eval::all_views(&refs))?;
            eval::measure_after(&self.engine, &overrides, &refs, &before, per_request, images.as_ref())?
        };
        if !sequential {
            commits.commit(&mut self.engine, &overrides)?;
        }
        let refused = refusals.iter().filter(|r| r.is_some()).count();
        self.edits_total += examples.len() - refused;
        let out = self.request_results(records, examples, answers_before, metrics, refusals)?;
        let summary = Summary::of(&out.iter().map(|r| r.metrics.clone()).collect::<Vec<_>>());
        Ok(EditOutcome { method: method_name, sequential, summary, requests: out, edits_total: self.edits_total, guard: guard.reports, refused, conflicts })
    }

    /// Next-token log-probabilities of `text` under the current (edited) weights.
    pub fn score(&self, text: &str) -> Result<Score> {
        score_text(&self.engine.lm, &ParamView::frozen(&self.engine.lm.params), text)
    }

    /// [`Session::score`] with an optional image shown before the text (Qwen2-VL /
    /// Qwen2.5-VL models): every text token's log-probability given the image and the
    /// text before it, and the tokens the image took ([`Score::image_tokens`]).
    pub fn score_image(&self, text: &str, image: Option<&Path>) -> Result<Score> {
        let images: Vec<&Path> = image.into_iter().collect();
        score_with_images(&self.engine.lm, &ParamView::frozen(&self.engine.lm.params), text, &images)
    }

    /// [`Session::score_image`] with the image given as the bytes of a PNG or JPEG file
    /// (an upload, say): checked to be one, written to a private temporary file for the
    /// image preprocessor, scored, and the file removed.
    pub fn score_image_bytes(&self, text: &str, image: &[u8]) -> Result<Score> {
        let tmp = TempImage::from_bytes(image)?;
        self.score_image(text, Some(tmp.path()))
    }

    /// Greedy continuation of `prompt` under the current weights, with a KV cache: the
    /// prompt is run once, then one token per step. Stops after `max_new_tokens`, at the
    /// model's end-of-sequence token, or when the context is full.
    pub fn generate(&self, prompt: &str, max_new_tokens: usize) -> Result<Generation> {
        let lm = &self.engine.lm;
        let ids = lm.tokenizer.encode(prompt)?;
        if ids.is_empty() {
            return Err(Error::input("prompt is empty (it encodes to no tokens)"));
        }
        check_length(lm, ids.len())?;
        let (tokens, finish_reason) = generate::greedy(lm, &ParamView::frozen(&lm.params), &ids, max_new_tokens, &self.eos)?;
        Ok(Generation { text: lm.tokenizer.decode(&tokens)?, prompt_tokens: ids.len(), tokens, finish_reason })
    }

    /// [`Session::generate`] with an optional image shown before the prompt (Qwen2-VL /
    /// Qwen2.5-VL models), laid out as [`Session::score_image`] lays it out: the image's
    /// run, then the prompt's tokens, verbatim (no chat template). The image's features
    /// are computed once; each new token runs one full forward. `prompt_tokens` counts the
    /// prompt's text tokens only.
    pub fn generate_image(&self, prompt: &str, image: Option<&Path>, max_new_tokens: usize) -> Result<Generation> {
        let Some(image) = image else { return self.generate(prompt, max_new_tokens) };
        let lm = &self.engine.lm;
        let text = lm.tokenizer.encode(prompt)?;
        if text.is_empty() {
            return Err(Error::input("prompt is empty (it encodes to no tokens)"));
        }
        let params = ParamView::frozen(&lm.params);
        let ImagePrompt { vl, mut ids, feats, grids } = image_prompt(lm, &params, &[image], text.len())?;
        ids.extend_from_slice(&text);
        let (tokens, finish_reason) = generate::greedy_with_images(lm, &params, (vl, &feats, &grids), &ids, max_new_tokens, &self.eos)?;
        Ok(Generation { text: lm.tokenizer.decode(&tokens)?, prompt_tokens: text.len(), tokens, finish_reason })
    }

    /// [`Session::generate_image`] with the image as the bytes of a PNG or JPEG file.
    pub fn generate_image_bytes(&self, prompt: &str, image: &[u8], max_new_tokens: usize) -> Result<Generation> {
        let tmp = TempImage::from_bytes(image)?;
        self.generate_image(prompt, Some(tmp.path()), max_new_tokens)
    }

    /// Puts back the exact weights the model was loaded with (on both devices), undoing
    /// every edit. Returns how many parameters were restored.
    pub fn reset(&mut self) -> Result<usize> {
        let n = self.originals.len();
        let originals: Overrides = self.originals.iter().map(|(n, t)| (n.clone(), t.shallow_clone())).collect();
        self.engine.commit(&originals)?;
        self.originals.clear();
        self.edits_total = 0;
        if let Some(m) = self.method.as_mut() {
            m.reset();
        }
        Ok(n)
    }

    /// Writes the current (edited) model to `dir` as a Hugging Face folder that
    /// `Session::open`, `dualedit score` and transformers load: every non-weight file of the
    /// source folder copied, the weights in the source's layout (names, shards, dtypes),
    /// all or nothing ([`crate::placed::save::save_model`]). `dir` must be new or empty.
    pub fn save(&self, dir: &Path) -> Result<()> {
        crate::placed::save::save_model(&self.engine.lm, dir)
    }

    /// Memory figures of each device the session uses.
    pub fn memory(&self) -> Result<Vec<DeviceMemory>> {
        device_memory(&self.engine.plan)
    }
}

/// Edits `examples` one after another, each proposed at the weights the ones before it
/// left and committed (or refused) before the next; with `stepwise`, each in steps until
/// it answers. Returns, per request, the guard's reason when it refused every step.
#[allow(clippy::too_many_arguments)]
fn edit_one_by_one(
    engine: &mut Engine,
    method: &mut dyn EditMethod,
    examples: &[EditExample],
    facts: &[Option<Fact>],
    call: CallMethod,
    stepwise: Option<&Stepwise>,
    guard: &mut CallGuard,
    commits: &mut Commits,
) -> Result<Vec<Option<String>>> {
    let mut refusals = Vec::with_capacity(examples.len());
    for (e, fact) in examples.iter().zip(facts) {
        let inner = engine.collate(&[&e.inner])?;
        let fact: Vec<Fact> = fact.iter().cloned().collect();
        let call = EditCall { call, sequential: true, facts: &fact, stepwise };
        let mut request_committed = false;
        for _ in 0..stepwise.map_or(1, |s| s.steps) {
            let proposal = edit::method::propose(engine, method, &inner, &call)?;
            let kept = guard.check(engine, proposal, &inner)?;
            method.committed(guard.committed_scale(kept.is_some()));
            if let Some(ov) = kept {
                commits.commit(engine, &ov)?;
                request_committed = true;
            }
            if stepwise.is_none() || guard::makes_edit(engine, &Overrides::new(), &inner)? {
                break;
            }
        }
        refusals.push((!request_committed).then(|| guard.last_reason()));
    }
    let refused = refusals.iter().filter(|r| r.is_some()).count();
    if refused > 0 {
        tracing::warn!(
            "the commit guard refused {refused} of {} edits one after another{} (the report's guard entries have each decision)",
            examples.len(),
            if refused < examples.len() { "" } else { ": nothing was committed" }
        );
    }
    Ok(refusals)
}

/// End-of-sequence ids from `config.json` (`eos_token_id`: a number or a list).
fn eos_ids(config: &serde_json::Value) -> Vec<i64> {
    match config.get("eos_token_id") {
        Some(serde_json::Value::Number(n)) => n.as_i64().into_iter().collect(),
        Some(serde_json::Value::Array(a)) => a.iter().filter_map(|v| v.as_i64()).collect(),
        _ => Vec::new(),
    }
}

/// Parses the text of a JSON array of E-VQA edit requests with images under `roots`. Unlike
/// the dataset reader, which skips bad records, every record must be usable: an empty
/// `src` or `alt` or a missing or unreadable image is an [`Error::Input`] naming it.
pub fn read_image_requests(requests: &str, roots: &ImageRoots) -> Result<Vec<MmRecord>> {
    let load = parse_mm(requests, Path::new("requests"), DatasetKind::Vqa, roots, true).map_err(|e| Error::input(e.to_string()))?;
    if let Some((i, why)) = load.skipped_empty.first() {
        return Err(Error::input(format!("requests: record {i}: {why}")));
    }
    Ok(load.records)
}

/// The file extension of a PNG or JPEG image given as bytes, checked readable (its
/// header decodes to a size); anything else is an [`Error::Input`].
pub fn image_kind(bytes: &[u8]) -> Result<&'static str> {
    let format = image::guess_format(bytes).map_err(|_| Error::input("the image is not a PNG or JPEG (unrecognised signature)"))?;
    let ext = match format {
        image::ImageFormat::Png => "png",
        image::ImageFormat::Jpeg => "jpg",
        other => return Err(Error::input(format!("{other:?} images are not supported (PNG or JPEG)"))),
    };
    let (w, h) = image::io::Reader::with_format(std::io::Cursor::new(bytes), format)
        .into_dimensions()
        .map_err(|e| Error::input(format!("the {ext} image cannot be read (truncated or corrupt?): {e}")))?;
    if w == 0 || h == 0 {
        return Err(Error::input("the image has no pixels"));
    }
    Ok(ext)
}

/// An image written to a fresh file in the temporary directory (created exclusively, so
/// never through a link someone planted there), removed when dropped.
pub(crate) struct TempImage(PathBuf);

impl TempImage {
    /// The bytes of a PNG or JPEG file ([`image_kind`] checks them) in a fresh file.
    pub(crate) fn from_bytes(bytes: &[u8]) -> Result<Self> {
        let ext = image_kind(bytes)?;
        Self::write(bytes, ext)
    }

    pub(crate) fn path(&self) -> &Path {
        &self.0
    }

    fn write(bytes: &[u8], ext: &str) -> Result<Self> {
        use std::io::Write;
        use std::sync::atomic::{AtomicU64, Ordering};
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let path = std::env::temp_dir().join(format!("dualedit-image-{}-{n}.{ext}", std::process::id()));
        let mut opts = std::fs::OpenOptions::new();
        opts.write(true).create_new(true);
        #[cfg(unix)]
        std::os::unix::fs::OpenOptionsExt::mode(&mut opts, 0o600);
        let mut f = opts.open(&path).map_err(|e| Error::io(&path, e))?;
        let tmp = Self(path);
        f.write_all(bytes).map_err(|e| Error::io(&tmp.0, e))?;
        Ok(tmp)
    }
}

impl Drop for TempImage {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

