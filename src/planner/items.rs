//! The plan's items, one list per phase of a step: resident, images, capture, the edit,
//! the edited forwards, losses and the optimiser step; per-device totals.
use std::collections::BTreeMap;

use super::sizes::{recompute_block_max, Mode, Sizes};
use super::types::{num, DeviceTotal, Group, Phase, PlanItem, PlanOptions, Role};




/// Plan items as the phases add them, each on the device its role maps to.
pub(super) struct Items {
    pub(super) main: String,
    pub(super) sub: String,
    pub(super) host: Option<String>,
    pub(super) items: Vec<PlanItem>,
}

impl Items {
    pub(super) fn new(o: &PlanOptions) -> Self {
        let main = o.main.clone();
        let sub = if o.split { o.sub.clone() } else { o.main.clone() };
        let host = (main == "cpu").then(|| "cpu".to_string());
        Self { main, sub, host, items: Vec::new() }
    }

    pub(super) fn add(&mut self, phase: Phase, role: Role, groups: &[Group], item: &str, formula: String, bytes: i64) {
        let device = match role {
            Role::Main => Some(self.main.clone()),
            Role::Sub => Some(self.sub.clone()),
            Role::Host => self.host.clone(),
            Role::Chain => None,
        };
        self.items.push(PlanItem { phase, role, device, groups: groups.to_vec(), item: item.into(), formula, bytes: bytes.max(0) as u64 });
    }

    /// An item on a chain's device `dev` (between main and the last sub-device).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn add_chain(&mut self, dev: &str, phase: Phase, groups: &[Group], item: &str, formula: String, bytes: i64) {
        self.items.push(PlanItem { phase, role: Role::Chain, device: Some(dev.to_string()), groups: groups.to_vec(), item: item.into(), formula, bytes: bytes.max(0) as u64 });
    }

    /// An item of the optimiser: on main, on sub, or in host memory (counted on the CPU
    /// device whichever role that is), as `--optimizer-device` places it.
    pub(super) fn add_optimizer(&mut self, o: &PlanOptions, phase: Phase, groups: &[Group], item: &str, formula: String, bytes: i64) {
        let dev = o.optimizer_device();
        let role = if dev == self.main {
            Role::Main
        } else if dev == self.sub {
            Role::Sub
        } else {
            Role::Host
        };
        self.add(phase, role, groups, item, formula, bytes);
        if role == Role::Host {
            if let Some(last) = self.items.last_mut() {
                last.device = Some(dev);
            }
        }
    }
}

