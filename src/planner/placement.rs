//! Placement search: the balancing layer-split boundary, every placement of a pair of
//! devices, the first that fits, the placements table, and `--placement` resolved.
use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::Path;

use serde::Serialize;
use tch::Kind;

use crate::config::MendConfig;
use crate::device::memory::format_bytes;
use crate::device::{DevicePlan, DeviceRequest, MaxMemory, OptimizerDevice, Placement, PlacementRequest};
use crate::model::loader::read_config;
use crate::model::Model;
use crate::{Error, Result};

#[allow(unused_imports)]
use super::{items::*, render::*, sizes::*, types::*, *};

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

/// What a run's placement is resolved for: the model's `config.json`, the MEND config, the
/// weights' dtype, tokens per example and the phase whose peaks matter.
#[derive(Debug, Clone, Copy)]
pub struct PlaceFor<'a> {
    pub model: &'a Path,
    pub config: &'a MendConfig,
    pub dtype: Kind,
    pub tokens: i64,
    pub phase: Phase,
}

/// A run's devices as asked ([`DeviceRequest`]) made into its plan: the devices checked,
/// `--max-memory` applied to the allocators, `--placement` resolved against the caps
/// ([`resolve_placement`]). The label says which placement the planner chose, when it chose.
pub fn place(req: &DeviceRequest, f: &PlaceFor) -> Result<(DevicePlan, Option<String>)> {
    let base = DevicePlan::parse(&req.main, req.sub.as_deref())?;
    req.apply_caps()?;
    let query = PlacementQuery {
        main: &req.main,
        sub: req.sub.as_deref(),
        request: req.placement.unwrap_or_default(),
        optimizer: req.optimizer,
        caps: req.caps.as_ref(),
        model: f.model,
        config: f.config,
        dtype: f.dtype,
        tokens: f.tokens,
        phase: f.phase,
    };
    resolve_placement(base, &query)
}
