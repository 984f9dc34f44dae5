//! Turning an allocation failure into a diagnosis: which device held how much, in which
//! phase it failed, and the concrete change that would make the run fit.
use std::path::Path;
use std::sync::Arc;

use tch::Kind;

use super::memory::{format_bytes, MemoryTracker};
use crate::config::MendConfig;
use crate::Error;

/// The planner's answer to "which placement fits the capacities": the planner is above
/// the device layer, so the run hands the diagnosis one of these (`planner::FitAdvice`).
pub trait FitAdvisor: Send + Sync + std::fmt::Debug {
    /// The flags of the first placement (in `planner::choose`'s order) whose every device
    /// fits its capacity, with its per-device peaks, e.g. `--placement balanced
    /// --optimizer-device cpu (main cuda:0 9.3 GiB, sub cuda:1 9.5 GiB, cpu 2.4 GiB)`;
    /// `Err` says why none does (each placement's peaks against the caps).
    fn would_fit(&self) -> std::result::Result<String, String>;
}

/// What the advice depends on besides the config: how the run is placed.
#[derive(Debug, Clone)]
pub struct Placement {
    /// Whether the edited forwards already run on a sub-device.
    pub split: bool,
    /// Dtype of the model weights.
    pub weights: Kind,
    /// Replica or layer split (`--placement`).
    pub layout: super::Placement,
    /// Where the optimiser state is (`--optimizer-device`).
    pub optimizer: super::OptimizerDevice,
    /// The planner's choice against the run's capacities, when the run set one up.
    pub fit: Option<Arc<dyn FitAdvisor>>,
}

/// Builds the error a run stops with after `err` at optimiser step `step` (the message says
/// where the training state is when `saved_state` names the folder holding one).
pub fn diagnose(
    err: Error,
    step: usize,
    phase: &str,
    placement: &Placement,
    cfg: &MendConfig,
    tracker: &mut MemoryTracker,
    saved_state: Option<&Path>,
) -> Error {
    let _ = tracker.mark("failure");
    let what = match &err {
        Error::OutOfMemory(m) => m.clone(),
        other => other.to_string(),
    };
    let mut msg = format!("{what}\n  at optimiser step {step}, in phase: {phase}\n  per device:\n");
    for (role, m) in tracker.summary_shown(placement.split) {
        msg.push_str(&format!(
            "    {role:<10} {:<8} peak allocated {:>10}  peak reserved {:>10}{}\n",
            m.device,
            format_bytes(m.peak_allocated_bytes),
            format_bytes(m.peak_reserved_bytes),
            if m.process_wide { " (process-wide)" } else { "" }
        ));
    }
    match placement.fit.as_ref().map(|f| f.would_fit()) {
        Some(Ok(flags)) => msg.push_str(&format!("  would fit (planner): {flags}\n")),
        Some(Err(why)) => msg.push_str(&format!("  placement advice (planner): {}\n", why.replace('\n', "\n    "))),
        None => {}
    }
    msg.push_str("  what would make it fit:\n");
    for a in advice(placement, cfg) {
        msg.push_str(&format!("    - {a}\n"));
    }
    match saved_state {
        Some(dir) => msg.push_str(&format!("  training state saved in {} (continue with `resume`=true)", dir.display())),
        None => msg.push_str("  no training state was saved yet"),
    }
    match err {
        Error::OutOfMemory(_) => Error::OutOfMemory(msg),
        _ => Error::Torch(msg),
    }
}

/// Changes that reduce the peak, most effective first, given the current setup.
pub fn advice(placement: &Placement, cfg: &MendConfig) -> Vec<String> {
    let mut out = Vec::new();
    if !placement.split {
        out.push("run the edited forwards on a second device: `sub_device`=cuda:1 (or `sub_device`=cpu)".into());
    }
    if placement.layout == super::Placement::Replica {
        out.push(format!(
            "divide the frozen model's blocks between the devices: `placement`=balanced{} (`dualedit plan` prints each placement's per-device peaks; `placement`=auto picks one that fits `max_memory`)",
            if placement.split { "" } else { " with `sub_device`" }
        ));
    }
    if placement.optimizer == super::OptimizerDevice::Main {
        out.push("move the editor's Adam moments off the main device: `optimizer_device`=sub (or cpu)".into());
    }
    if placement.weights == Kind::Float {
        out.push("load the model in bf16 (`dtype`=bf16): weights and activations take half the memory; editor maths stays f32".into());
    }
    if !cfg.recompute {
        out.push("recompute the edited forwards in the backward (`recompute`=true): keeps one block's activations instead of every edited block's".into());
    }
    if cfg.max_length > 64 {
        out.push(format!("lower max_length in the config (now {}): activations and logits grow with it", cfg.max_length));
    }
    if cfg.batch_size > 1 {
        out.push(format!("use batch_size 1 with accumulate {} (same effective batch)", cfg.batch_size * cfg.accumulate));
    }
    if cfg.rank > 256 {
        out.push(format!("a smaller editor rank (now {}): the editor, its gradients and Adam state shrink with it", cfg.rank));
    }
    out.push("set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True when reserved is much larger than allocated (fragmentation)".into());
    out
}
