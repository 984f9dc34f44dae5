//! LLaMA-family decoders: `LlamaForCausalLM`, `Qwen2ForCausalLM` (and Mistral's layout).
//!
//! One implementation covers them: RMSNorm, rotary embeddings (Hugging Face's
//! rotate-half convention), grouped-query attention and a gated SiLU MLP. Qwen2 differs
//! only in its q/k/v biases and its config defaults.

use serde::Deserialize;
use tch::{Kind, Tensor};

use super::family::{block_layout, BlockSaved, Dims, Family, MatmulSaves};
use super::layers::{declare_all, Layer, Linear, Norm, Param, ParamList};
use super::{attend, check_sizes, position_ids, Prefix, Activation, AttnMask, MAX_LAYERS, MAX_VOCAB_OR_CONTEXT, MAX_WIDTH};
use super::{BlockContext, BlockIo, ForwardInput, ModelInfo, ParamView, WeightLayout};
use crate::{Error, Result};

fn default_eps() -> f64 {
    1e-6
}
fn default_act() -> Activation {
    Activation::Silu
}

/// The fields of a LLaMA / Qwen2 `config.json` that the forward uses.
#[derive(Debug, Clone, Deserialize)]
pub struct LlamaConfig {
    pub vocab_size: i64,
    pub hidden_size: i64,
    pub intermediate_size: i64,
    pub num_hidden_layers: i64,
    pub num_attention_heads: i64,
    #[serde(default)]
    pub num_key_value_heads: Option<i64>,
    #[serde(default)]
    pub head_dim: Option<i64>,
    #[serde(default = "default_eps")]
    pub rms_norm_eps: f64,
    /// Older configs carry `rope_theta` at the top level; transformers v5 writes it
    /// inside `rope_parameters`.
    #[serde(default)]
    pub rope_theta: Option<f64>,
    #[serde(default)]
    pub rope_parameters: Option<serde_json::Value>,
    pub max_position_embeddings: i64,
    #[serde(default)]
    pub tie_word_embeddings: bool,
    #[serde(default)]
    pub attention_bias: bool,
    #[serde(default)]
    pub mlp_bias: bool,
    #[serde(default = "default_act")]
    pub hidden_act: Activation,
    #[serde(default)]
    pub rope_scaling: Option<serde_json::Value>,
}

#[derive(Debug, Clone)]
pub struct Llama {
    pub config: LlamaConfig,
    /// `Qwen2ForCausalLM` or `LlamaForCausalLM` (or `MistralForCausalLM`).
    pub architecture: String,
    qkv_bias: bool,
}

impl Llama {
    pub fn new(config: LlamaConfig, architecture: &str) -> Result<Self> {
        let c = &config;
        check_sizes(&[
            ("vocab_size", c.vocab_size, MAX_VOCAB_OR_CONTEXT),
            ("hidden_size", c.hidden_size, MAX_WIDTH),
            ("intermediate_size", c.intermediate_size, MAX_WIDTH),
            ("num_hidden_layers", c.num_hidden_layers, MAX_LAYERS),
            ("num_attention_heads", c.num_attention_heads, MAX_LAYERS),
            ("max_position_embeddings", c.max_position_embeddings, MAX_VOCAB_OR_CONTEXT),
            ("head_dim", c.head_dim.unwrap_or(1), MAX_WIDTH),
        ])?;
        let kv = c.num_key_value_heads.unwrap_or(c.num_attention_heads);
        if kv <= 0 || c.num_attention_heads % kv != 0 {
            return Err(Error::input(format!(
                "num_attention_heads {} is not a multiple of num_key_value_heads {kv}",
                c.num_attention_heads
            )));
        }
        if c.head_dim.is_none() && c.hidden_size % c.num_attention_heads != 0 {
            return Err(Error::input("hidden_size is not divisible by num_attention_heads"));
        }
        for s in [&c.rope_scaling, &c.rope_parameters].into_iter().flatten().filter(|s| !s.is_null()) {
            let kind = s.get("rope_type").or_else(|| s.get("type")).and_then(|v| v.as_str()).unwrap_or("default");
            if kind != "default" {
                return Err(Error::input(format!("rope scaling of type {kind:?} is not supported")));
            }
        }
        let qkv_bias = architecture == "Qwen2ForCausalLM" || c.attention_bias;
        Ok(Self { config, architecture: architecture.to_string(), qkv_bias })
    }

