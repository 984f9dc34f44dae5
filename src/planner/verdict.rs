//! The planner's answers to a user's question about their cards: does the run fit, which
//! placement to take, and the smallest card it fits on.
//!
//! A plan is a peak in bytes; a card of that size is not enough. On an H200 the planner was
//! 4 % to 9 % over the allocator's peak for every model run alone and 6 % over for the 7B
//! split's main device (docs/notebook/gpu.md), the caching allocator fragments,
//! and every CUDA device spends some memory on its context before any tensor. So a
//! placement *fits* a device capped at `cap` when its peak is at most
//! `cap × (1 − margin) − reserve` ([`Headroom`]; the reserve on CUDA devices only, the CPU
//! has no context to keep). `plan`, `plan --fit` and `--placement auto` all use this one
//! rule ([`super::choose`]). In a run, `--max-memory` caps the CUDA caching allocator
//! itself (`device::memory::set_memory_cap`), and the context lies outside that cap: such
//! devices keep the margin but no reserve ([`Headroom::allocator_capped`]; measured on an
//! H200: a placement of 0.70 GiB ran under a 1.01 GiB allocator cap that the reserve
//! called 0.41 GiB usable).
use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::Path;

use serde::Serialize;
use tch::Kind;

use super::placement::{choose, plan_all, plan_model, PlacementRow, PlacementTable};
use super::types::{MemoryPlan, Phase, PlanOptions, PlanShape};
use crate::device::{Placement, PlacementRequest};
use crate::config::MendConfig;
use crate::device::memory::format_bytes;
use crate::device::MaxMemory;
use crate::model::Model;
use crate::{Error, Result};

pub use super::types::{Headroom, DEFAULT_MARGIN, DEFAULT_RESERVE};

pub use super::judge::{judge, over, DeviceVerdict, PlacementVerdict};

/// [`judge`] of a placements-table row (its training peaks).
pub fn judge_row(row: &PlacementRow, main: &str, caps: &MaxMemory, headroom: &Headroom) -> PlacementVerdict {
    let mut label = row.placement.name().to_string();
    label.push_str(&super::boundary_label(row.boundary, &row.chain, &row.sub));
    if row.optimizer_device != main {
        label.push_str(&format!(", optimizer on {}", row.optimizer_device));
    }
    let peaks = row.train.iter().map(|(d, b)| (d.clone(), *b));
    super::judge::judge_peaks(row.placement, &row.optimizer_device, row.boundary, label, peaks, caps, headroom)
}

pub use crate::model::DtypeSource;

/// The weight dtype to plan: [`crate::model::model_dtype`], the rule the runs use.
pub fn planned_dtype(model_dir: &Path, flag: Option<crate::model::Dtype>) -> Result<(Kind, DtypeSource)> {
    crate::model::model_dtype(model_dir, flag)
}

/// What a plan assumed, in one line: the dtype and where it came from, batch, tokens,
/// image, the devices, and which phase's peaks the verdicts judge.
pub fn planned_text(shape: &PlanShape, source: DtypeSource, phase_judged: Phase, devices: &str) -> String {
    let mut out = String::new();
    let src = source.describe();
    let image = match &shape.image {
        Some(im) => format!(", image {}x{} (resized {}x{}, {} tokens)", im.size.0, im.size.1, im.resized.0, im.resized.1, im.tokens),
        None => String::new(),
    };
    let _ = writeln!(
        out,
        "planned: {} in {} ({src}), batch {} x {} tokens, {} labelled positions per example{image}; devices {devices}; verdicts on the {} peaks",
        shape.architecture,
        shape.dtype,
        shape.batch_size,
        shape.tokens_per_example,
        shape.kept_per_example,
        match phase_judged {
            Phase::Train => "meta-training",
            Phase::Edit => "editing",
        }
    );
    out
}

/// The placements table's columns, explained under it.
pub const COLUMNS: &str = "columns: boundary = first block on the sub-device (balanced); main/1 = the main device's training peak / the single-device \
training peak; max/1 = the largest device's training peak / the single-device training peak (below 1: the split saves that share)\n";

