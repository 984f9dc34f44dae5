//! `mend-ls`: MEND's per-edit updates combined by least squares over their keys, as
//! MALMEN (Tan et al., 2024) aggregates many edits, instead of summed (issue #24).
//!
//! Why: summed, N MEND edits add N rank-r updates whose effects on each other's keys (and
//! on unrelated ones) pile up; on the embedded default 10 edits in one batch or one after
//! another already break the model. Here the editor still turns each edit's gradient
//! factors into its update `M_i = Σ_rows aᵀb` (shape `[d_in, d_out]` in `x·W` orientation),
//! but what is kept of it is only what it does at the edit's own keys: for every row `t`
//! of edit `i` the key `k_t` (the layer's input at that token, `[d_in]`) and the value
//! shift `v_t = k_t·M_i` (`[d_out]`). The weight's change `S` (`[d_in, d_out]`) then solves
//!
//! ```text
//!     min_S  Σ_t ‖k_t·S − v_t‖² + λ·‖S‖²      S = (KᵀK + λ·I)⁻¹ KᵀV
//! ```
//!
//! over all edits' rows `K` (`[R, d_in]`), `V` (`[R, d_out]`), for each edited weight
//! separately (MALMEN's normal equation, in the primal form: a `d_in × d_in` solve).
//! Optionally `+ μ·Σ_j ‖c_j·S‖²` over keys `c_j` of unrelated text (`CᵀC` added to the
//! normal matrix), which asks `S` to leave the layer's outputs there alone, as MEMIT's
//! key covariance does.
//!
//! Edits one after another re-solve over every edit so far from the weights the first
//! one started from, `W0` ([`KeyMemory`]): a new edit is captured at `W0` (the current
//! weights minus the remembered change), its rows target their own shift `v`, earlier rows
//! keep their targets, so a later edit cannot overwrite an earlier one's values and N
//! sequential edits are the batch of N by construction. Capturing on the edited weights
//! instead (targets `k·S_prev + v`) was measured first: the editor's inputs leave its
//! training distribution after a few commits and 10 sequential edits broke the model
//! (0.00 reliability; BENCHMARKS.md).
use std::collections::HashMap;

use serde::Serialize;
use tch::{Kind, Tensor};

use crate::data::TokenBatch;
use crate::mend::{Editor, Engine};
use crate::model::{LowRank, Overrides};
use crate::{Error, Result};

/// The least-squares aggregation's settings.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct LsConfig {
    /// `λ` of `λ·‖S‖²`, relative to the mean squared norm of the edit's keys (so it means
    /// the same whatever the layer's scale): `λ_abs = lambda · mean_t ‖k_t‖²`.
    pub lambda: f64,
    /// `μ`: the weight of each unrelated key `c_j` in `μ·Σ_j ‖c_j·S‖²` (keep what the
    /// weight does at unrelated text, as MEMIT keeps its key covariance), when unrelated
    /// keys are given ([`unrelated_grams`]).
    pub cov_weight: f64,
}

impl Default for LsConfig {
    fn default() -> Self {
        Self { lambda: 1e-2, cov_weight: 1e-2 }
    }
}

/// `CᵀC` `[d_in, d_in]` of every edited weight's inputs at every token of `texts` (the
/// unrelated keys), under the engine's current weights, in batches of 64.
pub fn unrelated_grams(engine: &Engine, texts: &[String]) -> Result<Vec<Tensor>> {
    let max = (engine.lm.model.info().max_positions.max(2)) as usize;
    let mut examples = Vec::with_capacity(texts.len());
    for t in texts {
        let mut ids = engine.lm.tokenizer.encode(t)?;
        // The last token is a target, not an input, in a batch: add one so all are inputs.
        ids.truncate(max - 1);
        ids.push(ids.last().copied().unwrap_or(0));
        if ids.len() >= 2 {
            examples.push(crate::data::Example { ids, answer_start: 1, image: None });
        }
    }
    if examples.is_empty() {
        return Err(Error::input("no unrelated text to take keys from"));
    }
    let mut grams: Option<Vec<Tensor>> = None;
    for chunk in examples.chunks(64) {
        let refs: Vec<&crate::data::Example> = chunk.iter().collect();
        let xs = engine.layer_inputs(&engine.collate(&refs)?)?;
        grams = Some(crate::error::guard(|| {
            let g: Vec<Tensor> = xs.iter().map(|x| x.tr().matmul(x)).collect();
            Ok(match grams.take() {
                Some(acc) => acc.into_iter().zip(g).map(|(a, b)| a + b).collect(),
                None => g,
            })
        })?);
    }
    grams.ok_or_else(|| Error::input("no unrelated text to take keys from"))
}

