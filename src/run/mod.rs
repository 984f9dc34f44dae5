//! The train / edit / eval runs behind the CLI: load, place, run, report. Kept in the
//! library so `compare`, tests and embedding programs run exactly what the CLI runs.
pub mod chart;
pub mod compare;
pub mod options;
pub mod report;
pub mod report_merge;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Instant;

use serde::Serialize;
use tch::Kind;
use tracing::info;

use crate::edit::capacity::{self, CapacityReport, Grouping};
use crate::config::MendConfig;
use crate::data::easyedit::{load_records, DatasetKind, EditRecord};
use crate::data::multimodal::{load_mm, prepare_mm, ImageRoots, VlPrompt};
use crate::data::examples::{prepare_with, DataCounts, OverLong, SkippedRecord, SHOWN_SKIPPED};
use crate::data::EditExample;
use crate::device::memory::MemoryTracker;
use crate::device::DevicePlan;
use crate::edit::{self, LoadOptions, MethodSpec, RequestResult};
use crate::edit::eval::{RecordMetrics, Summary};
use crate::mend::{checkpoint, Editor, Engine};
use crate::run::report::{DeviceInfo, RunReport};
use crate::edit::session::{EditOutcome, Session};
use crate::mend::train::{self, TrainReport, TrainSetup};
use crate::{Error, Result};

/// What every run needs: the model, where it runs, in which dtype, with which seed.
#[derive(Debug, Clone)]
pub struct Common {
    pub model: PathBuf,
    pub plan: DevicePlan,
    pub dtype: Kind,
    pub seed: i64,
    /// Where the run report goes (default `runs/<command>-<time>.json`).
    pub report: Option<PathBuf>,
    /// What to do with data records longer than the maximum length (default: skip them);
    /// `Strict` also makes a missing or unreadable image of a multimodal record an error.
    pub over_long: OverLong,
    /// Where the images of multimodal data (`--ds vqa|caption`) are.
    pub image_roots: Option<ImageRoots>,
}

impl Common {
    /// `model` on `device` alone in f32, seed 0, no report path, records over the maximum
    /// length skipped, no images: what the programs that build defaults and the tests run
    /// with (set the rest with `Common { seed: 5, ..Common::single(dir, device) }`).
    pub fn single(model: impl Into<PathBuf>, device: tch::Device) -> Self {
        Self {
            model: model.into(),
            plan: DevicePlan::single(device),
            dtype: Kind::Float,
            seed: 0,
            report: None,
            over_long: OverLong::default(),
            image_roots: None,
        }
    }

    pub fn load_options(&self) -> LoadOptions {
        LoadOptions { plan: self.plan, dtype: self.dtype }
    }
}

fn report<M: Serialize>(
    command: &str,
    c: &Common,
    engine: &Engine,
    data: DataCounts,
    metrics: M,
    seconds: BTreeMap<String, f64>,
    tracker: &MemoryTracker,
) -> RunReport<M> {
    RunReport {
        format: report::REPORT_FORMAT,
        command: command.into(),
        model: c.model.display().to_string(),
        devices: DeviceInfo::from(&c.plan),
        dtype: crate::model::loader::dtype_name(c.dtype).into(),
        seed: c.seed,
        data: Some(data),
        metrics,
        seconds,
        memory: tracker.summary(),
        moved: engine.mover.stats(),
        timeline_file: None,
    }
}

/// Checks a run's report path before any work: it must not be one of the run's input
/// files (writing the report would replace it), nor replace anything dualedit did not
/// write as a report, timeline or chart ([`report::check_replaceable`]; checked again when
/// the report is written), and its folder must be creatable, so a long run does not fail
/// at its very end.
pub fn check_report_path(report: Option<&Path>, inputs: &[&Path]) -> Result<()> {
    let Some(report) = report else { return Ok(()) };
    report::check_replaceable(report)?;
    let same = |a: &Path, b: &Path| match (a.canonicalize(), b.canonicalize()) {
        (Ok(a), Ok(b)) => a == b,
        _ => a == b,
    };
    if let Some(input) = inputs.iter().find(|i| same(report, i)) {
        return Err(Error::file(report, format!("`report` would overwrite an input of this run ({}); choose another path", input.display())));
    }
    if let Some(dir) = report.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).map_err(|e| Error::file(dir, format!("cannot create the folder for `report`: {e}")))?;
    }
    Ok(())
}

