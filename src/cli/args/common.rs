//! Flags several commands share: the model and run settings (`CommonArgs`), the edit
//! method (`MethodArgs`), the commit guard (`GuardArgs`), and the parsers of a dataset
//! name and an image size.
use std::path::PathBuf;

use clap::builder::{PossibleValue, TypedValueParser};
use clap::{Args, ValueEnum};

use super::DeviceArgs;
use crate::config::MendConfig;
use crate::data::examples::OverLong;
use crate::data::DatasetKind;
use crate::edit::{MethodName, MethodOptions, MethodSpec, DEFAULT_FT_LR};
use crate::model::{model_dtype, Dtype};
use crate::planner::{Phase, PlaceFor};
use crate::run::Common;

/// Model and placement flags shared by train, edit and eval.
#[derive(Args, Clone)]
pub struct CommonArgs {
    /// Hugging Face model directory.
    #[arg(long)]
    pub model: PathBuf,
    #[command(flatten)]
    pub devices: DeviceArgs,
    /// f32, bf16 or f16 for the model weights (editor maths is always f32). Default: what
    /// the checkpoint's config.json says its weights are (`dtype`), else f32, as `plan`.
    #[arg(long, value_enum)]
    pub dtype: Option<Dtype>,
    #[arg(long, default_value_t = 0)]
    pub seed: i64,
    /// Where to write the run report (JSON).
    #[arg(long)]
    pub report: Option<PathBuf>,
    /// Cut the prompts of records longer than the maximum length from the left until they
    /// fit, instead of skipping those records.
    #[arg(long, conflicts_with = "strict")]
    pub truncate: bool,
    /// Stop at the first record longer than the maximum length (or, with --ds vqa|caption,
    /// whose image is missing or unreadable), instead of skipping it.
    #[arg(long)]
    pub strict: bool,
    /// --ds vqa|caption: the folder `image` and `m_loc` are relative to (COCO).
    #[arg(long)]
    pub image_root: Option<PathBuf>,
    /// --ds vqa|caption: the folder `image_rephrase` is relative to (default: --image-root).
    #[arg(long, requires = "image_root")]
    pub rephrase_image_root: Option<PathBuf>,
}

impl CommonArgs {
    /// `config`, `tokens` and `phase`: what the placement is planned for.
    pub fn resolve(&self, config: &MendConfig, tokens: usize, phase: Phase) -> anyhow::Result<Common> {
        let dtype = run_dtype(&self.model, self.dtype)?;
        let place = PlaceFor { model: &self.model, config, dtype, tokens: tokens as i64, phase };
        Ok(Common {
            model: self.model.clone(),
            plan: self.devices.placed(&place)?,
            dtype,
            seed: self.seed,
            report: self.report.clone(),
            over_long: match (self.truncate, self.strict) {
                (true, _) => OverLong::Truncate,
                (_, true) => OverLong::Strict,
                _ => OverLong::Skip,
            },
            image_roots: self.image_root.clone().map(|r| crate::data::multimodal::ImageRoots::new(r, self.rephrase_image_root.clone())),
        })
    }
}

/// The weights' dtype of a run ([`model_dtype`], the rule `plan` uses), logged with where
/// it came from so a bf16 checkpoint run in bf16 (or forced to f32) is never a surprise.
pub fn run_dtype(model: &std::path::Path, flag: Option<Dtype>) -> anyhow::Result<tch::Kind> {
    let (kind, source) = model_dtype(model, flag)?;
    tracing::info!("weights in {} ({})", crate::model::loader::dtype_name(kind), source.describe());
    Ok(kind)
}

/// `--method`: the library's [`MethodName`], its choices listed by `--help`.
impl ValueEnum for MethodName {
    fn value_variants<'a>() -> &'a [Self] {
        &MethodName::ALL
    }