/// Per edited weight: every committed edit's keys `K` `[R, d_in]`, targets `T` `[R, d_out]`
/// (relative to the weights the memory started from) and the change `S` `[d_in, d_out]`
/// committed so far.
#[derive(Default)]
struct Layer {
    k: Option<Tensor>,
    t: Option<Tensor>,
    s: Option<Tensor>,
}

/// The edits a session has committed with `mend-ls`, for re-solving over all of them.
#[derive(Default)]
pub struct KeyMemory {
    layers: Vec<Layer>,
    /// The last [`edit`]'s layers, committed by [`KeyMemory::commit`].
    pending: Option<Vec<Layer>>,
}

impl Layer {
    fn shallow(&self) -> Layer {
        Layer { k: self.k.as_ref().map(Tensor::shallow_clone), t: self.t.as_ref().map(Tensor::shallow_clone), s: self.s.as_ref().map(Tensor::shallow_clone) }
    }
}

impl KeyMemory {
    /// The committed edits, sharing their tensors (a commit replaces them, never changes
    /// them in place): what a failed edit call puts back ([`crate::session::Session::edit_examples`]).
    pub fn snapshot(&self) -> KeyMemory {
        KeyMemory { layers: self.layers.iter().map(Layer::shallow).collect(), pending: None }
    }

    /// Forgets every edit (the session was reset to its loaded weights).
    pub fn clear(&mut self) {
        *self = Self::default();
    }

    /// Records the last proposed edit as committed at `scale` (1: as proposed; the guard
    /// may scale it back, `W + s·ΔW`). At a scale below 1 the stored targets of the new
    /// rows are `k·S_prev + s·v` and `S = S_prev + s·(S_new − S_prev)`: exact for `S`,
    /// approximate for the old rows, whose targets are kept.
    pub fn commit(&mut self, scale: f64) {
        let Some(pending) = self.pending.take() else { return };
        if scale <= 0.0 {
            return;
        }
        let _g = tch::no_grad_guard();
        let mut layers = std::mem::take(&mut self.layers);
        layers.resize_with(pending.len(), Layer::default);
        for (old, new) in layers.iter_mut().zip(pending) {
            let (Some(k), Some(t), Some(s)) = (new.k, new.t, new.s) else { continue };
            let s_prev = old.s.as_ref().map_or_else(|| s.zeros_like(), |p| p.shallow_clone());
            // `new.t` holds the new rows' targets `k·S_prev + v`.
            let (t, s) = if scale < 1.0 {
                let t = &k.matmul(&s_prev) + (&t - k.matmul(&s_prev)) * scale;
                (t, &s_prev + (&s - &s_prev) * scale)
            } else {
                (t, s)
            };
            old.k = Some(match old.k.take() {
                Some(k0) => Tensor::cat(&[k0, k], 0),
                None => k,
            });
            old.t = Some(match old.t.take() {
                Some(t0) => Tensor::cat(&[t0, t], 0),
                None => t,
            });
            old.s = Some(s);
        }
        self.layers = layers;
    }

    /// Edits remembered (rows of the first layer, for logs).
    pub fn rows(&self) -> i64 {
        self.layers.first().and_then(|l| l.k.as_ref()).map_or(0, |k| k.size()[0])
    }
}

/// A MEND editor whose per-edit updates are combined by least squares.
pub struct LsEditor {
    pub editor: Editor,
    pub config: LsConfig,
    pub memory: KeyMemory,
    /// [`unrelated_grams`] of the unedited model, per edited weight (empty: none).
    pub unrelated: Vec<Tensor>,
}

