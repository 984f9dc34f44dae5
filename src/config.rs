//! MEND hyper-parameters, read from JSON presets in `configs/` (or EasyEdit's hparams YAMLs,
//! [`easyedit`]).
//!
//! Defaults follow EasyEdit's `hparams/TRAINING/MEND/*.yaml`.
use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::{Error, Result};

pub mod easyedit;

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

/// How the Adam learning rates (`lr`, `lr_lr`) change over the run.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LrSchedule {
    /// The configured rates throughout (EasyEdit).
    #[default]
    Constant,
    /// Cosine decay from the configured rates to a tenth of them at `max_steps`. With
    /// single-edit micro-batches the editor keeps swinging between stronger and more local
    /// edits at a constant rate; decaying it lets the last validations settle.
    Cosine,
}

impl LrSchedule {
    /// Factor on the configured rates at optimiser step `step` of `max_steps`.
    pub fn factor(self, step: usize, max_steps: usize) -> f64 {
        match self {
            LrSchedule::Constant => 1.0,
            LrSchedule::Cosine => {
                let progress = (step as f64 / max_steps.max(1) as f64).min(1.0);
                0.1 + 0.9 * 0.5 * (1.0 + (std::f64::consts::PI * progress).cos())
            }
        }
    }
}

/// What picks the saved editor among the validations (and drives early stopping).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SelectBy {
    /// The lowest validation loss `c_edit·NLL + c_loc·KL` (EasyEdit's choice).
    #[default]
    Loss,
    /// The highest edit accuracy plus locality accuracy: the metrics `eval` reports. The
    /// loss's KL is dominated by the few neighbours whose answer flips with confidence, so
    /// on small validation sets it ranks checkpoints by noise more than by those metrics.
    Accuracy,
}

/// How meta-training turns a batch's edits into the one change it scores (issue #36).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Aggregate {
    /// The edits' updates summed (MEND's batched setting; `batch_size` edits).
    #[default]
    Sum,
    /// The least-squares solve `--method mend-ls` makes at edit time (MALMEN, Tan et al.
    /// 2024): `S = (KᵀK + μ·C + λ·I)⁻¹ KᵀV` over the batch's keys `K` and the editor's value
    /// shifts `V`, with `λ`, `μ` from [`MendConfig::ls`] and `C` the key statistics of
    /// [`MendConfig::key_stats_text`]; the losses are differentiated through the solve, so
    /// the editor learns shifts that generalise after it ([`crate::mend::ls::aggregate`]).
    LeastSquares,
}

impl Aggregate {
    fn is_sum(&self) -> bool {
        *self == Aggregate::Sum
    }
}

/// The dtype of a MEND editor's `U`/`V` products for a model whose weights are `weights`,
/// the editor on the CPU (`on_cpu`) or an accelerator: bf16 for a bf16 model on a CPU (the
/// user asked for bf16; its gradient factors, the editor's inputs, are bf16 already, and a
/// CPU with avx512_bf16 runs bf16 GEMMs at ~3× the f32 rate: 0.70× the small Qwen2-VL
/// bench's bf16 step), else f32. On CUDA the products stay f32: the bf16 copies of `U` and
/// `V` the graph keeps for the backward would add ~0.7 GB to a 7B editor's main device,
/// which is what the layer split leaves there. f16 keeps f32 (its range is narrow). One
/// rule for the editor (`mend::Editor::products_for`) and the planner.
pub fn editor_product_kind(weights: tch::Kind, on_cpu: bool) -> tch::Kind {
    match weights {
        tch::Kind::BFloat16 if on_cpu => tch::Kind::BFloat16,
        _ => tch::Kind::Float,
    }
}

/// How `--method mend-ls` combines an editor's edits ([`crate::mend::ls`]): the settings
/// chosen by measurement for that editor, kept in its `editor.json` (`MendConfig::ls`) and
/// used unless the `--ls-*` flags say otherwise. The defaults are those measured with the
/// shipped `data/editor` (docs/notebook/many-edits.md, "Many edits, part 2").
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct LsConfig {
    /// `λ` of `λ·‖S‖²`, relative to the mean squared norm of the edits' keys (so it means
    /// the same whatever the layer's scale): `λ_abs = lambda · mean_t ‖k_t‖²`.
    pub lambda: f64,
    /// `μ`: the weight of each unrelated key `c_j` in `μ·Σ_j ‖c_j·S‖²` (keep what the
    /// weight does at unrelated text, as MEMIT keeps its key covariance), when unrelated
    /// text is given (`--ls-keep-text`).
    #[serde(rename = "keep_weight")]
    pub cov_weight: f64,
    /// Re-solve rounds: after a solve, the edits (remembered ones included) whose prompt
    /// does not yet answer its target are captured again at the solved weights, the
    /// editor's new shifts are added to their targets and the solve is repeated; a round
    /// that does not make more edits answer is dropped and ends the search. 0: one solve.
    pub rounds: usize,
}