/// Resident for the whole run: weights, the replica, the editor and its optimiser state.
pub(super) fn resident(z: &Sizes, it: &mut Items, phase: Phase) {
    let (s, p_count, e_params, stats_elems) = (z.s, z.p_count, z.e_params, z.stats_elems);
    let editors = &z.editors;
    let info = &z.info;
    let o = z.o;
    let train = z.mode(phase).train;
    use Group::*;
    if let Some(k) = z.boundary {
        let l = z.dm.n_layers;
        let below = z.chain.first().map_or(k, |c| c.from);
        it.add(
            phase,
            Role::Main,
            &[Resident],
            "model weights: embedding and blocks below the boundary (layer split)",
            format!("elements of blocks [0, {below}) + embedding·s = {}·{s}", num(z.w_main_elems)),
            z.w_main_elems * s,
        );
        for c in &z.chain {
            it.add_chain(
                &c.device,
                phase,
                &[Resident],
                "model weights: this device's blocks (layer split chain)",
                format!("elements of blocks [{}, {})·s = {}·{s}", c.from, c.to, num(c.elems)),
                c.elems * s,
            );
        }
        it.add(
            phase,
            Role::Sub,
            &[Resident],
            "model weights: blocks from the boundary, final norm, head (layer split)",
            format!("elements of blocks [{k}, {l}) + final norm + head·s = {}·{s}", num(z.w_sub_elems)),
            z.w_sub_elems * s,
        );
        if z.w_tied_elems > 0 {
            it.add(
                phase,
                Role::Sub,
                &[Resident],
                "copy of the tied embedding for the head (layer split)",
                format!("V·d·s = {}·{s}", num(z.w_tied_elems)),
                z.w_tied_elems * s,
            );
        }
    } else {
        it.add(
            phase,
            Role::Main,
            &[Resident],
            "model weights",
            format!("n_params·s = {}·{s}", num(info.n_params)),
            info.n_params * s,
        );
    }
    if o.split && z.boundary.is_none() {
        it.add(
            phase,
            Role::Sub,
            &[Resident],
            "sub-device replica of the weights",
            format!("n_params·s = {}·{s}", num(info.n_params)),
            info.n_params * s,
        );
    }
    let e_txt = {
        // Identical editors (same widths, rank, modes) are written once with a count.
        let mut kinds: Vec<(String, usize)> = Vec::new();
        for e in editors {
            let ws: Vec<String> = e.widths.iter().map(|w| w.to_string()).collect();
            let k = format!("(n_hidden+1)·(2·w·r+w+2·m·w) w={} r={} m={}", ws.join("/"), e.rank, e.n_modes);
            match kinds.iter_mut().find(|(x, _)| *x == k) {
                Some((_, c)) => *c += 1,
                None => kinds.push((k, 1)),
            }
        }
        kinds.into_iter().map(|(k, c)| if c > 1 { format!("{c}×{k}") } else { k }).collect::<Vec<_>>().join(" + ")
    };
    it.add(phase, Role::Main, &[Resident], "editor parameters (f32)", format!("[{e_txt}]·4 = {}·4", num(e_params)), e_params * 4);
    if train {
        it.add(phase, Role::Main, &[Resident], "editor gradients (f32)", format!("{}·4", num(e_params)), e_params * 4);
        it.add_optimizer(o, phase, &[Resident], "Adam m and v (f32)", format!("2·{}·4", num(e_params)), 2 * e_params * 4);
    }
    // Editing: a layer whose rank is more than half its width keeps `U·V` once a few edits
    // have paid for it (`mend::editor`'s dense products; never in training).
    let dense: i64 = editors.iter().flat_map(|e| e.widths.iter()).filter(|&&w| 2 * z.cfg.rank.min(w) > w).map(|&w| (z.cfg.n_hidden + 1) * w * w).sum();
    let pb = products_bytes(z);
    if !train && dense > 0 {
        it.add(
            phase,
            Role::Main,
            &[Resident],
            "editor's dense products U·V (in the products' dtype; layers of rank > width/2, after a few edits)",
            format!("Σ_{{2r>w}} (n_hidden+1)·w²·{pb} = {}·{pb}", num(dense)),
            dense * pb,
        );
    }
    let lr_copies = if train { 4 } else { 1 };
    it.add(
        phase,
        Role::Main,
        &[Resident],
        "edit learning rates (f32)",
        if train { format!("P·4·(value+grad+m+v) = {p_count}·4·4") } else { format!("P·4 = {p_count}·4") },
        p_count * 4 * lr_copies,
    );
    it.add(
        phase,
        Role::Main,
        &[Resident],
        "normalisation statistics (f32)",
        format!("Σ_editors 2·(d_in+d_out)·4 = {}·4", num(stats_elems)),
        stats_elems * 4,
    );
}

/// Vision-language models: the frozen vision tower's forward (once per image, its own
/// group: it runs before the edit's other work), and the image features every forward of
/// the edit reuses (on the main device, and moved with the batch to a split's sub-device).
pub(super) fn images(z: &Sizes, it: &mut Items, phase: Phase) {
    let Some((shape, cost)) = &z.image else { return };
    use Group::*;
    let (b, s, d) = (z.b, z.s, z.dm.d);
    it.add(phase, Role::Main, &[VisionForward], "vision tower forward, one image (no grad)", cost.formula.clone(), cost.forward_bytes);
    let row = (shape.tokens - 2) * d * s;
    let feats = b * shape.images_per_example * row;
    let formula = format!("B·images·N_img·D·s = {b}·{}·{}·{d}·{s}", shape.images_per_example, shape.tokens - 2);
    it.add(phase, Role::Main, &[Capture, EditedForward, Backward], "image features (frozen, computed once per distinct image)", formula, feats);
    // Each view's batch (and the edited forward's) gathers the features of its rows.
    let rows = if phase == Phase::Train { z.views.batch_img_rows } else { b };
    it.add(
        phase,
        Role::Main,
        &[Capture, EditedForward, Backward],
        "image features gathered into the views' batches",
        format!("image rows·N_img·D·s = {rows}·{}·{d}·{s}", shape.tokens - 2),
        rows * row,
    );
    if z.o.split && phase == Phase::Train {
        let rows = z.views.edited_img_rows;
        it.add(
            phase,
            Role::Sub,
            &[EditedForward],
            "image features of the edited forward, moved with its batch",
            format!("image rows·N_img·D·s = {rows}·{}·{d}·{s}", shape.tokens - 2),
            rows * row,
        );
    } else if z.o.split {
        it.add(phase, Role::Sub, &[EditedForward], "image features moved with the batch", format!("B·N_img·D·s = {b}·{}·{d}·{s}", shape.tokens - 2), b * row);
    }
}

