//! Memory planner: each device's peak bytes for meta-training and for editing, estimated
//! from a model's `config.json` and a MEND configuration before anything is loaded.
//!
//! The estimate follows what the code does, item by item: frozen weights (main), the
//! sub-device replica (when split), the editor with its gradients and Adam moments (f32,
//! main), captured factors, the edit (its low-rank factors for f32 weights, the edited
//! weights `W'` otherwise) and its copy on the sub-device, the activations autograd keeps
//! for the edited forwards, logits at labelled positions.
//!
//! Items are grouped by *when* they are alive. `resident` items live for the whole run;
//! every other group is alive only during its part of a step (gradient capture, the edited
//! forwards, their backward, the optimiser step, a checkpoint write), and those parts do
//! not overlap. A device's peak is therefore `resident + max over the other groups`.
//!
//! Activations are counted by simulating which tensors each op saves for backward: a
//! matmul saves its input only when its weight requires grad (an edited weight, or the
//! factor `a` of a factored edit, whose `x·aᵀ` saves the same input), a norm
//! saves its input only when that input requires grad, and so on. Nothing below the first
//! edited weight requires grad, so the frozen layers below it keep no activations at all.
use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::Path;

use serde::Serialize;
use tch::Kind;

use crate::config::{EditorMode, MendConfig};
use crate::device::memory::format_bytes;
use crate::device::{DevicePlan, MaxMemory, OptimizerDevice, Placement, PlacementRequest};
use crate::model::loader::read_config;
use crate::model::family::{split_block_name, Dims, Family};
use crate::model::qwen2_vl::{ImageProcessorConfig, Qwen2Vl};
use crate::model::ModelInfo;
use crate::model::Model;
use crate::{Error, Result};

/// What is planned for: devices, weight dtype, sequence shape.
#[derive(Debug, Clone)]
pub struct PlanOptions {
    /// Main device name (`cpu`, `cuda`, `cuda:N`); need not exist on this machine.
    pub main: String,
    /// Sub-device name.
    pub sub: String,
    /// Whether the sub-device holds a replica and the mover copies between the devices
    /// (true whenever the names differ; can be forced for a split on one device).
    pub split: bool,
    /// Weight dtype (editor maths is always f32).
    pub dtype: Kind,
    /// Tokens per example (the padded sequence length); capped at the model's context,
    /// as runs cap `max_length`.
    pub tokens: i64,
    /// Labelled positions per example (logits are computed only there); `None`: every
    /// position but the first, an upper bound.
    pub kept: Option<i64>,
    /// Replica (the default) or the layer split ([`Placement::Balanced`], which needs
    /// `split`).
    pub placement: Placement,
    /// With the layer split: the first block on the sub-device. `None`: the `k` that
    /// balances the two devices' peaks in `balance_for` ([`balanced_boundary`]).
    pub boundary: Option<i64>,
    /// The phase whose peaks the layer split balances (train for `train`, edit otherwise).
    pub balance_for: Phase,
    /// Where the editor's Adam moments live.
    pub optimizer: OptimizerDevice,
    /// Per-device capacities (`--max-memory`): the layer split balances peak/capacity
    /// instead of bytes, and [`choose`] keeps only placements that fit.
    pub caps: MaxMemory,
    /// Vision-language models: the image size `(width, height)` in pixels each example
    /// shows; its tokens are added to `tokens`, and the vision tower's forward and the
    /// image features are planned. `None`: text only.
    pub image: Option<(i64, i64)>,
    /// How images are resized and patched (the model directory's
    /// `preprocessor_config.json`, or the processor's defaults).
    pub image_processor: ImageProcessorConfig,
    /// With an image: tokens of the text-only locality question (E-VQA's NQ `loc` view)
    /// per example. `None`: `tokens` (the text part of the image views).
    pub loc_tokens: Option<i64>,
}

impl PlanOptions {
    /// Devices from their names (`sub` defaults to `main`).
    pub fn new(main: &str, sub: Option<&str>, dtype: Kind, tokens: i64, kept: Option<i64>) -> Result<Self> {
        let main = normalise_device(main)?;
        let sub = match sub {
            Some(s) => normalise_device(s)?,
            None => main.clone(),
        };
        let split = main != sub;
        Ok(Self {
            main,
            sub,
            split,
            dtype,
            tokens,
            kept,
            placement: Placement::Replica,
            boundary: None,
            balance_for: Phase::Train,
            optimizer: OptimizerDevice::Main,
            caps: MaxMemory::default(),
            image: None,
            image_processor: ImageProcessorConfig::default(),
            loc_tokens: None,
        })
    }

    /// The same options for `placement` (the layer split needs two devices, or `split`
    /// forced on one).
    pub fn with_placement(&self, placement: Placement, optimizer: OptimizerDevice) -> Result<Self> {
        if placement == Placement::Balanced && !self.split {
            return Err(Error::input("--placement balanced divides the model between two devices: give --sub-device (a device other than --device)"));
        }
        Ok(Self { placement, optimizer, boundary: if placement == Placement::Balanced { self.boundary } else { None }, ..self.clone() })
    }

    /// The same devices as one device (main alone): the reference the placements are
    /// compared with.
    pub fn single(&self) -> Self {
        Self { sub: self.main.clone(), split: false, placement: Placement::Replica, boundary: None, optimizer: OptimizerDevice::Main, ..self.clone() }
    }

    fn optimizer_device(&self) -> String {
        match self.optimizer {
            OptimizerDevice::Main => self.main.clone(),
            OptimizerDevice::Sub => if self.split { self.sub.clone() } else { self.main.clone() },
            OptimizerDevice::Cpu => "cpu".into(),
        }
    }
}

/// The normalised name (`cuda` -> `cuda:0`), without checking the device exists here.
fn normalise_device(name: &str) -> Result<String> {
    Ok(name.parse::<crate::device::DeviceName>()?.to_string())
}

/// What one image costs a vision-language model, as planned.
#[derive(Debug, Clone, Serialize)]
pub struct ImageShape {
    /// The image as given, `(width, height)`.
    pub size: (i64, i64),
    /// After `smart_resize`, `(width, height)`.
    pub resized: (i64, i64),
    /// Patches the vision tower runs over (`t·h·w`).
    pub patches: i64,
    /// Text tokens the image takes: merged patches + `<|vision_start|>` + `<|vision_end|>`.
    pub tokens: i64,
    /// Distinct images per edit example, each run through the tower once per step and
    /// its features held: the edit image (shown by `edit_inner` and `edit_outer`), the
    /// rephrase image (`edit_outer_image`) and the locality image (`loc_image`).
    pub images_per_example: i64,
}

/// One view of an edit example as a meta-training step builds it (EasyEdit's
/// `edit_inner`, `edit_outer`, `loc`, and with images `edit_outer_image`, `loc_image`).
#[derive(Debug, Clone, Serialize)]
pub struct ViewShape {
    pub name: &'static str,
    /// Rows of the view's batch (`edit_outer` holds the edit prompts too with
    /// `inner_in_edit_loss`).
    pub rows: i64,
    /// Tokens per row: text, plus the image's tokens for an image view.
    pub tokens: i64,
    /// Of `tokens`, those the image takes (0 for a text view).
    pub image_tokens: i64,
    /// Labelled positions per row (never an image token).
    pub kept: i64,
    /// Whether the edited model scores it (in the one edited forward of a step); the
    /// others are the capture batch (`edit_inner`) and, for locality, the unedited
    /// reference is scored too.
    pub edited: bool,
}

/// Meta-training (`train`) or editing with a trained editor (`edit`, `eval`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Phase {
    Train,
    Edit,
}

