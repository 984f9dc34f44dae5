//! The `Engine`: MEND's side of an edit over the placed runtime ([`Placed`], which it
//! derefs to): the gradient capture of the edited weights, and the editor's run turned
//! into edited weights where they live.

use std::collections::{HashMap, HashSet};
use std::ops::{Deref, DerefMut};

use tch::{Kind, Tensor};

use super::editor::{Editor, Factors};
use super::losses;

use crate::data::TokenBatch;
use crate::device::DevicePlan;
use crate::model::{lm_head, lm_head_input_grad, ForwardInput, LoadedModel, LowRank, Overrides, ParamView};
use crate::placed::Placed;
use crate::{Error, Result};

/// A model placed for MEND: the runtime ([`Placed`]: devices, forwards, commits) and
/// the set of edited weights whose layer inputs and output gradients a capture records.
pub struct Engine {
    placed: Placed,
    capture_set: HashSet<String>,
}

/// Everything that runs the model (`engine.lm`, `engine.collate`, `engine.commit`, ...)
/// is the runtime's.
impl Deref for Engine {
    type Target = Placed;
    fn deref(&self) -> &Placed {
        &self.placed
    }
}

impl DerefMut for Engine {
    fn deref_mut(&mut self) -> &mut Placed {
        &mut self.placed
    }
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

impl Engine {
    /// Places `lm` (loaded on `plan.main`) for editing the weights `edit_names` (empty:
    /// the family's default edited weights), checked against the model.
    pub fn new(lm: LoadedModel, plan: DevicePlan, edit_names: &[String]) -> Result<Self> {
        let placed = Placed::new(lm, plan, edit_names)?;
        let capture_set = placed.edit_params.iter().map(|p| p.name.clone()).collect();
        Ok(Self { placed, capture_set })
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
    /// only their gradients come back). So does every weight in `training`. Otherwise
    /// weights of other dtypes get `W'` itself, rounded once, so that what is scored is
    /// what [`crate::placed::Placed::commit`] and `--save` would keep.
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
                // Meta-training keeps every dtype's edit factored: a bf16 `W'` and its
                // gradient would cost two weight-sized tensors per edited weight (on the
                // 7B shape 0.8 + 1.5 GiB of the step's peak) for an edit that is only
                // rounded into the weights when an edit is made.
                if w.kind() == Kind::Float || training {
                    out.insert_low_rank(p.name.clone(), edit);
                } else {
                    out.insert(p.name.clone(), edit.added_to(w, p.layout));
                }
            }
            Ok(out)
        })
    }
}