/// Gradient capture on the main device: the forward and backward of the edit NLL.
pub(super) fn capture(z: &Sizes, it: &mut Items, phase: Phase) {
    let (s, n, nk, v, din_dout, dout_sum, act_per_token, first_layer) = (z.s, z.n, z.nk, z.v, z.din_dout, z.dout_sum, z.act_per_token, z.first_layer);
    let per_layer = &z.per_layer;
    let layers_txt = &z.layers_txt;
    let fam = &z.info.architecture;
    use Group::*;
    // The layer split runs the capture where the edited blocks are, on the sub-device.
    let cap = if z.boundary.is_some() { Role::Sub } else { Role::Main };
    let cap_act = n * act_per_token;
    it.add(
        phase,
        cap,
        &[Capture],
        "capture: activations kept for backward",
        format!("B·T·Σ_layers≥L{first_layer} bytes/token = {n}·({layers_txt}{}) [{fam}]", if act_per_token > per_layer.iter().map(|x| x.1).sum::<i64>() { " + final norm" } else { "" }),
        cap_act,
    );
    it.add(
        phase,
        cap,
        &[Capture],
        "capture: layer outputs h and δ = ∂L/∂h",
        format!("B·T·Σ_P d_out·(s+4) = {n}·{}·({s}+4)", num(dout_sum)),
        n * dout_sum * (s + 4),
    );
    it.add(
        phase,
        cap,
        &[Capture],
        "capture: logits at labelled positions + log_softmax",
        format!("B·kept·V·(s+4) = {nk}·{v}·({s}+4)"),
        nk * v * (s + 4),
    );
    if let Some(k) = z.boundary {
        // Layer split: the embedding and blocks [0, k) run without grad on main for every
        // forward (capture, edited, unedited); their output crosses to the sub-device.
        let d = z.dm.d;
        let ws = z.family.inference_working_set(s);
        let below = z.chain.first().map_or(k, |c| c.from);
        it.add(
            phase,
            Role::Main,
            &[Capture, EditedForward],
            "layer split: forward below the boundary without grad (one block's working set + its output)",
            format!("B·T·(bytes/token + d·s) = {n}·({ws} + {d}·{s}) [blocks < {below}]"),
            n * (ws + d * s),
        );
        // A chain's devices: the batch's hidden states come in, its blocks run without
        // grad, their output goes on (the edited forward's batch is the larger one).
        for c in &z.chain {
            for (group, tokens, what) in [(Capture, n, "B·T"), (EditedForward, z.views.fwd_n.max(n), "edited tokens")] {
                it.add_chain(
                    &c.device,
                    phase,
                    &[group],
                    "layer split chain: activations received + its blocks' forward without grad (one block's working set + its output)",
                    format!("{what}·(d·s + bytes/token + d·s) = {tokens}·({d}·{s} + {ws} + {d}·{s}) [blocks {}..{}]", c.from, c.to),
                    tokens * (2 * d * s + ws),
                );
            }
        }
        it.add(
            phase,
            Role::Sub,
            &[Capture, EditedForward],
            "layer split: boundary activations received",
            format!("B·T·d·s = {n}·{d}·{s}"),
            n * d * s,
        );
    } else if first_layer > 0 {
        // Every other placement (#35): each batch's prefix up to the first edited block runs
        // once without grad and is kept for the batch's later forwards: the capture's and
        // the edited forward's are alive together (the replica crosses the latter's copy).
        let d = z.dm.d;
        let fwd_n = z.views.fwd_n;
        it.add(
            phase,
            Role::Main,
            &[Capture, EditedForward],
            "prefix activations below the first edited block, kept per batch",
            format!("(B·T + edited tokens)·d·s = ({n} + {fwd_n})·{d}·{s} [blocks < {first_layer}]"),
            (n + fwd_n) * d * s,
        );
        if z.o.split {
            it.add(
                phase,
                Role::Sub,
                &[EditedForward],
                "prefix activations of the edited forward, crossed (replica)",
                format!("edited tokens·d·s = {fwd_n}·{d}·{s}"),
                fwd_n * d * s,
            );
        }
    }
    it.add(
        phase,
        Role::Main,
        &[EditedForward],
        "captured x and δ (f32, rows with signal)",
        format!("B·T·Σ_P (d_in+d_out)·4 = {n}·{}·4", num(din_dout)),
        n * din_dout * 4,
    );
}