/// When an item is alive (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Group {
    /// For the whole run.
    Resident,
    /// Forward + backward of the edit NLL on the frozen model (reads x and δ).
    Capture,
    /// End of the edited forwards (outer, locality): the largest set before backward.
    EditedForward,
    /// Backward of the meta-loss into the editor.
    Backward,
    /// Gradient clipping and Adam.
    OptimizerStep,
    /// Writing the editor and training state (host memory).
    Checkpoint,
    /// The frozen vision tower's forward, once per image, without grad (VL models).
    VisionForward,
}

impl Group {
    pub fn name(self) -> &'static str {
        match self {
            Group::Resident => "resident",
            Group::Capture => "capture",
            Group::EditedForward => "edited_forward",
            Group::Backward => "backward",
            Group::OptimizerStep => "optimizer_step",
            Group::Checkpoint => "checkpoint",
            Group::VisionForward => "vision_forward",
        }
    }
}

/// Where an item lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    Main,
    Sub,
    /// Host memory outside both devices (counted on main when main is the CPU).
    Host,
}

impl Role {
    pub fn name(self) -> &'static str {
        match self {
            Role::Main => "main",
            Role::Sub => "sub",
            Role::Host => "host",
        }
    }
}

/// One line of the plan.
#[derive(Debug, Clone, Serialize)]
pub struct PlanItem {
    pub phase: Phase,
    pub role: Role,
    /// Device name the item is counted on (`None` for host memory on an accelerator run).
    pub device: Option<String>,
    /// Groups during which the item is alive.
    pub groups: Vec<Group>,
    pub item: String,
    /// How the bytes are computed, as text.
    pub formula: String,
    pub bytes: u64,
}

/// Peak of one physical device in one phase: `resident + max(other groups)`.
#[derive(Debug, Clone, Serialize)]
pub struct DeviceTotal {
    pub device: String,
    /// Roles placed on this device (both on a single-device run).
    pub roles: Vec<String>,
    pub phase: Phase,
    pub by_group: BTreeMap<Group, u64>,
    /// The group whose bytes, added to the resident ones, give the peak.
    pub peak_group: Group,
    pub peak_bytes: u64,
}

/// One editor network (shared by all edited weights of one shape, or per weight).
#[derive(Debug, Clone, Serialize)]
pub struct EditorShape {
    pub key: String,
    pub d_in: i64,
    pub d_out: i64,
    /// Widths of its MLPs (one for combine, two for separate).
    pub widths: Vec<i64>,
    pub rank: i64,
    pub n_modes: i64,
    pub parameters: i64,
}

/// Everything the plan assumed.
#[derive(Debug, Clone, Serialize)]
pub struct PlanShape {
    pub architecture: String,
    pub n_params: i64,
    pub dtype: String,
    pub dtype_bytes: i64,
    pub main: String,
    pub sub: String,
    pub split: bool,
    pub placement: Placement,
    /// Layer split: the first block on the sub-device.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub boundary: Option<i64>,
    pub optimizer_device: String,
    pub batch_size: i64,
    pub tokens_per_example: i64,
    pub kept_per_example: i64,
    pub vocab_size: i64,
    pub hidden_size: i64,
    pub n_layers: i64,
    pub edited: Vec<String>,
    pub first_edited_layer: i64,
    pub editors: Vec<EditorShape>,
    pub editor_parameters: i64,
    /// The image each example shows (vision-language models with `--image-size`).
    pub image: Option<ImageShape>,
    /// The views of one micro-batch as planned: text (inner, outer, loc of one length)
    /// or, with an image, EasyEdit's five multimodal views.
    pub views: Vec<ViewShape>,
    /// Tokens of the one edited forward of a training step: every edited view's rows,
    /// padded to the longest.
    pub edited_forward_tokens: i64,
}

#[derive(Debug, Clone, Serialize)]
pub struct MemoryPlan {
    pub shape: PlanShape,
    pub items: Vec<PlanItem>,
    pub totals: Vec<DeviceTotal>,
}

/// Plans for the model directory `dir`, reading only its `config.json`.
pub fn plan_dir(dir: &Path, cfg: &MendConfig, opts: &PlanOptions) -> Result<MemoryPlan> {
    if !dir.is_dir() {
        return Err(Error::file(dir, "model directory not found"));
    }
    let (model, _) = read_config(dir)?;
    if opts.image.is_some() && model.family().vision_language().is_some() {
        let proc = ImageProcessorConfig::load(&dir.join("preprocessor_config.json"))?;
        return plan_model(&model, cfg, &PlanOptions { image_processor: proc, ..opts.clone() });
    }
    plan_model(&model, cfg, opts)
}

/// Element size of a weight dtype.
fn dtype_bytes(k: Kind) -> i64 {
    k.elt_size_in_bytes() as i64
}

fn dtype_name(k: Kind) -> &'static str {
    match k {
        Kind::BFloat16 => "bf16",
        Kind::Half => "f16",
        _ => "f32",
    }
}

/// Activations saved for backward by a forward with the `edited` weights requiring grad,
/// from the first edited layer up.
/// What a forward with grad keeps: bytes per token, the same per layer `(layer, bytes)`,
/// and the `(layer, matrix)` of edited weights whose `W'` the graph keeps.
struct Saved {
    per_token: i64,
    per_layer: Vec<(i64, i64)>,
    w_kept: Vec<(i64, String)>,
}

fn saved_activations(fam: &dyn Family, s: i64, edited: &[(i64, String)]) -> Saved {
    let n_layers = fam.dims().n_layers;
    let first = edited.iter().map(|(l, _)| *l).min().unwrap_or(n_layers);
    let mut res_rg = false;
    let mut per_token = 0;
    let mut per_layer = Vec::new();
    let mut kept = Vec::new();
    for layer in first..n_layers {
        let mats: Vec<String> = edited.iter().filter(|(l, _)| *l == layer).map(|(_, m)| m.clone()).collect();
        let block = fam.block_saved(s, res_rg, &mats);
        per_token += block.per_token;
        per_layer.push((layer, block.per_token));
        kept.extend(block.weights_kept.into_iter().map(|m| (layer, m)));
        res_rg = block.output_requires_grad;
    }
    if res_rg {
        // Final norm saves its input.
        per_token += fam.final_norm_saved(s);
    }
    Saved { per_token, per_layer, w_kept: kept }
}

