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
    #[arg(long)]
    pub text: PathBuf,
    /// Stop after this many tokens (MEMIT samples 100,000 Wikipedia texts).
    #[arg(long, default_value_t = 1_000_000, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..))]
    pub max_tokens: usize,
    #[command(flatten)]
    pub devices: DeviceRequest,
    /// Print exactly one JSON object on stdout.
    #[arg(long)]
    pub json: bool,
}
