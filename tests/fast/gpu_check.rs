//! The GPU check (`scripts/gpu/check.py`, issue #38) run end to end on the CPU with a fake
//! device list and test-size models, so that the script a GPU machine runs cannot rot: its
//! JSON is parsed and every step's fields are checked.
use crate::common;
use std::path::Path;
use std::process::{Command, Output};

use serde_json::Value;

const BIN: &str = env!("CARGO_BIN_EXE_dualedit");


/// Runs the check with `args`; fails the test if python3 is missing (CI has it: `./x` uses it).
fn check(args: &[&str]) -> Output {
    Command::new("python3")
        .arg(common::root().join("scripts/gpu/check.py"))
        .args(args)
        .current_dir(common::root())
        .output()
        .expect("python3 runs scripts/gpu/check.py")
}

/// Whether this build knows logical CPU devices (`cpu:1`): then the split runs on one CPU.
fn logical_cpu_devices() -> bool {
    let model = common::root().join("data/model");
    let config = common::root().join("configs/world.json");
    Command::new(BIN)
        .args(["plan", "--model", model.to_str().unwrap(), "--config", config.to_str().unwrap()])
        .args(["--device", "cpu", "--sub-device", "cpu:1", "--placement", "balanced", "--json"])
        .output()
        .map(|o| o.status.success())
        .unwrap_or(false)
}

fn step<'a>(v: &'a Value, name: &str) -> &'a Value {
    let s = &v["steps"][name];
    assert!(s.is_object(), "step {name} missing: {v:#}");
    assert!(s["seconds"].as_f64().is_some(), "{name}: no seconds: {s:#}");
    s
}

fn ok<'a>(v: &'a Value, name: &str) -> &'a Value {
    let s = step(v, name);
    assert_eq!(s["status"], "ok", "{name}: {s:#}");
    // Every command a step ran is recorded with its exit status (the fixtures need none).
    let cmds = s["commands"].as_array().unwrap();
    assert!(name == "models" || !cmds.is_empty(), "{name}: no commands recorded: {s:#}");
    assert!(cmds.iter().all(|c| c["rc"].is_i64() && c["argv"].is_array()), "{name}: {s:#}");
    s
}

fn positive(x: &Value, what: &str) -> f64 {
    let n = x.as_f64().unwrap_or_else(|| panic!("{what}: not a number: {x}"));
    assert!(n.is_finite() && n > 0.0, "{what}: {n}");
    n
}

