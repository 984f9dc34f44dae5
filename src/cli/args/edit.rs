use std::path::PathBuf;

use clap::Args;

use super::{CommonArgs, GuardArgs, MethodArgs};

#[derive(Args)]
pub struct EditArgs {
    #[command(flatten)]
    pub common: CommonArgs,
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
    pub guard: GuardArgs,
}
