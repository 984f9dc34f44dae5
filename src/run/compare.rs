//! Single- vs dual-device runs of the same experiment, side by side: the split must change
//! memory, not results.
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Instant;

use serde::Serialize;
use tch::Kind;

use crate::device::memory::{format_bytes, RoleSummary};
use crate::device::DevicePlan;
use crate::io::write_json_atomic;
use crate::run::{run_eval, run_train, EvalOptions, TrainOptions};
use crate::{Error, Result};

/// Relative tolerance for metrics that must agree between the two runs, by the runs'
/// dtype. In f32 the split changes only the order of a few sums (1e-4 is far above what it
/// does). In bf16 a split over different kinds of device (an H200's cuBLAS against the
/// CPU's bf16 GEMMs) rounds every product differently: one bf16 unit roundoff, 2⁻⁸, is
/// the tolerance (measured on an H200, GPT-2 124M, cuda:0 vs cuda:0 + cpu: 3.7e-4).
pub fn tolerance(dtype: Kind) -> f64 {
    match dtype {
        Kind::BFloat16 => 2f64.powi(-8),
        Kind::Half => 2f64.powi(-11),
        _ => 1e-4,
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct Side {
    pub devices: String,
    pub metrics: BTreeMap<String, f64>,
    pub memory: BTreeMap<String, RoleSummary>,
    pub wall_seconds: f64,
    pub report: PathBuf,
}

#[derive(Debug, Clone, Serialize)]
pub struct Comparison {
    pub command: String,
    pub single: Side,
    pub dual: Side,
    /// Largest relative difference over the compared metrics.
    pub max_relative_difference: f64,
    /// What "agree" allows ([`tolerance`] of the runs' dtype).
    pub tolerance: f64,
    pub metrics_agree: bool,
    /// The metric of the largest relative difference (`loss.step00039`, `reliability`, ...);
    /// `None` when no metric was compared.
    pub worst_metric: Option<String>,
    /// The first metric, in the report's order (training steps in step order), whose
    /// difference is beyond the tolerance: where a drift starts. `None` when they agree.
    pub first_beyond_tolerance: Option<String>,
    /// Dual main-device peak over single-device peak (allocated bytes).
    pub main_peak_ratio: f64,
}

fn side(plan: &DevicePlan, metrics: BTreeMap<String, f64>, memory: BTreeMap<String, RoleSummary>, wall: f64, report: PathBuf) -> Side {
    let devices = if plan.split { format!("{} + {}", plan.main_name(), plan.sub_list().replace(",", " + ")) } else { plan.main_name() };
    Side { devices, metrics, memory, wall_seconds: wall, report }
}

fn read_memory(report: &Path) -> Result<BTreeMap<String, RoleSummary>> {
    let text = crate::io::read_text(report)?;
    let v: serde_json::Value = serde_json::from_str(&text).map_err(|e| Error::file(report, e.to_string()))?;
    serde_json::from_value(v["memory"].clone()).map_err(|e| Error::file(report, e.to_string()))
}

fn finish(command: &str, single: Side, dual: Side, dtype: Kind) -> Comparison {
    // Relative difference per metric; a metric the dual side lacks counts as NaN (never
    // agreeing), and NaN sorts above every number.
    let rel: Vec<(&String, f64)> = single
        .metrics
        .iter()
        .map(|(k, a)| {
            let b = dual.metrics.get(k).copied().unwrap_or(f64::NAN);
            (k, (a - b).abs() / (1.0 + a.abs()))
        })
        .collect();
    let tol = tolerance(dtype);
    let worst = rel.iter().copied().max_by(|x, y| x.1.total_cmp(&y.1));
    let max_rel = worst.map_or(0.0, |w| w.1);
    let beyond = |r: f64| r.is_nan() || r > tol;
    let peak = |s: &Side| s.memory.get("main").map(|m| m.peak_allocated_bytes).unwrap_or(0) as f64;
    Comparison {
        command: command.into(),
        main_peak_ratio: peak(&dual) / peak(&single).max(1.0),
        metrics_agree: !rel.iter().any(|r| beyond(r.1)),
        worst_metric: worst.map(|w| w.0.clone()),
        first_beyond_tolerance: rel.iter().find(|r| beyond(r.1)).map(|r| r.0.clone()),
        max_relative_difference: max_rel,
        tolerance: tol,
        single,
        dual,
    }
}

/// A "dual" side that is the single side's plan would run the single path twice and call it
/// a comparison (the same metrics, a peak ratio of noise, nothing moved): refused, with the
/// way to a real split on one machine.
fn check_dual(plan: &DevicePlan) -> Result<()> {
    // A split, or the optimiser state placed elsewhere (ZeRO-Offload on one device), is a
    // different run; only the single side's own plan is refused.
    if *plan != DevicePlan::single(plan.main) {
        return Ok(());
    }
    let d = plan.main_name();
    let next = match plan.names.0 {
        crate::device::DeviceName::Cpu(i) => format!("cpu:{}", i + 1),
        crate::device::DeviceName::Cuda(i) => format!("cuda:{}", i + 1),
    };
    Err(Error::input(format!(
        "compare: the dual side's `sub_device` is the same device as `device` ({d}), so nothing would be split or moved; \
         give a second device (`sub_device` {next}; on one CPU the logical device cpu:1 runs the real split path)"
    )))
}

/// Meta-trains twice (single on the main device, then split), outputs under `out/single`
/// and `out/dual`, and compares the training losses and validation results.
pub fn compare_train(o: &TrainOptions, dual_plan: DevicePlan) -> Result<Comparison> {
    check_dual(&dual_plan)?;
    let mut sides = Vec::new();
    for (name, plan) in [("single", DevicePlan::single(dual_plan.main)), ("dual", dual_plan)] {
        let mut opts = o.clone();
        opts.common.plan = plan;
        opts.out = o.out.join(name);
        opts.common.report = Some(opts.out.join("report.json"));
        let t = Instant::now();
        let (rep, path) = run_train(&opts)?;
        let mut metrics = BTreeMap::new();
        for h in &rep.history {
            let l = &h.losses;
            metrics.insert(format!("loss.step{:05}", h.step), l.loss);
            for (name, v) in [("image_edit_acc", l.image_edit_acc), ("image_loc_kl", l.image_loc_kl), ("image_loc_acc", l.image_loc_acc)] {
                if let Some(v) = v {
                    metrics.insert(format!("{name}.step{:05}", h.step), v);
                }
            }
        }
        for v in &rep.validations {
            metrics.insert(format!("val_loss.step{:05}", v.step), v.loss);
            metrics.insert(format!("val_edit_acc.step{:05}", v.step), v.edit_acc);
        }
        sides.push(side(&plan, metrics, read_memory(&path)?, t.elapsed().as_secs_f64(), path));
    }
    let dual = sides.pop().expect("two sides");
    let single = sides.pop().expect("two sides");
    let c = finish("train", single, dual, o.common.dtype);
    write_json_atomic(&o.out.join("compare.json"), &c)?;
    Ok(c)
}

/// Evaluates twice (single, then split) and compares the edit metrics.
pub fn compare_eval(o: &EvalOptions, dual_plan: DevicePlan, out: &Path) -> Result<Comparison> {
    check_dual(&dual_plan)?;
    let mut sides = Vec::new();
    for (name, plan) in [("single", DevicePlan::single(dual_plan.main)), ("dual", dual_plan)] {
        let mut opts = o.clone();
        opts.common.plan = plan;
        opts.common.report = Some(out.join(format!("eval-{name}.json")));
        let t = Instant::now();
        let (res, path) = run_eval(&opts, |_, _| {})?;
        let s = &res.summary;
        let mut metrics = BTreeMap::from([
            ("reliability".to_string(), s.reliability),
            ("edit_success".to_string(), s.edit_success),
            ("nll_pre".to_string(), s.nll_pre),
            ("nll_post".to_string(), s.nll_post),
        ]);
        if let Some(g) = s.generalization {
            metrics.insert("generalization".to_string(), g);
        }
        if let Some(l) = s.locality {
            metrics.insert("locality".to_string(), l);
        }
        for (name, v) in [("image_generalization", s.image_generalization), ("image_locality", s.image_locality), ("image_locality_top1", s.image_locality_top1)] {
            if let Some(v) = v {
                metrics.insert(name.to_string(), v);
            }
        }
        sides.push(side(&plan, metrics, read_memory(&path)?, t.elapsed().as_secs_f64(), path));
    }
    let dual = sides.pop().expect("two sides");
    let single = sides.pop().expect("two sides");
    let c = finish("eval", single, dual, o.common.dtype);
    write_json_atomic(&out.join("compare.json"), &c)?;
    Ok(c)
}

/// The readable side-by-side table.
pub fn table(c: &Comparison) -> String {
    let mut s = String::new();
    let row = |s: &mut String, k: &str, a: String, b: String| s.push_str(&format!("{k:<28} {a:>18} {b:>18}\n"));
    row(&mut s, &format!("compare {}", c.command), "single".into(), "dual".into());
    row(&mut s, "devices", c.single.devices.clone(), c.dual.devices.clone());
    let keys: Vec<&String> = c.single.metrics.keys().collect();
    // Long training histories: show the last few entries of each kind.
    let shown: Vec<&String> = if keys.len() > 12 { keys[keys.len() - 12..].to_vec() } else { keys };
    for k in shown {
        let b = c.dual.metrics.get(k).copied().unwrap_or(f64::NAN);
        row(&mut s, k, format!("{:.6}", c.single.metrics[k]), format!("{b:.6}"));
    }
    for role in ["main", "sub"] {
        let get = |side: &Side| side.memory.get(role).map(|m| format_bytes(m.peak_allocated_bytes)).unwrap_or("-".into());
        row(&mut s, &format!("peak allocated ({role})"), get(&c.single), get(&c.dual));
    }
    row(&mut s, "wall time", format!("{:.1} s", c.single.wall_seconds), format!("{:.1} s", c.dual.wall_seconds));
    let worst = match &c.worst_metric {
        Some(k) => format!(
            "largest relative difference {:.2e} at {k} ({} vs {})",
            c.max_relative_difference,
            c.single.metrics.get(k).map_or("-".into(), |v| format!("{v:.6}")),
            c.dual.metrics.get(k).map_or("missing".into(), |v| format!("{v:.6}"))
        ),
        None => "no metric compared".into(),
    };
    let first = c.first_beyond_tolerance.as_ref().map_or(String::new(), |k| format!("; first beyond it: {k}"));
    s.push_str(&format!(
        "metrics agree: {} ({worst}; tolerance {:.1e}{first}); dual main peak / single peak = {:.3}\n",
        if c.metrics_agree { "yes" } else { "NO" },
        c.tolerance,
        c.main_peak_ratio
    ));
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    fn side_with(metrics: &[(&str, f64)]) -> Side {
        Side { devices: "cpu".into(), metrics: metrics.iter().map(|(k, v)| (k.to_string(), *v)).collect(), memory: BTreeMap::new(), wall_seconds: 1.0, report: PathBuf::new() }
    }

    #[test]
    fn a_disagreement_names_the_worst_metric_and_where_the_drift_starts() {
        let single = side_with(&[("loss.step00001", 5.0), ("loss.step00002", 5.0), ("loss.step00039", 5.418)]);
        let dual = side_with(&[("loss.step00001", 5.0), ("loss.step00002", 5.001), ("loss.step00039", 5.359)]);
        let c = finish("train", single, dual, Kind::Float);
        assert!(!c.metrics_agree);
        assert_eq!(c.worst_metric.as_deref(), Some("loss.step00039"));
        assert_eq!(c.first_beyond_tolerance.as_deref(), Some("loss.step00002"));
        let text = table(&c);
        assert!(text.contains("metrics agree: NO (largest relative difference") && text.contains("at loss.step00039 (5.418000 vs 5.359000)"), "{text}");
        assert!(text.contains("first beyond it: loss.step00002"), "{text}");
        // A metric the dual side lacks never agrees.
        let c = finish("eval", side_with(&[("reliability", 1.0)]), side_with(&[]), Kind::Float);
        assert!(!c.metrics_agree && c.worst_metric.as_deref() == Some("reliability"));
        // Agreement: no drift named.
        let c = finish("eval", side_with(&[("reliability", 1.0)]), side_with(&[("reliability", 1.0)]), Kind::Float);
        assert!(c.metrics_agree && c.first_beyond_tolerance.is_none());
    }
}
