use std::path::PathBuf;

use clap::Args;

use crate::run::options::RunOptions;

#[derive(Args)]
pub struct TrainArgs {
    #[command(flatten)]
    pub common: RunOptions,
    /// EasyEdit-format training file.
    #[arg(long)]
    pub data: PathBuf,
    /// The format of --data (vqa, caption: E-VQA / E-IC, with --image-root).
    #[arg(long, value_parser = super::dataset())]
    pub ds: crate::data::easyedit::DatasetKind,
    /// MEND hyper-parameters: JSON (see configs/), or an EasyEdit MEND hparams YAML as it is
    /// (`dualedit config --from-easyedit` shows what it becomes).
    #[arg(long)]
    pub config: PathBuf,
    /// Directory for the editor checkpoint, training state and report.
    #[arg(long)]
    pub out: PathBuf,
    /// Stop after this many optimiser steps (each of the config's `accumulate` micro-batches),
    /// in place of the config's `max_steps`.
    #[arg(long)]
    pub max_steps: Option<usize>,
    /// Use only the first N records of the file.
    #[arg(long, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..))]
    pub limit: Option<usize>,
    /// Continue from the training state in --out.
    #[arg(long)]
    pub resume: bool,
    /// Start from the trained editor in this directory (its network, learned edit rates
    /// and statistics) instead of a fresh one, with a fresh optimiser and the --config's
    /// losses and schedule; the network's shape and edited weights must be the same.
    #[arg(long, value_name = "EDITOR_DIR", conflicts_with = "resume")]
    pub init: Option<PathBuf>,
    /// Recompute the edited forwards' blocks in the backward instead of keeping their
    /// activations (less memory, one more forward of the edited blocks; same losses).
    #[arg(long)]
    pub recompute: bool,
}
