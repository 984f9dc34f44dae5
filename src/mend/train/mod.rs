//! MEND meta-training: edit on `edit_inner`, score the edited model on the rephrase
//! (`edit_outer`) and on unrelated locality text, update the editor.
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Instant;

use serde::Serialize;
use tch::Tensor;
use tracing::{info, warn};

use crate::config::{Aggregate, MendConfig, SelectBy};
use crate::data::EditExample;
use crate::device::memory::MemoryTracker;
use crate::device::timeline::{Span, TimelineSummary};
use crate::device::OptimizerDevice;
use crate::mend::checkpoint::{self, TrainCounters};
use crate::mend::optim::Adam;
use crate::mend::{Editor, Engine};
use crate::rng::SplitMix64;
use crate::{Error, Result};

mod meta_loss;
pub use meta_loss::*;

/// With `aggregate: least_squares` and a `key_stats_text`: the key statistics of the
/// engine's (unedited) model over that text, which the training solve keeps and which are
/// saved with the editor; else none.
fn key_stats(engine: &Engine, cfg: &MendConfig, progress: bool) -> Result<Option<crate::mend::stats::KeyStats>> {
    match (cfg.aggregate, &cfg.key_stats_text) {
        (Aggregate::LeastSquares, Some(text)) => {
            info!(text = %text.display(), "key statistics for the least-squares aggregation");
            crate::mend::stats::KeyStats::compute(engine, text, usize::MAX, progress).map(Some)
        }
        (Aggregate::LeastSquares, None) if cfg.ls.cov_weight > 0.0 => Err(Error::input(
            "aggregate least_squares keeps unrelated text's keys (ls.keep_weight > 0): set key_stats_text in the config to a text file (the model's pretraining corpus, say), or ls.keep_weight to 0",
        )),
        _ => Ok(None),
    }
}

/// Deterministic data order: position `g` of the endless stream of examples, reshuffled
/// each epoch from the seed, so a resumed run sees exactly the data it would have seen.
fn example_at(n: usize, seed: i64, g: usize) -> usize {
    let epoch = g / n;
    let mut order: Vec<usize> = (0..n).collect();
    SplitMix64::new(seed as u64, 1000 + epoch as u64).shuffle(&mut order);
    order[g % n]
}

/// One optimiser step in the report's history: its losses (the means over its
/// micro-batches, the same fields at the top level of the JSON), the gradient norm and
/// its wall time (its micro-batches and the optimiser's update; the losses are read back,
/// so a GPU's queued work is finished when it is taken), which gives the time per step
/// after the first (warm-up) step without a separate benchmark.
#[derive(Debug, Clone, Serialize)]
pub struct StepLog {
    pub step: usize,
    #[serde(flatten)]
    pub losses: StepLosses,
    pub grad_norm: f64,
    pub seconds: f64,
}

#[derive(Debug, Clone, Serialize)]
pub struct ValLog {
    pub step: usize,
    pub loss: f64,
    pub edit_acc: f64,
    pub loc_kl: f64,
    pub loc_acc: f64,
}

impl ValLog {
    fn at(step: usize, l: &StepLosses) -> Self {
        Self { step, loss: l.loss, edit_acc: l.edit_acc, loc_kl: l.loc_kl, loc_acc: l.loc_acc }
    }

