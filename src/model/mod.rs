//! Causal language models as plain Rust over tch, one file per family.
//!
//! Every forward is functional (weights come from a [`ParamView`]) and reports, for the
//! linear layers the caller names, their input `x` and output `h`: tch has no hooks, and
//! MEND reads its gradient factors from exactly those two tensors.
pub mod family;
pub mod gpt2;
pub mod kv_cache;
pub mod layers;
pub mod llama;
pub mod loader;
pub mod params;
pub mod qwen2_vl;
pub mod recompute;
pub mod tokenizer;
pub mod vision;

use std::collections::{BTreeMap, HashSet};
use std::sync::Arc;

use tch::{Device, Tensor};

pub use family::{Family, VisionLanguage};
pub use kv_cache::KvCache;
pub use loader::{load_model, load_model_split, model_dtype, parse_dtype, random_params, Dtype, DtypeSource, LoadedModel};
pub use params::{Crossing, LayerSplit, LowRank, Overrides, RowScaled, ParamStore, ParamView, Prefix, Scope};
pub use tokenizer::Tokenizer;

use crate::Result;

/// How a 2-D weight maps inputs to outputs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum WeightLayout {
    /// `torch.nn.Linear`: weight is `[d_out, d_in]`, `h = x Wᵀ + b`.
    Linear,
    /// GPT-2's `Conv1D`: weight is `[d_in, d_out]`, `h = x W + b`.
    Conv1d,
}

impl WeightLayout {
    /// `(d_in, d_out)` of a weight of this layout.
    pub fn in_out(self, shape: &[i64]) -> (i64, i64) {
        match self {
            WeightLayout::Linear => (shape[1], shape[0]),
            WeightLayout::Conv1d => (shape[0], shape[1]),
        }
    }

    /// `Σ_rows δ xᵀ` in this layout's orientation: the weight gradient of a layer whose
    /// rows had inputs `x` `[N, d_in]` and output gradients `δ` `[N, d_out]`.
    pub fn outer(self, x: &Tensor, delta: &Tensor) -> Tensor {
        match self {
            WeightLayout::Linear => delta.tr().matmul(x),
            WeightLayout::Conv1d => x.tr().matmul(delta),
        }
    }

    /// `W + Σ_rows δ xᵀ` in this layout's orientation, as one GEMM accumulating into W.
    pub fn add_outer(self, w: &Tensor, x: &Tensor, delta: &Tensor) -> Tensor {
        match self {
            WeightLayout::Linear => w.addmm(&delta.tr().contiguous(), &x.contiguous()),
            WeightLayout::Conv1d => w.addmm(&x.tr().contiguous(), &delta.contiguous()),
        }
    }

    /// Applies the layer, `h = x·W (+ b)` in this layout.
    ///
    /// On CPU with few rows (an edit's capture, a meta-training micro-batch) the product is
    /// computed as `(A·xᵀ)ᵀ` with `A` the weight as `[d_out, d_in]`: libtorch's CPU GEMM
    /// picks a slow kernel for `x·Aᵀ` when `x` is skinny, and the transposed product
    /// measured 35 % faster for GPT-2-small's layers at 16–48 rows and still 10 % faster
    /// at 256, with the backward no slower (docs/notebook/mend-step.md). Larger batches keep the
    /// plain product, which wins there. In f32 the threshold is [`SKINNY_ROWS_F32`]:
    /// Qwen2-VL's 188-row text forward (512 → 1408) measured 7–40 % slower that way (#35).
    pub fn apply(self, x: &Tensor, w: &Tensor, b: Option<&Tensor>) -> Tensor {
        let d_in = *x.size().last().unwrap_or(&0);
        let rows = x.numel() as i64 / d_in.max(1);
        let skinny = if x.kind() == tch::Kind::Float { SKINNY_ROWS_F32 } else { SKINNY_ROWS };
        if x.device() == Device::Cpu && rows > 0 && rows <= skinny {
            let a = match self {
                WeightLayout::Linear => w.shallow_clone(),
                WeightLayout::Conv1d => w.tr(),
            };
            let mut shape = x.size();
            if let Some(last) = shape.last_mut() {
                *last = a.size()[0];
            }
            return with_bias(a.matmul(&x.reshape([rows, d_in]).tr()).tr().reshape(shape), b);
        }
        match self {
            WeightLayout::Linear => x.linear(w, b),
            WeightLayout::Conv1d => with_bias(x.matmul(w), b),
        }
    }
}

/// Input and output of one captured linear layer.
#[derive(Debug)]
pub struct Capture {
    /// The layer's input, `[B, T, d_in]`.
    pub x: Tensor,
    /// The layer's output before any activation, `[B, T, d_out]`.
    pub h: Tensor,
    /// When the layer ran at some query rows only (the last block of a forward with
    /// `keep`, see [`QueryRows`]): the flat position `b·T + t` of each row of `x` and `h`
    /// (`[B·M]` int64; then `x` is `[B, M, d_in]`). `None`: every position, in order.
    pub rows: Option<Tensor>,
}

