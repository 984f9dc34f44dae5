//! Flags several commands share that are not a library option type: the edit method as
//! the CLI defaults it (`MethodArgs`, filling `edit::MethodOptions`), the choices of
//! `--method`, `--dtype` and `--ds`, and the parser of an image size. (The run, device,
//! guard and group options are the library's `run::options` types, flattened.)
use std::path::PathBuf;

use clap::builder::PossibleValue;
use clap::{Args, ValueEnum};

use crate::config::MendConfig;
use crate::data::DatasetKind;
use crate::edit::{MethodName, MethodOptions, MethodSpec, DEFAULT_FT_LR};
use crate::model::Dtype;

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

