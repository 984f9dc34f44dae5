//! The `Engine`: a loaded model placed on the main device and the sub-device, the gradient
//! capture, the editor's run and the edited forwards across the two.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use tch::{Kind, Tensor};
use tracing::info;

use super::editor::{EditedParam, Editor, Factors};
use super::losses;

use crate::data::multimodal::StepImages;
use crate::data::{Example, PrefixKey, TokenBatch};
use crate::device::worker::Worker;
use crate::device::timeline::Timeline;
use crate::device::{DevicePlan, Mover, Placement};
use crate::model::vision::ImageProcessorConfig;
use crate::model::{lm_head, lm_head_input_grad, Boundary, ForwardInput, LoadedModel, LowRank, Overrides, ParamStore, ParamView, WeightLayout};
use crate::{Error, Result};

/// A loaded model placed according to a device plan, with the weights MEND edits.
///
/// [`Placement::Replica`]: the main device holds the frozen model (gradient capture and
/// the unedited reference logits run there). When the plan is split, the sub-device holds
/// a read-only replica and every forward pass of the edited model runs on it: only the
/// edited tensors and the batches go there, only logits at scored positions come back.
///
/// [`Placement::Balanced`] (layer split): the embedding and blocks `[0, k)` stay on main,
/// blocks `[k, L)` with the final norm and head move to the sub-device once, at setup
/// (`k` ≤ the first edited block). The embedding and blocks below `k` run on main without
/// grad once per batch and cross the mover once (`[B, T, D]` plus the mask / rotary
/// tables; [`Engine::boundary`]); every forward of the batch starts there. The capture's
/// gradients, the factors, the edit's terms and the edited forwards are on the sub-device;
/// the factors cross to the editor on main and its terms come back.
pub struct Engine {
    pub lm: LoadedModel,
    replica: Option<ParamStore>,
    pub plan: DevicePlan,
    pub mover: Arc<Mover>,
    pub edit_params: Vec<EditedParam>,
    capture_set: HashSet<String>,
    /// Computes the unedited locality logits on the sub-device while the main device
    /// captures and runs the editor (split only): from the replica, or under a layer split
    /// from the boundary activations up. It holds its own handles to the frozen weights,
    /// so it serves meta-training, which never commits an edit.
    sub_worker: Option<Worker>,
    /// The image processor of a vision-language model (`preprocessor_config.json`).
    pub image_proc: Option<ImageProcessorConfig>,
    /// What the planner says would fit, for out-of-memory diagnoses (set by the run).
    pub fit_advisor: Option<Arc<dyn crate::device::oom::FitAdvisor>>,
    /// When each phase ran on which device (meta-training turns it on).
    pub timeline: Arc<Timeline>,
    /// Whether every forward of a batch starts from its prefix up to the first edited
    /// block, computed once ([`Engine::boundary`]); on by default. Off, forwards run from
    /// the embedding, except under a layer split, which always starts at its boundary.
    /// Exact either way (to float rounding); off is there to compare against.
    pub share_prefix: bool,
    /// Whether forwards read only at their scored positions (the capture, the unedited
    /// and the edited forwards) run the last block's queries, attention output, o_proj and
    /// MLP at those positions only ([`crate::model::QueryRows`]); on by default. Exact
    /// either way (to float rounding); off is there to compare against.
    pub last_block_at_kept: bool,
}

/// How [`Engine::edit_low_rank_shaped`] reshapes the editor's edit (the default leaves it
/// as it is). Both parts are for edits committed one after another
/// ([`crate::mend::stepwise`]).
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct EditShape {
    /// Subtract the editor's edit for the same layer inputs with a zero gradient (δ = 0).
    /// MEND normalises δ by subtracting its mean, so a zero gradient still gives the editor
    /// an input, and on the embedded default that answer is 35–100 % of every edit's
    /// norm (cosine 0.75–0.98 with the edit): a part of the update that does not depend on
    /// the request and adds up over committed edits. Centred, an edit of a request the
    /// model already answers is zero.
    pub center: bool,
    /// Scale each weight's change down to at most this fraction of the weight's norm.
    pub max_rel: Option<f64>,
}

/// A loss of the edited model's logits at a batch's scored positions (`[N, V]`, on the
/// sub-device), for [`Engine::edited_grads`]: a differentiable scalar.
pub type LogitsLoss<'a> = Box<dyn FnOnce(&Tensor) -> Result<Tensor> + 'a>;

/// Unedited logits that may still be computing on the sub-device's worker.
pub enum Pending {
    Ready(Tensor),
    Waiting(crossbeam::channel::Receiver<Result<Tensor>>),
}