/// What one forward pass is asked to do.
pub struct ForwardInput<'a> {
    /// Token ids, `[B, T]` int64.
    pub input_ids: &'a Tensor,
    /// 1 for real tokens, 0 for padding, `[B, T]`; `None` when nothing is padded.
    pub attention_mask: Option<&'a Tensor>,
    /// Positions whose logits are wanted, bool `[B, T]`; `None` for all of them. The LM
    /// head is the largest matmul with big vocabularies: computing it only where a label
    /// is scored saves both time and the largest activation.
    pub keep: Option<&'a Tensor>,
    /// Weight names whose layer input/output to return.
    pub capture: &'a HashSet<String>,
    /// M-RoPE position ids `[3, B, T]` (temporal, height, width) for vision-language
    /// models; `None`: positions from the padding mask, equal on all three streams.
    pub position_ids: Option<&'a Tensor>,
    /// Image features `[N, D]` placed, in order, at the N `<|image_pad|>` tokens of
    /// `input_ids` (vision-language models; see [`VisionLanguage::image_features`]).
    pub image_embeds: Option<&'a Tensor>,
    /// This input's activations entering a block, computed beforehand by
    /// [`Model::prefix_to`] (under a layer split at or above its boundary, and already
    /// crossed); the forward then starts at that block instead of running the embedding
    /// and the blocks below it again (their output does not depend on any edited
    /// weight). `None`: from the embedding.
    pub entry: Option<&'a Boundary>,
    /// Run the last block at every position even with `keep`. By default (false) a
    /// forward with `keep` and no KV cache runs the last block's queries, attention output,
    /// o_proj and MLP only at the kept positions ([`QueryRows`]), since nothing else reads
    /// them; its captured layers then cover those rows only ([`Capture::rows`]). A caller
    /// that reads the last block's captured inputs at every token sets this.
    pub full_last_block: bool,
}

impl<'a> ForwardInput<'a> {
    pub fn new(input_ids: &'a Tensor, capture: &'a HashSet<String>) -> Self {
        Self { input_ids, attention_mask: None, keep: None, capture, position_ids: None, image_embeds: None, entry: None, full_last_block: false }
    }

    /// `(B, T)`, after checking the shapes a caller handed in: `input_ids` is `[B, T]`
    /// integer ids, and the mask and `keep` (when given) are `[B, T]` too. A forward
    /// checks this first, so a wrong rank is an error, never an indexing panic.
    pub fn dims(&self) -> Result<(i64, i64)> {
        let (b, t) = match self.input_ids.size()[..] {
            [b, t] => (b, t),
            ref other => return Err(crate::Error::input(format!("input_ids must be [batch, tokens], got shape {other:?}"))),
        };
        if !matches!(self.input_ids.kind(), tch::Kind::Int64 | tch::Kind::Int) {
            return Err(crate::Error::input(format!("input_ids must be integer token ids, got {:?}", self.input_ids.kind())));
        }
        for (name, t_) in [("attention_mask", self.attention_mask), ("keep", self.keep)] {
            if let Some(m) = t_.filter(|m| m.size() != [b, t]) {
                return Err(crate::Error::input(format!("{name} has shape {:?}, expected [{b}, {t}] like input_ids", m.size())));
            }
        }
        Ok((b, t))
    }
}

/// What every block of one forward shares: shapes, the attention mask, the rotary tables.
///
/// Built by [`Model::embed`] together with the hidden states the first block reads;
/// [`Model::block`] runs one block, [`Model::head`] the final norm and LM head. Running
/// embed, every block and the head in turn is exactly [`Model::forward`] (which does
/// that); a caller that needs the blocks one at a time (recomputation in the backward,
/// see [`recompute`]) uses them directly.
pub struct BlockContext {
    pub(crate) batch: i64,
    pub(crate) tokens: i64,
    pub(crate) mask: AttnMask,
    /// cos/sin tables `[B, 1, T, head_dim]` (rotary families only).
    pub(crate) rope: Option<(Tensor, Tensor)>,
    /// Real tokens, bool `[B, T]`, of a padded batch without a KV cache (LLaMA family: the
    /// MLP then runs at these rows only); `None` when nothing is padded.
    pub(crate) pad: Option<Tensor>,
}

impl BlockContext {
    /// The same context on the sub-device side of a layer split's boundary: the mask and
    /// rotary tables carried across (`[B, 1, T, S]` bool, `[B, 1, T, head_dim]` each).
    pub(crate) fn crossed(&self, c: &dyn Crossing) -> BlockContext {
        let mask = match &self.mask {
            AttnMask::Causal => AttnMask::Causal,
            AttnMask::All => AttnMask::All,
            AttnMask::Keys(m) => AttnMask::Keys(c.to_sub(m)),
        };
        let (rope, pad) = (self.rope.as_ref().map(|(a, b)| (c.to_sub(a), c.to_sub(b))), self.pad.as_ref().map(|p| c.to_sub(p)));
        BlockContext { batch: self.batch, tokens: self.tokens, mask, rope, pad }
    }

    /// New handles to the same tensors.
    fn shallow_clone(&self) -> BlockContext {
        let rope = self.rope.as_ref().map(|(a, b)| (a.shallow_clone(), b.shallow_clone()));
        BlockContext { batch: self.batch, tokens: self.tokens, mask: self.mask.shallow_clone(), rope, pad: self.pad.as_ref().map(Tensor::shallow_clone) }
    }

    /// The context of the `n` rows `pick` takes of a `[B, …]` tensor (a batch whose
    /// examples are some of this one's rows, right-padded to `t` ≤ `self.tokens`).
    fn rows(&self, n: i64, t: i64, pick: impl Fn(&Tensor) -> Tensor) -> BlockContext {
        let mask = match &self.mask {
            AttnMask::Keys(m) if m.dim() == 4 => AttnMask::Keys(pick(m).narrow(2, 0, t).narrow(3, 0, t)),
            AttnMask::Keys(m) => AttnMask::Keys(m.narrow(0, 0, t).narrow(1, 0, t)),
            other => other.shallow_clone(),
        };
        let cut = |x: &Tensor| pick(x).narrow(2, 0, t);
        BlockContext { batch: n, tokens: t, mask, rope: self.rope.as_ref().map(|(a, b)| (cut(a), cut(b))), pad: self.pad.as_ref().map(|p| pick(p).narrow(1, 0, t)) }
    }
}

