//! The one interface a model family implements.
//!
//! Everything the rest of the crate knows about an architecture comes through [`Family`]:
//! the forward dispatcher ([`super::Model`]), the loader (tensor names and shapes) and the
//! memory planner (sizes, and what a block's forward keeps for the backward); the image
//! side of a vision-language family comes through [`VisionLanguage`]. Adding a family is
//! one new file (or folder) implementing them, its `pub mod` line and its entry in
//! [`super::loader::FAMILIES`] (ARCHITECTURE.md, "How to add a model family").
use std::path::Path;

use tch::Tensor;

use super::layers::Linear;
use super::params::Prefix;
use super::{BlockContext, BlockIo, ForwardInput, ModelInfo, ParamView, WeightLayout};
use super::vision::{ChatTemplate, Grid, ImageProcessorConfig, VisionTokens};
use crate::Result;

/// The sizes of a decoder that the memory planner needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Dims {
    /// Residual width.
    pub d: i64,
    /// MLP inner size.
    pub f: i64,
    pub heads: i64,
    /// Width of q (heads · head_dim).
    pub q: i64,
    /// Width of k and v (kv heads · head_dim).
    pub kv: i64,
    /// Whether k/v are repeated to the query heads (grouped-query attention).
    pub gqa: bool,
    pub n_layers: i64,
    pub vocab: i64,
}

/// What one block's forward keeps alive for the backward, as the planner counts it.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct BlockSaved {
    /// Bytes per token saved by the block's ops.
    pub per_token: i64,
    /// Whether the block's output requires grad (so the next block's ops save their inputs).
    pub output_requires_grad: bool,
}

/// A model family: its tensors, its forward in pieces, and its memory shape.
///
/// The forward is split into [`Family::embed`], [`Family::block`] (one per layer) and
/// [`Family::final_norm`] + the LM head, so that callers can run blocks one at a time
/// (recomputation in the backward) and so that [`super::Model`] owns the one forward loop.
/// Weights always come from a [`ParamView`]; a family holds only its configuration.
pub trait Family: std::fmt::Debug + Send + Sync {
    /// Architecture name, sizes and parameter count.
    fn info(&self) -> ModelInfo;

    /// Every parameter the forward reads, with its shape (the loader checks checkpoints
    /// against this list, the planner counts weight bytes from it).
    fn expected_params(&self) -> Vec<(String, Vec<i64>)>;

    /// Layout of a 2-D weight of a linear layer, `None` if `name` is not one.
    fn layout(&self, name: &str) -> Option<WeightLayout>;

    /// MEND's default edited weights for this family (EasyEdit's choice).
    fn default_edit_params(&self) -> Vec<String>;

    /// Prefix of per-block parameter names, up to the block index (`model.layers.`).
    fn block_prefix(&self) -> &'static str;

    /// The module path of block `i` (`model.layers.3`), under which the block's layers
    /// name their tensors.
    fn block_path(&self, i: usize) -> Prefix {
        Prefix::new(format!("{}{i}", self.block_prefix()))
    }

    /// The name this family reads a checkpoint tensor under (older writers dropped or
    /// changed prefixes); identity by default.
    fn canonical_name(&self, name: &str) -> String {
        name.to_string()
    }

    /// Hidden states the first block reads, `[B, T, D]`, and what the blocks share.
    /// `past` is the number of tokens already in a KV cache (0 without one).
    fn embed(&self, p: &ParamView, input: &ForwardInput, past: i64) -> Result<(Tensor, BlockContext)>;

    /// Block `io.layer` (0-based) applied to its input `io.x` `[B, T, D]`; records `(x, h)`
    /// of the layers whose weights are in `io.capture`, and extends `io.cache` when there
    /// is one.
    fn block(&self, io: BlockIo) -> Result<Tensor>;

    /// The final norm over the last block's output, `[.., D]` -> `[.., D]`.
    fn final_norm(&self, p: &ParamView, x: &Tensor) -> Result<Tensor>;

    /// Name of the LM head's weight `[vocab, D]` (the embedding when tied).
    fn head_weight_name(&self) -> &'static str;

    /// Parameters outside the blocks that only the final norm and the head read: the layer
    /// split (`--placement balanced`) keeps them on the device of the last block, every
    /// other non-block parameter with the embedding. The default takes the head weight
    /// (unless it is tied, see [`Family::head_is_tied`]) and the non-block parameters named
    /// `…ln_f.*` or `[….]norm.*` outside any numbered module; a family whose names differ
    /// (a vision tower with its own `norm`) overrides it.
    fn head_params(&self) -> Vec<String> {
        let prefix = self.block_prefix();
        let head = self.head_weight_name();
        let tied = self.head_is_tied();
        self.expected_params()
            .into_iter()
            .map(|(n, _)| n)
            .filter(|n| !n.starts_with(prefix))
            .filter(|n| {
                if n == head {
                    return !tied;
                }
                let stem = n.rsplit_once('.').map_or(n.as_str(), |(s, _)| s);
                let numbered = stem.split('.').any(|c| c.chars().all(|ch| ch.is_ascii_digit()));
                let last = stem.rsplit('.').next().unwrap_or(stem);
                !numbered && (last == "ln_f" || last == "norm")
            })
            .collect()
    }

    /// Whether the head reads the input embedding (so the layer split needs it on both
    /// devices). Default: the head weight's name does not say `lm_head`.
    fn head_is_tied(&self) -> bool {
        !self.head_weight_name().contains("lm_head")
    }

    /// Sizes for the memory planner.
    fn dims(&self) -> Dims;

