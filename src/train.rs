//! MEND meta-training: edit on `edit_inner`, score the edited model on the rephrase
//! (`edit_outer`) and on unrelated locality text, update the editor.
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Instant;

use serde::Serialize;
use tch::Tensor;
use tracing::{info, warn};

use crate::config::{Aggregate, MendConfig, SelectBy};
use crate::data::multimodal::StepImages;
use crate::data::{EditExample, Example, TokenBatch};
use crate::device::memory::MemoryTracker;
use crate::device::timeline::{Span, TimelineSummary};
use crate::device::OptimizerDevice;
use crate::mend::checkpoint::{self, TrainCounters};
use crate::mend::optim::Adam;
use crate::mend::{losses, Editor, Engine, LogitsLoss, Pending};
use crate::model::Overrides;
use crate::rng::SplitMix64;
use crate::{Error, Result};

/// The losses of one micro-batch, already weighted.
#[derive(Debug, Clone, Copy, Default, Serialize, PartialEq)]
pub struct StepLosses {
    pub loss: f64,
    pub edit_nll: f64,
    pub loc_kl: f64,
    /// Token accuracy of the new target on the rephrase after the edit.
    pub edit_acc: f64,
    /// Share of locality tokens whose top-1 prediction the edit left unchanged (1 without
    /// locality text): the locality metric, as `eval` computes it.
    pub loc_acc: f64,
    /// Multimodal only: the edit NLL on the rephrase image (`edit_outer_image`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub image_edit_nll: Option<f64>,
    /// Multimodal only: token accuracy of the target on the rephrase image.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub image_edit_acc: Option<f64>,
    /// Multimodal only: KL(pre ‖ post) on `loc_image`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub image_loc_kl: Option<f64>,
    /// Multimodal only: share of `loc_image` top-10 entries unchanged (EasyEdit's
    /// `multimodal_locality_acc`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub image_loc_acc: Option<f64>,
}

fn add_opt(a: &mut Option<f64>, b: Option<f64>, w: f64) {
    if let Some(v) = b {
        *a = Some(a.unwrap_or(0.0) + v * w);
    }
}

impl StepLosses {
    /// Adds `w` times each figure of `o`: means over micro-batches or validation records.
    fn add_scaled(&mut self, o: &StepLosses, w: f64) {
        self.loss += o.loss * w;
        self.edit_nll += o.edit_nll * w;
        self.loc_kl += o.loc_kl * w;
        self.edit_acc += o.edit_acc * w;
        self.loc_acc += o.loc_acc * w;
        add_opt(&mut self.image_edit_nll, o.image_edit_nll, w);
        add_opt(&mut self.image_edit_acc, o.image_edit_acc, w);
        add_opt(&mut self.image_loc_kl, o.image_loc_kl, w);
        add_opt(&mut self.image_loc_acc, o.image_loc_acc, w);
    }
}

/// The batches of a group of examples: EasyEdit's `edit_inner`, `edit_outer`, `loc` and,
/// with multimodal data, `edit_outer_image` and `loc_image`.
pub struct EditBatches {
    pub inner: TokenBatch,
    /// What the edit loss scores: the rephrases, then (with `inner_in_edit_loss`) the
    /// edit prompts themselves.
    pub outer: TokenBatch,
    pub loc: Option<TokenBatch>,
    /// The edit prompts shown with the rephrase images (multimodal).
    pub outer_image: Option<TokenBatch>,
    /// Unrelated images and questions (multimodal).
    pub loc_image: Option<TokenBatch>,
    /// The views the edited model scores, grouped by length (see [`EditBatches::groups`]):
    /// one forward per group, so the weights are read (and the edit crosses the mover)
    /// once per group, and a short view (the text `loc`, ~16–44 tokens) is not padded to
    /// an image view's ~80–290. Each group's views are in the order outer, outer_image,
    /// loc, loc_image (those present); a group of one view holds no batch and runs that
    /// view's own. Empty when `outer` is the only view.
    pub edited: Vec<EditedGroup>,
}

/// The scored views an [`EditBatches`] can hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum View {
    Outer,
    OuterImage,
    Loc,
    LocImage,
}

/// Views the edited model scores in one forward: `batch` holds their rows in `views`'
/// order (`None`: one view, whose own batch is run).
#[derive(Debug)]
pub struct EditedGroup {
    pub views: Vec<View>,
    pub batch: Option<TokenBatch>,
}

/// The edited model's logits of each scored view, split out of the one edited forward.
struct Posts {
    outer: Tensor,
    outer_image: Option<Tensor>,
    loc: Option<Tensor>,
    loc_image: Option<Tensor>,
}

impl EditBatches {
    /// The batches EasyEdit builds for text examples: the edit loss scores the rephrases.
    pub fn new(examples: &[&EditExample], pad: i64, device: tch::Device) -> Self {
        let Ok(b) = Self::build(examples, false, |ex| Ok::<_, std::convert::Infallible>(TokenBatch::collate(ex, pad, device)));
        b
    }

    /// The batches `cfg` asks for (see [`MendConfig::inner_in_edit_loss`]), on the
    /// engine's main device, with the features of every distinct image of the group
    /// computed once by the frozen tower and shared by the views that show it.
    pub fn for_config(engine: &Engine, examples: &[&EditExample], cfg: &MendConfig) -> Result<Self> {
        let all: Vec<&Example> = examples
            .iter()
            .flat_map(|e| [Some(&e.inner), Some(&e.outer), e.outer_image.as_ref(), e.loc.as_ref(), e.loc_image.as_ref()])
            .flatten()
            .collect();
        let images = engine.images(&all)?;
        Self::for_config_with(engine, examples, cfg, images.as_ref())
    }