impl Default for LsConfig {
    fn default() -> Self {
        Self { lambda: 1e-2, cov_weight: 1e-2, rounds: 0 }
    }
}

impl LsConfig {
    fn is_default(&self) -> bool {
        *self == Self::default()
    }

    /// Rejects settings the solve cannot use.
    pub fn validate(&self) -> Result<()> {
        if !(self.lambda.is_finite() && self.lambda > 0.0) {
            return Err(Error::input(format!("mend-ls lambda must be a positive number, got {}", self.lambda)));
        }
        if !(self.cov_weight.is_finite() && self.cov_weight >= 0.0) {
            return Err(Error::input(format!("mend-ls keep weight must be a non-negative number, got {}", self.cov_weight)));
        }
        if self.rounds > MAX_LS_ROUNDS {
            return Err(Error::input(format!("mend-ls rounds must be at most {MAX_LS_ROUNDS}, got {}", self.rounds)));
        }
        Ok(())
    }
}

/// More re-solve rounds than this only cost time: each must make more edits answer, and
/// on the embedded default the gain stops after 3 (docs/notebook/many-edits.md, part 3).
pub const MAX_LS_ROUNDS: usize = 20;

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
    /// Weight of the edit loss on the rephrase image (multimodal data only; EasyEdit's
    /// `iedit`): `c_edit·l_edit + c_loc·(l_loc + l_image_loc) + i_edit·l_image_edit`.
    pub i_edit: f64,
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
    pub lr_schedule: LrSchedule,
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
    /// Which validation figure picks the saved editor.
    pub select_by: SelectBy,
    /// Consecutive non-finite steps after which training stops.
    pub max_bad_steps: usize,
    /// Tokens beyond which an example is refused.
    pub max_length: usize,
    /// Keep only each block's input during the edited forwards (outer, locality) and
    /// recompute the blocks one at a time in the backward: activation memory of one block
    /// instead of all edited ones, for one more forward of those blocks.
    pub recompute: bool,
    /// How `--method mend-ls` combines this editor's edits unless flags say otherwise
    /// (written to `editor.json` only when it differs from the default, so editors saved
    /// before it existed keep their bytes).
    #[serde(skip_serializing_if = "LsConfig::is_default")]
    pub ls: LsConfig,
    /// How meta-training combines a batch's edits (written only when not `sum`).
    #[serde(skip_serializing_if = "Aggregate::is_sum")]
    pub aggregate: Aggregate,
    /// With `aggregate: least_squares`: the text (one line per text; relative to the
    /// working directory) whose key statistics `C` the training solve keeps, computed at
    /// the start of training and saved with the editor (`key-stats.safetensors`), so the
    /// edit-time solve uses the `C` the editor was trained with. Needed when
    /// `ls.keep_weight > 0` (training says so at its start); `build-default` sets it to the
    /// world's corpus.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub key_stats_text: Option<std::path::PathBuf>,
    /// Per training edit, up to this many more locality prompts: those of other training
    /// records whose locality answer is this record's (CounterFact's neighbours: another
    /// subject, the same relation and the old answer), in the same locality loss. The
    /// validation split keeps its own prompt only. 0 (the default, not written): each
    /// edit's own locality prompt. On SmolLM2 these hard negatives lifted both
    /// generalization and locality where more `c_loc` traded one for the other
    /// (docs/notebook/real-model.md, session 27).
    #[serde(skip_serializing_if = "is_zero")]
    pub loc_neighbours: usize,
}

fn is_zero(n: &usize) -> bool {
    *n == 0
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
            i_edit: 0.1,
            inner_in_edit_loss: false,
            lr: 1e-6,
            edit_lr: 1e-4,
            lr_lr: 1e-4,
            lr_schedule: LrSchedule::Constant,
            batch_size: 1,
            accumulate: 10,
            grad_clip: 100.0,
            max_steps: 10_000,
            val_every: 500,
            val_records: 100,
            early_stop_patience: 5,
            select_by: SelectBy::Loss,
            max_bad_steps: 20,
            max_length: 128,
            recompute: false,
            ls: LsConfig::default(),
            aggregate: Aggregate::Sum,
            key_stats_text: None,
            loc_neighbours: 0,
        }
    }
}

