//! The options of a run, one type each for every interface: the CLI flattens them into
//! flags (`--model`, `--device`, `--edits-per-batch`, ...), the Python package takes their
//! fields as keyword arguments, JSON as keys. Each is checked once, here, and its errors
//! name its fields (`edits_per_batch`, the flag `--edits-per-batch`, the keyword
//! `edits_per_batch=`).
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::{CapacityOptions, Common};
use crate::config::MendConfig;
use crate::data::examples::OverLong;
use crate::data::multimodal::ImageRoots;
use crate::device::DeviceRequest;
use crate::edit::capacity::Grouping;
use crate::edit::LoadOptions;
use crate::mend::guard::GuardConfig;
use crate::model::Dtype;
use crate::planner::{Phase, PlaceFor};
use crate::{Error, Result};

/// What every run is given: the model, its devices, the weights' dtype, the seed, where
/// the report goes, and how over-long records and images are read.
#[derive(Debug, Clone, Serialize, Deserialize, clap::Args)]
pub struct RunOptions {
    /// Hugging Face model directory.
    #[arg(long)]
    pub model: PathBuf,
    #[command(flatten)]
    #[serde(flatten)]
    pub devices: DeviceRequest,
    /// f32, bf16 or f16 for the model weights (editor maths is always f32). Default: what
    /// the checkpoint's config.json says its weights are (`dtype`), else f32, as `plan`.
    #[arg(long, value_enum)]
    #[serde(default)]
    pub dtype: Option<Dtype>,
    #[arg(long, default_value_t = 0)]
    #[serde(default)]
    pub seed: i64,
    /// Where to write the run report (JSON).
    #[arg(long)]
    #[serde(default)]
    pub report: Option<PathBuf>,
    /// Cut the prompts of records longer than the maximum length from the left until they
    /// fit, instead of skipping those records.
    #[arg(long, conflicts_with = "strict")]
    #[serde(default)]
    pub truncate: bool,
    /// Stop at the first record longer than the maximum length (or, with --ds vqa|caption,
    /// whose image is missing or unreadable), instead of skipping it.
    #[arg(long)]
    #[serde(default)]
    pub strict: bool,
    /// --ds vqa|caption: the folder `image` and `m_loc` are relative to (COCO).
    #[arg(long)]
    #[serde(default)]
    pub image_root: Option<PathBuf>,
    /// --ds vqa|caption: the folder `image_rephrase` is relative to (default: --image-root).
    #[arg(long, requires = "image_root")]
    #[serde(default)]
    pub rephrase_image_root: Option<PathBuf>,
}

impl RunOptions {
    /// Its fields (the flags' ids, which clap derives from the field names), the device
    /// request's included: what a reader of keyword arguments checks unknown keys against
    /// (serde's `flatten` cannot tell which keys a struct with a flattened part of its own
    /// took).
    pub fn fields() -> Vec<String> {
        let cmd = <Self as clap::Args>::augment_args(clap::Command::new("fields"));
        cmd.get_arguments().map(|a| a.get_id().to_string()).collect()
    }

    /// What to do with records longer than the maximum length.
    fn over_long(&self) -> Result<OverLong> {
        match (self.truncate, self.strict) {
            (true, true) => Err(Error::input("`truncate` and `strict` exclude each other")),
            (true, _) => Ok(OverLong::Truncate),
            (_, true) => Ok(OverLong::Strict),
            _ => Ok(OverLong::Skip),
        }
    }

    /// The run's settings with its placement resolved by the planner for `config`,
    /// `tokens` and `phase` ([`load_options`]).
    pub fn resolve(&self, config: &MendConfig, tokens: usize, phase: Phase) -> Result<Common> {
        if self.rephrase_image_root.is_some() && self.image_root.is_none() {
            return Err(Error::input("`rephrase_image_root` needs `image_root`"));
        }
        let over_long = self.over_long()?;
        let load = load_options(&self.model, &self.devices, self.dtype, config, tokens, phase)?;
        Ok(Common {
            model: self.model.clone(),
            plan: load.plan,
            dtype: load.dtype,
            seed: self.seed,
            report: self.report.clone(),
            over_long,
            image_roots: self.image_root.clone().map(|r| ImageRoots::new(r, self.rephrase_image_root.clone())),
        })
    }
}

/// The weights' dtype of a run on `model`: `dtype`, else what the checkpoint's config.json
/// says (the rule `plan` uses, [`crate::model::model_dtype`]), logged with where it came
/// from.
pub fn weights_dtype(model: &Path, dtype: Option<Dtype>) -> Result<tch::Kind> {
    let (kind, source) = crate::model::model_dtype(model, dtype)?;
    tracing::debug!("weights in {} ({})", crate::model::loader::dtype_name(kind), source.describe());
    Ok(kind)
}

/// What a run or a session loads `model` with: the weights' dtype (`dtype`, else what the
/// checkpoint says, else f32) and `devices` with the placement the planner resolves for
/// `config`, `tokens` and `phase` (`placement: auto` against `max_memory`). Both are
/// logged with where they came from.
pub fn load_options(model: &Path, devices: &DeviceRequest, dtype: Option<Dtype>, config: &MendConfig, tokens: usize, phase: Phase) -> Result<LoadOptions> {
    let dtype = weights_dtype(model, dtype)?;
    let place = PlaceFor { model, config, dtype, tokens: tokens as i64, phase };
    let (plan, chosen) = crate::planner::place(devices, &place)?;
    if let Some(label) = chosen {
        tracing::info!("placement: {label} (chosen by the planner)");
    }
    Ok(LoadOptions { plan, dtype })
}

