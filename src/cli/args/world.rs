use std::path::PathBuf;

use clap::Args;

use super::parse_image_size;

#[derive(Args)]
pub struct WorldArgs {
    /// Output directory. The visual world refuses a non-empty folder that holds no
    /// visual world; EasyEdit's image and rephrase-image roots are both this folder.
    #[arg(long)]
    pub out: PathBuf,
    /// The visual world: scenes drawn in code, vqa-train.json / vqa-holdout.json (E-VQA
    /// format), pretrain.json, scenes.json, images/ and images_rephrase/.
    #[arg(long)]
    pub vl: bool,
    /// Seed (default: the shipped world's).
    #[arg(long)]
    pub seed: Option<u64>,
    /// Visual world: scenes whose records train the editor.
    #[arg(long, requires = "vl")]
    pub train_scenes: Option<usize>,
    /// Visual world: scenes whose records are held out.
    #[arg(long, requires = "vl")]
    pub holdout_scenes: Option<usize>,
    /// Visual world: image size WIDTHxHEIGHT, each side an odd multiple of 28 (Qwen2-VL's
    /// merged-token cell) from 84 to 420 (default 84x84).
    #[arg(long, requires = "vl", value_parser = parse_image_size)]
    pub image_size: Option<(i64, i64)>,
}