#[test]
fn the_gpu_check_runs_on_cpu_with_a_fake_device_list() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("check.json");
    let split = logical_cpu_devices();
    let sub = if split { "cpu:1" } else { "cpu" };
    let o = check(&[
        "--small",
        "--models",
        "fixtures",
        "--bin",
        BIN,
        "--device",
        "cpu",
        "--sub",
        sub,
        "--out",
        out.to_str().unwrap(),
        "--budget",
        "240",
    ]);
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "check.py failed: {stderr}");
    let v: Value = serde_json::from_str(&std::fs::read_to_string(&out).unwrap()).unwrap();
    assert_eq!(v["format"], "dualedit-gpu-check/1");
    assert_eq!((v["small"].as_bool(), v["device"].as_str(), v["sub_device"].as_str()), (Some(true), Some("cpu"), Some(sub)));
    assert_eq!(v["image_size"], serde_json::json!([84, 84]));

    let env = ok(&v, "environment");
    assert!(env["version"].as_str().unwrap().starts_with("dualedit "), "{env}");
    let models = ok(&v, "models");
    for k in ["gpt2-124m", "qwen2vl-2b", "qwen2vl-7b"] {
        assert!(models["models"][k]["source"].as_str().unwrap().starts_with("tests/fixtures/"), "{models:#}");
    }
    let data = ok(&v, "data");
    assert!(data["images_replaced"].as_u64().unwrap() >= 4, "{data:#}");
    // The pictures the VL steps read are the replaced ones, at the asked size.
    let png = std::fs::read(Path::new(data["vl_world"].as_str().unwrap()).join("images/scene-0000.png")).unwrap();
    assert_eq!((u32::from_be_bytes(png[16..20].try_into().unwrap()), u32::from_be_bytes(png[20..24].try_into().unwrap())), (84, 84));

    // Planner against the measured peak: every model planned and measured, one step trained.
    let p = ok(&v, "planner_vs_allocator");
    for k in ["default", "gpt2-124m", "qwen2vl-2b"] {
        let m = &p["models"][k];
        assert_eq!(m["status"], "ok", "{k}: {m:#}");
        let (planned, measured) = (positive(&m["planned_bytes"], k), positive(&m["measured_bytes"], k));
        assert!((m["planned_over_measured"].as_f64().unwrap() - planned / measured).abs() < 1e-3, "{m:#}");
        assert_eq!(m["measured_is"], "process RSS");
        positive(&m["loss"][0], k);
    }
    assert_eq!(p["models"]["default"]["dtype"], "f32");
    assert_eq!(p["models"]["qwen2vl-2b"]["dtype"], "bf16");

    // The 7B-shaped step: measured, planned (with the image's tokens), set against the seed.
    let s = ok(&v, "qwen2vl_7b_step");
    positive(&s["measured_bytes"], "7b measured");
    positive(&s["planned_bytes"], "7b planned");
    assert_eq!(s["seed_bytes"].as_f64(), Some(40e9));
    assert!(s["image_tokens"].as_u64().unwrap() > 0, "{s:#}");

    let (balanced, cap) = (step(&v, "single_vs_balanced"), step(&v, "max_memory_cap"));
    if split {
        assert_eq!(balanced["status"], "ok", "{balanced:#}");
        let placements = balanced["placements"].as_array().unwrap();
        assert_eq!(placements.len(), 2, "the split alone and with the optimiser on sub: {balanced:#}");
        for p in placements {
            assert_eq!(p["metrics_agree"], true, "the split changed the losses: {balanced:#}");
            assert_eq!(p["tolerance"].as_f64(), Some(1e-4), "f32's tolerance: {balanced:#}");
            positive(&p["main_peak_ratio"], "main peak ratio");
            positive(&p["dual"]["wall_seconds"], "dual wall");
        }
        assert_eq!(placements[1]["placement"], "balanced --optimizer-device sub", "{balanced:#}");
        // A CPU cannot be capped: the out-of-memory is injected, the diagnosis printed, and
        // the split under the same cap completes.
        assert_eq!(cap["status"], "ok", "{cap:#}");
        assert_eq!((cap["cap_enforced"].as_bool(), cap["single"]["out_of_memory"].as_bool()), (Some(false), Some(true)), "{cap:#}");
        assert!(cap["single"]["diagnosis"].as_str().unwrap().contains("what would make it fit"), "{cap:#}");
        assert_eq!(cap["balanced"]["completed"], true, "{cap:#}");
    } else {
        // Without logical CPU devices the split cannot run on one CPU: the failure is
        // recorded with the CLI's error, the cap step (which needs its peaks) skipped, and
        // the check went on to the 7B step.
        assert_eq!(balanced["status"], "failed", "{balanced:#}");
        assert!(balanced["error"].as_str().unwrap().contains("--sub-device"), "{balanced:#}");
        assert_eq!(cap["status"], "skipped", "{cap:#}");
    }
    // #38: the layer split over a chain of three devices (cpu + cpu:1,cpu:2) gives the
    // single device's losses, each crossing counted.
    let chain = step(&v, "chain");
    assert_eq!(v["chain"], "cpu:1,cpu:2");
    if split {
        assert_eq!(chain["status"], "ok", "{chain:#}");
        assert_eq!(chain["metrics_agree"], true, "{chain:#}");
        let crossings = chain["crossings"].as_array().unwrap();
        assert_eq!(crossings.len(), 2, "{chain:#}");
        for c in crossings {
            positive(&c["boundary_bytes"], "a crossing's bytes");
        }
        assert_eq!(chain["devices"]["chain"][0][0], "cpu:1", "{chain:#}");
    } else {
        assert_eq!(chain["status"], "failed", "{chain:#}");
    }
    let sum = &v["summary"];
    let total: u64 = ["ok", "failed", "skipped"].iter().map(|k| sum[k].as_u64().unwrap()).sum();
    // The 7B split needs a sub-device (skipped otherwise) and runs on the fixture here.
    let split7b = step(&v, "qwen2vl_7b_split");
    if split {
        assert_eq!(split7b["status"], "ok", "{split7b:#}");
        positive(&split7b["measured_main_bytes"], "7b split main");
        positive(&split7b["planned_main_bytes"], "7b split planned");
    }
    assert_eq!(total, 9, "{sum}");
}

/// A missing binary is one clear error naming it, before any step runs.
#[test]
fn a_missing_binary_is_one_clear_error() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("check.json");
    let o = check(&["--small", "--bin", "/nonexistent/dualedit", "--out", out.to_str().unwrap()]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success());
    assert!(err.contains("/nonexistent/dualedit") && err.contains("build.sh"), "{err}");
    assert!(!err.contains("Traceback"), "{err}");
    assert!(!out.exists());
}
