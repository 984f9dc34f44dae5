//! The device split on a CPU-only machine: a split plan on one device runs the replica,
//! the mover, the worker thread and the cross-device backward, and must give the same
//! numbers as the single-device run.
use crate::common;
use std::path::PathBuf;

use common::{fixture, TRAIN_RECORDS};

use dualedit::run::compare::{compare_eval, compare_train};
use dualedit::config::MendConfig;
use dualedit::data::DatasetKind;
use dualedit::device::{memory, DevicePlan};
use dualedit::edit::MethodSpec;
use dualedit::run::{Common, EvalOptions, TrainOptions};
use tch::Device;

fn common(report: PathBuf) -> Common {
    Common { seed: 5, report: Some(report), ..Common::single(fixture("gpt2"), Device::Cpu) }
}

#[test]
fn split_training_and_evaluation_match_single_device() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("cf.json");
    std::fs::write(&data, TRAIN_RECORDS).unwrap();
    let config = MendConfig {
        rank: 16,
        lr: 1e-3,
        edit_lr: 1e-3,
        accumulate: 2,
        max_steps: 6,
        val_every: 3,
        val_records: 1,
        max_length: 64,
        ..MendConfig::default()
    };
    let opts = TrainOptions {
        common: common(dir.path().join("unused.json")),
        data: data.clone(),
        ds: DatasetKind::Counterfact,
        config,
        out: dir.path().join("train"),
        limit: None,
        resume: false,
        init: None,
        progress: false,
    };
    let split = DevicePlan::split_on(Device::Cpu, Device::Cpu);
    let c = compare_train(&opts, split).unwrap();
    assert!(c.single.metrics.len() >= 6, "{:?}", c.single.metrics);
    assert!(c.metrics_agree, "train: max relative difference {}", c.max_relative_difference);
    for (k, a) in &c.single.metrics {
        let b = c.dual.metrics[k];
        assert!((a - b).abs() <= 1e-5 * (1.0 + a.abs()), "{k}: single {a} vs dual {b}");
    }
    assert!(dir.path().join("train/compare.json").exists());
    assert!(dualedit::run::compare::table(&c).contains("metrics agree: yes"));

    // Evaluation with the editor just trained.
    let eval = EvalOptions {
        common: common(dir.path().join("eval.json")),
        method: MethodSpec::Mend { editor: dir.path().join("train/single") },
        data,
        ds: DatasetKind::Counterfact,
        limit: None,
        max_length: 64,
        capacity: None,
    };
    let c = compare_eval(&eval, split, dir.path()).unwrap();
    assert!(c.metrics_agree, "eval: max relative difference {}", c.max_relative_difference);
    // Both reports carry per-role memory figures.
    for side in [&c.single, &c.dual] {
        for role in ["main", "sub"] {
            let m = &side.memory[role];
            assert!(m.peak_allocated_bytes > 0 && m.process_wide && m.device == "cpu");
        }
    }
}

#[test]
fn same_device_flags_mean_single_device() {
    let plan = DevicePlan::parse("cpu", Some("cpu")).unwrap();
    assert!(!plan.split);
    assert!(!DevicePlan::parse("cpu", None).unwrap().split);
    assert!(!DevicePlan::parse("cpu:1", Some("cpu:1")).unwrap().split);
    assert!(DevicePlan::split_on(Device::Cpu, Device::Cpu).split);
    assert_eq!(DevicePlan::split_on(Device::Cpu, Device::Cpu).sub_name(), "cpu:1");
    // Logical CPU devices: one libtorch device, two names, a split plan.
    for sub in ["cpu:1", "cpu:2", "cpu:17"] {
        let plan = DevicePlan::parse("cpu", Some(sub)).unwrap();
        assert!(plan.split && plan.main == Device::Cpu && plan.sub == Device::Cpu, "{sub}");
        assert_eq!((plan.main_name(), plan.sub_name()), ("cpu".to_string(), sub.to_string()));
    }
    assert_eq!(DevicePlan::parse("cpu:0", Some("cpu")).unwrap().split, false);
    // Issue #48: spellings usize's parser takes that no user means.
    for bad in ["cpu:", "cpu:x", "cpu:-1", "cpu1", "cpu:01", "cpu:+1", " cpu:1", "cpu:1 ", "cuda:007"] {
        let err = DevicePlan::parse("cpu", Some(bad)).unwrap_err().to_string();
        assert!(err.contains(bad) && err.contains("cpu:N"), "{bad}: {err}");
    }
    let err = DevicePlan::parse("cpu", Some("gpu7")).unwrap_err().to_string();
    assert!(err.contains("gpu7"), "{err}");
}

