//! Sizes: what each part of the plan reads, derived once from the model family and the
//! MEND config (saved activations, the editor's shapes, the views, the vision tower).
use std::collections::BTreeMap;
use std::fmt::Write as _;


use crate::config::{EditorMode, MendConfig};
use crate::device::Placement;
use crate::model::family::{split_block_name, Dims, Family};
use crate::model::vision::ImageProcessorConfig;
use crate::model::VisionLanguage;
use crate::model::ModelInfo;
use crate::model::Model;
use crate::{Error, Result};

use super::types::{dtype_bytes, EditorShape, ImageShape, Phase, PlanOptions, ViewShape};


/// Activations saved for backward by a forward with the `edited` weights requiring grad,
/// from the first edited layer up.
/// What a forward with grad keeps: bytes per token, and the same per layer `(layer, bytes)`.
pub(super) struct Saved {
    pub(super) per_token: i64,
    pub(super) per_layer: Vec<(i64, i64)>,
}

pub(super) fn saved_activations(fam: &dyn Family, s: i64, edited: &[(i64, String)]) -> Saved {
    let n_layers = fam.dims().n_layers;
    let first = edited.iter().map(|(l, _)| *l).min().unwrap_or(n_layers);
    let mut res_rg = false;
    let mut per_token = 0;
    let mut per_layer = Vec::new();
    for layer in first..n_layers {
        let mats: Vec<String> = edited.iter().filter(|(l, _)| *l == layer).map(|(_, m)| m.clone()).collect();
        let block = fam.block_saved(s, res_rg, &mats);
        per_token += block.per_token;
        per_layer.push((layer, block.per_token));
        res_rg = block.output_requires_grad;
    }
    if res_rg {
        // Final norm saves its input.
        per_token += fam.final_norm_saved(s);
    }
    Saved { per_token, per_layer }
}

/// With recomputation ([`MendConfig::recompute`]): the bytes per token one block keeps for
/// its backward while it is recomputed, for the largest block from the first edited one
/// up (its input requires grad, except the first's), and that block.
pub(super) fn recompute_block_max(fam: &dyn Family, s: i64, edited: &[(i64, String)]) -> (i64, i64) {
    let n_layers = fam.dims().n_layers;
    let first = edited.iter().map(|(l, _)| *l).min().unwrap_or(n_layers);
    (first..n_layers)
        .map(|layer| {
            let mats: Vec<String> = edited.iter().filter(|(l, _)| *l == layer).map(|(_, m)| m.clone()).collect();
            (fam.block_saved(s, layer > first, &mats).per_token, layer)
        })
        .max()
        .unwrap_or((0, first))
}

pub(super) struct Edited {
    pub(super) name: String,
    pub(super) layer: i64,
    pub(super) matrix: String,
    pub(super) d_in: i64,
    pub(super) d_out: i64,
}

impl Edited {
    pub(super) fn numel(&self) -> i64 {
        self.d_in * self.d_out
    }
}

pub(super) fn editor_shapes(cfg: &MendConfig, edited: &[Edited]) -> Vec<EditorShape> {
    let mut groups: BTreeMap<String, (i64, i64, i64)> = BTreeMap::new();
    for p in edited {
        let key = if cfg.shared { format!("{}x{}", p.d_in, p.d_out) } else { p.name.clone() };
        groups.entry(key).or_insert((p.d_in, p.d_out, 0)).2 += 1;
    }
    groups
        .into_iter()
        .map(|(key, (d_in, d_out, n_modes))| {
            let widths = match cfg.mode {
                EditorMode::Combine => vec![d_in + d_out],
                EditorMode::XOnly => vec![d_in],
                EditorMode::DeltaOnly => vec![d_out],
                EditorMode::OneSided => vec![d_in.min(d_out)],
                EditorMode::Separate => vec![d_in, d_out],
            };
            let rank = cfg.rank.min(*widths.iter().max().unwrap_or(&1));
            // Per low-rank layer: U [w, r], V [r, w], bias [w], scale/shift [n_modes, w].
            let parameters = widths
                .iter()
                .map(|&w| (cfg.n_hidden + 1) * (2 * w * cfg.rank.min(w) + w + 2 * n_modes * w))
                .sum();
            EditorShape { key, d_in, d_out, widths, rank, n_modes, parameters }
        })
        .collect()
}

