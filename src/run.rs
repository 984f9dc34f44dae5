//! The train / edit / eval runs behind the CLI: load, place, run, report. Kept in the
//! library so `compare`, tests and embedding programs run exactly what the CLI runs.
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Instant;

use serde::Serialize;
use tch::Kind;
use tracing::info;

use crate::config::MendConfig;
use crate::data::easyedit::{load_records, DatasetKind, EditRecord};
use crate::data::examples::prepare;
use crate::data::{EditExample, TokenBatch};
use crate::device::memory::MemoryTracker;
use crate::device::DevicePlan;
use crate::eval::{self, Method, RecordMetrics, Summary};
use crate::mend::{checkpoint, Editor, Engine};
use crate::model::{load_model, ParamView};
use crate::report::{DeviceInfo, RunReport};
use crate::train::{self, TrainReport, TrainSetup};
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
}

fn dtype_name(k: Kind) -> &'static str {
    match k {
        Kind::BFloat16 => "bf16",
        Kind::Half => "f16",
        _ => "f32",
    }
}

/// Loads the model on the main device and builds the engine (replica on the sub-device).
pub fn open_engine(c: &Common, edit_params: &[String], tracker: &mut MemoryTracker) -> Result<Engine> {
    tch::manual_seed(c.seed);
    let lm = load_model(&c.model, c.plan.main, c.dtype)?;
    let engine = Engine::new(lm, c.plan, edit_params)?;
    tracker.mark("load")?;
    Ok(engine)
}

fn report<M: Serialize>(
    command: &str,
    c: &Common,
    engine: &Engine,
    metrics: M,
    seconds: BTreeMap<String, f64>,
    tracker: &MemoryTracker,
) -> RunReport<M> {
    RunReport {
        command: command.into(),
        model: c.model.display().to_string(),
        devices: DeviceInfo::from(&c.plan),
        dtype: dtype_name(c.dtype).into(),
        seed: c.seed,
        metrics,
        seconds,
        memory: tracker.summary(),
        moved: engine.mover.stats(),
        timeline_file: None,
    }
}

/// Checks a run's report path before any work: it must not be one of the run's input
/// files (writing the report would replace it), and its folder must be creatable, so a
/// long run does not fail at its very end.
pub fn check_report_path(report: Option<&Path>, inputs: &[&Path]) -> Result<()> {
    let Some(report) = report else { return Ok(()) };
    let same = |a: &Path, b: &Path| match (a.canonicalize(), b.canonicalize()) {
        (Ok(a), Ok(b)) => a == b,
        _ => a == b,
    };
    if let Some(input) = inputs.iter().find(|i| same(report, i)) {
        return Err(Error::file(report, format!("--report would overwrite an input of this run ({}); choose another path", input.display())));
    }
    if let Some(dir) = report.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).map_err(|e| Error::file(dir, format!("cannot create the folder for --report: {e}")))?;
    }
    Ok(())
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

/// Reads a dataset and tokenises it, keeping the first `limit` records.
pub fn load_examples(engine: &Engine, path: &Path, ds: DatasetKind, limit: Option<usize>, max_len: usize) -> Result<(Vec<EditRecord>, Vec<EditExample>)> {
    let (mut records, _) = load_records(path, ds)?;
    if let Some(l) = limit {
        records.truncate(l);
    }
    let max_len = max_len.min(engine.lm.model.info().max_positions as usize);
    let examples = prepare(&engine.lm.tokenizer, &records, max_len, path)?;
    Ok((records, examples))
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
    pub progress: bool,
}

