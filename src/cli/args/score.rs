use std::path::PathBuf;

use clap::Args;

use crate::device::DeviceRequest;

#[derive(Args)]
pub struct ScoreArgs {
    /// Hugging Face model directory (config.json, *.safetensors, tokenizer.json).
    #[arg(long)]
    pub model: PathBuf,
    /// Text to score.
    #[arg(long)]
    pub text: String,
    /// An image (PNG or JPEG) shown before the text; vision-language models only.
    #[arg(long)]
    pub image: Option<PathBuf>,
    #[command(flatten)]
    pub devices: DeviceRequest,
    /// f32, bf16 or f16. Default: the checkpoint's config.json `dtype`, else f32.
    #[arg(long, value_enum)]
    pub dtype: Option<crate::model::Dtype>,
    /// Print exactly one JSON object on stdout.
    #[arg(long)]
    pub json: bool,
}
