//! Adam (as `torch.optim.Adam` with default betas) and global-norm gradient clipping.
//!
//! Written out rather than taken from `tch::nn::Optimizer` because resuming a run must
//! restore the moment estimates, and tch's optimiser cannot export them.
use std::collections::BTreeMap;

use tch::{Device, Tensor};

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
    /// Where the moments live and the update is computed when offloaded
    /// (`--optimizer-device`); `None`: beside the parameters.
    offload: Option<Device>,
    /// Bytes carried by the offloaded step (gradients out, updates back), over the run.
    moved_bytes: u64,
}

impl Adam {
    /// Moments beside the parameters.
    pub fn new(groups: Vec<(f64, Vec<Tensor>)>) -> Self {
        Self::build(groups, None)
    }

    /// Moments on `device`, as ZeRO-Offload's optimiser offload: each step copies every
    /// gradient there once (after clipping, which reads them where they are), updates the
    /// moments and computes the update there, and adds the update to the parameter where
    /// it is. Offloaded even when `device` is the parameters' device, so CPU tests run
    /// this path; the arithmetic is the same as [`Adam::new`]'s.
    pub fn offloaded(groups: Vec<(f64, Vec<Tensor>)>, device: Device) -> Self {
        Self::build(groups, Some(device))
    }

    fn build(groups: Vec<(f64, Vec<Tensor>)>, offload: Option<Device>) -> Self {
        let groups = groups
            .into_iter()
            .map(|(lr, params)| {
                let zeros = || params.iter().map(|p| p.zeros_like().to_device(offload.unwrap_or(p.device()))).collect();
                Group { lr, m: zeros(), v: zeros(), params }
            })
            .collect();
        Self { groups, step: 0, offload, moved_bytes: 0 }
    }

    /// Bytes the offloaded optimiser carried between the parameters' device and its own
    /// (0 without offload): per step, every defined gradient out and its update back.
    pub fn moved_bytes(&self) -> u64 {
        self.moved_bytes
    }

    /// Where the moments live.
    pub fn state_device(&self) -> Option<Device> {
        self.offload
    }

    fn grads(&self) -> impl Iterator<Item = Tensor> + '_ {
        self.groups.iter().flat_map(|g| g.params.iter().map(|p| p.grad()))
    }

    /// Global L2 norm of all defined gradients.
    pub fn grad_norm(&self) -> f64 {
        let _g = tch::no_grad_guard();
        self.grads()
            .filter(|g| g.defined())
            .map(|g| g.norm().double_value(&[]).powi(2))
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
                let g = match self.offload {
                    Some(dev) => {
                        self.moved_bytes += 2 * (g.numel() * g.kind().elt_size_in_bytes()) as u64;
                        // A copy even on the same device: the offloaded path as a whole.
                        g.to_device_(dev, g.kind(), false, true)
                    }
                    None => g,
                };
                // In place, with one temporary: the editor's tensors are tens of MB each,
                // and every temporary is an allocation, page faults and a pass over memory.
                //   m ← m + (1-β1)(g - m);  v ← β2·v + (1-β2)·g²;
                //   p ← p + m / (-(c1/lr)·(√v/√c2 + ε))  =  p - lr/c1 · m / (√v/√c2 + ε)
                let _ = m.f_lerp_(&g, 1.0 - BETA1);
                let mut tmp = &g * (1.0 - BETA2);
                *v *= BETA2;
                let _ = v.f_addcmul_(&tmp, &g);
                let _ = tmp.f_copy_(v);
                let _ = tmp.f_sqrt_();
                tmp *= 1.0 / c2.sqrt();
                tmp += EPS;
                tmp *= -c1 / group.lr;
                match self.offload {
                    None => {
                        let _ = p.f_addcdiv_(m, &tmp);
                    }
                    Some(_) => {
                        // The update m / tmp where the moments are, added where p is.
                        let update = &*m / &tmp;
                        drop(tmp);
                        let _ = p.f_add_(&update.to_device_(p.device(), update.kind(), false, true));
                    }
                }
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

#[cfg(test)]
mod tests {
    use super::*;
    use tch::Kind;

    /// The in-place update equals Adam written out as in `torch.optim.Adam`'s docs.
    #[test]
    fn in_place_step_matches_the_textbook_update() {
        tch::manual_seed(0);
        let p0 = Tensor::randn([5, 7], (Kind::Float, tch::Device::Cpu));
        let p = p0.copy().set_requires_grad(true);
        let mut adam = Adam::new(vec![(0.01, vec![p.shallow_clone()])]);
        let (mut rp, mut rm, mut rv) = (p0.copy(), p0.zeros_like(), p0.zeros_like());
        for t in 1..=4 {
            let g = Tensor::randn([5, 7], (Kind::Float, tch::Device::Cpu)) * t as f64;
            let mut pg = p.grad();
            if pg.defined() {
                let _ = pg.f_copy_(&g);
            } else {
                (&p * &g).sum(Kind::Float).backward();
            }
            adam.step();
            rm = &rm * BETA1 + &g * (1.0 - BETA1);
            rv = &rv * BETA2 + g.square() * (1.0 - BETA2);
            let (c1, c2) = (1.0 - BETA1.powi(t), 1.0 - BETA2.powi(t));
            rp = rp - (&rm / c1) / ((&rv / c2).sqrt() + EPS) * 0.01;
            let err = (&p.detach() - &rp).abs().max().double_value(&[]);
            assert!(err < 1e-6, "step {t}: max difference {err}");
        }
    }

    /// The offloaded step gives the same parameters as the in-place one and counts a
    /// gradient out and an update back per tensor and step.
    #[test]
    fn offloaded_step_matches_and_counts_its_crossings() {
        tch::manual_seed(1);
        let p0 = Tensor::randn([6, 3], (Kind::Float, tch::Device::Cpu));
        let (a, b) = (p0.copy().set_requires_grad(true), p0.copy().set_requires_grad(true));
        let mut here = Adam::new(vec![(0.01, vec![a.shallow_clone()])]);
        let mut away = Adam::offloaded(vec![(0.01, vec![b.shallow_clone()])], tch::Device::Cpu);
        for t in 1..=5 {
            let g = Tensor::randn([6, 3], (Kind::Float, tch::Device::Cpu)) * t as f64;
            for (p, adam) in [(&a, &mut here), (&b, &mut away)] {
                adam.zero_grad();
                (p * &g).sum(Kind::Float).backward();
                adam.step();
            }
            let diff = (&a.detach() - &b.detach()).abs().max().double_value(&[]);
            assert!(diff <= 1e-6, "step {t}: {diff}");
        }
        assert_eq!(here.moved_bytes(), 0);
        assert_eq!(away.moved_bytes(), 5 * 2 * 18 * 4);
        // The moments were updated where they live, and round-trip a checkpoint.
        assert!(away.state().iter().all(|(_, t)| t.abs().sum(Kind::Float).double_value(&[]) > 0.0));
    }

    #[test]
    fn clipping_scales_to_the_max_norm() {
        let p = Tensor::ones([4], (Kind::Float, tch::Device::Cpu)).set_requires_grad(true);
        (&p * 3.0).sum(Kind::Float).backward(); // grad = 3 everywhere, norm 6
        let mut adam = Adam::new(vec![(0.1, vec![p.shallow_clone()])]);
        assert!((adam.clip(2.0) - 6.0).abs() < 1e-6);
        assert!((adam.grad_norm() - 2.0).abs() < 1e-5);
    }
}