/// The sizes every part of the plan reads, derived once from the model and the config.
pub(super) struct Sizes<'a> {
    pub(super) cfg: &'a MendConfig,
    pub(super) o: &'a PlanOptions,
    pub(super) family: &'a dyn Family,
    pub(super) info: ModelInfo,
    pub(super) dm: Dims,
    pub(super) names: Vec<String>,
    pub(super) edited: Vec<Edited>,
    pub(super) editors: Vec<EditorShape>,
    pub(super) tokens: i64,
    pub(super) kept: i64,
    /// Bytes per weight element.
    pub(super) s: i64,
    pub(super) b: i64,
    /// Tokens of one batch (inner, outer and locality alike).
    pub(super) n: i64,
    /// Labelled positions of one batch.
    pub(super) nk: i64,
    pub(super) v: i64,
    pub(super) p_count: i64,
    pub(super) w_elems: i64,
    pub(super) w_max: i64,
    pub(super) din_dout: i64,
    pub(super) dout_sum: i64,
    pub(super) e_params: i64,
    pub(super) stats_elems: i64,
    /// Largest single editor tensor (U or V of the widest MLP).
    pub(super) e_max: i64,
    pub(super) located: Vec<(i64, String)>,
    pub(super) act_per_token: i64,
    pub(super) per_layer: Vec<(i64, i64)>,
    pub(super) first_layer: i64,
    pub(super) layers_txt: String,
    /// Layer split: the first block on the sub-device; `None` for the replica placement.
    pub(super) boundary: Option<i64>,
    /// Layer split: weight elements on main (embedding, blocks below the boundary, the
    /// other non-block tensors), on sub (blocks from the boundary, final norm, head), and
    /// of the tied head's copy on sub (0 when untied).
    pub(super) w_main_elems: i64,
    pub(super) w_sub_elems: i64,
    pub(super) w_tied_elems: i64,
    /// Layer split over a chain: each device between main and the last with its blocks
    /// `[from, to)` and their weight elements (`w_main_elems` is then the embedding and
    /// the blocks below the first `from`).
    pub(super) chain: Vec<ChainDevice>,
    /// The image each example shows and its vision-tower cost (VL models with an image size).
    pub(super) image: Option<(ImageShape, VisionCost)>,
    /// The views of one micro-batch and what the step's forwards read of them ([`plan_views`]).
    pub(super) views: Views,
}

/// The views of one micro-batch and what the step's forwards read of them.
pub(super) struct Views {
    pub(super) shapes: Vec<ViewShape>,
    /// Tokens of the one edited forward of a training step (its rows padded to the longest).
    pub(super) fwd_n: i64,
    /// Labelled positions the edited forward scores.
    pub(super) fwd_kept: i64,
    /// Labelled positions of the unedited locality references.
    pub(super) base_kept: i64,
    /// Tokens of the largest single view's batch (one recomputed pass at a time).
    pub(super) pass_n: i64,
    /// Image rows gathered into the step's batches on main (each view's batch and the
    /// edited forward's), and of those, the edited forward's (moved to a split's sub-device).
    pub(super) batch_img_rows: i64,
    pub(super) edited_img_rows: i64,
}