/// One block's forward inputs and outputs, bundled (as mistral.rs bundles its attention
/// inputs): what [`Family::block`] reads besides its own configuration, so that the five
/// places that run or implement a block share one signature instead of seven arguments.
pub struct BlockIo<'a> {
    /// Where the weights come from: the frozen store with the edited names overridden.
    pub params: &'a ParamView<'a>,
    /// The block's index, 0-based (names its weights, selects its KV cache slot).
    pub layer: usize,
    /// The block's input, `[B, T, D]`.
    pub x: &'a Tensor,
    /// What every block shares: shapes, attention mask, rotary tables.
    pub ctx: &'a BlockContext,
    /// Weight names whose layer input and output to record.
    pub capture: &'a HashSet<String>,
    /// Where the recorded `(x, h)` go, by weight name.
    pub captures: &'a mut BTreeMap<String, Capture>,
    /// The KV cache the block extends, when decoding with one.
    pub cache: Option<&'a mut KvCache>,
    /// Compute the block's output only at these query rows (keys and values still over
    /// every position): the block returns `[B, M, D]` instead of `[B, T, D]`. For the last
    /// block of a forward read only at its `keep` positions; never with a cache.
    pub rows: Option<&'a QueryRows>,
}

impl<'a> BlockIo<'a> {
    /// Block `layer` over `x` with nothing captured and no cache (recorded layers would go
    /// to `scratch`, which stays empty).
    pub fn plain(params: &'a ParamView<'a>, layer: usize, x: &'a Tensor, ctx: &'a BlockContext, none: &'a HashSet<String>, scratch: &'a mut BTreeMap<String, Capture>) -> Self {
        BlockIo { params, layer, x, ctx, capture: none, captures: scratch, cache: None, rows: None }
    }
}

/// The query rows of a block whose output is read only at some positions (the kept ones
/// of the last block): per example its kept positions in order, padded to the longest
/// example's count `M` by repeating its last one. The block then computes its queries,
/// attention output, o_proj and MLP over `[B, M]` rows instead of `[B, T]`: exact, since
/// every op but attention is row-wise and attention still reads every key and value.
/// A padding row repeats a real one; nothing reads its output, so it gets no gradient.
#[derive(Debug)]
pub struct QueryRows {
    /// Positions `[B, M]` int64.
    pub pos: Tensor,
    /// Flat positions `b·T + t` of the `B·M` rows, `[B·M]` int64 (what a row stands for).
    pub flat: Tensor,
    /// The kept rows among the `B·M`, in `keep`'s row-major order, `[N]` int64: the
    /// block's output at `keep` is `out.reshape([-1, D]).index_select(0, kept)`.
    pub kept: Tensor,
    /// `M`.
    pub m: i64,
}

impl QueryRows {
    /// The rows of `keep` (`[B, T]` bool), on its device; `None` when there is no saving
    /// (some example keeps every position, or none is kept at all).
    pub fn from_keep(keep: &Tensor) -> Result<Option<QueryRows>> {
        let (b, t) = match keep.size()[..] {
            [b, t] => (b, t),
            ref other => return Err(crate::Error::Internal(format!("keep of shape {other:?}, expected [batch, tokens]"))),
        };
        let flags = Vec::<i64>::try_from(keep.reshape([-1]).to_kind(tch::Kind::Int64).to_device(Device::Cpu))?;
        let per: Vec<Vec<i64>> = flags.chunks(t.max(1) as usize).map(|r| (0..t).filter(|&i| r[i as usize] != 0).collect()).collect();
        let m = per.iter().map(Vec::len).max().unwrap_or(0) as i64;
        if m == 0 || m >= t {
            return Ok(None);
        }
        let (mut pos, mut kept) = (Vec::with_capacity((b * m) as usize), Vec::new());
        for (row, p) in per.iter().enumerate() {
            let last = p.last().copied().unwrap_or(0);
            for j in 0..m {
                if (j as usize) < p.len() {
                    kept.push(row as i64 * m + j);
                }
                pos.push(p.get(j as usize).copied().unwrap_or(last));
            }
        }
        let flat: Vec<i64> = pos.iter().enumerate().map(|(i, &p)| (i as i64 / m) * t + p).collect();
        let device = keep.device();
        let mk = |v: &[i64]| Tensor::from_slice(v).to_device(device);
        Ok(Some(QueryRows { pos: mk(&pos).reshape([b, m]), flat: mk(&flat), kept: mk(&kept), m }))
    }

    /// Rows `[B, T, ..]` -> `[B, M, ..]` at these positions.
    pub fn gather(&self, x: &Tensor) -> Tensor {
        let size = x.size();
        let mut out: Vec<i64> = size.clone();
        out[1] = self.m;
        let rest: i64 = size[2..].iter().product();
        x.reshape([size[0] * size[1], rest]).index_select(0, &self.flat).reshape(out)
    }

    /// The rotary tables `[B, 1, T, hd]` at these rows, `[B, 1, M, hd]`.
    pub(crate) fn gather_rope(&self, t: &Tensor) -> Tensor {
        self.gather(&t.squeeze_dim(1)).unsqueeze(1)
    }