    /// [`EditBatches::for_config`] with the group's image features computed beforehand
    /// (by [`Engine::images`], or from pixel values by
    /// [`crate::data::multimodal::StepImages::from_prepared`]).
    pub fn for_config_with(engine: &Engine, examples: &[&EditExample], cfg: &MendConfig, images: Option<&StepImages>) -> Result<Self> {
        let b = Self::build(examples, cfg.inner_in_edit_loss, |ex| engine.collate_with(ex, images))?;
        // The scored views' prefix activations are computed once per group, for the batch
        // of all of its views, and each view's are its rows of those.
        for g in &b.edited {
            if let Some(all) = &g.batch {
                let mut row = 0;
                let mut parts = Vec::new();
                for v in &g.views {
                    let v = b.view(*v).ok_or_else(|| Error::Torch("an edited group names a missing view".into()))?;
                    parts.push((v, row));
                    row += v.batch_size();
                }
                engine.share_boundary(all, &parts)?;
            }
        }
        Ok(b)
    }

    /// The batch of a scored view, if present.
    pub fn view(&self, v: View) -> Option<&TokenBatch> {
        match v {
            View::Outer => Some(&self.outer),
            View::OuterImage => self.outer_image.as_ref(),
            View::Loc => self.loc.as_ref(),
            View::LocImage => self.loc_image.as_ref(),
        }
    }

    /// The present views grouped for the edited forwards, from their `(rows, tokens)`
    /// shapes (canonical order kept within a group). Longest first, a view joins the
    /// current group when padding it to the group's length wastes at most half of its
    /// padded tokens (`2·t ≥ T`); otherwise it starts the next group. Every row of a view
    /// is computed exactly as alone (causal attention, right padding), so the grouping
    /// changes the arithmetic, not the results. E-VQA (three image views of ~290 tokens,
    /// a text `loc` of ~44): two forwards of 3×290 and 1×44 token-rows instead of 4×290.
    pub fn groups(views: &[(View, i64, i64)]) -> Vec<Vec<View>> {
        let mut order: Vec<usize> = (0..views.len()).collect();
        // Stable: equal lengths stay in canonical order.
        order.sort_by_key(|&i| std::cmp::Reverse(views[i].2));
        let mut groups: Vec<(i64, Vec<usize>)> = Vec::new();
        for i in order {
            let t = views[i].2;
            match groups.last_mut() {
                Some((len, members)) if 2 * t >= *len => members.push(i),
                _ => groups.push((t, vec![i])),
            }
        }
        groups
            .into_iter()
            .map(|(_, mut m)| {
                m.sort_unstable();
                m.into_iter().map(|i| views[i].0).collect()
            })
            .collect()
    }

    fn build<E>(
        examples: &[&EditExample],
        inner_in_edit_loss: bool,
        mut collate: impl FnMut(&[&Example]) -> std::result::Result<TokenBatch, E>,
    ) -> std::result::Result<Self, E> {
        let inner: Vec<&Example> = examples.iter().map(|e| &e.inner).collect();
        let mut outer: Vec<&Example> = examples.iter().map(|e| &e.outer).collect();
        if inner_in_edit_loss {
            outer.extend(&inner);
        }
        let outer_image: Vec<&Example> = examples.iter().filter_map(|e| e.outer_image.as_ref()).collect();
        let loc: Vec<&Example> = examples.iter().filter_map(|e| e.loc.as_ref()).collect();
        let loc_image: Vec<&Example> = examples.iter().filter_map(|e| e.loc_image.as_ref()).collect();
        let inner_b = collate(&inner)?;
        let outer_b = collate(&outer)?;
        let mut some = |v: &[&Example]| (!v.is_empty()).then(|| collate(v)).transpose();
        let mut b = Self {
            inner: inner_b,
            outer: outer_b,
            outer_image: some(&outer_image)?,
            loc: some(&loc)?,
            loc_image: some(&loc_image)?,
            edited: Vec::new(),
        };
        let shapes: Vec<(View, i64, i64)> = [View::Outer, View::OuterImage, View::Loc, View::LocImage]
            .into_iter()
            .filter_map(|v| b.view(v).map(|t| (v, t.batch_size(), t.input_ids.size()[1])))
            .collect();
        if shapes.len() > 1 {
            let examples = |v: View| -> &[&Example] {
                match v {
                    View::Outer => &outer,
                    View::OuterImage => &outer_image,
                    View::Loc => &loc,
                    View::LocImage => &loc_image,
                }
            };
            for views in Self::groups(&shapes) {
                let batch = if views.len() > 1 {
                    let rows: Vec<&Example> = views.iter().flat_map(|v| examples(*v).iter().copied()).collect();
                    Some(collate(&rows)?)
                } else {
                    None
                };
                b.edited.push(EditedGroup { views, batch });
            }
        }
        Ok(b)
    }

