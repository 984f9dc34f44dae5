//! The model's forwards across the placement: each batch's prefix once (up to the first
//! edited block, crossed once under a layer split), the unedited logits (on the
//! sub-device's worker while the main device works), the edited forwards on the
//! sub-device and their recomputed gradients, and the tensors that cross for them.
use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use tch::Tensor;

use super::Placed;
use crate::data::{PrefixKey, TokenBatch};
use crate::model::{Boundary, ForwardInput, Overrides, ParamView};
use crate::{Error, Result};

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

impl Placed {

    /// The block every forward of a batch starts at, after the batch's prefix: the first
    /// edited block (nothing below it depends on the edit; under a layer split it is at or
    /// above the boundary, [`Placed::check_boundary`]), or the layer split's boundary
    /// with [`Placed::share_prefix`] off. `None`: every forward runs from the embedding
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
    /// below [`Placed::prefix_at`] run once per batch (no grad) and every later forward
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


    /// The replica placement's [`Placed::boundary`] on the sub-device (computed there once
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
        for (part, row) in parts {
            let (n, t) = (part.batch_size(), part.input_ids.size()[1]);
            self.cut_boundary(whole, part, |b| b.narrow(*row, n, t))?;
        }
        Ok(())
    }


    /// [`Placed::share_boundary`] for one `part` made of the rows `rows` of `whole` (in
    /// that order, right-padded to its own length), which need not be one run.
    pub fn share_boundary_rows(&self, whole: &TokenBatch, part: &TokenBatch, rows: &[i64]) -> Result<()> {
        let t = part.input_ids.size()[1];
        self.cut_boundary(whole, part, |b| b.select(rows, t))
    }


    /// Gives `part` what `cut` takes of `whole`'s boundary activations, on each side that
    /// keeps them (the replica placement's sub-device copy too).
    fn cut_boundary(&self, whole: &TokenBatch, part: &TokenBatch, cut: impl Fn(&Boundary) -> Result<Boundary>) -> Result<()> {
        let (Some(key), Some(b)) = (self.prefix_key(false), self.boundary(whole)?) else {
            return Ok(());
        };
        part.prefix.set(key, crate::error::guard(|| cut(&b))?);
        if let (Some(k), true) = (self.prefix_key(true), self.replica.is_some()) {
            if let Some(s) = self.sub_boundary(whole)? {
                part.prefix.set(k, crate::error::guard(|| cut(&s))?);
            }
        }
        Ok(())
    }


    /// The forward input of `batch` with its boundary activations (`entry`, under a layer split).
    pub(crate) fn input_from<'a>(&self, batch: &'a TokenBatch, capture: &'a HashSet<String>, entry: Option<&'a Boundary>) -> ForwardInput<'a> {
        ForwardInput { entry, full_last_block: !self.last_block_at_kept, ..batch.forward_input(capture) }
    }


    /// A tensor made on the main device (by the editor) carried to where the edited
    /// weights are: the sub-device under a layer split; unchanged otherwise (the replica
    /// placement moves the edit in [`Placed::edited_logits_on_sub`]).
    pub(crate) fn to_weight_side(&self, t: &Tensor) -> Tensor {
        if self.layer_split() {
            self.mover.to_sub(t)
        } else {
            t.shallow_clone()
        }
    }


    /// A tensor on the edited weights' side carried back to the main device (layer split).
    pub(crate) fn weight_side_to_main(&self, t: &Tensor) -> Tensor {
        if self.layer_split() {
            self.mover.to_main(t)
        } else {
            t.shallow_clone()
        }
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
    /// sub-device when split, see [`Placed::edited_logits_on_sub`]): on the sub-device's
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


    /// [`Placed::edited_logits`] left on the sub-device (the main device when not split).
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
    /// [`Placed::edited_logits_on_sub`] returns them).
    ///
    /// As with [`Placed::edited_logits`], the forwards and their backward run on the
    /// sub-device: `W'` goes there once (detached, as leaves), the batches go through the
    /// mover, and the summed gradients come back to the main device through it. Returns
    /// the gradients by name, detached, beside `W'` (on the main device; on the sub-device
    /// under a layer split, where `W'` already is and the batches enter on main): the
    /// caller takes them into the editor's graph (see `train::meta_loss`,
    /// [`Placed::scalar_to_main`]).
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
}