/// The verdict block under a table: one line per placement with caps, and the chosen one.
pub fn verdict_text(verdicts: &[PlacementVerdict], headroom: &Headroom) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "verdicts against `max_memory`, usable = {}:", headroom.text());
    for v in verdicts {
        let devs = v
            .devices
            .iter()
            .filter_map(|d| Some(format!("{} {} of {}", d.device, format_bytes(d.peak_bytes), format_bytes(d.usable_bytes?))))
            .collect::<Vec<_>>()
            .join(", ");
        let _ = writeln!(out, "  {:<7} {} ({devs})", if v.fits { "fits" } else { "OVER" }, v.label);
    }
    match verdicts.iter().find(|v| v.fits) {
        Some(v) => {
            let _ = writeln!(out, "chosen: {} (the first that fits, in the order of `placement`=auto)", v.label);
        }
        None => {
            let _ = writeln!(out, "nothing fits");
        }
    }
    out
}

/// The one line `plan` exits with when no placement fits.
pub fn nothing_fits_line(verdicts: &[PlacementVerdict], caps: &MaxMemory, headroom: &Headroom) -> String {
    let best = verdicts
        .iter()
        .min_by_key(|v| v.devices.iter().filter_map(|d| d.peak_bytes.checked_sub(d.usable_bytes?)).max().unwrap_or(0));
    let caps_s = caps.0.iter().map(|(d, b)| format!("{d}={}", format_bytes(*b))).collect::<Vec<_>>().join(",");
    match best {
        Some(v) => format!(
            "no placement fits `max_memory` {caps_s} (usable {}); closest: {} ({})",
            headroom.text(),
            v.label,
            v.devices.iter().filter(|d| !d.fits).map(|d| format!("{} needs {} of {}", d.device, format_bytes(d.peak_bytes), format_bytes(d.usable_bytes.unwrap_or(0)))).collect::<Vec<_>>().join(", ")
        ),
        None => format!("no placement fits `max_memory` {caps_s}"),
    }
}

/// The smallest card of the sizes asked for on which the run fits, on `cards` cards
/// (and the host's memory, for one card with the CPU as sub-device).
#[derive(Debug, Clone, Serialize)]
pub struct FitCards {
    pub cards: usize,
    /// The devices planned: `cuda:0`, `cuda:0` + `cuda:1`, or `cuda:0` + `cpu`.
    pub devices: Vec<String>,
    /// The CPU's capacity with one card and the CPU: `--max-memory cpu=...`, else the
    /// host's memory (`None`: unknown, the CPU is then not judged).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub host_bytes: Option<u64>,
    /// The smallest size that fits; `None` when none of the sizes does.
    pub card_bytes: Option<u64>,
    /// What fits on it (the first placement in `--placement auto`'s order).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub placement: Option<PlacementVerdict>,
}

/// `plan --fit`: one card, and two cards or (`--sub-device cpu`) one card with the CPU.
#[derive(Debug, Clone, Serialize)]
pub struct FitAnswer {
    pub sizes_bytes: Vec<u64>,
    pub headroom: Headroom,
    pub phase: Phase,
    pub one_card: FitCards,
    /// Without a CPU sub-device.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub two_cards: Option<FitCards>,
    /// With `--sub-device cpu`: one card and the host's memory.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub card_and_host: Option<FitCards>,
}

