//! GPT-2 (`GPT2LMHeadModel`), matching Hugging Face transformers numerically.

use serde::Deserialize;
use tch::Tensor;

use super::family::{block_layout, BlockSaved, Dims, Family, MatmulSaves};
use super::layers::{declare_all, Layer, Linear, Norm, Param, ParamList};
use super::{attend, check_sizes, position_ids, Prefix, Activation, AttnMask, MAX_LAYERS, MAX_VOCAB_OR_CONTEXT, MAX_WIDTH};
use super::{BlockContext, BlockIo, ForwardInput, ModelInfo, ParamView, WeightLayout};
use crate::{Error, Result};

fn default_eps() -> f64 {
    1e-5
}
fn default_act() -> Activation {
    Activation::GeluTanh
}
fn default_true() -> bool {
    true
}

/// The fields of a GPT-2 `config.json` that the forward uses.
#[derive(Debug, Clone, Deserialize)]
pub struct Gpt2Config {
    pub vocab_size: i64,
    pub n_embd: i64,
    pub n_layer: i64,
    pub n_head: i64,
    pub n_positions: i64,
    #[serde(default)]
    pub n_inner: Option<i64>,
    #[serde(default = "default_eps")]
    pub layer_norm_epsilon: f64,
    #[serde(default = "default_act")]
    pub activation_function: Activation,
    #[serde(default = "default_true")]
    pub scale_attn_weights: bool,
    #[serde(default)]
    pub scale_attn_by_inverse_layer_idx: bool,
    #[serde(default)]
    pub reorder_and_upcast_attn: bool,
}

#[derive(Debug, Clone)]
pub struct Gpt2 {
    pub config: Gpt2Config,
}

impl Gpt2 {
    pub fn new(config: Gpt2Config) -> Result<Self> {
        let c = &config;
        check_sizes(&[
            ("vocab_size", c.vocab_size, MAX_VOCAB_OR_CONTEXT),
            ("n_embd", c.n_embd, MAX_WIDTH),
            ("n_layer", c.n_layer, MAX_LAYERS),
            ("n_head", c.n_head, MAX_LAYERS),
            ("n_positions", c.n_positions, MAX_VOCAB_OR_CONTEXT),
            ("n_inner", c.n_inner.unwrap_or(1), MAX_WIDTH),
        ])?;
        if c.n_embd % c.n_head != 0 {
            return Err(Error::input(format!("n_embd {} is not divisible by n_head {}", c.n_embd, c.n_head)));
        }
        if !c.scale_attn_weights || c.scale_attn_by_inverse_layer_idx || c.reorder_and_upcast_attn {
            return Err(Error::input(
                "unsupported GPT-2 attention options (scale_attn_weights=false, scale_attn_by_inverse_layer_idx or reorder_and_upcast_attn)",
            ));
        }
        Ok(Self { config })
    }

    fn inner(&self) -> i64 {
        self.config.n_inner.unwrap_or(4 * self.config.n_embd)
    }

    /// The final layer norm.
    fn ln_f(&self) -> Norm {
        Norm::layer("transformer.ln_f", self.config.n_embd, self.config.layer_norm_epsilon)
    }

    /// Every layer of a block, named once (relative to `transformer.h.<i>`).
    fn block_layers(&self) -> Block {
        let (d, f, eps) = (self.config.n_embd, self.inner(), self.config.layer_norm_epsilon);
        Block {
            ln_1: Norm::layer("ln_1", d, eps),
            c_attn: Linear::conv1d("attn.c_attn", d, 3 * d),
            attn_proj: Linear::conv1d("attn.c_proj", d, d),
            ln_2: Norm::layer("ln_2", d, eps),
            c_fc: Linear::conv1d("mlp.c_fc", d, f),
            mlp_proj: Linear::conv1d("mlp.c_proj", f, d),
        }
    }
}

/// The token embedding `[vocab, D]`, also the LM head's weight (tied).
const WTE: &str = "transformer.wte.weight";
/// The position embedding `[n_positions, D]`.
const WPE: &str = "transformer.wpe.weight";