    fn kv_heads(&self) -> i64 {
        self.config.num_key_value_heads.unwrap_or(self.config.num_attention_heads)
    }

    fn rope_theta(&self) -> f64 {
        let nested = self.config.rope_parameters.as_ref().and_then(|p| p.get("rope_theta")).and_then(|v| v.as_f64());
        self.config.rope_theta.or(nested).unwrap_or(10000.0)
    }

    fn head_dim(&self) -> i64 {
        self.config.head_dim.unwrap_or(self.config.hidden_size / self.config.num_attention_heads)
    }

    /// The final RMSNorm.
    fn norm(&self) -> Norm {
        Norm::rms("model.norm", self.config.hidden_size, self.config.rms_norm_eps)
    }

    /// Every layer of a block, named once (relative to `model.layers.<i>`).
    fn block_layers(&self) -> Block {
        let c = &self.config;
        let (d, f, eps) = (c.hidden_size, c.intermediate_size, c.rms_norm_eps);
        let (q, kv) = (c.num_attention_heads * self.head_dim(), self.kv_heads() * self.head_dim());
        Block {
            input_layernorm: Norm::rms("input_layernorm", d, eps),
            q_proj: Linear::linear("self_attn.q_proj", d, q, self.qkv_bias),
            k_proj: Linear::linear("self_attn.k_proj", d, kv, self.qkv_bias),
            v_proj: Linear::linear("self_attn.v_proj", d, kv, self.qkv_bias),
            o_proj: Linear::linear("self_attn.o_proj", q, d, c.attention_bias),
            post_attention_layernorm: Norm::rms("post_attention_layernorm", d, eps),
            gate_proj: Linear::linear("mlp.gate_proj", d, f, c.mlp_bias),
            up_proj: Linear::linear("mlp.up_proj", d, f, c.mlp_bias),
            down_proj: Linear::linear("mlp.down_proj", f, d, c.mlp_bias),
        }
    }

    /// cos/sin tables `[B, 1, T, head_dim]` for the given positions.
    fn rope(&self, pos: &Tensor, kind: Kind) -> (Tensor, Tensor) {
        let hd = self.head_dim();
        let device = pos.device();
        let exponents = Tensor::arange_start_step(0, hd, 2, (Kind::Int64, device)).to_kind(Kind::Float) / hd as f64;
        let inv_freq = Tensor::from(self.rope_theta() as f32).to_device(device).pow(&exponents).reciprocal();
        let freqs = pos.to_kind(Kind::Float).unsqueeze(-1) * inv_freq;
        let emb = Tensor::cat(&[&freqs, &freqs], -1).unsqueeze(1);
        (emb.cos().to_kind(kind), emb.sin().to_kind(kind))
    }
}

/// Whether autograd records the ops run now (libtorch's thread-local grad mode).
fn grad_enabled() -> bool {
    // SAFETY: sets the mode and puts back what it was, on this thread only.
    unsafe {
        let was = torch_sys::at_grad_set_enabled(0);
        torch_sys::at_grad_set_enabled(was);
        was != 0
    }
}

/// The token embedding `[vocab, D]` (also the head's weight when tied).
pub(crate) const EMBED: &str = "model.embed_tokens.weight";
/// The LM head `[vocab, D]` of an untied model.
const LM_HEAD: &str = "lm_head.weight";