    /// The attention mask of these query rows over the `t` keys, `[B, 1, M, t]`.
    pub(crate) fn mask(&self, mask: &AttnMask, t: i64) -> AttnMask {
        let b = self.pos.size()[0];
        match mask {
            AttnMask::Causal => {
                let keys = Tensor::arange(t, (tch::Kind::Int64, self.pos.device())).reshape([1, 1, 1, t]);
                AttnMask::Keys(keys.le_tensor(&self.pos.reshape([b, 1, self.m, 1])))
            }
            AttnMask::Keys(m) if m.dim() == 4 => AttnMask::Keys(self.gather(&m.squeeze_dim(1)).unsqueeze(1)),
            AttnMask::Keys(m) => AttnMask::Keys(m.index_select(0, &self.pos.reshape([-1])).reshape([b, 1, self.m, -1])),
            AttnMask::All => AttnMask::All,
        }
    }

    /// Records, for the captured layers among `names` (full weight names), that they ran
    /// at these rows.
    pub(crate) fn mark(&self, captures: &mut BTreeMap<String, Capture>, names: impl IntoIterator<Item = String>) {
        for n in names {
            if let Some(c) = captures.get_mut(&n) {
                c.rows = Some(self.flat.shallow_clone());
            }
        }
    }
}

/// A batch's prefix activations: the output of the embedding and the blocks below `at`
/// (no grad; under a layer split on the sub-device after one crossing), with what the
/// blocks above share. The prefix depends on no edited weight (every edited block is at
/// or above `at`), so one `Boundary` serves the unedited forward, the capture and every
/// edited forward of the same batch ([`ForwardInput::entry`]), in every placement.
pub struct Boundary {
    /// The first block the forwards starting here run (under a layer split, at or above
    /// the first block on the sub-device).
    pub at: usize,
    /// Hidden states entering block `at`, `[B, T, D]`, where block `at` runs.
    pub x: Tensor,
    ctx: BlockContext,
}

impl std::fmt::Debug for Boundary {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Boundary").field("at", &self.at).field("x", &self.x.size()).finish()
    }
}

impl Boundary {
    /// What the blocks above the boundary share (new handles).
    pub(crate) fn context(&self) -> BlockContext {
        self.ctx.shallow_clone()
    }

    /// Bytes of the hidden states `[B, T, D]` (what [`Model::prefix`] carried across).
    pub fn nbytes(&self) -> u64 {
        (self.x.numel() * self.x.kind().elt_size_in_bytes()) as u64
    }

    /// New handles to the same tensors.
    pub fn shallow_clone(&self) -> Boundary {
        Boundary { at: self.at, x: self.x.shallow_clone(), ctx: self.ctx.shallow_clone() }
    }

    /// The boundary of rows `[row, row + n)` of this batch, cut to their first `t` tokens:
    /// that of a batch of those examples alone, right-padded to `t` (attention is causal,
    /// so the first `t` positions never read the later ones). No copy, nothing crosses.
    pub fn narrow(&self, row: i64, n: i64, t: i64) -> Result<Boundary> {
        let size = self.x.size();
        if row < 0 || n < 1 || row + n > size[0] || t < 1 || t > size[1] {
            return Err(crate::Error::Internal(format!("boundary rows {row}..{} and {t} tokens of a {size:?} batch", row + n)));
        }
        Ok(Boundary { at: self.at, x: self.x.narrow(0, row, n).narrow(1, 0, t), ctx: self.ctx.rows(n, t, |x| x.narrow(0, row, n)) })
    }

    /// [`Boundary::narrow`] for rows `rows` (in that order) that need not be one run (the
    /// guard's probes an edit's scale can change, [`crate::mend::guard`]). Copies them.
    pub fn select(&self, rows: &[i64], t: i64) -> Result<Boundary> {
        let size = self.x.size();
        if rows.is_empty() || rows.iter().any(|r| *r < 0 || *r >= size[0]) || t < 1 || t > size[1] {
            return Err(crate::Error::Internal(format!("boundary rows {rows:?} and {t} tokens of a {size:?} batch")));
        }
        let idx = Tensor::from_slice(rows).to_device(self.x.device());
        crate::error::guard(|| Ok(Boundary { at: self.at, x: self.x.index_select(0, &idx).narrow(1, 0, t), ctx: self.ctx.rows(idx.size()[0], t, |x| x.index_select(0, &idx)) }))
    }
}

pub struct ForwardOutput {
    /// `[B, T, V]`, or `[N, V]` for the N kept positions in row-major order.
    pub logits: Tensor,
    pub captures: BTreeMap<String, Capture>,
}

/// Family-independent facts about a loaded architecture.
#[derive(Debug, Clone, serde::Serialize)]
pub struct ModelInfo {
    pub architecture: String,
    pub vocab_size: i64,
    pub hidden_size: i64,
    pub n_layers: i64,
    pub max_positions: i64,
    pub n_params: i64,
}

/// A loaded architecture (weights live in a [`ParamStore`], not here): one [`Family`]
/// behind the one forward loop. Cheap to clone (the family is shared).
#[derive(Debug, Clone)]
pub struct Model(Arc<dyn Family>);

impl Model {
    pub fn new(family: impl Family + 'static) -> Self {
        Self(Arc::new(family))
    }

    /// The family, for what the forward loop does not cover (the planner's sizes).
    pub fn family(&self) -> &dyn Family {
        self.0.as_ref()
    }

    /// The forward; under a layer split the logits come back to the main device, where
    /// the input is.
    pub fn forward(&self, p: &ParamView, input: &ForwardInput) -> Result<ForwardOutput> {
        crate::error::guard(|| self.forward_with(p, input, None, true))
    }