    /// The edited logits of every scored view from one forward over `edited`.
    fn edited_posts(&self, engine: &Engine, overrides: &Overrides) -> Result<Posts> {
        if self.edited.is_empty() {
            return Ok(Posts { outer: engine.edited_logits_on_sub(overrides, &self.outer)?, outer_image: None, loc: None, loc_image: None });
        }
        let mut posts: Vec<(View, Tensor)> = Vec::with_capacity(4);
        for g in &self.edited {
            let missing = || Error::Torch("an edited group names a missing view".into());
            match (&g.batch, g.views.as_slice()) {
                (None, [v]) => posts.push((*v, engine.edited_logits_on_sub(overrides, self.view(*v).ok_or_else(missing)?)?)),
                (Some(all), views) => {
                    let logits = engine.edited_logits_on_sub(overrides, all)?;
                    let mut at = 0i64;
                    for v in views {
                        let n = self.view(*v).ok_or_else(missing)?.keep.sum(tch::Kind::Int64).int64_value(&[]);
                        posts.push((*v, logits.narrow(0, at, n)));
                        at += n;
                    }
                }
                (None, _) => return Err(Error::Torch("an edited group of several views has no batch".into())),
            }
        }
        let mut take = |v: View| posts.iter().position(|(w, _)| *w == v).map(|i| posts.swap_remove(i).1);
        let outer = take(View::Outer).ok_or_else(|| Error::Torch("no edit_outer logits".into()))?;
        Ok(Posts { outer, outer_image: take(View::OuterImage), loc: take(View::Loc), loc_image: take(View::LocImage) })
    }
}

/// Forward of the meta-training loss for one micro-batch; returns the differentiable loss
/// `c_edit·l_edit + c_loc·(l_loc + l_image_loc) + i_edit·l_image_edit` (the image terms
/// with multimodal data, as EasyEdit's MultimodalTrainer), every NLL with the next-token
/// shift (EasyEdit's Qwen2-VL path scores position i against label i; dualedit does not).
///
/// With `recompute` in the config (and the edit differentiable), the edited forwards and
/// their backward run here, block by block ([`Engine::edited_grads`]); the tensor returned
/// then has the loss's value and, as its gradient w.r.t. each edited weight `W'`, exactly
/// `∂loss/∂W'`, so its backward reaches the editor just as the ordinary loss's would.
pub fn meta_loss(engine: &Engine, editor: &mut Editor, b: &EditBatches, training: bool) -> Result<(Tensor, StepLosses)> {
    meta_loss_aggregated(engine, editor, b, training, &[])
}

/// [`meta_loss`] with the unrelated keys' Grams `C` (`[d_in, d_in]` per edited weight, the
/// key statistics of [`MendConfig::key_stats_text`]) that an editor with
/// `aggregate: least_squares` solves against: its batch's edits are combined by the
/// edit-time solve ([`crate::mend::ls::aggregate`]) instead of summed, and the losses
/// differentiate through it. Ignored with `aggregate: sum`.
pub fn meta_loss_aggregated(engine: &Engine, editor: &mut Editor, b: &EditBatches, training: bool, unrelated: &[Tensor]) -> Result<(Tensor, StepLosses)> {
    let cfg = editor.config.clone();
    let least_squares = cfg.aggregate == Aggregate::LeastSquares;
    if least_squares && unrelated.is_empty() && cfg.ls.cov_weight > 0.0 {
        return Err(Error::input("aggregate least_squares with ls.keep_weight > 0 needs the key statistics of key_stats_text"));
    }
    // The unedited reference for locality does not depend on the edit: when split, it runs
    // on the sub-device's worker while the main device captures and runs the editor.
    let base_loc = b.loc.as_ref().map(|l| engine.base_logits_async(l)).transpose()?;
    let base_loc_image = b.loc_image.as_ref().map(|l| engine.base_logits_async(l)).transpose()?;
    let tl = &engine.timeline;
    let (capture_on, edits_on) = roles(engine);
    let (_, factors, positions) = tl.span(capture_on, "capture", || engine.capture_by_example(&b.inner, &std::collections::HashMap::new()))?;
    // Recomputation differentiates w.r.t. whole edited weights (`Engine::edited_grads`);
    // otherwise the edit stays factored, and the backward reaches the editor through the
    // factors without a weight-sized gradient. The least-squares aggregation's change is
    // `(I, S)` per weight, `S` differentiable through the solve.
    let overrides = tl.span("main", "editor", || {
        if least_squares {
            let t_len = b.inner.input_ids.size()[1];
            crate::mend::ls::aggregate(engine, editor, (&factors, &positions, t_len), &cfg.ls, unrelated, training)
        } else if cfg.recompute {
            engine.edit(editor, &factors, training)
        } else {
            engine.edit_low_rank(editor, &factors, training)
        }
    })?;
    // Targets go where the edited logits are: the losses are computed on the sub-device and
    // only the scalar loss comes back (autograd carries its gradient across).
    let targets = engine.mover.to_sub(&b.outer.kept_targets());
    let targets_image = b.outer_image.as_ref().map(|o| engine.mover.to_sub(&o.kept_targets()));
    if cfg.recompute && overrides.dense().values().any(Tensor::requires_grad) {
        // The edited forwards with their (recomputed) backward.
        return tl.span(edits_on, "edited forwards", || recomputed_meta_loss(engine, &cfg, b, (&targets, targets_image.as_ref()), &overrides, (base_loc, base_loc_image)));
    }
    let post = tl.span(edits_on, "edited forwards", || b.edited_posts(engine, &overrides))?;
    let l_edit = losses::nll(&post.outer, &targets);
    let image_edit = match (&post.outer_image, &targets_image) {
        (Some(p), Some(t)) => Some((p.shallow_clone(), losses::nll(p, t))),
        _ => None,
    };
    let loc = match (post.loc, &b.loc, base_loc) {
        (Some(post), Some(l), Some(base)) => Some(locality(l, &base.wait()?, &post, 1)),
        _ => None,
    };
    let loc_image = match (post.loc_image, &b.loc_image, base_loc_image) {
        (Some(post), Some(l), Some(base)) => Some(locality(l, &base.wait()?, &post, 10)),
        _ => None,
    };
    let (loss, parts) = weigh(&cfg, b, (&targets, targets_image.as_ref()), (&post.outer, &l_edit), image_edit, loc, loc_image);
    Ok((engine.mover.to_main(&loss), parts))
}

