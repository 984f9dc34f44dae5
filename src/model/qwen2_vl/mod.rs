//! Vision-language decoders: `Qwen2VLForConditionalGeneration` and
//! `Qwen2_5_VLForConditionalGeneration`.
//!
//! The text decoder is the Qwen2 block exactly (q/k/v biases, grouped-query attention,
//! SwiGLU, RMSNorm), so blocks, final norm and head are [`Llama`]'s. What differs:
//!
//! - the embedding step places image features (from [`vision`]) at the `<|image_pad|>`
//!   tokens ([`ForwardInput::image_embeds`]);
//! - the rotary tables come from M-RoPE: three position streams (temporal, height,
//!   width; [`ForwardInput::position_ids`] `[3, B, T]`), the head_dim/2 frequencies split
//!   by `mrope_section`, section `i` taking its angles from stream `i`. Text-only input
//!   has the three streams equal, which is plain RoPE.
//!
//! The vision tower is frozen by default (its weights are never in the edited set), so an
//! image's features are computed once, under `no_grad`, by [`VisionLanguage::image_features`]
//! and reused by every forward that shows the image: they are an input of the forward,
//! like the token ids, and live on the device that runs the embedding (the main device in
//! a split plan, which holds the embedding and the vision tower's weights).
//!
//! Tensor names are kept in the released checkpoints' layout (`model.layers.*`,
//! `model.embed_tokens`, `visual.*`, `lm_head`); the loader maps transformers 5's module
//! names (`model.language_model.*`, `model.visual.*`) onto it.
pub mod config;
pub mod vision;


use tch::{Kind, Tensor};

pub use config::{Qwen2VlConfig, VisionConfig, VlFamily};

use super::family::{BlockSaved, Dims, Family, VisionLanguage};
use super::llama::Llama;
use super::{position_ids, AttnMask, BlockContext, BlockIo, ForwardInput, ModelInfo, ParamView, WeightLayout};
use super::vision::{ChatTemplate, Grid, ImageProcessorConfig, VisionTokens};
use crate::{Error, Result};

/// Qwen2-VL's chat template as the released `Qwen2-VL-*-Instruct` checkpoints ship it.
pub const DEFAULT_CHAT_TEMPLATE: &str = "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}{% for message in messages %}{% if loop.first and message['role'] != 'system' %}<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n{% else %}{% for content in message['content'] %}{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}{% set image_count.value = image_count.value + 1 %}{% if add_vision_id %}Picture {{ image_count.value }}: {% endif %}<|vision_start|><|image_pad|><|vision_end|>{% elif content['type'] == 'video' or 'video' in content %}{% set video_count.value = video_count.value + 1 %}{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}<|vision_start|><|video_pad|><|vision_end|>{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}";

/// What Qwen2-VL's template renders for the one image of a turn.
const IMAGE_MARKERS: &str = "<|vision_start|><|image_pad|><|vision_end|>";

/// Qwen2-VL's released template ([`DEFAULT_CHAT_TEMPLATE`]), compiled once: the prompts
/// of a checkpoint that ships none.
pub fn default_chat_template() -> &'static ChatTemplate {
    static DEFAULT: std::sync::OnceLock<ChatTemplate> = std::sync::OnceLock::new();
    DEFAULT.get_or_init(|| {
        ChatTemplate::compile(DEFAULT_CHAT_TEMPLATE.to_string(), None, IMAGE_MARKERS).expect("the built-in Qwen2-VL template compiles")
    })
}

#[derive(Debug, Clone)]
pub struct Qwen2Vl {
    pub config: Qwen2VlConfig,
    pub architecture: String,
    /// The text decoder (built as a Qwen2 decoder from the text fields).
    text: Llama,
}

impl Qwen2Vl {
    /// From a `config.json` value of `architecture`; errors are plain messages (the
    /// loader names the file).
    pub fn from_json(json: &serde_json::Value, architecture: &str) -> Result<Self> {
        let family = VlFamily::from_architecture(architecture)
            .ok_or_else(|| Error::input(format!("{architecture:?} is not a Qwen2-VL architecture")))?;
        let config = Qwen2VlConfig::from_json(json, family)?;
        let text = Llama::new(config.text.clone(), "Qwen2ForCausalLM")?;
        Ok(Self { config, architecture: architecture.to_string(), text })
    }