/// The views `train::EditBatches` builds for `b` examples. Text: `edit_inner`,
/// `edit_outer` and `loc`, `tokens` each. With an image of `image_tokens` tokens,
/// EasyEdit's five multimodal views: `edit_inner`, `edit_outer`, `edit_outer_image` and
/// `loc_image` show an image (`tokens` = text + image), `loc` is the NQ question alone
/// (`loc_tokens`). The edited model scores every view but `edit_inner` in one forward, its
/// rows padded to the longest (`TokenBatch::collate`); `edit_outer` also holds the edit
/// prompts with `inner_in_edit_loss` (multimodal only: the text plan keeps one row each).
/// `loc` has `loc_rows` rows an example: its own prompt and its `loc_neighbours`.
pub(super) fn plan_views(b: i64, tokens: i64, kept: i64, image_tokens: Option<i64>, loc: (i64, i64), inner_in_edit_loss: bool, loc_rows: i64) -> Views {
    let view = |name, rows, tokens, image_tokens, kept, edited| ViewShape { name, rows, tokens, image_tokens, kept, edited };
    let views = match image_tokens {
        None => vec![
            view("edit_inner", b, tokens, 0, kept, false),
            view("edit_outer", b, tokens, 0, kept, true),
            view("loc", b * loc_rows, tokens, 0, kept, true),
        ],
        Some(it) => {
            let outer_rows = if inner_in_edit_loss { 2 * b } else { b };
            vec![
                view("edit_inner", b, tokens, it, kept, false),
                view("edit_outer", outer_rows, tokens, it, kept, true),
                view("edit_outer_image", b, tokens, it, kept, true),
                view("loc", b * loc_rows, loc.0, 0, loc.1, true),
                view("loc_image", b, tokens, it, kept, true),
            ]
        }
    };
    let edited: Vec<&ViewShape> = views.iter().filter(|v| v.edited).collect();
    let fwd_kept = edited.iter().map(|v| v.rows * v.kept).sum();
    let base_kept = views.iter().filter(|v| v.name.starts_with("loc")).map(|v| v.rows * v.kept).sum();
    let pass_n = views.iter().map(|v| v.rows * v.tokens).max().unwrap_or(0);
    let img_rows = |vs: &mut dyn Iterator<Item = &ViewShape>| vs.filter(|v| v.image_tokens > 0).map(|v| v.rows).sum::<i64>();
    let edited_img_rows = img_rows(&mut edited.iter().copied());
    let batch_img_rows = img_rows(&mut views.iter()) + edited_img_rows;
    Views { fwd_n: grouped_rows(&edited), fwd_kept, base_kept, pass_n, batch_img_rows, edited_img_rows, shapes: views }
}

/// Token rows of the edited forwards: the views grouped as `train::EditBatches::groups`
/// groups them (longest first, a view joins the current group while `2·tokens ≥` the
/// group's length; #35), each group padded to its longest view. E-VQA: the short text
/// `loc` view is a forward of its own instead of padded to the image views' length.
fn grouped_rows(edited: &[&ViewShape]) -> i64 {
    let mut shapes: Vec<(i64, i64)> = edited.iter().map(|v| (v.rows, v.tokens)).collect();
    shapes.sort_by_key(|&(_, t)| std::cmp::Reverse(t));
    let mut total = 0;
    let mut group: Option<(i64, i64)> = None;
    for (rows, tokens) in shapes {
        match &mut group {
            Some((len, n)) if 2 * tokens >= *len => *n += rows,
            _ => {
                if let Some((len, n)) = group {
                    total += len * n;
                }
                group = Some((tokens, rows));
            }
        }
    }
    total + group.map_or(0, |(len, n)| len * n)
}

/// What a phase of the run does with the edit.
pub(super) struct Mode {
    pub(super) train: bool,
    /// The edited forwards recomputed block by block in their backward.
    pub(super) recompute: bool,
    /// Without recomputation the change of f32 weights, and of every weight in training,
    /// stays as its factors (`Engine::edit_low_rank`): no W' is built, kept, or
    /// differentiated.
    pub(super) factored: bool,
}

impl Sizes<'_> {
    pub(super) fn mode(&self, phase: Phase) -> Mode {
        let train = phase == Phase::Train;
        let recompute = train && self.cfg.recompute;
        Mode { train, recompute, factored: !recompute && (self.s == 4 || train) }
    }
}

