//! MEND hyper-parameters, read from JSON presets in `configs/`.
//!
//! Defaults follow EasyEdit's `hparams/TRAINING/MEND/*.yaml`.
use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::{Error, Result};

/// How the editor transforms the gradient factors `(x, δ)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum EditorMode {
    /// One MLP over `cat(x, δ)`, split back into `(x̃, δ̃)` (MEND's default).
    Combine,
    /// Transform `x` only.
    XOnly,
    /// Transform `δ` only.
    DeltaOnly,
    /// Transform whichever factor is narrower.
    OneSided,
    /// Two MLPs, one per factor.
    Separate,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct MendConfig {
    /// Names of the edited weights; empty: the MLP weights of the last 3 blocks.
    pub edit_params: Vec<String>,
    /// Rank of the editor's low-rank layers (capped by the layer width).
    pub rank: i64,
    /// Hidden layers of the editor MLP (it has `n_hidden + 1` layers).
    pub n_hidden: i64,
    pub mode: EditorMode,
    /// One editor per weight shape (true) or per weight (false).
    pub shared: bool,
    /// Normalise `x` and `δ` with running statistics.
    pub norm: bool,
    /// `W' = W − lr·∇̃W` (true) or MEND reference code's `W' = W + lr·∇̃W` (false).
    pub descent: bool,
    pub c_edit: f64,
    pub c_loc: f64,
    /// Score the edit target after the edit prompt itself too, not only after its
    /// rephrase (EasyEdit scores the rephrase only). On CounterFact the locality prompts
    /// share the edit prompt's template, so a locality-weighted editor trained on the
    /// rephrase alone learns to leave the edit prompt unchanged as well.
    pub inner_in_edit_loss: bool,
    /// Adam learning rate of the editor network.
    pub lr: f64,
    /// Initial per-layer edit learning rate.
    pub edit_lr: f64,
    /// Adam learning rate of the per-layer edit learning rates.
    pub lr_lr: f64,
    pub batch_size: usize,
    /// Micro-batches per optimiser step.
    pub accumulate: usize,
    pub grad_clip: f64,
    /// Optimiser steps (each of `accumulate` micro-batches).
    pub max_steps: usize,
    /// Validate every this many optimiser steps.
    pub val_every: usize,
    /// Records held out of the training file for validation.
    pub val_records: usize,
    /// Stop after this many validations without improvement.
    pub early_stop_patience: usize,
    /// Consecutive non-finite steps after which training stops.
    pub max_bad_steps: usize,
    /// Tokens beyond which an example is refused.
    pub max_length: usize,
    /// Keep only each block's input during the edited forwards (outer, locality) and
    /// recompute the blocks one at a time in the backward: activation memory of one block
    /// instead of all edited ones, for one more forward of those blocks.
    pub recompute: bool,
}

impl Default for MendConfig {
    fn default() -> Self {
        Self {
            edit_params: Vec::new(),
            rank: 1920,
            n_hidden: 1,
            mode: EditorMode::Combine,
            shared: true,
            norm: true,
            descent: true,
            c_edit: 0.1,
            c_loc: 1.0,
            inner_in_edit_loss: false,
            lr: 1e-6,
            edit_lr: 1e-4,
            lr_lr: 1e-4,
            batch_size: 1,
            accumulate: 10,
            grad_clip: 100.0,
            max_steps: 10_000,
            val_every: 500,
            val_records: 100,
            early_stop_patience: 5,
            max_bad_steps: 20,
            max_length: 128,
            recompute: false,
        }
    }
}

impl MendConfig {
    pub fn from_file(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
        let cfg: MendConfig =
            serde_json::from_str(&text).map_err(|e| Error::file(path, format!("invalid MEND config: {e}")))?;
        cfg.validate().map_err(|e| Error::file(path, e.to_string()))?;
        Ok(cfg)
    }

    /// Rejects values that cannot work, before anything is loaded.
    pub fn validate(&self) -> Result<()> {
        let fail = |m: &str| Err(Error::input(m.to_string()));
        if self.rank < 1 {
            return fail("rank must be at least 1");
        }
        if self.n_hidden < 0 {
            return fail("n_hidden must be non-negative");
        }
        for (name, v) in [("lr", self.lr), ("edit_lr", self.edit_lr), ("lr_lr", self.lr_lr)] {
            if !(v.is_finite() && v >= 0.0) {
                return Err(Error::input(format!("{name} must be a non-negative number, got {v}")));
            }
        }
        for (name, v) in [("c_edit", self.c_edit), ("c_loc", self.c_loc), ("grad_clip", self.grad_clip)] {
            if !(v.is_finite() && v >= 0.0) {
                return Err(Error::input(format!("{name} must be a non-negative number, got {v}")));
            }
        }
        if self.batch_size == 0 || self.accumulate == 0 {
            return fail("batch_size and accumulate must be at least 1");
        }
        if self.val_every == 0 || self.max_bad_steps == 0 || self.max_length < 2 {
            return fail("val_every and max_bad_steps must be at least 1, max_length at least 2");
        }
        Ok(())
    }
}
