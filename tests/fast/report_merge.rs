//! `dualedit report merge` (issue #38): reports the commands really write (a one-step
//! `train` and an `eval` on the embedded default, a `compare.json` serialised from the
//! library's own type) merged into one table and one JSON object; bad files refused.
use crate::common;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Output;

use dualedit::run::compare::{Comparison, Side};
use dualedit::device::memory::RoleSummary;
use serde_json::Value;

fn dualedit(args: &[&str]) -> Output {
    common::dualedit_cmd().args(args).current_dir(env!("CARGO_MANIFEST_DIR")).output().unwrap()
}

fn ok(o: Output) -> String {
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    String::from_utf8(o.stdout).unwrap()
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

fn summary(device: &str, peak: u64) -> RoleSummary {
    RoleSummary { device: device.into(), peak_allocated_bytes: peak, peak_reserved_bytes: peak, current_allocated_bytes: 0, process_wide: false }
}

/// A train and an eval report from the binary, and a compare.json of the library's type.
fn reports(dir: &Path) -> Vec<PathBuf> {
    let root = common::root();
    let cfg = dir.join("cfg.json");
    std::fs::write(&cfg, r#"{"rank": 16, "max_steps": 2, "accumulate": 1, "val_every": 1000, "val_records": 1, "max_length": 32}"#).unwrap();
    let (train, eval) = (dir.join("train.json"), dir.join("eval.json"));
    let model = root.join("data/model");
    ok(dualedit(&["train", "--model", s(&model), "--data", s(&root.join("data/world/edits-train.json")), "--ds", "counterfact"]
        .into_iter()
        .chain(["--config", s(&cfg), "--out", s(&dir.join("editor")), "--report", s(&train)])
        .collect::<Vec<_>>()));
    ok(dualedit(&[
        "eval",
        "--model",
        s(&model),
        "--editor",
        s(&root.join("data/editor")),
        "--data",
        s(&root.join("data/world/edits-holdout.json")),
        "--ds",
        "counterfact",
        "--limit",
        "3",
        "--report",
        s(&eval),
    ]));
    let side = |devices: &str, main: u64, sub: Option<u64>, wall: f64| Side {
        devices: devices.into(),
        metrics: BTreeMap::from([("loss.step00000".to_string(), 1.5)]),
        memory: [("main".to_string(), summary("cuda:0", main))].into_iter().chain(sub.map(|b| ("sub".to_string(), summary("cpu", b)))).collect(),
        wall_seconds: wall,
        report: dir.join("x.json"),
    };
    let c = Comparison {
        command: "train".into(),
        single: side("cuda:0", 1000, None, 2.0),
        dual: side("cuda:0 + cpu", 600, Some(700), 3.0),
        max_relative_difference: 1e-7,
        tolerance: 1e-4,
        metrics_agree: true,
        worst_metric: Some("loss.step00001".into()),
        first_beyond_tolerance: None,
        main_peak_ratio: 0.6,
    };
    let compare = dir.join("compare.json");
    std::fs::write(&compare, serde_json::to_string(&c).unwrap()).unwrap();
    vec![train, eval, compare]
}

#[test]
fn merges_train_eval_and_compare_reports_into_one_table_and_one_json() {
    let dir = tempfile::tempdir().unwrap();
    let files = reports(dir.path());
    // The timeline beside a report (what `runs/*.json` also matches) is passed over.
    let timeline = dir.path().join("train.timeline.json");
    assert!(timeline.is_file());
    let args: Vec<&str> = ["report", "merge"].into_iter().chain(files.iter().map(|p| s(p))).chain([s(&timeline)]).collect();

    let v: Value = serde_json::from_str(&ok(dualedit(&[args.as_slice(), &["--json"]].concat()))).unwrap();
    assert_eq!(v["format"], "dualedit-report-merge/1");
    let rows = v["rows"].as_array().unwrap();
    assert_eq!(rows.len(), 3, "{v:#}");
    let (train, eval, compare) = (&rows[0], &rows[1], &rows[2]);
    // The train report: its command, model, device, dtype, steps and last loss, a peak, time.
    assert_eq!((train["command"].as_str(), train["devices"].as_str(), train["dtype"].as_str()), (Some("train"), Some("cpu"), Some("f32")), "{train:#}");
    assert!(train["model"].as_str().unwrap().ends_with("data/model"), "{train:#}");
    assert_eq!(train["metrics"]["steps"], 2.0);
    assert!(train["metrics"]["final_loss"].as_f64().unwrap().is_finite());
    assert!(train["peak_bytes"]["main"].as_u64().unwrap() > 0 && train["wall_seconds"].as_f64().unwrap() > 0.0, "{train:#}");
    assert!(train["placement"].is_null(), "one device has no placement: {train:#}");
    // The eval report: EasyEdit's metrics as the report has them.
    let eval_report: Value = serde_json::from_str(&std::fs::read_to_string(&files[1]).unwrap()).unwrap();
    assert_eq!(eval["command"], "eval");
    for k in ["reliability", "generalization", "locality", "n"] {
        assert_eq!(eval["metrics"][k].as_f64(), eval_report["metrics"][k].as_f64(), "{k}");
        assert!(eval["metrics"][k].is_number(), "{k}: {eval:#}");
    }
    // compare.json: the split side, the ratio, agreement and both wall times.
    assert_eq!((compare["command"].as_str(), compare["devices"].as_str()), (Some("compare train"), Some("cuda:0 + cpu")));
    assert_eq!(compare["metrics"]["main_peak_ratio"], 0.6);
    assert_eq!(compare["metrics"]["metrics_agree"], 1.0);
    assert_eq!(compare["peak_bytes"], serde_json::json!({"main": 600, "sub": 700, "single main": 1000}));
    assert_eq!(compare["wall_seconds"], 5.0);

    // The table: a header, one line per report in the given order, the key metrics as columns.
    let table = ok(dualedit(&args));
    let lines: Vec<&str> = table.lines().collect();
    assert_eq!(lines.len(), 4, "{table}");
    for col in ["command", "devices", "placement", "reliability", "final_loss", "main_peak_ratio", "peaks", "wall"] {
        assert!(lines[0].contains(col), "header lacks {col}: {table}");
    }
    assert!(lines[1].starts_with("1  train") && lines[1].contains("data/model") && lines[1].contains("main "), "{table}");
    assert!(lines[2].starts_with("2  eval"), "{table}");
    assert!(lines[3].starts_with("3  compare train") && lines[3].contains("cuda:0 + cpu") && lines[3].contains("0.6000"), "{table}");
}

#[test]
fn bad_reports_are_one_clear_error_naming_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let other = dir.path().join("notes.json");
    std::fs::write(&other, r#"{"hello": 1}"#).unwrap();
    let broken = dir.path().join("broken.json");
    std::fs::write(&broken, "{ not json").unwrap();
    let missing = dir.path().join("missing.json");
    for (file, needle) in [(&other, "not a dualedit run report"), (&broken, "not JSON"), (&missing, "missing.json")] {
        let o = dualedit(&["report", "merge", s(file)]);
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(!o.status.success(), "{err}");
        assert!(err.contains(s(file)) && err.contains(needle), "{err}");
        assert_eq!(err.lines().count(), 1, "one line: {err}");
        assert!(o.stdout.is_empty());
    }
    // Only timelines: nothing to merge, said so.
    let t = dir.path().join("a.timeline.json");
    std::fs::write(&t, r#"{"samples": []}"#).unwrap();
    let o = dualedit(&["report", "merge", s(&t)]);
    assert!(!o.status.success() && String::from_utf8_lossy(&o.stderr).contains("none a report"));
    // No report at all: the usage error, nothing merged.
    let o = dualedit(&["report", "merge"]);
    assert!(!o.status.success() && String::from_utf8_lossy(&o.stderr).contains("REPORTS"));
}

/// Issue #48: a report of a newer format, or whose metrics are not numbers (its row would
/// be empty), is refused naming the file; a report of this format, or of a build before
/// the tag, merges.
#[test]
fn future_formats_and_non_numeric_metrics_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let report = |name: &str, format: Option<&str>, metrics: Value| {
        let mut v = serde_json::json!({
            "command": "eval", "model": "m", "dtype": "f32",
            "devices": {"main": "cpu", "sub": "cpu", "split": false},
            "metrics": metrics, "memory": {"main": {"peak_allocated_bytes": 10}}, "seconds": {"eval": 1.0},
        });
        if let Some(f) = format {
            v["format"] = f.into();
        }
        let p = dir.path().join(name);
        std::fs::write(&p, v.to_string()).unwrap();
        p
    };
    let good = serde_json::json!({"reliability": 1.0});
    let ok_now = report("now.json", Some(dualedit::run::report::REPORT_FORMAT), good.clone());
    let ok_old = report("old.json", None, good.clone());
    assert_eq!(dualedit::run::report_merge::merge(&[ok_now, ok_old]).unwrap().rows.len(), 2);
    for (file, needle) in [
        (report("future.json", Some("dualedit-run-report/2"), good.clone()), "newer dualedit"),
        (report("alien.json", Some("someone-else/1"), good.clone()), "not a dualedit run report"),
        (report("words.json", None, serde_json::json!({"reliability": "high"})), "not a number"),
        (report("empty.json", None, serde_json::json!({"method": "mend"})), "no numeric metric"),
    ] {
        let o = dualedit(&["report", "merge", s(&file)]);
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(!o.status.success() && err.contains(s(&file)) && err.contains(needle), "{}: {err}", file.display());
        assert!(o.stdout.is_empty());
    }
}

/// EasyEdit's own MEND as `scripts/gpu/easyedit_mend.py` timed it on the H200 (#51, kept in
/// `docs/gpu/`) merges into the table beside dualedit's reports; a failed run is refused
/// with its phase and error.
#[test]
fn easyedit_runs_merge_as_rows() {
    let dir = tempfile::tempdir().unwrap();
    let versus = common::json_file(&common::root().join("docs/gpu/gpu-versus-h200-2026-11-27.json"));
    let ee = dir.path().join("easyedit-vl7b.json");
    std::fs::write(&ee, versus["steps"]["vl7b"]["easyedit"].to_string()).unwrap();
    let ours = reports(dir.path());
    let out = ok(dualedit(&["report", "merge", "--json", s(&ee), s(&ours[0])]));
    let v: Value = serde_json::from_str(&out).unwrap();
    let row = &v["rows"][0];
    assert_eq!(row["command"], "easyedit mend", "{row}");
    assert_eq!((row["devices"].as_str(), row["dtype"].as_str()), (Some("cuda:0"), Some("bf16")), "{row}");
    assert_eq!(row["metrics"]["seconds_per_step"].as_f64(), Some(1.2546), "{row}");
    assert_eq!(row["peak_bytes"]["main"].as_u64(), Some(35014137856), "{row}");
    assert!(row["peak_bytes"]["edit"].as_u64().unwrap() > 0, "{row}");
    assert_eq!(v["rows"].as_array().unwrap().len(), 2);
    // The run whose import failed (the first H200 run) is refused, naming the phase.
    let failed = dir.path().join("failed.json");
    std::fs::write(&failed, versus["runs"]["dualedit_side"]["steps"]["vl7b"]["easyedit"].to_string()).unwrap();
    let o = dualedit(&["report", "merge", s(&failed)]);
    common::assert_clean_error(&o, &["failed.json", "failed in import", "sniffio"]);
}
