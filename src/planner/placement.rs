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
use crate::model::vision::ImageProcessorConfig;
use crate::model::Model;
use crate::{Error, Result};

use super::render::views_text;
use super::sizes::{sizes, split_weights};
use super::types::{MemoryPlan, Phase, PlanOptions, ViewShape};


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

/// Builds the plan for an architecture (no weights needed). A layer split without a
/// boundary gets the balancing one ([`balanced_boundary`]).
pub fn plan_model(model: &Model, cfg: &MendConfig, o: &PlanOptions) -> Result<MemoryPlan> {
    if o.placement == Placement::Balanced && (o.boundary.is_none() || o.chain_at.len() != o.chain.len()) {
        let (chain_at, k) = balanced_chain(model, cfg, o)?;
        return plan_model(model, cfg, &PlanOptions { boundary: Some(k), chain_at, ..o.clone() });
    }
    super::plan::plan_fixed(model, cfg, o)
}

/// The layer split's boundary `k` (blocks `[k, L)` on the sub-device) that balances the two
/// devices: it minimises the larger of the main and sub peaks in `o.balance_for`, each
/// divided by its capacity when both have one ([`PlanOptions::balance_load`]: a
/// `--max-memory` cap, or the host's memory for a CPU device), else in bytes. `k` runs from 0 (only the embedding
/// on main) to the first edited block (everything that needs gradients on sub); the
/// smallest `k` wins ties.
pub fn balanced_boundary(model: &Model, cfg: &MendConfig, o: &PlanOptions) -> Result<i64> {
    let at = |k: i64| plan_model(model, cfg, &PlanOptions { placement: Placement::Balanced, boundary: Some(k), ..o.clone() });
    let first = at(0)?.shape.first_edited_layer;
    let mut best: Option<(f64, i64)> = None;
    for k in 0..=first {
        let p = at(k)?;
        let load = |dev: &str| o.balance_load(dev, p.peak(dev, o.balance_for));
        let worst = load(&o.main).max(load(&o.sub));
        if best.is_none_or(|(b, _)| worst < b) {
            best = Some((worst, k));
        }
    }
    best.map(|(_, k)| k).ok_or_else(|| Error::input("no layer split to choose from"))
}

/// The layer split's boundaries over a chain (`o.chain` between main and `o.sub`):
/// `(chain_at, k)`, main holding blocks below `chain_at[0]`, the chain's device `j` blocks
/// `[chain_at[j], chain_at[j + 1])`, the last device blocks from `k` (≤ the first edited
/// block) with the head and every edited block. They minimise the largest device's peak in
/// `o.balance_for` (each divided by its capacity when every device has one,
/// [`PlanOptions::balance_load`]); the smallest
/// boundaries win ties. Without a chain, [`balanced_boundary`].
///
/// Main's peak depends only on `chain_at[0]` and the last device's only on `k` (the
/// two-device plans give both); a device between holds its blocks' weights and, while the
/// prefix runs, the activations it receives, one block's working set and its output. So
/// the search is a min-max partition of blocks `[chain_at[0], k)` over the devices between,
/// by dynamic programming: `O(N·L²)` sums and `L` plans.
pub fn balanced_chain(model: &Model, cfg: &MendConfig, o: &PlanOptions) -> Result<(Vec<i64>, i64)> {
    if o.chain.is_empty() {
        return Ok((Vec::new(), balanced_boundary(model, cfg, o)?));
    }
    let two = PlanOptions { placement: Placement::Balanced, chain: Vec::new(), chain_at: Vec::new(), ..o.clone() };
    let at = |k: i64| plan_model(model, cfg, &PlanOptions { boundary: Some(k), ..two.clone() });
    let p0 = at(0)?;
    let first = p0.shape.first_edited_layer;
    let m = o.chain.len();
    if first < m as i64 {
        return Err(Error::input(format!(
            "`sub_device` {}: a chain of {} sub-devices needs {m} blocks below the first edited block, and it is block {first} \
             (the edited blocks run on the last device): list fewer devices",
            o.sub_list(),
            m + 1
        )));
    }
    let load = |dev: &str, bytes: u64| o.balance_load(dev, bytes);
    let n = first as usize + 1;
    let (mut main_load, mut last_load) = (Vec::with_capacity(n), Vec::with_capacity(n));
    for k in 0..n as i64 {
        let p = if k == 0 { p0.clone() } else { at(k)? };
        main_load.push(load(&o.main, p.peak(&o.main, o.balance_for)));
        last_load.push(load(&o.sub, p.peak(&o.sub, o.balance_for)));
    }
    // A device between: the items `items::capture` and `items::resident` put on it.
    let at0 = PlanOptions { boundary: Some(0), ..two.clone() };
    let z = sizes(model, cfg, &at0)?;
    let (s, d, ws) = (z.s, z.dm.d, z.family.inference_working_set(z.s));
    let transient = z.views.fwd_n.max(z.n) * (2 * d * s + ws);
    let from: Vec<i64> = (0..n as i64).map(|k| split_weights(model, k).1).collect();
    let mid = |a: usize, b: usize| ((from[a] - from[b]) * s + transient).max(0) as u64;
    // f[j][b]: the smallest largest load of main and the first j devices between, device j
    // ending before block b; arg[j][b]: where device j starts.
    let mut f: Vec<Vec<f64>> = vec![main_load];
    let mut arg: Vec<Vec<usize>> = vec![vec![0; n]];
    for j in 1..=m {
        let dev = &o.chain[j - 1];
        let (mut fj, mut aj) = (vec![f64::INFINITY; n], vec![0; n]);
        for b in j..n {
            for a in (j - 1)..b {
                let v = f[j - 1][a].max(load(dev, mid(a, b)));
                if v < fj[b] {
                    (fj[b], aj[b]) = (v, a);
                }
            }
        }
        f.push(fj);
        arg.push(aj);
    }
    let mut best: Option<(f64, usize)> = None;
    for k in m..n {
        let v = f[m][k].max(last_load[k]);
        if best.is_none_or(|(b, _)| v < b) {
            best = Some((v, k));
        }
    }
    let (_, k) = best.ok_or_else(|| Error::input("no layer split to choose from"))?;
    let (mut chain_at, mut b) = (vec![0i64; m], k);
    for j in (1..=m).rev() {
        b = arg[j][b];
        chain_at[j - 1] = b as i64;
    }
    Ok((chain_at, k as i64))
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
            if opt == OptimizerDevice::Cpu && o.devices().iter().any(|d| d == "cpu") {
                continue; // the same as Main or Sub there
            }
            if placement == Placement::Replica && !o.chain.is_empty() {
                continue; // a chain runs the layer split only
            }
            out.push(plan_model(model, cfg, &o.with_placement(placement, opt)?)?);
        }
    }
    Ok(out)
}

