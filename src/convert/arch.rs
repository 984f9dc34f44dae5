//! What differs per architecture: llama.cpp's tensor names mapped back to Hugging Face's,
//! the layout changes its converter made undone, and the `config.json` transformers writes
//! after loading the GGUF (transformers 5's `modeling_gguf_pytorch_utils.py` and
//! `integrations/ggml.py`, whose behaviour this reproduces).
use serde_json::{json, Map, Value as Json};

use super::gguf::{Gguf, Value};
use crate::Result;

/// An architecture the importer converts, from `general.architecture`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Arch {
    /// `llama`: LLaMA, SmolLM and Mistral-style files (llama.cpp writes Mistral's as `llama`;
    /// transformers 5.23 would call a file whose `general.name` is exactly `mistral` a
    /// Mistral and then fail to load it, gguf-py having no such architecture: here it is the
    /// LLaMA it is, with no sliding window, as llama.cpp runs it).
    Llama,
    /// `qwen2`: the LLaMA layout with q/k/v biases, and no rotary row permutation.
    Qwen2,
    /// `gpt2`: fused `c_attn`, learned positions, layer norms with biases, `Conv1D` weights.
    Gpt2,
}

/// What a tensor needs besides its new name.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Layout {
    /// As stored.
    Same,
    /// llama.cpp's rotary row permutation undone, over `heads` heads (`attn_q`: the
    /// attention heads, `attn_k`: the key-value heads).
    Unpermute { heads: usize },
    /// A GPT-2 `Conv1D` weight: stored `[out, in]` by llama.cpp, `[in, out]` in Hugging Face.
    Transpose,
}

impl Arch {
    pub fn from_gguf(g: &Gguf) -> Result<Self> {
        let arch = g.get("general.architecture").and_then(Value::as_str).ok_or_else(|| g.error("no general.architecture (string) in the metadata"))?;
        Ok(match arch {
            "llama" => Arch::Llama,
            "qwen2" => Arch::Qwen2,
            "gpt2" => Arch::Gpt2,
            other => return Err(g.error(format!("architecture {other:?} is not supported (llama, qwen2 and gpt2 are)"))),
        })
    }