/// The commit guard on the locality prompts of `edit`, `eval`'s groups and `serve`
/// (same defaults everywhere: [`GuardConfig::default`]).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, clap::Args)]
#[serde(default)]
pub struct GuardOptions {
    /// Commit every edit as the editor makes it: no guard on the locality prompts.
    #[arg(
        long = "no-guard",
        action = clap::ArgAction::SetFalse,
        conflicts_with_all = ["guard_min_agreement", "guard_max_drop", "guard_max_kl", "guard_refuse", "guard_shrink"]
    )]
    pub guard: bool,
    /// Guard: the least top-1 agreement of the locality prompts with the unedited model
    /// (0 to 1; default 0.9).
    #[arg(long)]
    pub guard_min_agreement: Option<f64>,
    /// Guard: the most one edit may lower that agreement, a batch of n edits n times it (0 to 1; default 0.05).
    #[arg(long)]
    pub guard_max_drop: Option<f64>,
    /// Guard: the largest KL(unedited || edited) per locality position, in nats (>= 0;
    /// default 1).
    #[arg(long)]
    pub guard_max_kl: Option<f64>,
    /// Guard: refuse an edit that fails instead of scaling it back.
    #[arg(long)]
    pub guard_refuse: bool,
    /// Guard: shrink each edit to the smallest scale (1, 1/2, 1/4, ...) that still makes it.
    #[arg(long)]
    pub guard_shrink: bool,
}

impl Default for GuardOptions {
    fn default() -> Self {
        Self { guard: true, guard_min_agreement: None, guard_max_drop: None, guard_max_kl: None, guard_refuse: false, guard_shrink: false }
    }
}

impl GuardOptions {
    /// Whether any setting differs from the default.
    pub fn given(&self) -> bool {
        *self != Self::default()
    }

    /// The guard (`None` with `guard: false`), its thresholds checked before anything
    /// loads; a threshold given with the guard off is refused.
    pub fn config(&self) -> Result<Option<GuardConfig>> {
        if !self.guard {
            if *self != (Self { guard: false, ..Self::default() }) {
                return Err(Error::input(
                    "with the guard off, `guard_min_agreement`, `guard_max_drop`, `guard_max_kl`, `guard_refuse` and `guard_shrink` would not be used",
                ));
            }
            return Ok(None);
        }
        let d = GuardConfig::default();
        let c = GuardConfig {
            min_agreement: self.guard_min_agreement.unwrap_or(d.min_agreement),
            max_drop: self.guard_max_drop.unwrap_or(d.max_drop),
            max_kl: self.guard_max_kl.unwrap_or(d.max_kl),
            scale_back: !self.guard_refuse,
            shrink: self.guard_shrink,
            ..d
        };
        c.validate_named(|key| format!("`guard_{key}`"))?;
        Ok(Some(c))
    }
}

/// `eval`'s capacity measurement: the records edited in groups, each group in one batch
/// or one after another, and measured after the group's last edit.
#[derive(Debug, Clone, Default, Serialize, Deserialize, clap::Args)]
#[serde(default)]
pub struct GroupOptions {
    /// Capacity: edit the records in groups of N, each group in one batch edit from the
    /// unedited model, and measure all N after it.
    #[arg(long, value_name = "N", conflicts_with = "sequential", value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..))]
    pub edits_per_batch: Option<usize>,
    /// Capacity: edit the records in groups of N, one after another (each committed, the
    /// guard as configured), and measure all N after the group's last edit.
    #[arg(long, value_name = "N", value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..))]
    pub sequential: Option<usize>,
    /// Capacity: a text file whose lines are the unrelated texts whose NLL drift is
    /// reported (lines naming an edited subject are skipped; default: the locality prompts).
    #[arg(long, value_name = "FILE")]
    pub drift_text: Option<PathBuf>,
    /// In sequential groups: make each request in up to 8 committed steps of a centred,
    /// clipped, capped edit at 1/4 scale (experimental; see src/mend/stepwise.rs).
    #[arg(long, requires = "sequential")]
    pub stepwise: bool,
}

impl GroupOptions {
    /// The capacity measurement these options ask for with `guard` (`None`: each record
    /// edited alone, where the guard, the drift text and stepwise edits have no use).
    pub fn capacity(&self, guard: &GuardOptions) -> Result<Option<CapacityOptions>> {
        let grouping = match (self.edits_per_batch, self.sequential) {
            (Some(0), _) | (_, Some(0)) => return Err(Error::input("`edits_per_batch` and `sequential` must be at least 1")),
            (Some(_), Some(_)) => return Err(Error::input("`edits_per_batch` and `sequential` exclude each other")),
            (Some(n), None) => Grouping::Batch(n),
            (None, Some(n)) => Grouping::Sequential(n),
            (None, None) => {
                if self.drift_text.is_some() || self.stepwise || guard.given() {
                    return Err(Error::input(
                        "`drift_text`, `stepwise` and the guard's settings are only used with `edits_per_batch` or `sequential`",
                    ));
                }
                return Ok(None);
            }
        };
        if self.stepwise && self.sequential.is_none() {
            return Err(Error::input("`stepwise` needs `sequential`"));
        }
        Ok(Some(CapacityOptions {
            grouping,
            guard: guard.config()?,
            stepwise: self.stepwise.then(crate::mend::stepwise::Stepwise::default),
            drift_text: self.drift_text.clone(),
        }))
    }
}