/// The editor's pass and the edit it makes: factors or `W'`, and their copies on the sub-device.
pub(super) fn edit(z: &Sizes, it: &mut Items, phase: Phase) {
    editor_activations(z, it, phase);
    edit_form(z, it, phase);
    recompute_grads(z, it, phase);
    edit_on_sub(z, it, phase);
}

/// Training: the editor's activations kept for its backward, per row with signal.
fn editor_activations(z: &Sizes, it: &mut Items, phase: Phase) {
    if !z.mode(phase).train {
        return;
    }
    let (n, cfg, edited, editors) = (z.n, z.cfg, &z.edited, &z.editors);
    use Group::*;
    let e_rows = n; // rows with signal ≤ tokens of the edit batch
    let e_act_elems: i64 = edited
        .iter()
        .map(|p| {
            let ed = editors
                .iter()
                .find(|e| if cfg.shared { e.d_in == p.d_in && e.d_out == p.d_out } else { e.key == p.name })
                .expect("every edited weight has an editor");
            ed.widths.iter().map(|&w| (cfg.n_hidden + 1) * (3 * w + cfg.rank.min(w)) + w).sum::<i64>()
        })
        .sum();
    it.add(
        phase,
        Role::Main,
        &[EditedForward, Backward],
        "editor activations (f32)",
        format!("rows·Σ_P [(n_hidden+1)·(3w+r)+w]·4 = {e_rows}·{}·4", num(e_act_elems)),
        e_rows * e_act_elems * 4,
    );
    // W' is one GEMM accumulating (lr·x̃)ᵀδ̃ into W (`WeightLayout::add_outer`): no
    // pseudo-gradient is formed, and the graph keeps only the factors.
    if products_bytes(z) == 2 {
        let uv: i64 = editors.iter().flat_map(|e| e.widths.iter()).map(|&w| (cfg.n_hidden + 1) * 2 * w * cfg.rank.min(w)).sum();
        it.add(
            phase,
            Role::Main,
            &[EditedForward, Backward],
            "editor's U and V in bf16 for its products (kept for its backward)",
            format!("Σ_editors (n_hidden+1)·2·w·r·2 = {}·2", num(uv)),
            uv * 2,
        );
    }
}

/// Bytes per element of the editor's `U`/`V` products (the editor is on the main device).
fn products_bytes(z: &Sizes) -> i64 {
    crate::config::editor_product_kind(z.o.dtype, z.o.main.starts_with("cpu")).elt_size_in_bytes() as i64
}

/// The edit as the editor hands it on: factors, or `W'` whole.
fn edit_form(z: &Sizes, it: &mut Items, phase: Phase) {
    let (s, n, w_elems, din_dout) = (z.s, z.n, z.w_elems, z.din_dout);
    let Mode { factored, .. } = z.mode(phase);
    use Group::*;
    if factored {
        it.add(
            phase,
            Role::Main,
            &[EditedForward],
            "the edit as factors (lr·x̃, δ̃), f32",
            format!("B·T·Σ_P (d_in+d_out)·4 = {n}·{}·4", num(din_dout)),
            n * din_dout * 4,
        );
    } else {
        // Otherwise (recomputation, or an edit of a non-f32 model) W' stays alive whole
        // as the editor's output; what the forwards read of it is counted below.
        it.add(
            phase,
            Role::Main,
            &[EditedForward],
            "edited weights W' (full tensors)",
            format!("Σ_P d_in·d_out·s = {}·{s}", num(w_elems)),
            w_elems * s,
        );
    }
}