/// The timeline's device of the capture and of the edited forwards: the sub-device where
/// they run there (the capture only under a layer split), else main.
fn roles(engine: &Engine) -> (&'static str, &'static str) {
    let sub = |on: bool| if on { "sub" } else { "main" };
    (sub(engine.layer_split()), sub(engine.plan.split))
}

/// The locality KL (differentiable) and the share of locality entries unchanged: each
/// kept position's top-`k` token list, compared entry by entry (k = 1: the top-1
/// prediction, `locality_acc`; k = 10: EasyEdit's `multimodal_locality_acc`, here at the
/// answer positions the KL covers, where `eval` compares every position as EasyEdit does).
fn locality(loc: &TokenBatch, base: &Tensor, post: &Tensor, k: i64) -> (Tensor, f64) {
    let agree = if k == 1 {
        // Per row, then the mean over rows (as `eval` reports text locality).
        let rows = loc.kept_rows().to_device(post.device());
        let a = losses::agreement(&post.detach(), base, &rows, loc.batch_size());
        a.iter().sum::<f64>() / a.len().max(1) as f64
    } else {
        losses::topk_agreement(&post.detach(), base, k)
    };
    (losses::kl(base, post), agree)
}

/// The weighted loss and its parts, from the edited logits of the edit-loss batches and
/// the locality terms of [`locality`] (no locality text: a zero KL).
fn weigh(
    cfg: &MendConfig,
    b: &EditBatches,
    (targets, targets_image): (&Tensor, Option<&Tensor>),
    (post_outer, l_edit): (&Tensor, &Tensor),
    image_edit: Option<(Tensor, Tensor)>,
    loc: Option<(Tensor, f64)>,
    loc_image: Option<(Tensor, f64)>,
) -> (Tensor, StepLosses) {
    let (l_loc, loc_acc) = loc.unwrap_or_else(|| (l_edit.zeros_like(), 1.0));
    let rows = b.outer.kept_rows().to_device(post_outer.device());
    let (acc, _) = losses::token_accuracy(post_outer, targets, &rows, b.outer.batch_size());
    let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len().max(1) as f64;
    let mut loss = l_edit * cfg.c_edit + &l_loc * cfg.c_loc;
    let mut parts = StepLosses { edit_nll: l_edit.double_value(&[]), loc_kl: l_loc.double_value(&[]), edit_acc: mean(&acc), loc_acc, ..Default::default() };
    if let (Some((post, l)), Some(t), Some(ob)) = (image_edit, targets_image, &b.outer_image) {
        let rows = ob.kept_rows().to_device(post.device());
        let (acc, _) = losses::token_accuracy(&post, t, &rows, ob.batch_size());
        loss = loss + &l * cfg.i_edit;
        parts.image_edit_nll = Some(l.double_value(&[]));
        parts.image_edit_acc = Some(mean(&acc));
    }
    if let Some((kl, agree)) = loc_image {
        loss = loss + &kl * cfg.c_loc;
        parts.image_loc_kl = Some(kl.double_value(&[]));
        parts.image_loc_acc = Some(agree);
    }
    parts.loss = loss.double_value(&[]);
    (loss, parts)
}

/// [`meta_loss`] with the edited forwards recomputed block by block in their backward.
///
/// The losses are computed as in [`meta_loss`] (the weighted terms are what each pass
/// differentiates, so the gradients match the ordinary backward's). The returned tensor is
/// `Σ_i ⟨W'_i, G_i⟩` with `G_i = ∂loss/∂W'_i` detached, whose gradient w.r.t. `W'_i` is
/// `G_i`, shifted by a constant to carry the loss's value.
fn recomputed_meta_loss(
    engine: &Engine,
    cfg: &MendConfig,
    b: &EditBatches,
    targets: (&Tensor, Option<&Tensor>),
    overrides: &Overrides,
    (base_loc, base_loc_image): (Option<Pending>, Option<Pending>),
) -> Result<(Tensor, StepLosses)> {
    let mut outer: Option<(Tensor, Tensor)> = None;
    let mut image_edit: Option<(Tensor, Tensor)> = None;
    let mut loc: Option<(Tensor, f64)> = None;
    let mut loc_image: Option<(Tensor, f64)> = None;
    let grads = {
        let mut passes: Vec<(&TokenBatch, LogitsLoss)> = vec![(
            &b.outer,
            Box::new(|logits: &Tensor| {
                let l = losses::nll(logits, targets.0);
                outer = Some((logits.detach(), l.detach()));
                Ok(&l * cfg.c_edit)
            }),
        )];
        if let (Some(ob), Some(t)) = (&b.outer_image, targets.1) {
            passes.push((
                ob,
                Box::new(|logits: &Tensor| {
                    let l = losses::nll(logits, t);
                    image_edit = Some((logits.detach(), l.detach()));
                    Ok(&l * cfg.i_edit)
                }),
            ));
        }
        for (batch, base, k, slot) in [(&b.loc, base_loc, 1, &mut loc), (&b.loc_image, base_loc_image, 10, &mut loc_image)] {
            if let (Some(l), Some(base)) = (batch, base) {
                passes.push((
                    l,
                    Box::new(move |logits: &Tensor| {
                        let (kl, agree) = locality(l, &base.wait()?, logits, k);
                        *slot = Some((kl.detach(), agree));
                        Ok(&kl * cfg.c_loc)
                    }),
                ));
            }
        }
        engine.edited_grads(overrides, passes)?
    };
    let (post_outer, l_edit) = outer.ok_or_else(|| Error::Internal("the edited forward of edit_outer did not run".into()))?;
    crate::error::guard(|| {
        let (loss, parts) = weigh(cfg, b, targets, (&post_outer, &l_edit), image_edit, loc, loc_image);
        let inner = grads
            .iter()
            .map(|(name, g)| engine.scalar_to_main(&(&overrides.dense()[name] * g).sum(tch::Kind::Float)))
            .fold(Tensor::zeros([], (tch::Kind::Float, engine.plan.main)), |a, b| a + b);
        // Value: the loss (inner − inner = 0 exactly); gradient: that of `inner`.
        let surrogate = &inner - inner.detach() + engine.mover.to_main(&loss);
        Ok((surrogate, parts))
    })
}

