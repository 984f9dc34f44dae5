//! The plan's types: the options a plan is made for, its items, per-device totals and
//! the shapes it was made from; dtype sizes and number formatting.
use std::collections::BTreeMap;

use serde::Serialize;
use tch::Kind;

use crate::device::memory::format_bytes;
use crate::device::{MaxMemory, OptimizerDevice, Placement};
use crate::model::vision::ImageProcessorConfig;
use crate::{Error, Result};


/// What is planned for: devices, weight dtype, sequence shape.
#[derive(Debug, Clone)]
pub struct PlanOptions {
    /// Main device name (`cpu`, `cuda`, `cuda:N`); need not exist on this machine.
    pub main: String,
    /// Sub-device name (the last of a chain).
    pub sub: String,
    /// A chain's devices between main and `sub` (`--sub-device a,b,c`: `a`, `b`), in
    /// order; only the layer split runs on a chain.
    pub chain: Vec<String>,
    /// With the layer split over a chain: the first block on each of `chain`'s devices
    /// (increasing, below `boundary`). Empty: the balancing ones ([`balanced_chain`]).
    pub chain_at: Vec<i64>,
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
    /// What of each cap a placement may use ([`Headroom`]: 10 % and 0.5 GiB
    /// per CUDA device unless `plan --margin/--reserve` say otherwise).
    pub headroom: Headroom,
    /// The host's memory: the capacity of a CPU device `caps` names none for (host
    /// memory is a capacity too), [`PlanOptions::capacity`]. `None`: unknown. By default
    /// this machine's ([`crate::device::memory::host_total_bytes`]).
    pub host_bytes: Option<u64>,
}

impl PlanOptions {
    /// Devices from their names (`sub` defaults to `main`).
    /// `sub` may list a chain (`cuda:1,cuda:2,cuda:3`, [`crate::device::parse_sub_list`]).
    pub fn new(main: &str, sub: Option<&str>, dtype: Kind, tokens: i64, kept: Option<i64>) -> Result<Self> {
        let main_n: crate::device::DeviceName = main.parse()?;
        let mut subs = match sub {
            Some(s) => crate::device::parse_sub_list(main_n, s, |d| d.parse())?,
            None => vec![main_n],
        };
        let sub = subs.pop().unwrap_or(main_n).to_string();
        let main = main_n.to_string();
        let split = main != sub;
        Ok(Self {
            main,
            sub,
            chain: subs.iter().map(|d| d.to_string()).collect(),
            chain_at: Vec::new(),
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
            headroom: Headroom::default(),
            host_bytes: crate::device::memory::host_total_bytes(),
        })
    }

    /// What `device` holds: its `--max-memory` cap, else for a CPU device the host's
    /// memory ([`PlanOptions::host_bytes`]); `None` for a GPU without a cap.
    pub fn capacity(&self, device: &str) -> Option<u64> {
        self.caps.get(device).or_else(|| if device.starts_with("cpu") { self.host_bytes } else { None })
    }

    /// The caps a placement is judged against: `--max-memory`'s, and the host's memory
    /// for each CPU device of the plan it names no cap for.
    pub fn judged_caps(&self) -> MaxMemory {
        let mut caps = self.caps.clone();
        // `cpu` also for the optimiser's moments on the CPU (`--optimizer-device cpu`).
        for d in self.devices().into_iter().chain(["cpu".to_string()]) {
            if let (None, Some(c)) = (caps.get(&d), self.capacity(&d)) {
                caps.0.insert(d, c);
            }
        }
        caps
    }

    /// A device's share of its capacity for the layer split's balance: `bytes / capacity`
    /// when every device of the plan has a capacity ([`PlanOptions::capacity`]), else plain
    /// bytes (a share of one device is never weighed against bytes of another).
    pub fn balance_load(&self, device: &str, bytes: u64) -> f64 {
        let all = self.devices().iter().all(|d| self.capacity(d).is_some());
        match self.capacity(device).filter(|_| all) {
            Some(c) => bytes as f64 / c.max(1) as f64,
            None => bytes as f64,
        }
    }

    /// A run's `--max-memory`: caps the process enforced on the CUDA caching allocator
    /// (`device::memory::apply_caps`), so its CUDA devices keep no context reserve.
    pub fn with_run_caps(mut self, caps: MaxMemory) -> Self {
        self.headroom.allocator_capped = caps.iter().map(|(d, _)| d.to_string()).filter(|d| d.starts_with("cuda")).collect();
        self.caps = caps;
        self
    }

    /// The same options for `placement` (the layer split needs two devices, or `split`
    /// forced on one).
    pub fn with_placement(&self, placement: Placement, optimizer: OptimizerDevice) -> Result<Self> {
        if placement == Placement::Balanced && !self.split {
            return Err(Error::input("`placement` balanced divides the model between two devices: give `sub_device` (a device other than `device`)"));
        }
        if placement == Placement::Replica && !self.chain.is_empty() {
            return Err(Error::input(format!(
                "`sub_device` {}: `placement` replica runs on two devices (main and one sub-device); a chain runs `placement` balanced or auto",
                self.sub_list()
            )));
        }
        let balanced = placement == Placement::Balanced;
        Ok(Self {
            placement,
            optimizer,
            boundary: if balanced { self.boundary } else { None },
            chain_at: if balanced { self.chain_at.clone() } else { Vec::new() },
            ..self.clone()
        })
    }