/// Meta-trains an editor; the report goes to `<out>/report.json` unless told otherwise.
pub fn run_train(o: &TrainOptions) -> Result<(TrainReport, PathBuf)> {
    check_report_path(o.common.report.as_deref(), &[&o.data])?;
    // Never replace a trained editor: only --resume continues (and then rewrites) it.
    if o.out.join(checkpoint::EDITOR_FILE).exists() && !(o.resume && o.out.join(checkpoint::STATE_FILE).exists()) {
        return Err(Error::file(
            &o.out,
            if o.resume {
                "holds an editor but no training state to resume it from; choose another --out to train a new one"
            } else {
                "already holds an editor; pass --resume to continue its training, or choose another --out"
            },
        ));
    }
    let t0 = Instant::now();
    let mut tracker = MemoryTracker::new(&o.common.plan.roles());
    let engine = open_engine(&o.common, &o.config.edit_params, &mut tracker)?;
    let load_s = t0.elapsed().as_secs_f64();
    let (_, examples) = load_examples(&engine, &o.data, o.ds, o.limit, o.config.max_length)?;
    let holdout = o.config.val_records.min(examples.len() / 5);
    let (train_set, val_set) = split_holdout_examples(examples, holdout);
    if train_set.is_empty() {
        return Err(Error::file(&o.data, "no records left for training after holding out the validation split"));
    }
    info!(train = train_set.len(), val = val_set.len(), "meta-training");
    if val_set.is_empty() {
        tracing::warn!("no validation split (val_records is 0 or there are fewer than 5 records): the editor is selected by its training-batch loss");
    }
    tch::manual_seed(o.common.seed);
    let mut editor = crate::error::guard(|| Editor::new(&o.config, engine.edit_params.clone(), o.common.plan.main))
        .map_err(|e| crate::device::oom::diagnose(e, 0, "editor setup", &engine, &o.config, &mut tracker, &o.out))?;
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
    let path = report("train", &o.common, &engine, &rep, seconds, &tracker).write(&path, &tracker)?;
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

fn split_holdout_examples(examples: Vec<EditExample>, holdout: usize) -> (Vec<EditExample>, Vec<EditExample>) {
    let n = examples.len();
    let mut train = examples;
    let val = train.split_off(n - holdout.min(n));
    (train, val)
}

/// How `eval` and `edit` make their edits.
#[derive(Debug, Clone)]
pub enum MethodSpec {
    Unedited,
    FineTune { lr: f64 },
    Mend { editor: PathBuf },
}

pub fn open_method(spec: &MethodSpec, engine: &Engine) -> Result<Method> {
    Ok(match spec {
        MethodSpec::Unedited => Method::Unedited,
        MethodSpec::FineTune { lr } => Method::FineTune { lr: *lr },
        MethodSpec::Mend { editor } => {
            let (ed, meta) = checkpoint::load_editor(editor, engine)?;
            info!(dir = %editor.display(), step = meta.step, "editor loaded");
            Method::Mend(ed)
        }
    })
}

/// Opens the engine for a method: with an editor, on the weights it was trained to edit
/// (a model without them is another model than the editor's).
pub fn open_engine_for(c: &Common, spec: &MethodSpec, tracker: &mut MemoryTracker) -> Result<Engine> {
    let names = edit_params_of(spec)?;
    open_engine(c, &names, tracker).map_err(|e| match (spec, e) {
        (MethodSpec::Mend { editor }, Error::Input(msg)) => Error::file(
            editor.join(checkpoint::EDITOR_JSON),
            format!("editor was trained for another model than {}: {msg}", c.model.display()),
        ),
        (_, e) => e,
    })
}

/// Edit parameters an editor checkpoint was trained on (so the engine captures those).
pub fn edit_params_of(spec: &MethodSpec) -> Result<Vec<String>> {
    match spec {
        MethodSpec::Mend { editor } => {
            let path = editor.join(checkpoint::EDITOR_JSON);
            let text = std::fs::read_to_string(&path).map_err(|e| Error::io(&path, e))?;
            let meta: checkpoint::EditorMeta =
                serde_json::from_str(&text).map_err(|e| Error::file(&path, format!("invalid editor description: {e}")))?;
            Ok(meta.params.into_iter().map(|p| p.name).collect())
        }
        _ => Ok(Vec::new()),
    }
}

#[derive(Debug, Clone)]
pub struct EvalOptions {
    pub common: Common,
    pub method: MethodSpec,
    pub data: PathBuf,
    pub ds: DatasetKind,
    pub limit: Option<usize>,
    pub max_length: usize,
}

#[derive(Debug, Clone, Serialize)]
pub struct EvalOutput {
    pub method: String,
    #[serde(flatten)]
    pub summary: Summary,
    pub records: Vec<RecordMetrics>,
}

/// Edits each record from the unedited model and measures it (EasyEdit's protocol).
pub fn run_eval(o: &EvalOptions, mut on_record: impl FnMut(usize, &RecordMetrics)) -> Result<(EvalOutput, PathBuf)> {
    check_report_path(o.common.report.as_deref(), &[&o.data])?;
    let t0 = Instant::now();
    let mut tracker = MemoryTracker::new(&o.common.plan.roles());
    let engine = open_engine_for(&o.common, &o.method, &mut tracker)?;
    let mut method = open_method(&o.method, &engine)?;
    let load_s = t0.elapsed().as_secs_f64();
    let (_, examples) = load_examples(&engine, &o.data, o.ds, o.limit, o.max_length)?;
    let t1 = Instant::now();
    let records = eval::evaluate(&engine, &mut method, &examples, |i, m| on_record(i, m))?;
    tracker.mark("eval")?;
    let out = EvalOutput { method: method.name().into(), summary: Summary::of(&records), records };
    let seconds = BTreeMap::from([("load".to_string(), load_s), ("eval".to_string(), t1.elapsed().as_secs_f64())]);
    let path = o.common.report.clone().unwrap_or_else(|| crate::report::default_path("eval"));
    let path = report("eval", &o.common, &engine, &out, seconds, &tracker).write(&path, &tracker)?;
    Ok((out, path))
}

#[derive(Debug, Clone)]
pub struct EditOptions {
    pub common: Common,
    pub method: MethodSpec,
    pub requests: PathBuf,
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

#[derive(Debug, Clone, Serialize)]
pub struct EditOutput {
    pub sequential: bool,
    /// The guard's decision on each edit committed (one per request when sequential, one
    /// for the batch); empty without a guard or without locality prompts.
    pub guard: Vec<crate::mend::guard::GuardReport>,
    #[serde(flatten)]
    pub summary: Summary,
    pub requests: Vec<RequestResult>,
    pub saved: Option<PathBuf>,
}

#[derive(Debug, Clone, Serialize)]
pub struct RequestResult {
    pub prompt: String,
    pub target_new: String,
    /// Greedy answer after all edits (as many tokens as the target has).
    pub answer_after: String,
    #[serde(flatten)]
    pub metrics: RecordMetrics,
}

/// Applies requests as one batch (or one after another), measures them after all edits,
/// and optionally saves the edited model as a Hugging Face directory.
pub fn run_edit(o: &EditOptions) -> Result<(EditOutput, PathBuf)> {
    check_report_path(o.common.report.as_deref(), &[&o.requests])?;
    if let Some(dir) = &o.save {
        check_new_model_dir(dir)?;
    }
    let t0 = Instant::now();
    let mut tracker = MemoryTracker::new(&o.common.plan.roles());
    let mut engine = open_engine_for(&o.common, &o.method, &mut tracker)?;
    let mut method = open_method(&o.method, &engine)?;
    let (records, examples) = load_examples(&engine, &o.requests, DatasetKind::Requests, None, o.max_length)?;
    let refs: Vec<&EditExample> = examples.iter().collect();
    let before = eval::measure_before(&engine, &refs)?;
    let pad = engine.lm.tokenizer.pad_id();
    // The guard's probes: the requests' locality prompts, against the weights as loaded.
    let loc: Vec<&crate::data::Example> = examples.iter().filter_map(|e| e.loc.as_ref()).collect();
    let probes = match &o.guard {
        Some(_) => crate::mend::guard::Probes::new(&engine, &loc)?,
        None => None,
    };
    if o.guard.is_some() && probes.is_none() {
        tracing::warn!("no request has a locality prompt: the commit guard has nothing to measure and is off");
    }
    let mut guard_reports = Vec::new();
    let mut guarded = |engine: &Engine, ov: crate::model::Overrides, inner: &TokenBatch| -> Result<Option<crate::model::Overrides>> {
        match (&o.guard, &probes) {
            (Some(cfg), Some(p)) => {
                let (ov, rep) = crate::mend::guard::check_edit(engine, &ov, p, Some(inner), cfg)?;
                match rep.decision {
                    crate::mend::guard::Decision::Accepted => info!("{}", rep.message),
                    _ => tracing::warn!("request(s) {}: {}", guard_reports.len(), rep.message),
                }
                guard_reports.push(rep);
                Ok(ov)
            }
            _ => Ok(Some(ov)),
        }
    };
    let t1 = Instant::now();
    let overrides = if o.sequential {
        for e in &examples {
            let inner = TokenBatch::collate(&[&e.inner], pad, engine.plan.main);
            match &o.stepwise {
                None => {
                    let ov = eval::make_edit(&engine, &mut method, &inner)?;
                    if let Some(ov) = guarded(&engine, ov, &inner)? {
                        engine.commit(&ov)?;
                    }
                }
                Some(sw) => {
                    for _ in 0..sw.steps {
                        let ov = crate::mend::stepwise::step(&engine, &mut method, &inner, sw)?;
                        if let Some(ov) = guarded(&engine, ov, &inner)? {
                            engine.commit(&ov)?;
                        }
                        if crate::mend::guard::makes_edit(&engine, &crate::model::Overrides::new(), &inner)? {
                            break;
                        }
                    }
                }
            }
        }
        crate::model::Overrides::new()
    } else {
        let inner: Vec<_> = examples.iter().map(|e| &e.inner).collect();
        let batch = TokenBatch::collate(&inner, pad, engine.plan.main);
        let ov = eval::make_edit(&engine, &mut method, &batch)?;
        guarded(&engine, ov, &batch)?.unwrap_or_default()
    };
    let edit_s = t1.elapsed().as_secs_f64();
    tracker.mark("edit")?;
    let per = edit_s / examples.len().max(1) as f64;
    let metrics = eval::measure_after(&engine, &overrides, &refs, &before, per)?;
    engine.commit(&overrides)?;
    let mut requests = Vec::with_capacity(records.len());
    for ((r, e), m) in records.iter().zip(&examples).zip(metrics) {
        let answer = greedy(&engine, &ParamView::frozen(&engine.lm.params), &e.inner.ids[..e.inner.answer_start], e.inner.answer().len())?;
        requests.push(RequestResult { prompt: r.prompt.clone(), target_new: r.target_new.clone(), answer_after: answer, metrics: m });
    }
    let saved = match &o.save {
        Some(dir) => {
            save_model(&engine, dir)?;
            Some(dir.clone())
        }
        None => None,
    };
    let summary = Summary::of(&requests.iter().map(|r| r.metrics.clone()).collect::<Vec<_>>());
    let out = EditOutput { sequential: o.sequential, guard: guard_reports, summary, requests, saved };
    let seconds = BTreeMap::from([("load".to_string(), t1.duration_since(t0).as_secs_f64()), ("edit".to_string(), edit_s)]);
    let path = o.common.report.clone().unwrap_or_else(|| crate::report::default_path("edit"));
    let path = report("edit", &o.common, &engine, &out, seconds, &tracker).write(&path, &tracker)?;
    Ok((out, path))
}

/// Greedy continuation of `prompt` ids under the weights of `params` (full recomputation
/// per token: the answers scored here are a few tokens long).
pub fn greedy(engine: &Engine, params: &ParamView, prompt: &[i64], n: usize) -> Result<String> {
    let _g = tch::no_grad_guard();
    let mut ids = prompt.to_vec();
    let none = Default::default();
    let max = engine.lm.model.info().max_positions as usize;
    for _ in 0..n {
        if ids.len() >= max {
            break;
        }
        let t = tch::Tensor::from_slice(&ids).unsqueeze(0).to_device(params.device());
        let out = engine.lm.model.forward(params, &crate::model::ForwardInput::new(&t, &none))?;
        let next = out.logits.get(0).get(ids.len() as i64 - 1).argmax(-1, false).int64_value(&[]);
        ids.push(next);
    }
    engine.lm.tokenizer.decode(&ids[prompt.len()..])
}

/// Writes the (edited) model as a Hugging Face directory that `score` and transformers load.
pub fn save_model(engine: &Engine, dir: &Path) -> Result<()> {
    check_new_model_dir(dir)?;
    std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
    crate::io::write_json_atomic(&dir.join("config.json"), &engine.lm.config_json)?;
    let tok = engine.lm.tokenizer.path();
    let bytes = std::fs::read(tok).map_err(|e| Error::io(tok, e))?;
    crate::io::write_atomic(&dir.join("tokenizer.json"), &bytes)?;
    let mut tensors: Vec<(String, tch::Tensor)> = engine.lm.params.iter().map(|(n, t)| (n.clone(), t.shallow_clone())).collect();
    tensors.sort_by(|a, b| a.0.cmp(&b.0));
    let meta = std::collections::HashMap::from([("format".to_string(), "pt".to_string())]);
    crate::io::write_safetensors(&dir.join("model.safetensors"), &tensors, meta)?;
    info!(dir = %dir.display(), "edited model saved");
    Ok(())
}