    /// [`Model::forward`] with the logits left where the head ran (the sub-device under a
    /// layer split), for losses computed there.
    pub fn forward_to_head_side(&self, p: &ParamView, input: &ForwardInput) -> Result<ForwardOutput> {
        crate::error::guard(|| self.forward_with(p, input, None, false))
    }

    /// The forward without the LM head: `logits` holds the final normalised hidden states
    /// at the kept positions (`[N, D]`, or `[B, T, D]` without `keep`), for callers that
    /// apply the head themselves ([`lm_head`], [`lm_head_input_grad`]).
    pub fn forward_hidden(&self, p: &ParamView, input: &ForwardInput) -> Result<ForwardOutput> {
        crate::error::guard(|| {
            let (x, captures, rows) = self.run_blocks(p, input, None)?;
            let keep = input.keep.map(|k| head_side(p, k));
            Ok(ForwardOutput { logits: kept_hidden(self.final_norm(p, &x)?, keep.as_ref(), rows.as_ref()), captures })
        })
    }

    /// Embedding, every block, head: the one forward loop of all families, continuing
    /// after the tokens in `cache` when there is one.
    /// `back`: under a layer split, carry the logits back to the main device.
    fn forward_with(&self, p: &ParamView, input: &ForwardInput, cache: Option<&mut KvCache>, back: bool) -> Result<ForwardOutput> {
        let (x, captures, rows) = self.run_blocks(p, input, cache)?;
        let keep = input.keep.map(|k| head_side(p, k));
        let logits = self.head_at(p, &x, keep.as_ref(), rows.as_ref())?;
        let logits = match p.layer_split() {
            Some(s) if back => s.cross.to_main(&logits),
            _ => logits,
        };
        Ok(ForwardOutput { logits, captures })
    }

    /// Embedding and every block: the last block's output and the captured layers, and
    /// the query rows the last block ran at ([`Model::query_rows`]; its output is then
    /// `[B, M, D]`).
    fn run_blocks(
        &self,
        p: &ParamView,
        input: &ForwardInput,
        mut cache: Option<&mut KvCache>,
    ) -> Result<(Tensor, BTreeMap<String, Capture>, Option<QueryRows>)> {
        input.dims()?;
        let mut captures = BTreeMap::new();
        let past = cache.as_ref().map_or(0, |c| c.len());
        let (start, mut x, mut ctx) = match input.entry {
            Some(e) => {
                if cache.is_some() {
                    return Err(crate::Error::Internal("a forward from boundary activations cannot extend a KV cache".into()));
                }
                self.check_entry(p, input, e)?;
                (e.at, e.x.shallow_clone(), e.ctx.shallow_clone())
            }
            None => {
                let (x, ctx) = self.embed(p, input, past)?;
                (0, x, ctx)
            }
        };
        let n = self.n_blocks();
        let rows = if start < n && cache.is_none() { self.query_rows(p, input)? } else { None };
        for i in start..n {
            if let Some(c) = p.crossing_at(i).filter(|_| i > start || input.entry.is_none()) {
                x = c.boundary_to_sub(&x);
                ctx = ctx.crossed(c);
            }
            let rows = rows.as_ref().filter(|_| i + 1 == n);
            x = self.block(BlockIo { params: p, layer: i, x: &x, ctx: &ctx, capture: input.capture, captures: &mut captures, cache: cache.as_deref_mut(), rows })?;
        }
        Ok((x, captures, rows))
    }

    /// The query rows the last block of `input`'s forward runs at (on the device of the
    /// head, where the last block is): its `keep` positions, unless the input asks for
    /// every row ([`ForwardInput::full_last_block`]) or there is none to save. Callers
    /// running a KV cache do not ask.
    pub(crate) fn query_rows(&self, p: &ParamView, input: &ForwardInput) -> Result<Option<QueryRows>> {
        match input.keep {
            Some(k) if !input.full_last_block => QueryRows::from_keep(&head_side(p, k)),
            _ => Ok(None),
        }
    }

    /// [`Model::head`] over the last block's output, which ran at `rows` when given.
    pub(crate) fn head_at(&self, p: &ParamView, x: &Tensor, keep: Option<&Tensor>, rows: Option<&QueryRows>) -> Result<Tensor> {
        Ok(lm_head(&kept_hidden(self.final_norm(p, x)?, keep, rows), self.head_weight(p)?))
    }

    /// That `e` is a prefix of this input (same `[B, T]`) entering a block this view can
    /// start at: any block of the model, at or above the layer split's boundary when
    /// there is one (the crossing is part of the prefix).
    pub(crate) fn check_entry(&self, p: &ParamView, input: &ForwardInput, e: &Boundary) -> Result<()> {
        let (b, t) = input.dims()?;
        let lowest = p.layer_split().map_or(0, |s| s.at);
        if e.at >= lowest && e.at <= self.n_blocks() && e.x.size()[..2] == [b, t] {
            return Ok(());
        }
        Err(crate::Error::Torch(format!(
            "boundary activations {:?} at block {} for a [{b}, {t}] input (the lowest block it may enter is {lowest}, the model has {})",
            e.x.size(),
            e.at,
            self.n_blocks()
        )))
    }

    /// The boundary activations of `input` under `p`'s layer split: the embedding and
    /// blocks `[0, k)` on the main device without grad, then one crossing of `[B, T, D]`
    /// (and the mask / rotary tables) to the sub-device. `p` must not override a weight
    /// below the boundary (the engine checks that no edited weight is there).
    pub fn prefix(&self, p: &ParamView, input: &ForwardInput) -> Result<Boundary> {
        let split = p.layer_split().ok_or_else(|| crate::Error::Internal("boundary activations need a layer split".into()))?;
        self.prefix_to(p, input, split.at)
    }