/// Refuses the data flags a run would not use: image roots for text data, and
/// `--truncate` for image data (an image prompt cannot be cut; over-long records are
/// skipped, or with `--strict` an error).
pub fn check_data_flags(ds: DatasetKind, common: &Common) -> Result<()> {
    if ds.is_multimodal() {
        if common.over_long == OverLong::Truncate {
            return Err(Error::input(format!("`truncate` cannot cut the image prompts of `ds` {ds}: over-long records are skipped (or, with `strict`, an error)")));
        }
    } else if common.image_roots.is_some() {
        return Err(Error::input(format!("`image_root` / `rephrase_image_root` are for `ds` vqa|caption; {ds} data has no images")));
    }
    Ok(())
}

/// Reads a dataset and tokenises it, keeping the first `limit` records, with records
/// longer than `max_len` (or the model's context) handled by `over_long`. Returns the
/// records that were kept, their examples (aligned), and what was left out.
pub fn load_examples(
    engine: &Engine,
    path: &Path,
    ds: DatasetKind,
    limit: Option<usize>,
    max_len: usize,
    over_long: OverLong,
    image_roots: Option<&ImageRoots>,
) -> Result<(Vec<EditRecord>, Vec<EditExample>, DataCounts)> {
    if ds.is_multimodal() {
        return load_mm_examples(engine, path, ds, limit, max_len, over_long, image_roots);
    }
    let (mut records, load) = load_records(path, ds)?;
    let in_file = records.len() + load.skipped.len();
    // Positions in the file of the records the reader kept (it drops empty targets).
    let mut empty = load.skipped.iter().map(|(i, _)| *i).peekable();
    let mut file_index = Vec::with_capacity(records.len());
    for i in 0..in_file {
        if empty.next_if_eq(&i).is_none() {
            file_index.push(i);
        }
    }
    if let Some(l) = limit {
        records.truncate(l);
        file_index.truncate(l);
    }
    let max_len = max_len.min(engine.lm.model.info().max_positions as usize);
    let prepared = prepare_with(&engine.lm.tokenizer, &records, &file_index, max_len, over_long, path)?;
    let mut first_skipped: Vec<(usize, String)> = load.skipped.iter().chain(&prepared.skipped).cloned().collect();
    first_skipped.sort_by_key(|(i, _)| *i);
    first_skipped.truncate(SHOWN_SKIPPED);
    let counts = DataCounts {
        file: path.to_path_buf(),
        records: in_file,
        used: prepared.examples.len(),
        skipped_empty: load.skipped.len(),
        skipped_too_long: prepared.skipped.len(),
        skipped_image: 0,
        truncated: prepared.truncated.len(),
        no_rephrase: 0,
        val_duplicates_dropped: 0,
        max_length: max_len,
        over_long,
        first_skipped: first_skipped.into_iter().map(|(record, reason)| SkippedRecord { record, reason }).collect(),
    };
    let mut kept = prepared.kept.iter().peekable();
    let mut pos = 0;
    records.retain(|_| {
        let keep = kept.next_if_eq(&&pos).is_some();
        pos += 1;
        keep
    });
    Ok((records, prepared.examples, counts))
}