/// Recomputation: `∂loss/∂W'` summed for the editor's backward and one block's before it
/// is added in (on the sub-device first when split).
fn recompute_grads(z: &Sizes, it: &mut Items, phase: Phase) {
    if !z.mode(phase).recompute {
        return;
    }
    let (s, w_elems, o, edited) = (z.s, z.w_elems, z.o, &z.edited);
    // The edited forwards run on the sub-device when split.
    let fwd_role = if o.split { Role::Sub } else { Role::Main };
    use Group::*;
    let w_block_max: i64 = {
        let mut per_block: BTreeMap<i64, i64> = BTreeMap::new();
        for p in edited {
            *per_block.entry(p.layer).or_default() += p.numel();
        }
        per_block.values().copied().max().unwrap_or(0)
    };
    it.add(
        phase,
        Role::Main,
        &[EditedForward, Backward],
        "recompute: ∂loss/∂W' summed over outer + locality (kept for the editor's backward; on sub first when split)",
        format!("Σ_P d_in·d_out·s = {}·{s}", num(w_elems)),
        w_elems * s,
    );
    it.add(
        phase,
        fwd_role,
        &[EditedForward],
        "recompute: ∂loss/∂W' of one block before it is added in",
        format!("max_block Σ d_in·d_out·s = {}·{s}", num(w_block_max)),
        w_block_max * s,
    );
    if o.split {
        it.add(
            phase,
            Role::Sub,
            &[EditedForward],
            "recompute: W' leaves on sub (one copy for both passes) + the sum of ∂loss/∂W' before the copy back",
            format!("2·Σ_P d_in·d_out·s = 2·{}·{s}", num(w_elems)),
            2 * w_elems * s,
        );
    }
}

/// Split: what of the edit crosses to the sub-device (its factors, or one copy of `W'`).
fn edit_on_sub(z: &Sizes, it: &mut Items, phase: Phase) {
    let (s, n, w_elems, din_dout, o) = (z.s, z.n, z.w_elems, z.din_dout, z.o);
    let Mode { recompute, factored, .. } = z.mode(phase);
    use Group::*;
    if o.split && factored {
        it.add(
            phase,
            Role::Sub,
            &[EditedForward],
            "the edit's factors on sub",
            format!("B·T·Σ_P (d_in+d_out)·4 = {n}·{}·4", num(din_dout)),
            n * din_dout * 4,
        );
    } else if o.split && !recompute {
        // One edited forward reads rephrase and locality text together, so one copy
        // of W' crosses to the sub-device (kept by the graph until the backward).
        it.add(
            phase,
            Role::Sub,
            &[EditedForward],
            "W' copy on sub (one edited forward)",
            format!("Σ_P d_in·d_out·s = {}·{s}", num(w_elems)),
            w_elems * s,
        );
    }
}