/// The smallest of `sizes` on which the run of `o` (its dtype, tokens, image; devices
/// replaced by `cuda:0`, and `cuda:0` + `cuda:1`) fits, judged on `phase` peaks. The
/// placements of two cards are planned once (equal caps balance the layer split by bytes
/// whatever the size) and judged against each size in turn. With `host`, a CPU device
/// (`--sub-device cpu`), the second answer is one card and that CPU instead, its capacity
/// the host's memory or its `--max-memory` cap; those placements are planned per size
/// (the layer split balances each device's share of its capacity).
pub fn fit(model: &Model, cfg: &MendConfig, o: &PlanOptions, sizes: &[u64], headroom: &Headroom, phase: Phase, host: Option<&str>) -> Result<FitAnswer> {
    if sizes.is_empty() {
        return Err(Error::input("`fit`: give card sizes, e.g. 16GiB,24GiB,40GiB,80GiB"));
    }
    let mut sizes = sizes.to_vec();
    sizes.sort_unstable();
    sizes.dedup();
    let base = PlanOptions { balance_for: phase, caps: MaxMemory::default(), ..o.clone() };
    let one = PlanOptions { main: "cuda:0".into(), sub: "cuda:0".into(), split: false, ..base.clone() };
    let single = plan_model(model, cfg, &one.single())?;
    let judged = |plans: &[MemoryPlan], caps: &MaxMemory| plans.iter().map(|p| judge(p, caps, headroom, phase)).find(|v| v.fits);
    let caps_of = |devices: &[&str], s: u64| MaxMemory(devices.iter().map(|d| (d.to_string(), s)).collect::<BTreeMap<_, _>>());
    let answer = |cards: usize, plans: &[MemoryPlan], devices: &[&str]| -> FitCards {
        let devs = devices.iter().map(|d| d.to_string()).collect();
        for &s in &sizes {
            if let Some(v) = judged(plans, &caps_of(devices, s)) {
                return FitCards { cards, devices: devs, host_bytes: None, card_bytes: Some(s), placement: Some(v) };
            }
        }
        FitCards { cards, devices: devs, host_bytes: None, card_bytes: None, placement: None }
    };
    let one_card = answer(1, std::slice::from_ref(&single), &["cuda:0"]);
    let (two_cards, card_and_host) = if let Some(cpu) = host {
        let host = o.capacity(cpu);
        let devices = vec!["cuda:0".to_string(), cpu.to_string()];
        let mut found = FitCards { cards: 1, devices: devices.clone(), host_bytes: host, card_bytes: None, placement: None };
        for &s in &sizes {
            let mut caps = caps_of(&["cuda:0"], s);
            if let Some(h) = host {
                caps.0.insert(cpu.to_string(), h);
            }
            let with = PlanOptions {
                main: "cuda:0".into(),
                sub: cpu.to_string(),
                chain: Vec::new(),
                chain_at: Vec::new(),
                split: true,
                caps: caps.clone(),
                ..base.clone()
            };
            if let Some(v) = judged(&plan_all(model, cfg, &with)?, &caps) {
                found.card_bytes = Some(s);
                found.placement = Some(v);
                break;
            }
        }
        (None, Some(found))
    } else {
        let two = PlanOptions { main: "cuda:0".into(), sub: "cuda:1".into(), chain: Vec::new(), chain_at: Vec::new(), split: true, ..base };
        (Some(answer(2, &plan_all(model, cfg, &two)?, &["cuda:0", "cuda:1"])), None)
    };
    Ok(FitAnswer { one_card, two_cards, card_and_host, sizes_bytes: sizes, headroom: headroom.clone(), phase })
}

impl FitAnswer {
    pub fn text(&self) -> String {
        let mut out = String::new();
        let sizes = self.sizes_bytes.iter().map(|s| format_bytes(*s)).collect::<Vec<_>>().join(", ");
        let _ = writeln!(out, "fit: the smallest of {sizes} per card (usable {}):", self.headroom.text());
        for f in [Some(&self.one_card), self.two_cards.as_ref(), self.card_and_host.as_ref()].into_iter().flatten() {
            let cards = match (f.cards, f.devices.len()) {
                (1, 1) => "one card ".to_string(),
                (1, _) => match f.host_bytes {
                    Some(h) => format!("one card + {} ({} of host memory)", f.devices[1], format_bytes(h)),
                    None => format!("one card + {} (host memory unknown, not judged)", f.devices[1]),
                },
                _ => "two cards".to_string(),
            };
            match (&f.card_bytes, &f.placement) {
                (Some(s), Some(v)) => {
                    let peaks = v.devices.iter().map(|d| format!("{} {}", d.device, format_bytes(d.peak_bytes))).collect::<Vec<_>>().join(", ");
                    let _ = writeln!(out, "  {cards}: {} with {} (peaks {peaks})", format_bytes(*s), v.label);
                }
                _ => {
                    let _ = writeln!(out, "  {cards}: none of the sizes");
                }
            }
        }
        out
    }
}

/// What `plan` was asked.
#[derive(Debug, Clone)]
pub struct PlanQuestion {
    /// `--placement` (`None`: every placement of the devices in a table).
    pub placement: Option<PlacementRequest>,
    /// Where the dtype came from ([`planned_dtype`]).
    pub dtype_source: DtypeSource,
    /// `--fit` card sizes.
    pub fit: Option<Vec<u64>>,
    /// `--fit` with `--sub-device cpu`: the CPU device it plans one card with (instead of
    /// two cards).
    pub fit_host: Option<String>,
    /// `--data`: the records' shape the options were taken from.
    pub data: Option<super::data::DataShape>,
    pub json: bool,
}