    fn to_possible_value(&self) -> Option<PossibleValue> {
        let value = PossibleValue::new(self.as_str()).aliases(self.aliases().iter().copied());
        Some(match self {
            MethodName::Auto => value.help(
                "One request: mend; several, or one after another: mend-ls with the editor for many edits the editor's editor.json names (or the editor itself, with its key statistics)",
            ),
            MethodName::MendLs => value.help("MEND's per-edit updates combined by least squares over their keys (MALMEN-style)"),
            _ => value,
        })
    }
}

#[derive(Args)]
pub struct MethodArgs {
    /// Trained editor directory (for --method auto, mend, mend-ls).
    #[arg(long)]
    pub editor: Option<PathBuf>,
    #[arg(long, value_enum, default_value = crate::edit::DEFAULT_METHOD)]
    pub method: MethodName,
    /// --method mend-ls: ridge weight of the least-squares solve, relative to the mean
    /// squared norm of the edits' keys (default: the editor's `ls` settings in its
    /// editor.json, else 0.01).
    #[arg(long)]
    pub ls_lambda: Option<f64>,
    /// --method mend-ls: a text file whose lines' keys (layer inputs) the solve keeps,
    /// MEMIT-style (the edit should not change what the edited layers do there).
    #[arg(long, value_name = "FILE")]
    pub ls_keep_text: Option<PathBuf>,
    /// --method mend-ls: the weight of each kept key against each edit key (default: the
    /// editor's, else 0.01).
    #[arg(long)]
    pub ls_keep_weight: Option<f64>,
    /// --method mend-ls: re-solve rounds that push the edits whose prompts do not yet
    /// answer their targets (default: the editor's, else 0; data/editor-many: 4).
    #[arg(long)]
    pub ls_rounds: Option<usize>,
    /// Step size of the fine-tuning baseline (--method ft).
    #[arg(long, default_value_t = DEFAULT_FT_LR)]
    pub ft_lr: f64,
    /// Maximum tokens of any prompt + answer.
    #[arg(long, default_value_t = 512)]
    pub max_length: usize,
}

impl MethodArgs {
    /// The library's option type these flags fill.
    pub fn options(&self) -> MethodOptions {
        MethodOptions {
            method: Some(self.method),
            editor: self.editor.clone(),
            ft_lr: self.ft_lr,
            ls_lambda: self.ls_lambda,
            ls_keep_weight: self.ls_keep_weight,
            ls_rounds: self.ls_rounds,
            ls_keep_text: self.ls_keep_text.clone(),
        }
    }

    /// The MEND config the placement is planned with ([`MethodOptions::planning_config`]).
    pub fn planning_config(&self) -> anyhow::Result<MendConfig> {
        Ok(self.options().planning_config()?)
    }

    /// The method the flags ask for, checked once by [`MethodOptions::resolve`]. `many`:
    /// the run edits several requests or one after another.
    pub fn resolve(&self, many: bool) -> anyhow::Result<MethodSpec> {
        Ok(self.options().resolve(many)?)
    }
}

/// The commit guard and stepwise flags of `edit` and of `eval --edits-per-batch / --sequential`.
#[derive(Args)]
pub struct GuardArgs {
    #[command(flatten)]
    pub flags: GuardFlags,
    /// With --sequential: make each request in up to 8 committed steps of a centred,
    /// clipped, capped edit at 1/4 scale (experimental; see src/mend/stepwise.rs).
    #[arg(long, requires = "sequential")]
    pub stepwise: bool,
}

/// The commit guard's flags, shared by `edit`, `eval` and `serve` (same defaults).
#[derive(Args)]
pub struct GuardFlags {
    /// Commit every edit as the editor makes it: no guard on the locality prompts.
    #[arg(long, conflicts_with_all = ["guard_min_agreement", "guard_max_drop", "guard_max_kl", "guard_refuse", "guard_shrink"])]
    pub no_guard: bool,
    /// Guard: the least top-1 agreement of the locality prompts with the unedited model
    /// (0 to 1; default 0.9).
    #[arg(long)]
    pub guard_min_agreement: Option<f64>,
    /// Guard: the most one edit may lower that agreement (0 to 1; default 0.05).
    #[arg(long)]
    pub guard_max_drop: Option<f64>,
    /// Guard: the largest KL(unedited || edited) per locality position, in nats (>= 0;
    /// default 1).
    #[arg(long)]
    pub guard_max_kl: Option<f64>,
    /// Guard: refuse an edit that fails instead of scaling it back.
    #[arg(long, conflicts_with = "no_guard")]
    pub guard_refuse: bool,
    /// Guard: shrink each edit to the smallest scale (1, 1/2, 1/4, ...) that still makes it.
    #[arg(long, conflicts_with = "no_guard")]
    pub guard_shrink: bool,
}

