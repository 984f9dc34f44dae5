//! Parameters as an explicit argument of the forward pass.
//!
//! MEND needs the edited model f(x; θ + Δ) as a differentiable function of Δ. Instead of
//! patching a module tree (Python's `higher`), the forward reads every weight through a
//! [`ParamView`]: the frozen store plus an override map holding only the edited tensors.
//! Untouched weights are never copied.
use std::collections::HashMap;
use std::sync::Arc;

use tch::{Device, Kind, Tensor};

use crate::{Error, Result};

/// A weight change kept as its factors: `W' = W + Σ_rows aᵢᵀ bᵢ`, with `a` `[r, d_in]` and
/// `b` `[r, d_out]` (MEND's update `lr·Σ δ̃ x̃ᵀ` has one row per edit token).
///
/// A layer applies it as `x·W + (x·aᵀ)·b`: for a handful of rows that is two small
/// products, where building `W'` writes a whole weight-sized tensor per edited weight
/// (9 MiB each for GPT-2 small's MLP) and the dual-device split would carry it to the
/// sub-device.
#[derive(Debug)]
pub struct LowRank {
    pub a: Tensor,
    pub b: Tensor,
}

impl LowRank {
    /// `x·aᵀ·b` for `x` `[.., d_in]`, in f32, cast to `x`'s kind.
    pub fn apply(&self, x: &Tensor) -> Tensor {
        x.to_kind(Kind::Float).matmul(&self.a.tr()).matmul(&self.b).to_kind(x.kind())
    }

    /// The full weight `W + Σ_rows aᵀ b` in `layout`'s orientation: one GEMM accumulating
    /// into a copy of `W`, in f32, returned in `W`'s kind on `W`'s device.
    pub fn added_to(&self, w: &Tensor, layout: super::WeightLayout) -> Tensor {
        let dev = w.device();
        layout.add_outer(&w.to_kind(Kind::Float), &self.a.to_device(dev), &self.b.to_device(dev)).to_kind(w.kind())
    }
}

/// A weight change `D` applied to each batch row at its own scale: row `b` of a forward
/// sees `W + scales[b]·D`, as `x·W + scales[b]·(x·D)`. The commit guard asks at which
/// scale an edit still makes itself; with the edit's prompt repeated once per scale, one
/// forward answers for several scales, where building `W + s·D` for each would write every
/// edited weight and run one forward per scale.
#[derive(Debug)]
pub struct RowScaled {
    /// `[d_out, d_in]` or `[d_in, d_out]`, the weight's layout, f32.
    pub delta: Tensor,
    /// `[B]` f32, one scale per batch row.
    pub scales: Tensor,
}

impl RowScaled {
    /// `scales[b]·(x·D)` for `x` `[B, .., d_in]`, in f32, cast to `x`'s kind.
    pub fn apply(&self, x: &Tensor, layout: super::WeightLayout) -> Result<Tensor> {
        let (size, b) = (x.size(), self.scales.size());
        if size.len() < 2 || b.len() != 1 || size[0] != b[0] {
            return Err(Error::Internal(format!("row scales {b:?} for an input of shape {size:?}")));
        }
        let mut per_row = vec![1i64; size.len()];
        per_row[0] = b[0];
        crate::error::guard(|| Ok((layout.apply(&x.to_kind(Kind::Float), &self.delta, None) * self.scales.view(per_row.as_slice())).to_kind(x.kind())))
    }
}

/// The edited weights a forward reads instead of the frozen ones, by parameter name: each
/// either replaced outright (`W'`: non-f32 weights, recomputed meta-training, the
/// fine-tuning baseline), changed by a [`LowRank`] term (MEND's edit of an f32 weight;
/// see [`ParamStore::materialise`] for the weight it stands for) or by a [`RowScaled`] one
/// (the guard's scale search).
#[derive(Debug, Default)]
pub struct Overrides {
    dense: HashMap<String, Tensor>,
    low_rank: HashMap<String, LowRank>,
    row_scaled: HashMap<String, RowScaled>,
}

impl Overrides {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn is_empty(&self) -> bool {
        self.dense.is_empty() && self.low_rank.is_empty() && self.row_scaled.is_empty()
    }

    /// Every overridden name, of any kind.
    pub fn names(&self) -> impl Iterator<Item = &String> {
        self.dense.keys().chain(self.low_rank.keys()).chain(self.row_scaled.keys())
    }

    /// The replaced weights (not the low-rank ones).
    pub fn dense(&self) -> &HashMap<String, Tensor> {
        &self.dense
    }

    pub fn insert(&mut self, name: String, value: Tensor) {
        self.low_rank.remove(&name);
        self.row_scaled.remove(&name);
        self.dense.insert(name, value);
    }

    pub fn insert_low_rank(&mut self, name: String, value: LowRank) {
        self.dense.remove(&name);
        self.row_scaled.remove(&name);
        self.low_rank.insert(name, value);
    }

