//! `dualedit report merge`: many run reports in one table (issue #38). Experiments beyond
//! one node are independent processes (a Slurm job array, one process per card set), each
//! writing its own report; this puts them side by side: one row per report with the
//! command, model, devices, placement, key metrics, per-role memory peaks and wall time.
//!
//! It reads what the commands write, as JSON values (so a report of an older or newer
//! build still merges, its unknown fields ignored): the run reports of `train`, `eval` and
//! `edit` ([`crate::run::report::RunReport`]) and the `compare.json` of `compare`
//! ([`crate::run::compare::Comparison`], one row: the split side's devices and peaks, the
//! ratio and agreement as metrics, the two wall times summed), and EasyEdit's MEND timed by
//! `scripts/gpu/easyedit_mend.py` (format `dualedit-easyedit-mend/1`: its time per step, one
//! edit's time, the peaks), so both tools' runs of `scripts/gpu/versus.py` sit in one table.
//! Anything else is refused with the file named.
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::Serialize;
use serde_json::Value;

use crate::device::memory::format_bytes;
use crate::{Error, Result};

/// The format tag of `--json`'s object.
pub const FORMAT: &str = "dualedit-report-merge/1";

/// The metrics the table shows (when a report has them), in this order; `--json` keeps
/// every numeric metric.
pub const KEY_METRICS: &[&str] = &[
    "reliability",
    "generalization",
    "locality",
    "portability",
    "image_generalization",
    "image_locality",
    "edit_success",
    "best_val_loss",
    "final_loss",
    "steps",
    "seconds_per_step",
    "seconds_per_edit",
    "main_peak_ratio",
    "max_relative_difference",
];

/// One report, as a row.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Row {
    pub file: PathBuf,
    /// `train`, `eval`, `edit`, or `compare train` / `compare eval`.
    pub command: String,
    /// The model directory as the run was given it (`compare.json` does not record it: null).
    pub model: Option<String>,
    /// `cuda:0` alone, or `cuda:0 + cpu` for a split run.
    pub devices: String,
    /// `replica` or `balanced` for a split run; null on one device (and for compare).
    pub placement: Option<String>,
    pub dtype: Option<String>,
    /// Every numeric metric of the report (booleans as 0 / 1), plus `final_loss` (the last
    /// training step's loss) for `train`.
    pub metrics: BTreeMap<String, f64>,
    /// Peak allocated bytes per role (`main`, `sub`, `editor`, ...).
    pub peak_bytes: BTreeMap<String, u64>,
    /// Seconds: the sum of the report's phases (`compare`: the two runs' wall times).
    pub wall_seconds: f64,
}

/// Every report merged: rows in the order the files were given.
#[derive(Debug, Clone, Serialize)]
pub struct Merged {
    pub format: &'static str,
    pub rows: Vec<Row>,
}

/// Reads each file and makes its row (timelines skipped); the first unreadable or
/// unrecognised file is the error (named), so a sweep's table never silently lacks a run.
pub fn merge(paths: &[PathBuf]) -> Result<Merged> {
    if paths.is_empty() {
        return Err(Error::input("report merge: give at least one report (the JSON files train / eval / edit / compare write)"));
    }
    let mut rows = Vec::with_capacity(paths.len());
    for p in paths {
        if let Some(r) = read_row(p)? {
            rows.push(r);
        }
    }
    if rows.is_empty() {
        return Err(Error::input("report merge: every file given is a memory timeline (<report>.timeline.json), none a report"));
    }
    Ok(Merged { format: FORMAT, rows })
}

/// One report file as a row; `None` for the memory timeline written beside every report
/// (`<report>.timeline.json`, `{"samples": [...]}`), which `runs/*.json` also matches.
pub fn read_row(path: &Path) -> Result<Option<Row>> {
    let text = crate::io::read_text(path)?;
    let v: Value = serde_json::from_str(&text).map_err(|e| Error::file(path, format!("not JSON: {e}")))?;
    if v.as_object().is_some_and(|o| o.len() == 1 && o.get("samples").is_some_and(Value::is_array)) {
        tracing::info!(file = %path.display(), "skipped: a memory timeline, not a report");
        return Ok(None);
    }
    row(path, &v).map(Some)
}