/// [`load_examples`] for E-VQA / E-IC: the five views of each record, with images. The
/// records returned are the edit requests as text (`src` → `alt`, rephrase, NQ locality).
fn load_mm_examples(
    engine: &Engine,
    path: &Path,
    ds: DatasetKind,
    limit: Option<usize>,
    max_len: usize,
    over_long: OverLong,
    image_roots: Option<&ImageRoots>,
) -> Result<(Vec<EditRecord>, Vec<EditExample>, DataCounts)> {
    let roots = image_roots.ok_or_else(|| Error::file(path, format!("`ds` {ds} names images relative to a root: pass `image_root` (and `rephrase_image_root` if the rephrase images are elsewhere)")))?;
    let (Some(vl), Some(proc)) = (engine.lm.model.family().vision_language(), engine.image_proc.as_ref()) else {
        return Err(Error::file(path, format!("`ds` {ds} needs a vision-language model (Qwen2-VL), not {}", engine.lm.model.info().architecture)));
    };
    let mut load = load_mm(path, ds, roots, over_long == OverLong::Strict)?;
    if let Some(l) = limit {
        load.records.truncate(l);
        load.file_index.truncate(l);
    }
    let context = engine.lm.model.info().max_positions as usize;
    let template = vl.chat_template(&engine.lm.dir)?;
    let prepared = prepare_mm(&engine.lm.tokenizer, VlPrompt { vl, proc, template: &template }, &load, max_len, context, over_long, path)?;
    let mut first_skipped: Vec<(usize, String)> = load.skipped_empty.iter().chain(&load.skipped_image).chain(&prepared.skipped).cloned().collect();
    first_skipped.sort_by_key(|(i, _)| *i);
    first_skipped.truncate(SHOWN_SKIPPED);
    let counts = DataCounts {
        file: path.to_path_buf(),
        records: load.in_file,
        used: prepared.examples.len(),
        skipped_empty: load.skipped_empty.len(),
        skipped_too_long: prepared.skipped.len(),
        skipped_image: load.skipped_image.len(),
        truncated: 0,
        no_rephrase: prepared.kept.iter().filter(|&&k| load.records[k].rephrase.is_none()).count(),
        val_duplicates_dropped: 0,
        max_length: max_len,
        over_long,
        first_skipped: first_skipped.into_iter().map(|(record, reason)| SkippedRecord { record, reason }).collect(),
    };
    let records = prepared
        .kept
        .iter()
        .map(|&k| load.records[k].as_edit_record())
        .collect();
    Ok((records, prepared.examples, counts))
}

#[derive(Debug, Clone)]
pub struct TrainOptions {
    pub common: Common,
    pub data: PathBuf,
    pub ds: DatasetKind,
    pub config: MendConfig,
    pub out: PathBuf,
    pub limit: Option<usize>,
    pub resume: bool,
    /// A trained editor to start from ([`checkpoint::init_editor`]) instead of a fresh one.
    pub init: Option<PathBuf>,
    pub progress: bool,
}

