//! Image edits from the command line, whole saved folders, the checkpoint's own chat
//! template, and bad E-VQA data (issue #31 part B; #33 items 3, 4, 10), on the tiny random
//! Qwen2-VL fixture.
//!
//! The transformers comparisons run `scripts/vl_reference.py` with the project venv's
//! Python. transformers is found in the venv, or on `DUALEDIT_PYTHONPATH` (default: the
//! shared `/work/pyenv/{tf-5.23.0,common,torchvision-0.28.0}` folders that exist; with
//! torchvision, `AutoProcessor` itself builds the references); without it those
//! checks are skipped with a message, unless `DUALEDIT_REQUIRE_TRANSFORMERS=1` makes that a
//! failure.
use crate::common;
use std::path::{Path, PathBuf};
use std::process::Command;

use common::fixture;
use dualedit::config::MendConfig;
use dualedit::data::multimodal::{load_mm, ImageRoots};
use dualedit::data::DatasetKind;
use dualedit::device::memory::MemoryTracker;
use dualedit::device::DevicePlan;
use dualedit::edit::{open_engine, LoadOptions};
use dualedit::mend::{checkpoint, Editor};
use dualedit::run::load_examples;
use dualedit::edit::session::Session;
use serde_json::{json, Value};
use tch::Device;

const ROOT: &str = env!("CARGO_MANIFEST_DIR");

/// A chat template unlike Qwen2-VL's: another system prompt, an `Image:` label, Python's
/// `.strip()`, a filter, loop controls, and whitespace control that depends on
/// `trim_blocks` / `lstrip_blocks` being set as transformers sets them.
const TEMPLATE: &str = "{%- for message in messages %}
  {%- if loop.first and message['role'] != 'system' %}
<|im_start|>system
You answer questions about pictures, briefly.<|im_end|>
  {% endif %}
<|im_start|>{{ message.role }}
{% for c in message.content %}
  {% if c.type == 'video' %}{% continue %}{% endif %}
  {% if c.type == 'image' %}
Image: <|vision_start|><|image_pad|><|vision_end|>
  {% elif c.type == 'text' %}{{ c.text.strip() | replace('  ', ' ') }}{% endif %}
{% endfor %}
<|im_end|>
{% endfor %}
{% if add_generation_prompt %}<|im_start|>assistant
{% endif %}
";

fn png(path: &Path, w: u32, h: u32, seed: u8) {
    let img = image::RgbImage::from_fn(w, h, |x, y| image::Rgb([(x as u8).wrapping_mul(seed), (y as u8).wrapping_add(seed), seed.wrapping_mul(7)]));
    img.save(path).unwrap();
}

/// COCO-like root: a.png, b.png, c.png, loc.png; the rephrase image r.png.
fn images(dir: &Path) -> ImageRoots {
    let root = dir.join("coco");
    std::fs::create_dir_all(&root).unwrap();
    png(&root.join("a.png"), 40, 30, 3);
    png(&root.join("b.png"), 30, 40, 5);
    png(&root.join("c.png"), 56, 56, 13);
    png(&root.join("loc.png"), 50, 50, 9);
    png(&root.join("r.png"), 60, 28, 11);
    ImageRoots::new(root, None)
}

fn record(src: &str, alt: &str, image: &str) -> Value {
    json!({
        "src": src, "pred": "a dog", "alt": alt, "rephrase": format!("{src} Tell me."),
        "image": image, "image_rephrase": "r.png",
        "loc": "nq question: who wrote hamlet", "loc_ans": "shakespeare",
        "m_loc": "loc.png", "m_loc_q": "What colour is the bus?", "m_loc_a": "red"
    })
}

fn write(path: &Path, v: &Value) -> PathBuf {
    std::fs::write(path, serde_json::to_string(v).unwrap()).unwrap();
    path.to_path_buf()
}

