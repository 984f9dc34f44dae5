//! The multimodal default (issue #22): `pretrain --vl` on a tiny visual world (deterministic,
//! learns, writes a directory the loader and image scoring accept), and the shipped
//! `data/vl` default through `dualedit demo --multimodal`.
use crate::common;
use std::path::Path;

use dualedit::data::multimodal::{ImageFile, VlPrompt};
use dualedit::world::visual::{write_visual_world, VisualWorld, VisualWorldConfig};
use dualedit::model::{load_model, ParamView};
use dualedit::bootstrap::pretrain_vl::{pretrain_vl, vl_accuracy, VlPretrainConfig};
use tch::{Device, Kind};

static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

fn tiny_world(dir: &Path) {
    let cfg = VisualWorldConfig { seed: 5, width: 84, height: 84, n_train_scenes: 4, n_holdout_scenes: 2, min_objects: 1, max_objects: 2 };
    write_visual_world(dir, &VisualWorld::generate(&cfg).unwrap()).unwrap();
}

fn tiny_config() -> VlPretrainConfig {
    VlPretrainConfig {
        vocab_size: 320,
        hidden: 32,
        layers: 1,
        heads: 2,
        vision_width: 16,
        vision_depth: 1,
        steps: 300,
        batch_size: 8,
        lr: 3e-3,
        vision_lr_scale: 0.1,
        seed: 11,
        target_accuracy: None,
        probe_every: 100,
    }
}

#[test]
fn pretrain_vl_is_deterministic_learns_and_loads() {
    let _serial = serial();
    tch::set_num_threads(1);
    let tmp = tempfile::tempdir().unwrap();
    let world = tmp.path().join("world");
    tiny_world(&world);
    let (a, b) = (tmp.path().join("a"), tmp.path().join("b"));
    let ra = pretrain_vl(&world, &tiny_config(), &a, Device::Cpu, false).unwrap();
    let rb = pretrain_vl(&world, &tiny_config(), &b, Device::Cpu, false).unwrap();
    for f in ["config.json", "model.safetensors", "tokenizer.json", "preprocessor_config.json"] {
        assert_eq!(std::fs::read(a.join(f)).unwrap(), std::fs::read(b.join(f)).unwrap(), "{f} differs between two runs with one seed");
    }
    assert_eq!(ra.final_loss, rb.final_loss);
    // Learned something: the loss fell well below a uniform guess over the vocabulary
    // (ln 320 = 5.8), and far below a two-step run's, which answers almost nothing right.
    assert!(ra.final_loss < 2.0, "final loss {}", ra.final_loss);
    let c = tmp.path().join("c");
    let rc = pretrain_vl(&world, &VlPretrainConfig { seed: 12, steps: 2, ..tiny_config() }, &c, Device::Cpu, false).unwrap();
    assert!(ra.final_loss < rc.final_loss - 1.0, "{} vs {}", ra.final_loss, rc.final_loss);
    assert!(ra.accuracy.original >= rc.accuracy.original + 0.2, "{:?} vs {:?}", ra.accuracy, rc.accuracy);
    // A Hugging Face directory the loader reads as Qwen2-VL, and image scoring accepts.
    let lm = dualedit::model::load_model(&a, Device::Cpu, tch::Kind::Float).unwrap();
    assert_eq!(lm.model.info().architecture, "Qwen2VLForConditionalGeneration");
    let out = common::dualedit_cmd()
        .args(["score", "--model"])
        .arg(&a)
        .args(["--image"])
        .arg(world.join("images/scene-0000.png"))
        .args(["--text", "What colour is the square?"])
        .output()
        .unwrap();
    assert!(out.status.success(), "score --image failed: {}", String::from_utf8_lossy(&out.stderr));
    // A different seed gives different weights (the seed is used).
    assert_ne!(std::fs::read(a.join("model.safetensors")).unwrap(), std::fs::read(c.join("model.safetensors")).unwrap());
}

#[test]
fn pretrain_vl_names_a_missing_world() {
    let tmp = tempfile::tempdir().unwrap();
    let err = pretrain_vl(&tmp.path().join("nowhere"), &tiny_config(), &tmp.path().join("m"), Device::Cpu, false).unwrap_err().to_string();
    assert!(err.contains("pretrain.json"), "{err}");
}