    pub fn insert_row_scaled(&mut self, name: String, value: RowScaled) {
        self.dense.remove(&name);
        self.low_rank.remove(&name);
        self.row_scaled.insert(name, value);
    }

    pub fn get(&self, name: &str) -> Option<&Tensor> {
        self.dense.get(name)
    }

    pub fn low_rank(&self, name: &str) -> Option<&LowRank> {
        self.low_rank.get(name)
    }

    pub fn row_scaled(&self, name: &str) -> Option<&RowScaled> {
        self.row_scaled.get(name)
    }

    /// The same overrides with every tensor passed through `f` (a move to another device).
    pub fn map(&self, f: impl Fn(&Tensor) -> Tensor) -> Overrides {
        Overrides {
            dense: self.dense.iter().map(|(n, t)| (n.clone(), f(t))).collect(),
            low_rank: self.low_rank.iter().map(|(n, l)| (n.clone(), LowRank { a: f(&l.a), b: f(&l.b) })).collect(),
            row_scaled: self.row_scaled.iter().map(|(n, r)| (n.clone(), RowScaled { delta: f(&r.delta), scales: f(&r.scales) })).collect(),
        }
    }
}

impl FromIterator<(String, Tensor)> for Overrides {
    fn from_iter<I: IntoIterator<Item = (String, Tensor)>>(iter: I) -> Self {
        Overrides { dense: iter.into_iter().collect(), ..Overrides::default() }
    }
}

/// Carries tensors across a layer split's boundary (the device layer's mover, which
/// counts what it carries). Autograd records the copies, so gradients flow back.
pub trait Crossing: Send + Sync + std::fmt::Debug {
    /// Main device -> sub-device.
    fn to_sub(&self, t: &Tensor) -> Tensor;
    /// Sub-device -> main device.
    fn to_main(&self, t: &Tensor) -> Tensor;
    /// Main device -> sub-device for a forward's hidden states entering the boundary
    /// block, `[B, T, D]` (the mover counts these apart, see `MoverStats::boundary_bytes`).
    fn boundary_to_sub(&self, t: &Tensor) -> Tensor {
        self.to_sub(t)
    }
}

/// The layer split of a [`ParamStore`] (`--placement balanced`): the embedding and blocks
/// `[0, at)` on the main device, blocks `[at, L)`, the final norm and the head on the
/// sub-device. A forward crosses once, before block `at` ([`ParamView::crossing_at`]);
/// [`super::Model::forward`] brings the logits back.
#[derive(Debug)]
pub struct LayerSplit {
    /// The first block on the sub-device.
    pub at: usize,
    pub sub: Device,
    pub cross: Arc<dyn Crossing>,
    /// The head's copy of a tied embedding on the sub-device (the embedding itself stays on
    /// main for the forward's first step), by the head weight's name.
    pub tied_head: Option<(String, Tensor)>,
    /// A chain of devices (`--sub-device a,b,c`): the crossings below `at`, each with the
    /// first block on its device, increasing ([`ParamStore::add_hop`]). Empty for two devices.
    pub hops: Vec<(usize, Arc<dyn Crossing>)>,
}

/// The frozen weights of one model, by Hugging Face parameter name: on one device, or
/// divided between two by a [`LayerSplit`].
#[derive(Debug)]
pub struct ParamStore {
    tensors: HashMap<String, Tensor>,
    /// The device of the tensors, the main device under a layer split.
    device: Device,
    kind: Kind,
    split: Option<LayerSplit>,
}

impl ParamStore {
    pub fn new(tensors: HashMap<String, Tensor>, device: Device, kind: Kind) -> Self {
        Self { tensors, device, kind, split: None }
    }

    /// Divides the store between the devices: the tensors named in `on_sub` are carried to
    /// `split.sub` through `split.cross` (which counts them: the one time frozen weights
    /// cross), and so is `tied_head`'s copy. Refused when already split.
    pub fn split_layers(&mut self, at: usize, sub: Device, on_sub: &[String], tied_head: Option<&str>, cross: Arc<dyn Crossing>) -> Result<()> {
        if self.split.is_some() {
            return Err(Error::input("the weights are already divided between the devices"));
        }
        crate::error::guard(|| {
            let _g = tch::no_grad_guard();
            for name in on_sub {
                let t = self.tensors.get_mut(name).ok_or_else(|| Error::input(format!("unknown parameter {name:?}")))?;
                *t = cross.to_sub(t);
            }
            let tied_head = match tied_head {
                Some(name) => {
                    let t = self.get(name).ok_or_else(|| Error::input(format!("unknown parameter {name:?}")))?;
                    Some((name.to_string(), cross.to_sub(t)))
                }
                None => None,
            };
            self.split = Some(LayerSplit { at, sub, cross: cross.clone(), tied_head, hops: Vec::new() });
            Ok(())
        })
    }

