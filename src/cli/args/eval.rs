use std::path::PathBuf;

use clap::Args;

use super::{CommonArgs, GuardArgs, MethodArgs};

#[derive(Args)]
pub struct EvalArgs {
    #[command(flatten)]
    pub common: CommonArgs,
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
    #[command(flatten)]
    pub guard: GuardArgs,
}