    /// Maps transformers 5's module names onto the released layout used inside dualedit.
    pub fn canonical_name(name: &str) -> String {
        if let Some(rest) = name.strip_prefix("model.language_model.") {
            format!("model.{rest}")
        } else if let Some(rest) = name.strip_prefix("model.visual.") {
            format!("visual.{rest}")
        } else {
            name.to_string()
        }
    }

    fn head_dim(&self) -> i64 {
        let c = &self.config.text;
        c.head_dim.unwrap_or(c.hidden_size / c.num_attention_heads)
    }

    /// Parameters of the vision tower alone (`visual.*`), with shapes.
    pub fn vision_params(&self) -> Vec<(String, Vec<i64>)> {
        vision::expected_params(&self.config.vision)
    }

    /// M-RoPE cos/sin tables `[B, 1, T, head_dim]` for position ids `[3, B, T]`.
    fn rope(&self, pos: &Tensor, kind: Kind) -> (Tensor, Tensor) {
        let hd = self.head_dim();
        let device = pos.device();
        let exponents = Tensor::arange_start_step(0, hd, 2, (Kind::Int64, device)).to_kind(Kind::Float) / hd as f64;
        let inv_freq = Tensor::from(self.config.rope_theta as f32).to_device(device).pow(&exponents).reciprocal();
        // [3, B, T, hd/2]: every stream's angles; section i of the frequencies from stream i.
        let freqs = pos.to_kind(Kind::Float).unsqueeze(-1) * inv_freq;
        let sizes: Vec<i64> = self.config.mrope_section.to_vec();
        let parts: Vec<Tensor> =
            freqs.split_with_sizes(sizes.as_slice(), -1).iter().enumerate().map(|(i, f)| f.select(0, (i % 3) as i64)).collect();
        let f = Tensor::cat(&parts, -1);
        let emb = Tensor::cat(&[&f, &f], -1).unsqueeze(1);
        (emb.cos().to_kind(kind), emb.sin().to_kind(kind))
    }
}

/// The text side is [`Llama`]'s Qwen2 decoder in everything but the embedding step;
/// the planner's per-block description is therefore the decoder's too (the vision tower
/// runs once per image, without grad; see [`VisionLanguage::vision_forward_bytes`]).
impl Family for Qwen2Vl {
    fn info(&self) -> ModelInfo {
        let n_params = self.expected_params().iter().map(|(_, s)| s.iter().product::<i64>()).sum();
        ModelInfo { architecture: self.architecture.clone(), n_params, ..self.text.info() }
    }

    /// The text decoder's parameters, then the vision tower's.
    fn expected_params(&self) -> Vec<(String, Vec<i64>)> {
        let mut out = self.text.expected_params();
        out.extend(vision::expected_params(&self.config.vision));
        out
    }

    /// Only the text decoder's linear layers can be edited; the vision tower is frozen.
    fn layout(&self, name: &str) -> Option<WeightLayout> {
        self.text.layout(name)
    }

    fn default_edit_params(&self) -> Vec<String> {
        self.text.default_edit_params()
    }

    /// Token embeddings with the image features scattered into the `<|image_pad|>`
    /// positions, and the M-RoPE tables.
    fn embed(&self, p: &ParamView, input: &ForwardInput, past: i64) -> Result<(Tensor, BlockContext)> {
        let ids = input.input_ids;
        let (b, t) = input.dims()?;
        let mask = AttnMask::new(input.attention_mask, t, past, ids.device());
        let mut x = Tensor::embedding(p.get(super::llama::EMBED)?, ids, -1, false, false);
        let is_image = ids.eq(self.config.tokens.image_pad);
        let n_image = is_image.sum(Kind::Int64).int64_value(&[]);
        match input.image_embeds {
            Some(feats) => {
                let size = feats.size();
                if size.len() != 2 || size[0] != n_image || size[1] != self.config.text.hidden_size {
                    return Err(Error::input(format!(
                        "image features of shape {size:?} for {n_image} <|image_pad|> tokens of width {}",
                        self.config.text.hidden_size
                    )));
                }
                x = x.masked_scatter(&is_image.unsqueeze(-1), &feats.to_device(x.device()).to_kind(x.kind()));
            }
            None if n_image > 0 => {
                return Err(Error::input(format!("{n_image} <|image_pad|> tokens but no image features")));
            }
            None => {}
        }
        let pos = match input.position_ids {
            Some(pos) => {
                if pos.size() != [3, b, t] {
                    return Err(Error::input(format!("M-RoPE position ids of shape {:?}, expected [3, {b}, {t}]", pos.size())));
                }
                pos.to_device(ids.device())
            }
            None => {
                let mut pos = position_ids(ids, input.attention_mask);
                if past > 0 {
                    pos += past;
                }
                pos.unsqueeze(0).expand([3, b, t], false)
            }
        };
        let rope = self.rope(&pos, x.kind());
        Ok((x, BlockContext { batch: b, tokens: t, mask, rope: Some(rope), pad: None }))
    }

