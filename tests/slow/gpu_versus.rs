//! The side-by-side with EasyEdit (`scripts/gpu/versus.py`, issue #51) run end to end on
//! the CPU at test size: EasyEdit's own MEND from the carried archive and dualedit on the
//! same models and records, every step ok and every row with both tools' numbers, so the
//! script a GPU machine runs cannot rot between the rare sessions that have one.
//!
//! It needs what `scripts/gpu/easyedit_env.sh --test-site` prepares (PyPI and EasyEdit's
//! repository at its pinned commit): `.easyedit/easyedit-env.tar.xz`, the archive a GPU
//! machine gets, and `.easyedit/image-site`, the GPU image's packages (transformers 5.17,
//! ...) for this machine's Python. Without them it says so and skips
//! (`DUALEDIT_REQUIRE_EASYEDIT=1` makes that a failure).
use crate::common;
use std::process::Command;

use serde_json::Value;

const BIN: &str = env!("CARGO_BIN_EXE_dualedit");

#[test]
fn versus_easyedit_dry_run_on_cpu() {
    let root = common::root();
    let archive = root.join(".easyedit/easyedit-env.tar.xz");
    let site = root.join(".easyedit/image-site");
    if !archive.is_file() || !site.is_dir() || !root.join("data/real/model/config.json").is_file() {
        let msg = "no .easyedit/easyedit-env.tar.xz + .easyedit/image-site (scripts/gpu/easyedit_env.sh --test-site) or no data/real/model (./x demo --real): the EasyEdit dry run is skipped";
        assert!(
            std::env::var("DUALEDIT_REQUIRE_EASYEDIT").as_deref() != Ok("1"),
            "{msg}"
        );
        eprintln!("{msg}");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("versus.json");
    let o = Command::new(root.join(".venv/bin/python"))
        .arg(root.join("scripts/gpu/versus.py"))
        .args([
            "--small", "--device", "cpu", "--sub", "cpu:1", "--bin", BIN, "--budget", "900",
        ])
        .arg("--out")
        .arg(&out)
        .arg("--python")
        .arg(root.join(".venv/bin/python"))
        .env("PYTHONPATH", &site)
        .current_dir(&root)
        .output()
        .expect("the venv's python runs scripts/gpu/versus.py");
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "versus.py failed: {stderr}");
    let v: Value = serde_json::from_slice(&std::fs::read(&out).unwrap()).unwrap();
    assert_eq!(v["format"], "dualedit-gpu-versus/1");
    for name in [
        "environment",
        "easyedit",
        "models",
        "data",
        "vl7b",
        "real",
        "vl7b_edit",
        "vl2b",
    ] {
        assert_eq!(
            v["steps"][name]["status"], "ok",
            "{name}: {:#}",
            v["steps"][name]
        );
    }
    // EasyEdit ran its own trainer, from the pinned commit, with the network-free import.
    let ee = &v["steps"]["vl7b"]["easyedit"];
    assert_eq!(ee["phase"], "done", "{ee:#}");
    assert_eq!(
        ee["easyedit"]["commit"].as_str().map(str::len),
        Some(40),
        "{ee:#}"
    );
    assert!(
        ee["inner_params"][0]
            .as_str()
            .unwrap()
            .starts_with("model.language_model.layers."),
        "{ee:#}"
    );
    // Every measurement has both tools' numbers and their ratio: 3 placements of the 7B
    // step (time, main peak; sub peak for the split), its edit, two dtypes of the real
    // model (step and edit) and the 2B step.
    let rows = v["rows"].as_array().unwrap();
    assert_eq!(rows.len(), 7 + 2 + 2 * 4 + 2, "{:#}", v["rows"]);
    for r in rows {
        for k in ["dualedit", "easyedit", "ratio"] {
            let x = r[k]
                .as_f64()
                .unwrap_or_else(|| panic!("{}: {k} missing: {r:#}", r["measurement"]));
            assert!(x.is_finite() && x > 0.0, "{r:#}");
        }
    }
    assert!(v["markdown"].as_str().unwrap().lines().count() == rows.len() + 2);
    // The dualedit side read its per-step times: the first (warm-up) step is left out.
    let single = &v["steps"]["vl7b"]["dualedit"]["single"];
    assert_eq!(
        single["step_seconds"].as_array().unwrap().len(),
        3,
        "{single:#}"
    );
    // The synced run's timeline gives each phase its time; an edit's diagnostic ran.
    let synced = &v["steps"]["vl7b"]["dualedit"]["single-opt-cpu-synced"];
    assert!(synced["phase_seconds"]["main/editor"].as_f64().is_some_and(|s| s > 0.0), "{synced:#}");
    assert!(v["steps"]["vl7b_edit"]["dualedit"]["mean_of_5_same"].as_f64().is_some_and(|s| s > 0.0));
}
