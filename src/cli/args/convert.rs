use std::path::PathBuf;

use clap::Args;

#[derive(Args)]
pub struct ConvertArgs {
    /// GGUF file to import (llama.cpp's format, version 2 or 3): architectures llama
    /// (SmolLM, Mistral-style), qwen2 and gpt2; tensors F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1,
    /// Q8_0, Q4_K, Q5_K, Q6_K (dequantised to f32); a byte-level BPE or SentencePiece tokenizer.
    #[arg(long)]
    pub gguf: PathBuf,
    /// New (or empty) folder for the Hugging Face model: config.json, model.safetensors,
    /// tokenizer.json, tokenizer_config.json, chat_template.jinja. Written whole or not at all.
    #[arg(long)]
    pub out: PathBuf,
    /// Print exactly one JSON object on stdout.
    #[arg(long)]
    pub json: bool,
}
