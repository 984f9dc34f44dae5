use std::path::PathBuf;

use clap::Args;

use super::MethodArgs;
use crate::run::options::{GroupOptions, GuardOptions, RunOptions};

#[derive(Args)]
pub struct EvalArgs {
    #[command(flatten)]
    pub common: RunOptions,
    #[command(flatten)]
    pub method: MethodArgs,
    /// EasyEdit-format dataset.
    #[arg(long)]
    pub data: PathBuf,
    /// The format of --data (vqa, caption: E-VQA / E-IC, with --image-root).
    #[arg(long, value_parser = super::dataset())]
    pub ds: crate::data::easyedit::DatasetKind,
    /// Evaluate only the first N records.
    #[arg(long, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..))]
    pub limit: Option<usize>,
    /// Print exactly one JSON object on stdout.
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub groups: GroupOptions,
    #[command(flatten)]
    pub guard: GuardOptions,
}