    /// What checkpoint selection and early stopping minimise (see [`SelectBy`]).
    pub fn criterion(&self, by: SelectBy) -> f64 {
        match by {
            SelectBy::Loss => self.loss,
            SelectBy::Accuracy => -(self.edit_acc + self.loc_acc),
        }
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct TrainReport {
    pub steps: usize,
    pub skipped_steps: usize,
    /// Best validation criterion: the loss, or −(edit_acc + loc_acc) with `select_by: accuracy`.
    pub best_val_loss: f64,
    pub seconds_per_step: f64,
    pub editor_parameters: i64,
    pub history: Vec<StepLog>,
    pub validations: Vec<ValLog>,
    pub editor_dir: PathBuf,
    pub stopped_early: bool,
    /// Bytes the offloaded optimiser carried (gradients out, updates back); 0 when the
    /// optimiser state is beside the editor.
    pub optimizer_bytes_moved: u64,
    /// When each phase of the first [`TIMELINE_STEPS`] optimiser steps ran on which
    /// device, and how much the devices' work overlapped.
    pub timeline: TimelineReport,
}

/// Optimiser steps of a run whose phases the timeline records (from the first step run).
pub const TIMELINE_STEPS: usize = 3;

#[derive(Debug, Clone, Serialize)]
pub struct TimelineReport {
    pub summary: TimelineSummary,
    pub spans: Vec<Span>,
}

pub struct TrainSetup<'a> {
    pub config: &'a MendConfig,
    pub train: &'a [EditExample],
    pub val: &'a [EditExample],
    pub out: &'a Path,
    pub seed: i64,
    pub resume: bool,
    pub progress: bool,
}

/// Mean validation losses (editor in evaluation mode: statistics frozen, no gradients).
pub fn validate(engine: &Engine, editor: &mut Editor, val: &[EditExample]) -> Result<ValLog> {
    validate_aggregated(engine, editor, val, &[])
}

/// [`validate`] with the least-squares aggregation's key Grams ([`meta_loss_aggregated`]).
pub fn validate_aggregated(engine: &Engine, editor: &mut Editor, val: &[EditExample], unrelated: &[Tensor]) -> Result<ValLog> {
    let _g = tch::no_grad_guard();
    let mut mean = StepLosses::default();
    for e in val {
        let b = EditBatches::for_config(engine, &[e], &editor.config)?;
        let (_, l) = meta_loss_aggregated(engine, editor, &b, false, unrelated)?;
        mean.add_scaled(&l, 1.0 / val.len() as f64);
    }
    Ok(ValLog::at(0, &mean))
}

/// Env var for fault injection in tests: an impossible allocation at this step, to
/// exercise the out-of-memory path end to end on a machine with memory to spare. Read
/// once per run, and only by builds with the `fault-injection` feature (the tests').
pub const FAULT_OOM_STEP: &str = "DUALEDIT_FAULT_OOM_STEP";

/// The step [`FAULT_OOM_STEP`] names, in builds with the `fault-injection` feature.
fn fault_oom_step() -> Option<usize> {
    if cfg!(feature = "fault-injection") {
        std::env::var(FAULT_OOM_STEP).ok().and_then(|v| v.parse().ok())
    } else {
        None
    }
}

/// The micro-batches of one optimiser step: forwards, backwards, accumulated gradients.
#[allow(clippy::too_many_arguments)] // one step's state, passed apart so each is borrowed as it must be
fn accumulate(
    engine: &Engine,
    editor: &mut Editor,
    setup: &TrainSetup,
    step: usize,
    seed: i64,
    mut tracker: Option<&mut MemoryTracker>,
    phase: &mut &'static str,
    fault: Option<usize>,
    unrelated: &[Tensor],
) -> Result<StepLosses> {
    let cfg = setup.config;
    let n = setup.train.len();
    let k = cfg.accumulate as f64;
    let mut acc = StepLosses::default();
    for micro in 0..cfg.accumulate {
        let base = (step * cfg.accumulate + micro) * cfg.batch_size;
        let batch: Vec<&EditExample> = (0..cfg.batch_size).map(|j| &setup.train[example_at(n, seed, base + j)]).collect();
        engine.timeline.at(step, micro);
        let b = EditBatches::for_config(engine, &batch, &editor.config)?;
        *phase = "capture, editor and edited forwards";
        let (loss, parts) = meta_loss_aggregated(engine, editor, &b, true, unrelated)?;
        if fault == Some(step) {
            let _ = Tensor::f_empty([1i64 << 50], (tch::Kind::Float, engine.plan.sub))?;
        }
        if let (Some(t), 0) = (tracker.as_deref_mut(), micro) {
            t.mark("edited_forward")?;
        }
        *phase = "backward";
        engine.timeline.span(roles(engine).1, "backward", || {
            crate::error::guard(|| {
                (loss / k).f_backward()?;
                Ok(())
            })
        })?;
        if let (Some(t), 0) = (tracker.as_deref_mut(), micro) {
            t.mark("backward")?;
        }
        acc.add_scaled(&parts, 1.0 / k);
    }
    Ok(acc)
}

/// Set by an embedding program (the Python package, on Ctrl-C) to end a running
/// [`train`] after its current step as if that were the last: validated, the best editor
/// and the resumable state saved, the report returned with `stopped_early`. Process-wide;
/// cleared when a training loop takes it.
pub static STOP_REQUESTED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Runs meta-training; writes the best editor (by the `select_by` validation criterion)
/// and the training state to `setup.out`.
pub fn train(engine: &Engine, editor: &mut Editor, setup: &TrainSetup, tracker: &mut MemoryTracker) -> Result<TrainReport> {
    let cfg = setup.config;
    if setup.train.is_empty() {
        return Err(Error::input("no training examples"));
    }
    let out = setup.out;
    let (mut counters, saved_adam) = start_or_resume(editor, setup)?;
    let mut adam = optimiser(engine, editor, cfg, &counters, saved_adam.as_ref(), tracker, out)?;
    let bar = crate::progress::Progress::new("train", cfg.max_steps, setup.progress);
    bar.set_position(counters.step as u64);
    let mut history = Vec::new();
    let mut validations = Vec::new();
    let mut consecutive_bad = 0usize;
    let mut stopped_early = false;
    let start = Instant::now();
    let first_step = counters.step;
    let fault = fault_oom_step();
    let mut stats = key_stats(engine, cfg, setup.progress)?;
    let unrelated = match &stats {
        Some(s) => s.grams()?,
        None => Vec::new(),
    };
    engine.timeline.set_on(true);
    while counters.step < cfg.max_steps {
        let step = counters.step;
        let step_start = Instant::now();
        engine.timeline.set_on(step < first_step + TIMELINE_STEPS);
        let mark = step < first_step + 2 || step.is_multiple_of(cfg.val_every);
        let mut phase = "start";
        let acc = accumulate(engine, editor, setup, step, counters.seed, mark.then_some(&mut *tracker), &mut phase, fault, &unrelated)
            .map_err(|e| keep_after_failed_step(e, engine, editor, &mut adam, &counters, phase, cfg, tracker, out))?;
        // A failure in the optimiser step may leave the editor half-updated: nothing is
        // saved then, and the state from the last validation (if any) stays the resume point.
        let grad_norm = update(engine, &mut adam, cfg, step, acc.loss, tracker, out)?;
        if !acc.loss.is_finite() || !grad_norm.is_finite() {
            counters.skipped_steps += 1;
            consecutive_bad += 1;
            warn!(step, loss = acc.loss, grad_norm, "non-finite loss or gradient; step skipped");
            if consecutive_bad >= cfg.max_bad_steps {
                checkpoint::save_state(out, editor, &adam, &counters)?;
                return Err(Error::Torch(format!(
                    "{consecutive_bad} consecutive non-finite steps at step {step}; the last good editor is in {} (try a lower lr or edit_lr)",
                    out.display()
                )));
            }
        } else {
            consecutive_bad = 0;
        }
        engine.timeline.set_on(false);
        counters.step += 1;
        counters.adam_step = adam.step;
        if mark {
            tracker.mark("optimizer_step")?;
        }
        history.push(StepLog { step: counters.step, losses: acc, grad_norm, seconds: step_start.elapsed().as_secs_f64() });
        // The last validation (on the held-out split) rides along the training losses.
        let val = validations.last().map_or(String::new(), |v: &ValLog| {
            format!(" | val@{} loss {:.4} edit_acc {:.2} loc_acc {:.2}", v.step, v.loss, v.edit_acc, v.loc_acc)
        });
        bar.set_message(format!(
            "loss {:.4} edit_acc {:.2} loc_kl {:.4} loc_acc {:.2}{val}",
            acc.loss, acc.edit_acc, acc.loc_kl, acc.loc_acc
        ));
        bar.set_position(counters.step as u64);
        let stop = STOP_REQUESTED.swap(false, std::sync::atomic::Ordering::SeqCst);
        let last = counters.step == cfg.max_steps || stop;
        if counters.step.is_multiple_of(cfg.val_every) || last {
            validations.push(validate_and_select(engine, editor, setup, &mut counters, &acc, tracker, &unrelated)?);
            checkpoint::save_state(out, editor, &adam, &counters)?;
            if stop {
                info!(step = counters.step, "stopped on request: editor and training state saved");
                stopped_early = true;
                break;
            }
            if counters.stale_validations >= cfg.early_stop_patience {
                info!(step = counters.step, "early stopping: validation has not improved");
                stopped_early = true;
                break;
            }
        }
    }
    bar.finish_and_clear();
    if let Some(s) = stats.as_mut() {
        // The edit-time solve keeps the `C` the editor was trained against.
        if out.join(checkpoint::EDITOR_JSON).is_file() {
            s.write_for_editor(out)?;
        }
    }
    engine.timeline.set_on(false);
    let timeline = TimelineReport { summary: engine.timeline.summary(), spans: engine.timeline.spans() };
    info!(timeline = %timeline.summary.text, "phases per device");
    let steps_run = counters.step - first_step;
    Ok(TrainReport {
        steps: counters.step,
        skipped_steps: counters.skipped_steps,
        best_val_loss: counters.best_val,
        seconds_per_step: start.elapsed().as_secs_f64() / steps_run.max(1) as f64,
        editor_parameters: editor.n_parameters(),
        history,
        validations,
        editor_dir: out.to_path_buf(),
        stopped_early,
        optimizer_bytes_moved: adam.moved_bytes(),
        timeline,
    })
}

/// The loop's counters: fresh, or with `setup.resume` those saved in `setup.out` (with
/// the saved Adam moments to load). A resumed run keeps the saved seed (its data order),
/// and starts best-editor selection over when `select_by` changed since.
fn start_or_resume(editor: &mut Editor, setup: &TrainSetup) -> Result<(TrainCounters, Option<BTreeMap<String, Tensor>>)> {
    let (cfg, out) = (setup.config, setup.out);
    let fresh = TrainCounters {
        step: 0,
        adam_step: 0,
        best_val: f64::INFINITY,
        best_val_by: Some(cfg.select_by),
        stale_validations: 0,
        skipped_steps: 0,
        seed: setup.seed,
    };
    if !setup.resume {
        return Ok((fresh, None));
    }
    if !out.join(checkpoint::STATE_FILE).exists() {
        warn!(dir = %out.display(), "`resume` given but no training state found; starting afresh");
        return Ok((fresh, None));
    }
    let (tensors, mut counters) = checkpoint::load_state(out, editor)?;
    if counters.seed != setup.seed {
        warn!(saved = counters.seed, given = setup.seed, "resuming with the saved seed");
    }
    info!(step = counters.step, "resuming");
    if let Some(by) = counters.best_val_by.filter(|&by| by != cfg.select_by) {
        warn!(
            saved = ?by,
            now = ?cfg.select_by,
            "select_by changed since the saved run: the best editor so far was picked by the other criterion, so selection and early stopping start over"
        );
        counters.best_val = f64::INFINITY;
        counters.stale_validations = 0;
    }
    counters.best_val_by = Some(cfg.select_by);
    Ok((counters, Some(tensors)))
}

/// Adam over the editor's network (`lr`) and its learned edit rates (`lr_lr`), its moments
/// where `--optimizer-device` puts them, and the saved moments of a resumed run loaded.
#[allow(clippy::too_many_arguments)] // the run's parts, each borrowed as it must be
fn optimiser(
    engine: &Engine,
    editor: &mut Editor,
    cfg: &MendConfig,
    counters: &TrainCounters,
    saved: Option<&BTreeMap<String, Tensor>>,
    tracker: &mut MemoryTracker,
    out: &Path,
) -> Result<Adam> {
    let (net, lrs) = editor.trainables();
    let groups = vec![(cfg.lr, net), (cfg.lr_lr, lrs)];
    if engine.plan.optimizer == OptimizerDevice::Sub && !engine.plan.split {
        // It used to fall back to the main device silently, which is not what was asked.
        return Err(Error::input("`optimizer_device` sub needs a `sub_device` other than `device` (this run has one device): drop it or give a sub-device"));
    }
    let offload = engine.plan.optimizer != OptimizerDevice::Main;
    let mut adam = crate::error::guard(|| Ok(if offload { Adam::offloaded(groups, engine.plan.optimizer_device()) } else { Adam::new(groups) }))
        .map_err(|e| crate::device::oom::diagnose(e, counters.step, "optimizer setup", &engine.placement(), cfg, tracker, checkpoint::saved_state(out)))?;
    if let Some(t) = saved {
        adam.load_state(t, counters.adam_step)?;
    }
    Ok(adam)
}

/// After a step failed before touching the editor: keeps what was learned (the training
/// state, and the editor when none is saved yet) so that `--resume` continues from this
/// step, not from the last validation, and returns the error that ends the run:
/// out-of-memory and libtorch failures diagnosed (where, and what to try), any other (a
/// data error, say) as it was.
#[allow(clippy::too_many_arguments)] // the run's parts, each borrowed as it must be
fn keep_after_failed_step(
    err: Error,
    engine: &Engine,
    editor: &Editor,
    adam: &mut Adam,
    counters: &TrainCounters,
    phase: &str,
    cfg: &MendConfig,
    tracker: &mut MemoryTracker,
    out: &Path,
) -> Error {
    let step = counters.step;
    adam.zero_grad();
    let saved = checkpoint::save_state(out, editor, adam, counters).and_then(|()| {
        if out.join(checkpoint::EDITOR_FILE).exists() {
            Ok(())
        } else {
            checkpoint::save_editor(out, editor, engine, step).map(|_| ())
        }
    });
    match err {
        e @ (Error::OutOfMemory(_) | Error::Torch(_)) => match saved {
            Ok(()) => crate::device::oom::diagnose(e, step, phase, &engine.placement(), cfg, tracker, checkpoint::saved_state(out)),
            // The diagnosis still; the state on disk is the last one saved, if any.
            Err(se) => {
                warn!(dir = %out.display(), step, "saving the training state after the failed step failed too: {se}");
                crate::device::oom::diagnose(e, step, phase, &engine.placement(), cfg, tracker, checkpoint::saved_state(out))
            }
        },
        e => {
            match saved {
                Ok(()) => warn!(dir = %out.display(), step, "the run stopped on an error; the training state is saved: `resume`=true continues from step {step}"),
                Err(se) => warn!(dir = %out.display(), step, "the run stopped on an error, and saving the training state failed too: {se}"),
            }
            e
        }
    }
}

/// The optimiser's update after a step's micro-batches: the scheduled learning rates,
/// gradients clipped to `grad_clip`, Adam applied when the loss and the gradient norm are
/// finite (the step is skipped otherwise), gradients cleared. Returns the gradient norm.
fn update(engine: &Engine, adam: &mut Adam, cfg: &MendConfig, step: usize, loss: f64, tracker: &mut MemoryTracker, out: &Path) -> Result<f64> {
    let decay = cfg.lr_schedule.factor(step, cfg.max_steps);
    adam.groups[0].lr = cfg.lr * decay;
    adam.groups[1].lr = cfg.lr_lr * decay;
    engine.timeline.at(step, cfg.accumulate);
    let opt_on = match engine.plan.optimizer {
        OptimizerDevice::Main => "main",
        OptimizerDevice::Sub if engine.plan.split => "sub",
        OptimizerDevice::Sub => "main",
        OptimizerDevice::Cpu => "cpu",
    };
    engine
        .timeline
        .span(opt_on, "optimiser", || {
            crate::error::guard(|| {
                let grad_norm = adam.clip(cfg.grad_clip);
                if loss.is_finite() && grad_norm.is_finite() {
                    adam.step();
                }
                adam.zero_grad();
                Ok(grad_norm)
            })
        })
        .map_err(|e| crate::device::oom::diagnose(e, step, "optimizer_step", &engine.placement(), cfg, tracker, checkpoint::saved_state(out)))
}

/// Validation at `counters.step` (on the step's own losses when there is no validation
/// set); the editor is saved when it is the best so far by `select_by`, and a validation
/// that is not counts towards early stopping.
fn validate_and_select(
    engine: &Engine,
    editor: &mut Editor,
    setup: &TrainSetup,
    counters: &mut TrainCounters,
    acc: &StepLosses,
    tracker: &mut MemoryTracker,
    unrelated: &[Tensor],
) -> Result<ValLog> {
    let (cfg, out) = (setup.config, setup.out);
    let mut v = if setup.val.is_empty() {
        ValLog::at(0, acc)
    } else {
        crate::error::guard(|| validate_aggregated(engine, editor, setup.val, unrelated))
            .map_err(|e| crate::device::oom::diagnose(e, counters.step, "validation", &engine.placement(), cfg, tracker, checkpoint::saved_state(out)))?
    };
    v.step = counters.step;
    info!(step = v.step, loss = v.loss, edit_acc = v.edit_acc, loc_kl = v.loc_kl, loc_acc = v.loc_acc, "validation");
    let score = v.criterion(cfg.select_by);
    if score < counters.best_val {
        counters.best_val = score;
        counters.stale_validations = 0;
        checkpoint::save_editor(out, editor, engine, counters.step)?;
    } else {
        counters.stale_validations += 1;
    }
    Ok(v)
}