/// `plan`'s whole answer: what it printed (text or one JSON object), and with caps given
/// and nothing fitting, the one line it exits non-zero with.
pub fn answer(model: &Model, cfg: &MendConfig, o: &PlanOptions, q: &PlanQuestion) -> Result<(String, Option<String>)> {
    let phase = Phase::Train;
    let single = plan_model(model, cfg, &o.single())?;
    let devices = if o.split { o.devices().join(" + ") } else { format!("{} alone", o.main) };
    let mut planned = planned_text(&single.shape, q.dtype_source, phase, &devices);
    if let Some(d) = &q.data {
        planned.push_str(&d.text());
    }
    let planned_json = serde_json::json!({
        "dtype": single.shape.dtype, "dtype_source": q.dtype_source, "batch_size": single.shape.batch_size,
        "tokens_per_example": single.shape.tokens_per_example, "kept_per_example": single.shape.kept_per_example,
        "image": single.shape.image, "main": o.main, "sub": o.sub, "chain": o.chain, "split": o.split, "verdict_phase": phase,
        "headroom": o.headroom, "data": q.data,
    });
    let judged = !o.caps.is_empty();
    // A CPU device is judged against the host's memory when no cap names it.
    let caps = o.judged_caps();
    if let Some(sizes) = &q.fit {
        let f = fit(model, cfg, o, sizes, &o.headroom, phase, q.fit_host.as_deref())?;
        let mut planned_json = planned_json;
        let sub = q.fit_host.clone().unwrap_or_else(|| "cuda:1".to_string());
        for (k, v) in [("main", "cuda:0"), ("sub", sub.as_str())] {
            planned_json[k] = serde_json::Value::from(v);
        }
        let out = if q.json {
            serde_json::json!({ "planned": planned_json, "fit": f }).to_string() + "\n"
        } else {
            let data = q.data.as_ref().map(|d| d.text()).unwrap_or_default();
            let devices = if q.fit_host.is_some() {
                format!("cuda:0 (one card) or cuda:0 + {sub} (one card and host memory)")
            } else {
                "cuda:0 (one card) or cuda:0 + cuda:1 (two cards)".to_string()
            };
            format!("{}{data}{}", planned_text(&single.shape, q.dtype_source, phase, &devices), f.text())
        };
        return Ok((out, None));
    }
    let (mut value, mut text, verdicts) = match (q.placement, o.split) {
        (None, true) => {
            let table = PlacementTable::new(model, cfg, o)?;
            let v: Vec<PlacementVerdict> = table.rows.iter().map(|r| judge_row(r, &o.main, &caps, &o.headroom)).collect();
            let text = format!("{planned}{}{COLUMNS}(`placement`=NAME prints one placement's items and formulas)\n", table.text());
            (serde_json::to_value(&table).map_err(|e| Error::Torch(e.to_string()))?, text, v)
        }
        (request, _) => {
            let plan = match request.and_then(PlacementRequest::fixed) {
                Some(p) => plan_model(model, cfg, &o.with_placement(p, o.optimizer)?)?,
                None if request == Some(PlacementRequest::Auto) => match choose(model, cfg, o, phase) {
                    Ok(p) => p,
                    // Nothing fits: judge every placement, so the answer says by how much.
                    Err(_) => {
                        let all = plan_all(model, cfg, &PlanOptions { balance_for: phase, ..o.clone() })?;
                        let v: Vec<PlacementVerdict> = all.iter().map(|p| judge(p, &caps, &o.headroom, phase)).collect();
                        return finish(serde_json::json!({}), format!("{planned}"), v, planned_json, judged, &caps, &o.headroom, q.json);
                    }
                },
                None => plan_model(model, cfg, &PlanOptions { placement: Placement::Replica, ..o.clone() })?,
            };
            let v = vec![judge(&plan, &caps, &o.headroom, phase)];
            (serde_json::to_value(&plan).map_err(|e| Error::Torch(e.to_string()))?, format!("{planned}{}", plan.table()), v)
        }
    };
    if !judged {
        value["planned"] = planned_json;
        value["fits"] = serde_json::Value::Null;
        text.push_str("(`max_memory`=DEVICE=SIZE,... gives each placement a verdict)\n");
        return Ok((if q.json { value.to_string() + "\n" } else { text }, None));
    }
    finish(value, text, verdicts, planned_json, judged, &caps, &o.headroom, q.json)
}

