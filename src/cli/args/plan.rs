use std::path::PathBuf;

use clap::Args;

use super::{parse_image_size, DeviceArgs};

#[derive(Args)]
pub struct PlanArgs {
    /// Model directory; only its config.json is read (no weights needed).
    #[arg(long)]
    pub model: PathBuf,
    /// MEND hyper-parameters (JSON, see configs/).
    #[arg(long)]
    pub config: PathBuf,
    /// The devices planned for (they need not exist on this machine).
    #[command(flatten)]
    pub devices: DeviceArgs,
    /// f32, bf16 or f16 for the model weights (editor maths is always f32).
    #[arg(long, default_value = "f32")]
    pub dtype: String,
    /// Tokens per example (default: the config's max_length, capped at the model's context).
    #[arg(long)]
    pub max_length: Option<usize>,
    /// Labelled positions per example (default: all but the first, an upper bound).
    #[arg(long)]
    pub kept_tokens: Option<i64>,
    /// Vision-language models: the image each example shows, WIDTHxHEIGHT pixels. Plans
    /// EasyEdit's five multimodal views (implies --ds vqa): --max-length is the text of the
    /// image views, to which the image's tokens are added; the vision tower's forward is
    /// planned once per distinct image.
    #[arg(long, value_parser = parse_image_size)]
    pub image_size: Option<(i64, i64)>,
    /// The data planned for: zsre or counterfact (text: edit_inner, edit_outer, loc) or
    /// vqa or caption (the five multimodal views; needs --image-size).
    #[arg(long)]
    pub ds: Option<String>,
    /// --ds vqa|caption: tokens of the text-only locality question (E-VQA's NQ `loc`
    /// view; default --max-length).
    #[arg(long)]
    pub loc_length: Option<i64>,
    /// Print exactly one JSON object on stdout.
    #[arg(long)]
    pub json: bool,
}