    /// The metadata prefix of the architecture's keys (`llama.block_count`).
    pub fn key(self) -> &'static str {
        match self {
            Arch::Llama => "llama",
            Arch::Qwen2 => "qwen2",
            Arch::Gpt2 => "gpt2",
        }
    }

    pub fn architecture(self) -> &'static str {
        match self {
            Arch::Llama => "LlamaForCausalLM",
            Arch::Qwen2 => "Qwen2ForCausalLM",
            Arch::Gpt2 => "GPT2LMHeadModel",
        }
    }

    /// The Hugging Face name of GGUF tensor `name` and the layout change it needs, or `None`
    /// for a tensor transformers does not load either (`rope_freqs`, which llama.cpp
    /// computes from the config).
    pub fn hf_name(self, name: &str, heads: usize, kv_heads: usize) -> Option<(String, Layout)> {
        let (stem, suffix) = name.rsplit_once('.')?;
        if suffix != "weight" && suffix != "bias" {
            return None;
        }
        let (top, layer) = match stem.strip_prefix("blk.") {
            Some(rest) => {
                let (n, leaf) = rest.split_once('.')?;
                let n: usize = n.parse().ok()?;
                (leaf, Some(n))
            }
            None => (stem, None),
        };
        let gpt2 = self == Arch::Gpt2;
        let (hf, layout) = match (layer, top) {
            (None, "token_embd") if gpt2 => ("transformer.wte".to_string(), Layout::Same),
            (None, "position_embd") if gpt2 => ("transformer.wpe".to_string(), Layout::Same),
            (None, "output_norm") if gpt2 => ("transformer.ln_f".to_string(), Layout::Same),
            (None, "token_embd") => ("model.embed_tokens".to_string(), Layout::Same),
            (None, "output_norm") => ("model.norm".to_string(), Layout::Same),
            (None, "output") => ("lm_head".to_string(), Layout::Same),
            (Some(n), leaf) if gpt2 => {
                let (sub, layout) = match leaf {
                    "attn_norm" => ("ln_1", Layout::Same),
                    "attn_qkv" => ("attn.c_attn", Layout::Transpose),
                    "attn_output" => ("attn.c_proj", Layout::Transpose),
                    "ffn_norm" => ("ln_2", Layout::Same),
                    "ffn_up" => ("mlp.c_fc", Layout::Transpose),
                    "ffn_down" => ("mlp.c_proj", Layout::Transpose),
                    _ => return None,
                };
                // Only weights are transposed; a bias is a vector either way.
                let layout = if suffix == "bias" { Layout::Same } else { layout };
                (format!("transformer.h.{n}.{sub}"), layout)
            }
            (Some(n), leaf) => {
                let llama = self == Arch::Llama;
                let (sub, layout) = match leaf {
                    "attn_norm" => ("input_layernorm", Layout::Same),
                    "ffn_norm" => ("post_attention_layernorm", Layout::Same),
                    "attn_q" if llama => ("self_attn.q_proj", Layout::Unpermute { heads }),
                    "attn_k" if llama => ("self_attn.k_proj", Layout::Unpermute { heads: kv_heads }),
                    "attn_q" => ("self_attn.q_proj", Layout::Same),
                    "attn_k" => ("self_attn.k_proj", Layout::Same),
                    "attn_v" => ("self_attn.v_proj", Layout::Same),
                    "attn_output" => ("self_attn.o_proj", Layout::Same),
                    "ffn_gate" => ("mlp.gate_proj", Layout::Same),
                    "ffn_up" => ("mlp.up_proj", Layout::Same),
                    "ffn_down" => ("mlp.down_proj", Layout::Same),
                    _ => return None,
                };
                (format!("model.layers.{n}.{sub}"), layout)
            }
            _ => return None,
        };
        Some((format!("{hf}.{suffix}"), layout))
    }

    /// `config.json` as transformers writes it after loading the file (less its
    /// `quantization_config`: these weights are plain floats). `tied`: the file has no
    /// `output.weight`, so the head is the embedding.
    pub fn config(self, g: &Gguf, tied: bool, vocab_size: i64, dtype: &str) -> Result<Json> {
        let k = self.key();
        let int = |name: &str| -> Result<Option<i64>> {
            match g.get(&format!("{k}.{name}")) {
                None => Ok(None),
                Some(v) => v.as_i64().map(Some).ok_or_else(|| g.error(format!("{k}.{name} is not an integer: {v:?}"))),
            }
        };
        let need = |name: &str| -> Result<i64> {
            int(name)?.filter(|&v| v > 0).ok_or_else(|| g.error(format!("{k}.{name} (a positive integer) is missing")))
        };
        let float = |name: &str| -> Result<Option<f64>> {
            match g.get(&format!("{k}.{name}")) {
                None => Ok(None),
                Some(v) => v.as_f64().map(Some).ok_or_else(|| g.error(format!("{k}.{name} is not a number: {v:?}"))),
            }
        };
        let token_id = |name: &str| -> Result<Json> {
            match g.get(&format!("tokenizer.ggml.{name}")) {
                None => Ok(Json::Null),
                Some(v) => v.as_i64().map(Json::from).ok_or_else(|| g.error(format!("tokenizer.ggml.{name} is not an integer: {v:?}"))),
            }
        };
        let mut c = Map::new();
        c.insert("architectures".into(), json!([self.architecture()]));
        c.insert("model_type".into(), json!(self.key()));
        let layers = need("block_count")?;
        let hidden = need("embedding_length")?;
        let heads = need("attention.head_count")?;
        match self {
            Arch::Gpt2 => {
                c.insert("n_layer".into(), json!(layers));
                c.insert("n_embd".into(), json!(hidden));
                c.insert("n_head".into(), json!(heads));
                // transformers' GPT2Config reads n_positions (its own default: 1024) and
                // n_inner (4 * n_embd); the file's sizes are written so the shapes agree.
                let ctx = int("context_length")?.unwrap_or(1024);
                c.insert("n_ctx".into(), json!(ctx));
                c.insert("n_positions".into(), json!(ctx));
                // transformers leaves n_inner unset (4 * n_embd); a file whose FFN is
                // another width gets it written, so that its shapes load at all.
                let ff = int("feed_forward_length")?.filter(|&ff| ff != 4 * hidden);
                c.insert("n_inner".into(), json!(ff));
                c.insert("layer_norm_epsilon".into(), json!(float("attention.layer_norm_epsilon")?.unwrap_or(1e-5)));
                c.insert("activation_function".into(), json!("gelu_new"));
            }
            Arch::Llama | Arch::Qwen2 => {
                c.insert("num_hidden_layers".into(), json!(layers));
                c.insert("hidden_size".into(), json!(hidden));
                c.insert("intermediate_size".into(), json!(need("feed_forward_length")?));
                c.insert("num_attention_heads".into(), json!(heads));
                c.insert("num_key_value_heads".into(), json!(int("attention.head_count_kv")?.unwrap_or(heads)));
                if self == Arch::Llama {
                    if let Some(d) = int("rope.dimension_count")? {
                        c.insert("head_dim".into(), json!(d));
                    }
                }
                let default_ctx = if self == Arch::Qwen2 { 32768 } else { 2048 };
                c.insert("max_position_embeddings".into(), json!(int("context_length")?.unwrap_or(default_ctx)));
                c.insert("rms_norm_eps".into(), json!(float("attention.layer_norm_rms_epsilon")?.unwrap_or(1e-6)));
                let theta = float("rope.freq_base")?.unwrap_or(10000.0);
                c.insert("rope_parameters".into(), json!({"rope_theta": theta, "rope_type": "default"}));
                c.insert("hidden_act".into(), json!("silu"));
                if self != Arch::Qwen2 {
                    c.insert("attention_bias".into(), json!(false));
                    c.insert("mlp_bias".into(), json!(false));
                }
            }
        }
        c.insert("vocab_size".into(), json!(vocab_size));
        c.insert("bos_token_id".into(), token_id("bos_token_id")?);
        c.insert("eos_token_id".into(), token_id("eos_token_id")?);
        c.insert("pad_token_id".into(), token_id("padding_token_id")?);
        if let v @ Json::Number(_) = token_id("unknown_token_id")? {
            c.insert("unk_token_id".into(), v);
        }
        c.insert("tie_word_embeddings".into(), json!(tied));
        c.insert("dtype".into(), json!(dtype));
        Ok(Json::Object(c))
    }
}