impl Pending {
    pub fn wait(self) -> Result<Tensor> {
        match self {
            Pending::Ready(t) => Ok(t),
            Pending::Waiting(rx) => crate::device::worker::wait(rx),
        }
    }
}

/// The candidate nearest to `name` by edit distance (characters), when it is near enough
/// to be the name meant (at most a third of the name's length away): a typo's correction.
fn closest<'a>(name: &str, candidates: impl Iterator<Item = &'a String>) -> Option<&'a String> {
    let distance = |a: &str, b: &str| -> usize {
        let b: Vec<char> = b.chars().collect();
        let mut row: Vec<usize> = (0..=b.len()).collect();
        for (i, ca) in a.chars().enumerate() {
            let mut diag = row[0];
            row[0] = i + 1;
            for (j, cb) in b.iter().enumerate() {
                let next = (diag + usize::from(ca != *cb)).min(row[j] + 1).min(row[j + 1] + 1);
                diag = row[j + 1];
                row[j + 1] = next;
            }
        }
        row[b.len()]
    };
    candidates.map(|c| (distance(name, c), c)).filter(|(d, _)| *d * 3 <= name.chars().count()).min().map(|(_, c)| c)
}

impl Engine {
    /// Places `lm` (loaded on `plan.main`) and checks the edited weight names.
    pub fn new(lm: LoadedModel, plan: DevicePlan, edit_names: &[String]) -> Result<Self> {
        // Names in either tensor layout (Qwen2-VL: transformers 5's `model.language_model.*`
        // or the released `model.*`) resolve to the loader's canonical ones.
        let names: Vec<String> = if edit_names.is_empty() {
            lm.model.default_edit_params()
        } else {
            edit_names.iter().map(|n| lm.model.family().canonical_name(n)).collect()
        };
        let mut edit_params = Vec::with_capacity(names.len());
        let model_dir = lm.dir.display();
        for (i, name) in names.iter().enumerate() {
            if names[..i].contains(name) {
                return Err(Error::input(format!("edit_params lists {name:?} twice")));
            }
            let w = lm.params.get(name).ok_or_else(|| {
                let hint = closest(name, lm.params.names().filter(|n| lm.model.layout(n).is_some())).map_or(String::new(), |c| format!("; did you mean {c:?}?"));
                Error::input(format!("edit_params names {name:?}, which is not a parameter of the model in {model_dir}{hint}"))
            })?;
            let layout = lm.model.layout(name).ok_or_else(|| {
                Error::input(format!(
                    "edit_params names {name:?}, which is not the weight of a linear layer of {} (model in {model_dir})",
                    lm.model.info().architecture
                ))
            })?;
            edit_params.push(EditedParam { name: name.clone(), shape: w.size(), layout });
        }
        let mover = Arc::new(Mover::new(&plan));
        let mut lm = lm;
        let replica = match plan.placement {
            Placement::Replica if plan.split => Some(lm.params.replicate(plan.sub)?),
            Placement::Replica => None,
            Placement::Balanced => {
                let at = Self::check_boundary(&lm, &plan, &edit_params)?;
                let (on_sub, tied) = lm.model.sub_side_params(at);
                let before = mover.stats().bytes_to_sub;
                lm.params.split_layers(at, plan.sub, &on_sub, tied, mover.clone())?;
                info!(boundary = at, bytes = mover.stats().bytes_to_sub - before, "layer split: blocks from the boundary, final norm and head moved to the sub-device");
                // A chain: blocks [chain_at[i], chain_at[i + 1]) go to its device i.
                let chain_at = plan.chain.at();
                for (i, &from) in chain_at.iter().enumerate() {
                    let to = chain_at.get(i + 1).copied().unwrap_or(at);
                    let names: Vec<String> = lm.model.sub_side_params(from).0.into_iter().filter(|n| lm.model.block_of(n).is_some_and(|b| b < to)).collect();
                    let cross = mover.hop(i).ok_or_else(|| Error::Internal(format!("no crossing for the chain's device {i}")))?;
                    lm.params.add_hop(from, &names, cross)?;
                    info!(device = %plan.chain.names()[i], blocks = ?(from..to), "layer split chain: blocks moved");
                }
                None
            }
        };
        if let Some(r) = &replica {
            info!(bytes = r.nbytes(), "sub-device replica of the frozen weights built");
        }
        let capture_set = names.iter().cloned().collect();
        let timeline = Arc::new(Timeline::new());
        // The unedited locality logits overlap with the main device's work: from the
        // replica, or under a layer split from the boundary up (the blocks on the sub-device).
        let sub_worker = match &replica {
            Some(r) => Some(Worker::spawn(lm.model.clone(), r.shallow_clone(), "sub", timeline.clone())?),
            None if lm.params.layer_split().is_some() => Some(Worker::spawn(lm.model.clone(), lm.params.shallow_clone(), "sub", timeline.clone())?),
            None => None,
        };
        let image_proc = match lm.model.family().vision_language() {
            Some(vl) => Some(vl.image_processor(&lm.dir)?),
            None => None,
        };
        Ok(Self { mover, lm, replica, plan, edit_params, capture_set, sub_worker, image_proc, fit_advisor: None, timeline, share_prefix: true, last_block_at_kept: true })
    }