    fn block(&self, io: BlockIo) -> Result<Tensor> {
        self.text.block(io)
    }

    fn final_norm(&self, p: &ParamView, x: &Tensor) -> Result<Tensor> {
        self.text.final_norm(p, x)
    }

    fn head_weight_name(&self) -> &'static str {
        self.text.head_weight_name()
    }

    fn block_prefix(&self) -> &'static str {
        self.text.block_prefix()
    }

    fn canonical_name(&self, name: &str) -> String {
        Self::canonical_name(name)
    }

    fn dims(&self) -> Dims {
        self.text.dims()
    }

    fn block_saved(&self, s: i64, input_requires_grad: bool, edited: &[String]) -> BlockSaved {
        self.text.block_saved(s, input_requires_grad, edited)
    }

    fn final_norm_saved(&self, s: i64) -> i64 {
        self.text.final_norm_saved(s)
    }

    fn inference_working_set(&self, s: i64) -> i64 {
        self.text.inference_working_set(s)
    }

    fn vision_language(&self) -> Option<&dyn VisionLanguage> {
        Some(self)
    }
}

/// The image side: the vision tower, the `<|vision_start|>` / `<|image_pad|>` /
/// `<|vision_end|>` runs and the M-RoPE positions.
impl VisionLanguage for Qwen2Vl {
    fn tokens(&self) -> VisionTokens {
        self.config.tokens
    }

    fn merge_size(&self) -> i64 {
        self.config.vision.spatial_merge_size
    }

    /// Merged image tokens `[N, D]` for the images' pixel values `[P, patch_dim]` and
    /// grids (`P = Σ t·h·w`, `N = P / merge²`), in the weights' dtype, without autograd:
    /// compute once per image and pass as [`ForwardInput::image_embeds`].
    fn image_features(&self, p: &ParamView, pixels: &Tensor, grids: &[Grid]) -> Result<Tensor> {
        let _g = tch::no_grad_guard();
        self.image_features_trainable(p, pixels, grids)
    }

    /// [`VisionLanguage::image_features`] under the caller's autograd mode: pretraining
    /// (`dualedit pretrain --vl`) trains the vision tower, so its features must keep the
    /// graph back to the `visual.*` weights. Editing never calls this.
    fn image_features_trainable(&self, p: &ParamView, pixels: &Tensor, grids: &[Grid]) -> Result<Tensor> {
        crate::error::guard(|| vision::VisionTower { config: &self.config.vision }.forward(p, pixels, grids))
    }

    /// The token ids an image takes in a prompt: `<|vision_start|>`, one `<|image_pad|>`
    /// per merged patch, `<|vision_end|>`.
    fn image_prompt(&self, grid: &Grid) -> Vec<i64> {
        let t = &self.config.tokens;
        let n = grid.iter().product::<i64>() / self.config.vision.merge_unit();
        let mut ids = Vec::with_capacity(n as usize + 2);
        ids.push(t.vision_start);
        ids.extend(std::iter::repeat_n(t.image_pad, n as usize));
        ids.push(t.vision_end);
        ids
    }

