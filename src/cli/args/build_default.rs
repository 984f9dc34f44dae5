use std::path::PathBuf;

use clap::Args;

#[derive(Args)]
pub struct BuildDefaultArgs {
    /// Output directory (the shipped default lives in data/).
    #[arg(long, default_value = "data")]
    pub out: PathBuf,
    /// MEND hyper-parameters for the editor.
    #[arg(long, default_value = "configs/world.json")]
    pub config: PathBuf,
    /// MEND hyper-parameters (and `mend-ls` settings) of the editor for many edits
    /// (written to OUT/editor-many).
    #[arg(long, default_value = "configs/world-many.json")]
    pub many_config: PathBuf,
    /// Pretraining steps (upper bound; training stops once the model knows its facts).
    #[arg(long)]
    pub pretrain_steps: Option<usize>,
    /// MEND hyper-parameters for the multimodal default's editor (written to OUT/vl).
    #[arg(long, default_value = "configs/vl-world.json")]
    pub vl_config: PathBuf,
    /// Build only the text default (`text`), only the multimodal one (`vl`), or only the
    /// text default's editor for many edits (`many`: OUT/editor-many, from the model and
    /// world already in OUT).
    #[arg(long, value_parser = ["text", "vl", "many"])]
    pub only: Option<String>,
}
