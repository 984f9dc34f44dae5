//! The meta-loss of one micro-batch: the edit made on `edit_inner` (with the editor's
//! hooks), the edited model scored on the rephrase (`edit_outer`) and, against the
//! unedited model, on the locality text (and the image views of multimodal records).
use serde::Serialize;
use tch::Tensor;

use crate::config::{Aggregate, MendConfig};
use crate::data::multimodal::StepImages;
use crate::data::{EditExample, Example, TokenBatch};
use crate::mend::{losses, Editor, Engine};
use crate::placed::{LogitsLoss, Pending};
use crate::model::Overrides;
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
    pub(crate) fn add_scaled(&mut self, o: &StepLosses, w: f64) {
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
        let loc: Vec<&Example> = examples.iter().flat_map(|e| e.loc.iter().chain(&e.neighbours)).collect();
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
pub(crate) fn roles(engine: &Engine) -> (&'static str, &'static str) {
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