    /// The image processor of the model in `dir` (`preprocessor_config.json`, its
    /// defaults when absent), checked against `config.json`'s vision tower.
    fn image_processor(&self, dir: &std::path::Path) -> Result<ImageProcessorConfig> {
        let path = dir.join("preprocessor_config.json");
        let proc = ImageProcessorConfig::load(&path)?;
        let v = &self.config.vision;
        if proc.patch_size != v.patch_size || proc.merge_size != v.spatial_merge_size || proc.temporal_patch_size != v.temporal_patch_size {
            return Err(Error::file(
                &path,
                format!(
                    "patch_size {} / merge_size {} / temporal_patch_size {} do not match config.json's vision_config ({} / {} / {})",
                    proc.patch_size, proc.merge_size, proc.temporal_patch_size, v.patch_size, v.spatial_merge_size, v.temporal_patch_size
                ),
            ));
        }
        Ok(proc)
    }

    fn default_chat_template(&self) -> &'static ChatTemplate {
        default_chat_template()
    }

    /// M-RoPE position ids `[3, T]` for one unpadded sequence: text tokens count up on all
    /// three streams; each run of `<|image_pad|>` tokens (one image, `grids` in order)
    /// gets (temporal, row, column) offsets from the position where it starts, and the
    /// text after it continues from that start plus the image's larger merged side.
    fn mrope_positions(&self, ids: &[i64], grids: &[Grid]) -> Result<Tensor> {
        let pad = self.config.tokens.image_pad;
        let m = self.config.vision.spatial_merge_size;
        let mut streams: [Vec<i64>; 3] = Default::default();
        let (mut pos, mut i, mut next_grid) = (0i64, 0usize, 0usize);
        while i < ids.len() {
            if ids[i] != pad {
                for s in &mut streams {
                    s.push(pos);
                }
                pos += 1;
                i += 1;
                continue;
            }
            let run = ids[i..].iter().take_while(|&&t| t == pad).count();
            let g = grids.get(next_grid).ok_or_else(|| {
                Error::input(format!("the prompt has more image runs than the {} image(s) given", grids.len()))
            })?;
            let (lt, lh, lw) = (g[0], g[1] / m, g[2] / m);
            if (lt * lh * lw) as usize != run {
                return Err(Error::input(format!(
                    "image {next_grid} has {} merged patches but the prompt has {run} <|image_pad|> tokens for it",
                    lt * lh * lw
                )));
            }
            for t in 0..lt {
                for h in 0..lh {
                    for w in 0..lw {
                        streams[0].push(pos + t);
                        streams[1].push(pos + h);
                        streams[2].push(pos + w);
                    }
                }
            }
            pos += lh.max(lw);
            i += run;
            next_grid += 1;
        }
        if next_grid != grids.len() {
            return Err(Error::input(format!("{} image(s) given but the prompt has {next_grid} image run(s)", grids.len())));
        }
        let flat: Vec<i64> = streams.concat();
        Ok(Tensor::from_slice(&flat).reshape([3, ids.len() as i64]))
    }

    /// The forward runs without grad, so one block's working set is alive at a time: the
    /// residual stream, the norm's output, q/k/v, the rotary f32 copies of q and k, the
    /// attention output, the MLP's hidden layer (twice: activation and product), and the
    /// attention scores of the largest segment (the whole image in full-attention blocks;
    /// a fused kernel does not form them, so this is an upper bound); plus the f32 pixel
    /// rows and their cast, the rotary tables, and the merged output.
    fn vision_forward_bytes(&self, grid: &Grid, s: i64) -> (i64, String) {
        let v = &self.config.vision;
        let n = grid.iter().product::<i64>();
        let merged = n / v.merge_unit();
        let (e, f, heads, pd, u) = (v.width, v.mlp_hidden, v.num_heads, v.patch_dim(), v.merge_unit());
        let per_block = n * (e * 6 + 2 * f) * s + n * 2 * e * 4 + heads * n * n * s;
        let fixed = n * pd * (4 + s) + n * v.head_dim() * 2 * 4 + merged * (2 * e * u + v.out_dim) * s;
        let formula = format!(
            "N·(patch·(4+s) + 2·hd·4) + N·((6E+2F)·s + 2E·4) + H·N²·s + N/{u}·(2·{u}E+D)·s, N={n} E={e} F={f} H={heads}"
        );
        (fixed + per_block, formula)
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_default_template_renders_qwen2_vls_prompt() {
        let p = super::default_chat_template().image_prompt(" What is this? ").unwrap();
        assert_eq!(
            p,
            "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>What is this?<|im_end|>\n<|im_start|>assistant\n"
        );
    }
}