/// Meta-trains an editor; the report goes to `<out>/report.json` unless told otherwise.
pub fn run_train(o: &TrainOptions) -> Result<(TrainReport, PathBuf)> {
    check_report_path(o.common.report.as_deref(), &[&o.data])?;
    check_data_flags(o.ds, &o.common)?;
    if o.init.is_some() && o.resume {
        return Err(Error::input("`init` starts a new training from a trained editor and `resume` continues one in `out`: give one of them"));
    }
    // Never replace a trained editor: only --resume continues (and then rewrites) it.
    if o.out.join(checkpoint::EDITOR_FILE).exists() && !(o.resume && o.out.join(checkpoint::STATE_FILE).exists()) {
        return Err(Error::file(
            &o.out,
            if o.resume {
                "holds an editor but no training state to resume it from; choose another `out` to train a new one"
            } else {
                "already holds an editor; pass `resume` to continue its training, or choose another `out`"
            },
        ));
    }
    let t0 = Instant::now();
    let mut tracker = MemoryTracker::sampled(&o.common.plan.roles());
    let mut engine = edit::open_engine(&o.common.model, &o.common.load_options(), &o.config.edit_params)?;
    // Out of memory, the diagnosis names the placement the planner says fits the caps.
    match crate::planner::FitAdvice::for_run(&o.common.model, &o.config, &engine.plan, o.common.dtype, o.config.max_length as i64, &crate::device::memory::applied_caps()) {
        Ok(a) => engine.fit_advisor = Some(std::sync::Arc::new(a)),
        Err(e) => tracing::warn!(error = %e, "no placement advice for out-of-memory diagnoses"),
    }
    tracker.mark("load")?;
    let load_s = t0.elapsed().as_secs_f64();
    let (_, examples, mut data) = load_examples(&engine, &o.data, o.ds, o.limit, o.config.max_length, o.common.over_long, o.common.image_roots.as_ref())?;
    let holdout = o.config.val_records.min(examples.len() / 5);
    let (mut train_set, val_set) = split_holdout_examples(examples, holdout);
    if o.config.loc_neighbours > 0 {
        let given = crate::data::add_answer_neighbours(&mut train_set, o.config.loc_neighbours);
        info!("each training edit's locality loss also covers up to {} other training records' locality prompts with its answer ({given} in all)", o.config.loc_neighbours);
    }
    let (val_set, dropped) = drop_overlap(&train_set, val_set);
    if dropped > 0 {
        tracing::warn!(file = %o.data.display(), dropped, left = val_set.len(), "validation examples that repeat a training example (duplicated records) were dropped, so validation does not measure what was trained on");
    }
    data.val_duplicates_dropped = dropped;
    if train_set.is_empty() {
        return Err(Error::file(&o.data, "no records left for training after holding out the validation split"));
    }
    // Which records validate is a choice the user should see, not find in the code (the
    // CLI shows this module's info lines by default).
    info!(
        "meta-training on {} records; validating on the last {} of {} (min(val_records = {}, records / 5){})",
        train_set.len(),
        val_set.len(),
        data.used,
        o.config.val_records,
        if dropped > 0 { format!(", {dropped} repeating a training record dropped") } else { String::new() }
    );
    if val_set.is_empty() {
        tracing::warn!("no validation split (val_records is 0 or there are fewer than 5 records): the editor is selected by its training-batch loss");
    }
    let mut editor = match &o.init {
        Some(dir) => {
            info!(editor = %dir.display(), "starting from a trained editor (`init`), with a fresh optimiser");
            checkpoint::init_editor(dir, &engine, &o.config)?
        }
        None => {
            let mut e = crate::error::guard(|| Editor::new(&o.config, engine.edit_params.clone(), o.common.plan.main, o.common.seed))
                .map_err(|e| crate::device::oom::diagnose(e, 0, "editor setup", &engine.placement(), &o.config, &mut tracker, checkpoint::saved_state(&o.out)))?;
            e.product_kind = Editor::products_for(engine.lm.params.kind(), e.device());
            e
        }
    };
    tracker.mark("editor")?;
    std::fs::create_dir_all(&o.out).map_err(|e| Error::io(&o.out, e))?;
    let setup = TrainSetup {
        config: &o.config,
        train: &train_set,
        val: &val_set,
        out: &o.out,
        seed: o.common.seed,
        resume: o.resume,
        progress: o.progress,
    };
    let t1 = Instant::now();
    let rep = train::train(&engine, &mut editor, &setup, &mut tracker)?;
    let seconds = BTreeMap::from([("load".to_string(), load_s), ("train".to_string(), t1.elapsed().as_secs_f64())]);
    let path = o.common.report.clone().unwrap_or_else(|| o.out.join("report.json"));
    let path = report("train", &o.common, &engine, data, &rep, seconds, &tracker).write(&path, &tracker)?;
    if !o.out.join(checkpoint::EDITOR_FILE).exists() {
        return Err(Error::file(
            &o.out,
            format!(
                "no editor was saved: {} steps ran ({} skipped as non-finite) and no validation gave a finite result; report in {}",
                rep.steps,
                rep.skipped_steps,
                path.display()
            ),
        ));
    }
    Ok((rep, path))
}

/// `val` without the examples that are also in `train` or earlier in `val` (same tokens,
/// same image), and how many were dropped.
fn drop_overlap(train: &[EditExample], val: Vec<EditExample>) -> (Vec<EditExample>, usize) {
    let key = |e: &EditExample| (e.inner.ids.clone(), e.inner.image.as_ref().map(|r| r.path.clone()));
    let mut seen: std::collections::HashSet<_> = train.iter().map(key).collect();
    let n = val.len();
    let kept: Vec<EditExample> = val.into_iter().filter(|e| seen.insert(key(e))).collect();
    let dropped = n - kept.len();
    (kept, dropped)
}

fn split_holdout_examples(examples: Vec<EditExample>, holdout: usize) -> (Vec<EditExample>, Vec<EditExample>) {
    let n = examples.len();
    let mut train = examples;
    let val = train.split_off(n - holdout.min(n));
    (train, val)
}