#[test]
fn multimodal_demo_shows_an_image_edit_and_five_metrics_quickly() {
    let _serial = serial();
    let start = std::time::Instant::now();
    let out = common::dualedit_cmd().args(["demo", "--multimodal", "--json"]).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let elapsed = start.elapsed();
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    println!("multimodal demo ({elapsed:?}): {}", serde_json::to_string_pretty(&v).unwrap());
    assert_eq!(v["model"], "Qwen2VLForConditionalGeneration");
    for k in ["before", "after", "rephrase_image_after", "unrelated_before", "unrelated_after"] {
        assert!(v["edit"][k].is_string(), "edit.{k} missing: {v}");
    }
    let e = &v["easyedit"];
    let metric = |k: &str| e[k].as_f64().unwrap_or_else(|| panic!("easyedit.{k} missing: {v}"));
    let names = ["rewrite_acc", "rephrase_acc", "rephrase_image_acc", "locality_acc", "multimodal_locality_acc"];
    for k in names {
        assert!((0.0..=1.0).contains(&metric(k)), "{k} = {}", metric(k));
    }
    // The shipped editor edits: most held-out rewrites take and unrelated answers stay.
    // (BENCHMARKS.md has the figures reached against the targets.)
    // Shipped: 0.952 / 0.947 / 0.945 / 1.000, image locality 0.646 (top-10 lists), 0.972
    // by the unrelated image's top-1 answer.
    for k in ["rewrite_acc", "rephrase_acc", "rephrase_image_acc", "locality_acc"] {
        assert!(metric(k) >= 0.93, "{k}: {e}");
    }
    assert!(metric("multimodal_locality_acc") >= 0.6, "{e}");
    assert!(v["holdout"]["image_locality_top1"].as_f64().is_some_and(|t| t >= 0.95), "{v}");
    assert!(v["holdout"]["n"].as_u64().unwrap_or(0) >= 50, "{v}");
    // The text output names the five metrics by both names.
    let text = common::dualedit_cmd().args(["demo", "--multimodal"]).output().unwrap();
    let stdout = String::from_utf8_lossy(&text.stdout);
    assert!(text.status.success(), "{}", String::from_utf8_lossy(&text.stderr));
    for needle in ["before:", "after:", "rephrase image:", "unrelated image:", "reliability", "image generality", "image locality"] {
        assert!(stdout.contains(needle), "demo output lacks {needle:?}:\n{stdout}");
    }
    for k in names {
        assert!(stdout.contains(k), "demo output lacks {k:?}:\n{stdout}");
    }
    assert!(elapsed.as_secs() < 60, "demo --multimodal --json took {elapsed:?}");
}

/// Fifty E-VQA edits in one batch on the multimodal default (a finding of the #48 sweep: such
/// a batch ran past 60 s) end in seconds, guarded or not: refused whole with one error
/// naming the guard, or, without it, reported with EasyEdit's five metrics.
#[test]
fn fifty_image_edits_in_one_batch_end_in_seconds() {
    let _serial = serial();
    let root = common::root();
    let world = root.join("data/vl/world");
    let records: Vec<serde_json::Value> = common::json_file(&world.join("vqa-holdout.json")).as_array().unwrap()[..50].to_vec();
    let dir = tempfile::tempdir().unwrap();
    let requests = dir.path().join("vqa50.json");
    std::fs::write(&requests, serde_json::to_string(&records).unwrap()).unwrap();
    for guard in [true, false] {
        let start = std::time::Instant::now();
        let mut cmd = common::dualedit_cmd();
        // One thread: beside the other slow tests (two cores, each process's OpenMP threads
        // spinning at their barriers) a two-thread run was stretched from 1 s to 67 s.
        cmd.env("OMP_NUM_THREADS", "1");
        cmd.args(["edit", "--model", root.join("data/vl/model").to_str().unwrap(), "--editor", root.join("data/vl/editor").to_str().unwrap()]);
        cmd.args(["--ds", "vqa", "--requests", requests.to_str().unwrap(), "--image-root", world.to_str().unwrap(), "--json"]);
        cmd.args(["--report", dir.path().join(format!("r{guard}.json")).to_str().unwrap()]);
        if !guard {
            cmd.arg("--no-guard");
        }
        let out = cmd.output().unwrap();
        let wall = start.elapsed();
        let stderr = String::from_utf8_lossy(&out.stderr);
        // The edit's own span (the report is written refused or not): what the sweep saw
        // run past 60 s. The process's wall time also holds loading, which a busy machine
        // (other slow tests in parallel) stretches.
        let report = common::json_file(&dir.path().join(format!("r{guard}.json")));
        let edit_s = report["seconds"]["edit"].as_f64().unwrap_or_else(|| panic!("no seconds.edit in {report}"));
        if out.status.success() {
            let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
            assert_eq!(v["n"], 50, "{v}");
            assert!(v["easyedit"]["multimodal_locality_acc"].is_number(), "{v}");
        } else {
            assert!(guard, "without the guard the batch is committed: {stderr}");
            let errors: Vec<&str> = stderr.lines().filter(|l| l.starts_with("error:")).collect();
            assert!(errors.len() == 1 && errors[0].contains("guard"), "{stderr}");
        }
        assert!(edit_s < 30.0, "guard {guard}: 50 image edits took {edit_s:.1} s ({wall:?} in all)");
    }
}

