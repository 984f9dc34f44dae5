use std::path::PathBuf;

use clap::Args;

use crate::device::DeviceRequest;

#[derive(Args)]
pub struct StatsArgs {
    /// Hugging Face model directory (the unedited model the editor was trained for).
    #[arg(long)]
    pub model: PathBuf,
    /// Trained editor directory: the statistics are of the weights it edits, written into
    /// it (key-stats.safetensors, named in its editor.json as key_stats).
    #[arg(long)]
    pub editor: PathBuf,
    /// Text file, one text a line (the embedded default: data/world/corpus.txt; for your
    /// model: any text like what it was trained on, e.g. a Wikipedia sample).
    #[arg(long, required_unless_present = "data", conflicts_with = "data")]
    pub text: Option<PathBuf>,
    /// Instead of --text, an EasyEdit data file whose records' locality views are summed:
    /// the unrelated prompt and, with --ds vqa|caption, the unrelated image and question
    /// (m_loc): a vision-language model's statistics need its images' tokens.
    #[arg(long, requires = "ds")]
    pub data: Option<PathBuf>,
    /// The format of --data (vqa, caption: E-VQA / E-IC, with --image-root).
    #[arg(long, requires = "data", value_parser = super::dataset())]
    pub ds: Option<crate::data::easyedit::DatasetKind>,
    /// --ds vqa|caption: the folder `image` and `m_loc` are relative to.
    #[arg(long, requires = "data")]
    pub image_root: Option<PathBuf>,
    /// --ds vqa|caption: the folder `image_rephrase` is relative to (default: --image-root).
    #[arg(long, requires = "image_root")]
    pub rephrase_image_root: Option<PathBuf>,
    /// Stop after this many tokens (MEMIT samples 100,000 Wikipedia texts).
    #[arg(long, default_value_t = 1_000_000, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..))]
    pub max_tokens: usize,
    #[command(flatten)]
    pub devices: DeviceRequest,
    /// Print exactly one JSON object on stdout.
    #[arg(long)]
    pub json: bool,
}