/// The row of a parsed report (`path` only names it).
pub fn row(path: &Path, v: &Value) -> Result<Row> {
    if v.get("format").and_then(Value::as_str) == Some(EASYEDIT_FORMAT) {
        return easyedit_row(path, v);
    }
    let not_a_report = || Error::file(path, "not a dualedit run report (train / eval / edit write one with command, devices, metrics, memory; compare writes compare.json)");
    let command = v.get("command").and_then(Value::as_str).ok_or_else(not_a_report)?;
    check_format(path, v)?;
    if v.get("single").is_some() && v.get("dual").is_some() {
        return compare_row(path, command, v).ok_or_else(not_a_report);
    }
    let devices = v.get("devices").filter(|d| d.is_object()).ok_or_else(not_a_report)?;
    let metrics_v = v.get("metrics").filter(|m| m.is_object()).ok_or_else(not_a_report)?;
    let memory = v.get("memory").filter(|m| m.is_object()).ok_or_else(not_a_report)?;
    let main = devices.get("main").and_then(Value::as_str).ok_or_else(not_a_report)?;
    let split = devices.get("split").and_then(Value::as_bool).unwrap_or(false);
    let sub = devices.get("sub").and_then(Value::as_str).unwrap_or(main);
    // A key metric that is there but not a number (a string, an object) would leave its
    // cell empty without a word: refused, naming it (null stays an absent metric).
    if let Some(k) = KEY_METRICS.iter().find(|k| metrics_v.get(**k).is_some_and(|x| !(x.is_number() || x.is_boolean() || x.is_null()))) {
        return Err(Error::file(path, format!("metric {k:?} is {}, not a number; this is not a report as dualedit writes it", metrics_v[*k])));
    }
    let mut metrics = numeric_fields(metrics_v);
    // Reports before the key was named for what it is (a mean over edits) call it `edit_seconds`.
    if let Some(x) = metrics.remove("edit_seconds") {
        metrics.entry("seconds_per_edit".into()).or_insert(x);
    }
    if metrics.is_empty() {
        return Err(Error::file(path, "has no numeric metric (its row would be empty); this is not a report as dualedit writes it"));
    }
    if let Some(last) = metrics_v.get("history").and_then(Value::as_array).and_then(|h| h.last()) {
        if let Some(loss) = last.get("loss").and_then(Value::as_f64) {
            metrics.insert("final_loss".into(), loss);
        }
    }
    let wall_seconds = v.get("seconds").and_then(Value::as_object).map(|s| s.values().filter_map(Value::as_f64).sum()).unwrap_or(0.0);
    Ok(Row {
        file: path.to_path_buf(),
        command: command.to_string(),
        model: v.get("model").and_then(Value::as_str).map(String::from),
        devices: if split { format!("{main} + {sub}") } else { main.to_string() },
        placement: split.then(|| devices.get("placement").and_then(Value::as_str).map(String::from)).flatten(),
        dtype: v.get("dtype").and_then(Value::as_str).map(String::from),
        metrics,
        peak_bytes: peaks(memory),
        wall_seconds,
    })
}

/// A report's `format` ([`crate::run::report::REPORT_FORMAT`]): absent (a report of a build
/// before the tag) or one this build reads; a newer version, or anything else, is refused.
fn check_format(path: &Path, v: &Value) -> Result<()> {
    let Some(f) = v.get("format") else { return Ok(()) };
    let ours = crate::run::report::REPORT_FORMAT;
    let (name, version) = ours.rsplit_once('/').unwrap_or((ours, "1"));
    let given = f.as_str().and_then(|s| s.rsplit_once('/')).filter(|(n, _)| *n == name).and_then(|(_, v)| v.parse::<u32>().ok());
    match given {
        Some(g) if g <= version.parse::<u32>().unwrap_or(1) => Ok(()),
        Some(_) => Err(Error::file(path, format!("is a report of format {f} from a newer dualedit; this build reads {ours} (merge it with that build)"))),
        None => Err(Error::file(path, format!("has format {f}, not a dualedit run report's ({ours})"))),
    }
}

