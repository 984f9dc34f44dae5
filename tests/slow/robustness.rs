//! Long-run robustness: resume equals an uninterrupted run, a killed checkpoint write
//! never corrupts the previous checkpoint, out-of-memory and persistent NaN stop with a
//! diagnosis after saving, bad files give one clear error.
use crate::common;
use std::path::Path;

use common::{fixture, TRAIN_RECORDS};
use std::process::Command;

use dualedit::config::{MendConfig, SelectBy};
use dualedit::data::DatasetKind;
use dualedit::device::DevicePlan;
use dualedit::run::{run_train, Common, TrainOptions};
use tch::{Device, Kind};

fn options(dir: &Path, out: &str, config: MendConfig, resume: bool) -> TrainOptions {
    let data = dir.join("cf.json");
    if !data.exists() {
        std::fs::write(&data, TRAIN_RECORDS).unwrap();
    }
    TrainOptions {
        common: Common { seed: 11, report: Some(dir.join(format!("{out}-report.json"))), ..Common::single(fixture("gpt2"), Device::Cpu) },
        data,
        ds: DatasetKind::Counterfact,
        config,
        out: dir.join(out),
        limit: None,
        resume,
        init: None,
        progress: false,
    }
}

fn config(max_steps: usize) -> MendConfig {
    MendConfig {
        rank: 16,
        lr: 1e-3,
        edit_lr: 1e-3,
        lr_lr: 1e-3,
        accumulate: 2,
        max_steps,
        val_every: 2,
        val_records: 1,
        early_stop_patience: 100,
        max_length: 64,
        ..MendConfig::default()
    }
}

#[test]
fn resume_continues_with_the_same_losses() {
    let dir = tempfile::tempdir().unwrap();
    let (full, _) = run_train(&options(dir.path(), "full", config(8), false)).unwrap();
    let (first, _) = run_train(&options(dir.path(), "part", config(4), false)).unwrap();
    assert_eq!(first.steps, 4);
    let (rest, _) = run_train(&options(dir.path(), "part", config(8), true)).unwrap();
    assert_eq!(rest.history.first().map(|h| h.step), Some(5), "resumed run starts after step 4");
    for (a, b) in full.history[4..].iter().zip(&rest.history) {
        assert_eq!(a.step, b.step);
        assert!((a.losses.loss - b.losses.loss).abs() <= 1e-6 * (1.0 + a.losses.loss.abs()), "step {}: {} vs {}", a.step, a.losses.loss, b.losses.loss);
    }
}

/// The best validation so far is measured by `select_by`; resuming with the other criterion
/// starts the selection over instead of comparing a loss with −(edit_acc + loc_acc).
#[test]
fn resume_with_another_select_by_restarts_selection() {
    let dir = tempfile::tempdir().unwrap();
    let by_accuracy = MendConfig { select_by: SelectBy::Accuracy, ..config(4) };
    let (first, _) = run_train(&options(dir.path(), "sel", by_accuracy, false)).unwrap();
    assert!(first.best_val_loss <= 0.0, "accuracy criterion is −(edit_acc + loc_acc): {}", first.best_val_loss);
    let (rest, _) = run_train(&options(dir.path(), "sel", config(6), true)).unwrap();
    assert!(rest.best_val_loss > 0.0, "after resuming with select_by loss the best is a loss: {}", rest.best_val_loss);
}