    /// The layer split's boundary, checked: a split plan, within the model, at most the
    /// first edited block (the blocks that need gradients run on the sub-device).
    fn check_boundary(lm: &LoadedModel, plan: &DevicePlan, edited: &[EditedParam]) -> Result<usize> {
        let at = plan.boundary.ok_or_else(|| Error::input("--placement balanced needs the boundary block (the planner chooses it)"))?;
        if !plan.split {
            return Err(Error::input("--placement balanced divides the model between two devices: give --sub-device"));
        }
        let chain_at = plan.chain.at();
        if chain_at.len() != plan.chain.len() || chain_at.iter().chain([&at]).collect::<Vec<_>>().windows(2).any(|w| w[0] >= w[1]) {
            return Err(Error::input(format!(
                "the chain's boundaries {:?} (then {at}) must increase, one per device of --sub-device {}",
                chain_at,
                plan.sub_list()
            )));
        }
        let first = edited.iter().filter_map(|p| lm.model.block_of(&p.name)).min().unwrap_or(0);
        if at > first || at >= lm.model.n_blocks() {
            return Err(Error::input(format!(
                "layer split at block {at}: it must be at most the first edited block ({first}) and below the model's {} blocks",
                lm.model.n_blocks()
            )));
        }
        Ok(at)
    }

    /// Whether the frozen blocks are divided between the devices (`--placement balanced`).
    pub fn layer_split(&self) -> bool {
        self.lm.params.layer_split().is_some()
    }

    /// The block every forward of a batch starts at, after the batch's prefix: the first
    /// edited block (nothing below it depends on the edit; under a layer split it is at or
    /// above the boundary, [`Engine::check_boundary`]), or the layer split's boundary
    /// with [`Engine::share_prefix`] off. `None`: every forward runs from the embedding
    /// (sharing off without a layer split, or an edited weight outside the blocks).
    fn prefix_at(&self) -> Option<usize> {
        let split = self.lm.params.layer_split().map(|s| s.at);
        if !self.share_prefix {
            return split;
        }
        let blocks: Option<Vec<usize>> = self.edit_params.iter().map(|p| self.lm.model.block_of(&p.name)).collect();
        match blocks.and_then(|b| b.into_iter().min()) {
            Some(first) => Some(split.map_or(first, |at| first.max(at))),
            None => split,
        }
    }

    /// The key under which a batch caches this engine's prefix (`sub`: the replica
    /// placement's copy on the sub-device).
    fn prefix_key(&self, sub: bool) -> Option<PrefixKey> {
        let crossing = match self.lm.params.layer_split() {
            Some(s) => Arc::as_ptr(&s.cross) as *const () as usize,
            None => Arc::as_ptr(&self.mover) as usize,
        };
        self.prefix_at().map(|at| PrefixKey { at, crossing, sub })
    }

    /// `batch`'s prefix activations for the forwards over the main device's weights (under
    /// a layer split, already crossed to the sub-device): the embedding and the blocks
    /// below [`Engine::prefix_at`] run once per batch (no grad) and every later forward
    /// of the batch (the unedited one, the capture, the edited ones) starts from them.
    /// A Qwen2-VL-7B editor of blocks 25–27 skips 25 of 28 blocks in every forward but
    /// the first. `None` when every forward runs from the embedding.
    pub fn boundary(&self, batch: &TokenBatch) -> Result<Option<Boundary>> {
        let Some(key) = self.prefix_key(false) else {
            return Ok(None);
        };
        let none = HashSet::new();
        batch
            .prefix
            .get_or(key, || {
                self.timeline.span("main", "prefix", || self.lm.model.prefix_to(&ParamView::frozen(&self.lm.params), &batch.forward_input(&none), key.at))
            })
            .map(Some)
    }

    /// The replica placement's [`Engine::boundary`] on the sub-device (computed there once
    /// per batch from the replica), where the edited and the unedited locality forwards
    /// run; the main device's boundary elsewhere.
    fn sub_boundary(&self, batch: &TokenBatch) -> Result<Option<Boundary>> {
        let (Some(replica), Some(key)) = (&self.replica, self.prefix_key(true)) else {
            return self.boundary(batch);
        };
        let none = HashSet::new();
        // Computed again from the replica: only batches and factors cross in this placement.
        batch
            .prefix
            .get_or(key, || {
                let moved = self.mover.batch_to_sub(batch);
                self.timeline.span("sub", "prefix", || self.lm.model.prefix_to(&ParamView::frozen(replica), &moved.forward_input(&none), key.at))
            })
            .map(Some)
    }

