use std::path::PathBuf;

use clap::Args;

use super::MethodArgs;
use crate::run::options::{GuardOptions, RunOptions};

#[derive(Args)]
pub struct EditArgs {
    #[command(flatten)]
    pub common: RunOptions,
    #[command(flatten)]
    pub method: MethodArgs,
    /// EasyEdit-style request records (prompt, target_new, optional rephrase_prompt, locality_*,
    /// portability), or with --ds the records of that dataset (vqa|caption: E-VQA / E-IC, with --image-root).
    #[arg(long)]
    pub requests: PathBuf,
    /// The format of --requests (vqa, caption: E-VQA / E-IC, with --image-root).
    #[arg(long, value_enum, default_value_t = crate::data::easyedit::DatasetKind::Requests)]
    pub ds: crate::data::easyedit::DatasetKind,
    /// Apply the requests one after another instead of as one batch.
    #[arg(long)]
    pub sequential: bool,
    /// Write the edited model as a Hugging Face directory.
    #[arg(long)]
    pub save: Option<PathBuf>,
    /// Print exactly one JSON object on stdout.
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub guard: GuardOptions,
    /// With --sequential: make each request in up to 8 committed steps of a centred,
    /// clipped, capped edit at 1/4 scale (experimental; see src/mend/stepwise.rs).
    #[arg(long, requires = "sequential")]
    pub stepwise: bool,
}