#[test]
fn memory_shim_reports_no_accelerator_cleanly_on_cpu() {
    if tch::Cuda::device_count() > 0 {
        return; // a GPU machine: the shim has real figures to report
    }
    assert_eq!(memory::accelerator_count(), 0);
    let err = memory::sample(Device::Cuda(0)).unwrap_err().to_string();
    assert!(err.contains("no accelerator"), "{err}");
    memory::empty_cache();
    let cpu = memory::sample(Device::Cpu).unwrap();
    assert!(cpu.process_wide && cpu.peak_allocated_bytes >= cpu.current_allocated_bytes);
}

fn run_cli(args: &[&str], envs: &[(&str, &str)]) -> std::process::Output {
    let mut cmd = common::dualedit_cmd();
    cmd.args(args).env("OMP_NUM_THREADS", "1");
    for (k, v) in envs {
        cmd.env(k, v);
    }
    cmd.output().unwrap()
}


/// `compare train --device cpu --sub-device cpu:1` from the command line: the dual side
/// takes the real split path (replica, then the layer split), the mover carries and counts
/// bytes, and every loss and validation figure equals the single-device run's. The same
/// runs show the progress lines a log gets (stderr is a pipe here, not a terminal) and a
/// memory timeline that covers the whole run.
#[test]
fn logical_cpu_device_runs_the_split_from_the_command_line() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("cf.json");
    std::fs::write(&data, TRAIN_RECORDS).unwrap();
    let cfg = dir.path().join("cfg.json");
    std::fs::write(&cfg, r#"{"rank": 8, "accumulate": 1, "max_steps": 10, "val_every": 5, "val_records": 1, "max_length": 64}"#).unwrap();
    let model = fixture("gpt2");
    for placement in ["replica", "balanced"] {
        let out = dir.path().join(placement);
        let o = run_cli(
            &[
                "compare", "train", "--model", model.to_str().unwrap(), "--data", data.to_str().unwrap(), "--ds", "counterfact",
                "--config", cfg.to_str().unwrap(), "--out", out.to_str().unwrap(), "--device", "cpu", "--sub-device", "cpu:1",
                "--placement", placement,
            ],
            &[("DUALEDIT_PROGRESS_SECS", "3600"), ("DUALEDIT_SAMPLE_MS", "10")],
        );
        let stderr = String::from_utf8_lossy(&o.stderr);
        let stdout = String::from_utf8_lossy(&o.stdout);
        assert!(o.status.success(), "{placement}:\n{stderr}");
        assert!(stdout.contains("metrics agree: yes") && stdout.contains("cpu + cpu:1"), "{placement}:\n{stdout}");
        let cmp = common::json_file(&out.join("compare.json"));
        assert_eq!(cmp["metrics_agree"], true, "{cmp}");
        let single = cmp["single"]["metrics"].as_object().unwrap();
        assert!(single.len() >= 10, "{cmp}");
        for (k, a) in single {
            let (a, b) = (a.as_f64().unwrap(), cmp["dual"]["metrics"][k].as_f64().unwrap());
            assert!((a - b).abs() <= 1e-5 * (1.0 + a.abs()), "{placement} {k}: single {a} vs dual {b}");
        }
        let dual = common::json_file(std::path::Path::new(cmp["dual"]["report"].as_str().unwrap()));
        assert_eq!(dual["devices"]["split"], true, "{dual}");
        assert_eq!((dual["devices"]["main"].as_str(), dual["devices"]["sub"].as_str()), (Some("cpu"), Some("cpu:1")));
        assert_eq!(dual["devices"]["placement"], placement);
        assert!(dual["moved"]["bytes_to_sub"].as_u64().unwrap() > 0 && dual["moved"]["transfers"].as_u64().unwrap() > 0, "{}", dual["moved"]);
        if placement == "balanced" {
            assert!(dual["moved"]["boundary_crossings"].as_u64().unwrap() > 0, "{}", dual["moved"]);
        }
        let single_report = common::json_file(std::path::Path::new(cmp["single"]["report"].as_str().unwrap()));
        assert_eq!(single_report["moved"]["bytes_to_sub"], 0);

        // Progress: both runs write a line at every tenth of their 10 steps, with the
        // step, the loss, the elapsed time and an ETA; no bar escape codes in a log.
        let lines: Vec<&str> = stderr.lines().filter(|l| l.starts_with("progress: train ")).collect();
        for step in 1..=10 {
            let n = lines.iter().filter(|l| l.contains(&format!(" {step}/10 ({}%)", step * 10))).count();
            assert_eq!(n, 2, "step {step}: {lines:#?}");
        }
        assert!(lines.iter().all(|l| l.contains(" loss ") && l.contains("elapsed ") && l.contains("ETA ")), "{lines:#?}");
        assert!(!stderr.contains('\u{1b}'), "escape codes in a log:\n{stderr}");

        // The timeline: steady samples between the marks, from the start to the end.
        let tl = common::json_file(std::path::Path::new(dual["timeline_file"].as_str().unwrap()));
        let samples = tl["samples"].as_array().unwrap();
        let ms: Vec<f64> = samples.iter().map(|s| s["elapsed_ms"].as_f64().unwrap()).collect();
        assert!(ms.windows(2).all(|w| w[1] >= w[0]));
        let wall_ms: f64 = dual["seconds"].as_object().unwrap().values().map(|v| v.as_f64().unwrap()).sum::<f64>() * 1e3;
        let sampled: Vec<f64> = samples.iter().filter(|s| s["phase"] == "sampled").map(|s| s["elapsed_ms"].as_f64().unwrap()).collect();
        assert!(!sampled.is_empty(), "no steady samples");
        // No gap between two samples is longer than a few sampler intervals (the run's
        // phases all lie between the first and the last sample).
        let gap = ms.windows(2).map(|w| w[1] - w[0]).fold(0.0, f64::max);
        assert!(gap < 2_000.0 || gap < 0.25 * wall_ms, "a {gap} ms gap in a {wall_ms} ms run");
        assert!(ms[ms.len() - 1] >= 0.9 * wall_ms, "timeline ends at {} ms of {wall_ms} ms", ms[ms.len() - 1]);
        assert!(out.join("dual/report.timeline.png").exists());
    }
}

#[test]
fn compare_refuses_a_dual_side_on_the_same_device() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("cf.json");
    std::fs::write(&data, TRAIN_RECORDS).unwrap();
    let model = fixture("gpt2");
    let out = dir.path().join("out");
    let o = run_cli(
        &[
            "compare", "train", "--model", model.to_str().unwrap(), "--data", data.to_str().unwrap(), "--ds", "counterfact", "--config",
            concat!(env!("CARGO_MANIFEST_DIR"), "/configs/world.json"), "--out", out.to_str().unwrap(), "--device", "cpu", "--sub-device", "cpu",
        ],
        &[],
    );
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success(), "{stderr}");
    assert!(stderr.contains("same device") && stderr.contains("cpu:1"), "{stderr}");
    assert!(!out.join("single").exists(), "ran before refusing");
}