/// The edited forwards (on the sub-device when split): activations kept for their backward.
pub(super) fn edited_forwards(z: &Sizes, it: &mut Items, phase: Phase) {
    let (s, n, nk, v, act_per_token, first_layer) = (z.s, z.n, z.nk, z.v, z.act_per_token, z.first_layer);
    let located = &z.located;
    let dm = z.dm;
    let family = z.family;
    let o = z.o;
    // Tokens of the edited forward (every edited view's rows, padded to the longest), and
    // of the largest single view (recomputation runs one view's pass at a time).
    let (fwd_n, pass_n) = (z.views.fwd_n, z.views.pass_n);
    let edited_views: Vec<&str> = z.views.shapes.iter().filter(|v| v.edited).map(|v| v.name).collect();
    let Mode { train, recompute, .. } = z.mode(phase);
    // The edited forwards run on the sub-device when split.
    let fwd_role = if z.o.split { Role::Sub } else { Role::Main };
    use Group::*;
    if recompute {
        // One forward at a time (outer, then locality): its block inputs, then one
        // block recomputed with grad, the hidden-state gradients in and out of it.
        let kept_blocks = dm.n_layers - first_layer + 1;
        let (block_max, block_at) = recompute_block_max(family, s, located);
        it.add(
            phase,
            fwd_role,
            &[EditedForward],
            "recompute: block inputs of one edited forward (blocks ≥ first edited + the last hidden state)",
            format!("largest view's rows·T·(L − L{first_layer} + 1)·d·s = {pass_n}·{kept_blocks}·{}·{s}", dm.d),
            pass_n * kept_blocks * dm.d * s,
        );
        it.add(
            phase,
            fwd_role,
            &[EditedForward],
            "recompute: activations of the largest recomputed block + its backward temporaries",
            format!("largest view's rows·T·(L{block_at} bytes/token + (2d + f)·s) = {pass_n}·({block_max} + {}·{s})", 2 * dm.d + dm.f),
            pass_n * (block_max + (2 * dm.d + dm.f) * s),
        );
    } else if train {
        it.add(
            phase,
            fwd_role,
            &[EditedForward],
            "edited forwards: activations kept for backward (one forward over the edited views)",
            format!("tokens({})·Σ_layers≥L{first_layer} bytes/token = {fwd_n}·{act_per_token}", edited_views.join("+")),
            fwd_n * act_per_token,
        );
        if s != 4 {
            // The factored edit's `x·aᵀ` runs in f32 (`LowRank::apply`): what it keeps of
            // each edited weight's input is an f32 copy, not the input counted above.
            let din: i64 = z.din_dout - z.dout_sum;
            it.add(
                phase,
                fwd_role,
                &[EditedForward],
                "the factored edit's f32 inputs, beyond the inputs counted above",
                format!("tokens·Σ_P d_in·(4 − s) = {fwd_n}·{}·{}", num(din), 4 - s),
                fwd_n * din * (4 - s),
            );
        }
    } else {
        it.add(
            phase,
            fwd_role,
            &[EditedForward],
            "edited forward without grad: one layer's working set",
            format!("B·T·bytes/token = {n}·{}", family.inference_working_set(s)),
            n * family.inference_working_set(s),
        );
    }
    if o.split && !train {
        it.add(
            phase,
            Role::Sub,
            &[EditedForward],
            "logits on sub before the copy back",
            format!("B·kept·V·s = {nk}·{v}·{s}"),
            nk * v * s,
        );
    }
}