#[test]
fn killed_while_checkpointing_leaves_a_loadable_checkpoint() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("cf.json");
    std::fs::write(&data, TRAIN_RECORDS).unwrap();
    let cfg = dir.path().join("cfg.json");
    // Validate (and write checkpoints) every step, so kills land inside writes often.
    std::fs::write(&cfg, r#"{"rank": 64, "accumulate": 1, "max_steps": 100000, "val_every": 1, "val_records": 1, "early_stop_patience": 100000, "max_length": 64, "lr": 1e-4}"#).unwrap();
    let out = dir.path().join("ed");
    for (i, wait_ms) in [150u64, 230, 310, 470].iter().enumerate() {
        let mut child = common::dualedit_cmd()
            .args(["train", "--model", fixture("gpt2").to_str().unwrap(), "--data", data.to_str().unwrap(), "--ds", "counterfact"])
            .args(["--config", cfg.to_str().unwrap(), "--out", out.to_str().unwrap()])
            .args(if i > 0 { vec!["--resume"] } else { vec![] })
            .stderr(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .spawn()
            .unwrap();
        // Wait for the run to be writing checkpoints (one per step), then kill it at an
        // arbitrary moment: with a write every step, kills land inside writes often.
        let spawned = std::time::SystemTime::now();
        let written_since_spawn = || {
            std::fs::metadata(out.join("train_state.safetensors")).and_then(|m| m.modified()).map(|t| t > spawned).unwrap_or(false)
        };
        let start = std::time::Instant::now();
        while !written_since_spawn() && start.elapsed().as_secs() < 120 {
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        assert!(written_since_spawn(), "round {i}: the run wrote no checkpoint within 120 s");
        std::thread::sleep(std::time::Duration::from_millis(*wait_ms));
        child.kill().unwrap(); // SIGKILL: no chance to clean up
        child.wait().unwrap();
        assert!(out.join("editor.safetensors").exists(), "no checkpoint was written");
        let lm = dualedit::model::load_model(&fixture("gpt2"), Device::Cpu, Kind::Float).unwrap();
        let engine = dualedit::mend::Engine::new(lm, DevicePlan::single(Device::Cpu), &[]).unwrap();
        dualedit::mend::checkpoint::load_editor(&out, &engine).expect("checkpoint loads after a kill");
        // The run's own config: --resume (and so load_state) refuses another one.
        let mut editor = dualedit::mend::Editor::new(&MendConfig::from_file(&cfg).unwrap(), engine.edit_params.clone(), Device::Cpu, 0).unwrap();
        dualedit::mend::checkpoint::load_state(&out, &mut editor).expect("training state loads after a kill");
    }
}

#[test]
fn out_of_memory_stops_with_a_diagnosis_after_saving() {
    let dir = tempfile::tempdir().unwrap();
    let opts = options(dir.path(), "oom", config(6), false);
    let cfg = dir.path().join("cfg.json");
    std::fs::write(&cfg, serde_json::to_string(&opts.config).unwrap()).unwrap();
    let out = common::dualedit_cmd()
        .env(dualedit::mend::train::FAULT_OOM_STEP, "3")
        .args(["train", "--model", fixture("gpt2").to_str().unwrap(), "--data", opts.data.to_str().unwrap()])
        .args(["--ds", "counterfact", "--config", cfg.to_str().unwrap(), "--out", opts.out.to_str().unwrap()])
        // Not enforced on the CPU, but what the planner's advice is checked against.
        .args(["--max-memory", "cpu=1MiB"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(!err.contains("panicked"), "{err}");
    // The planner's answer for these caps: nothing on this CPU-only machine fits 1 MiB.
    for needle in ["placement advice (planner): no placement fits --max-memory cpu=1.0 MiB", "cpu needs", "no other device here"] {
        assert!(err.contains(needle), "diagnosis lacks {needle:?}: {err}");
    }
    for needle in ["out of memory", "step 3", "phase", "main", "what would make it fit", "--sub-device", "bf16", "--resume"] {
        assert!(err.contains(needle), "diagnosis lacks {needle:?}: {err}");
    }
    assert!(opts.out.join("train_state.safetensors").exists());
    assert!(opts.out.join("editor.safetensors").exists());
    // And the run continues from there.
    let (rep, _) = run_train(&options(dir.path(), "oom", config(6), true)).unwrap();
    assert_eq!(rep.steps, 6);
    assert_eq!(rep.history.first().map(|h| h.step), Some(4));
}

#[test]
fn persistent_nan_stops_the_run_and_keeps_the_state() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = MendConfig { edit_lr: 1e38, max_bad_steps: 3, ..config(20) };
    let err = run_train(&options(dir.path(), "nan", cfg, false)).unwrap_err().to_string();
    assert!(err.contains("non-finite") && err.contains("3 consecutive"), "{err}");
    assert!(dir.path().join("nan/train_state.safetensors").exists());
}

fn cli(args: &[&str]) -> (bool, String) {
    let out = common::dualedit_cmd().args(args).output().unwrap();
    (out.status.success(), String::from_utf8_lossy(&out.stderr).into_owned())
}

#[test]
fn bad_files_give_one_clear_error() {
    let dir = tempfile::tempdir().unwrap();
    let model = fixture("gpt2");
    let m = model.to_str().unwrap();
    // Truncated data file.
    let data = dir.path().join("trunc.json");
    std::fs::write(&data, &TRAIN_RECORDS[..TRAIN_RECORDS.len() / 2]).unwrap();
    let (ok, err) = cli(&["eval", "--model", m, "--method", "unedited", "--data", data.to_str().unwrap(), "--ds", "counterfact"]);
    assert!(!ok && err.contains("trunc.json") && err.trim().lines().count() == 1, "{err}");
    // Unknown --ds.
    let (ok, err) = cli(&["eval", "--model", m, "--method", "unedited", "--data", data.to_str().unwrap(), "--ds", "squad"]);
    assert!(!ok && err.contains("squad"), "{err}");
    // An editor trained for another model.
    let good = dir.path().join("cf.json");
    std::fs::write(&good, TRAIN_RECORDS).unwrap();
    let (rep, _) = run_train(&options(dir.path(), "ed", config(2), false)).unwrap();
    let (ok, err) = cli(&[
        "eval", "--model", fixture("qwen2").to_str().unwrap(), "--editor", rep.editor_dir.to_str().unwrap(),
        "--data", good.to_str().unwrap(), "--ds", "counterfact",
    ]);
    assert!(!ok && err.contains("another model"), "{err}");
    // A truncated editor checkpoint.
    let ed = rep.editor_dir.join("editor.safetensors");
    let bytes = std::fs::read(&ed).unwrap();
    std::fs::write(&ed, &bytes[..bytes.len() / 3]).unwrap();
    let (ok, err) = cli(&["eval", "--model", m, "--editor", rep.editor_dir.to_str().unwrap(), "--data", good.to_str().unwrap(), "--ds", "counterfact"]);
    assert!(!ok && err.contains("editor.safetensors") && err.trim().lines().count() == 1, "{err}");
    // Impossible config values.
    let cfg = dir.path().join("bad.json");
    std::fs::write(&cfg, r#"{"rank": 0}"#).unwrap();
    let (ok, err) = cli(&["train", "--model", m, "--data", good.to_str().unwrap(), "--ds", "counterfact", "--config", cfg.to_str().unwrap(), "--out", dir.path().join("x").to_str().unwrap()]);
    assert!(!ok && err.contains("bad.json") && err.contains("rank"), "{err}");
    // An empty data file.
    std::fs::write(&data, "[]").unwrap();
    let (ok, err) = cli(&["eval", "--model", m, "--method", "unedited", "--data", data.to_str().unwrap(), "--ds", "counterfact"]);
    assert!(!ok && err.contains("no records"), "{err}");
    // A BPE vocabulary smaller than the byte alphabet.
    let (ok, err) = cli(&["pretrain", "--data", good.to_str().unwrap(), "--ds", "counterfact", "--out", dir.path().join("p").to_str().unwrap(), "--vocab", "100"]);
    assert!(!ok && err.contains("--vocab") && err.contains("257"), "{err}");
    assert!(!dir.path().join("p").exists(), "nothing is written for a refused run");
}

/// Nothing a user wrote or trained is replaced: a trained editor in --out (without
/// --resume), a model folder given to --save (the source model included), an input file
/// given as --report. Each is refused up front with one error naming the path.
#[test]
fn user_files_are_never_overwritten() {
    let dir = tempfile::tempdir().unwrap();
    let (rep, _) = run_train(&options(dir.path(), "ed", config(2), false)).unwrap();
    let editor = rep.editor_dir.join("editor.safetensors");
    let before = std::fs::read(&editor).unwrap();
    let err = run_train(&options(dir.path(), "ed", config(2), false)).unwrap_err().to_string();
    assert!(err.contains("already holds an editor") && err.contains("`resume`"), "{err}");
    std::fs::remove_file(rep.editor_dir.join("train_state.safetensors")).unwrap();
    let err = run_train(&options(dir.path(), "ed", config(2), true)).unwrap_err().to_string();
    assert!(err.contains("no training state"), "{err}");
    assert_eq!(std::fs::read(&editor).unwrap(), before, "the editor is untouched");

    // --save into a folder that holds a model (here: a copy of the source model).
    let model = dir.path().join("model");
    std::fs::create_dir(&model).unwrap();
    for f in ["config.json", "model.safetensors", "tokenizer.json"] {
        std::fs::copy(fixture("gpt2").join(f), model.join(f)).unwrap();
    }
    let weights = std::fs::read(model.join("model.safetensors")).unwrap();
    let requests = dir.path().join("cf.json");
    let (r, m) = (requests.to_str().unwrap(), model.to_str().unwrap());
    let (ok, err) = cli(&["edit", "--model", m, "--method", "ft", "--requests", r, "--save", m]);
    assert!(!ok && err.contains("already holds a model") && err.trim().lines().count() == 1, "{err}");
    assert_eq!(std::fs::read(model.join("model.safetensors")).unwrap(), weights);

    // --report naming the data file.
    let data = std::fs::read(&requests).unwrap();
    let (ok, err) = cli(&["eval", "--model", m, "--method", "unedited", "--data", r, "--ds", "counterfact", "--report", r]);
    assert!(!ok && err.contains("--report") && err.contains("not a dualedit run report"), "{err}");
    assert_eq!(std::fs::read(&requests).unwrap(), data);
}

/// A run that saves no editor (nothing to train, or no finite validation) is an error, not
/// a success that points at a missing file.
#[test]
fn a_run_without_an_editor_fails() {
    let dir = tempfile::tempdir().unwrap();
    let err = run_train(&options(dir.path(), "zero", config(0), false)).unwrap_err().to_string();
    assert!(err.contains("max_steps"), "{err}");
    // Every step non-finite, but fewer than max_bad_steps in a row: the run ends normally.
    let cfg = MendConfig { edit_lr: 1e38, max_bad_steps: 100, ..config(2) };
    let err = run_train(&options(dir.path(), "nan", cfg, false)).unwrap_err().to_string();
    assert!(err.contains("no editor was saved") && err.contains("2 skipped"), "{err}");
}

/// Config sizes that are not positive or absurdly large, a checkpoint with more blocks than
/// its config, and a tokenizer larger than the model's vocabulary are refused at load.
#[test]
fn implausible_model_folders_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let src = fixture("gpt2");
    let config: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(src.join("config.json")).unwrap()).unwrap();
    let variant = |name: &str, key: &str, value: serde_json::Value| {
        let d = dir.path().join(name);
        std::fs::create_dir(&d).unwrap();
        for f in ["model.safetensors", "tokenizer.json"] {
            std::fs::copy(src.join(f), d.join(f)).unwrap();
        }
        let mut c = config.clone();
        c[key] = value;
        std::fs::write(d.join("config.json"), c.to_string()).unwrap();
        d
    };
    let load = |d: &Path| dualedit::model::load_model(d, Device::Cpu, Kind::Float).map(|_| ()).unwrap_err().to_string();
    let err = load(&variant("huge", "n_layer", serde_json::json!(1_000_000_000_000i64)));
    assert!(err.contains("config.json") && err.contains("n_layer"), "{err}");
    let err = load(&variant("negative", "n_layer", serde_json::json!(-1)));
    assert!(err.contains("n_layer"), "{err}");
    let fewer = config["n_layer"].as_i64().unwrap() - 1;
    let err = load(&variant("fewer", "n_layer", serde_json::json!(fewer)));
    assert!(err.contains("model.safetensors") && err.contains(&format!("block {fewer}")), "{err}");
    let err = load(&variant("small_vocab", "vocab_size", serde_json::json!(8)));
    assert!(err.contains("tokenizer.json") && err.contains("does not belong"), "{err}");
}

/// Files saved with a UTF-8 byte-order mark load; a directory given as a file is named so.
#[test]
fn byte_order_marks_and_directories() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("bom.json");
    std::fs::write(&data, format!("\u{feff}{TRAIN_RECORDS}")).unwrap();
    let (records, _) = dualedit::data::load_records(&data, DatasetKind::Counterfact).unwrap();
    assert!(!records.is_empty());
    let cfg = dir.path().join("cfg.json");
    std::fs::write(&cfg, "\u{feff}{\"rank\": 8}").unwrap();
    assert_eq!(MendConfig::from_file(&cfg).unwrap().rank, 8);
    let err = dualedit::data::load_records(dir.path(), DatasetKind::Counterfact).unwrap_err().to_string();
    assert!(err.contains("is a directory"), "{err}");
}

/// Generalisation (locality) is measured only for requests with a rephrase (a locality
/// prompt), as EasyEdit has no such accuracy otherwise, and is null in the summary when no
/// request has one.
#[test]
fn generalization_and_locality_only_where_measured() {
    let dir = tempfile::tempdir().unwrap();
    let m = fixture("gpt2");
    let run = |name: &str, records: &str| -> serde_json::Value {
        let path = dir.path().join(name);
        std::fs::write(&path, records).unwrap();
        let out = common::dualedit_cmd()
            .args(["edit", "--model", m.to_str().unwrap(), "--method", "ft", "--requests", path.to_str().unwrap(), "--json"])
            .args(["--report", dir.path().join(format!("{name}.report.json")).to_str().unwrap()])
            .output()
            .unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        serde_json::from_slice(&out.stdout).unwrap()
    };
    let mixed = run(
        "mixed.json",
        r#"[{"prompt": "The capital of France is", "target_new": "Rome", "rephrase_prompt": "France has its capital in",
             "locality_prompt": "The capital of Spain is", "locality_ground_truth": "Madrid"},
            {"prompt": "The capital of Italy is", "target_new": "Paris"}]"#,
    );
    let reqs = mixed["requests"].as_array().unwrap();
    assert!(reqs[0]["generalization"].is_f64() && reqs[1]["generalization"].is_null(), "{mixed}");
    assert_eq!(mixed["generalization"], reqs[0]["generalization"], "the mean is over rephrased requests only");
    assert!(reqs[0]["locality"].is_f64() && reqs[1]["locality"].is_null(), "{mixed}");
    assert_eq!(mixed["locality"], reqs[0]["locality"], "the mean is over requests with a locality prompt only");
    let none = run("none.json", r#"[{"prompt": "The capital of Italy is", "target_new": "Paris"}]"#);
    assert!(none["generalization"].is_null() && none["locality"].is_null() && none["reliability"].is_f64(), "{none}");
}

