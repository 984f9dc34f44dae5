//! The embedded default: the build pipeline end to end at a small scale, the shipped
//! default's quality on its held-out edits, and the demo command.
use crate::common;
use std::path::Path;

use dualedit::config::MendConfig;
use dualedit::world::text::WorldConfig;
use dualedit::bootstrap::demo::{build_default, shipped_root, BuildSpec};
use dualedit::bootstrap::pretrain::PretrainConfig;
use dualedit::edit::MethodSpec;
use dualedit::run::{run_eval, Common, EvalOptions};
use tch::Device;

/// The tests of this file run one at a time: the demo's time limit is about the demo, not
/// about sharing two cores with a pretraining run.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

#[test]
fn pipeline_runs_end_to_end_at_small_scale() {
    let _serial = serial();
    let dir = tempfile::tempdir().unwrap();
    let spec = BuildSpec {
        world: WorldConfig { seed: 3, n_entities: 24, n_edit_train: 60, n_edit_holdout: 10 },
        pretrain: PretrainConfig { n_embd: 64, n_layer: 2, n_head: 2, steps: 600, vocab_size: 400, ..PretrainConfig::default() },
        mend: MendConfig {
            rank: 16,
            lr: 1e-3,
            edit_lr: 1e-3,
            lr_lr: 1e-3,
            c_edit: 1.0,
            accumulate: 2,
            max_steps: 40,
            val_every: 20,
            val_records: 10,
            max_length: 32,
            ..MendConfig::default()
        },
        // The editor for many edits: the output projection of the last block, batches of 4.
        many: Some(MendConfig {
            edit_params: vec!["transformer.h.1.mlp.c_proj.weight".into()],
            rank: 16,
            lr: 1e-3,
            edit_lr: 1e-3,
            lr_lr: 1e-3,
            c_edit: 1.0,
            batch_size: 4,
            accumulate: 1,
            max_steps: 10,
            val_every: 10,
            val_records: 10,
            max_length: 32,
            ls: dualedit::config::LsConfig { lambda: 1e-6, cov_weight: 0.1, rounds: 3 },
            ..MendConfig::default()
        }),
    };
    let rep = build_default(dir.path(), &spec, Device::Cpu).unwrap();
    // The tiny model learned most of its small world.
    assert!(rep.pretrain.fact_accuracy > 0.5, "fact accuracy {}", rep.pretrain.fact_accuracy);
    for f in ["model/config.json", "model/model.safetensors", "model/tokenizer.json", "editor/editor.safetensors", "world/edits-holdout.json", "editor-many/editor.safetensors"] {
        assert!(dir.path().join(f).exists(), "{f} missing");
    }
    // The editor for many edits ships without its optimiser state, with its mend-ls settings.
    assert_eq!(rep.many_train_steps, Some(10));
    assert!(!dir.path().join("editor-many/train_state.safetensors").exists());
    let meta = std::fs::read_to_string(dir.path().join("editor-many/editor.json")).unwrap();
    assert!(meta.contains(r#""rounds": 3"#), "{meta}");
    // ... its key statistics over the world's corpus, and the first editor names it, so
    // that `--method auto` (the default) edits several requests with it (issue #36).
    assert!(meta.contains(r#""key_stats": "key-stats.safetensors""#), "{meta}");
    assert!(dir.path().join("editor-many/key-stats.safetensors").is_file());
    let first = std::fs::read_to_string(dir.path().join("editor/editor.json")).unwrap();
    assert!(first.contains(r#""many_editor": "../editor-many""#), "{first}");
    assert_eq!(rep.holdout.n, 10);
    // Forty steps of meta-training at this scale make no promise about quality (the shipped
    // default's test does); the evaluation must still produce sane numbers.
    let h = &rep.holdout;
    for v in [h.reliability, h.generalization.unwrap_or(-1.0), h.locality.unwrap_or(-1.0), h.edit_success] {
        assert!((0.0..=1.0).contains(&v), "{h:?}");
    }
    assert!(h.nll_pre.is_finite() && h.nll_post.is_finite(), "{h:?}");
}

#[test]
fn shipped_default_meets_its_targets() {
    let _serial = serial();
    let root = shipped_root();
    let opts = EvalOptions {
        common: Common { report: Some(std::env::temp_dir().join(format!("dualedit-default-{}.json", std::process::id()))), ..Common::single(root.join("model"), Device::Cpu) },
        method: MethodSpec::Mend { editor: root.join("editor") },
        data: root.join("world/edits-holdout.json"),
        ds: dualedit::data::DatasetKind::Counterfact,
        limit: None,
        max_length: 64,
        capacity: None,
    };
    let (out, _) = run_eval(&opts, |_, _| {}).unwrap();
    let s = &out.summary;
    println!("shipped default on held-out edits: {s:?}");
    assert!(s.reliability >= 0.9, "reliability {}", s.reliability);
    assert!(s.locality.is_some_and(|l| l >= 0.9), "locality {:?}", s.locality);
    // The embedded defaults stay small; the real default (`real/`: its editor, and the
    // model `./x` converts there, never committed) is another matter.
    let size: u64 = walk(&root, &root.join("real"));
    assert!(size < 30 * 1024 * 1024, "data/ is {size} bytes");
}

/// Bytes of the files under `p`, the folder `skip` left out.
fn walk(p: &Path, skip: &Path) -> u64 {
    std::fs::read_dir(p)
        .unwrap()
        .map(|e| {
            let e = e.unwrap();
            if e.path() == skip {
                0
            } else if e.file_type().unwrap().is_dir() {
                walk(&e.path(), skip)
            } else {
                e.metadata().unwrap().len()
            }
        })
        .sum()
}

#[test]
fn demo_shows_edits_metrics_and_memory_quickly() {
    let _serial = serial();
    let start = std::time::Instant::now();
    let out = common::dualedit_cmd().args(["demo"]).output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    for needle in ["before:", "after:", "rephrase after:", "unrelated:", "reliability", "generalization", "locality", "peak memory"] {
        assert!(stdout.contains(needle), "demo output lacks {needle:?}:\n{stdout}");
    }
    assert!(start.elapsed().as_secs() < 60, "demo took {:?}", start.elapsed());
}