#[allow(clippy::too_many_arguments)]
fn finish(
    mut value: serde_json::Value,
    mut text: String,
    verdicts: Vec<PlacementVerdict>,
    planned: serde_json::Value,
    judged: bool,
    caps: &MaxMemory,
    headroom: &Headroom,
    json: bool,
) -> Result<(String, Option<String>)> {
    let fits = verdicts.iter().any(|v| v.fits);
    let chosen = verdicts.iter().find(|v| v.fits).map(|v| v.label.clone());
    let failure = (judged && !fits).then(|| nothing_fits_line(&verdicts, caps, headroom));
    text.push_str(&verdict_text(&verdicts, headroom));
    value["planned"] = planned;
    value["fits"] = serde_json::Value::Bool(fits);
    value["chosen"] = chosen.map_or(serde_json::Value::Null, serde_json::Value::String);
    value["placements"] = serde_json::to_value(&verdicts).map_err(|e| Error::Torch(e.to_string()))?;
    Ok((if json { value.to_string() + "\n" } else { text }, failure))
}

/// The smallest card size `--fit` takes: a smaller one (`1KiB`) is a unit slip, not a card.
pub const MIN_FIT_CARD_BYTES: u64 = 256 << 20;

/// Card sizes from `--fit 16GiB,24GiB,40GiB,80GiB`: an empty entry (`16GiB,,24GiB`,
/// `16GiB,`) or a size below [`MIN_FIT_CARD_BYTES`] is refused, naming it.
pub fn parse_sizes(s: &str) -> Result<Vec<u64>> {
    if s.trim().is_empty() {
        return Err(Error::input(format!("`fit` {s:?}: give card sizes, e.g. 16GiB,24GiB,40GiB,80GiB")));
    }
    s.split(',')
        .map(str::trim)
        .enumerate()
        .map(|(i, p)| {
            if p.is_empty() {
                return Err(Error::input(format!("`fit` {s:?}: size {} is empty (a stray comma?); give card sizes, e.g. 16GiB,24GiB", i + 1)));
            }
            let bytes = crate::device::placement::parse_size(p).map_err(|e| Error::input(format!("`fit` {s:?}: {e}")))?;
            if bytes < MIN_FIT_CARD_BYTES {
                return Err(Error::input(format!("`fit` {s:?}: {p:?} is {bytes} bytes, smaller than any card (at least 256MiB); a unit slip (GiB)?")));
            }
            Ok(bytes)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headroom_takes_the_margin_and_the_context() {
        let h = Headroom::default();
        assert_eq!(h.usable("cuda:0", 10 << 30), (9u64 << 30) - (512 << 20));
        assert_eq!(h.usable("cpu", 10 << 30), 9 << 30);
        assert_eq!(h.usable("cuda:1", 256 << 20), 0);
        // A run's --max-memory caps the allocator: the context is outside, no reserve.
        let h = Headroom { allocator_capped: vec!["cuda:0".into()], ..Headroom::default() };
        assert_eq!(h.usable("cuda:0", 10 << 30), 9u64 << 30);
        assert_eq!(h.usable("cuda:1", 10 << 30), (9u64 << 30) - (512 << 20));
        assert!(h.text().contains("no reserve on cuda:0"), "{}", h.text());
        let h = Headroom::parse(Some("5%"), Some("1GiB")).unwrap();
        assert_eq!((h.margin, h.reserve_bytes), (0.05, 1 << 30));
        assert_eq!(Headroom::parse(Some("0.2"), Some("0")).unwrap(), Headroom { margin: 0.2, reserve_bytes: 0, allocator_capped: vec![] });
        for (m, r) in [(Some("100%"), None), (Some("-1"), None), (Some("lots"), None), (None, Some("big"))] {
            let e = Headroom::parse(m, r).unwrap_err().to_string();
            assert!(e.contains("`margin`") || e.contains("`reserve`"), "{e}");
        }
        assert_eq!(parse_sizes("24GiB, 16GiB").unwrap(), vec![24 << 30, 16 << 30]);
        assert!(parse_sizes("").unwrap_err().to_string().contains("`fit`"));
        assert!(parse_sizes("24GiB,huge").unwrap_err().to_string().contains("`fit`"));
        for (bad, needle) in [("1KiB", "smaller than any card"), ("16GiB,,24GiB", "size 2 is empty"), ("16GiB,", "size 2 is empty"), (",", "size 1 is empty"), (" ", "give card sizes")] {
            let e = parse_sizes(bad).unwrap_err().to_string();
            assert!(e.contains("`fit`") && e.contains(needle), "{bad:?}: {e}");
        }
        assert_eq!(parse_sizes("256MiB").unwrap(), vec![256 << 20]);
    }
}
