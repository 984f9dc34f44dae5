//! The device split on a CPU-only machine: a split plan on one device runs the replica,
//! the mover, the worker thread and the cross-device backward, and must give the same
//! numbers as the single-device run.
mod common;
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
    assert!(DevicePlan::split_on(Device::Cpu, Device::Cpu).split);
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
