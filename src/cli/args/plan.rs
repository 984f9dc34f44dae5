use std::path::PathBuf;

use clap::Args;

use super::parse_image_size;
use crate::device::DeviceRequest;

#[derive(Args)]
pub struct PlanArgs {
    /// Model directory; only its config.json is read (no weights needed).
    #[arg(long)]
    pub model: PathBuf,
    /// MEND hyper-parameters: JSON (see configs/), or an EasyEdit MEND hparams YAML as it is
    /// (`dualedit config --from-easyedit` shows what it becomes).
    #[arg(long)]
    pub config: PathBuf,
    /// The devices planned for (they need not exist on this machine).
    #[command(flatten)]
    pub devices: DeviceRequest,
    /// f32, bf16 or f16 for the model weights (editor maths is always f32). Default: the
    /// model's config.json `torch_dtype` (what its weights are), else f32.
    #[arg(long, value_enum)]
    pub dtype: Option<crate::model::Dtype>,
    /// With --max-memory: the share of each cap kept free for the planner's own error and
    /// the allocator's fragmentation (a placement fits when its peak is at most cap x (1 -
    /// margin) - reserve). Default 10%.
    #[arg(long)]
    pub margin: Option<String>,
    /// With --max-memory: bytes kept free on each CUDA device for its context (cuBLAS,
    /// kernels) before any tensor. Default 512MiB.
    #[arg(long)]
    pub reserve: Option<String>,
    /// Card sizes to try, e.g. 16GiB,24GiB,40GiB,80GiB: the smallest on which the run fits on
    /// one card and on two (with the placement and each device's peak), by the same rule as
    /// --max-memory.
    #[arg(long)]
    pub fit: Option<String>,
    /// The user's records (with --ds): tokens per example, labelled positions and image
    /// sizes are taken from them (at --percentile) instead of upper bounds; flags given
    /// explicitly still win. Tokenised with --model's tokenizer.json.
    #[arg(long)]
    pub data: Option<PathBuf>,
    /// --data --ds vqa|caption: where the records' images are.
    #[arg(long)]
    pub image_root: Option<PathBuf>,
    /// --data: the percentile of the records planned for; 100 (the default) is the longest
    /// record, which with a batch of one sets a step's peak.
    #[arg(long, default_value_t = crate::planner::data::DEFAULT_PERCENTILE)]
    pub percentile: f64,
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
    #[arg(long, value_parser = super::dataset())]
    pub ds: Option<crate::data::easyedit::DatasetKind>,
    /// --ds vqa|caption: tokens of the text-only locality question (E-VQA's NQ `loc`
    /// view; default --max-length).
    #[arg(long)]
    pub loc_length: Option<i64>,
    /// Print exactly one JSON object on stdout.
    #[arg(long)]
    pub json: bool,
}