/// Issue #33.7: `--resume` continues the saved run only with its config: another
/// learning rate or rank is refused naming the keys (it used to continue silently);
/// how long it runs may change.
#[test]
fn resume_with_another_config_is_refused_naming_the_keys() {
    let dir = tempfile::tempdir().unwrap();
    run_train(&options(dir.path(), "cfg", config(2), false)).unwrap();
    let other = MendConfig { lr: 5e-3, val_every: 3, ..config(4) };
    let err = run_train(&options(dir.path(), "cfg", other, true)).err().expect("refused").to_string();
    assert!(err.contains("lr (saved 0.001, now 0.005)") && err.contains("val_every (saved 2, now 3)"), "{err}");
    assert!(err.contains("train_state") && err.contains("`out`"), "{err}");
    assert!(!err.contains("max_steps (saved"), "max_steps may change: {err}");
    let (rest, _) = run_train(&options(dir.path(), "cfg", config(3), true)).unwrap();
    assert_eq!(rest.history.first().map(|h| h.step), Some(3));
}

/// `train --init`: a new training starts from a trained editor's weights (its first
/// validation is the trained editor's, not a fresh one's), under its own config; a network
/// of another shape is refused naming the checkpoint, and `init` with `resume` is refused.
#[test]
fn init_starts_from_a_trained_editor() {
    let dir = tempfile::tempdir().unwrap();
    run_train(&options(dir.path(), "first", config(6), false)).unwrap();
    // With the learning rates at zero the network and the edit rates stay as they started.
    let zero_lr = || MendConfig { lr: 0.0, lr_lr: 0.0, c_loc: 3.0, ..config(2) };
    run_train(&TrainOptions { init: Some(dir.path().join("first")), ..options(dir.path(), "second", zero_lr(), false) }).unwrap();
    run_train(&options(dir.path(), "scratch", zero_lr(), false)).unwrap();
    let weights = |d: &str| {
        let (t, _) = dualedit::io::read_safetensors(&dir.path().join(d).join("editor.safetensors")).unwrap();
        t.into_iter().filter(|(n, _)| !n.starts_with("stats.")).collect::<Vec<_>>()
    };
    let (first, second, scratch) = (weights("first"), weights("second"), weights("scratch"));
    assert_eq!(first.len(), second.len());
    for ((n, a), (_, b)) in first.iter().zip(&second) {
        assert!(a.equal(b), "{n} is the trained editor's");
    }
    assert!(first.iter().zip(&scratch).any(|((_, a), (_, b))| !a.equal(b)), "a fresh editor differs");
    let saved = dualedit::mend::checkpoint::trained_config(&dir.path().join("second")).unwrap();
    assert_eq!(saved.c_loc, 3.0, "the new editor carries the new config");

    let other_rank = TrainOptions { init: Some(dir.path().join("first")), ..options(dir.path(), "third", MendConfig { rank: 8, ..config(2) }, false) };
    let err = run_train(&other_rank).err().expect("another rank is refused").to_string();
    assert!(err.contains("first/editor.safetensors") && err.contains("`init`") && err.contains("shape"), "{err}");
    let both = TrainOptions { init: Some(dir.path().join("first")), ..options(dir.path(), "fourth", config(2), true) };
    let err = run_train(&both).err().expect("init with resume is refused").to_string();
    assert!(err.contains("`init`") && err.contains("`resume`"), "{err}");
}

