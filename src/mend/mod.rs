//! MEND: the editor network, gradient capture, edit application and the engine that runs
//! them across the main device and the sub-device.
pub mod checkpoint;
pub mod editor;
pub mod losses;
pub mod optim;

use std::collections::{HashMap, HashSet};

use tch::{Kind, Tensor};
use tracing::info;

pub use editor::{EditedParam, Editor, Factors};

use crate::data::multimodal::StepImages;
use crate::data::{Example, TokenBatch};
use crate::device::worker::Worker;
use crate::device::{DevicePlan, Mover};
use crate::model::qwen2_vl::ImageProcessorConfig;
use crate::model::{lm_head, lm_head_input_grad, LoadedModel, LowRank, Overrides, ParamStore, ParamView, WeightLayout};
use crate::{Error, Result};

/// A loaded model placed according to a device plan, with the weights MEND edits.
///
/// The main device holds the frozen model (gradient capture and the unedited reference
/// logits run there). When the plan is split, the sub-device holds a read-only replica
/// and every forward pass of the edited model runs on it: only the edited tensors and the
/// batches go there, only logits at scored positions come back.
pub struct Engine {
    pub lm: LoadedModel,
    replica: Option<ParamStore>,
    pub plan: DevicePlan,
    pub mover: Mover,
    pub edit_params: Vec<EditedParam>,
    capture_set: HashSet<String>,
    /// Computes the unedited locality logits on the sub-device, from the replica, while the
    /// main device captures and runs the editor (split only).
    sub_worker: Option<Worker>,
    /// The image processor of a vision-language model (`preprocessor_config.json`).
    pub image_proc: Option<ImageProcessorConfig>,
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
                Error::input(format!("edit_params names {name:?}, which is not a parameter of the model in {model_dir}"))
            })?;
            let layout = lm.model.layout(name).ok_or_else(|| {
                Error::input(format!(
                    "edit_params names {name:?}, which is not the weight of a linear layer of {} (model in {model_dir})",
                    lm.model.info().architecture
                ))
            })?;
            edit_params.push(EditedParam { name: name.clone(), shape: w.size(), layout });
        }
        let replica = if plan.split { Some(lm.params.replicate(plan.sub)?) } else { None };
        if let Some(r) = &replica {
            info!(bytes = r.nbytes(), "sub-device replica of the frozen weights built");
        }
        let capture_set = names.iter().cloned().collect();
        let sub_worker = match &replica {
            Some(r) => Some(Worker::spawn(lm.model.clone(), r.shallow_clone(), "sub")?),
            None => None,
        };
        let image_proc = match lm.model.family().vision_language() {
            Some(vl) => Some(vl.image_processor(&lm.dir)?),
            None => None,
        };
        Ok(Self { mover: Mover::new(&plan), lm, replica, plan, edit_params, capture_set, sub_worker, image_proc })
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
        crate::device::oom::Placement { split: self.plan.split, weights: self.lm.params.kind() }
    }

    pub fn edit_names(&self) -> Vec<String> {
        self.edit_params.iter().map(|p| p.name.clone()).collect()
    }

    /// One forward and backward of the edit NLL on the frozen model: the factors `(x, δ)`
    /// of every edited weight (detached, rows without signal dropped) and the NLL.
    /// Runs with gradients enabled even when called under `no_grad` (evaluation).
    pub fn capture(&self, batch: &TokenBatch) -> Result<(f64, Vec<Factors>)> {
        crate::error::guard(|| tch::with_grad(|| {
            let overrides: Overrides = self
                .edit_params
                .iter()
                .map(|p| Ok((p.name.clone(), self.weight(&p.name)?.detach().set_requires_grad(true))))
                .collect::<Result<_>>()?;
            let view = ParamView::new(&self.lm.params, Some(&overrides));
            let out = self.lm.model.forward_hidden(&view, &batch.forward_input(&self.capture_set))?;
            // The head's part of the backward by hand: ∂NLL/∂logits = (softmax − onehot)/N,
            // then through the head with `lm_head_input_grad` (autograd's product for it is
            // the slowest step of the capture); autograd takes over from the final hidden
            // states through the surrogate ⟨hidden, g⟩, whose gradient w.r.t. them is g.
            let (nll, g_hidden) = tch::no_grad(|| -> Result<(f64, Tensor)> {
                let w = self.lm.model.head_weight(&view)?;
                let (nll, g_logits) = losses::nll_and_grad(&lm_head(&out.logits.detach(), w), &batch.kept_targets());
                Ok((nll, lm_head_input_grad(&g_logits.to_kind(w.kind()), w).to_kind(out.logits.kind())))
            })?;
            let loss = (&out.logits * g_hidden).sum(Kind::Float);
            let hs: Vec<&Tensor> = self
                .edit_params
                .iter()
                .map(|p| out.captures.get(&p.name).map(|c| &c.h))
                .collect::<Option<_>>()
                .ok_or_else(|| Error::Torch("an edited layer was not captured".into()))?;
            let deltas = Tensor::f_run_backward(&[&loss], &hs, false, false)?;
            let factors = self
                .edit_params
                .iter()
                .zip(deltas)
                .map(|(p, delta)| {
                    let (d_in, d_out) = p.in_out();
                    let x = out.captures[&p.name].x.detach().reshape([-1, d_in]).to_kind(Kind::Float);
                    let delta = delta.reshape([-1, d_out]).to_kind(Kind::Float);
                    // Padding rows and rows after the last scored token carry no gradient.
                    let rows = x.ne(0.0).any_dim(1, false).logical_and(&delta.ne(0.0).any_dim(1, false));
                    let idx = rows.nonzero().squeeze_dim(1);
                    Factors { x: x.index_select(0, &idx), delta: delta.index_select(0, &idx) }
                })
                .collect();
            Ok((nll, factors))
        }))
    }

    /// The frozen weight `name` on the main device.
    pub fn weight(&self, name: &str) -> Result<&Tensor> {
        self.lm.params.get(name).ok_or_else(|| Error::input(format!("unknown parameter {name:?}")))
    }

    /// Edited weights `W'` (on the main device) for the given factors.
    pub fn edit(&self, editor: &mut Editor, factors: &[Factors], training: bool) -> Result<Overrides> {
        crate::error::guard(|| {
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
        crate::error::guard(|| {
            let mut out = Overrides::new();
            for (p, (a, b)) in self.edit_params.iter().zip(editor.edit_terms(factors, training)) {
                let w = self.weight(&p.name)?;
                let edit = LowRank { a: a.to_device(w.device()), b: b.to_device(w.device()) };
                if w.kind() == Kind::Float {
                    out.insert_low_rank(p.name.clone(), edit);
                } else {
                    out.insert(p.name.clone(), edit.added_to(w, p.layout));
                }
            }
            Ok(out)
        })
    }

    /// Logits of the unedited model at the batch's scored positions, on the main device.
    pub fn base_logits(&self, batch: &TokenBatch) -> Result<Tensor> {
        let _g = tch::no_grad_guard();
        let none = HashSet::new();
        Ok(self.lm.model.forward(&ParamView::frozen(&self.lm.params), &batch.forward_input(&none))?.logits)
    }

    /// Starts the unedited logits of `batch` where the training losses are computed (the
    /// sub-device when split, see [`Engine::edited_logits_on_sub`]): on the sub-device's
    /// worker, from the replica, so they overlap with the capture and the editor on the
    /// main device; without a split, now.
    pub fn base_logits_async(&self, batch: &TokenBatch) -> Result<Pending> {
        match &self.sub_worker {
            Some(w) => Ok(Pending::Waiting(w.submit(self.mover.batch_to_sub(batch))?)),
            None => Ok(Pending::Ready(self.base_logits(batch)?)),
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
            None => Ok(self.lm.model.forward(&ParamView::new(&self.lm.params, Some(overrides)), &batch.forward_input(&none))?.logits),
            Some(replica) => crate::error::guard(|| {
                let moved = overrides.map(|t| self.mover.to_sub(t));
                let sub_batch = self.mover.batch_to_sub(batch);
                Ok(self.lm.model.forward(&ParamView::new(replica, Some(&moved)), &sub_batch.forward_input(&none))?.logits)
            }),
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
    /// the gradients by name, on the main device, detached: the caller takes them into
    /// the editor's graph (see `train::meta_loss`).
    pub fn edited_grads(&self, overrides: &Overrides, passes: Vec<(&TokenBatch, LogitsLoss<'_>)>) -> Result<HashMap<String, Tensor>> {
        if passes.is_empty() {
            return Err(Error::input("edited_grads needs at least one batch"));
        }
        let none = HashSet::new();
        let store = self.replica.as_ref().unwrap_or(&self.lm.params);
        let dense = overrides.dense();
        let wrt: Vec<String> = self.edit_params.iter().map(|p| p.name.clone()).filter(|n| dense.contains_key(n)).collect();
        let leaves: Overrides = crate::error::guard(|| {
            Ok(tch::no_grad(|| {
                wrt.iter().map(|n| (n.clone(), self.mover.to_sub(&dense[n].detach()).set_requires_grad(true))).collect()
            }))
        })?;
        let view = ParamView::new(store, Some(&leaves));
        let mut total: Vec<Option<Tensor>> = wrt.iter().map(|_| None).collect();
        for (batch, loss) in passes {
            let sub_batch = self.mover.batch_to_sub(batch);
            crate::model::recompute::grad_by_blocks(
                &self.lm.model,
                &view,
                &sub_batch.forward_input(&none),
                &wrt,
                &mut total,
                |logits| loss(logits),
            )?;
        }
        let total: Vec<Tensor> = total.into_iter().collect::<Option<_>>().ok_or_else(|| Error::Torch("an edited weight got no gradient".into()))?;
        crate::error::guard(|| Ok(wrt.into_iter().zip(total).map(|(n, g)| (n, self.mover.to_main(&g))).collect()))
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