/// Logits and losses of the edited forwards, the editor's backward, the optimiser step and
/// the checkpoint write.
pub(super) fn losses_and_step(z: &Sizes, it: &mut Items, phase: Phase) {
    let (s, nk, v, w_elems, w_max, e_max) = (z.s, z.nk, z.v, z.w_elems, z.w_max, z.e_max);
    let (fwd_kept, base_kept) = (z.views.fwd_kept, z.views.base_kept);
    let Mode { train, factored, .. } = z.mode(phase);
    // The edited forwards run on the sub-device when split.
    let fwd_role = if z.o.split { Role::Sub } else { Role::Main };
    use Group::*;
    if train {
        // The meta-training losses are computed where the edited logits are (only the
        // scalar loss crosses back), so these live on the sub-device when split.
        it.add(
            phase,
            fwd_role,
            &[EditedForward],
            "logits at labelled positions (edited views, unedited locality)",
            format!("(edited kept + base kept)·V·s = ({fwd_kept} + {base_kept})·{v}·{s}"),
            (fwd_kept + base_kept) * v * s,
        );
        it.add(
            phase,
            fwd_role,
            &[EditedForward],
            "log_softmax copies kept for backward (edited views, exp(base))",
            format!("(edited kept + base kept)·V·4 = ({fwd_kept} + {base_kept})·{v}·4"),
            (fwd_kept + base_kept) * v * 4,
        );
        if !factored {
            it.add(
                phase,
                Role::Main,
                &[Backward],
                "gradients w.r.t. W' + one weight's backward temporaries",
                format!("Σ_P d_in·d_out·s + 3·max_P d_in·d_out·4 = {}·{s} + 3·{}·4", num(w_elems), num(w_max)),
                w_elems * s + 3 * w_max * 4,
            );
        }
        // Each editor runs once per micro-batch (all its weights' rows in one pass), and
        // its products give gradients in the parameters' own layout, which .grad
        // accumulates in place: one incoming gradient at a time.
        it.add(
            phase,
            Role::Main,
            &[Backward],
            "one incoming editor gradient",
            format!("largest editor tensor·4 = {}·4", num(e_max)),
            e_max * 4,
        );
        if z.o.optimizer_device() == z.o.main {
            it.add(
                phase,
                Role::Main,
                &[OptimizerStep],
                "Adam and clipping temporaries",
                format!("6·largest editor tensor·4 = 6·{}·4", num(e_max)),
                6 * e_max * 4,
            );
        } else {
            // Offloaded: each gradient crosses once, the update is computed beside the
            // moments and comes back, one tensor at a time.
            it.add(
                phase,
                Role::Main,
                &[OptimizerStep],
                "clipping temporaries + one update brought back",
                format!("2·largest editor tensor·4 = 2·{}·4", num(e_max)),
                2 * e_max * 4,
            );
            it.add_optimizer(
                z.o,
                phase,
                &[OptimizerStep],
                "Adam temporaries + one gradient's copy (offloaded optimiser)",
                format!("6·largest editor tensor·4 = 6·{}·4", num(e_max)),
                6 * e_max * 4,
            );
        }
        it.add(
            phase,
            Role::Host,
            &[Checkpoint],
            "checkpoint write: streamed, one tensor's bytes at a time",
            format!("largest editor tensor·4 = {}·4", num(e_max)),
            e_max * 4,
        );
    } else {
        it.add(
            phase,
            Role::Main,
            &[EditedForward],
            "logits at labelled positions + log_softmax",
            format!("B·kept·V·(s+4) = {nk}·{v}·({s}+4)"),
            nk * v * (s + 4),
        );
    }
}

/// Each device's peak per phase: what is resident plus the largest of the other groups,
/// which are alive at different times of a step.
pub(super) fn totals(it: &Items) -> Vec<DeviceTotal> {
    use Group::*;
    let (main_dev, sub_dev, items) = (&it.main, &it.sub, &it.items);
    let mut devices: Vec<String> = vec![main_dev.clone()];
    // A chain's devices in order, between main and the last.
    for d in items.iter().filter(|i| i.role == Role::Chain).filter_map(|i| i.device.as_ref()) {
        if !devices.contains(d) {
            devices.push(d.clone());
        }
    }
    if !devices.contains(sub_dev) {
        devices.push(sub_dev.clone());
    }
    // Host memory named as a device of its own (an optimiser offloaded to the CPU).
    for d in items.iter().filter_map(|i| i.device.as_ref()) {
        if !devices.contains(d) {
            devices.push(d.clone());
        }
    }
    let mut totals = Vec::new();
    for phase in [Phase::Train, Phase::Edit] {
        for dev in &devices {
            let mut by_group: BTreeMap<Group, u64> = BTreeMap::new();
            let mut roles: Vec<String> = Vec::new();
            if dev == main_dev {
                roles.push("main".into());
            }
            if dev == sub_dev {
                roles.push("sub".into());
            }
            if roles.is_empty() && items.iter().any(|i| i.role == Role::Chain && i.device.as_deref() == Some(dev.as_str())) {
                roles.push("chain".into());
            }
            if roles.is_empty() {
                roles.push("host".into());
            }
            for it in items.iter().filter(|i| i.phase == phase && i.device.as_deref() == Some(dev.as_str())) {
                for g in &it.groups {
                    *by_group.entry(*g).or_default() += it.bytes;
                }
            }
            let resident = by_group.get(&Resident).copied().unwrap_or(0);
            let (peak_group, extra) = by_group
                .iter()
                .filter(|(g, _)| **g != Resident)
                .max_by_key(|(_, b)| **b)
                .map(|(g, b)| (*g, *b))
                .unwrap_or((Resident, 0));
            totals.push(DeviceTotal { device: dev.clone(), roles, phase, by_group, peak_group, peak_bytes: resident + extra });
        }
    }

    totals
}