    /// The activations of `input` entering block `at` (`[B, T, D]`), without grad: the
    /// embedding and blocks `[0, at)`, crossing to the sub-device at `p`'s layer split
    /// when there is one (then `at` must be at or above its boundary). Every forward of
    /// the same batch whose weights below `at` are the frozen ones may start there
    /// ([`ForwardInput::entry`]): MEND's capture, unedited and edited forwards all do,
    /// with `at` the first edited block. `p` must not override a weight below `at`.
    pub fn prefix_to(&self, p: &ParamView, input: &ForwardInput, at: usize) -> Result<Boundary> {
        let lowest = p.layer_split().map_or(0, |s| s.at);
        if at < lowest || at > self.n_blocks() {
            return Err(crate::Error::Internal(format!("a prefix to block {at} (the lowest block it may enter is {lowest}, the model has {})", self.n_blocks())));
        }
        crate::error::guard(|| {
            tch::no_grad(|| {
                let none = HashSet::new();
                let mut scratch = BTreeMap::new();
                let (mut x, mut ctx) = self.embed(p, input, 0)?;
                for i in 0..at {
                    if let Some(c) = p.crossing_at(i) {
                        x = c.boundary_to_sub(&x);
                        ctx = ctx.crossed(c);
                    }
                    x = self.block(BlockIo::plain(p, i, &x, &ctx, &none, &mut scratch))?;
                }
                // A split exactly at `at`: the crossing is the prefix's last step.
                if let Some(c) = p.crossing_at(at) {
                    x = c.boundary_to_sub(&x);
                    ctx = ctx.crossed(c);
                }
                Ok(Boundary { at, x, ctx })
            })
        })
    }

    /// A forward of new tokens after those already in `cache`, which it extends: positions
    /// continue from `cache.len()` and the new queries attend to every cached key. The
    /// input must be unpadded (`attention_mask: None`). On error the cache is left as it was.
    pub fn forward_cached(&self, p: &ParamView, input: &ForwardInput, cache: &mut KvCache) -> Result<ForwardOutput> {
        if input.attention_mask.is_some() {
            return Err(crate::Error::input("the KV cache takes unpadded inputs (no attention mask)"));
        }
        let (past, t) = (cache.len(), input.dims()?.1);
        let max = self.info().max_positions;
        if past + t > max {
            return Err(crate::Error::input(format!(
                "{past} cached + {t} new tokens is longer than the model's context of {max}"
            )));
        }
        let out = crate::error::guard(|| self.forward_with(p, input, Some(&mut *cache), true));
        match out {
            Ok(o) => {
                cache.set_len(past + t);
                Ok(o)
            }
            Err(e) => {
                cache.truncate(past);
                Err(e)
            }
        }
    }

    /// Hidden states the first block reads, `[B, T, D]`, and what the blocks share.
    /// `past` is the number of tokens already in a KV cache (0 without one).
    pub fn embed(&self, p: &ParamView, input: &ForwardInput, past: i64) -> Result<(Tensor, BlockContext)> {
        crate::error::guard(|| self.0.embed(p, input, past))
    }

    /// One block ([`BlockIo::layer`]) applied to its input; records `(x, h)` of the layers
    /// whose weights are in `io.capture` into `io.captures`, and extends `io.cache` when
    /// there is one. Not guarded against libtorch panics itself: its callers (`forward`,
    /// the recomputed backward) guard the whole pass once.
    pub fn block(&self, io: BlockIo) -> Result<Tensor> {
        self.0.block(io)
    }

    /// Final norm and LM head over the last block's output: logits at the `keep`
    /// positions (`[N, V]`), or everywhere (`[B, T, V]`) without `keep`.
    pub fn head(&self, p: &ParamView, x: &Tensor, keep: Option<&Tensor>) -> Result<Tensor> {
        crate::error::guard(|| Ok(lm_head(&keep_rows(self.final_norm(p, x)?, keep), self.head_weight(p)?)))
    }

    /// Final layer norm (GPT-2) or RMSNorm (LLaMA family) over the last block's output.
    pub fn final_norm(&self, p: &ParamView, x: &Tensor) -> Result<Tensor> {
        self.0.final_norm(p, x)
    }

    /// The LM head's weight `[vocab, D]`.
    pub fn head_weight<'a>(&self, p: &'a ParamView) -> Result<&'a Tensor> {
        p.get_for_head(self.0.head_weight_name())
    }

    /// Names of the tensors the layer split puts on the sub-device when blocks `[at, L)`
    /// go there: those blocks' tensors and [`Family::head_params`]; and the head weight when
    /// it is the tied embedding (copied, the embedding stays on main).
    pub fn sub_side_params(&self, at: usize) -> (Vec<String>, Option<&'static str>) {
        let head = self.0.head_params();
        let names = self
            .expected_params()
            .into_iter()
            .map(|(n, _)| n)
            .filter(|n| match self.block_of(n) {
                Some(i) => i >= at,
                None => head.contains(n),
            })
            .collect();
        (names, self.0.head_is_tied().then(|| self.0.head_weight_name()))
    }

    /// Number of transformer blocks.
    pub fn n_blocks(&self) -> usize {
        self.info().n_layers.max(0) as usize
    }

    /// The block that reads parameter `name`, `None` for parameters outside the blocks
    /// (embeddings, final norm, LM head).
    pub fn block_of(&self, name: &str) -> Option<usize> {
        let (idx, _) = name.strip_prefix(self.0.block_prefix())?.split_once('.')?;
        idx.parse().ok().filter(|i| *i < self.n_blocks())
    }

    pub fn info(&self) -> ModelInfo {
        self.0.info()
    }

    /// Every parameter the architecture reads, with its expected shape.
    pub fn expected_params(&self) -> Vec<(String, Vec<i64>)> {
        self.0.expected_params()
    }

    /// Layout of a 2-D weight of a linear layer, `None` if `name` is not one.
    pub fn layout(&self, name: &str) -> Option<WeightLayout> {
        self.0.layout(name)
    }

    /// MEND's default edited weights: the MLP weights of the last 3 blocks.
    pub fn default_edit_params(&self) -> Vec<String> {
        self.0.default_edit_params()
    }
}