/// Issue #33.7: `eval --sequential 100000` on a handful of records edits them all as one
/// group and reports the group that ran (`n` = the records) and what was asked.
#[test]
fn a_group_larger_than_the_records_is_cut_to_them_and_reported() {
    use dualedit::edit::capacity::{measure, Grouping};
    let lm = dualedit::model::load_model(&fixture("gpt2"), Device::Cpu, Kind::Float).unwrap();
    let engine = dualedit::mend::Engine::new(lm, DevicePlan::single(Device::Cpu), &[]).unwrap();
    let editor = dualedit::mend::Editor::new(&MendConfig { rank: 8, edit_lr: 1e-4, ..MendConfig::default() }, engine.edit_params.clone(), Device::Cpu, 0).unwrap();
    let mut session = dualedit::edit::session::Session::from_parts(engine, Some(editor));
    let records = common::records();
    let examples = dualedit::data::examples::prepare(&session.engine().lm.tokenizer, &records, 64, Path::new("inline.json")).unwrap();
    let (metrics, report) = measure(&mut session, &records, &examples, Grouping::Sequential(100_000), &[], |_, _| {}).unwrap();
    assert_eq!(metrics.len(), records.len());
    assert_eq!((report.grouping, report.n_requested, report.groups), (Grouping::Sequential(records.len()), Some(100_000), 1));
    let v = serde_json::to_value(&report).unwrap();
    assert_eq!((v["n"].as_u64(), v["n_requested"].as_u64()), (Some(records.len() as u64), Some(100_000)), "{v}");
    let (_, report) = measure(&mut session, &records, &examples, Grouping::Batch(2), &[], |_, _| {}).unwrap();
    assert_eq!(report.n_requested, None);
    assert!(serde_json::to_value(&report).unwrap().get("n_requested").is_none());
    assert!(measure(&mut session, &[], &[], Grouping::Batch(2), &[], |_, _| {}).is_err());
}