pub(super) fn sizes<'a>(model: &'a Model, cfg: &'a MendConfig, o: &'a PlanOptions) -> Result<Sizes<'a>> {
    cfg.validate()?;
    let info = model.info();
    let family = model.family();
    let dm = family.dims();
    let image = match (o.image, family.vision_language()) {
        (None, _) => None,
        (Some(_), None) => {
            return Err(Error::input(format!("{} is a text-only model: `image_size` needs a vision-language model", info.architecture)))
        }
        (Some((w, h)), Some(vl)) => Some(image_cost(vl, &o.image_processor, w, h, dtype_bytes(o.dtype))?),
    };
    let image_tokens = image.as_ref().map_or(0, |(shape, _)| shape.tokens);
    if image_tokens >= info.max_positions {
        return Err(Error::input(format!(
            "an image of {image_tokens} tokens does not fit the model's context of {}",
            info.max_positions
        )));
    }
    let tokens = (o.tokens + image_tokens).min(info.max_positions);
    // Labelled positions are answer tokens, never the image's.
    let text = tokens - image_tokens;
    let kept = o.kept.unwrap_or(text - 1);
    if text < 2 || kept < 1 || kept >= text {
        return Err(Error::input(format!(
            "need at least 2 text tokens per example (got {text}) and 1 <= labelled positions < text tokens (got {kept})"
        )));
    }
    let loc_len = o.loc_tokens.unwrap_or(o.tokens).min(info.max_positions);
    if image.is_some() && loc_len < 2 {
        return Err(Error::input(format!("need at least 2 tokens in the locality question (got {loc_len})")));
    }
    let views = plan_views(
        cfg.batch_size as i64,
        tokens,
        kept,
        image.as_ref().map(|(shape, _)| shape.tokens),
        (loc_len, kept.min(loc_len - 1)),
        cfg.inner_in_edit_loss,
        1 + cfg.loc_neighbours as i64,
    );
    let names: Vec<String> = if cfg.edit_params.is_empty() { model.default_edit_params() } else { cfg.edit_params.clone() };
    let shapes: BTreeMap<String, Vec<i64>> = model.expected_params().into_iter().collect();
    let mut edited = Vec::with_capacity(names.len());
    for name in &names {
        let layout = model
            .layout(name)
            .ok_or_else(|| Error::input(format!("{name:?} is not the weight of a linear layer of {}", info.architecture)))?;
        let shape = shapes.get(name).ok_or_else(|| Error::input(format!("{name:?} is not a parameter of the model")))?;
        let (d_in, d_out) = layout.in_out(shape);
        let (layer, matrix) =
            split_block_name(family.block_prefix(), name).ok_or_else(|| Error::input(format!("{name:?} is not inside a transformer block")))?;
        edited.push(Edited { name: name.clone(), layer, matrix, d_in, d_out });
    }
    if edited.is_empty() {
        return Err(Error::input("no weights to edit"));
    }

    let s = dtype_bytes(o.dtype);
    let b = cfg.batch_size as i64;
    let n = b * tokens; // tokens of one batch (inner, outer and locality alike)
    let nk = b * kept; // labelled positions of one batch
    let v = dm.vocab;
    let p_count = edited.len() as i64;
    let w_elems: i64 = edited.iter().map(Edited::numel).sum();
    let w_max: i64 = edited.iter().map(Edited::numel).max().unwrap_or(0);
    let din_dout: i64 = edited.iter().map(|p| p.d_in + p.d_out).sum();
    let dout_sum: i64 = edited.iter().map(|p| p.d_out).sum();
    let editors = editor_shapes(cfg, &edited);
    let e_params: i64 = editors.iter().map(|e| e.parameters).sum();
    let stats_elems: i64 = editors.iter().map(|e| 2 * (e.d_in + e.d_out)).sum();
    // Largest single editor tensor (U or V of the widest MLP).
    let e_max: i64 = editors
        .iter()
        .flat_map(|e| e.widths.iter().map(|&w| w * cfg.rank.min(w)))
        .max()
        .unwrap_or(0);

    let located: Vec<(i64, String)> = edited.iter().map(|p| (p.layer, p.matrix.clone())).collect();
    let Saved { per_token: act_per_token, per_layer } = saved_activations(family, s, &located);
    let first_layer = per_layer.first().map(|(l, _)| *l).unwrap_or(0);
    let layers_txt = {
        let mut t = String::new();
        for (i, (l, bpt)) in per_layer.iter().enumerate() {
            if i > 0 {
                t.push_str(" + ");
            }
            let _ = write!(t, "L{l}:{bpt}");
        }
        t
    };

    let boundary = match o.placement {
        Placement::Replica => None,
        Placement::Balanced => {
            let k = o.boundary.ok_or_else(|| Error::Internal("layer split planned without a boundary".into()))?;
            if !(0..=first_layer).contains(&k) {
                return Err(Error::input(format!(
                    "the layer split's boundary must be between 0 and the first edited block ({first_layer}), got {k}: the blocks that need gradients run on the sub-device"
                )));
            }
            Some(k)
        }
    };
    let (mut w_main_elems, w_sub_elems, w_tied_elems) = split_weights(model, boundary.unwrap_or(dm.n_layers));
    let mut chain = Vec::new();
    if let (Some(k), false) = (boundary, o.chain.is_empty()) {
        if o.chain_at.len() != o.chain.len() {
            return Err(Error::Internal(format!("{} chain boundaries planned for {} devices", o.chain_at.len(), o.chain.len())));
        }
        let mut all = o.chain_at.clone();
        all.push(k);
        if all[0] < 0 || all.windows(2).any(|w| w[0] >= w[1]) {
            return Err(Error::input(format!("the chain's boundaries {all:?} must increase from 0: each sub-device holds at least one block")));
        }
        w_main_elems = split_weights(model, all[0]).0;
        for (j, dev) in o.chain.iter().enumerate() {
            let (from, to) = (all[j], all[j + 1]);
            chain.push(ChainDevice { device: dev.clone(), from, to, elems: split_weights(model, from).1 - split_weights(model, to).1 });
        }
    }

    Ok(Sizes {
        cfg, o, family, info, dm, names, edited, editors, tokens, kept, s, b, n, nk, v, p_count, w_elems, w_max, din_dout,
        dout_sum, e_params, stats_elems, e_max, located, act_per_token, per_layer, first_layer,
        layers_txt, image, boundary, w_main_elems, w_sub_elems, w_tied_elems, chain, views,
    })
}