/// With `aggregate: least_squares` and a `key_stats_text`: the key statistics of the
/// engine's (unedited) model over that text, which the training solve keeps and which are
/// saved with the editor; else none.
fn key_stats(engine: &Engine, cfg: &MendConfig, progress: bool) -> Result<Option<crate::mend::stats::KeyStats>> {
    match (cfg.aggregate, &cfg.key_stats_text) {
        (Aggregate::LeastSquares, Some(text)) => {
            info!(text = %text.display(), "key statistics for the least-squares aggregation");
            crate::mend::stats::KeyStats::compute(engine, text, usize::MAX, progress).map(Some)
        }
        (Aggregate::LeastSquares, None) if cfg.ls.cov_weight > 0.0 => Err(Error::input(
            "aggregate least_squares keeps unrelated text's keys (ls.keep_weight > 0): set key_stats_text in the config to a text file (the model's pretraining corpus, say), or ls.keep_weight to 0",
        )),
        _ => Ok(None),
    }
}

/// Deterministic data order: position `g` of the endless stream of examples, reshuffled
/// each epoch from the seed, so a resumed run sees exactly the data it would have seen.
fn example_at(n: usize, seed: i64, g: usize) -> usize {
    let epoch = g / n;
    let mut order: Vec<usize> = (0..n).collect();
    SplitMix64::new(seed as u64, 1000 + epoch as u64).shuffle(&mut order);
    order[g % n]
}

/// One optimiser step in the report's history: its losses (the means over its
/// micro-batches, the same fields at the top level of the JSON), the gradient norm and
/// its wall time (its micro-batches and the optimiser's update; the losses are read back,
/// so a GPU's queued work is finished when it is taken), which gives the time per step
/// after the first (warm-up) step without a separate benchmark.
#[derive(Debug, Clone, Serialize)]
pub struct StepLog {
    pub step: usize,
    #[serde(flatten)]
    pub losses: StepLosses,
    pub grad_norm: f64,
    pub seconds: f64,
}

#[derive(Debug, Clone, Serialize)]
pub struct ValLog {
    pub step: usize,
    pub loss: f64,
    pub edit_acc: f64,
    pub loc_kl: f64,
    pub loc_acc: f64,
}

impl ValLog {
    fn at(step: usize, l: &StepLosses) -> Self {
        Self { step, loss: l.loss, edit_acc: l.edit_acc, loc_kl: l.loc_kl, loc_acc: l.loc_acc }
    }