/// A LLaMA-family block's layers, in the order they run (and are listed).
struct Block {
    input_layernorm: Norm,
    q_proj: Linear,
    k_proj: Linear,
    v_proj: Linear,
    o_proj: Linear,
    post_attention_layernorm: Norm,
    gate_proj: Linear,
    up_proj: Linear,
    down_proj: Linear,
}

impl Block {
    fn layers(&self) -> [&dyn Layer; 9] {
        [
            &self.input_layernorm,
            &self.q_proj,
            &self.k_proj,
            &self.v_proj,
            &self.o_proj,
            &self.post_attention_layernorm,
            &self.gate_proj,
            &self.up_proj,
            &self.down_proj,
        ]
    }

    fn linears(&self) -> [&Linear; 7] {
        [&self.q_proj, &self.k_proj, &self.v_proj, &self.o_proj, &self.gate_proj, &self.up_proj, &self.down_proj]
    }
}

impl Family for Llama {
    fn info(&self) -> ModelInfo {
        let n_params = self.expected_params().iter().map(|(_, s)| s.iter().product::<i64>()).sum();
        ModelInfo {
            architecture: self.architecture.clone(),
            vocab_size: self.config.vocab_size,
            hidden_size: self.config.hidden_size,
            n_layers: self.config.num_hidden_layers,
            max_positions: self.config.max_position_embeddings,
            n_params,
        }
    }

    fn expected_params(&self) -> Vec<(String, Vec<i64>)> {
        let c = &self.config;
        let (d, v) = (c.hidden_size, c.vocab_size);
        let mut out = ParamList::new();
        let embed = Param { name: EMBED, shape: vec![v, d] };
        let head = Param { name: LM_HEAD, shape: vec![v, d] };
        let norm = self.norm();
        let top: Vec<&dyn Layer> = if c.tie_word_embeddings { vec![&embed, &norm] } else { vec![&embed, &norm, &head] };
        declare_all(&top, &Prefix::default(), &mut out);
        let block = self.block_layers();
        for i in 0..c.num_hidden_layers.max(0) as usize {
            declare_all(&block.layers(), &self.block_path(i), &mut out);
        }
        out
    }

    fn layout(&self, name: &str) -> Option<WeightLayout> {
        block_layout(self.block_prefix(), name, &self.block_layers().linears())
    }

    /// EasyEdit's choice: gate/up/down for LLaMA, up/down for Qwen2.
    fn default_edit_params(&self) -> Vec<String> {
        let n = self.config.num_hidden_layers;
        let b = self.block_layers();
        let mats: Vec<Linear> = if self.architecture == "Qwen2ForCausalLM" { vec![b.up_proj, b.down_proj] } else { vec![b.gate_proj, b.up_proj, b.down_proj] };
        ((n - 3).max(0)..n)
            .flat_map(|i| mats.iter().map(move |l| self.block_path(i as usize).pp(l.name).name("weight")))
            .collect()
    }