/// A device of a chain between main and the last sub-device, as planned.
pub(super) struct ChainDevice {
    pub(super) device: String,
    /// Its blocks `[from, to)`.
    pub(super) from: i64,
    pub(super) to: i64,
    /// Their weight elements.
    pub(super) elems: i64,
}

/// Weight elements `(main, sub, tied head copy)` when blocks `[k, L)` with the final norm
/// and head go to the sub-device and the rest stays on main (`Family::head_params`).
pub(super) fn split_weights(model: &Model, k: i64) -> (i64, i64, i64) {
    let family = model.family();
    let head: Vec<String> = family.head_params();
    let (mut main, mut sub) = (0, 0);
    let mut tied = 0;
    for (name, shape) in model.expected_params() {
        let numel: i64 = shape.iter().product();
        let on_sub = match model.block_of(&name) {
            Some(i) => i as i64 >= k,
            None => head.contains(&name),
        };
        if on_sub {
            sub += numel;
        } else {
            main += numel;
        }
        if family.head_is_tied() && name == family.head_weight_name() {
            tied = numel;
        }
    }
    (main, sub, tied)
}

/// The vision tower's forward over one image, as planned.
pub(super) struct VisionCost {
    pub(super) forward_bytes: i64,
    pub(super) formula: String,
}

/// Tokens and vision-forward bytes of one `width × height` image: the grid from the
/// image processor, the tower's peak from the family
/// ([`VisionLanguage::vision_forward_bytes`]).
pub(super) fn image_cost(vl: &dyn VisionLanguage, proc: &ImageProcessorConfig, w: i64, h: i64, s: i64) -> Result<(ImageShape, VisionCost)> {
    if !(1..=1 << 16).contains(&w) || !(1..=1 << 16).contains(&h) {
        return Err(Error::input(format!("image size {w}x{h} is not 1 to 65536 pixels per side")));
    }
    let grid = proc.grid_for(h, w)?;
    let n = grid.iter().product::<i64>();
    let (forward_bytes, formula) = vl.vision_forward_bytes(&grid, s);
    let shape = ImageShape {
        size: (w, h),
        resized: (grid[2] * proc.patch_size, grid[1] * proc.patch_size),
        patches: n,
        tokens: n / vl.merge_unit() + 2,
        images_per_example: 3,
    };
    Ok((shape, VisionCost { forward_bytes, formula }))
}