/// The edit of `inner` (one or many examples) on the engine's current weights: for each
/// edited weight the change from the current weights to `W0 + S`, with `S` re-solved over
/// the remembered edits and these; as a low-rank override `(I, S − S_prev)` (rank `d_in`).
/// Not committed: [`KeyMemory::commit`] records it once the caller has committed it.
pub fn edit(engine: &Engine, ls: &mut LsEditor, inner: &TokenBatch) -> Result<Overrides> {
    let _g = tch::no_grad_guard();
    if !(ls.config.lambda.is_finite() && ls.config.lambda > 0.0) {
        return Err(Error::input(format!("mend-ls lambda must be a positive number, got {}", ls.config.lambda)));
    }
    // Captured at the weights the remembered edits started from, `W0 = W − S_prev`: each
    // edit's keys and shifts are those it would have in one batch with all the others.
    let start = crate::error::guard(|| {
        let mut at = HashMap::new();
        for (p, l) in engine.edit_params.iter().zip(&ls.memory.layers) {
            if let Some(s) = &l.s {
                let w = engine.weight(&p.name)?;
                let undo = LowRank { a: Tensor::eye(s.size()[0], (Kind::Float, w.device())), b: -s.to_device(w.device()) };
                at.insert(p.name.clone(), undo.added_to(w, p.layout));
            }
        }
        Ok(at)
    })?;
    let (_, factors, examples) = engine.capture_by_example(inner, &start)?;
    let terms = ls.editor.edit_terms(&factors, false);
    crate::error::guard(|| {
        let mut out = Overrides::new();
        let mut pending = Vec::with_capacity(engine.edit_params.len());
        for (i, (p, (a, b))) in engine.edit_params.iter().zip(terms).enumerate() {
            let k = &factors[i].x;
            let ex = &examples[i];
            if a.size()[0] != k.size()[0] {
                return Err(Error::Torch(format!("{}: the editor gave {} rows for {} keys", p.name, a.size()[0], k.size()[0])));
            }
            // v_t = Σ_{s in t's edit} (k_t·a_s) b_s: each row's shift under its own edit's update.
            let same = ex.unsqueeze(1).eq_tensor(&ex.unsqueeze(0)).to_kind(Kind::Float);
            let v = (k.matmul(&a.tr()) * same).matmul(&b);
            let prev = ls.memory.layers.get(i);
            let s_prev = prev.and_then(|l| l.s.as_ref());
            // Targets relative to W0, where the keys were captured.
            let t_new = v;
            let (kk, tt) = match prev.and_then(|l| l.k.as_ref().zip(l.t.as_ref())) {
                Some((k0, t0)) => (Tensor::cat(&[k0, k], 0), Tensor::cat(&[t0, &t_new], 0)),
                None => (k.shallow_clone(), t_new.shallow_clone()),
            };
            let d_in = kk.size()[1];
            let lambda = ls.config.lambda * kk.square().sum_dim_intlist(1, false, Kind::Float).mean(Kind::Float).double_value(&[]).max(1e-12);
            let mut gram = kk.tr().matmul(&kk) + Tensor::eye(d_in, (Kind::Float, kk.device())) * lambda;
            if let Some(c) = ls.unrelated.get(i) {
                gram += c.to_device(kk.device()) * ls.config.cov_weight;
            }
            let s = Tensor::linalg_solve(&gram, &kk.tr().matmul(&tt), true);
            let change = match s_prev {
                Some(sp) => &s - sp,
                None => s.shallow_clone(),
            };
            let w = engine.weight(&p.name)?;
            let edit = LowRank { a: Tensor::eye(d_in, (Kind::Float, w.device())), b: change.to_device(w.device()) };
            if w.kind() == Kind::Float {
                out.insert_low_rank(p.name.clone(), edit);
            } else {
                out.insert(p.name.clone(), edit.added_to(w, p.layout));
            }
            pending.push(Layer { k: Some(k.shallow_clone()), t: Some(t_new), s: Some(s) });
        }
        ls.memory.pending = Some(pending);
        Ok(out)
    })
}