/// Position ids from a padding mask: counts real tokens so far, which is right for both
/// left and right padding (pads get position 0; their outputs are never read).
pub(crate) fn position_ids(input_ids: &Tensor, attention_mask: Option<&Tensor>) -> Tensor {
    let (b, t) = (input_ids.size()[0], input_ids.size()[1]);
    match attention_mask {
        None => Tensor::arange(t, (tch::Kind::Int64, input_ids.device())).unsqueeze(0).expand([b, t], false),
        Some(m) => (m.to_kind(tch::Kind::Int64).cumsum(1, tch::Kind::Int64) - 1).clamp_min(0),
    }
}

/// Boolean attention mask `[B, 1, T, T]` (true = may attend) combining causality and
/// padding; `None` when there is no padding, so SDPA can take its causal fast path.
/// Every query may attend to itself, so fully padded rows never turn into NaN.
pub(crate) fn attention_mask(attention_mask: Option<&Tensor>, t: i64) -> Option<Tensor> {
    let m = attention_mask?;
    let device = m.device();
    let causal = Tensor::ones([t, t], (tch::Kind::Bool, device)).tril(0);
    let keys = m.to_kind(tch::Kind::Bool).unsqueeze(1).unsqueeze(1);
    let eye = Tensor::eye(t, (tch::Kind::Bool, device));
    Some(causal.logical_and(&keys).logical_or(&eye))
}

/// Which keys each query may attend to.
pub(crate) enum AttnMask {
    /// Plain causal attention over the input alone (SDPA's fast path).
    Causal,
    /// An explicit boolean mask (true = may attend), `[T, S]` or `[B, 1, T, S]`.
    Keys(Tensor),
    /// Every key: one new query after a cached prefix sees the whole sequence.
    All,
}

impl AttnMask {
    fn shallow_clone(&self) -> AttnMask {
        match self {
            AttnMask::Causal => AttnMask::Causal,
            AttnMask::All => AttnMask::All,
            AttnMask::Keys(m) => AttnMask::Keys(m.shallow_clone()),
        }
    }

    /// The mask for `t` new tokens after `past` cached ones. With a cache, SDPA's
    /// `is_causal` would align the causal triangle to the top-left (query `i` sees keys
    /// `0..=i`), hiding most of the prefix; the new queries must see every past key.
    pub(crate) fn new(padding: Option<&Tensor>, t: i64, past: i64, device: tch::Device) -> Self {
        if past == 0 {
            return match attention_mask(padding, t) {
                Some(m) => AttnMask::Keys(m),
                None => AttnMask::Causal,
            };
        }
        if t == 1 {
            return AttnMask::All;
        }
        AttnMask::Keys(Tensor::ones([t, past + t], (tch::Kind::Bool, device)).tril(past))
    }
}

/// Scaled dot-product attention over `[B, H, T, D]` queries and `[B, H, S, D]` keys/values.
pub(crate) fn attend(q: &Tensor, k: &Tensor, v: &Tensor, mask: &AttnMask) -> Tensor {
    match mask {
        AttnMask::Causal => Tensor::scaled_dot_product_attention(q, k, v, None::<Tensor>, 0.0, true, None, false),
        AttnMask::Keys(m) => Tensor::scaled_dot_product_attention(q, k, v, Some(m), 0.0, false, None, false),
        AttnMask::All => Tensor::scaled_dot_product_attention(q, k, v, None::<Tensor>, 0.0, false, None, false),
    }
}

fn with_bias(h: Tensor, b: Option<&Tensor>) -> Tensor {
    match b {
        Some(b) => h + b,
        None => h,
    }
}

/// Rows up to which [`WeightLayout::apply`] computes a CPU product as `(A·xᵀ)ᵀ` (bf16,
/// f16: at or below par with `x·Aᵀ` at every shape measured up to 256 rows,
/// docs/notebook/mend-step.md, #35).
const SKINNY_ROWS: i64 = 256;

/// [`SKINNY_ROWS`] for f32 products: at 188 rows `(A·xᵀ)ᵀ` was 4–42 % slower than `x·Aᵀ`
/// at six layer shapes (GPT-2-small's, Qwen2-VL-small's), at 96 rows and below on par or
/// faster (one thread, #35, docs/notebook/mend-step.md).
const SKINNY_ROWS_F32: i64 = 128;

/// Rows up to which [`lm_head`] streams the embedding matrix instead of calling x·Wᵀ.
const SKINNY_HEAD_ROWS: i64 = 64;