/// The format of `scripts/gpu/easyedit_mend.py`'s JSON (EasyEdit's own MEND, timed).
pub const EASYEDIT_FORMAT: &str = "dualedit-easyedit-mend/1";

/// EasyEdit's run: `seconds_per_step` (its mean `train_step` time after warm-up),
/// `seconds_per_edit` (one `MEND.edit`), peaks of the steps (`main`) and of the edit (`edit`);
/// a run that failed is refused with the phase and error it records.
fn easyedit_row(path: &Path, v: &Value) -> Result<Row> {
    if let Some(e) = v.get("error").and_then(Value::as_str) {
        let phase = v.get("phase").and_then(Value::as_str).unwrap_or("?");
        return Err(Error::file(path, format!("EasyEdit's run failed in {phase}: {e}")));
    }
    let num = |x: Option<&Value>| x.and_then(Value::as_f64);
    let train = v.get("train");
    let edit = v.get("edit");
    let mut metrics = BTreeMap::new();
    for (k, x) in [
        ("seconds_per_step", num(train.and_then(|t| t.get("mean_step_seconds")))),
        ("seconds_per_edit", num(edit.and_then(|e| e.get("seconds")))),
        ("steps", num(v.get("steps"))),
        ("final_loss", num(v.get("last_loss"))),
    ] {
        if let Some(x) = x {
            metrics.insert(k.to_string(), x);
        }
    }
    if metrics.is_empty() {
        return Err(Error::file(path, "an EasyEdit run with no timing (no train or edit): not as easyedit_mend.py writes it"));
    }
    let mut peak_bytes = BTreeMap::new();
    for (role, x) in [("main", train), ("edit", edit)] {
        if let Some(b) = x.and_then(|t| t.get("peak_bytes")).and_then(Value::as_u64) {
            peak_bytes.insert(role.to_string(), b);
        }
    }
    let steps: f64 = train.and_then(|t| t.get("step_seconds")).and_then(Value::as_array).map_or(0.0, |s| s.iter().filter_map(Value::as_f64).sum());
    Ok(Row {
        file: path.to_path_buf(),
        command: "easyedit mend".into(),
        model: v.get("model").and_then(Value::as_str).map(String::from),
        devices: v.get("device").and_then(Value::as_str).unwrap_or("?").to_string(),
        placement: None,
        // torch's names (`bfloat16`) as the CLI writes them (`bf16`); an unknown one as it is.
        dtype: v.get("dtype").and_then(Value::as_str).map(|d| crate::model::parse_dtype(d).map_or_else(|_| d.to_string(), |k| crate::model::loader::dtype_name(k).to_string())),
        metrics,
        peak_bytes,
        wall_seconds: num(v.get("load_seconds")).unwrap_or(0.0) + steps,
    })
}

/// `compare.json`: the split side's devices and peaks; the ratio, the largest difference
/// and the agreement as metrics.
fn compare_row(path: &Path, command: &str, v: &Value) -> Option<Row> {
    let (single, dual) = (v.get("single")?, v.get("dual")?);
    let mut metrics = BTreeMap::new();
    for k in ["main_peak_ratio", "max_relative_difference"] {
        metrics.insert(k.to_string(), v.get(k)?.as_f64()?);
    }
    metrics.insert("metrics_agree".into(), if v.get("metrics_agree")?.as_bool()? { 1.0 } else { 0.0 });
    let wall = |s: &Value| s.get("wall_seconds").and_then(Value::as_f64);
    metrics.insert("single_wall_seconds".into(), wall(single)?);
    metrics.insert("dual_wall_seconds".into(), wall(dual)?);
    let mut peak_bytes = peaks(dual.get("memory")?);
    if let Some(m) = single.get("memory").and_then(|m| m.get("main")).and_then(|m| m.get("peak_allocated_bytes")).and_then(Value::as_u64) {
        peak_bytes.insert("single main".into(), m);
    }
    Some(Row {
        file: path.to_path_buf(),
        command: format!("compare {command}"),
        model: None,
        devices: dual.get("devices")?.as_str()?.to_string(),
        placement: None,
        dtype: None,
        metrics,
        peak_bytes,
        wall_seconds: wall(single)? + wall(dual)?,
    })
}