/// A copy of the Qwen2-VL fixture with the extra files a transformers-saved checkpoint
/// has, and `template` as its chat template.
fn model_copy(dir: &Path, template: Option<&str>) -> PathBuf {
    let m = dir.join("model");
    std::fs::create_dir_all(&m).unwrap();
    for e in std::fs::read_dir(fixture("qwen2_vl")).unwrap() {
        let p = e.unwrap().path();
        std::fs::copy(&p, m.join(p.file_name().unwrap())).unwrap();
    }
    std::fs::write(m.join("generation_config.json"), r#"{"bos_token_id": 0, "eos_token_id": 0, "transformers_version": "5.23.0"}"#).unwrap();
    std::fs::write(m.join("special_tokens_map.json"), r#"{"eos_token": "<|endoftext|>"}"#).unwrap();
    if let Some(t) = template {
        std::fs::write(m.join("chat_template.jinja"), t).unwrap();
    }
    m
}

/// The venv's Python with transformers importable, or `None` (with a message; a failure
/// under `DUALEDIT_REQUIRE_TRANSFORMERS=1`).
fn python() -> Option<(PathBuf, Option<String>)> {
    let py = Path::new(ROOT).join(".venv/bin/python");
    let path = std::env::var("DUALEDIT_PYTHONPATH").ok().or_else(|| {
        let shared = ["/work/pyenv/tf-5.23.0", "/work/pyenv/common", "/work/pyenv/torchvision-0.28.0"];
        let there: Vec<&str> = shared.into_iter().filter(|p| Path::new(p).is_dir()).collect();
        (there.len() >= 2).then(|| there.join(":"))
    });
    let mut c = Command::new(&py);
    c.args(["-c", "import transformers, PIL"]);
    if let Some(p) = &path {
        c.env("PYTHONPATH", p);
    }
    if c.output().map(|o| o.status.success()).unwrap_or(false) {
        return Some((py, path));
    }
    let msg = "transformers is not importable from .venv/bin/python (set DUALEDIT_PYTHONPATH): transformers comparison skipped";
    assert!(std::env::var("DUALEDIT_REQUIRE_TRANSFORMERS").as_deref() != Ok("1"), "{msg}");
    eprintln!("{msg}");
    None
}

fn reference(py: &(PathBuf, Option<String>), args: &[&str]) -> Value {
    let mut c = Command::new(&py.0);
    c.arg(Path::new(ROOT).join("scripts/vl_reference.py")).args(args);
    if let Some(p) = &py.1 {
        c.env("PYTHONPATH", p);
    }
    let out = c.output().unwrap();
    assert!(out.status.success(), "vl_reference.py {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).unwrap()
}

fn dualedit(args: &[&str]) -> std::process::Output {
    common::dualedit_cmd().args(args).env("RUST_LOG", "warn").output().unwrap()
}

fn ok(out: &std::process::Output, what: &str) -> String {
    assert!(out.status.success(), "{what} failed: {}\n{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

#[test]
fn views_follow_the_checkpoints_chat_template() {
    let dir = tempfile::tempdir().unwrap();
    let roots = images(dir.path());
    let m = model_copy(dir.path(), Some(TEMPLATE));
    let plain = model_copy(&dir.path().join("plain"), None);
    let data = write(&dir.path().join("vqa.json"), &json!([record("What is  shown?", "a red block", "a.png")]));
    let opts = LoadOptions::default();
    let views = |model: &Path| {
        let engine = open_engine(model, &opts, &[]).unwrap();
        load_examples(&engine, &data, DatasetKind::Vqa, None, 200, Default::default(), Some(&roots)).unwrap().1.remove(0)
    };
    let (ours, default) = (views(&m), views(&plain));
    assert_ne!(ours.inner.ids, default.inner.ids, "the checkpoint's template changed nothing");
    let Some(py) = python() else { return };
    let coco = &roots.image_root;
    let cases = [
        ("edit_inner", &ours.inner, coco.join("a.png"), "What is  shown?", "a red block"),
        ("edit_outer", &ours.outer, coco.join("a.png"), "What is  shown? Tell me.", "a red block"),
        ("edit_outer_image", ours.outer_image.as_ref().unwrap(), coco.join("r.png"), "What is  shown?", "a red block"),
        ("loc_image", ours.loc_image.as_ref().unwrap(), coco.join("loc.png"), "Question: What colour is the bus? Short answer:", "red"),
    ];
    for (name, e, img, text, target) in cases {
        let r = reference(&py, &["template", s(&m), s(&img), text, target]);
        assert!(r["prompt"].as_str().unwrap().contains("briefly"), "{r}");
        eprintln!("{name}: reference via {}", r["via"]);
        let ids: Vec<i64> = serde_json::from_value(r["input_ids"].clone()).unwrap();
        assert_eq!(e.ids, ids, "{name}: dualedit's ids differ from transformers' apply_chat_template + \" \" + target");
    }
}

#[test]
fn truncated_images_empty_rephrases_and_duplicates() {
    let dir = tempfile::tempdir().unwrap();
    let roots = images(dir.path());
    // A PNG and a JPEG whose headers are intact and whose data stops halfway.
    let full = std::fs::read(roots.image_root.join("c.png")).unwrap();
    std::fs::write(roots.image_root.join("cut.png"), &full[..full.len() / 2]).unwrap();
    let jpg = roots.image_root.join("c.jpg");
    image::open(roots.image_root.join("c.png")).unwrap().save(&jpg).unwrap();
    let full = std::fs::read(&jpg).unwrap();
    std::fs::write(roots.image_root.join("cut.jpg"), &full[..full.len() / 2]).unwrap();
    for cut in ["cut.png", "cut.jpg"] {
        assert!(image::image_dimensions(roots.image_root.join(cut)).is_ok(), "{cut}: the header should still read");
    }
    let mut empty_rephrase = record("What is this?", "a cat", "b.png");
    empty_rephrase["rephrase"] = json!("  ");
    let data = write(
        &dir.path().join("vqa.json"),
        &json!([record("What is in it?", "a dog", "a.png"), record("Q1?", "x", "cut.png"), empty_rephrase, record("Q2?", "y", "cut.jpg")]),
    );
    let load = load_mm(&data, DatasetKind::Vqa, &roots, false).unwrap();
    assert_eq!(load.records.len(), 2);
    let skipped: Vec<usize> = load.skipped_image.iter().map(|(i, _)| *i).collect();
    assert_eq!(skipped, [1, 3]);
    assert!(load.skipped_image.iter().all(|(_, why)| why.contains("truncated or corrupt")), "{:?}", load.skipped_image);
    let err = load_mm(&data, DatasetKind::Vqa, &roots, true).unwrap_err().to_string();
    assert!(err.contains("record 1") && err.contains("cut.png"), "{err}");

    // The empty rephrase is absent: not measured, counted.
    assert_eq!(load.records[1].rephrase, None);
    let engine = open_engine(&fixture("qwen2_vl"), &LoadOptions::default(), &[]).unwrap();
    let (_, ex, counts) = load_examples(&engine, &data, DatasetKind::Vqa, None, 200, Default::default(), Some(&roots)).unwrap();
    assert_eq!((counts.skipped_image, counts.no_rephrase, counts.used), (2, 1, 2));
    assert!(ex[0].rephrased && !ex[1].rephrased);

    // Duplicated records: the validation split keeps none that training has.
    // 20 records, the last 4 held out: two of them repeat training records.
    let recs: Vec<Value> = (0..16).map(|i| i % 4).chain([0, 1, 20, 21]).map(|i| record(&format!("Question {i}?"), "a dog", "a.png")).collect();
    let dup = write(&dir.path().join("dup.json"), &json!(recs));
    let cfg = dir.path().join("cfg.json");
    let c = MendConfig { rank: 8, accumulate: 1, max_steps: 1, val_every: 1, val_records: 4, max_length: 200, ..MendConfig::default() };
    std::fs::write(&cfg, serde_json::to_string(&c).unwrap()).unwrap();
    let out = dir.path().join("ed");
    let o = dualedit(&["train", "--model", s(&fixture("qwen2_vl")), "--ds", "vqa", "--data", s(&dup), "--image-root", s(&roots.image_root), "--config", s(&cfg), "--out", s(&out)]);
    ok(&o, "train on duplicated records");
    let report: Value = serde_json::from_str(&std::fs::read_to_string(out.join("report.json")).unwrap()).unwrap();
    assert_eq!(report["data"]["val_duplicates_dropped"], json!(2), "{}", report["data"]);
}

#[test]
fn a_data_error_that_ends_training_saves_the_training_state() {
    let dir = tempfile::tempdir().unwrap();
    let roots = images(dir.path());
    let recs: Vec<Value> = ["a.png", "b.png", "c.png", "a.png"].iter().enumerate().map(|(i, im)| record(&format!("Question {i}?"), "a dog", im)).collect();
    let data = write(&dir.path().join("vqa.json"), &json!(recs));
    let engine = open_engine(&fixture("qwen2_vl"), &LoadOptions::default(), &[]).unwrap();
    let (_, examples, _) = load_examples(&engine, &data, DatasetKind::Vqa, None, 200, Default::default(), Some(&roots)).unwrap();
    // The images change after they were read (a disk fault, a sync): the next step that
    // shows one fails.
    for im in ["a.png", "b.png", "c.png", "r.png", "loc.png"] {
        std::fs::write(roots.image_root.join(im), b"\x89PNG\r\n\x1a\n broken").unwrap();
    }
    let cfg = MendConfig { rank: 8, accumulate: 1, max_steps: 5, val_every: 100, val_records: 0, max_length: 200, ..MendConfig::default() };
    let mut editor = Editor::new(&cfg, engine.edit_params.clone(), Device::Cpu, 0).unwrap();
    let out = dir.path().join("ed");
    std::fs::create_dir_all(&out).unwrap();
    let setup = dualedit::mend::train::TrainSetup { config: &cfg, train: &examples, val: &[], out: &out, seed: 0, resume: false, progress: false };
    let mut tracker = MemoryTracker::new(&DevicePlan::single(Device::Cpu).roles());
    let err = dualedit::mend::train::train(&engine, &mut editor, &setup, &mut tracker).unwrap_err().to_string();
    assert!(err.contains(".png"), "the error names the image: {err}");
    assert!(out.join(checkpoint::STATE_FILE).exists(), "no training state after a data error");
    assert!(out.join(checkpoint::EDITOR_FILE).exists(), "no editor after a data error");
}

/// Tensor name → (dtype, shape).
type Tensors = std::collections::BTreeMap<String, (String, Vec<usize>)>;

/// The tensors of every safetensors file in `dir`, and the files.
fn layout(dir: &Path) -> (Tensors, Vec<String>) {
    let mut out = std::collections::BTreeMap::new();
    let mut files = Vec::new();
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        let name = p.file_name().unwrap().to_str().unwrap().to_string();
        if !name.ends_with(".safetensors") {
            continue;
        }
        let bytes = std::fs::read(&p).unwrap();
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        for (n, v) in st.tensors() {
            out.insert(n, (format!("{:?}", v.dtype()), v.shape().to_vec()));
        }
        files.push(name);
    }
    files.sort();
    (out, files)
}

#[test]
fn saves_keep_the_sources_files_and_layout_and_are_whole_or_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let m = model_copy(dir.path(), Some(TEMPLATE));
    // The source as transformers writes a sharded bf16 checkpoint: two shards and an index.
    let (tensors, meta) = dualedit::io::read_safetensors(&m.join("model.safetensors")).unwrap();
    std::fs::remove_file(m.join("model.safetensors")).unwrap();
    let mut shards: [Vec<(String, tch::Tensor)>; 2] = Default::default();
    let mut map = serde_json::Map::new();
    for (i, (n, t)) in tensors.into_iter().enumerate() {
        let file = format!("model-0000{}-of-00002.safetensors", 1 + i % 2);
        map.insert(n.clone(), json!(file));
        shards[i % 2].push((n, t.to_kind(tch::Kind::BFloat16)));
    }
    for (i, s) in shards.iter().enumerate() {
        dualedit::io::write_safetensors(&m.join(format!("model-0000{}-of-00002.safetensors", i + 1)), s, meta.clone()).unwrap();
    }
    write(&m.join("model.safetensors.index.json"), &json!({"metadata": {"total_size": 1}, "weight_map": map}));

    let session = Session::open(&m, None, &LoadOptions::default()).unwrap();
    // A killed save of an older dualedit left config + tokenizer and a temporary file; a
    // killed save of this one left a temporary sibling folder.
    let target = dir.path().join("saved");
    std::fs::create_dir_all(&target).unwrap();
    for f in ["config.json", "tokenizer.json", ".model.safetensors.tmp.4242"] {
        std::fs::write(target.join(f), "{}").unwrap();
    }
    let stale = dir.path().join(".saved.dualedit-save-999999999-1");
    std::fs::create_dir_all(&stale).unwrap();
    std::fs::write(stale.join("config.json"), "{}").unwrap();
    session.save(&target).unwrap();
    assert!(!stale.exists(), "the stale temporary folder of a killed save is left");
    let leftovers: Vec<_> = std::fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().file_name()).filter(|n| n.to_string_lossy().contains("dualedit-save")).collect();
    assert!(leftovers.is_empty(), "{leftovers:?}");

    // Every non-weight file, byte for byte; the weights in the source's layout.
    for f in ["config.json", "tokenizer.json", "preprocessor_config.json", "chat_template.jinja", "generation_config.json", "special_tokens_map.json"] {
        assert_eq!(std::fs::read(m.join(f)).unwrap(), std::fs::read(target.join(f)).unwrap(), "{f}");
    }
    assert!(!target.join(".model.safetensors.tmp.4242").exists());
    assert_eq!(layout(&m), layout(&target));
    let index: Value = serde_json::from_str(&std::fs::read_to_string(target.join("model.safetensors.index.json")).unwrap()).unwrap();
    assert_eq!(index["weight_map"], Value::Object(map));
    let bytes: u64 = layout(&target).0.values().map(|(_, shape)| 2 * shape.iter().product::<usize>() as u64).sum();
    assert_eq!(index["metadata"]["total_size"], json!(bytes));
    // Unedited, bf16 → f32 → bf16 is exact: the shards hold the same values.
    for f in layout(&m).1 {
        let (a, b) = (dualedit::io::read_safetensors(&m.join(&f)).unwrap().0, dualedit::io::read_safetensors(&target.join(&f)).unwrap().0);
        for (n, t) in &a {
            assert!(t.equal(&b[n]), "{f}: {n} changed");
        }
    }
    // Reloads and scores as the source.
    let again = Session::open(&target, None, &LoadOptions::default()).unwrap();
    assert_eq!(again.score("hello there").unwrap().logprobs, session.score("hello there").unwrap().logprobs);

    // A real model folder, or a folder of the user's, is never written into.
    for (to, needle) in [(&m, "already holds a model"), (&target, "already holds a model")] {
        let err = session.save(to).unwrap_err().to_string();
        assert!(err.contains(needle), "{err}");
    }
    let mine = dir.path().join("mine");
    std::fs::create_dir_all(&mine).unwrap();
    std::fs::write(mine.join("notes.txt"), "mine").unwrap();
    let err = session.save(&mine).unwrap_err().to_string();
    assert!(err.contains("not empty") && err.contains("notes.txt"), "{err}");
    assert_eq!(std::fs::read_to_string(mine.join("notes.txt")).unwrap(), "mine");
}

#[test]
fn cli_image_edit_after_cli_training_saves_a_folder_transformers_scores_alike() {
    let dir = tempfile::tempdir().unwrap();
    let roots = images(dir.path());
    let m = model_copy(dir.path(), None);
    let coco = s(&roots.image_root);
    let train: Vec<Value> = ["a.png", "b.png", "c.png", "a.png", "b.png", "c.png"]
        .iter()
        .enumerate()
        .map(|(i, im)| record(&format!("What is in picture {i}?"), ["a dog", "a cat", "a bus"][i % 3], im))
        .collect();
    let data = write(&dir.path().join("train.json"), &json!(train));
    let cfg = dir.path().join("cfg.json");
    let c = MendConfig { rank: 8, lr: 1e-3, edit_lr: 1e-2, accumulate: 1, max_steps: 3, val_every: 3, val_records: 1, max_length: 200, ..MendConfig::default() };
    std::fs::write(&cfg, serde_json::to_string(&c).unwrap()).unwrap();
    let ed = dir.path().join("ed");
    ok(&dualedit(&["train", "--model", s(&m), "--ds", "vqa", "--data", s(&data), "--image-root", coco, "--config", s(&cfg), "--out", s(&ed)]), "train --ds vqa");

    let requests = write(&dir.path().join("req.json"), &json!([record("What animal is this?", "a giraffe", "a.png")]));
    let saved = dir.path().join("saved");
    let base = ["edit", "--model", s(&m), "--method", "mend", "--editor", s(&ed), "--ds", "vqa", "--requests", s(&requests), "--image-root", coco];
    let out = ok(&dualedit(&[&base[..], &["--save", s(&saved), "--json", "--no-guard"]].concat()), "edit --ds vqa --save --json");
    let v: Value = serde_json::from_str(out.trim()).unwrap();
    for k in ["rewrite_acc", "rephrase_acc", "rephrase_image_acc", "locality_acc", "multimodal_locality_acc"] {
        assert!(v["easyedit"][k].is_number(), "{k} missing from edit --json: {v}");
    }
    assert_eq!(v["requests"][0]["prompt"], json!("What animal is this?"));
    // This 3-step editor's edit moves the locality probes past the guard's limits, and a
    // refused edit is an error (#36): the guard is off here as in the run above.
    let text = ok(&dualedit(&[&base[..], &["--sequential", "--no-guard"]].concat()), "edit --ds vqa --sequential");
    for k in ["rewrite_acc", "rephrase_acc", "rephrase_image_acc", "locality_acc", "multimodal_locality_acc", "rephrase image"] {
        assert!(text.contains(k), "{k} missing from the text table:\n{text}");
    }

    // Flags that would be ignored are refused.
    let err = dualedit(&["edit", "--model", s(&m), "--method", "unedited", "--requests", s(&requests), "--image-root", coco]);
    assert!(!err.status.success() && String::from_utf8_lossy(&err.stderr).contains("--image-root"), "{}", String::from_utf8_lossy(&err.stderr));
    let err = dualedit(&[&base[..], &["--truncate"]].concat());
    assert!(!err.status.success() && String::from_utf8_lossy(&err.stderr).contains("--truncate"), "{}", String::from_utf8_lossy(&err.stderr));

    // The saved folder: dualedit's score on it, and transformers', agree; and differ from
    // the unedited model.
    let image = roots.image_root.join("a.png");
    let prompt = "What animal is this? a giraffe";
    let score = |model: &Path| -> Vec<f64> {
        let out = ok(&dualedit(&["score", "--model", s(model), "--image", s(&image), "--text", prompt, "--json"]), "score");
        serde_json::from_value(serde_json::from_str::<Value>(out.trim()).unwrap()["logprobs"].clone()).unwrap()
    };
    let (edited, unedited) = (score(&saved), score(&m));
    let moved = edited.iter().zip(&unedited).map(|(a, b)| (a - b).abs()).fold(0.0, f64::max);
    assert!(moved > 1e-5, "the saved model scores as the unedited one (max difference {moved}); edit: {v}");
    let Some(py) = python() else { return };
    let r = reference(&py, &["logprobs", s(&saved), s(&image), prompt]);
    let theirs: Vec<f64> = serde_json::from_value(r["logprobs"].clone()).unwrap();
    assert_eq!(theirs.len(), edited.len());
    if let Some(class) = r["auto_processor"].as_str() {
        assert_eq!(class, "Qwen2VLProcessor", "AutoProcessor on the saved folder");
    } else {
        eprintln!("torchvision missing: AutoProcessor on the saved folder not tried");
    }
    let diff = edited.iter().zip(&theirs).map(|(a, b)| (a - b).abs()).fold(0.0, f64::max);
    eprintln!("saved folder: dualedit vs transformers max |Δ log-prob| {diff:.3e}; edited vs unedited {moved:.3e}");
    assert!(diff <= 1e-4, "dualedit and transformers differ by {diff} on the saved folder");
    let r0 = reference(&py, &["logprobs", s(&m), s(&image), prompt]);
    let theirs0: Vec<f64> = serde_json::from_value(r0["logprobs"].clone()).unwrap();
    let moved = theirs.iter().zip(&theirs0).map(|(a, b)| (a - b).abs()).fold(0.0, f64::max);
    assert!(moved > 1e-5, "transformers scores the saved folder as the unedited model");
}

/// A flag `edit` / `eval` accepts is used or refused with one error naming it.
#[test]
fn flags_that_would_be_ignored_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let req = dir.path().join("req.json");
    std::fs::write(&req, common::RECORDS).unwrap();
    let (m, r) = (fixture("gpt2"), req.to_str().unwrap().to_string());
    let edit = ["edit", "--model", s(&m), "--method", "ft", "--requests", &r];
    let eval = ["eval", "--model", s(&m), "--method", "ft", "--data", &r, "--ds", "counterfact"];
    let cases: [(&[&str], &[&str], &str); 7] = [
        (&edit, &["--no-guard", "--guard-max-kl", "2"], "--guard-max-kl"),
        (&edit, &["--no-guard", "--guard-refuse"], "--guard-refuse"),
        (&edit, &["--guard-min-agreement", "NaN"], "--guard-min-agreement"),
        (&edit, &["--guard-max-drop", "2"], "--guard-max-drop"),
        (&edit, &["--guard-max-kl=-1"], "--guard-max-kl must be"),
        (&eval, &["--guard-max-kl", "0.5"], "only used with --edits-per-batch or --sequential"),
        (&eval, &["--image-root", "."], "--image-root"),
    ];
    for (cmd, extra, needle) in cases {
        let out = dualedit(&[cmd, extra].concat());
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && err.contains(needle), "{extra:?}: {err}");
    }
}