/// `--placement auto`: the first plan of [`plan_all`] whose every device's peak in
/// `phase` fits its capacity (a CPU device's is the host's memory without a cap,
/// [`PlanOptions::judged_caps`]; a GPU without a cap always fits). When none fits, the
/// error lists each placement's peaks against the caps.
pub fn choose(model: &Model, cfg: &MendConfig, o: &PlanOptions, phase: Phase) -> Result<MemoryPlan> {
    let o = PlanOptions { balance_for: phase, ..o.clone() };
    let plans = plan_all(model, cfg, &o)?;
    let caps = o.judged_caps();
    let mut lines = Vec::new();
    for p in plans {
        match super::judge::over(&p, &caps, &o.headroom, phase) {
            None => return Ok(p),
            Some(why) => lines.push(format!("  {}: {why}", p.placement_label())),
        }
    }
    Err(Error::OutOfMemory(format!(
        "no placement fits `max_memory` {} (usable: {}):\n{}",
        caps.0.iter().map(|(d, b)| format!("{d}={}", format_bytes(*b))).collect::<Vec<_>>().join(","),
        o.headroom.text(),
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
    /// A chain's devices between main and the last with their first blocks.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub chain: Vec<(String, i64)>,
    /// The (last) sub-device, for labels.
    #[serde(skip)]
    pub sub: String,
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
                    chain: p.shape.chain.clone(),
                    sub: p.shape.sub.clone(),
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
                r.boundary.map_or("-".into(), |k| r.chain.iter().map(|(_, a)| a.to_string()).chain([k.to_string()]).collect::<Vec<_>>().join(",")),
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
        s.push_str(&boundary_label(sh.boundary, &sh.chain, &sh.sub));
        if sh.optimizer_device != sh.main {
            s.push_str(&format!(", optimizer on {}", sh.optimizer_device));
        }
        s
    }
}

/// ` (blocks from 16 on the sub-device)`, or over a chain
/// ` (blocks from 8 on cuda:1, 16 on cuda:2, 24 on cuda:3)`; empty without a boundary.
pub fn boundary_label(boundary: Option<i64>, chain: &[(String, i64)], sub: &str) -> String {
    match boundary {
        None => String::new(),
        Some(k) if chain.is_empty() => format!(" (blocks from {k} on the sub-device)"),
        Some(k) => {
            let parts: Vec<String> = chain.iter().map(|(d, a)| format!("{a} on {d}")).chain([format!("{k} on {sub}")]).collect();
            format!(" (blocks from {})", parts.join(", "))
        }
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
        if !base.chain.is_empty() {
            return Err(Error::input(format!(
                "`sub_device` {}: `placement` replica runs on two devices (main and one sub-device); a chain runs `placement` balanced or auto",
                base.sub_list()
            )));
        }
        return Ok((base, None));
    }
    let (model, _) = read_config(q.model)?;
    let mut o = PlanOptions::new(q.main, q.sub, q.dtype, q.tokens, None)?.with_run_caps(q.caps.cloned().unwrap_or_default());
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
                    "`placement` auto: no placement with `optimizer_device` {:?} fits; the planner's choice puts the optimiser on {opt}",
                    q.optimizer
                )));
            }
            p
        }
    };
    let label = q.request.fixed().is_none().then(|| chosen.placement_label());
    match (chosen.shape.placement, chosen.shape.boundary) {
        (Placement::Balanced, Some(k)) => {
            let chain_at = chosen.shape.chain.iter().map(|(_, a)| *a as usize).collect();
            Ok((base.balanced_chain(chain_at, k as usize)?, label))
        }
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
    let base = DevicePlan::parse(&req.device, req.sub_device.as_deref())?;
    req.apply_caps()?;
    // A chain runs the layer split: without --placement it is balanced.
    let default = if base.chain.is_empty() { PlacementRequest::default() } else { PlacementRequest::Balanced };
    let query = PlacementQuery {
        main: &req.device,
        sub: req.sub_device.as_deref(),
        request: req.placement.unwrap_or(default),
        optimizer: req.optimizer_device,
        caps: req.max_memory.as_ref(),
        model: f.model,
        config: f.config,
        dtype: f.dtype,
        tokens: f.tokens,
        phase: f.phase,
    };
    resolve_placement(base, &query)
}