    /// Makes a layer split a chain: the tensors named in `on_hop` (blocks `[at, next)`, on
    /// main until now) go to the crossing's device through `cross`, and a forward crosses
    /// there before block `at`. Hops are added in order, each above the last and below the
    /// split's boundary.
    pub fn add_hop(&mut self, at: usize, on_hop: &[String], cross: Arc<dyn Crossing>) -> Result<()> {
        let split = self.split.as_ref().ok_or_else(|| Error::Internal("a chain's crossing needs a layer split".into()))?;
        if at >= split.at || split.hops.last().is_some_and(|(a, _)| *a >= at) {
            return Err(Error::Internal(format!("a chain's crossing at block {at} is out of order (the split's boundary is {})", split.at)));
        }
        crate::error::guard(|| {
            let _g = tch::no_grad_guard();
            for name in on_hop {
                let t = self.tensors.get_mut(name).ok_or_else(|| Error::input(format!("unknown parameter {name:?}")))?;
                *t = cross.to_sub(t);
            }
            Ok(())
        })?;
        if let Some(s) = self.split.as_mut() {
            s.hops.push((at, cross));
        }
        Ok(())
    }

    /// The layer split, if the weights are divided between two devices.
    pub fn layer_split(&self) -> Option<&LayerSplit> {
        self.split.as_ref()
    }

    pub fn device(&self) -> Device {
        self.device
    }

    pub fn kind(&self) -> Kind {
        self.kind
    }

    pub fn get(&self, name: &str) -> Option<&Tensor> {
        self.tensors.get(name)
    }

    pub fn names(&self) -> impl Iterator<Item = &String> {
        self.tensors.keys()
    }

    pub fn iter(&self) -> impl Iterator<Item = (&String, &Tensor)> {
        self.tensors.iter()
    }

    /// Total bytes held by the store's tensors.
    pub fn nbytes(&self) -> u64 {
        self.tensors.values().map(|t| (t.numel() * t.kind().elt_size_in_bytes()) as u64).sum()
    }

    /// A copy of every tensor on `device` (the sub-device's read-only replica).
    pub fn replicate(&self, device: Device) -> Result<ParamStore> {
        crate::error::guard(|| {
            let tensors = self
                .tensors
                .iter()
                .map(|(n, t)| (n.clone(), t.to_device(device)))
                .collect();
            Ok(ParamStore { tensors, device, kind: self.kind, split: None })
        })
    }

    /// New handles to the same tensors (no copy), for another thread to own.
    pub fn shallow_clone(&self) -> ParamStore {
        let tensors = self.tensors.iter().map(|(n, t)| (n.clone(), t.shallow_clone())).collect();
        let split = self.split.as_ref().map(|s| LayerSplit {
            at: s.at,
            sub: s.sub,
            cross: s.cross.clone(),
            tied_head: s.tied_head.as_ref().map(|(n, t)| (n.clone(), t.shallow_clone())),
            hops: s.hops.clone(),
        });
        ParamStore { tensors, device: self.device, kind: self.kind, split }
    }

    /// The weight every override of `overrides` stands for, as full tensors: dense ones as
    /// they are, low-rank ones added to this store's weight (`layout` gives each weight's
    /// orientation).
    pub fn materialise(
        &self,
        overrides: &Overrides,
        layout: impl Fn(&str) -> Option<super::WeightLayout>,
    ) -> Result<Vec<(String, Tensor)>> {
        if let Some(name) = overrides.row_scaled.keys().next() {
            return Err(Error::Internal(format!("{name:?} has a change scaled per batch row, which stands for no single weight")));
        }
        let mut out: Vec<(String, Tensor)> = overrides.dense.iter().map(|(n, t)| (n.clone(), t.shallow_clone())).collect();
        for (name, l) in &overrides.low_rank {
            let w = self.get(name).ok_or_else(|| Error::input(format!("unknown parameter {name:?}")))?;
            let layout = layout(name).ok_or_else(|| Error::input(format!("{name:?} is not a linear layer's weight")))?;
            out.push((name.clone(), crate::error::guard(|| Ok(l.added_to(w, layout)))?));
        }
        Ok(out)
    }

    /// Replaces one tensor in place (used when an edit is committed to the weights).
    pub fn set(&mut self, name: &str, value: Tensor) -> Result<()> {
        let slot = self
            .tensors
            .get_mut(name)
            .ok_or_else(|| Error::input(format!("unknown parameter {name:?}")))?;
        if slot.size() != value.size() {
            return Err(Error::input(format!(
                "parameter {name:?}: new value has shape {:?}, expected {:?}",
                value.size(),
                slot.size()
            )));
        }
        // Where the tensor lives (the main or, under a layer split, the sub-device).
        *slot = value.to_device(slot.device()).to_kind(self.kind).detach();
        Ok(())
    }
}

