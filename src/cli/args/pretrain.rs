use std::path::PathBuf;

use clap::Args;

use crate::device::DeviceRequest;

#[derive(Args)]
pub struct PretrainArgs {
    /// EasyEdit files whose facts make the corpus (repeat the flag for several).
    #[arg(long, required_unless_present = "vl")]
    pub data: Vec<PathBuf>,
    /// The format of --data (vqa, caption: E-VQA / E-IC, with --image-root).
    #[arg(long, required_unless_present = "vl", value_parser = super::dataset())]
    pub ds: Option<crate::data::easyedit::DatasetKind>,
    /// Pretrain a tiny Qwen2-VL-shaped model (vision tower included) on a visual world's
    /// pretrain.json (`dualedit world --vl`) instead of a GPT-2 on text; its shape is the
    /// multimodal default's, and of the sizes below only --steps, --batch and --lr apply.
    #[arg(long, requires = "world", conflicts_with_all = ["data", "ds", "with_new_targets"])]
    pub vl: bool,
    /// The visual world folder (with --vl).
    #[arg(long, requires = "vl")]
    pub world: Option<PathBuf>,
    /// With --vl: the vision tower's learning rate as a share of --lr (default 1).
    #[arg(long, requires = "vl")]
    pub vision_lr_scale: Option<f64>,
    /// Output model directory.
    #[arg(long)]
    pub out: PathBuf,
    /// BPE vocabulary size (at least 257: the 256 byte-level symbols and end-of-text).
    #[arg(long, default_value_t = 4096)]
    pub vocab: usize,
    /// Width, layers and heads (default 256, 4, 4; with --vl the multimodal default's
    /// text decoder: 96, 2, 4).
    #[arg(long)]
    pub n_embd: Option<i64>,
    #[arg(long)]
    pub n_layer: Option<i64>,
    #[arg(long)]
    pub n_head: Option<i64>,
    #[arg(long, default_value_t = 64)]
    pub n_positions: i64,
    /// Default 4000 (text) or the multimodal default's 10000 (--vl).
    #[arg(long)]
    pub steps: Option<usize>,
    #[arg(long, default_value_t = 32)]
    pub batch: usize,
    /// Default 2e-3 (text) or 3e-4 (--vl).
    #[arg(long)]
    pub lr: Option<f64>,
    /// Where to train: cpu or cuda:N (the result is the same HF directory either way).
    #[command(flatten)]
    pub devices: DeviceRequest,
    /// Also put each record's new target in the corpus, alone on its line (never after its
    /// prompt), so the model can write the words edits ask for, as a pretrained LM can.
    #[arg(long)]
    pub with_new_targets: bool,
}
