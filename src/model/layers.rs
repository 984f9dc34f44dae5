//! The layers families are made of, each naming its tensors once.
//!
//! A family declares a block as a few layers whose names are relative to the block
//! (`attn.c_attn`, `input_layernorm`). The list of tensors the loader expects
//! ([`Layer::declare`] under the block's [`Prefix`]) and the forward (each layer reading
//! through a [`Scope`], the parameter view seen from the block) come from that one
//! declaration, so a tensor's name is written once; overrides and captures still go by
//! the full name (`transformer.h.3.mlp.c_fc.weight`).
use std::collections::{BTreeMap, HashSet};

use tch::{Kind, Tensor};

use super::params::{Prefix, Scope};
use super::{Capture, WeightLayout};
use crate::Result;

/// Tensors being listed: full name and shape, in declaration order (the order
/// [`super::random_params`] draws them in).
pub type ParamList = Vec<(String, Vec<i64>)>;

/// A piece of a model that reads tensors: it lists them, with their shapes, under the
/// module prefix `at`.
pub trait Layer {
    fn declare(&self, at: &Prefix, out: &mut ParamList);
}

/// One tensor read as it is (an embedding), by its name under the module.
#[derive(Debug, Clone)]
pub struct Param {
    pub name: &'static str,
    pub shape: Vec<i64>,
}

impl Layer for Param {
    fn declare(&self, at: &Prefix, out: &mut ParamList) {
        out.push((at.name(self.name), self.shape.clone()));
    }
}

/// A linear layer: `<name>.weight` in `layout`'s orientation and, with `bias`,
/// `<name>.bias` `[d_out]`.
#[derive(Debug, Clone, Copy)]
pub struct Linear {
    /// Name under the module, without `.weight` (`mlp.up_proj`): also the name the
    /// planner's [`super::family::MatmulSaves`] knows the matrix by.
    pub name: &'static str,
    pub d_in: i64,
    pub d_out: i64,
    pub bias: bool,
    pub layout: WeightLayout,
}

impl Linear {
    /// `torch.nn.Linear`: weight `[d_out, d_in]`.
    pub fn linear(name: &'static str, d_in: i64, d_out: i64, bias: bool) -> Self {
        Linear { name, d_in, d_out, bias, layout: WeightLayout::Linear }
    }

    /// GPT-2's `Conv1D`: weight `[d_in, d_out]`, with a bias.
    pub fn conv1d(name: &'static str, d_in: i64, d_out: i64) -> Self {
        Linear { name, d_in, d_out, bias: true, layout: WeightLayout::Conv1d }
    }

    /// The layer in a block's forward, `x` `[.., d_in]` -> `[.., d_out]`: the weight
    /// through the view (the edited one when overridden) plus its low-rank or per-row
    /// scaled change when it has one; records `(x, h)` under the weight's full name when `capture` names it
    /// (MEND reads its gradient factors from those two tensors).
    pub fn forward(&self, s: &Scope, capture: &HashSet<String>, captures: &mut BTreeMap<String, Capture>, x: &Tensor) -> Result<Tensor> {
        let m = s.pp(self.name);
        let w_name = m.name("weight");
        let w = s.view().get(&w_name)?;
        let b = if self.bias { Some(m.get("bias")?) } else { None };
        let mut h = self.layout.apply(x, w, b);
        if let Some(delta) = s.view().low_rank(&w_name) {
            h = h + delta.apply(x);
        }
        if let Some(delta) = s.view().row_scaled(&w_name) {
            h = h + delta.apply(x, self.layout)?;
        }
        if capture.contains(&w_name) {
            captures.insert(w_name, Capture { x: x.shallow_clone(), h: h.shallow_clone(), rows: None });
        }
        Ok(h)
    }

    /// The full name of this layer's weight under `s` (what captures are keyed by).
    pub fn weight_name(&self, s: &Scope) -> String {
        s.pp(self.name).name("weight")
    }

    /// `x·Wᵀ + b` as one libtorch `linear`, without edits or captures (the frozen vision
    /// tower; `Linear` layout only).
    pub fn forward_frozen(&self, s: &Scope, x: &Tensor) -> Result<Tensor> {
        let m = s.pp(self.name);
        let b = if self.bias { Some(m.get("bias")?) } else { None };
        Ok(x.linear(m.get("weight")?, b))
    }
}

impl Layer for Linear {
    fn declare(&self, at: &Prefix, out: &mut ParamList) {
        let m = at.pp(self.name);
        let shape = match self.layout {
            WeightLayout::Linear => vec![self.d_out, self.d_in],
            WeightLayout::Conv1d => vec![self.d_in, self.d_out],
        };
        out.push((m.name("weight"), shape));
        if self.bias {
            out.push((m.name("bias"), vec![self.d_out]));
        }
    }
}

/// Which normalisation a [`Norm`] applies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NormKind {
    /// LayerNorm: `<name>.weight` and `<name>.bias`.
    Layer,
    /// RMSNorm computed in f32 and cast back, as transformers does: `<name>.weight`.
    Rms,
}

/// A norm over the last dimension `d`.
#[derive(Debug, Clone, Copy)]
pub struct Norm {
    pub name: &'static str,
    pub d: i64,
    pub kind: NormKind,
    pub eps: f64,
}

impl Norm {
    pub fn layer(name: &'static str, d: i64, eps: f64) -> Self {
        Norm { name, d, kind: NormKind::Layer, eps }
    }

    pub fn rms(name: &'static str, d: i64, eps: f64) -> Self {
        Norm { name, d, kind: NormKind::Rms, eps }
    }

    /// `x` `[.., d]` normalised.
    pub fn forward(&self, s: &Scope, x: &Tensor) -> Result<Tensor> {
        let m = s.pp(self.name);
        let w = m.get("weight")?;
        Ok(match self.kind {
            NormKind::Layer => x.layer_norm([self.d], Some(w), Some(m.get("bias")?), self.eps, false),
            NormKind::Rms => {
                let xf = x.to_kind(Kind::Float);
                let var = xf.pow_tensor_scalar(2).mean_dim(-1, true, Kind::Float);
                w * (xf * (var + self.eps).rsqrt()).to_kind(x.kind())
            }
        })
    }
}

impl Layer for Norm {
    fn declare(&self, at: &Prefix, out: &mut ParamList) {
        let m = at.pp(self.name);
        out.push((m.name("weight"), vec![self.d]));
        if self.kind == NormKind::Layer {
            out.push((m.name("bias"), vec![self.d]));
        }
    }
}

/// Every tensor of `layers` under `at`, in order.
pub fn declare_all(layers: &[&dyn Layer], at: &Prefix, out: &mut ParamList) {
    for l in layers {
        l.declare(at, out);
    }
}