    /// What checkpoint selection and early stopping minimise (see [`SelectBy`]).
    pub fn criterion(&self, by: SelectBy) -> f64 {
        match by {
            SelectBy::Loss => self.loss,
            SelectBy::Accuracy => -(self.edit_acc + self.loc_acc),
        }
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct TrainReport {
    pub steps: usize,
    pub skipped_steps: usize,
    /// Best validation criterion: the loss, or −(edit_acc + loc_acc) with `select_by: accuracy`.
    pub best_val_loss: f64,
    pub seconds_per_step: f64,
    pub editor_parameters: i64,
    pub history: Vec<StepLog>,
    pub validations: Vec<ValLog>,
    pub editor_dir: PathBuf,
    pub stopped_early: bool,
    /// Bytes the offloaded optimiser carried (gradients out, updates back); 0 when the
    /// optimiser state is beside the editor.
    pub optimizer_bytes_moved: u64,
    /// When each phase of the first [`TIMELINE_STEPS`] optimiser steps ran on which
    /// device, and how much the devices' work overlapped.
    pub timeline: TimelineReport,
}

/// Optimiser steps of a run whose phases the timeline records (from the first step run).
pub const TIMELINE_STEPS: usize = 3;

#[derive(Debug, Clone, Serialize)]
pub struct TimelineReport {
    pub summary: TimelineSummary,
    pub spans: Vec<Span>,
}

pub struct TrainSetup<'a> {
    pub config: &'a MendConfig,
    pub train: &'a [EditExample],
    pub val: &'a [EditExample],
    pub out: &'a Path,
    pub seed: i64,
    pub resume: bool,
    pub progress: bool,
}

/// Mean validation losses (editor in evaluation mode: statistics frozen, no gradients).
pub fn validate(engine: &Engine, editor: &mut Editor, val: &[EditExample]) -> Result<ValLog> {
    validate_aggregated(engine, editor, val, &[])
}

/// [`validate`] with the least-squares aggregation's key Grams ([`meta_loss_aggregated`]).
pub fn validate_aggregated(engine: &Engine, editor: &mut Editor, val: &[EditExample], unrelated: &[Tensor]) -> Result<ValLog> {
    let _g = tch::no_grad_guard();
    let mut mean = StepLosses::default();
    for e in val {
        let b = EditBatches::for_config(engine, &[e], &editor.config)?;
        let (_, l) = meta_loss_aggregated(engine, editor, &b, false, unrelated)?;
        mean.add_scaled(&l, 1.0 / val.len() as f64);
    }
    Ok(ValLog::at(0, &mean))
}

/// Env var for fault injection in tests: an impossible allocation at this step, to
/// exercise the out-of-memory path end to end on a machine with memory to spare. Read
/// once per run, and only by builds with the `fault-injection` feature (the tests').
pub const FAULT_OOM_STEP: &str = "DUALEDIT_FAULT_OOM_STEP";

/// The step [`FAULT_OOM_STEP`] names, in builds with the `fault-injection` feature.
fn fault_oom_step() -> Option<usize> {
    if cfg!(feature = "fault-injection") {
        std::env::var(FAULT_OOM_STEP).ok().and_then(|v| v.parse().ok())
    } else {
        None
    }
}

/// The micro-batches of one optimiser step: forwards, backwards, accumulated gradients.
#[allow(clippy::too_many_arguments)] // one step's state, passed apart so each is borrowed as it must be
fn accumulate(
    engine: &Engine,
    editor: &mut Editor,
    setup: &TrainSetup,
    step: usize,
    seed: i64,
    mut tracker: Option<&mut MemoryTracker>,
    phase: &mut &'static str,
    fault: Option<usize>,
    unrelated: &[Tensor],
) -> Result<StepLosses> {
    let cfg = setup.config;
    let n = setup.train.len();
    let k = cfg.accumulate as f64;
    let mut acc = StepLosses::default();
    for micro in 0..cfg.accumulate {
        let base = (step * cfg.accumulate + micro) * cfg.batch_size;
        let batch: Vec<&EditExample> = (0..cfg.batch_size).map(|j| &setup.train[example_at(n, seed, base + j)]).collect();
        engine.timeline.at(step, micro);
        let b = EditBatches::for_config(engine, &batch, &editor.config)?;
        *phase = "capture, editor and edited forwards";
        let (loss, parts) = meta_loss_aggregated(engine, editor, &b, true, unrelated)?;
        if fault == Some(step) {
            let _ = Tensor::f_empty([1i64 << 50], (tch::Kind::Float, engine.plan.sub))?;
        }
        if let (Some(t), 0) = (tracker.as_deref_mut(), micro) {
            t.mark("edited_forward")?;
        }
        *phase = "backward";
        engine.timeline.span(roles(engine).1, "backward", || {
            crate::error::guard(|| {
                (loss / k).f_backward()?;
                Ok(())
            })
        })?;
        if let (Some(t), 0) = (tracker.as_deref_mut(), micro) {
            t.mark("backward")?;
        }
        acc.add_scaled(&parts, 1.0 / k);
    }
    Ok(acc)
}

/// A step counter with elapsed time, ETA and a message: a bar on a terminal, plain lines
/// in a log ([`crate::progress`]), nothing when `show` is false.
pub(crate) fn progress_bar(what: &str, steps: usize, show: bool) -> crate::progress::Progress {
    crate::progress::Progress::new(what, steps, show)
}

/// Set by an embedding program (the Python package, on Ctrl-C) to end a running
/// [`train`] after its current step as if that were the last: validated, the best editor
/// and the resumable state saved, the report returned with `stopped_early`. Process-wide;
/// cleared when a training loop takes it.
pub static STOP_REQUESTED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Runs meta-training; writes the best editor (by the `select_by` validation criterion)
/// and the training state to `setup.out`.
pub fn train(engine: &Engine, editor: &mut Editor, setup: &TrainSetup, tracker: &mut MemoryTracker) -> Result<TrainReport> {
    let cfg = setup.config;
    if setup.train.is_empty() {
        return Err(Error::input("no training examples"));
    }
    let out = setup.out;
    let (mut counters, saved_adam) = start_or_resume(editor, setup)?;
    let mut adam = optimiser(engine, editor, cfg, &counters, saved_adam.as_ref(), tracker, out)?;
    let bar = progress_bar("train", cfg.max_steps, setup.progress);
    bar.set_position(counters.step as u64);
    let mut history = Vec::new();
    let mut validations = Vec::new();
    let mut consecutive_bad = 0usize;
    let mut stopped_early = false;
    let start = Instant::now();
    let first_step = counters.step;
    let fault = fault_oom_step();
    let mut stats = key_stats(engine, cfg, setup.progress)?;
    let unrelated = match &stats {
        Some(s) => s.grams()?,
        None => Vec::new(),
    };
    engine.timeline.set_on(true);
    while counters.step < cfg.max_steps {
        let step = counters.step;
        let step_start = Instant::now();
        engine.timeline.set_on(step < first_step + TIMELINE_STEPS);
        let mark = step < first_step + 2 || step.is_multiple_of(cfg.val_every);
        let mut phase = "start";
        let acc = accumulate(engine, editor, setup, step, counters.seed, mark.then_some(&mut *tracker), &mut phase, fault, &unrelated)
            .map_err(|e| keep_after_failed_step(e, engine, editor, &mut adam, &counters, phase, cfg, tracker, out))?;
        // A failure in the optimiser step may leave the editor half-updated: nothing is
        // saved then, and the state from the last validation (if any) stays the resume point.
        let grad_norm = update(engine, &mut adam, cfg, step, acc.loss, tracker, out)?;
        if !acc.loss.is_finite() || !grad_norm.is_finite() {
            counters.skipped_steps += 1;
            consecutive_bad += 1;
            warn!(step, loss = acc.loss, grad_norm, "non-finite loss or gradient; step skipped");
            if consecutive_bad >= cfg.max_bad_steps {
                checkpoint::save_state(out, editor, &adam, &counters)?;
                return Err(Error::Torch(format!(
                    "{consecutive_bad} consecutive non-finite steps at step {step}; the last good editor is in {} (try a lower lr or edit_lr)",
                    out.display()
                )));
            }
        } else {
            consecutive_bad = 0;
        }
        engine.timeline.set_on(false);
        counters.step += 1;
        counters.adam_step = adam.step;
        if mark {
            tracker.mark("optimizer_step")?;
        }
        history.push(StepLog { step: counters.step, losses: acc, grad_norm, seconds: step_start.elapsed().as_secs_f64() });
        // The last validation (on the held-out split) rides along the training losses.
        let val = validations.last().map_or(String::new(), |v: &ValLog| {
            format!(" | val@{} loss {:.4} edit_acc {:.2} loc_acc {:.2}", v.step, v.loss, v.edit_acc, v.loc_acc)
        });
        bar.set_message(format!(
            "loss {:.4} edit_acc {:.2} loc_kl {:.4} loc_acc {:.2}{val}",
            acc.loss, acc.edit_acc, acc.loc_kl, acc.loc_acc
        ));
        bar.set_position(counters.step as u64);
        let stop = STOP_REQUESTED.swap(false, std::sync::atomic::Ordering::SeqCst);
        let last = counters.step == cfg.max_steps || stop;
        if counters.step.is_multiple_of(cfg.val_every) || last {
            validations.push(validate_and_select(engine, editor, setup, &mut counters, &acc, tracker, &unrelated)?);
            checkpoint::save_state(out, editor, &adam, &counters)?;
            if stop {
                info!(step = counters.step, "stopped on request: editor and training state saved");
                stopped_early = true;
                break;
            }
            if counters.stale_validations >= cfg.early_stop_patience {
                info!(step = counters.step, "early stopping: validation has not improved");
                stopped_early = true;
                break;
            }
        }
    }
    bar.finish_and_clear();
    if let Some(s) = stats.as_mut() {
        // The edit-time solve keeps the `C` the editor was trained against.
        if out.join(checkpoint::EDITOR_JSON).is_file() {
            s.write_for_editor(out)?;
        }
    }
    engine.timeline.set_on(false);
    let timeline = TimelineReport { summary: engine.timeline.summary(), spans: engine.timeline.spans() };
    info!(timeline = %timeline.summary.text, "phases per device");
    let steps_run = counters.step - first_step;
    Ok(TrainReport {
        steps: counters.step,
        skipped_steps: counters.skipped_steps,
        best_val_loss: counters.best_val,
        seconds_per_step: start.elapsed().as_secs_f64() / steps_run.max(1) as f64,
        editor_parameters: editor.n_parameters(),
        history,
        validations,
        editor_dir: out.to_path_buf(),
        stopped_early,
        optimizer_bytes_moved: adam.moved_bytes(),
        timeline,
    })
}

/// The loop's counters: fresh, or with `setup.resume` those saved in `setup.out` (with
/// the saved Adam moments to load). A resumed run keeps the saved seed (its data order),
/// and starts best-editor selection over when `select_by` changed since.
fn start_or_resume(editor: &mut Editor, setup: &TrainSetup) -> Result<(TrainCounters, Option<BTreeMap<String, Tensor>>)> {
    let (cfg, out) = (setup.config, setup.out);
    let fresh = TrainCounters {
        step: 0,
        adam_step: 0,
        best_val: f64::INFINITY,
        best_val_by: Some(cfg.select_by),
        stale_validations: 0,
        skipped_steps: 0,
        seed: setup.seed,
    };
    if !setup.resume {
        return Ok((fresh, None));
    }
    if !out.join(checkpoint::STATE_FILE).exists() {
        warn!(dir = %out.display(), "--resume given but no training state found; starting afresh");
        return Ok((fresh, None));
    }
    let (tensors, mut counters) = checkpoint::load_state(out, editor)?;
    if counters.seed != setup.seed {
        warn!(saved = counters.seed, given = setup.seed, "resuming with the saved seed");
    }
    info!(step = counters.step, "resuming");
    if let Some(by) = counters.best_val_by.filter(|&by| by != cfg.select_by) {
        warn!(
            saved = ?by,
            now = ?cfg.select_by,
            "select_by changed since the saved run: the best editor so far was picked by the other criterion, so selection and early stopping start over"
        );
        counters.best_val = f64::INFINITY;
        counters.stale_validations = 0;
    }
    counters.best_val_by = Some(cfg.select_by);
    Ok((counters, Some(tensors)))
}

/// Adam over the editor's network (`lr`) and its learned edit rates (`lr_lr`), its moments
/// where `--optimizer-device` puts them, and the saved moments of a resumed run loaded.
#[allow(clippy::too_many_arguments)] // the run's parts, each borrowed as it must be
fn optimiser(
    engine: &Engine,
    editor: &mut Editor,
    cfg: &MendConfig,
    counters: &TrainCounters,
    saved: Option<&BTreeMap<String, Tensor>>,
    tracker: &mut MemoryTracker,
    out: &Path,
) -> Result<Adam> {
    let (net, lrs) = editor.trainables();
    let groups = vec![(cfg.lr, net), (cfg.lr_lr, lrs)];
    if engine.plan.optimizer == OptimizerDevice::Sub && !engine.plan.split {
        // It used to fall back to the main device silently, which is not what was asked.
        return Err(Error::input("--optimizer-device sub needs a --sub-device other than --device (this run has one device): drop the flag or give a sub-device"));
    }
    let offload = engine.plan.optimizer != OptimizerDevice::Main;
    let mut adam = crate::error::guard(|| Ok(if offload { Adam::offloaded(groups, engine.plan.optimizer_device()) } else { Adam::new(groups) }))
        .map_err(|e| crate::device::oom::diagnose(e, counters.step, "optimizer setup", &engine.placement(), cfg, tracker, checkpoint::saved_state(out)))?;
    if let Some(t) = saved {
        adam.load_state(t, counters.adam_step)?;
    }
    Ok(adam)
}

/// After a step failed before touching the editor: keeps what was learned (the training
/// state, and the editor when none is saved yet) so that `--resume` continues from this
/// step, not from the last validation, and returns the error that ends the run:
/// out-of-memory and libtorch failures diagnosed (where, and what to try), any other (a
/// data error, say) as it was.
#[allow(clippy::too_many_arguments)] // the run's parts, each borrowed as it must be
fn keep_after_failed_step(
    err: Error,
    engine: &Engine,
    editor: &Editor,
    adam: &mut Adam,
    counters: &TrainCounters,
    phase: &str,
    cfg: &MendConfig,
    tracker: &mut MemoryTracker,
    out: &Path,
) -> Error {
    let step = counters.step;
    adam.zero_grad();
    let saved = checkpoint::save_state(out, editor, adam, counters).and_then(|()| {
        if out.join(checkpoint::EDITOR_FILE).exists() {
            Ok(())
        } else {
            checkpoint::save_editor(out, editor, engine, step).map(|_| ())
        }
    });
    match err {
        e @ (Error::OutOfMemory(_) | Error::Torch(_)) => match saved {
            Ok(()) => crate::device::oom::diagnose(e, step, phase, &engine.placement(), cfg, tracker, checkpoint::saved_state(out)),
            // The diagnosis still; the state on disk is the last one saved, if any.
            Err(se) => {
                warn!(dir = %out.display(), step, "saving the training state after the failed step failed too: {se}");
                crate::device::oom::diagnose(e, step, phase, &engine.placement(), cfg, tracker, checkpoint::saved_state(out))
            }
        },
        e => {
            match saved {
                Ok(()) => warn!(dir = %out.display(), step, "the run stopped on an error; the training state is saved: --resume continues from step {step}"),
                Err(se) => warn!(dir = %out.display(), step, "the run stopped on an error, and saving the training state failed too: {se}"),
            }
            e
        }
    }
}

/// The optimiser's update after a step's micro-batches: the scheduled learning rates,
/// gradients clipped to `grad_clip`, Adam applied when the loss and the gradient norm are
/// finite (the step is skipped otherwise), gradients cleared. Returns the gradient norm.
fn update(engine: &Engine, adam: &mut Adam, cfg: &MendConfig, step: usize, loss: f64, tracker: &mut MemoryTracker, out: &Path) -> Result<f64> {
    let decay = cfg.lr_schedule.factor(step, cfg.max_steps);
    adam.groups[0].lr = cfg.lr * decay;
    adam.groups[1].lr = cfg.lr_lr * decay;
    engine.timeline.at(step, cfg.accumulate);
    let opt_on = match engine.plan.optimizer {
        OptimizerDevice::Main => "main",
        OptimizerDevice::Sub if engine.plan.split => "sub",
        OptimizerDevice::Sub => "main",
        OptimizerDevice::Cpu => "cpu",
    };
    engine
        .timeline
        .span(opt_on, "optimiser", || {
            crate::error::guard(|| {
                let grad_norm = adam.clip(cfg.grad_clip);
                if loss.is_finite() && grad_norm.is_finite() {
                    adam.step();
                }
                adam.zero_grad();
                Ok(grad_norm)
            })
        })
        .map_err(|e| crate::device::oom::diagnose(e, step, "optimizer_step", &engine.placement(), cfg, tracker, checkpoint::saved_state(out)))
}

/// Validation at `counters.step` (on the step's own losses when there is no validation
/// set); the editor is saved when it is the best so far by `select_by`, and a validation
/// that is not counts towards early stopping.
fn validate_and_select(
    engine: &Engine,
    editor: &mut Editor,
    setup: &TrainSetup,
    counters: &mut TrainCounters,
    acc: &StepLosses,
    tracker: &mut MemoryTracker,
    unrelated: &[Tensor],
) -> Result<ValLog> {
    let (cfg, out) = (setup.config, setup.out);
    let mut v = if setup.val.is_empty() {
        ValLog::at(0, acc)
    } else {
        crate::error::guard(|| validate_aggregated(engine, editor, setup.val, unrelated))
            .map_err(|e| crate::device::oom::diagnose(e, counters.step, "validation", &engine.placement(), cfg, tracker, checkpoint::saved_state(out)))?
    };
    v.step = counters.step;
    info!(step = v.step, loss = v.loss, edit_acc = v.edit_acc, loc_kl = v.loc_kl, loc_acc = v.loc_acc, "validation");
    let score = v.criterion(cfg.select_by);
    if score < counters.best_val {
        counters.best_val = score;
        counters.stale_validations = 0;
        checkpoint::save_editor(out, editor, engine, counters.step)?;
    } else {
        counters.stale_validations += 1;
    }
    Ok(v)
}