/// Numbers (and booleans as 0 / 1) at the top level of an object; nested values are left
/// out (histories, per-record lists), except that the metrics' own fields are all here.
fn numeric_fields(v: &Value) -> BTreeMap<String, f64> {
    let mut out = BTreeMap::new();
    if let Some(o) = v.as_object() {
        for (k, x) in o {
            match x {
                Value::Number(n) => {
                    if let Some(f) = n.as_f64() {
                        out.insert(k.clone(), f);
                    }
                }
                Value::Bool(b) => {
                    out.insert(k.clone(), if *b { 1.0 } else { 0.0 });
                }
                _ => {}
            }
        }
    }
    out
}

fn peaks(memory: &Value) -> BTreeMap<String, u64> {
    memory
        .as_object()
        .map(|m| m.iter().filter_map(|(role, s)| Some((role.clone(), s.get("peak_allocated_bytes")?.as_u64()?))).collect())
        .unwrap_or_default()
}

/// The readable table: one line per report, the key metrics that any row has as columns.
pub fn table(m: &Merged) -> String {
    let columns: Vec<&str> = KEY_METRICS.iter().copied().filter(|k| m.rows.iter().any(|r| r.metrics.contains_key(*k))).collect();
    let mut header = vec!["#".to_string(), "command".into(), "model".into(), "devices".into(), "placement".into(), "dtype".into()];
    header.extend(columns.iter().map(|c| c.to_string()));
    header.extend(["peaks".to_string(), "wall".into(), "file".into()]);
    let mut lines = vec![header];
    for (i, r) in m.rows.iter().enumerate() {
        let mut cells = vec![
            (i + 1).to_string(),
            r.command.clone(),
            r.model.as_deref().map(short_path).unwrap_or_else(|| "-".into()),
            r.devices.clone(),
            r.placement.clone().unwrap_or_else(|| "-".into()),
            r.dtype.clone().unwrap_or_else(|| "-".into()),
        ];
        cells.extend(columns.iter().map(|c| r.metrics.get(*c).map(|x| number(*x)).unwrap_or_else(|| "-".into())));
        let peaks: Vec<String> = r.peak_bytes.iter().map(|(role, b)| format!("{role} {}", format_bytes(*b))).collect();
        cells.push(if peaks.is_empty() { "-".into() } else { peaks.join(", ") });
        cells.push(format!("{:.1} s", r.wall_seconds));
        cells.push(r.file.display().to_string());
        lines.push(cells);
    }
    let n = lines[0].len();
    let widths: Vec<usize> = (0..n).map(|j| lines.iter().map(|l| l[j].chars().count()).max().unwrap_or(0)).collect();
    let mut s = String::new();
    for l in &lines {
        let cells: Vec<String> = l.iter().zip(&widths).map(|(c, w)| format!("{c:<w$}")).collect();
        s.push_str(cells.join("  ").trim_end());
        s.push('\n');
    }
    s
}

/// Integers as integers, the rest with four significant decimals.
fn number(x: f64) -> String {
    if x.fract() == 0.0 && x.abs() < 1e15 {
        format!("{x:.0}")
    } else {
        format!("{x:.4}")
    }
}

/// The last two components of a path: enough to tell models apart in a table.
fn short_path(p: &str) -> String {
    let parts: Vec<&str> = p.trim_end_matches('/').rsplit('/').take(2).collect();
    parts.into_iter().rev().collect::<Vec<_>>().join("/")
}