/// Issue #33.10 / #33.5: a huge `--ls-keep-text` is capped with a warning, a FIFO is
/// refused instead of blocking, and a 50 MB field is refused by its length before it is
/// tokenised (it used to be encoded in full, then skipped).
#[test]
fn huge_inputs_are_refused_or_capped_before_the_expensive_part() {
    use dualedit::data::examples::{prepare_with, OverLong};
    use dualedit::mend::stats::{read_keep_text, MAX_KEEP_LINES};
    let dir = tempfile::tempdir().unwrap();
    let many = dir.path().join("keep.txt");
    std::fs::write(&many, (0..MAX_KEEP_LINES + 5000).map(|i| format!("line {i}\n\n")).collect::<String>()).unwrap();
    let lines = read_keep_text(&many).unwrap();
    assert_eq!((lines.len(), lines[0].as_str()), (MAX_KEEP_LINES, "line 0"));
    let fifo = dir.path().join("fifo.txt");
    assert!(Command::new("mkfifo").arg(&fifo).status().unwrap().success());
    let err = read_keep_text(&fifo).unwrap_err().to_string();
    assert!(err.contains("fifo.txt") && err.contains("regular file"), "{err}");
    let spec = dualedit::edit::MethodSpec::MendLs { editor: dir.path().to_path_buf(), ls: Default::default(), unrelated: Some(fifo.clone()) };
    assert!(spec.validate().unwrap_err().to_string().contains("regular file"));
    let err = dualedit::edit::MethodSpec::FineTune { lr: f64::NAN }.validate().unwrap_err().to_string();
    assert!(err.contains("ft_lr"), "{err}");

    let tok = dualedit::model::Tokenizer::from_file(&fixture("gpt2").join("tokenizer.json")).unwrap();
    let mut records = common::records();
    records[1].locality_prompt = Some("word ".repeat(10_000_000));
    let index: Vec<usize> = (0..records.len()).collect();
    let start = std::time::Instant::now();
    let p = prepare_with(&tok, &records, &index, 64, OverLong::Skip, Path::new("big.json")).unwrap();
    assert!(start.elapsed() < std::time::Duration::from_secs(5), "took {:?}", start.elapsed());
    assert_eq!(p.skipped.len(), 1, "{:?}", p.skipped);
    assert!(p.skipped[0].0 == 1 && p.skipped[0].1.contains("bytes"), "{:?}", p.skipped);
    let err = prepare_with(&tok, &records, &index, 64, OverLong::Strict, Path::new("big.json")).unwrap_err().to_string();
    assert!(err.contains("big.json") && err.contains("record 1") && err.contains("before tokenising"), "{err}");
    // Truncating: the prompt is cut before tokenising and then to the context.
    let p = prepare_with(&tok, &records, &index, 64, OverLong::Truncate, Path::new("big.json")).unwrap();
    assert_eq!((p.examples.len(), p.truncated.as_slice()), (records.len(), &[1][..]));
    assert!(p.examples[1].loc.as_ref().unwrap().ids.len() <= 64);
}

