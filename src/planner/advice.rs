//! Fit advice for the out-of-memory diagnosis (`device::oom::FitAdvisor`).
use std::path::Path;

use tch::Kind;

use crate::config::MendConfig;
use crate::device::memory::format_bytes;
use crate::device::{DevicePlan, MaxMemory, OptimizerDevice, Placement};
use crate::model::loader::read_config;
use crate::model::Model;
use crate::{Error, Result};

use super::placement::choose;
use super::types::{MemoryPlan, Phase, PlanOptions};


/// The out-of-memory diagnosis's question to the planner (`device::oom::FitAdvisor`): of
/// the placements of the run's devices ([`choose`], in [`plan_all`]'s order), the first
/// whose every device's training peak fits its capacity. A single-device run is also
/// planned with each possible sub-device (`--sub-device`), the CPU last.
#[derive(Debug)]
pub struct FitAdvice {
    pub(super) model: Model,
    pub(super) config: MendConfig,
    /// The run's devices, dtype, tokens and capacities (`caps`).
    pub(super) opts: PlanOptions,
    /// Sub-devices to propose when the run has none.
    pub(super) subs: Vec<String>,
    /// The run's own placement and optimiser device, to say when the planner's choice is it.
    pub(super) current: (Placement, OptimizerDevice),
}

impl FitAdvice {
    /// Advice for a run placed as `plan`, on the model in `dir` (its `config.json`), with
    /// `tokens` per example, against `caps` (`--max-memory`); a CUDA device without a cap
    /// is planned against its size. Sub-devices proposed to a single-device run: every
    /// other CUDA device here, then the CPU.
    pub fn for_run(dir: &Path, config: &MendConfig, plan: &DevicePlan, dtype: Kind, tokens: i64, caps: &MaxMemory) -> Result<Self> {
        let (model, _) = read_config(dir)?;
        let name = |d: tch::Device| crate::device::memory::device_name(d);
        let mut opts = PlanOptions::new(&name(plan.main), Some(&name(plan.sub)), dtype, tokens, None)?.with_run_caps(caps.clone());
        opts.split = plan.split;
        // Devices without a cap are planned against the card (keeping the reserve).
        for d in [plan.main, plan.sub] {
            if let (tch::Device::Cuda(_), None) = (d, opts.caps.get(&name(d))) {
                if let Ok(total) = crate::device::memory::total_bytes(d) {
                    opts.caps.0.insert(name(d), total);
                }
            }
        }
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
    pub(super) fn flags(&self, p: &MemoryPlan, add_sub: bool) -> String {
        let sh = &p.shape;
        let mut out = Vec::new();
        if add_sub {
            out.push(format!("`sub_device`={}", sh.sub));
        }
        if sh.split {
            out.push(format!("`placement`={}", sh.placement.name()));
        }
        let opt = if sh.optimizer_device == sh.main {
            None
        } else if sh.optimizer_device == sh.sub {
            Some("sub")
        } else {
            Some("cpu")
        };
        if let Some(o) = opt {
            out.push(format!("`optimizer_device`={o}"));
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
            return Err(format!("no capacity is known for {} (give `max_memory` to plan against one)", self.opts.main));
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