    /// Computes `whole`'s prefix activations (under a split, one crossing) and gives each
    /// of `parts` (a batch of rows `[row, row + B)` of `whole`'s examples, in the same
    /// order, right-padded to its own length) its slice, so that their forwards compute
    /// and cross nothing more. Meta-training's edited forward runs over the scored views
    /// at once (`whole`), its unedited locality forward and recomputed passes over each.
    /// Does nothing when forwards run from the embedding.
    pub fn share_boundary(&self, whole: &TokenBatch, parts: &[(&TokenBatch, i64)]) -> Result<()> {
        let (Some(key), Some(b)) = (self.prefix_key(false), self.boundary(whole)?) else {
            return Ok(());
        };
        let sub = match self.prefix_key(true) {
            Some(k) if self.replica.is_some() => self.sub_boundary(whole)?.map(|b| (k, b)),
            _ => None,
        };
        for (part, row) in parts {
            let (n, t) = (part.batch_size(), part.input_ids.size()[1]);
            part.prefix.set(key, crate::error::guard(|| b.narrow(*row, n, t))?);
            if let Some((k, s)) = &sub {
                part.prefix.set(*k, crate::error::guard(|| s.narrow(*row, n, t))?);
            }
        }
        Ok(())
    }

    /// The forward input of `batch` with its boundary activations (`entry`, under a layer split).
    fn input_from<'a>(&self, batch: &'a TokenBatch, capture: &'a HashSet<String>, entry: Option<&'a Boundary>) -> ForwardInput<'a> {
        ForwardInput { entry, full_last_block: !self.last_block_at_kept, ..batch.forward_input(capture) }
    }

    /// A tensor made on the main device (by the editor) carried to where the edited
    /// weights are: the sub-device under a layer split; unchanged otherwise (the replica
    /// placement moves the edit in [`Engine::edited_logits_on_sub`]).
    fn to_weight_side(&self, t: &Tensor) -> Tensor {
        if self.layer_split() {
            self.mover.to_sub(t)
        } else {
            t.shallow_clone()
        }
    }

    /// A tensor on the edited weights' side carried back to the main device (layer split).
    fn weight_side_to_main(&self, t: &Tensor) -> Tensor {
        if self.layer_split() {
            self.mover.to_main(t)
        } else {
            t.shallow_clone()
        }
    }

    /// One padded batch of `examples` on the main device, where the capture and the
    /// unedited forwards run (the mover takes it to the sub-device for edited forwards),
    /// with the features of the examples' images (computed here; use
    /// [`Engine::images`] + [`Engine::collate_with`] to share them between batches).
    pub fn collate(&self, examples: &[&Example]) -> Result<TokenBatch> {
        let images = self.images(examples)?;
        self.collate_with(examples, images.as_ref())
    }

    /// [`Engine::collate`] with image features computed beforehand by [`Engine::images`].
    pub fn collate_with(&self, examples: &[&Example], images: Option<&StepImages>) -> Result<TokenBatch> {
        let pad = self.lm.tokenizer.pad_id();
        match images {
            Some(im) => im.collate(examples, pad, self.plan.main),
            None if examples.iter().any(|e| e.image.is_some()) => Err(Error::input("examples show images but no image features were computed")),
            None => Ok(TokenBatch::collate(examples, pad, self.plan.main)),
        }
    }

    /// The frozen vision tower's features of every distinct image of `examples`, once
    /// each, on the main device (`None` without images). A text-only model refuses images.
    pub fn images(&self, examples: &[&Example]) -> Result<Option<StepImages<'_>>> {
        if examples.iter().all(|e| e.image.is_none()) {
            return Ok(None);
        }
        match (self.lm.model.family().vision_language(), &self.image_proc) {
            (Some(vl), Some(proc)) => StepImages::compute(vl, &ParamView::frozen(&self.lm.params), proc, examples),
            _ => Err(Error::input(format!(
                "{} is a text-only model ({}); images need a Qwen2-VL or Qwen2.5-VL model",
                self.lm.dir.display(),
                self.lm.model.info().architecture
            ))),
        }
    }

    /// How this engine is placed, for out-of-memory advice.
    pub fn placement(&self) -> crate::device::oom::Placement {
        crate::device::oom::Placement {
            split: self.plan.split,
            weights: self.lm.params.kind(),
            layout: self.plan.placement,
            optimizer: self.plan.optimizer,
            fit: self.fit_advisor.clone(),
        }
    }

    pub fn edit_names(&self) -> Vec<String> {
        self.edit_params.iter().map(|p| p.name.clone()).collect()
    }

    /// One forward and backward of the edit NLL on the frozen model: the factors `(x, δ)`
    /// of every edited weight (detached, rows without signal dropped) and the NLL (the mean
    /// over the batch's examples of each one's mean NLL).
    ///
    /// The loss is the sum over the examples of each example's mean NLL
    /// ([`losses::nll_and_grad_per_row`]), so every example's `δ` rows are those it has when
    /// captured alone: the editor (trained one example at a time) sees each as it saw its
    /// training examples, and since it transforms rows independently, a batch edit is the sum
    /// of the examples' single edits. A mean over all the batch's tokens instead shrank
    /// each example's `δ` by the batch's token count: out of the editor's distribution
    /// (issue #24: 5 requests in one batch reached 0.47 reliability, each 1.0 alone).
    /// Runs with gradients enabled even when called under `no_grad` (evaluation).
    pub fn capture(&self, batch: &TokenBatch) -> Result<(f64, Vec<Factors>)> {
        let (nll, factors, _) = self.capture_by_example(batch, &HashMap::new())?;
        Ok((nll, factors))
    }

    /// [`Engine::capture`] with, per edited weight, where each factor row came from: its
    /// flat position `b·T + t` in the batch's `[B, T]` tokens (`[R]` int64, on the factors'
    /// device), so the example is `pos / T` and the token `pos % T`: what
    /// [`crate::mend::ls`] needs to tell one edit's rows from another's and to see which
    /// tokens a row stands for. `at`: edited weights to capture at instead of the
    /// current ones (by name; the others as they are), e.g. the weights before a run of
    /// edits.
    pub fn capture_by_example(&self, batch: &TokenBatch, at: &HashMap<String, Tensor>) -> Result<(f64, Vec<Factors>, Vec<Tensor>)> {
        let entry = self.boundary(batch)?;
        crate::error::guard(|| tch::with_grad(|| {
            let overrides: Overrides = self
                .edit_params
                .iter()
                .map(|p| {
                    let w = match at.get(&p.name) {
                        Some(w) => w,
                        None => self.weight(&p.name)?,
                    };
                    Ok((p.name.clone(), w.detach().set_requires_grad(true)))
                })
                .collect::<Result<_>>()?;
            let view = ParamView::new(&self.lm.params, Some(&overrides));
            let out = self.lm.model.forward_hidden(&view, &self.input_from(batch, &self.capture_set, entry.as_ref()))?;
            // The head's part of the backward by hand: ∂NLL/∂logits = (softmax − onehot)/N,
            // then through the head with `lm_head_input_grad` (autograd's product for it is
            // the slowest step of the capture); autograd takes over from the final hidden
            // states through the surrogate ⟨hidden, g⟩, whose gradient w.r.t. them is g.
            let (nll, g_hidden) = tch::no_grad(|| -> Result<(f64, Tensor)> {
                let w = self.lm.model.head_weight(&view)?;
                // Under a layer split the head is on the sub-device: the targets go there.
                let (nll, g_logits) = losses::nll_and_grad_per_row(
                    &lm_head(&out.logits.detach(), w),
                    &self.to_weight_side(&batch.kept_targets()),
                    &self.to_weight_side(&batch.kept_rows()),
                    batch.batch_size(),
                );
                Ok((nll, lm_head_input_grad(&g_logits.to_kind(w.kind()), w).to_kind(out.logits.kind())))
            })?;
            let loss = (&out.logits * g_hidden).sum(Kind::Float);
            let hs: Vec<&Tensor> = self
                .edit_params
                .iter()
                .map(|p| out.captures.get(&p.name).map(|c| &c.h))
                .collect::<Option<_>>()
                .ok_or_else(|| Error::Internal("an edited layer was not captured".into()))?;
            let deltas = Tensor::f_run_backward(&[&loss], &hs, false, false)?;
            let mut examples = Vec::with_capacity(self.edit_params.len());
            let factors = self
                .edit_params
                .iter()
                .zip(deltas)
                .map(|(p, delta)| {
                    let (d_in, d_out) = p.in_out();
                    let cap = &out.captures[&p.name];
                    let x = cap.x.detach().reshape([-1, d_in]).to_kind(Kind::Float);
                    let delta = delta.reshape([-1, d_out]).to_kind(Kind::Float);
                    // Padding rows and rows after the last scored token carry no gradient
                    // (nor do the last block's padding query rows, `QueryRows`).
                    let rows = x.ne(0.0).any_dim(1, false).logical_and(&delta.ne(0.0).any_dim(1, false));
                    let idx = rows.nonzero().squeeze_dim(1);
                    // Where each row is in the batch: the last block's layers ran at the
                    // kept positions only, and say which.
                    let at = match &cap.rows {
                        Some(flat) => flat.index_select(0, &idx),
                        None => idx.shallow_clone(),
                    };
                    examples.push(self.weight_side_to_main(&at));
                    // The editor is on the main device: under a layer split the factors
                    // (rows with signal only) cross to it.
                    Factors {
                        x: self.weight_side_to_main(&x.index_select(0, &idx)),
                        delta: self.weight_side_to_main(&delta.index_select(0, &idx)),
                    }
                })
                .collect();
            Ok((nll, factors, examples))
        }))
    }

    /// The inputs of every edited weight's layer at the batch's real (unpadded) tokens,
    /// `[R, d_in]` f32 per edited weight, under the current weights, on the main device.
    pub fn layer_inputs(&self, batch: &TokenBatch) -> Result<Vec<Tensor>> {
        self.layer_inputs_at(batch, &HashMap::new())
    }

    /// [`Engine::layer_inputs`] with the edited weights `at` (by name; the others as they
    /// are) in place of the current ones, as [`Engine::capture_by_example`] takes them.
    pub fn layer_inputs_at(&self, batch: &TokenBatch, at: &HashMap<String, Tensor>) -> Result<Vec<Tensor>> {
        let _g = tch::no_grad_guard();
        let entry = self.boundary(batch)?;
        // Every token's input, the last block's included.
        let input = ForwardInput { full_last_block: true, ..self.input_from(batch, &self.capture_set, entry.as_ref()) };
        let overrides: Overrides = at.iter().map(|(name, w)| (name.clone(), w.shallow_clone())).collect();
        let out = self.lm.model.forward_hidden(&ParamView::new(&self.lm.params, Some(&overrides)), &input)?;
        crate::error::guard(|| {
            let real = batch.attention_mask.reshape([-1]).ne(0).nonzero().squeeze_dim(1);
            self.edit_params
                .iter()
                .map(|p| {
                    let (d_in, _) = p.in_out();
                    let x = out.captures.get(&p.name).ok_or_else(|| Error::Internal("an edited layer was not captured".into()))?;
                    let x = self.weight_side_to_main(&x.x.reshape([-1, d_in]).to_kind(Kind::Float));
                    Ok(x.index_select(0, &real.to_device(x.device())))
                })
                .collect()
        })
    }

    /// The frozen weight `name` on the main device.
    pub fn weight(&self, name: &str) -> Result<&Tensor> {
        self.lm.params.get(name).ok_or_else(|| Error::input(format!("unknown parameter {name:?}")))
    }

    /// Edited weights `W'` (on the main device) for the given factors.
    pub fn edit(&self, editor: &mut Editor, factors: &[Factors], training: bool) -> Result<Overrides> {
        crate::error::guard(|| {
            if self.layer_split() {
                // W' where W is: the edit's terms cross, never a weight.
                let mut out = Overrides::new();
                for (p, (a, b)) in self.edit_params.iter().zip(editor.edit_terms(factors, training)) {
                    let edit = LowRank { a: self.to_weight_side(&a), b: self.to_weight_side(&b) };
                    out.insert(p.name.clone(), edit.added_to(self.weight(&p.name)?, p.layout));
                }
                return Ok(out);
            }
            let weights: Vec<&Tensor> = self.edit_params.iter().map(|p| self.weight(&p.name)).collect::<Result<_>>()?;
            let new = editor.edited_weights(&weights, factors, training);
            Ok(self.edit_params.iter().map(|p| p.name.clone()).zip(new).collect())
        })
    }

    /// The edit for the given factors with each edited f32 weight's change kept as a
    /// [`LowRank`] override: the layers apply it as `x·W + (x·aᵀ)·b`, `W'` is never built
    /// unless committed, and only the factors cross to the sub-device (and, in training,
    /// only their gradients come back). Weights of other dtypes get `W'` itself, rounded
    /// once, so that what is scored is what [`Engine::commit`] and `--save` would keep.
    /// Differentiable w.r.t. the editor under grad mode, as [`Engine::edit`].
    pub fn edit_low_rank(&self, editor: &mut Editor, factors: &[Factors], training: bool) -> Result<Overrides> {
        self.edit_low_rank_shaped(editor, factors, training, &EditShape::default())
    }

    /// [`Engine::edit_low_rank`] with the edit reshaped as `shape` says (the default shape
    /// is the editor's edit as it is).
    pub fn edit_low_rank_shaped(&self, editor: &mut Editor, factors: &[Factors], training: bool, shape: &EditShape) -> Result<Overrides> {
        crate::error::guard(|| {
            let mut out = Overrides::new();
            let mut terms = editor.edit_terms(factors, training);
            if shape.center {
                // Minus the editor's edit for the same inputs with no gradient at all.
                let zero: Vec<Factors> = factors.iter().map(|f| Factors { x: f.x.shallow_clone(), delta: f.delta.zeros_like() }).collect();
                let base = editor.edit_terms(&zero, training);
                terms = terms.into_iter().zip(base).map(|((a, b), (a0, b0))| (Tensor::cat(&[a, -a0], 0), Tensor::cat(&[b, b0], 0))).collect();
            }
            for (p, (a, b)) in self.edit_params.iter().zip(terms) {
                let w = self.weight(&p.name)?;
                let mut edit = if self.layer_split() {
                    LowRank { a: self.to_weight_side(&a), b: self.to_weight_side(&b) }
                } else {
                    LowRank { a: a.to_device(w.device()), b: b.to_device(w.device()) }
                };
                if let Some(rho) = shape.max_rel {
                    // ‖aᵀb‖_F without building it: ⟨a aᵀ, b bᵀ⟩ = ‖aᵀb‖².
                    let dw = (edit.a.matmul(&edit.a.tr()) * edit.b.matmul(&edit.b.tr())).sum(Kind::Float).clamp_min(0.0).sqrt();
                    let wn = w.to_kind(Kind::Float).norm().to_device(dw.device());
                    let s = (wn * rho / (dw + 1e-12)).clamp_max(1.0);
                    edit.a = edit.a * s;
                }
                if w.kind() == Kind::Float {
                    out.insert_low_rank(p.name.clone(), edit);
                } else {
                    out.insert(p.name.clone(), edit.added_to(w, p.layout));
                }
            }
            Ok(out)
        })
    }

    /// Logits of the unedited model at the batch's scored positions, on the main device
    /// (under a layer split they come back from the head on the sub-device).
    pub fn base_logits(&self, batch: &TokenBatch) -> Result<Tensor> {
        let _g = tch::no_grad_guard();
        let none = HashSet::new();
        let entry = self.boundary(batch)?;
        Ok(self.lm.model.forward(&ParamView::frozen(&self.lm.params), &self.input_from(batch, &none, entry.as_ref()))?.logits)
    }

    /// Starts the unedited logits of `batch` where the training losses are computed (the
    /// sub-device when split, see [`Engine::edited_logits_on_sub`]): on the sub-device's
    /// worker, from the replica, so they overlap with the capture and the editor on the
    /// main device; without a split, now.
    pub fn base_logits_async(&self, batch: &TokenBatch) -> Result<Pending> {
        let at = self.timeline.position();
        match &self.sub_worker {
            // Layer split: the prefix on main (once per batch), the rest on the worker.
            Some(w) if self.layer_split() => Ok(Pending::Waiting(w.submit(batch.shallow_clone(), self.boundary(batch)?, at, !self.last_block_at_kept)?)),
            Some(w) => Ok(Pending::Waiting(w.submit(self.mover.batch_to_sub(batch), self.sub_boundary(batch)?, at, !self.last_block_at_kept)?)),
            None => Ok(Pending::Ready(self.timeline.span("main", "unedited forwards", || self.base_logits(batch))?)),
        }
    }

    /// Logits of the edited model `θ + Δ` at the batch's scored positions, computed on the
    /// sub-device and returned on the main device (differentiable w.r.t. `overrides`).
    pub fn edited_logits(&self, overrides: &Overrides, batch: &TokenBatch) -> Result<Tensor> {
        let logits = self.edited_logits_on_sub(overrides, batch)?;
        Ok(self.mover.to_main(&logits))
    }

    /// [`Engine::edited_logits`] left on the sub-device (the main device when not split).
    /// Meta-training computes its losses there and brings back only the scalar loss: the
    /// logits (`[N, V]`, with a vocabulary of 50k–150k) and their log-softmax are then
    /// never held by the main device, whose memory the split is there to relieve.
    pub fn edited_logits_on_sub(&self, overrides: &Overrides, batch: &TokenBatch) -> Result<Tensor> {
        let none = HashSet::new();
        match &self.replica {
            // Layer split: the batch enters on main, the logits stay where the head is.
            None if self.layer_split() => {
                let entry = self.boundary(batch)?;
                let input = self.input_from(batch, &none, entry.as_ref());
                Ok(self.lm.model.forward_to_head_side(&ParamView::new(&self.lm.params, Some(overrides)), &input)?.logits)
            }
            None => {
                let entry = self.boundary(batch)?;
                let input = self.input_from(batch, &none, entry.as_ref());
                Ok(self.lm.model.forward(&ParamView::new(&self.lm.params, Some(overrides)), &input)?.logits)
            }
            Some(replica) => {
                let entry = self.sub_boundary(batch)?;
                crate::error::guard(|| {
                    let moved = overrides.map(|t| self.mover.to_sub(t));
                    let sub_batch = self.mover.batch_to_sub(batch);
                    let input = self.input_from(&sub_batch, &none, entry.as_ref());
                    Ok(self.lm.model.forward(&ParamView::new(replica, Some(&moved)), &input)?.logits)
                })
            }
        }
    }

    /// `Σ_passes ∂loss/∂W'` for every edited weight, with each edited forward's blocks
    /// recomputed in the backward instead of keeping their activations
    /// ([`crate::model::recompute`]). Each pass is a batch and a loss of the edited
    /// model's logits at its scored positions (given on the sub-device, as
    /// [`Engine::edited_logits_on_sub`] returns them).
    ///
    /// As with [`Engine::edited_logits`], the forwards and their backward run on the
    /// sub-device: `W'` goes there once (detached, as leaves), the batches go through the
    /// mover, and the summed gradients come back to the main device through it. Returns
    /// the gradients by name, detached, beside `W'` (on the main device; on the sub-device
    /// under a layer split, where `W'` already is and the batches enter on main): the
    /// caller takes them into the editor's graph (see `train::meta_loss`,
    /// [`Engine::scalar_to_main`]).
    pub fn edited_grads(&self, overrides: &Overrides, passes: Vec<(&TokenBatch, LogitsLoss<'_>)>) -> Result<HashMap<String, Tensor>> {
        if passes.is_empty() {
            return Err(Error::input("edited_grads needs at least one batch"));
        }
        let none = HashSet::new();
        let store = self.replica.as_ref().unwrap_or(&self.lm.params);
        let dense = overrides.dense();
        let wrt: Vec<String> = self.edit_params.iter().map(|p| p.name.clone()).filter(|n| dense.contains_key(n)).collect();
        // Layer split: W' is already where its weight is, and the batch enters on main.
        let split = self.layer_split();
        let leaves: Overrides = crate::error::guard(|| {
            Ok(tch::no_grad(|| {
                wrt.iter()
                    .map(|n| {
                        let w = if split { dense[n].detach().copy() } else { self.mover.to_sub(&dense[n].detach()) };
                        (n.clone(), w.set_requires_grad(true))
                    })
                    .collect()
            }))
        })?;
        let view = ParamView::new(store, Some(&leaves));
        let mut total: Vec<Option<Tensor>> = wrt.iter().map(|_| None).collect();
        for (batch, loss) in passes {
            let moved;
            let sub_batch = if split {
                batch
            } else {
                moved = self.mover.batch_to_sub(batch);
                &moved
            };
            let entry = self.sub_boundary(batch)?;
            crate::model::recompute::grad_by_blocks(
                &self.lm.model,
                &view,
                &self.input_from(sub_batch, &none, entry.as_ref()),
                &wrt,
                &mut total,
                |logits| loss(logits),
            )?;
        }
        let total: Vec<Tensor> = total.into_iter().collect::<Option<_>>().ok_or_else(|| Error::Internal("an edited weight got no gradient".into()))?;
        if split {
            return Ok(wrt.into_iter().zip(total).collect());
        }
        crate::error::guard(|| Ok(wrt.into_iter().zip(total).map(|(n, g)| (n, self.mover.to_main(&g))).collect()))
    }

    /// A scalar computed beside the edited weights (the recomputed loss's surrogate)
    /// carried to the main device: through the mover under a layer split.
    pub fn scalar_to_main(&self, t: &Tensor) -> Tensor {
        self.weight_side_to_main(t)
    }

    /// Makes an edit permanent (sequential editing): writes `W'` into the frozen weights on
    /// both devices.
    pub fn commit(&mut self, overrides: &Overrides) -> Result<()> {
        let layouts: HashMap<&str, WeightLayout> = self.edit_params.iter().map(|p| (p.name.as_str(), p.layout)).collect();
        let _g = tch::no_grad_guard();
        for (name, t) in self.lm.params.materialise(overrides, |n| layouts.get(n).copied())? {
            let t = t.detach();
            self.lm.params.set(&name, t.shallow_clone())?;
            if let Some(r) = self.replica.as_mut() {
                r.set(&name, t)?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn closest_names_a_typo_not_a_stranger() {
        let names: Vec<String> = ["model.layers.2.mlp.up_proj.weight", "model.layers.2.mlp.down_proj.weight", "lm_head.weight"].map(String::from).to_vec();
        assert_eq!(super::closest("model.layers.2.mlp.upproj.weight", names.iter()), Some(&names[0]));
        assert_eq!(super::closest("transformer.h.2.mlp.c_fc.weight", names.iter()), None);
    }
}