/// With recomputation ([`MendConfig::recompute`]): the bytes per token one block keeps for
/// its backward while it is recomputed, for the largest block from the first edited one
/// up (its input requires grad, except the first's), and that block.
fn recompute_block_max(fam: &dyn Family, s: i64, edited: &[(i64, String)]) -> (i64, i64) {
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

struct Edited {
    name: String,
    layer: i64,
    matrix: String,
    d_in: i64,
    d_out: i64,
}

impl Edited {
    fn numel(&self) -> i64 {
        self.d_in * self.d_out
    }
}

fn editor_shapes(cfg: &MendConfig, edited: &[Edited]) -> Vec<EditorShape> {
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

fn num(n: i64) -> String {
    // 124439808 -> 124,439,808
    let s = n.abs().to_string();
    let mut out = String::new();
    for (i, c) in s.chars().enumerate() {
        if i > 0 && (s.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    if n < 0 {
        format!("-{out}")
    } else {
        out
    }
}

/// The sizes every part of the plan reads, derived once from the model and the config.
struct Sizes<'a> {
    cfg: &'a MendConfig,
    o: &'a PlanOptions,
    family: &'a dyn Family,
    info: ModelInfo,
    dm: Dims,
    names: Vec<String>,
    edited: Vec<Edited>,
    editors: Vec<EditorShape>,
    tokens: i64,
    kept: i64,
    /// Bytes per weight element.
    s: i64,
    b: i64,
    /// Tokens of one batch (inner, outer and locality alike).
    n: i64,
    /// Labelled positions of one batch.
    nk: i64,
    v: i64,
    p_count: i64,
    w_elems: i64,
    w_max: i64,
    din_dout: i64,
    dout_sum: i64,
    e_params: i64,
    stats_elems: i64,
    /// Largest single editor tensor (U or V of the widest MLP).
    e_max: i64,
    located: Vec<(i64, String)>,
    act_per_token: i64,
    per_layer: Vec<(i64, i64)>,
    first_layer: i64,
    w_kept_elems: i64,
    w_unkept_elems: i64,
    layers_txt: String,
    /// Layer split: the first block on the sub-device; `None` for the replica placement.
    boundary: Option<i64>,
    /// Layer split: weight elements on main (embedding, blocks below the boundary, the
    /// other non-block tensors), on sub (blocks from the boundary, final norm, head), and
    /// of the tied head's copy on sub (0 when untied).
    w_main_elems: i64,
    w_sub_elems: i64,
    w_tied_elems: i64,
    /// The image each example shows and its vision-tower cost (VL models with an image size).
    image: Option<(ImageShape, VisionCost)>,
    /// The views of one micro-batch ([`plan_views`]).
    views: Vec<ViewShape>,
    /// Tokens of the one edited forward of a training step (its rows padded to the longest).
    fwd_n: i64,
    /// Labelled positions the edited forward scores.
    fwd_kept: i64,
    /// Labelled positions of the unedited locality references.
    base_kept: i64,
    /// Tokens of the largest single view's batch (one recomputed pass at a time).
    pass_n: i64,
    /// Image rows gathered into the step's batches on main (each view's batch and the
    /// edited forward's), and of those, the edited forward's (moved to a split's sub-device).
    batch_img_rows: i64,
    edited_img_rows: i64,
}

/// The views of one micro-batch and what the step's forwards read of them.
struct Views {
    views: Vec<ViewShape>,
    fwd_n: i64,
    fwd_kept: i64,
    base_kept: i64,
    pass_n: i64,
    batch_img_rows: i64,
    edited_img_rows: i64,
}

/// The views `train::EditBatches` builds for `b` examples. Text: `edit_inner`,
/// `edit_outer` and `loc`, `tokens` each. With an image of `image_tokens` tokens,
/// EasyEdit's five multimodal views: `edit_inner`, `edit_outer`, `edit_outer_image` and
/// `loc_image` show an image (`tokens` = text + image), `loc` is the NQ question alone
/// (`loc_tokens`). The edited model scores every view but `edit_inner` in one forward, its
/// rows padded to the longest (`TokenBatch::collate`); `edit_outer` also holds the edit
/// prompts with `inner_in_edit_loss` (multimodal only: the text plan keeps one row each).
fn plan_views(b: i64, tokens: i64, kept: i64, image_tokens: Option<i64>, loc: (i64, i64), inner_in_edit_loss: bool) -> Views {
    let view = |name, rows, tokens, image_tokens, kept, edited| ViewShape { name, rows, tokens, image_tokens, kept, edited };
    let views = match image_tokens {
        None => vec![
            view("edit_inner", b, tokens, 0, kept, false),
            view("edit_outer", b, tokens, 0, kept, true),
            view("loc", b, tokens, 0, kept, true),
        ],
        Some(it) => {
            let outer_rows = if inner_in_edit_loss { 2 * b } else { b };
            vec![
                view("edit_inner", b, tokens, it, kept, false),
                view("edit_outer", outer_rows, tokens, it, kept, true),
                view("edit_outer_image", b, tokens, it, kept, true),
                view("loc", b, loc.0, 0, loc.1, true),
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
    Views { fwd_n: grouped_rows(&edited), fwd_kept, base_kept, pass_n, batch_img_rows, edited_img_rows, views }
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
struct Mode {
    train: bool,
    /// The edited forwards recomputed block by block in their backward.
    recompute: bool,
    /// Without recomputation the change of f32 weights stays as its factors
    /// (`Engine::edit_low_rank`): no W' is built, kept, or differentiated.
    factored: bool,
}

impl Sizes<'_> {
    fn mode(&self, phase: Phase) -> Mode {
        let train = phase == Phase::Train;
        let recompute = train && self.cfg.recompute;
        Mode { train, recompute, factored: !recompute && self.s == 4 }
    }
}

fn sizes<'a>(model: &'a Model, cfg: &'a MendConfig, o: &'a PlanOptions) -> Result<Sizes<'a>> {
    cfg.validate()?;
    let info = model.info();
    let family = model.family();
    let dm = family.dims();
    let image = match (o.image, family.vision_language()) {
        (None, _) => None,
        (Some(_), None) => {
            return Err(Error::input(format!("{} is a text-only model: --image-size needs a vision-language model", info.architecture)))
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
    let Views { views, fwd_n, fwd_kept, base_kept, pass_n, batch_img_rows, edited_img_rows } = plan_views(
        cfg.batch_size as i64,
        tokens,
        kept,
        image.as_ref().map(|(shape, _)| shape.tokens),
        (loc_len, kept.min(loc_len - 1)),
        cfg.inner_in_edit_loss,
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
    let Saved { per_token: act_per_token, per_layer, w_kept } = saved_activations(family, s, &located);
    let first_layer = per_layer.first().map(|(l, _)| *l).unwrap_or(0);
    let w_kept_elems: i64 = edited
        .iter()
        .filter(|p| w_kept.iter().any(|(l, m)| *l == p.layer && *m == p.matrix))
        .map(Edited::numel)
        .sum();
    let w_unkept_elems = w_elems - w_kept_elems;
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
            let k = o.boundary.ok_or_else(|| Error::Torch("layer split planned without a boundary".into()))?;
            if !(0..=first_layer).contains(&k) {
                return Err(Error::input(format!(
                    "the layer split's boundary must be between 0 and the first edited block ({first_layer}), got {k}: the blocks that need gradients run on the sub-device"
                )));
            }
            Some(k)
        }
    };
    let (w_main_elems, w_sub_elems, w_tied_elems) = split_weights(model, boundary.unwrap_or(dm.n_layers));

    Ok(Sizes {
        cfg, o, family, info, dm, names, edited, editors, tokens, kept, s, b, n, nk, v, p_count, w_elems, w_max, din_dout,
        dout_sum, e_params, stats_elems, e_max, located, act_per_token, per_layer, first_layer, w_kept_elems,
        w_unkept_elems, layers_txt, image, boundary, w_main_elems, w_sub_elems, w_tied_elems, views, fwd_n, fwd_kept,
        base_kept, pass_n, batch_img_rows, edited_img_rows,
    })
}

/// Weight elements `(main, sub, tied head copy)` when blocks `[k, L)` with the final norm
/// and head go to the sub-device and the rest stays on main (`Family::head_params`).
fn split_weights(model: &Model, k: i64) -> (i64, i64, i64) {
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

/// Plan items as the phases add them, each on the device its role maps to.
struct Items {
    main: String,
    sub: String,
    host: Option<String>,
    items: Vec<PlanItem>,
}

impl Items {
    fn new(o: &PlanOptions) -> Self {
        let main = o.main.clone();
        let sub = if o.split { o.sub.clone() } else { o.main.clone() };
        let host = (main == "cpu").then(|| "cpu".to_string());
        Self { main, sub, host, items: Vec::new() }
    }

    fn add(&mut self, phase: Phase, role: Role, groups: &[Group], item: &str, formula: String, bytes: i64) {
        let device = match role {
            Role::Main => Some(self.main.clone()),
            Role::Sub => Some(self.sub.clone()),
            Role::Host => self.host.clone(),
        };
        self.items.push(PlanItem { phase, role, device, groups: groups.to_vec(), item: item.into(), formula, bytes: bytes.max(0) as u64 });
    }

    /// An item of the optimiser: on main, on sub, or in host memory (counted on the CPU
    /// device whichever role that is), as `--optimizer-device` places it.
    fn add_optimizer(&mut self, o: &PlanOptions, phase: Phase, groups: &[Group], item: &str, formula: String, bytes: i64) {
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
fn resident(z: &Sizes, it: &mut Items, phase: Phase) {
    let (s, p_count, e_params, stats_elems) = (z.s, z.p_count, z.e_params, z.stats_elems);
    let editors = &z.editors;
    let info = &z.info;
    let o = z.o;
    let train = z.mode(phase).train;
    use Group::*;
    if let Some(k) = z.boundary {
        let l = z.dm.n_layers;
        it.add(
            phase,
            Role::Main,
            &[Resident],
            "model weights: embedding and blocks below the boundary (layer split)",
            format!("elements of blocks [0, {k}) + embedding·s = {}·{s}", num(z.w_main_elems)),
            z.w_main_elems * s,
        );
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
fn images(z: &Sizes, it: &mut Items, phase: Phase) {
    let Some((shape, cost)) = &z.image else { return };
    use Group::*;
    let (b, s, d) = (z.b, z.s, z.dm.d);
    it.add(phase, Role::Main, &[VisionForward], "vision tower forward, one image (no grad)", cost.formula.clone(), cost.forward_bytes);
    let row = (shape.tokens - 2) * d * s;
    let feats = b * shape.images_per_example * row;
    let formula = format!("B·images·N_img·D·s = {b}·{}·{}·{d}·{s}", shape.images_per_example, shape.tokens - 2);
    it.add(phase, Role::Main, &[Capture, EditedForward, Backward], "image features (frozen, computed once per distinct image)", formula, feats);
    // Each view's batch (and the edited forward's) gathers the features of its rows.
    let rows = if phase == Phase::Train { z.batch_img_rows } else { b };
    it.add(
        phase,
        Role::Main,
        &[Capture, EditedForward, Backward],
        "image features gathered into the views' batches",
        format!("image rows·N_img·D·s = {rows}·{}·{d}·{s}", shape.tokens - 2),
        rows * row,
    );
    if z.o.split && phase == Phase::Train {
        let rows = z.edited_img_rows;
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

/// The vision tower's forward over one image, as planned.
struct VisionCost {
    forward_bytes: i64,
    formula: String,
}

/// Tokens and vision-forward bytes of one `width × height` image.
///
/// The forward runs without grad, so one block's working set is alive at a time: the
/// residual stream, the norm's output, q/k/v, the rotary f32 copies of q and k, the
/// attention output, the MLP's hidden layer (twice: activation and product), and the
/// attention scores of the largest segment (the whole image in full-attention blocks;
/// a fused kernel does not form them, so this is an upper bound); plus the f32 pixel rows
/// and their cast, the rotary tables, and the merged output.
fn image_cost(vl: &Qwen2Vl, proc: &ImageProcessorConfig, w: i64, h: i64, s: i64) -> Result<(ImageShape, VisionCost)> {
    if !(1..=1 << 16).contains(&w) || !(1..=1 << 16).contains(&h) {
        return Err(Error::input(format!("image size {w}x{h} is not 1 to 65536 pixels per side")));
    }
    let grid = proc.grid_for(h, w)?;
    let v = &vl.config.vision;
    let n = grid.iter().product::<i64>();
    let merged = n / v.merge_unit();
    let (e, f, heads, pd, u) = (v.width, v.mlp_hidden, v.num_heads, v.patch_dim(), v.merge_unit());
    let per_block = n * (e * 6 + 2 * f) * s + n * 2 * e * 4 + heads * n * n * s;
    let fixed = n * pd * (4 + s) + n * v.head_dim() * 2 * 4 + merged * (2 * e * u + v.out_dim) * s;
    let formula = format!(
        "N·(patch·(4+s) + 2·hd·4) + N·((6E+2F)·s + 2E·4) + H·N²·s + N/{u}·(2·{u}E+D)·s, N={n} E={e} F={f} H={heads}"
    );
    let shape = ImageShape {
        size: (w, h),
        resized: (grid[2] * proc.patch_size, grid[1] * proc.patch_size),
        patches: n,
        tokens: merged + 2,
        images_per_example: 3,
    };
    Ok((shape, VisionCost { forward_bytes: fixed + per_block, formula }))
}

/// Gradient capture on the main device: the forward and backward of the edit NLL.
fn capture(z: &Sizes, it: &mut Items, phase: Phase) {
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
        it.add(
            phase,
            Role::Main,
            &[Capture, EditedForward],
            "layer split: forward below the boundary without grad (one block's working set + its output)",
            format!("B·T·(bytes/token + d·s) = {n}·({ws} + {d}·{s}) [blocks < {k}]"),
            n * (ws + d * s),
        );
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
        let fwd_n = z.fwd_n;
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
fn edit(z: &Sizes, it: &mut Items, phase: Phase) {
    let (s, n, w_elems, din_dout, w_kept_elems, w_unkept_elems) = (z.s, z.n, z.w_elems, z.din_dout, z.w_kept_elems, z.w_unkept_elems);
    let editors = &z.editors;
    let edited = &z.edited;
    let cfg = z.cfg;
    let o = z.o;
    let Mode { train, recompute, factored } = z.mode(phase);
    // The edited forwards run on the sub-device when split.
    let fwd_role = if z.o.split { Role::Sub } else { Role::Main };
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
    if train {
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
    }
    let w_block_max: i64 = {
        let mut per_block: BTreeMap<i64, i64> = BTreeMap::new();
        for p in edited {
            *per_block.entry(p.layer).or_default() += p.numel();
        }
        per_block.values().copied().max().unwrap_or(0)
    };
    if factored {
        it.add(
            phase,
            Role::Main,
            &[EditedForward],
            "the edit as factors (lr·x̃, δ̃), f32",
            format!("B·T·Σ_P (d_in+d_out)·4 = {n}·{}·4", num(din_dout)),
            n * din_dout * 4,
        );
    } else if train && !o.split && !recompute {
        // On one device the graph keeps the W' of every edited weight whose input
        // needs grad (all but the lowest) until backward.
        it.add(
            phase,
            Role::Main,
            &[EditedForward],
            "edited weights W' kept by the graph",
            format!("Σ_saved d_in·d_out·s = {}·{s}", num(w_kept_elems)),
            w_kept_elems * s,
        );
        it.add(
            phase,
            Role::Main,
            &[EditedForward],
            "edited weights W' of the lowest edited weights",
            format!("Σ_first d_in·d_out·s = {}·{s}", num(w_unkept_elems)),
            w_unkept_elems * s,
        );
    } else {
        // Otherwise (recomputation, or a non-f32 model) W' stays alive whole as the
        // editor's output; what the forwards read of it is counted below.
        it.add(
            phase,
            Role::Main,
            &[EditedForward],
            "edited weights W' (full tensors)",
            format!("Σ_P d_in·d_out·s = {}·{s}", num(w_elems)),
            w_elems * s,
        );
    }
    if recompute {
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
fn edited_forwards(z: &Sizes, it: &mut Items, phase: Phase) {
    let (s, n, nk, v, act_per_token, first_layer) = (z.s, z.n, z.nk, z.v, z.act_per_token, z.first_layer);
    let located = &z.located;
    let dm = z.dm;
    let family = z.family;
    let o = z.o;
    // Tokens of the edited forward (every edited view's rows, padded to the longest), and
    // of the largest single view (recomputation runs one view's pass at a time).
    let (fwd_n, pass_n) = (z.fwd_n, z.pass_n);
    let edited_views: Vec<&str> = z.views.iter().filter(|v| v.edited).map(|v| v.name).collect();
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
fn losses_and_step(z: &Sizes, it: &mut Items, phase: Phase) {
    let (s, nk, v, w_elems, w_max, e_max) = (z.s, z.nk, z.v, z.w_elems, z.w_max, z.e_max);
    let (fwd_kept, base_kept) = (z.fwd_kept, z.base_kept);
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
fn totals(it: &Items) -> Vec<DeviceTotal> {
    use Group::*;
    let (main_dev, sub_dev, items) = (&it.main, &it.sub, &it.items);
    let mut devices: Vec<String> = vec![main_dev.clone()];
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

/// Builds the plan for an architecture (no weights needed). A layer split without a
/// boundary gets the balancing one ([`balanced_boundary`]).
pub fn plan_model(model: &Model, cfg: &MendConfig, o: &PlanOptions) -> Result<MemoryPlan> {
    if o.placement == Placement::Balanced && o.boundary.is_none() {
        let k = balanced_boundary(model, cfg, o)?;
        return plan_model(model, cfg, &PlanOptions { boundary: Some(k), ..o.clone() });
    }
    let z = sizes(model, cfg, o)?;
    let mut it = Items::new(o);
    for phase in [Phase::Train, Phase::Edit] {
        resident(&z, &mut it, phase);
        images(&z, &mut it, phase);
        capture(&z, &mut it, phase);
        edit(&z, &mut it, phase);
        edited_forwards(&z, &mut it, phase);
        losses_and_step(&z, &mut it, phase);
    }
    let totals = totals(&it);
    let shape = PlanShape {
        architecture: z.info.architecture.clone(),
        n_params: z.info.n_params,
        dtype: dtype_name(o.dtype).into(),
        dtype_bytes: z.s,
        main: o.main.clone(),
        sub: o.sub.clone(),
        split: o.split,
        placement: o.placement,
        boundary: z.boundary,
        optimizer_device: o.optimizer_device(),
        batch_size: z.b,
        tokens_per_example: z.tokens,
        kept_per_example: z.kept,
        vocab_size: z.v,
        hidden_size: z.dm.d,
        n_layers: z.dm.n_layers,
        edited: z.names,
        first_edited_layer: z.first_layer,
        editors: z.editors,
        editor_parameters: z.e_params,
        image: z.image.map(|(shape, _)| shape),
        views: z.views,
        edited_forward_tokens: z.fwd_n,
    };
    Ok(MemoryPlan { shape, items: it.items, totals })
}

impl MemoryPlan {
    /// Peak bytes of `device` in `phase` (0 if the device has no role).
    pub fn peak(&self, device: &str, phase: Phase) -> u64 {
        self.totals.iter().find(|t| t.device == device && t.phase == phase).map_or(0, |t| t.peak_bytes)
    }

    /// Bytes of one group on `device` in `phase`.
    pub fn group_bytes(&self, device: &str, phase: Phase, group: Group) -> u64 {
        self.totals
            .iter()
            .find(|t| t.device == device && t.phase == phase)
            .and_then(|t| t.by_group.get(&group).copied())
            .unwrap_or(0)
    }

    /// The plan as a text table: every item with its bytes and, under it, its formula;
    /// then each device's peak per phase.
    pub fn table(&self) -> String {
        let sh = &self.shape;
        let mut out = String::new();
        let placement = if sh.split {
            format!("main {}, sub {} (split), placement {}", sh.main, sh.sub, self.placement_label())
        } else {
            format!("main = sub = {} (single device)", sh.main)
        };
        let _ = writeln!(out, "memory plan: {} ({} parameters, {}), {placement}", sh.architecture, num(sh.n_params), sh.dtype);
        let _ = writeln!(
            out,
            "assumes batch {} x {} tokens with {} labelled positions per example; {} edited weights from layer {} on; {} editor(s), {} parameters",
            sh.batch_size,
            sh.tokens_per_example,
            sh.kept_per_example,
            sh.edited.len(),
            sh.first_edited_layer,
            sh.editors.len(),
            num(sh.editor_parameters)
        );
        let _ = writeln!(
            out,
            "s = {} bytes per weight element; B batch, T tokens, kept labelled positions, V vocabulary, P edited weights",
            sh.dtype_bytes
        );
        if let Some(im) = &sh.image {
            let _ = writeln!(
                out,
                "image {}x{} -> {}x{}: {} patches, {} tokens; {} distinct images per example, each through the tower once per step",
                im.size.0, im.size.1, im.resized.0, im.resized.1, im.patches, im.tokens, im.images_per_example
            );
        }
        out.push_str(&views_text(&sh.views, sh.edited_forward_tokens));
        let _ = writeln!(out, "a device's peak = its resident items + the largest of its other groups (they are never alive together)");
        for phase in [Phase::Train, Phase::Edit] {
            let title = match phase {
                Phase::Train => "TRAIN: one meta-training micro-step, the optimiser step, a checkpoint write",
                Phase::Edit => "EDIT: one edit with a trained editor, then scoring the edited model",
            };
            let _ = writeln!(out, "\n{title}");
            let _ = writeln!(out, "{:<5} {:<25} {:>10}  item / formula", "role", "alive during", "bytes");
            for it in self.items.iter().filter(|i| i.phase == phase) {
                let when: Vec<&str> = it.groups.iter().map(|g| g.name()).collect();
                let _ = writeln!(out, "{:<5} {:<25} {:>10}  {}", it.role.name(), when.join(","), format_bytes(it.bytes), it.item);
                let _ = writeln!(out, "{:<5} {:<25} {:>10}    = {}", "", "", "", it.formula);
            }
            for t in self.totals.iter().filter(|t| t.phase == phase) {
                let groups: Vec<String> = t
                    .by_group
                    .iter()
                    .filter(|(g, _)| **g != Group::Resident)
                    .map(|(g, b)| format!("{} {}", g.name(), format_bytes(*b)))
                    .collect();
                let _ = writeln!(
                    out,
                    "PEAK {} ({}): {}  = resident {} + {} (largest of: {})",
                    t.device,
                    t.roles.join("+"),
                    format_bytes(t.peak_bytes),
                    format_bytes(t.by_group.get(&Group::Resident).copied().unwrap_or(0)),
                    t.peak_group.name(),
                    groups.join(", ")
                );
            }
            if phase == Phase::Train && sh.main != "cpu" {
                let host: u64 = self.items.iter().filter(|i| i.phase == phase && i.role == Role::Host).map(|i| i.bytes).sum();
                let _ = writeln!(out, "host memory (not on {}): {} while a checkpoint is written", sh.main, format_bytes(host));
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::gpt2::{Gpt2, Gpt2Config};

    fn gpt2(n_layer: i64, d: i64, v: i64) -> Model {
        let c: Gpt2Config = serde_json::from_value(serde_json::json!({
            "vocab_size": v, "n_embd": d, "n_layer": n_layer, "n_head": 4, "n_positions": 128
        }))
        .unwrap();
        Model::new(Gpt2::new(c).unwrap())
    }

    #[test]
    fn frozen_layers_below_the_first_edit_keep_nothing() {
        let m = gpt2(6, 64, 100);
        let last: Vec<(i64, String)> = vec![(5, "mlp.c_fc".into()), (5, "mlp.c_proj".into())];
        let two: Vec<(i64, String)> = vec![(4, "mlp.c_fc".into()), (5, "mlp.c_fc".into()), (5, "mlp.c_proj".into())];
        let Saved { per_token: a, per_layer: la, w_kept: ka } = saved_activations(m.family(), 4, &last);
        let Saved { per_token: b, per_layer: lb, .. } = saved_activations(m.family(), 4, &two);
        assert_eq!(la.len(), 1);
        assert_eq!(lb.len(), 2);
        assert!(b > a);
        // Layer 5: ln_2 input not needed (residual has no grad), c_fc input + gelu in/out.
        assert_eq!(la[0].1, (64 + 2 * 256) * 4);
        // c_fc's input needs no grad, so only c_proj's W' is kept by the graph.
        assert_eq!(ka, vec![(5, "mlp.c_proj".to_string())]);
    }

    #[test]
    fn plan_sums_and_split() {
        let m = gpt2(4, 64, 100);
        let cfg = MendConfig { rank: 8, ..MendConfig::default() };
        let single = plan_model(&m, &cfg, &PlanOptions::new("cpu", None, Kind::Float, 16, Some(4)).unwrap()).unwrap();
        assert_eq!(single.totals.len(), 2); // one device, two phases
        let t = &single.totals[0];
        assert_eq!(t.roles, vec!["main", "sub"]);
        let resident = t.by_group[&Group::Resident];
        let largest = t.by_group.iter().filter(|(g, _)| **g != Group::Resident).map(|(_, b)| *b).max().unwrap();
        assert_eq!(t.peak_bytes, resident + largest);
        assert_eq!(t.by_group[&t.peak_group], largest);
        let split = plan_model(&m, &cfg, &PlanOptions::new("cuda:0", Some("cuda:1"), Kind::BFloat16, 16, Some(4)).unwrap()).unwrap();
        assert_eq!(split.totals.len(), 4);
        let sub_train = split.peak("cuda:1", Phase::Train);
        let weights = (m.info().n_params * 2) as u64;
        assert!(sub_train > weights, "the sub-device holds the replica and the edited forwards");
        // Editor state stays on main.
        assert!(split.group_bytes("cuda:0", Phase::Train, Group::Resident) > weights + 4 * single.shape.editor_parameters as u64);
        // Training losses are computed on the sub-device: no vocabulary-sized tensor of the
        // edited forwards is planned on main, and only the edit phase copies logits back.
        let logits_of = |p: &MemoryPlan, phase: Phase| -> Vec<Role> {
            p.items.iter().filter(|i| i.phase == phase && i.item.starts_with("logits")).map(|i| i.role).collect()
        };
        assert_eq!(logits_of(&split, Phase::Train), vec![Role::Sub]);
        assert_eq!(logits_of(&single, Phase::Train), vec![Role::Main]);
        assert!(logits_of(&split, Phase::Edit).contains(&Role::Main));
        assert!(split.table().contains("PEAK cuda:1 (sub)"));
        assert!(serde_json::to_string(&split).unwrap().contains("\"peak_bytes\""));
    }

    #[test]
    fn recompute_keeps_block_inputs_instead_of_activations() {
        let m = gpt2(12, 64, 100);
        let deep: Vec<String> = [2, 5, 8, 11].iter().flat_map(|l| ["c_fc", "c_proj"].map(|x| format!("transformer.h.{l}.mlp.{x}.weight"))).collect();
        let o = PlanOptions::new("cpu", None, Kind::Float, 128, Some(8)).unwrap();
        let plain = MendConfig { rank: 8, batch_size: 4, edit_params: deep, ..MendConfig::default() };
        let rc = MendConfig { recompute: true, ..plain.clone() };
        let (a, b) = (plan_model(&m, &plain, &o).unwrap(), plan_model(&m, &rc, &o).unwrap());
        let fwd = |p: &MemoryPlan| p.group_bytes("cpu", Phase::Train, Group::EditedForward);
        assert!(fwd(&b) < fwd(&a), "recompute {} vs {}", fwd(&b), fwd(&a));
        // Capture and editing are untouched.
        assert_eq!(a.group_bytes("cpu", Phase::Train, Group::Capture), b.group_bytes("cpu", Phase::Train, Group::Capture));
        assert_eq!(a.peak("cpu", Phase::Edit), b.peak("cpu", Phase::Edit));
        // Block inputs of blocks 2..11 plus the last hidden state: 11 · B·T·d·4.
        let inputs = b.items.iter().find(|i| i.item.starts_with("recompute: block inputs")).unwrap();
        assert_eq!(inputs.bytes, 11 * 4 * 128 * 64 * 4);
        assert!(!b.items.iter().any(|i| i.item.starts_with("edited forwards: activations")));
        // Split: the W' leaves and the gradient sum on sub, one copy each.
        let mut os = o.clone();
        os.split = true;
        let split = plan_model(&m, &rc, &os).unwrap();
        assert!(split.items.iter().any(|i| i.role == Role::Sub && i.item.contains("W' leaves on sub")));
        assert!(!split.items.iter().any(|i| i.phase == Phase::Train && i.item.contains("W' copy on sub (one edited forward)")));
    }

    #[test]
    fn bad_options_are_refused() {
        assert!(PlanOptions::new("gpu", None, Kind::Float, 8, None).is_err());
        let m = gpt2(3, 64, 100);
        // Beyond the context: capped as runs cap max_length.
        let o = PlanOptions::new("cpu", None, Kind::Float, 1000, None).unwrap();
        assert_eq!(plan_model(&m, &MendConfig::default(), &o).unwrap().shape.tokens_per_example, 128);
        let o = PlanOptions::new("cpu", None, Kind::Float, 8, Some(8)).unwrap();
        assert!(plan_model(&m, &MendConfig::default(), &o).is_err());
        let o = PlanOptions::new("cpu", None, Kind::Float, 8, None).unwrap();
        let bad = MendConfig { edit_params: vec!["transformer.wte.weight".into()], ..MendConfig::default() };
        assert!(plan_model(&m, &bad, &o).is_err());
    }
}

/// The layer split's boundary `k` (blocks `[k, L)` on the sub-device) that balances the two
/// devices: it minimises the larger of the main and sub peaks in `o.balance_for`, each
/// divided by its capacity when `o.caps` gives one. `k` runs from 0 (only the embedding
/// on main) to the first edited block (everything that needs gradients on sub); the
/// smallest `k` wins ties.
pub fn balanced_boundary(model: &Model, cfg: &MendConfig, o: &PlanOptions) -> Result<i64> {
    let at = |k: i64| plan_model(model, cfg, &PlanOptions { placement: Placement::Balanced, boundary: Some(k), ..o.clone() });
    let first = at(0)?.shape.first_edited_layer;
    let mut best: Option<(f64, i64)> = None;
    for k in 0..=first {
        let p = at(k)?;
        let load = |dev: &str| p.peak(dev, o.balance_for) as f64 / o.caps.get(dev).map_or(1.0, |c| c as f64);
        let worst = load(&o.main).max(load(&o.sub));
        if best.is_none_or(|(b, _)| worst < b) {
            best = Some((worst, k));
        }
    }
    best.map(|(_, k)| k).ok_or_else(|| Error::input("no layer split to choose from"))
}

/// Every placement of the given devices, in the order [`choose`] tries them: replica and
/// layer split with the optimiser beside the editor, then with it on the sub-device, then
/// on the CPU. One device (no sub-device): the single-device plan alone.
pub fn plan_all(model: &Model, cfg: &MendConfig, o: &PlanOptions) -> Result<Vec<MemoryPlan>> {
    if !o.split {
        return Ok(vec![plan_model(model, cfg, &o.single())?]);
    }
    let mut out = Vec::new();
    for opt in [OptimizerDevice::Main, OptimizerDevice::Sub, OptimizerDevice::Cpu] {
        for placement in Placement::ALL {
            if opt == OptimizerDevice::Cpu && (o.main == "cpu" || o.sub == "cpu") {
                continue; // the same as Main or Sub there
            }
            out.push(plan_model(model, cfg, &o.with_placement(placement, opt)?)?);
        }
    }
    Ok(out)
}

/// `--placement auto`: the first plan of [`plan_all`] whose every device's peak in
/// `phase` fits its capacity (devices without a cap in `o.caps` always fit). When none
/// fits, the error lists each placement's peaks against the caps.
pub fn choose(model: &Model, cfg: &MendConfig, o: &PlanOptions, phase: Phase) -> Result<MemoryPlan> {
    let o = PlanOptions { balance_for: phase, ..o.clone() };
    let plans = plan_all(model, cfg, &o)?;
    let mut lines = Vec::new();
    for p in plans {
        match p.over_caps(&o.caps, phase) {
            None => return Ok(p),
            Some(why) => lines.push(format!("  {}: {why}", p.placement_label())),
        }
    }
    Err(Error::OutOfMemory(format!(
        "no placement fits --max-memory {}:\n{}",
        o.caps.0.iter().map(|(d, b)| format!("{d}={}", format_bytes(*b))).collect::<Vec<_>>().join(","),
        lines.join("\n")
    )))
}

/// The views as text: one line each (rows × tokens, of which image, labelled), then the
/// edited forward's tokens.
fn views_text(views: &[ViewShape], fwd_tokens: i64) -> String {
    let mut out = String::from("views of one micro-batch (rows x tokens per row, image tokens, labelled positions per row):\n");
    for v in views {
        let role = if v.edited { "edited forward" } else { "capture" };
        let _ = writeln!(out, "  {:<17} {:>3} x {:>5}  image {:>5}  labelled {:>4}  [{role}]", v.name, v.rows, v.tokens, v.image_tokens, v.kept);
    }
    let _ = writeln!(out, "  the edited forward runs one batch of the edited views padded to the longest: {fwd_tokens} tokens");
    out
}

/// One row of the placements table: a plan's peaks per device against the single-device
/// run's.
#[derive(Debug, Clone, Serialize)]
pub struct PlacementRow {
    pub placement: Placement,
    pub optimizer_device: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub boundary: Option<i64>,
    /// Peak bytes per device in meta-training and in editing.
    pub train: BTreeMap<String, u64>,
    pub edit: BTreeMap<String, u64>,
    /// Main-device training peak / the single-device training peak.
    pub main_ratio: f64,
    /// Largest device's training peak / the single-device training peak.
    pub max_ratio: f64,
}

/// The table of every placement ([`plan_all`]) against the single-device plan.
#[derive(Debug, Clone, Serialize)]
pub struct PlacementTable {
    pub single_train_bytes: u64,
    pub single_edit_bytes: u64,
    /// The views every placement plans for (the same for all).
    pub views: Vec<ViewShape>,
    pub edited_forward_tokens: i64,
    pub rows: Vec<PlacementRow>,
}

impl PlacementTable {
    pub fn new(model: &Model, cfg: &MendConfig, o: &PlanOptions) -> Result<Self> {
        let single = plan_model(model, cfg, &o.single())?;
        let (st, se) = (single.peak(&o.main, Phase::Train), single.peak(&o.main, Phase::Edit));
        let rows = plan_all(model, cfg, o)?
            .into_iter()
            .map(|p| {
                let per = |phase| {
                    p.totals
                        .iter()
                        .filter(|t| t.phase == phase && t.peak_bytes > 0)
                        .map(|t| (t.device.clone(), t.peak_bytes))
                        .collect::<BTreeMap<_, _>>()
                };
                let train = per(Phase::Train);
                let max = train.values().copied().max().unwrap_or(0);
                PlacementRow {
                    placement: p.shape.placement,
                    optimizer_device: p.shape.optimizer_device.clone(),
                    boundary: p.shape.boundary,
                    main_ratio: train.get(&o.main).copied().unwrap_or(0) as f64 / st.max(1) as f64,
                    max_ratio: max as f64 / st.max(1) as f64,
                    edit: per(Phase::Edit),
                    train,
                }
            })
            .collect();
        Ok(Self { single_train_bytes: st, single_edit_bytes: se, views: single.shape.views.clone(), edited_forward_tokens: single.shape.edited_forward_tokens, rows })
    }

    /// As text: one line per placement with each device's training and editing peaks.
    pub fn text(&self) -> String {
        let mut out = views_text(&self.views, self.edited_forward_tokens);
        let _ = writeln!(
            out,
            "single device: train {}, edit {}",
            format_bytes(self.single_train_bytes),
            format_bytes(self.single_edit_bytes)
        );
        let _ = writeln!(out, "{:<10} {:<10} {:>8}  {:<52} {:<40} {:>6} {:>6}", "placement", "optimizer", "boundary", "train peak per device", "edit peak per device", "main/1", "max/1");
        for r in &self.rows {
            let dev = |m: &BTreeMap<String, u64>| m.iter().map(|(d, b)| format!("{d} {}", format_bytes(*b))).collect::<Vec<_>>().join(", ");
            let _ = writeln!(
                out,
                "{:<10} {:<10} {:>8}  {:<52} {:<40} {:>6.2} {:>6.2}",
                r.placement.name(),
                r.optimizer_device,
                r.boundary.map_or("-".into(), |k| k.to_string()),
                dev(&r.train),
                dev(&r.edit),
                r.main_ratio,
                r.max_ratio
            );
        }
        out
    }
}

impl MemoryPlan {
    /// `None` when every device's peak in `phase` fits its cap; else which do not.
    pub fn over_caps(&self, caps: &MaxMemory, phase: Phase) -> Option<String> {
        let over: Vec<String> = self
            .totals
            .iter()
            .filter(|t| t.phase == phase)
            .filter_map(|t| {
                let cap = caps.get(&t.device)?;
                (t.peak_bytes > cap).then(|| format!("{} needs {} > cap {}", t.device, format_bytes(t.peak_bytes), format_bytes(cap)))
            })
            .collect();
        (!over.is_empty()).then(|| over.join(", "))
    }

    /// `balanced (boundary 16), optimizer on cuda:1`, for messages.
    pub fn placement_label(&self) -> String {
        let sh = &self.shape;
        let mut s = sh.placement.name().to_string();
        if let Some(k) = sh.boundary {
            s.push_str(&format!(" (blocks from {k} on the sub-device)"));
        }
        if sh.optimizer_device != sh.main {
            s.push_str(&format!(", optimizer on {}", sh.optimizer_device));
        }
        s
    }
}

/// What a run's `--placement` is resolved against: its devices, the request, the model's
/// `config.json`, the MEND config, the weights' dtype, tokens per example and the phase
/// whose peaks matter.
pub struct PlacementQuery<'a> {
    pub main: &'a str,
    pub sub: Option<&'a str>,
    pub request: PlacementRequest,
    /// `--optimizer-device` as given (`None`: main, or `auto`'s choice).
    pub optimizer: Option<OptimizerDevice>,
    pub caps: Option<&'a MaxMemory>,
    pub model: &'a Path,
    pub config: &'a MendConfig,
    pub dtype: Kind,
    pub tokens: i64,
    pub phase: Phase,
}

/// `base` with the request resolved: the layer split's boundary and `auto`'s choice of
/// placement and optimiser device come from the plan of `q.model` against `q.caps`.
/// Returns the plan, and for `auto` the label of the placement it chose.
pub fn resolve_placement(base: DevicePlan, q: &PlacementQuery) -> Result<(DevicePlan, Option<String>)> {
    let mut base = base.with_optimizer(q.optimizer.unwrap_or_default());
    if q.request == PlacementRequest::Replica {
        return Ok((base, None));
    }
    let (model, _) = read_config(q.model)?;
    let mut o = PlanOptions::new(q.main, q.sub, q.dtype, q.tokens, None)?;
    o.caps = q.caps.cloned().unwrap_or_default();
    o.balance_for = q.phase;
    o.optimizer = base.optimizer;
    let chosen = match q.request.fixed() {
        Some(p) => plan_model(&model, q.config, &o.with_placement(p, base.optimizer)?)?,
        None => {
            let p = choose(&model, q.config, &o, q.phase)?;
            let opt = p.shape.optimizer_device.as_str();
            base = base.with_optimizer(if opt == o.main {
                OptimizerDevice::Main
            } else if opt == o.sub {
                OptimizerDevice::Sub
            } else {
                OptimizerDevice::Cpu
            });
            if q.optimizer.is_some_and(|d| d != base.optimizer) {
                return Err(Error::input(format!(
                    "--placement auto: no placement with --optimizer-device {:?} fits; the planner's choice puts the optimiser on {opt}",
                    q.optimizer
                )));
            }
            p
        }
    };
    let label = q.request.fixed().is_none().then(|| chosen.placement_label());
    match (chosen.shape.placement, chosen.shape.boundary) {
        (Placement::Balanced, Some(k)) => Ok((base.balanced(k as usize)?, label)),
        _ => Ok((base, label)),
    }
}

/// The out-of-memory diagnosis's question to the planner (`device::oom::FitAdvisor`): of
/// the placements of the run's devices ([`choose`], in [`plan_all`]'s order), the first
/// whose every device's training peak fits its capacity. A single-device run is also
/// planned with each possible sub-device (`--sub-device`), the CPU last.
#[derive(Debug)]
pub struct FitAdvice {
    model: Model,
    config: MendConfig,
    /// The run's devices, dtype, tokens and capacities (`caps`).
    opts: PlanOptions,
    /// Sub-devices to propose when the run has none.
    subs: Vec<String>,
    /// The run's own placement and optimiser device, to say when the planner's choice is it.
    current: (Placement, OptimizerDevice),
}

impl FitAdvice {
    /// Advice for a run placed as `plan`, on the model in `dir` (its `config.json`), with
    /// `tokens` per example, against `caps` (`--max-memory`); a CUDA device without a cap
    /// is planned against its size. Sub-devices proposed to a single-device run: every
    /// other CUDA device here, then the CPU.
    pub fn for_run(dir: &Path, config: &MendConfig, plan: &DevicePlan, dtype: Kind, tokens: i64, caps: &MaxMemory) -> Result<Self> {
        let (model, _) = read_config(dir)?;
        let name = |d: tch::Device| crate::device::memory::device_name(d);
        let mut opts = PlanOptions::new(&name(plan.main), Some(&name(plan.sub)), dtype, tokens, None)?;
        opts.split = plan.split;
        let mut caps = caps.clone();
        for d in [plan.main, plan.sub] {
            if let (tch::Device::Cuda(_), None) = (d, caps.get(&name(d))) {
                if let Ok(total) = crate::device::memory::total_bytes(d) {
                    caps.0.insert(name(d), total);
                }
            }
        }
        opts.caps = caps;
        let mut subs: Vec<String> = (0..tch::Cuda::device_count().max(0) as usize).map(|i| format!("cuda:{i}")).filter(|d| *d != opts.main).collect();
        if opts.main != "cpu" {
            subs.push("cpu".into());
        }
        Ok(Self::new(model, config.clone(), opts, subs, (plan.placement, plan.optimizer)))
    }

    /// Advice for the devices and capacities of `opts` (which need not exist here),
    /// proposing `subs` when `opts` has no sub-device.
    pub fn new(model: Model, config: MendConfig, opts: PlanOptions, subs: Vec<String>, current: (Placement, OptimizerDevice)) -> Self {
        Self { model, config, opts, subs, current }
    }

    /// The command-line flags that select `p`, with its training peak per device.
    fn flags(&self, p: &MemoryPlan, add_sub: bool) -> String {
        let sh = &p.shape;
        let mut out = Vec::new();
        if add_sub {
            out.push(format!("--sub-device {}", sh.sub));
        }
        if sh.split {
            out.push(format!("--placement {}", sh.placement.name()));
        }
        let opt = if sh.optimizer_device == sh.main {
            None
        } else if sh.optimizer_device == sh.sub {
            Some("sub")
        } else {
            Some("cpu")
        };
        if let Some(o) = opt {
            out.push(format!("--optimizer-device {o}"));
        }
        let role = |d: &str| {
            if d == sh.main {
                "main "
            } else if d == sh.sub {
                "sub "
            } else {
                ""
            }
        };
        let peaks: Vec<String> = p
            .totals
            .iter()
            .filter(|t| t.phase == Phase::Train && t.peak_bytes > 0)
            .map(|t| format!("{}{} {}", role(&t.device), t.device, format_bytes(t.peak_bytes)))
            .collect();
        let head = if out.is_empty() { "the run's devices as they are".to_string() } else { out.join(" ") };
        let mut s = format!("{head} ({})", peaks.join(", "));
        if let Some(k) = sh.boundary {
            s.push_str(&format!(", blocks from {k} on the sub-device"));
        }
        let current_opt = match self.current.1 {
            OptimizerDevice::Main => None,
            OptimizerDevice::Sub => Some("sub"),
            OptimizerDevice::Cpu => Some("cpu"),
        };
        let mine = !add_sub && sh.placement == self.current.0 && opt == current_opt;
        if mine {
            s.push_str("; this is the run's own placement: the estimate (within about 15 % on CUDA) was too low for it, so lower the batch or the tokens per example");
        }
        s
    }
}

impl crate::device::oom::FitAdvisor for FitAdvice {
    fn would_fit(&self) -> std::result::Result<String, String> {
        if self.opts.caps.is_empty() {
            return Err(format!("no capacity is known for {} (give --max-memory to plan against one)", self.opts.main));
        }
        // The run's own devices first, then (one device) with each possible sub-device.
        let mut tries = vec![(self.opts.clone(), false)];
        if !self.opts.split {
            tries.extend(self.subs.iter().map(|s| (PlanOptions { sub: s.clone(), split: true, ..self.opts.clone() }, true)));
        }
        let mut why = Vec::new();
        for (o, add_sub) in tries {
            match choose(&self.model, &self.config, &o, Phase::Train) {
                Ok(p) => return Ok(self.flags(&p, add_sub)),
                Err(Error::OutOfMemory(m)) => why.push(m),
                Err(e) => why.push(e.to_string()),
            }
        }
        if !self.opts.split && self.subs.is_empty() {
            why.push(format!("there is no other device here to divide the run with {}", self.opts.main));
        }
        Err(why.join("\n"))
    }
}