/// Logits `x·Wᵀ` for an LM head weight `W` `[vocab, d]`.
///
/// With the few rows MEND scores (the kept answer positions), libtorch's CPU GEMM for
/// x·Wᵀ reads the 50k×768 matrix at a fraction of memory bandwidth; computing (W·xᵀ)ᵀ
/// streams W row by row and measured 6× faster for 3 rows and still faster for 34,
/// with a backward no slower (GPT-2-small, see docs/notebook/mend-step.md).
pub fn lm_head(x: &Tensor, w: &Tensor) -> Tensor {
    let d = w.size()[1];
    let mut shape = x.size();
    let rows = x.numel() as i64 / d.max(1);
    if rows == 0 || rows > SKINNY_HEAD_ROWS {
        return x.matmul(&w.tr());
    }
    if let Some(last) = shape.last_mut() {
        *last = w.size()[0];
    }
    w.matmul(&x.reshape([rows, d]).tr()).tr().contiguous().reshape(shape)
}

/// Rows of the LM head weight per chunk in [`lm_head_input_grad`].
const HEAD_GRAD_CHUNK: i64 = 1024;

/// `g·W`: the gradient of `x·Wᵀ` w.r.t. `x` for logit gradients `g` `[N, vocab]`.
///
/// This sums over the vocabulary, and libtorch's CPU GEMM does that for a handful of rows
/// at a fraction of memory bandwidth (37 ms for 3 rows of GPT-2's head). Splitting the
/// vocabulary into chunks and summing one batched product per chunk reads W once at
/// bandwidth speed (about 15 ms), and the sum is the same up to rounding.
pub fn lm_head_input_grad(g: &Tensor, w: &Tensor) -> Tensor {
    let (n, v, d) = (g.size()[0], w.size()[0], w.size()[1]);
    let chunks = v / HEAD_GRAD_CHUNK;
    if n > SKINNY_HEAD_ROWS || chunks < 2 {
        return g.matmul(w);
    }
    let split = chunks * HEAD_GRAD_CHUNK;
    let main = g
        .narrow(1, 0, split)
        .reshape([n, chunks, HEAD_GRAD_CHUNK])
        .transpose(0, 1)
        .bmm(&w.narrow(0, 0, split).reshape([chunks, HEAD_GRAD_CHUNK, d]))
        .sum_dim_intlist(0, false, w.kind());
    if split == v {
        main
    } else {
        main + g.narrow(1, split, v - split).matmul(&w.narrow(0, split, v - split))
    }
}

/// A tensor of the input's device (`keep`) carried to where the head runs under a layer
/// split; a handle to the same tensor otherwise.
fn head_side(p: &ParamView, t: &Tensor) -> Tensor {
    match p.layer_split() {
        Some(s) => s.cross.to_sub(t),
        None => t.shallow_clone(),
    }
}

/// Final hidden states -> the kept rows `[N, D]`: from `[B, M, D]` when the last block ran
/// at `rows`, else as [`keep_rows`].
pub(crate) fn kept_hidden(hidden: Tensor, keep: Option<&Tensor>, rows: Option<&QueryRows>) -> Tensor {
    match rows {
        Some(r) => {
            let d = hidden.size()[2];
            hidden.reshape([-1, d]).index_select(0, &r.kept)
        }
        None => keep_rows(hidden, keep),
    }
}

/// Final hidden states `[B, T, D]` -> the kept rows `[N, D]` (or all of them as `[B, T, D]`).
pub(crate) fn keep_rows(hidden: Tensor, keep: Option<&Tensor>) -> Tensor {
    match keep {
        None => hidden,
        Some(k) => {
            let d = hidden.size()[2];
            let flat = hidden.reshape([-1, d]);
            let idx = k.reshape([-1]).nonzero().squeeze_dim(1);
            flat.index_select(0, &idx)
        }
    }
}

/// Bounds for a config.json's size fields: far beyond any released model, small enough
/// that the tensors a config implies can be listed and counted without overflow.
pub(crate) const MAX_LAYERS: i64 = 4096;
pub(crate) const MAX_WIDTH: i64 = 1 << 20;
pub(crate) const MAX_VOCAB_OR_CONTEXT: i64 = 1 << 24;

/// Refuses size fields `(name, value, max)` that are not in `1..=max`, at load time: such a
/// config would otherwise allocate without bound or run without any block.
pub(crate) fn check_sizes(fields: &[(&str, i64, i64)]) -> Result<()> {
    for &(name, v, max) in fields {
        if !(1..=max).contains(&v) {
            return Err(crate::Error::input(format!("{name} = {v} is not a plausible size (expected 1 to {max})")));
        }
    }
    Ok(())
}

/// Activation functions as Hugging Face configs spell them (`hidden_act`,
/// `activation_function`); an unknown name is refused when the config is read.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Deserialize)]
pub enum Activation {
    /// GELU with the tanh approximation (GPT-2's `gelu_new`).
    #[serde(rename = "gelu_new", alias = "gelu_pytorch_tanh", alias = "gelu_fast")]
    GeluTanh,
    /// Exact (erf) GELU.
    #[serde(rename = "gelu")]
    Gelu,
    /// `x · sigmoid(1.702 x)` (CLIP-style vision towers).
    #[serde(rename = "quick_gelu")]
    QuickGelu,
    #[serde(rename = "relu")]
    Relu,
    #[serde(rename = "silu", alias = "swish")]
    Silu,
}

impl Activation {
    pub fn apply(self, x: &Tensor) -> Tensor {
        match self {
            Activation::GeluTanh => x.gelu("tanh"),
            Activation::Gelu => x.gelu("none"),
            Activation::QuickGelu => x * (x * 1.702).sigmoid(),
            Activation::Relu => x.relu(),
            Activation::Silu => x.silu(),
        }
    }
}
