//! The placed runtime: a loaded model on the devices of a [`DevicePlan`] (the frozen
//! weights on the main device, a replica or the upper blocks on the sub-device(s), the
//! sub-device's worker), the weights an edit changes, and everything that runs the model
//! across them without knowing how an edit is made: batches collated with their images
//! (`batches.rs`), the shared prefix, the unedited and the edited forwards and their
//! gradients (`forward.rs`), greedy decoding (`generate.rs`), commits, and saving the
//! model (`save.rs`). MEND's side (the capture, the editor) is [`crate::mend::Engine`],
//! built over it.
use std::collections::HashMap;
use std::sync::Arc;

use tracing::info;

use crate::device::timeline::Timeline;
use crate::device::worker::Worker;
use crate::device::{DevicePlan, Mover, Placement};
use crate::model::vision::ImageProcessorConfig;
use tch::Tensor;

use crate::model::{LoadedModel, Overrides, ParamStore, WeightLayout};
use crate::{Error, Result};

mod batches;
mod forward;
pub mod generate;
pub mod save;

pub use forward::{LogitsLoss, Pending};

/// One edited weight: its name, shape and layout (which side of `W` an input multiplies).
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize, PartialEq)]
pub struct EditedParam {
    pub name: String,
    pub shape: Vec<i64>,
    pub layout: WeightLayout,
}

impl EditedParam {
    pub fn in_out(&self) -> (i64, i64) {
        self.layout.in_out(&self.shape)
    }
}

/// A loaded model placed according to a device plan, with the weights an edit changes.
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
/// tables; [`Placed::boundary`]); every forward of the batch starts there. The capture's
/// gradients, the factors, the edit's terms and the edited forwards are on the sub-device;
/// the factors cross to the editor on main and its terms come back.
pub struct Placed {
    pub lm: LoadedModel,
    pub(crate) replica: Option<ParamStore>,
    pub plan: DevicePlan,
    pub mover: Arc<Mover>,
    /// The weights an edit changes (their layouts commit it; the first one's block is
    /// where every forward's shared prefix ends).
    pub edit_params: Vec<EditedParam>,
    /// Computes the unedited locality logits on the sub-device while the main device
    /// captures and runs the editor (split only): from the replica, or under a layer split
    /// from the boundary activations up. It holds its own handles to the frozen weights,
    /// so it serves meta-training, which never commits an edit.
    pub(crate) sub_worker: Option<Worker>,
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

impl Placed {
    /// Places `lm` (loaded on `plan.main`) and checks the edited weight names (empty:
    /// the family's default edited weights).
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
        Ok(Self { mover, lm, replica, plan, edit_params, sub_worker, image_proc, fit_advisor: None, timeline, share_prefix: true, last_block_at_kept: true })
    }


    /// The layer split's boundary, checked: a split plan, within the model, at most the
    /// first edited block (the blocks that need gradients run on the sub-device).
    fn check_boundary(lm: &LoadedModel, plan: &DevicePlan, edited: &[EditedParam]) -> Result<usize> {
        let at = plan.boundary.ok_or_else(|| Error::input("`placement` balanced needs the boundary block (the planner chooses it)"))?;
        if !plan.split {
            return Err(Error::input("`placement` balanced divides the model between two devices: give `sub_device`"));
        }
        let chain_at = plan.chain.at();
        if chain_at.len() != plan.chain.len() || chain_at.iter().chain([&at]).collect::<Vec<_>>().windows(2).any(|w| w[0] >= w[1]) {
            return Err(Error::input(format!(
                "the chain's boundaries {:?} (then {at}) must increase, one per device of `sub_device` {}",
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


    /// The frozen weight `name` on the main device.
    pub fn weight(&self, name: &str) -> Result<&Tensor> {
        self.lm.params.get(name).ok_or_else(|| Error::input(format!("unknown parameter {name:?}")))
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