#[derive(Debug, Clone)]
pub struct EvalOptions {
    pub common: Common,
    pub method: MethodSpec,
    pub data: PathBuf,
    pub ds: DatasetKind,
    pub limit: Option<usize>,
    pub max_length: usize,
    /// Capacity measurement ([`crate::edit::capacity`]) instead of each record alone.
    pub capacity: Option<CapacityOptions>,
}

/// `dualedit eval --edits-per-batch N | --sequential N`: groups of N records edited
/// together or one after another, measured after each group's last edit.
#[derive(Debug, Clone)]
pub struct CapacityOptions {
    pub grouping: Grouping,
    /// The commit guard on the groups' locality prompts.
    pub guard: Option<crate::mend::guard::GuardConfig>,
    /// Sequential only: stepwise edits ([`crate::mend::stepwise`]).
    pub stepwise: Option<crate::mend::stepwise::Stepwise>,
    /// A text file whose lines are the unrelated texts of the NLL drift (default: the
    /// groups' locality prompts with their answers).
    pub drift_text: Option<PathBuf>,
}

#[derive(Debug, Clone, Serialize)]
pub struct EvalOutput {
    pub method: String,
    /// `--method mend-ls`: the settings used (the editor's `ls`, unless flags changed them).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ls: Option<crate::config::LsConfig>,
    /// The capacity measurement's grouping, time per edit, drift and guard counts.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub capacity: Option<CapacityReport>,
    #[serde(flatten)]
    pub summary: Summary,
    pub records: Vec<RecordMetrics>,
    /// What was read from the data file and what was left out: the report's top-level
    /// `data` (skipped here so the report does not carry it twice).
    #[serde(skip)]
    pub data: DataCounts,
}

/// Edits each record from the unedited model and measures it (EasyEdit's protocol).
pub fn run_eval(o: &EvalOptions, mut on_record: impl FnMut(usize, &RecordMetrics)) -> Result<(EvalOutput, PathBuf)> {
    run_eval_counted(o, |i, _, m| on_record(i, m))
}

/// [`run_eval`] telling `on_record(i, n, metrics)` how far it got: record `i` of `n` done
/// (for progress lines).
pub fn run_eval_counted(o: &EvalOptions, mut on_record: impl FnMut(usize, usize, &RecordMetrics)) -> Result<(EvalOutput, PathBuf)> {
    check_report_path(o.common.report.as_deref(), &[&o.data])?;
    check_data_flags(o.ds, &o.common)?;
    if let Some(c) = &o.capacity {
        return run_capacity(o, c, on_record);
    }
    let t0 = Instant::now();
    let mut tracker = MemoryTracker::sampled(&o.common.plan.roles());
    let (engine, mut method) = edit::open(&o.common.model, &o.common.load_options(), &o.method)?;
    tracker.mark("load")?;
    let load_s = t0.elapsed().as_secs_f64();
    let (records, examples, data) = load_examples(&engine, &o.data, o.ds, o.limit, o.max_length, o.common.over_long, o.common.image_roots.as_ref())?;
    // `load_examples` keeps the records its examples were made from, one for one.
    let facts: Vec<_> = records.iter().map(crate::mend::ls::Fact::of).collect();
    let t1 = Instant::now();
    let records = crate::edit::evaluate(&engine, method.as_mut(), &examples, &facts, |i, m| on_record(i, examples.len(), m))?;
    tracker.mark("eval")?;
    let out = EvalOutput { method: method.name().into(), ls: method.ls_config(), capacity: None, summary: Summary::of(&records), records, data };
    let seconds = BTreeMap::from([("load".to_string(), load_s), ("eval".to_string(), t1.elapsed().as_secs_f64())]);
    let path = o.common.report.clone().unwrap_or_else(|| crate::run::report::default_path("eval"));
    let path = report("eval", &o.common, &engine, out.data.clone(), &out, seconds, &tracker).write(&path, &tracker)?;
    Ok((out, path))
}