impl MendConfig {
    /// Reads `configs/*.json` (ours), or an EasyEdit MEND hparams YAML (`.yaml` / `.yml`,
    /// [`easyedit`]: its keys mapped, what it carries that is not a config logged).
    pub fn from_file(path: &Path) -> Result<Self> {
        let text = crate::io::read_text(path)?;
        if easyedit::is_yaml(path) {
            let r = easyedit::from_easyedit(&text).map_err(|e| Error::file(path, format!("EasyEdit hparams: {e}")))?;
            if !r.ignored.is_empty() {
                tracing::warn!("{}: EasyEdit keys not used here: {}", path.display(), r.ignored.join("; "));
            }
            return Ok(r.config);
        }
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
        for (name, v) in [("c_edit", self.c_edit), ("c_loc", self.c_loc), ("i_edit", self.i_edit), ("grad_clip", self.grad_clip)] {
            if !(v.is_finite() && v >= 0.0) {
                return Err(Error::input(format!("{name} must be a non-negative number, got {v}")));
            }
        }
        if self.batch_size == 0 || self.accumulate == 0 {
            return fail("batch_size and accumulate must be at least 1");
        }
        if self.max_steps == 0 || self.early_stop_patience == 0 {
            return fail("max_steps and early_stop_patience must be at least 1");
        }
        if self.val_every == 0 || self.max_bad_steps == 0 || self.max_length < 2 {
            return fail("val_every and max_bad_steps must be at least 1, max_length at least 2");
        }
        if self.loc_neighbours > MAX_LOC_NEIGHBOURS {
            return Err(Error::input(format!("loc_neighbours must be at most {MAX_LOC_NEIGHBOURS}, got {}", self.loc_neighbours)));
        }
        self.ls.validate()
    }
}

/// Each neighbour is one more row of every training edit's locality forward: more than
/// this only multiplies the step's cost.
pub const MAX_LOC_NEIGHBOURS: usize = 32;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cosine_schedule_runs_from_one_to_a_tenth() {
        let c = LrSchedule::Cosine;
        assert_eq!(c.factor(0, 100), 1.0);
        assert!((c.factor(50, 100) - 0.55).abs() < 1e-12);
        assert!((c.factor(100, 100) - 0.1).abs() < 1e-12);
        assert_eq!(LrSchedule::Constant.factor(70, 100), 1.0);
        let cfg: MendConfig = serde_json::from_str(r#"{"lr_schedule": "cosine", "select_by": "accuracy"}"#).unwrap();
        assert_eq!((cfg.lr_schedule, cfg.select_by), (LrSchedule::Cosine, SelectBy::Accuracy));
    }

    #[test]
    fn ls_settings_are_read_and_written_only_when_set() {
        let cfg: MendConfig = serde_json::from_str(r#"{"ls": {"lambda": 1e-6, "rounds": 3}}"#).unwrap();
        assert_eq!(cfg.ls, LsConfig { lambda: 1e-6, cov_weight: LsConfig::default().cov_weight, rounds: 3 });
        assert!(serde_json::to_string(&cfg).unwrap().contains(r#""ls":{"lambda":1e-6,"keep_weight":0.01,"rounds":3}"#));
        // An editor saved without them is written back without them (its bytes stay).
        assert!(!serde_json::to_string(&MendConfig::default()).unwrap().contains("\"ls\""));
        let bad: MendConfig = serde_json::from_str(r#"{"ls": {"lambda": 0}}"#).unwrap();
        assert!(bad.validate().unwrap_err().to_string().contains("lambda"));
        assert!(serde_json::from_str::<MendConfig>(r#"{"ls": {"lamda": 1}}"#).is_err());
    }

    #[test]
    fn loc_neighbours_are_written_only_when_set_and_bounded() {
        assert!(!serde_json::to_string(&MendConfig::default()).unwrap().contains("loc_neighbours"));
        let cfg: MendConfig = serde_json::from_str(r#"{"loc_neighbours": 4}"#).unwrap();
        assert!(serde_json::to_string(&cfg).unwrap().contains(r#""loc_neighbours":4"#));
        cfg.validate().unwrap();
        let e = MendConfig { loc_neighbours: MAX_LOC_NEIGHBOURS + 1, ..cfg }.validate().unwrap_err().to_string();
        assert!(e.contains("loc_neighbours"), "{e}");
    }

    /// Every preset users are pointed to parses and validates.
    #[test]
    fn every_preset_in_configs_loads() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("configs");
        let mut n = 0;
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if path.extension().is_some_and(|e| e == "json") {
                MendConfig::from_file(&path).unwrap_or_else(|e| panic!("{e}"));
                n += 1;
            }
        }
        assert!(n >= 6, "only {n} presets found in {}", dir.display());
    }
}