/// A GPT-2 block's layers, in the order they run (and are listed).
struct Block {
    ln_1: Norm,
    c_attn: Linear,
    attn_proj: Linear,
    ln_2: Norm,
    c_fc: Linear,
    mlp_proj: Linear,
}

impl Block {
    fn layers(&self) -> [&dyn Layer; 6] {
        [&self.ln_1, &self.c_attn, &self.attn_proj, &self.ln_2, &self.c_fc, &self.mlp_proj]
    }

    fn linears(&self) -> [&Linear; 4] {
        [&self.c_attn, &self.attn_proj, &self.c_fc, &self.mlp_proj]
    }
}

impl Family for Gpt2 {
    fn info(&self) -> ModelInfo {
        let n_params = self.expected_params().iter().map(|(_, s)| s.iter().product::<i64>()).sum();
        ModelInfo {
            architecture: "GPT2LMHeadModel".into(),
            vocab_size: self.config.vocab_size,
            hidden_size: self.config.n_embd,
            n_layers: self.config.n_layer,
            max_positions: self.config.n_positions,
            n_params,
        }
    }

    fn expected_params(&self) -> Vec<(String, Vec<i64>)> {
        let c = &self.config;
        let mut out = ParamList::new();
        let top: [&dyn Layer; 3] =
            [&Param { name: WTE, shape: vec![c.vocab_size, c.n_embd] }, &Param { name: WPE, shape: vec![c.n_positions, c.n_embd] }, &self.ln_f()];
        declare_all(&top, &Prefix::default(), &mut out);
        let block = self.block_layers();
        for i in 0..c.n_layer.max(0) as usize {
            declare_all(&block.layers(), &self.block_path(i), &mut out);
        }
        out
    }

    fn layout(&self, name: &str) -> Option<WeightLayout> {
        block_layout(self.block_prefix(), name, &self.block_layers().linears())
    }

    fn default_edit_params(&self) -> Vec<String> {
        let n = self.config.n_layer;
        let b = self.block_layers();
        ((n - 3).max(0)..n).flat_map(|i| [b.c_fc, b.mlp_proj].map(|l| self.block_path(i as usize).pp(l.name).name("weight"))).collect()
    }