/// [`run_eval`] with groups ([`crate::edit::capacity::measure`]) through a [`Session`].
fn run_capacity(o: &EvalOptions, c: &CapacityOptions, mut on_record: impl FnMut(usize, usize, &RecordMetrics)) -> Result<(EvalOutput, PathBuf)> {
    let unrelated: Vec<String> = match &c.drift_text {
        Some(p) => {
            let text = crate::io::read_text(p).map_err(|e| Error::file(p, format!("`drift_text`: {e}")))?;
            let lines: Vec<String> = text.lines().map(str::trim).filter(|l| !l.is_empty()).map(String::from).collect();
            if lines.is_empty() {
                return Err(Error::file(p, "`drift_text` has no non-empty line"));
            }
            lines
        }
        None => Vec::new(),
    };
    let t0 = Instant::now();
    let mut tracker = MemoryTracker::sampled(&o.common.plan.roles());
    let mut session = Session::open_method(&o.common.model, &o.method, &o.common.load_options())?;
    tracker.mark("load")?;
    let load_s = t0.elapsed().as_secs_f64();
    let (records, examples, data) =
        load_examples(session.engine(), &o.data, o.ds, o.limit, o.max_length, o.common.over_long, o.common.image_roots.as_ref())?;
    session.guard = c.guard.clone();
    session.stepwise = c.stepwise.clone();
    let t1 = Instant::now();
    let (mut done, total) = (0, examples.len());
    let (records, cap) = capacity::measure(&mut session, &records, &examples, c.grouping, &unrelated, |_, ms| {
        for m in ms {
            on_record(done, total, m);
            done += 1;
        }
    })?;
    tracker.mark("eval")?;
    let out = EvalOutput { method: session.method_name().into(), ls: session.ls_config(), capacity: Some(cap), summary: Summary::of(&records), records, data };
    let seconds = BTreeMap::from([("load".to_string(), load_s), ("eval".to_string(), t1.elapsed().as_secs_f64())]);
    let path = o.common.report.clone().unwrap_or_else(|| crate::run::report::default_path("eval"));
    let path = report("eval", &o.common, session.engine(), out.data.clone(), &out, seconds, &tracker).write(&path, &tracker)?;
    Ok((out, path))
}

#[derive(Debug, Clone)]
pub struct EditOptions {
    pub common: Common,
    pub method: MethodSpec,
    pub requests: PathBuf,
    /// The requests' format: `Requests` (EasyEdit's request records: prompt, target_new,
    /// ...), `Vqa` / `Caption` (E-VQA / E-IC records with images under
    /// `common.image_roots`), or a dataset's (`Zsre`, `Counterfact`).
    pub ds: DatasetKind,
    pub sequential: bool,
    pub save: Option<PathBuf>,
    pub max_length: usize,
    /// The commit guard ([`crate::mend::guard`]) on the requests' locality prompts; `None`
    /// commits every edit as the editor makes it.
    pub guard: Option<crate::mend::guard::GuardConfig>,
    /// Sequential only: make each request in small committed steps
    /// ([`crate::mend::stepwise`], experimental).
    pub stepwise: Option<crate::mend::stepwise::Stepwise>,
}

/// `dualedit edit`'s result: the session's [`EditOutcome`] (the keys `serve` and Python
/// answer with) plus the folder the edited model was saved to.
#[derive(Debug, Clone, Serialize)]
pub struct EditOutput {
    #[serde(flatten)]
    pub outcome: EditOutcome,
    pub saved: Option<PathBuf>,
    /// What was read from the requests file and what was left out: the report's
    /// top-level `data` (skipped here so the report does not carry it twice).
    #[serde(skip)]
    pub data: DataCounts,
}

