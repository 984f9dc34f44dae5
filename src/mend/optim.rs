//! Adam (as `torch.optim.Adam` with default betas) and global-norm gradient clipping.
//!
//! Written out rather than taken from `tch::nn::Optimizer` because resuming a run must
//! restore the moment estimates, and tch's optimiser cannot export them.
use std::collections::BTreeMap;

use tch::{Kind, Tensor};

use crate::{Error, Result};

const BETA1: f64 = 0.9;
const BETA2: f64 = 0.999;
const EPS: f64 = 1e-8;

/// One parameter group: tensors sharing a learning rate.
#[derive(Debug)]
pub struct Group {
    pub lr: f64,
    pub params: Vec<Tensor>,
    m: Vec<Tensor>,
    v: Vec<Tensor>,
}

#[derive(Debug)]
pub struct Adam {
    pub groups: Vec<Group>,
    pub step: i64,
}

impl Adam {
    pub fn new(groups: Vec<(f64, Vec<Tensor>)>) -> Self {
        let groups = groups
            .into_iter()
            .map(|(lr, params)| {
                let zeros = || params.iter().map(|p| p.zeros_like()).collect();
                Group { lr, m: zeros(), v: zeros(), params }
            })
            .collect();
        Self { groups, step: 0 }
    }

    fn grads(&self) -> impl Iterator<Item = Tensor> + '_ {
        self.groups.iter().flat_map(|g| g.params.iter().map(|p| p.grad()))
    }

    /// Global L2 norm of all defined gradients.
    pub fn grad_norm(&self) -> f64 {
        let _g = tch::no_grad_guard();
        self.grads()
            .filter(|g| g.defined())
            .map(|g| g.to_kind(Kind::Double).square().sum(Kind::Double).double_value(&[]))
            .sum::<f64>()
            .sqrt()
    }

    /// Scales gradients so their global norm is at most `max_norm`; returns the norm before.
    pub fn clip(&mut self, max_norm: f64) -> f64 {
        let norm = self.grad_norm();
        if norm.is_finite() && norm > max_norm && max_norm > 0.0 {
            let _g = tch::no_grad_guard();
            for mut g in self.grads().filter(|g| g.defined()) {
                let _ = g.f_mul_(&Tensor::from(max_norm / (norm + 1e-6)));
            }
        }
        norm
    }

    pub fn zero_grad(&mut self) {
        for g in self.groups.iter_mut() {
            for p in g.params.iter_mut() {
                p.zero_grad();
            }
        }
    }

    /// One Adam update with the current gradients.
    pub fn step(&mut self) {
        let _g = tch::no_grad_guard();
        self.step += 1;
        let t = self.step as f64;
        let (c1, c2) = (1.0 - BETA1.powf(t), 1.0 - BETA2.powf(t));
        for group in self.groups.iter_mut() {
            for ((p, m), v) in group.params.iter_mut().zip(group.m.iter_mut()).zip(group.v.iter_mut()) {
                let g = p.grad();
                if !g.defined() {
                    continue;
                }
                // In place where possible: the editor's tensors are tens of MB each, and
                // every temporary is an allocation, a page-fault storm and a pass over memory.
                *m *= BETA1;
                *m += &g * (1.0 - BETA1);
                *v *= BETA2;
                *v += g.square() * (1.0 - BETA2);
                let mut denom = &*v / c2;
                let _ = denom.sqrt_();
                denom += EPS;
                let mut update = &*m / denom;
                update *= group.lr / c1;
                let _ = p.f_sub_(&update);
            }
        }
    }

    /// Moment estimates by name (`adam.{group}.{index}.m|v`) for a checkpoint.
    pub fn state(&self) -> Vec<(String, Tensor)> {
        let mut out = Vec::new();
        for (gi, g) in self.groups.iter().enumerate() {
            for (i, (m, v)) in g.m.iter().zip(&g.v).enumerate() {
                out.push((format!("adam.{gi}.{i}.m"), m.shallow_clone()));
                out.push((format!("adam.{gi}.{i}.v"), v.shallow_clone()));
            }
        }
        out
    }

    pub fn load_state(&mut self, tensors: &BTreeMap<String, Tensor>, step: i64) -> Result<()> {
        for (gi, g) in self.groups.iter_mut().enumerate() {
            for (i, (m, v)) in g.m.iter_mut().zip(g.v.iter_mut()).enumerate() {
                for (which, slot) in [("m", m), ("v", v)] {
                    let name = format!("adam.{gi}.{i}.{which}");
                    let t = tensors.get(&name).ok_or_else(|| Error::input(format!("training state lacks {name:?}")))?;
                    if t.size() != slot.size() {
                        return Err(Error::input(format!("training state tensor {name:?} has the wrong shape")));
                    }
                    *slot = t.to_device(slot.device()).to_kind(slot.kind());
                }
            }
        }
        self.step = step;
        Ok(())
    }
}