/// Issue #47: the multimodal default has key statistics over its visual world
/// (`dualedit stats --data vqa-train.json --ds vqa`: each training record's unrelated image
/// and question, and its NQ question), so several image edits go through `mend-ls` by
/// default. The committed statistics are what the command computes now, and with them 20
/// held-out E-VQA edits one after another are all committed, with higher reliability and
/// image locality than plain summed MEND, which the guard refuses edits of.
#[test]
fn multimodal_default_edits_many_with_statistics_of_its_visual_world() {
    let _serial = serial();
    let root = common::root();
    let world = root.join("data/vl/world");
    let dir = tempfile::tempdir().unwrap();
    let editor = dir.path().join("editor");
    std::fs::create_dir(&editor).unwrap();
    for f in ["editor.json", "editor.safetensors"] {
        std::fs::copy(root.join("data/vl/editor").join(f), editor.join(f)).unwrap();
    }
    let mut cmd = common::dualedit_cmd();
    cmd.env("OMP_NUM_THREADS", "1");
    cmd.args(["stats", "--model", root.join("data/vl/model").to_str().unwrap(), "--editor", editor.to_str().unwrap()]);
    cmd.args(["--data", world.join("vqa-train.json").to_str().unwrap(), "--ds", "vqa", "--image-root", world.to_str().unwrap(), "--json"]);
    let out = cmd.output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!((v["ds"].as_str(), v["lines"].as_u64()), (Some("vqa"), Some(4022)), "{v}");
    // And as `build-default` computes them, into a copy of data/vl.
    let built = dir.path().join("vl");
    std::fs::create_dir_all(built.join("editor")).unwrap();
    for d in ["model", "world"] {
        std::os::unix::fs::symlink(root.join("data/vl").join(d), built.join(d)).unwrap();
    }
    for f in ["editor.json", "editor.safetensors"] {
        std::fs::copy(root.join("data/vl/editor").join(f), built.join("editor").join(f)).unwrap();
    }
    let roots = dualedit::data::multimodal::ImageRoots::new(built.join("world"), None);
    dualedit::bootstrap::demo_vl::visual_key_stats(&built, &Default::default(), Some(&roots)).unwrap();
    let read = |p: &Path| dualedit::io::read_safetensors(p).unwrap().0.into_iter().collect::<std::collections::BTreeMap<_, _>>();
    let shipped = read(&root.join("data/vl/editor/key-stats.safetensors"));
    for now in [read(&editor.join("key-stats.safetensors")), read(&built.join("editor/key-stats.safetensors"))] {
        assert_eq!(now.keys().collect::<Vec<_>>(), shipped.keys().collect::<Vec<_>>());
        for (name, t) in &now {
            let rel = (t - &shipped[name]).abs().max().double_value(&[]) / shipped[name].abs().max().double_value(&[]);
            assert!(rel < 1e-4, "{name}: the shipped statistics differ from a recomputation by {rel:e}");
        }
    }

    let records: Vec<serde_json::Value> = common::json_file(&world.join("vqa-holdout.json")).as_array().unwrap()[..20].to_vec();
    let requests = dir.path().join("vqa20.json");
    std::fs::write(&requests, serde_json::to_string(&records).unwrap()).unwrap();
    let run = |method: Option<&str>| {
        let mut cmd = common::dualedit_cmd();
        cmd.env("OMP_NUM_THREADS", "1").current_dir(dir.path());
        cmd.args(["edit", "--model", root.join("data/vl/model").to_str().unwrap(), "--editor", root.join("data/vl/editor").to_str().unwrap()]);
        cmd.args(["--ds", "vqa", "--requests", requests.to_str().unwrap(), "--image-root", world.to_str().unwrap(), "--sequential", "--json"]);
        if let Some(m) = method {
            cmd.args(["--method", m]);
        }
        let out = cmd.output().unwrap();
        assert!(out.status.success(), "{method:?}: {}", String::from_utf8_lossy(&out.stderr));
        serde_json::from_slice::<serde_json::Value>(&out.stdout).unwrap()
    };
    let (default, plain) = (run(None), run(Some("mend")));
    let f = |v: &serde_json::Value, k: &str| v[k].as_f64().unwrap_or_else(|| panic!("no {k} in {v}"));
    println!(
        "20 in a row: default {} {:.2}/{:.2}/{:.2} image locality {:.3}, refused {}; plain mend {:.2}/{:.2}/{:.2} image locality {:.3}, refused {}",
        default["method"], f(&default, "reliability"), f(&default, "generalization"), f(&default, "locality"), f(&default, "image_locality"), default["refused"],
        f(&plain, "reliability"), f(&plain, "generalization"), f(&plain, "locality"), f(&plain, "image_locality"), plain["refused"]
    );
    assert_eq!((default["method"].as_str(), default["refused"].as_u64()), (Some("mend-ls"), Some(0)), "{default}");
    assert!(plain["refused"].as_u64().unwrap() > 0, "{plain}");
    assert!(f(&default, "reliability") > f(&plain, "reliability") && f(&default, "image_locality") > f(&plain, "image_locality"), "{default}\n{plain}");
}