/// Applies requests as one batch (or one after another), measures them after all edits,
/// and optionally saves the edited model as a Hugging Face directory: a [`Session`]
/// opened for the method, one edit call, a report.
pub fn run_edit(o: &EditOptions) -> Result<(EditOutput, PathBuf)> {
    check_report_path(o.common.report.as_deref(), &[&o.requests])?;
    check_data_flags(o.ds, &o.common)?;
    if let Some(dir) = &o.save {
        crate::placed::save::check_save_dir(dir)?;
    }
    let t0 = Instant::now();
    let mut tracker = MemoryTracker::sampled(&o.common.plan.roles());
    let mut session = Session::open_method(&o.common.model, &o.method, &o.common.load_options())?;
    tracker.mark("load")?;
    let (records, examples, data) =
        load_examples(session.engine(), &o.requests, o.ds, None, o.max_length, o.common.over_long, o.common.image_roots.as_ref())?;
    let t1 = Instant::now();
    session.guard = o.guard.clone();
    session.stepwise = o.stepwise.clone();
    let outcome = session.edit_examples(&records, &examples, o.sequential)?;
    let edit_s = t1.elapsed().as_secs_f64();
    tracker.mark("edit")?;
    // Everything refused, nothing committed: an error (after the report is written),
    // never a run that exits 0 having changed nothing; and nothing is saved.
    let refused = outcome.refused_error();
    let saved = match &o.save {
        Some(_) if refused.is_some() => None,
        Some(dir) => {
            session.save(dir)?;
            Some(dir.clone())
        }
        None => None,
    };
    let out = EditOutput { outcome, saved, data };
    let seconds = BTreeMap::from([("load".to_string(), t1.duration_since(t0).as_secs_f64()), ("edit".to_string(), edit_s)]);
    let path = o.common.report.clone().unwrap_or_else(|| crate::run::report::default_path("edit"));
    let path = report("edit", &o.common, session.engine(), out.data.clone(), &out, seconds, &tracker).write(&path, &tracker)?;
    if let Some(e) = refused {
        return Err(Error::input(format!("{e} (report: {})", path.display())));
    }
    Ok((out, path))
}

/// A number or `-` with why it is missing, for the text tables.
fn cell(v: Option<f64>, missing: &str) -> String {
    v.map_or_else(|| format!("- ({missing})"), |v| format!("{v:.4}"))
}

/// The text table `edit` and `eval` print: the summary's metrics, and for image edits
/// EasyEdit's five (`rewrite_acc`, `rephrase_acc`, `rephrase_image_acc`, `locality_acc`,
/// `multimodal_locality_acc`) under their names.
pub fn summary_table(s: &Summary) -> String {
    let mut rows: Vec<(&str, String)> = vec![
        ("reliability", format!("{:.4}", s.reliability)),
        ("edit_success", format!("{:.4}", s.edit_success)),
        ("nll_pre", format!("{:.4}", s.nll_pre)),
        ("nll_post", format!("{:.4}", s.nll_post)),
        ("seconds_per_edit", format!("{:.4}", s.seconds_per_edit)),
        ("generalization", cell(s.generalization, "no rephrases")),
        ("locality", cell(s.locality, "no locality prompts")),
    ];
    if let Some(p) = s.portability {
        rows.push(("portability", format!("{p:.4}")));
    }
    if let Some(e) = &s.easyedit {
        rows.push(("rewrite_acc", format!("{:.4}", e.rewrite_acc)));
        rows.push(("rephrase_acc", cell(e.rephrase_acc, "no rephrases")));
        rows.push(("rephrase_image_acc", cell(e.rephrase_image_acc, "no rephrase images")));
        rows.push(("locality_acc", cell(e.locality_acc, "no locality prompts")));
        rows.push(("multimodal_locality_acc", cell(e.multimodal_locality_acc, "no locality images")));
    }
    rows.push(("n", s.n.to_string()));
    let mut out = format!("{:<24} {:>8}\n", "metric", "value");
    for (k, v) in rows {
        out.push_str(&format!("{k:<24} {v:>8}\n"));
    }
    out
}

/// One request's line in `edit`'s text output: the request, the answer after the edit
/// and its metrics (the image ones too, for image edits).
pub fn request_line(i: usize, r: &RequestResult) -> String {
    let m = &r.metrics;
    let opt = |v: Option<f64>| v.map_or("-".into(), |v| format!("{v:.2}"));
    let mut line = format!(
        "[{i}] {:?} -> {:?}: answered {:?}, now {:?} (reliability {:.2}, generalization {}, locality {}",
        r.prompt,
        r.target_new,
        r.answer_before,
        r.answer_after,
        m.reliability,
        opt(m.generalization),
        opt(m.locality)
    );
    if m.image_generalization.is_some() || m.image_locality.is_some() {
        line.push_str(&format!(", rephrase image {}, image locality {}", opt(m.image_generalization), opt(m.image_locality)));
    }
    line.push(')');
    if let Some(why) = &r.refused_reason {
        line.push_str(&format!(" REFUSED: {why}"));
    }
    line
}