    fn block_prefix(&self) -> &'static str {
        "transformer.h."
    }

    /// Checkpoints written by older code lack the `transformer.` prefix.
    fn canonical_name(&self, name: &str) -> String {
        if name.starts_with("transformer.") || name.starts_with("lm_head.") {
            name.to_string()
        } else {
            format!("transformer.{name}")
        }
    }

    /// Token + position embeddings, and what every block shares.
    fn embed(&self, p: &ParamView, input: &ForwardInput, past: i64) -> Result<(Tensor, BlockContext)> {
        let (b, t) = input.dims()?;
        let mut pos = position_ids(input.input_ids, input.attention_mask);
        if past > 0 {
            pos += past;
        }
        let mask = AttnMask::new(input.attention_mask, t, past, input.input_ids.device());
        let x = Tensor::embedding(p.get(WTE)?, input.input_ids, -1, false, false) + Tensor::embedding(p.get(WPE)?, &pos, -1, false, false);
        Ok((x, BlockContext { batch: b, tokens: t, mask, rope: None, pad: None }))
    }

    /// Block `i`: attention and MLP, each behind a pre-norm and a residual connection.
    /// With `io.rows` the attention output and everything after it run at those `M` rows
    /// only (`[B, M, D]` out; `c_attn` still at every position, for the keys and values).
    fn block(&self, io: BlockIo) -> Result<Tensor> {
        let BlockIo { params: p, layer: i, x, ctx, capture, captures, cache, rows } = io;
        let c = &self.config;
        let (b, t) = (ctx.batch, ctx.tokens);
        let (nh, hd) = (c.n_head, c.n_embd / c.n_head);
        let l = self.block_layers();
        let s = p.pp(&self.block_path(i));
        let h = l.ln_1.forward(&s, x)?;
        let qkv = l.c_attn.forward(&s, capture, captures, &h)?;
        let heads = |t_: &Tensor| t_.reshape([b, t, nh, hd]).transpose(1, 2);
        let parts = qkv.split(c.n_embd, 2);
        let (k, v) = (heads(&parts[1]), heads(&parts[2]));
        let (k, v) = match cache {
            Some(kv) => kv.extend(i, k, v),
            None => (k, v),
        };
        let (q, tq, xq, mask) = match rows {
            Some(r) => (r.gather(&parts[0]).reshape([b, r.m, nh, hd]).transpose(1, 2), r.m, r.gather(x), r.mask(&ctx.mask, t)),
            None => (heads(&parts[0]), t, x.shallow_clone(), ctx.mask.shallow_clone()),
        };
        let y = attend(&q, &k, &v, &mask);
        let y = y.transpose(1, 2).reshape([b, tq, c.n_embd]);
        let y = l.attn_proj.forward(&s, capture, captures, &y)?;
        let x = xq + y;
        let h = l.ln_2.forward(&s, &x)?;
        let h = l.c_fc.forward(&s, capture, captures, &h)?;
        let h = c.activation_function.apply(&h);
        let h = l.mlp_proj.forward(&s, capture, captures, &h)?;
        if let Some(r) = rows {
            r.mark(captures, [&l.attn_proj, &l.c_fc, &l.mlp_proj].map(|m| m.weight_name(&s)));
        }
        Ok(x + h)
    }

    /// Final layer norm over the last block's output.
    fn final_norm(&self, p: &ParamView, x: &Tensor) -> Result<Tensor> {
        self.ln_f().forward(&p.pp(&Prefix::default()), x)
    }

    /// The LM head's weight (tied to the token embedding).
    fn head_weight_name(&self) -> &'static str {
        WTE
    }

    fn dims(&self) -> Dims {
        let c = &self.config;
        Dims { d: c.n_embd, f: self.inner(), heads: c.n_head, q: c.n_embd, kv: c.n_embd, gqa: false, n_layers: c.n_layer, vocab: c.vocab_size }
    }

    /// Follows [`Family::block`] op by op: LayerNorm saves its input, mean and rstd; a
    /// matmul saves its input when its weight is edited and the weight when its input
    /// requires grad; SDPA saves q, k, v, its output and the logsumexp; GELU its input.
    fn block_saved(&self, s: i64, res_rg: bool, edited: &[String]) -> BlockSaved {
        let Dims { d, f, heads: h, .. } = self.dims();
        let l = self.block_layers();
        let (c_attn, attn_proj, c_fc, mlp_proj) = (l.c_attn.name, l.attn_proj.name, l.c_fc.name, l.mlp_proj.name);
        let mm = MatmulSaves::new(edited);
        let mut bytes = 0i64;
        if res_rg {
            bytes += d * s + 8; // ln_1: input, mean, rstd (f32)
        }
        if mm.is_edited(c_attn) {
            bytes += d * s; // ln_1 output, input of an edited matmul
        }
        let qkv_rg = mm.matmul(res_rg, c_attn);
        if qkv_rg {
            bytes += 3 * d * s + d * s + h * 4; // SDPA: q, k, v (one qkv tensor), output, logsumexp
        }
        if mm.is_edited(attn_proj) {
            bytes += d * s; // contiguous copy of the attention output
        }
        let a_rg = mm.matmul(qkv_rg, attn_proj);
        let x1_rg = res_rg || a_rg;
        if x1_rg {
            bytes += d * s + 8; // ln_2
        }
        if mm.is_edited(c_fc) {
            bytes += d * s;
        }
        let fc_rg = mm.matmul(x1_rg, c_fc);
        if fc_rg {
            bytes += f * s; // gelu input
        }
        if mm.is_edited(mlp_proj) {
            bytes += f * s; // gelu output
        }
        let o_rg = mm.matmul(fc_rg, mlp_proj);
        BlockSaved { per_token: bytes, output_requires_grad: x1_rg || o_rg }
    }

    fn final_norm_saved(&self, s: i64) -> i64 {
        self.config.n_embd * s + 8
    }

    fn inference_working_set(&self, s: i64) -> i64 {
        (2 * self.config.n_embd + 3 * self.inner()) * s
    }
}