impl GuardFlags {
    /// Whether any guard setting was given (eval uses them only with a capacity mode).
    pub fn given(&self) -> bool {
        self.no_guard || self.guard_refuse || self.guard_shrink || self.guard_min_agreement.is_some() || self.guard_max_drop.is_some() || self.guard_max_kl.is_some()
    }

    /// The guard (`None` with --no-guard), its thresholds checked before anything loads.
    pub fn config(&self) -> anyhow::Result<Option<crate::mend::guard::GuardConfig>> {
        if self.no_guard {
            return Ok(None);
        }
        let d = crate::mend::guard::GuardConfig::default();
        let c = crate::mend::guard::GuardConfig {
            min_agreement: self.guard_min_agreement.unwrap_or(d.min_agreement),
            max_drop: self.guard_max_drop.unwrap_or(d.max_drop),
            max_kl: self.guard_max_kl.unwrap_or(d.max_kl),
            scale_back: !self.guard_refuse,
            shrink: self.guard_shrink,
            ..d
        };
        c.validate()?;
        Ok(Some(c))
    }
}

impl GuardArgs {
    pub fn config(&self) -> anyhow::Result<Option<crate::mend::guard::GuardConfig>> {
        self.flags.config()
    }

    pub fn stepwise(&self) -> Option<crate::mend::stepwise::Stepwise> {
        self.stepwise.then(crate::mend::stepwise::Stepwise::default)
    }
}

/// `--dtype`: the library's [`Dtype`], its choices (and the long spellings as aliases)
/// listed by `--help`.
impl ValueEnum for Dtype {
    fn value_variants<'a>() -> &'a [Self] {
        &Dtype::ALL
    }

    fn to_possible_value(&self) -> Option<PossibleValue> {
        Some(match self {
            Dtype::F32 => PossibleValue::new("f32").aliases(["float32", "fp32"]),
            Dtype::Bf16 => PossibleValue::new("bf16").alias("bfloat16"),
            Dtype::F16 => PossibleValue::new("f16").aliases(["float16", "fp16"]),
        })
    }
}

/// `--ds` of `edit`: every [`DatasetKind`], listed by `--help`.
impl ValueEnum for DatasetKind {
    fn value_variants<'a>() -> &'a [Self] {
        &DatasetKind::ALL
    }

    fn to_possible_value(&self) -> Option<PossibleValue> {
        Some(PossibleValue::new(self.as_str()))
    }
}

/// `--ds` of the commands that read a dataset (not edit requests): zsre, counterfact, vqa
/// or caption, listed by `--help`.
pub fn dataset() -> impl TypedValueParser<Value = DatasetKind> {
    let names: Vec<&'static str> = DatasetKind::ALL.iter().filter(|k| **k != DatasetKind::Requests).map(|k| k.as_str()).collect();
    clap::builder::PossibleValuesParser::new(names).try_map(|s| s.parse::<DatasetKind>())
}

/// `448x448` (or `448×448`) to `(width, height)`.
pub fn parse_image_size(s: &str) -> Result<(i64, i64), String> {
    let bad = || format!("{s:?} is not an image size WIDTHxHEIGHT (e.g. 448x448)");
    let (w, h) = s.split_once(['x', 'X', '×']).ok_or_else(bad)?;
    let (w, h) = (w.trim().parse::<i64>().map_err(|_| bad())?, h.trim().parse::<i64>().map_err(|_| bad())?);
    if w < 1 || h < 1 {
        return Err(bad());
    }
    Ok((w, h))
}