/// Issue #33.7 on the command line: nonsense guard thresholds, `--no-guard` with a guard
/// flag, and `serve` with a bad threshold are one clear error naming the flag, before
/// any model is loaded.
#[test]
fn nonsense_guard_flags_are_refused_by_the_cli() {
    let model = fixture("gpt2").display().to_string();
    let dir = tempfile::tempdir().unwrap();
    let requests = dir.path().join("r.json");
    std::fs::write(&requests, common::RECORDS).unwrap();
    let requests = requests.display().to_string();
    let missing_editor = dir.path().join("no-editor").display().to_string();
    for (flag, value, needle) in [
        ("--guard-min-agreement", "NaN", "[0, 1]"),
        ("--guard-min-agreement", "1.5", "[0, 1]"),
        ("--guard-min-agreement", "-1", "[0, 1]"),
        ("--guard-max-drop", "2", "[0, 1]"),
        ("--guard-max-kl", "-1", "[0, ∞)"),
        ("--guard-max-kl", "inf", "[0, ∞)"),
    ] {
        // `--flag=value`: clap reads a separate `-1` as a flag.
        let arg = format!("{flag}={value}");
        let (ok, err) = cli(&["edit", "--model", &model, "--editor", &missing_editor, "--requests", &requests, &arg]);
        assert!(!ok && err.contains(flag) && err.contains(needle), "{flag} {value}: {err}");
        let (ok, err) = cli(&["serve", "--model", &model, &arg]);
        assert!(!ok && err.contains(flag), "serve {flag} {value}: {err}");
    }
    let (ok, err) = cli(&["edit", "--model", &model, "--editor", &missing_editor, "--requests", &requests, "--no-guard", "--guard-refuse"]);
    assert!(!ok && err.contains("--no-guard") && err.contains("--guard-refuse"), "{err}");
}

/// Issue #33.7: `--optimizer-device sub` on a run without a sub-device is refused naming
/// the flag (it used to fall back to the main device silently).
#[test]
fn optimizer_on_a_missing_sub_device_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let mut o = options(dir.path(), "opt", config(2), false);
    o.common.plan = o.common.plan.with_optimizer(dualedit::device::OptimizerDevice::Sub);
    let err = run_train(&o).err().expect("refused").to_string();
    assert!(err.contains("`optimizer_device` sub") && err.contains("`sub_device`"), "{err}");
}