    /// The same devices as one device (main alone): the reference the placements are
    /// compared with.
    pub fn single(&self) -> Self {
        Self {
            sub: self.main.clone(),
            split: false,
            placement: Placement::Replica,
            boundary: None,
            optimizer: OptimizerDevice::Main,
            chain: Vec::new(),
            chain_at: Vec::new(),
            ..self.clone()
        }
    }

    /// The sub-devices as `--sub-device` lists them (`cuda:1,cuda:2`).
    pub fn sub_list(&self) -> String {
        self.chain.iter().chain([&self.sub]).cloned().collect::<Vec<_>>().join(",")
    }

    /// Every device of the plan in order: main, the chain, the last sub-device.
    pub fn devices(&self) -> Vec<String> {
        let mut v = vec![self.main.clone()];
        v.extend(self.chain.iter().cloned());
        if self.sub != self.main {
            v.push(self.sub.clone());
        }
        v
    }

    pub(super) fn optimizer_device(&self) -> String {
        match self.optimizer {
            OptimizerDevice::Main => self.main.clone(),
            OptimizerDevice::Sub => if self.split { self.sub.clone() } else { self.main.clone() },
            OptimizerDevice::Cpu => "cpu".into(),
        }
    }
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
    /// A chain's device between main and the last sub-device (the item names which).
    Chain,
}

impl Role {
    pub fn name(self) -> &'static str {
        match self {
            Role::Main => "main",
            Role::Sub => "sub",
            Role::Host => "host",
            Role::Chain => "chain",
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
    /// Layer split over a chain: each device between main and the last with its first block.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub chain: Vec<(String, i64)>,
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

/// Element size of a weight dtype.
pub(super) fn dtype_bytes(k: Kind) -> i64 {
    k.elt_size_in_bytes() as i64
}


pub(super) fn num(n: i64) -> String {
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

/// The default share of a cap kept free (`--margin`): the planner's own error.
pub const DEFAULT_MARGIN: f64 = 0.10;
/// The default bytes kept free on each CUDA device (`--reserve`): its context.
pub const DEFAULT_RESERVE: u64 = 512 << 20;

/// What of a cap a plan may use.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Headroom {
    /// Share of the cap kept free, in `[0, 1)`.
    pub margin: f64,
    /// Bytes kept free on each CUDA device.
    pub reserve_bytes: u64,
    /// Devices whose cap is the caching allocator's (a run's `--max-memory`), not the
    /// card's: the CUDA context is outside it, so they keep no reserve.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub allocator_capped: Vec<String>,
}

impl Default for Headroom {
    fn default() -> Self {
        Self { margin: DEFAULT_MARGIN, reserve_bytes: DEFAULT_RESERVE, allocator_capped: Vec::new() }
    }
}

impl Headroom {
    /// A margin from `--margin` (`10%`, `0.1`) and a reserve from `--reserve` (`512MiB`).
    pub fn parse(margin: Option<&str>, reserve: Option<&str>) -> Result<Self> {
        let mut h = Self::default();
        if let Some(m) = margin {
            let t = m.trim();
            let v = match t.strip_suffix('%') {
                Some(p) => p.trim().parse::<f64>().map(|p| p / 100.0),
                None => t.parse::<f64>(),
            }
            .map_err(|_| Error::input(format!("`margin` {m:?}: expected a share such as 10% or 0.1")))?;
            if !(0.0..1.0).contains(&v) {
                return Err(Error::input(format!("`margin` {m:?}: the share kept free must be at least 0 and less than 100%")));
            }
            h.margin = v;
        }
        if let Some(r) = reserve {
            h.reserve_bytes = match r.trim() {
                "0" => 0,
                t => crate::device::placement::parse_size(t).map_err(|e| Error::input(format!("`reserve` {r:?}: {e}")))?,
            };
        }
        Ok(h)
    }

    /// The bytes a plan may use on `device` capped at `cap`.
    pub fn usable(&self, device: &str, cap: u64) -> u64 {
        let after_margin = (cap as f64 * (1.0 - self.margin)) as u64;
        if device.starts_with("cuda") && !self.allocator_capped.iter().any(|d| d == device) {
            after_margin.saturating_sub(self.reserve_bytes)
        } else {
            after_margin
        }
    }

    /// `cap × 0.90 − 512.0 MiB`, for messages.
    pub fn text(&self) -> String {
        let mut t = format!("cap x {:.2} - {} per CUDA device", 1.0 - self.margin, format_bytes(self.reserve_bytes));
        if !self.allocator_capped.is_empty() {
            t.push_str(&format!(" (no reserve on {}: the cap is the allocator's, the context is outside it)", self.allocator_capped.join(", ")));
        }
        t
    }
}