/// Undoes llama.cpp's rotary permutation of q / k rows (`permute` in its
/// `convert_hf_to_gguf.py`; transformers' `_reverse_permute_weights`): within each of `heads`
/// heads of `2 * half` rows, row `2i + t` of the file is row `t * half + i` of Hugging Face's.
/// `rows` is the tensor as `[out, row_len]` values; a bias has `row_len` 1.
pub fn unpermute(data: &[f32], heads: usize, row_len: usize) -> Option<Vec<f32>> {
    let out_rows = data.len() / row_len.max(1);
    if heads == 0 || !out_rows.is_multiple_of(2 * heads) {
        return None;
    }
    let half = out_rows / heads / 2;
    let mut out = vec![0f32; data.len()];
    for h in 0..heads {
        for i in 0..half {
            for t in 0..2 {
                let from = h * 2 * half + 2 * i + t;
                let to = h * 2 * half + t * half + i;
                out[to * row_len..(to + 1) * row_len].copy_from_slice(&data[from * row_len..(from + 1) * row_len]);
            }
        }
    }
    Some(out)
}

/// `[rows, cols]` to `[cols, rows]`.
pub fn transpose(data: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    let mut out = vec![0f32; data.len()];
    for r in 0..rows {
        for c in 0..cols {
            out[c * rows + r] = data[r * cols + c];
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unpermute_inverts_llama_cpp_permute() {
        // llama.cpp: w.reshape(heads, 2, half, cols).swapaxes(1, 2).reshape(shape).
        let (heads, half, cols) = (3, 4, 2);
        let rows = heads * 2 * half;
        let hf: Vec<f32> = (0..rows * cols).map(|v| v as f32).collect();
        let mut gguf = vec![0f32; hf.len()];
        for h in 0..heads {
            for t in 0..2 {
                for i in 0..half {
                    let src = h * 2 * half + t * half + i;
                    let dst = h * 2 * half + i * 2 + t;
                    gguf[dst * cols..(dst + 1) * cols].copy_from_slice(&hf[src * cols..(src + 1) * cols]);
                }
            }
        }
        assert_eq!(unpermute(&gguf, heads, cols).unwrap(), hf);
        assert!(unpermute(&gguf, 5, cols).is_none());
    }

    #[test]
    fn names() {
        let l = Arch::Llama;
        assert_eq!(l.hf_name("blk.3.attn_k.weight", 9, 3), Some(("model.layers.3.self_attn.k_proj.weight".into(), Layout::Unpermute { heads: 3 })));
        assert_eq!(Arch::Qwen2.hf_name("blk.0.attn_q.bias", 9, 3), Some(("model.layers.0.self_attn.q_proj.bias".into(), Layout::Same)));
        assert_eq!(Arch::Gpt2.hf_name("blk.1.attn_qkv.weight", 4, 4), Some(("transformer.h.1.attn.c_attn.weight".into(), Layout::Transpose)));
        assert_eq!(Arch::Gpt2.hf_name("output.weight", 4, 4), Some(("lm_head.weight".into(), Layout::Same)));
        assert_eq!(l.hf_name("rope_freqs.weight", 9, 3), None);
        assert_eq!(l.hf_name("blk.x.attn_q.weight", 9, 3), None);
    }
}