/// The shipped multimodal model answers from the picture it is shown: held-out questions
/// are right with their own image and mostly wrong with another scene's (the record's
/// `m_loc` image), so an image edit has image-specific states to work on. (The model the
/// first build shipped answered every picture alike: docs/notebook/vision-language.md.)
#[test]
fn shipped_vl_model_reads_the_pictures() {
    let _serial = serial();
    tch::set_num_threads(1);
    let root = common::root().join("data/vl");
    let world = root.join("world");
    let lm = load_model(&root.join("model"), Device::Cpu, Kind::Float).unwrap();
    let vl = lm.model.family().vision_language().expect("a vision-language model");
    let proc = vl.image_processor(&lm.dir).unwrap();
    let cfg = VisualWorld::read(&world).unwrap().config;
    let vp = VlPrompt { vl, proc: &proc, template: vl.default_chat_template() };
    let records: Vec<serde_json::Value> = serde_json::from_str(&std::fs::read_to_string(world.join("vqa-holdout.json")).unwrap()).unwrap();
    let example = |r: &serde_json::Value, image: &str| {
        let img = ImageFile { path: world.join(r[image].as_str().unwrap()), height: cfg.height as i64, width: cfg.width as i64 };
        vp.image_example(&lm.tokenizer, &img, r["src"].as_str().unwrap(), r["pred"].as_str().unwrap()).unwrap()
    };
    let own: Vec<_> = records.iter().take(200).map(|r| example(r, "image")).collect();
    let other: Vec<_> = records.iter().take(200).map(|r| example(r, "m_loc")).collect();
    let p = ParamView::frozen(&lm.params);
    let pad = lm.tokenizer.pad_id();
    let (a_own, a_other) = (vl_accuracy(&lm.model, vl, &p, &proc, pad, &own).unwrap(), vl_accuracy(&lm.model, vl, &p, &proc, pad, &other).unwrap());
    println!("held-out questions right: {a_own:.3} with their image, {a_other:.3} with another scene's");
    assert!(a_own >= 0.95, "{a_own}");
    assert!(a_other <= 0.5, "{a_other}: the answers do not depend on the picture");
}