    fn block_prefix(&self) -> &'static str {
        "model.layers."
    }

    /// Token embeddings, and what every block shares (mask, rotary tables).
    fn embed(&self, p: &ParamView, input: &ForwardInput, past: i64) -> Result<(Tensor, BlockContext)> {
        let (b, t) = input.dims()?;
        let mask = AttnMask::new(input.attention_mask, t, past, input.input_ids.device());
        let x = Tensor::embedding(p.get(EMBED)?, input.input_ids, -1, false, false);
        let mut pos = position_ids(input.input_ids, input.attention_mask);
        if past > 0 {
            pos += past;
        }
        let rope = self.rope(&pos, x.kind());
        // The real tokens of a padded batch (the mask is `None` when nothing is padded; a
        // cached forward's new tokens never are padding).
        let pad = input.attention_mask.filter(|_| past == 0).map(|m| m.to_kind(Kind::Bool));
        Ok((x, BlockContext { batch: b, tokens: t, mask, rope: Some(rope), pad }))
    }

    /// Block `i`: grouped-query attention with rotary positions and a gated MLP, each
    /// behind an RMSNorm and a residual connection. With `io.rows` the queries and
    /// everything after attention run at those `M` rows only (`[B, M, D]` out); keys and
    /// values are computed at every position as without.
    fn block(&self, io: BlockIo) -> Result<Tensor> {
        let BlockIo { params: p, layer: i, x, ctx, capture: cap, captures, cache, rows } = io;
        let c = &self.config;
        let (b, t) = (ctx.batch, ctx.tokens);
        let (nh, nkv, hd) = (c.num_attention_heads, self.kv_heads(), self.head_dim());
        let (cos, sin) = ctx.rope.as_ref().ok_or_else(|| Error::Internal("block context without rotary tables".into()))?;
        let rotate = |q: &Tensor, cos: &Tensor, sin: &Tensor| {
            let halves = q.chunk(2, -1);
            let rotated = Tensor::cat(&[&(-&halves[1]), &halves[0]], -1);
            q * cos + rotated * sin
        };
        let l = self.block_layers();
        let s = p.pp(&self.block_path(i));
        let h = l.input_layernorm.forward(&s, x)?;
        // The query rows: all `t`, or the `M` the caller reads.
        let (hq, tq, xq, cos_q, sin_q, mask) = match rows {
            Some(r) => (r.gather(&h), r.m, r.gather(x), r.gather_rope(cos), r.gather_rope(sin), r.mask(&ctx.mask, t)),
            None => (h.shallow_clone(), t, x.shallow_clone(), cos.shallow_clone(), sin.shallow_clone(), ctx.mask.shallow_clone()),
        };
        let q = l.q_proj.forward(&s, cap, captures, &hq)?;
        let k = l.k_proj.forward(&s, cap, captures, &h)?;
        let v = l.v_proj.forward(&s, cap, captures, &h)?;
        let q = rotate(&q.reshape([b, tq, nh, hd]).transpose(1, 2), &cos_q, &sin_q);
        let k = rotate(&k.reshape([b, t, nkv, hd]).transpose(1, 2), cos, sin);
        let v = v.reshape([b, t, nkv, hd]).transpose(1, 2);
        // Cached before the GQA repeat: the cache holds n_kv heads, not n_heads.
        let (k, v) = match cache {
            Some(kv) => kv.extend(i, k, v),
            None => (k, v),
        };
        let (k, v) = if nkv != nh {
            let rep = nh / nkv;
            (k.repeat_interleave_self_int(rep, 1, None), v.repeat_interleave_self_int(rep, 1, None))
        } else {
            (k, v)
        };
        let y = attend(&q, &k, &v, &mask).transpose(1, 2).reshape([b, tq, nh * hd]);
        let y = l.o_proj.forward(&s, cap, captures, &y)?;
        let x = xq + y;
        let mlp = |x: &Tensor, captures: &mut _| -> Result<Tensor> {
            let h = l.post_attention_layernorm.forward(&s, x)?;
            let g = l.gate_proj.forward(&s, cap, captures, &h)?;
            let u = l.up_proj.forward(&s, cap, captures, &h)?;
            l.down_proj.forward(&s, cap, captures, &(c.hidden_act.apply(&g) * u))
        };
        // The MLP is position-wise: of a padded batch it runs at the real tokens only (the
        // padding keeps its residual; no real token's attention reads it), unless autograd
        // or a capture needs the `[B, T]` layout. A probe batch of the guard is ~40 % padding.
        let mlp_layers = [&l.gate_proj, &l.up_proj, &l.down_proj];
        let packed = match &ctx.pad {
            Some(pad) if rows.is_none() && !grad_enabled() && !mlp_layers.iter().any(|m| cap.contains(&m.weight_name(&s))) => Some(pad.reshape([-1]).nonzero().squeeze_dim(1)),
            _ => None,
        };
        if let Some(at) = packed {
            let flat = x.reshape([b * t, -1]);
            let m = mlp(&flat.index_select(0, &at), captures)?;
            return Ok(flat.index_add(0, &at, &m).reshape(x.size()));
        }
        let m = mlp(&x, captures)?;
        if let Some(r) = rows {
            r.mark(captures, [&l.q_proj, &l.o_proj, &l.gate_proj, &l.up_proj, &l.down_proj].map(|m| m.weight_name(&s)));
        }
        Ok(x + m)
    }

    /// Final RMSNorm over the last block's output.
    fn final_norm(&self, p: &ParamView, x: &Tensor) -> Result<Tensor> {
        self.norm().forward(&p.pp(&Prefix::default()), x)
    }

    /// The LM head's weight (or the tied embedding).
    fn head_weight_name(&self) -> &'static str {
        if self.config.tie_word_embeddings { EMBED } else { LM_HEAD }
    }

    fn dims(&self) -> Dims {
        let c = &self.config;
        let kvh = self.kv_heads();
        Dims {
            d: c.hidden_size,
            f: c.intermediate_size,
            heads: c.num_attention_heads,
            q: c.num_attention_heads * self.head_dim(),
            kv: kvh * self.head_dim(),
            gqa: kvh != c.num_attention_heads,
            n_layers: c.num_hidden_layers,
            vocab: c.vocab_size,
        }
    }

    /// Follows [`Family::block`] op by op: RMSNorm (in f32) saves its input as f32 and
    /// the rsqrt; a matmul saves its input when its weight is edited and the weight when
    /// its input requires grad; SDPA saves the rotated q, k, v (after the GQA repeat),
    /// output and logsumexp; the gated MLP saves the SiLU input, its output and `up`.
    fn block_saved(&self, s: i64, res_rg: bool, edited: &[String]) -> BlockSaved {
        let Dims { d, f, heads: h, q, kv, gqa, .. } = self.dims();
        let l = self.block_layers();
        let [q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj] = l.linears().map(|m| m.name);
        let mm = MatmulSaves::new(edited);
        let mut bytes = 0i64;
        if res_rg {
            bytes += d * 4 + 4; // RMSNorm in f32: input (as f32), rsqrt
        }
        if mm.is_edited(q_proj) || mm.is_edited(k_proj) || mm.is_edited(v_proj) {
            bytes += d * s;
        }
        let q_rg = mm.matmul(res_rg, q_proj);
        let k_rg = mm.matmul(res_rg, k_proj);
        let v_rg = mm.matmul(res_rg, v_proj);
        let att_rg = q_rg || k_rg || v_rg;
        if att_rg {
            let kvw = if gqa { q } else { kv };
            bytes += q * s + 2 * kvw * s + q * s + h * 4; // SDPA: rotated q, k, v, output, logsumexp
        }
        if mm.is_edited(o_proj) {
            bytes += q * s;
        }
        let o_rg = mm.matmul(att_rg, o_proj);
        let x1_rg = res_rg || o_rg;
        if x1_rg {
            bytes += d * 4 + 4;
        }
        if mm.is_edited(gate_proj) || mm.is_edited(up_proj) {
            bytes += d * s;
        }
        let g_rg = mm.matmul(x1_rg, gate_proj);
        let u_rg = mm.matmul(x1_rg, up_proj);
        if g_rg {
            bytes += f * s; // silu input
        }
        if u_rg {
            bytes += f * s; // act, saved by act·u for u's gradient
        }
        if g_rg {
            bytes += f * s; // u, saved for act's gradient
        }
        if mm.is_edited(down_proj) {
            bytes += f * s;
        }
        let m_rg = mm.matmul(g_rg || u_rg, down_proj);
        BlockSaved { per_token: bytes, output_requires_grad: x1_rg || m_rg }
    }

    fn final_norm_saved(&self, _s: i64) -> i64 {
        self.config.hidden_size * 4 + 4
    }

    fn inference_working_set(&self, s: i64) -> i64 {
        let (d, f) = (self.config.hidden_size, self.config.intermediate_size);
        (2 * d + 4 * f) * s + d * 4
    }
}