    /// What block `matrices`' forward keeps for the backward at `s` bytes per element,
    /// given whether its input requires grad and which of its matrices are edited (names
    /// relative to the block, without `.weight`: `mlp.up_proj`). Must follow
    /// [`Family::block`] op by op; `tests/slow/planner.rs` measures it against the real forward.
    fn block_saved(&self, s: i64, input_requires_grad: bool, edited: &[String]) -> BlockSaved;

    /// Bytes per token the final norm saves when its input requires grad.
    fn final_norm_saved(&self, s: i64) -> i64;

    /// Bytes per token alive in one block of a forward without grad (its working set).
    fn inference_working_set(&self, s: i64) -> i64;

    /// The image side of a vision-language family (vision tower, prompt layout, M-RoPE
    /// positions); `None` for text-only families.
    fn vision_language(&self) -> Option<&dyn VisionLanguage> {
        None
    }
}

/// The image side of a vision-language family: everything the rest of the crate needs to
/// put images into a prompt and a forward, so that callers outside `model/` never name a
/// concrete family. A second VL family implements this next to [`Family`] and returns
/// itself from [`Family::vision_language`].
///
/// Image features are inputs of a forward like token ids ([`ForwardInput::image_embeds`],
/// positions in [`ForwardInput::position_ids`]); the tower is frozen, so they are computed
/// once per image.
pub trait VisionLanguage: std::fmt::Debug + Send + Sync {
    /// The special tokens an image prompt is made of.
    fn tokens(&self) -> VisionTokens;

    /// Patches per side merged into one text token (`spatial_merge_size`).
    fn merge_size(&self) -> i64;

    /// Patches merged into one text token (`merge_size²`).
    fn merge_unit(&self) -> i64 {
        self.merge_size() * self.merge_size()
    }

    /// Merged image tokens `[N, D]` for the images' pixel values `[P, patch_dim]` and
    /// grids (`P = Σ t·h·w`, `N = P / merge_unit`), in the weights' dtype, without
    /// autograd: compute once per image and pass as [`ForwardInput::image_embeds`].
    fn image_features(&self, p: &ParamView, pixels: &Tensor, grids: &[Grid]) -> Result<Tensor>;

    /// [`VisionLanguage::image_features`] under the caller's autograd mode: pretraining
    /// trains the vision tower, so its features must keep the graph back to the tower's
    /// weights. Editing never calls this.
    fn image_features_trainable(&self, p: &ParamView, pixels: &Tensor, grids: &[Grid]) -> Result<Tensor>;

    /// The token ids an image of `grid` takes in a prompt (start marker, one pad per
    /// merged patch, end marker).
    fn image_prompt(&self, grid: &Grid) -> Vec<i64>;

    /// Rotary position ids `[3, T]` (temporal, height, width) for one unpadded sequence
    /// whose image runs show `grids` in order.
    fn mrope_positions(&self, ids: &[i64], grids: &[Grid]) -> Result<Tensor>;

    /// The image processor of the model in `dir` (`preprocessor_config.json`, its
    /// defaults when absent), checked against the model's vision tower.
    fn image_processor(&self, dir: &Path) -> Result<ImageProcessorConfig>;

    /// The family's released chat template: the prompts of a checkpoint that ships none.
    fn default_chat_template(&self) -> &'static ChatTemplate;

    /// The chat template of the model in `dir` (its own, else the family's default; see
    /// [`ChatTemplate::load`]): how an image prompt is worded for this checkpoint.
    fn chat_template(&self, dir: &Path) -> Result<ChatTemplate> {
        ChatTemplate::load(dir, self.default_chat_template())
    }

    /// Bytes alive at the peak of the tower's forward (without grad) over one image of
    /// `grid` at `s` bytes per element, and the formula as text for the plan: the
    /// planner's image cost, described by the family that knows its tower.
    fn vision_forward_bytes(&self, grid: &Grid, s: i64) -> (i64, String);
}

/// What a block's matmuls save, for [`Family::block_saved`]: a matmul saves its input when
/// its weight is edited (it requires grad, or its factored edit's `a` does), and its output
/// requires grad when either its input or its weight does. (Meta-training keeps the edit
/// factored, so no edited weight `W'` is kept by the graph.)
pub struct MatmulSaves<'a> {
    edited: &'a [String],
}

impl<'a> MatmulSaves<'a> {
    pub fn new(edited: &'a [String]) -> Self {
        Self { edited }
    }

    pub fn is_edited(&self, m: &str) -> bool {
        self.edited.iter().any(|x| x == m)
    }

    /// Matmul `m` with an input that does (`input_rg`) or does not require grad: whether
    /// its output requires grad.
    pub fn matmul(&self, input_rg: bool, m: &str) -> bool {
        input_rg || self.is_edited(m)
    }
}

/// The layout of `name` when it is the weight of one of a block's `linears` (`<prefix><i>.<linear>.weight`).
pub fn block_layout(prefix: &str, name: &str, linears: &[&Linear]) -> Option<WeightLayout> {
    let (_, m) = split_block_name(prefix, name)?;
    linears.iter().find(|l| l.name == m).map(|l| l.layout)
}

/// Block index and matrix (`mlp.c_fc`) of a weight named `<prefix><i>.<matrix>.weight`.
pub fn split_block_name(prefix: &str, name: &str) -> Option<(i64, String)> {
    let (idx, m) = name.strip_prefix(prefix)?.split_once('.')?;
    let m = m.strip_suffix(".weight")?;
    Some((idx.parse().ok()?, m.to_string()))
}