/// What a forward pass reads its weights from: the store, with some names overridden.
#[derive(Clone, Copy)]
pub struct ParamView<'a> {
    store: &'a ParamStore,
    overrides: Option<&'a Overrides>,
}

impl<'a> ParamView<'a> {
    pub fn new(store: &'a ParamStore, overrides: Option<&'a Overrides>) -> Self {
        Self { store, overrides }
    }

    pub fn frozen(store: &'a ParamStore) -> Self {
        Self { store, overrides: None }
    }

    pub fn device(&self) -> Device {
        self.store.device
    }

    /// The tensor for `name`: the override if there is one, else the frozen weight.
    ///
    /// Names are checked against the architecture when the model is loaded, so a miss
    /// here is a programming error, reported as an error rather than a panic anyway.
    pub fn get(&self, name: &str) -> Result<&'a Tensor> {
        if let Some(t) = self.overrides.and_then(|o| o.get(name)) {
            return Ok(t);
        }
        self.store
            .get(name)
            .ok_or_else(|| Error::Internal(format!("parameter {name:?} is not loaded")))
    }

    /// The weight the head reads under `name`: under a layer split with a tied embedding,
    /// its copy on the sub-device; otherwise [`ParamView::get`].
    pub fn get_for_head(&self, name: &str) -> Result<&'a Tensor> {
        match self.store.split.as_ref().and_then(|s| s.tied_head.as_ref()) {
            Some((n, t)) if n == name => Ok(t),
            _ => self.get(name),
        }
    }

    /// The layer split's crossing when block `i` is the first on the sub-device, or on
    /// one of a chain's devices.
    pub fn crossing_at(&self, i: usize) -> Option<&'a dyn Crossing> {
        let s = self.store.split.as_ref()?;
        if s.at == i {
            return Some(s.cross.as_ref());
        }
        s.hops.iter().find(|(at, _)| *at == i).map(|(_, c)| c.as_ref())
    }

    /// The layer split of the store, if any.
    pub fn layer_split(&self) -> Option<&'a LayerSplit> {
        self.store.split.as_ref()
    }

    /// The low-rank change to `name`, if it has one (its frozen weight is what
    /// [`ParamView::get`] returns).
    pub fn low_rank(&self, name: &str) -> Option<&'a LowRank> {
        self.overrides.and_then(|o| o.low_rank(name))
    }

    /// The per-row scaled change to `name`, if it has one (its frozen weight is what
    /// [`ParamView::get`] returns).
    pub fn row_scaled(&self, name: &str) -> Option<&'a RowScaled> {
        self.overrides.and_then(|o| o.row_scaled(name))
    }
}

/// A dotted module path in the parameter names (`model.layers.3`), as candle's
/// `VarBuilder::pp` and tch's `nn::Path / "key"` build them: a family names each tensor
/// relative to its module, once, and both its list of expected tensors and its forward
/// (through a [`Scope`]) go through the same prefix.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Prefix(String);

impl Prefix {
    pub fn new(path: impl Into<String>) -> Self {
        Prefix(path.into())
    }

    /// The sub-module `key` (`self.key`).
    pub fn pp(&self, key: impl std::fmt::Display) -> Prefix {
        if self.0.is_empty() {
            Prefix(key.to_string())
        } else {
            Prefix(format!("{}.{key}", self.0))
        }
    }

    /// The full name of this module's tensor `key` (`self.key`).
    pub fn name(&self, key: &str) -> String {
        self.pp(key).0
    }
}

/// A [`ParamView`] seen from a module: tensors by their name relative to its [`Prefix`].
/// The full name is what overrides (edited weights) and captures are keyed by.
#[derive(Clone)]
pub struct Scope<'v, 'a> {
    view: &'v ParamView<'a>,
    at: Prefix,
}

impl<'a> ParamView<'a> {
    /// This view from the module at `prefix`.
    pub fn pp(&self, prefix: &Prefix) -> Scope<'_, 'a> {
        Scope { view: self, at: prefix.clone() }
    }
}

impl<'v, 'a> Scope<'v, 'a> {
    /// The sub-module `key`.
    pub fn pp(&self, key: impl std::fmt::Display) -> Scope<'v, 'a> {
        Scope { view: self.view, at: self.at.pp(key) }
    }

    /// The module's tensor `key` ([`ParamView::get`] of its full name).
    pub fn get(&self, key: &str) -> Result<&'a Tensor> {
        self.view.get(&self.at.name(key))
    }

    /// The full name of the module's tensor `key`.
    pub fn name(&self, key: &str) -> String {
        self.at.name(key)
    }

    /// The view itself (low-rank changes, the layer split).
    pub fn view(&self) -> &'v ParamView<'a> {
        self.view
    }
}
