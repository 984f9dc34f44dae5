//! Multimodal MEND (issue #22) on the tiny random Qwen2-VL fixture: the E-VQA reader, the
//! five views' tokens and labels, the shifted loss, and single = dual training and
//! evaluation with images on CPU.
use crate::common;
use std::path::{Path, PathBuf};

use common::fixture;
use dualedit::run::compare::{compare_eval, compare_train};
use dualedit::config::MendConfig;
use dualedit::data::multimodal::{load_mm, parse_mm, ImageRoots};
use dualedit::data::examples::DataCounts;
use dualedit::data::{DatasetKind, EditExample, EditRecord, Example};
use dualedit::device::DevicePlan;
use dualedit::edit::{open_engine, LoadOptions, MethodSpec};
use dualedit::mend::{losses, Engine};
use dualedit::model::ForwardInput;
use dualedit::run::{load_examples, Common, EvalOptions, TrainOptions};
use tch::{Device, Kind, Tensor};

/// A `w × h` PNG filled from `seed`.
fn png(path: &Path, w: u32, h: u32, seed: u8) {
    let img = image::RgbImage::from_fn(w, h, |x, y| image::Rgb([(x as u8).wrapping_mul(seed), (y as u8).wrapping_add(seed), seed.wrapping_mul(7)]));
    img.save(path).unwrap();
}

/// COCO root with a.png / b.png / loc.png, rephrase root with r.png (another size).
fn roots(dir: &Path) -> ImageRoots {
    let (coco, reph) = (dir.join("coco"), dir.join("reph"));
    std::fs::create_dir_all(coco.join("val")).unwrap();
    std::fs::create_dir_all(&reph).unwrap();
    png(&coco.join("val/a.png"), 40, 30, 3);
    png(&coco.join("val/b.png"), 30, 40, 5);
    png(&coco.join("loc.png"), 50, 50, 9);
    png(&reph.join("r.png"), 224, 28, 11);
    ImageRoots::new(coco, Some(reph))
}

fn record(src: &str, alt: &str, image: &str) -> serde_json::Value {
    serde_json::json!({
        "src": src, "pred": "a dog", "alt": alt, "rephrase": format!("{src} Tell me."),
        "image": image, "image_rephrase": "r.png",
        "loc": "nq question: who wrote hamlet", "loc_ans": "shakespeare",
        "m_loc": "loc.png", "m_loc_q": "What colour is the bus?", "m_loc_a": "red"
    })
}

fn write_data(dir: &Path, records: &[serde_json::Value]) -> PathBuf {
    let p = dir.join("vqa.json");
    std::fs::write(&p, serde_json::to_string(records).unwrap()).unwrap();
    p
}

#[test]
fn reader_resolves_roots_and_skips_empty_targets_and_missing_images() {
    let dir = tempfile::tempdir().unwrap();
    let r = roots(dir.path());
    let data = write_data(
        dir.path(),
        &[
            record("What is in the picture?", "a cat", "val/a.png"),
            record("What animal is this?", "", "val/a.png"),
            record("What is on the table?", "a cup", "val/missing.png"),
            record("What is shown?", "a bird", "val/b.png"),
        ],
    );
    let load = load_mm(&data, DatasetKind::Vqa, &r, false).unwrap();
    assert_eq!((load.in_file, load.records.len()), (4, 2));
    assert_eq!(load.file_index, vec![0, 3]);
    assert_eq!(load.skipped_empty.iter().map(|s| s.0).collect::<Vec<_>>(), vec![1]);
    assert_eq!(load.skipped_image.len(), 1);
    assert_eq!(load.skipped_image[0].0, 2);
    assert!(load.skipped_image[0].1.contains("missing.png"), "{:?}", load.skipped_image);
    let a = &load.records[0];
    assert_eq!(a.image.path, r.image_root.join("val/a.png"));
    assert_eq!((a.image.height, a.image.width), (30, 40));
    assert_eq!(a.image_rephrase.as_ref().unwrap().path, r.rephrase_root.join("r.png"));
    assert_eq!(a.m_loc.as_ref().unwrap().image.path, r.image_root.join("loc.png"));
    assert_eq!(a.pred.as_deref(), Some("a dog"));

    // --strict: the bad image is an error naming the file, the record and the image.
    let err = load_mm(&data, DatasetKind::Vqa, &r, true).unwrap_err().to_string();
    assert!(err.contains("vqa.json") && err.contains("record 2") && err.contains("missing.png"), "{err}");
    // The rephrase root defaults to the image root, where r.png is not.
    let err = load_mm(&data, DatasetKind::Vqa, &ImageRoots::new(r.image_root.clone(), None), true).unwrap_err().to_string();
    assert!(err.contains("r.png"), "{err}");
    // A required key missing is an error naming it; text readers refuse the kind.
    let err = parse_mm(r#"[{"src": "q", "alt": "a"}]"#, Path::new("x.json"), DatasetKind::Caption, &r, false).unwrap_err().to_string();
    assert!(err.contains("x.json") && err.contains("\"image\""), "{err}");
    let err = dualedit::data::load_records(&data, DatasetKind::Vqa).unwrap_err().to_string();
    assert!(err.contains("`image_root`") || err.contains("multimodal"), "{err}");
}

/// Only `src`, `alt` and `image` are required (EasyEdit's optional views): a record without
/// the others is edited and measured, the metrics of its absent views are absent (not zero),
/// and one half of a view (`loc` without `loc_ans`) is an error naming both keys.
#[test]
fn optional_views_may_be_left_out_and_their_metrics_are_absent() {
    let dir = tempfile::tempdir().unwrap();
    let r = roots(dir.path());
    let full = record("What is in the picture?", "a cat", "val/a.png");
    let bare = serde_json::json!({"src": "What is shown?", "alt": "a bird", "image": "val/b.png"});
    let mut some = bare.clone();
    some["loc"] = full["loc"].clone();
    some["loc_ans"] = full["loc_ans"].clone();
    some["rephrase"] = serde_json::Value::Null;
    let text = serde_json::to_string(&[full, bare, some]).unwrap();
    let load = parse_mm(&text, Path::new("x.json"), DatasetKind::Vqa, &r, true).unwrap();
    assert_eq!(load.records.len(), 3);
    let b = &load.records[1];
    assert!(b.rephrase.is_none() && b.image_rephrase.is_none() && b.loc.is_none() && b.m_loc.is_none(), "{b:?}");
    assert!(load.records[2].loc.is_some() && load.records[2].m_loc.is_none());

    let mut s = vl_session();
    let out = s.edit_image_requests(&text, &r).unwrap();
    assert_eq!(out.requests.len(), 3);
    let m = |i: usize| serde_json::to_value(&out.requests[i]).unwrap();
    for k in ["generalization", "image_generalization", "locality", "image_locality"] {
        assert!(m(0)[k].is_number(), "the full record has {k}: {}", m(0));
    }
    let bare = m(1);
    assert!(bare["reliability"].is_number(), "{bare}");
    assert!(bare["generalization"].is_null() && bare["locality"].is_null(), "{bare}");
    assert!(bare.get("image_generalization").is_none() && bare.get("image_locality").is_none(), "{bare}");
    assert!(m(2)["locality"].is_number() && m(2).get("image_locality").is_none(), "{}", m(2));
    // The means are over the records that have the view.
    let loc: Vec<f64> = [0, 2].iter().map(|&i| m(i)["locality"].as_f64().unwrap()).collect();
    assert!((out.summary.locality.unwrap() - (loc[0] + loc[1]) / 2.0).abs() < 1e-12);
    assert_eq!(out.summary.image_locality, m(0)["image_locality"].as_f64());

    // Half a view is a mistake, named.
    for (drop, keeps) in [("loc_ans", "loc"), ("m_loc_q", "m_loc")] {
        let mut half = record("Q?", "a", "val/a.png");
        half.as_object_mut().unwrap().remove(drop);
        let err = parse_mm(&serde_json::to_string(&[half]).unwrap(), Path::new("x.json"), DatasetKind::Vqa, &r, true).unwrap_err().to_string();
        assert!(err.contains("x.json") && err.contains("record 0") && err.contains(drop) && err.contains(keeps), "{err}");
    }
}

fn engine(plan: DevicePlan) -> Engine {
    open_engine(&fixture("qwen2_vl"), &LoadOptions { plan, ..LoadOptions::default() }, &[]).unwrap()
}

/// One E-VQA record ("What is in the picture?" → "a cat") with its images under `dir`, read
/// for the fixture engine: the engine, the roots, and what `load_examples` gives.
fn one_record(dir: &Path) -> (Engine, ImageRoots, (Vec<EditRecord>, Vec<EditExample>, DataCounts)) {
    let r = roots(dir);
    let data = write_data(dir, &[record("What is in the picture?", "a cat", "val/a.png")]);
    let engine = engine(DevicePlan::single(Device::Cpu));
    let loaded = load_examples(&engine, &data, DatasetKind::Vqa, None, 200, Default::default(), Some(&r)).unwrap();
    (engine, r, loaded)
}

#[test]
fn five_views_tokens_labels_and_the_shifted_loss() {
    let dir = tempfile::tempdir().unwrap();
    let (engine, r, (recs, ex, counts)) = one_record(dir.path());
    assert_eq!((recs.len(), counts.used, counts.skipped_image), (1, 1, 0));
    let e = &ex[0];
    let tok = &engine.lm.tokenizer;
    let (vs, pad, ve) = (3i64, 5i64, 4i64);
    let count = |x: &Example| x.ids.iter().filter(|&&t| t == pad).count();
    // smart_resize (min_pixels 3136): 40×30 -> 84×56, 6 merged tokens; 50×50 -> 56×56, 4;
    // the 224×28 rephrase image stays, 2×16 patches, 8.
    let oi = e.outer_image.as_ref().unwrap();
    for (name, x, n) in [("inner", &e.inner, 6), ("outer", &e.outer, 6), ("outer_image", oi, 8), ("loc_image", e.loc_image.as_ref().unwrap(), 4)] {
        assert_eq!(count(x), n, "{name}");
        let g = x.image.as_ref().unwrap().grid;
        assert_eq!(g.iter().product::<i64>() / 4, n as i64, "{name}: {g:?}");
    }
    assert_eq!(oi.image.as_ref().unwrap().path, r.rephrase_root.join("r.png"));
    let loc = e.loc.as_ref().unwrap();
    assert!(loc.image.is_none() && count(loc) == 0);
    // Each image view: chat template, vision_start, the pad run, vision_end, then the
    // text; the labels are exactly the tokens of " " + target.
    for (x, text, answer) in [(&e.inner, "What is in the picture?", "a cat"), (&e.outer, "What is in the picture? Tell me.", "a cat"), (oi, "What is in the picture?", "a cat")] {
        let start = x.ids.iter().position(|&t| t == vs).unwrap();
        let n = count(x);
        assert!(x.ids[start + 1..=start + n].iter().all(|&t| t == pad) && x.ids[start + n + 1] == ve);
        let prompt = tok.decode(&x.ids[..x.answer_start]).unwrap();
        assert!(prompt.contains(text) && prompt.contains("assistant"), "{prompt:?}");
        assert_eq!(tok.decode(x.answer()).unwrap().trim(), answer);
    }
    let li = e.loc_image.as_ref().unwrap();
    assert!(tok.decode(&li.ids[..li.answer_start]).unwrap().contains("Question: What colour is the bus? Short answer:"));
    assert_eq!(tok.decode(li.answer()).unwrap().trim(), "red");
    assert_eq!(tok.decode(loc.answer()).unwrap().trim(), "shakespeare");

    // The batch: labels only on the target, M-RoPE positions and features for every row.
    let images = engine.images(&[&e.inner, oi]).unwrap().unwrap();
    assert_eq!(images.len(), 2, "one tower forward per distinct image");
    let b = engine.collate_with(&[&e.inner, oi], Some(&images)).unwrap();
    let kept: Vec<i64> = Vec::try_from(b.kept_targets()).unwrap();
    let mut want = e.inner.answer().to_vec();
    want.extend(oi.answer());
    assert_eq!(kept, want);
    assert_eq!(b.position_ids.as_ref().unwrap().size()[..2], [3, 2]);
    assert_eq!(b.image_embeds.as_ref().unwrap().size()[0], (count(&e.inner) + count(oi)) as i64);

    // The loss: position i's logits against token i + 1, by hand from the full logits.
    let one = engine.collate(&[&e.inner]).unwrap();
    let none = Default::default();
    let full = {
        let input = ForwardInput { keep: None, ..one.forward_input(&none) };
        engine.lm.model.forward(&dualedit::model::ParamView::frozen(&engine.lm.params), &input).unwrap().logits
    };
    let full = full.reshape([-1, full.size()[full.dim() - 1]]);
    let lp = full.log_softmax(-1, Kind::Float);
    let a = e.inner.answer_start;
    let by_hand: f64 = (a..e.inner.ids.len()).map(|p| -lp.double_value(&[(p - 1) as i64, e.inner.ids[p]])).sum::<f64>() / (e.inner.ids.len() - a) as f64;
    let ours = losses::nll(&engine.base_logits(&one).unwrap(), &one.kept_targets()).double_value(&[]);
    assert!((ours - by_hand).abs() < 1e-5, "{ours} vs {by_hand}");
    // EasyEdit's unshifted Qwen2-VL scoring (position i against label i) is another number.
    let unshifted: f64 = (a..e.inner.ids.len() - 1).map(|p| -lp.double_value(&[p as i64, e.inner.ids[p]])).sum::<f64>() / (e.inner.ids.len() - 1 - a) as f64;
    assert!((unshifted - by_hand).abs() > 1e-3, "{unshifted} vs {by_hand}");
    let _ = Tensor::zeros([1], (Kind::Float, Device::Cpu));
}

#[test]
fn image_training_and_evaluation_match_between_single_and_dual_on_cpu() {
    let dir = tempfile::tempdir().unwrap();
    let r = roots(dir.path());
    let qs = ["What is in the picture?", "What animal is this?", "What is shown here?", "What do you see?", "Name the object."];
    let alts = ["a cat", "a horse", "a bird", "a lamp", "a boat"];
    let recs: Vec<_> = qs.iter().zip(alts).enumerate().map(|(i, (q, a))| record(q, a, if i % 2 == 0 { "val/a.png" } else { "val/b.png" })).collect();
    let data = write_data(dir.path(), &recs);
    let common = Common { seed: 3, image_roots: Some(r.clone()), ..Common::single(fixture("qwen2_vl"), Device::Cpu) };
    let config = MendConfig { rank: 8, lr: 1e-3, edit_lr: 1e-3, accumulate: 1, max_steps: 3, val_every: 3, val_records: 1, max_length: 200, ..MendConfig::default() };
    let opts = TrainOptions { common: common.clone(), data: data.clone(), ds: DatasetKind::Vqa, config, out: dir.path().join("train"), limit: None, resume: false, init: None, progress: false };
    let split = DevicePlan::split_on(Device::Cpu, Device::Cpu);
    let c = compare_train(&opts, split).unwrap();
    for k in ["image_edit_acc.step00001", "image_loc_kl.step00003", "image_loc_acc.step00002"] {
        assert!(c.single.metrics.contains_key(k), "{k} missing: {:?}", c.single.metrics.keys());
    }
    assert!(c.metrics_agree, "train: max relative difference {}", c.max_relative_difference);
    for (k, a) in &c.single.metrics {
        let b = c.dual.metrics[k];
        assert!((a - b).abs() <= 1e-5 * (1.0 + a.abs()), "{k}: single {a} vs dual {b}");
    }

    let eval = EvalOptions {
        common,
        method: MethodSpec::Mend { editor: dir.path().join("train/single") },
        data,
        ds: DatasetKind::Vqa,
        limit: Some(2),
        max_length: 200,
        capacity: None,
    };
    let c = compare_eval(&eval, split, dir.path()).unwrap();
    for k in ["reliability", "generalization", "locality", "image_generalization", "image_locality"] {
        assert!(c.single.metrics.contains_key(k), "{k} missing");
    }
    assert!(c.metrics_agree, "eval: max relative difference {}", c.max_relative_difference);
    // The report carries EasyEdit's names.
    let report: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(dir.path().join("eval-dual.json")).unwrap()).unwrap();
    let text = report.to_string();
    for k in ["rewrite_acc", "rephrase_acc", "rephrase_image_acc", "locality_acc", "multimodal_locality_acc"] {
        assert!(text.contains(k), "{k} not in the eval report");
    }
}

#[test]
fn qwen2vl_7b_preset_names_resolve_in_both_layouts() {
    use dualedit::model::qwen2_vl::Qwen2Vl;
    let cfg = MendConfig::from_file(&common::root().join("configs/qwen2vl-7b.json")).unwrap();
    assert_eq!((cfg.rank, cfg.c_edit, cfg.c_loc, cfg.i_edit, cfg.shared), (1920, 0.1, 1.0, 0.1, true));
    let json: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(fixture("qwen2_vl_7b_instruct").join("config.json")).unwrap()).unwrap();
    let m = Qwen2Vl::from_json(&json, "Qwen2VLForConditionalGeneration").unwrap();
    let names: Vec<String> = dualedit::model::Family::expected_params(&m).into_iter().map(|(n, _)| n).collect();
    for n in &cfg.edit_params {
        assert!(names.contains(n), "{n} is not a parameter of Qwen2-VL-7B");
        let new_layout = n.replacen("model.", "model.language_model.", 1);
        assert_eq!(&Qwen2Vl::canonical_name(&new_layout), n);
        assert!(dualedit::model::Family::layout(&m, n).is_some(), "{n} is not an editable linear layer");
    }
}

/// A session on the Qwen2-VL fixture with an untrained editor (a plain gradient step of
/// size edit_lr), for the library and HTTP image edit paths.
pub fn vl_session() -> dualedit::edit::session::Session {
    let engine = engine(DevicePlan::single(Device::Cpu));
    let cfg = MendConfig { rank: 8, edit_lr: 1e-2, ..MendConfig::default() };
    let editor = dualedit::mend::Editor::new(&cfg, engine.edit_params.clone(), Device::Cpu, 0).unwrap();
    dualedit::edit::session::Session::from_parts(engine, Some(editor))
}

/// Issue #22: a library user applies E-VQA requests with images through `Session`; the edit
/// counts, changes the image score, and `reset` restores it bit for bit. A text-only model
/// refuses image requests, and a bad request is an input error naming the record.
#[test]
fn session_edits_with_images_and_reset_restores_the_image_score() {
    use dualedit::edit::session::{read_image_requests, Session, SessionOptions};
    let dir = tempfile::tempdir().unwrap();
    let r = roots(dir.path());
    let text = serde_json::to_string(&[record("What is in the picture?", "a cat", "val/a.png"), record("What animal is this?", "a horse", "val/b.png")]).unwrap();
    let mut s = vl_session();
    let probe = "What is in the picture? a cat";
    let img = r.image_root.join("val/a.png");
    let before = s.score_image(probe, Some(&img)).unwrap();
    assert!(before.image_tokens > 0);

    let out = s.edit_image_requests(&text, &r).unwrap();
    assert_eq!((out.requests.len(), out.edits_total, s.edits_total()), (2, 2, 2));
    assert_eq!(out.requests[0].prompt, "What is in the picture?");
    assert_eq!(out.requests[1].target_new, "a horse");
    let edited = s.score_image(probe, Some(&img)).unwrap();
    assert_ne!(edited.logprobs, before.logprobs, "the image edit changed nothing");
    // The same records, parsed by the caller.
    let records = read_image_requests(&text, &r).unwrap();
    assert_eq!(s.edit_images(&records[..1]).unwrap().edits_total, 3);
    // Uploaded bytes score as the file does.
    let bytes = std::fs::read(&img).unwrap();
    assert_eq!(s.score_image_bytes(probe, &bytes).unwrap().logprobs, s.score_image(probe, Some(&img)).unwrap().logprobs);
    assert!(s.score_image_bytes(probe, b"not an image").unwrap_err().to_string().contains("PNG or JPEG"));

    assert!(s.reset().unwrap() > 0);
    assert_eq!(s.edits_total(), 0);
    let after = s.score_image(probe, Some(&img)).unwrap();
    assert_eq!(after.logprobs, before.logprobs, "reset restores the image score exactly");
    assert_eq!(after.tokens, before.tokens);

    // Bad requests: named, input errors.
    let missing = serde_json::to_string(&[record("Q?", "a", "val/none.png")]).unwrap();
    let err = s.edit_image_requests(&missing, &r).unwrap_err();
    assert!(matches!(err, dualedit::Error::Input(_)) && err.to_string().contains("none.png"), "{err}");
    let empty = serde_json::to_string(&[record("Q?", "", "val/a.png")]).unwrap();
    assert!(s.edit_image_requests(&empty, &r).unwrap_err().to_string().contains("record 0"));
    assert!(s.edit_images(&[]).is_err());

    // A text-only model refuses image requests, saying why.
    let cfg = MendConfig { rank: 8, ..MendConfig::default() };
    let text_engine = open_engine(&fixture("gpt2"), &LoadOptions::default(), &[]).unwrap();
    let editor = dualedit::mend::Editor::new(&cfg, text_engine.edit_params.clone(), Device::Cpu, 0).unwrap();
    let mut t = Session::from_parts(text_engine, Some(editor));
    let err = t.edit_images(&records).unwrap_err();
    assert!(matches!(err, dualedit::Error::Input(_)) && err.to_string().contains("text-only"), "{err}");
    assert_eq!(t.edits_total(), 0);
    // And a session without an editor refuses to edit.
    let mut plain = Session::open(&fixture("qwen2_vl"), None, &SessionOptions::default()).unwrap();
    assert!(plain.edit_images(&records).unwrap_err().to_string().contains("no editor"));
}

/// Image locality as EasyEdit computes `multimodal_locality_acc`: the top-10 token lists of
/// the unrelated image's sequence at every position (chat template, image tokens, question
/// and answer), entry by entry, before and after; beside it the answer's top-1 tokens. By
/// hand from the full logits of a perturbed model.
#[test]
fn image_locality_compares_top_ten_lists_at_every_position() {
    use dualedit::model::{Overrides, ParamView};
    let dir = tempfile::tempdir().unwrap();
    let (engine, _, (_, ex, _)) = one_record(dir.path());
    let e = &ex[0];
    let li = e.loc_image.as_ref().unwrap();
    let images = engine.images(&dualedit::edit::eval::all_views(&[e])).unwrap();
    // Every edited weight moved by noise: some top-10 lists change, not all.
    let mut ov = Overrides::new();
    dualedit::rng::torch_seeded(4, || {
        for p in &engine.edit_params {
            let w = engine.lm.params.get(&p.name).unwrap();
            ov.insert(p.name.clone(), w + w.randn_like() * 0.5 * w.std(true));
        }
    });
    let before = dualedit::edit::eval::measure_before(&engine, &[e], images.as_ref()).unwrap();
    let m = &dualedit::edit::eval::measure_after(&engine, &ov, &[e], &before, 0.0, images.as_ref()).unwrap()[0];

    let mut ids = li.ids.clone();
    ids.push(0);
    let every = Example { ids, answer_start: li.ids.len(), image: li.image.clone() };
    let b = engine.collate_with(&[&every], images.as_ref()).unwrap();
    let none = Default::default();
    let top10 = |ov: Option<&Overrides>| -> Tensor {
        let _g = tch::no_grad_guard();
        let input = ForwardInput { keep: None, ..b.forward_input(&none) };
        let logits = engine.lm.model.forward(&ParamView::new(&engine.lm.params, ov), &input).unwrap().logits;
        let logits = logits.reshape([-1, logits.size()[logits.dim() - 1]]);
        assert_eq!(logits.size()[0], li.ids.len() as i64, "one row per token of the sequence");
        logits.topk(10, -1, true, true).1
    };
    let (pre, post) = (top10(None), top10(Some(&ov)));
    let share = |a: &Tensor, b: &Tensor| a.eq_tensor(b).to_kind(Kind::Double).mean(Kind::Double).double_value(&[]);
    let all = share(&pre, &post);
    // The rows whose logits predict the answer's tokens.
    let rows = |t: &Tensor| t.slice(0, li.answer_start as i64 - 1, li.ids.len() as i64 - 1, 1);
    let top1 = share(&rows(&pre).select(1, 0), &rows(&post).select(1, 0));
    assert!(all > 0.0 && all < 1.0, "the noise must move some lists and keep some: {all}");
    assert!((m.image_locality.unwrap() - all).abs() < 1e-12, "{:?} vs {all}", m.image_locality);
    assert!((m.image_locality_top1.unwrap() - top1).abs() < 1e-12, "{:?} vs {top1}", m.image_locality_top1);
    // The answer's rows alone give another top-10 figure: the metric is not answer-only.
    assert_ne!(share(&rows(&pre), &rows(&post)), all);
}

/// #35: the scored views are forwarded in groups of similar length (E-VQA: the three
/// image views together, the short text `loc` alone) and score exactly as the one padded
/// forward over all four did, with the prefix shared or not, on one device and split.
#[test]
fn views_grouped_by_length_score_as_one_padded_forward() {
    use dualedit::mend::Editor;
    use dualedit::mend::train::{meta_loss, EditBatches, EditedGroup, View};
    let evqa = [(View::Outer, 1, 290), (View::OuterImage, 1, 290), (View::Loc, 1, 44), (View::LocImage, 1, 288)];
    assert_eq!(EditBatches::groups(&evqa), vec![vec![View::Outer, View::OuterImage, View::LocImage], vec![View::Loc]]);
    assert_eq!(EditBatches::groups(&[(View::Outer, 2, 20), (View::Loc, 2, 12)]), vec![vec![View::Outer, View::Loc]]);

    let dir = tempfile::tempdir().unwrap();
    let (_, _, (_, ex, _)) = one_record(dir.path());
    let e = &ex[0];
    let names: Vec<String> = ["up_proj", "down_proj"].iter().map(|m| format!("model.layers.1.mlp.{m}.weight")).collect();
    let cfg = MendConfig { rank: 8, edit_lr: 1e-3, max_length: 200, edit_params: names.clone(), ..MendConfig::default() };
    for plan in [DevicePlan::single(Device::Cpu), DevicePlan::split_on(Device::Cpu, Device::Cpu)] {
        for share in [false, true] {
            let mut engine = open_engine(&fixture("qwen2_vl"), &LoadOptions { plan, ..LoadOptions::default() }, &names).unwrap();
            engine.share_prefix = share;
            let run = |one_forward: bool| {
                let mut editor = Editor::new(&cfg, engine.edit_params.clone(), Device::Cpu, 0).unwrap();
                let mut b = EditBatches::for_config(&engine, &[e], &cfg).unwrap();
                let groups: Vec<Vec<View>> = b.edited.iter().map(|g| g.views.clone()).collect();
                if one_forward {
                    // All four views in one batch padded to the longest, as before #35.
                    let all = [&e.outer, e.outer_image.as_ref().unwrap(), e.loc.as_ref().unwrap(), e.loc_image.as_ref().unwrap()];
                    let batch = engine.collate(&all).unwrap();
                    let parts: Vec<(&dualedit::data::TokenBatch, i64)> =
                        [View::Outer, View::OuterImage, View::Loc, View::LocImage].iter().enumerate().map(|(i, v)| (b.view(*v).unwrap(), i as i64)).collect();
                    engine.share_boundary(&batch, &parts).unwrap();
                    b.edited = vec![EditedGroup { views: vec![View::Outer, View::OuterImage, View::Loc, View::LocImage], batch: Some(batch) }];
                }
                let (loss, parts) = meta_loss(&engine, &mut editor, &b, true).unwrap();
                loss.backward();
                let (net, _) = editor.trainables();
                let g: f64 = net.iter().filter(|t| t.grad().defined()).map(|t| t.grad().square().sum(Kind::Double).double_value(&[])).sum();
                (parts, g, groups)
            };
            let (p0, g0, _) = run(true);
            let (p1, g1, groups) = run(false);
            let what = format!("{plan:?}, share_prefix {share}");
            let lens: Vec<i64> = [&e.outer, e.loc.as_ref().unwrap()].iter().map(|x| x.ids.len() as i64).collect();
            assert_eq!(groups, vec![vec![View::Outer, View::OuterImage, View::LocImage], vec![View::Loc]], "{what}: view lengths {lens:?}");
            let pairs = [
                ("loss", p0.loss, p1.loss),
                ("edit_nll", p0.edit_nll, p1.edit_nll),
                ("loc_kl", p0.loc_kl, p1.loc_kl),
                ("loc_acc", p0.loc_acc, p1.loc_acc),
                ("image_edit_nll", p0.image_edit_nll.unwrap(), p1.image_edit_nll.unwrap()),
                ("image_loc_kl", p0.image_loc_kl.unwrap(), p1.image_loc_kl.unwrap()),
                ("image_loc_acc", p0.image_loc_acc.unwrap(), p1.image_loc_acc.unwrap()),
            ];
            for (k, a, b) in pairs {
                assert!((a - b).abs() <= 1e-5 * (1.0 + a.abs()) + 1e-7, "{what}: {k}: one forward {a}, grouped {b}");
            }
            assert!(g0 > 0.0 && (g0 - g1).abs() <= 1e-4 * g0, "{what}: |grad|² {g0} vs {g1}");
        }
    }
}

/// #35: on Qwen2-VL with images (M-RoPE tables, the image views and the text `loc` in
/// their groups), the last block only at the scored positions gives the step of the whole
/// last block: the same losses, metrics and editor gradients, single and split.
#[test]
fn last_block_at_the_kept_rows_scores_as_the_whole_block() {
    use dualedit::mend::Editor;
    use dualedit::mend::train::{meta_loss, EditBatches};
    let dir = tempfile::tempdir().unwrap();
    let (_, _, (_, ex, _)) = one_record(dir.path());
    let e = &ex[0];
    let names: Vec<String> = ["self_attn.q_proj", "mlp.up_proj", "mlp.down_proj"].iter().map(|m| format!("model.layers.1.{m}.weight")).collect();
    let cfg = MendConfig { rank: 8, edit_lr: 1e-3, max_length: 200, edit_params: names.clone(), ..MendConfig::default() };
    for plan in [DevicePlan::single(Device::Cpu), DevicePlan::split_on(Device::Cpu, Device::Cpu)] {
        let run = |at_kept: bool| {
            let mut engine = open_engine(&fixture("qwen2_vl"), &LoadOptions { plan, ..LoadOptions::default() }, &names).unwrap();
            engine.last_block_at_kept = at_kept;
            let mut editor = Editor::new(&cfg, engine.edit_params.clone(), Device::Cpu, 0).unwrap();
            let b = EditBatches::for_config(&engine, &[e], &cfg).unwrap();
            let (loss, parts) = meta_loss(&engine, &mut editor, &b, true).unwrap();
            loss.backward();
            let (net, _) = editor.trainables();
            let g: Vec<Tensor> = net.iter().filter(|t| t.grad().defined()).map(|t| t.grad().reshape([-1])).collect();
            (parts, Tensor::cat(&g, 0))
        };
        let (p0, g0) = run(false);
        let (p1, g1) = run(true);
        let what = format!("{plan:?}");
        let pairs = [
            ("loss", p0.loss, p1.loss),
            ("edit_nll", p0.edit_nll, p1.edit_nll),
            ("loc_kl", p0.loc_kl, p1.loc_kl),
            ("edit_acc", p0.edit_acc, p1.edit_acc),
            ("image_edit_nll", p0.image_edit_nll.unwrap(), p1.image_edit_nll.unwrap()),
            ("image_loc_kl", p0.image_loc_kl.unwrap(), p1.image_loc_kl.unwrap()),
            ("image_loc_acc", p0.image_loc_acc.unwrap(), p1.image_loc_acc.unwrap()),
        ];
        for (k, a, b) in pairs {
            assert!((a - b).abs() <= 1e-5 * (1.0 + a.abs()) + 1e-7, "{what}: {k}: whole last block {a}, kept rows {b}");
        }
        let scale = g0.abs().max().double_value(&[]);
        let diff = (&g0 - &g1).abs().max().double_value(&[]);
        assert!(scale > 0.0 && diff <= 1e-4 * scale, "{what}: editor gradients differ by {diff} (largest {scale})");
    }
}

/// The Qwen2-VL fixture grown to four blocks (random weights), so that a chain of four
/// devices has a block for each.
fn four_block_qwen2_vl(dir: &Path) -> PathBuf {
    let src = fixture("qwen2_vl");
    let out = dir.join("qwen2_vl_4");
    std::fs::create_dir_all(&out).unwrap();
    for f in ["tokenizer.json", "preprocessor_config.json"] {
        std::fs::copy(src.join(f), out.join(f)).unwrap();
    }
    let mut cfg: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(src.join("config.json")).unwrap()).unwrap();
    cfg["text_config"]["num_hidden_layers"] = 4.into();
    cfg["text_config"]["layer_types"] = serde_json::json!(vec!["full_attention"; 4]);
    std::fs::write(out.join("config.json"), cfg.to_string()).unwrap();
    let (model, _) = dualedit::model::loader::read_config(&out).unwrap();
    let params = dualedit::model::loader::random_params(&model, Device::Cpu, Kind::Float, 7);
    let tensors: Vec<(String, Tensor)> = params.iter().map(|(n, t)| (n.clone(), t.shallow_clone())).collect();
    Tensor::write_safetensors(&tensors, out.join("model.safetensors")).unwrap();
    out
}

/// #38: image training and evaluation over chains of three and four logical CPU devices
/// give the single-device run's losses and metrics; each crossing is counted.
#[test]
fn image_training_and_evaluation_over_a_chain_match_one_device() {
    let dir = tempfile::tempdir().unwrap();
    let model = four_block_qwen2_vl(dir.path());
    let r = roots(dir.path());
    let qs = ["What is in the picture?", "What animal is this?", "What is shown here?"];
    let alts = ["a cat", "a horse", "a bird"];
    let recs: Vec<_> = qs.iter().zip(alts).enumerate().map(|(i, (q, a))| record(q, a, if i % 2 == 0 { "val/a.png" } else { "val/b.png" })).collect();
    let data = write_data(dir.path(), &recs);
    let common = Common { seed: 3, image_roots: Some(r.clone()), ..Common::single(model, Device::Cpu) };
    let edit_params = vec!["model.layers.3.mlp.up_proj.weight".to_string(), "model.layers.3.mlp.down_proj.weight".to_string()];
    let config = MendConfig { rank: 8, lr: 1e-3, edit_lr: 1e-3, accumulate: 1, max_steps: 2, val_every: 2, val_records: 1, max_length: 200, edit_params, ..MendConfig::default() };
    for (list, chain_at) in [("cpu:1,cpu:2", vec![1]), ("cpu:1,cpu:2,cpu:3", vec![1, 2])] {
        let plan = DevicePlan::parse("cpu", Some(list)).unwrap().balanced_chain(chain_at, 3).unwrap();
        let out = dir.path().join(format!("train-{}", list.len()));
        let opts = TrainOptions { common: common.clone(), data: data.clone(), ds: DatasetKind::Vqa, config: config.clone(), out: out.clone(), limit: None, resume: false, init: None, progress: false };
        let c = compare_train(&opts, plan).unwrap();
        assert!(c.single.metrics.keys().any(|k| k.starts_with("image_loc_kl")), "{:?}", c.single.metrics.keys());
        for (k, a) in &c.single.metrics {
            let b = c.dual.metrics[k];
            assert!((a - b).abs() <= 1e-5 * (1.0 + a.abs()) + 1e-6, "{list}: {k}: single {a} vs chain {b}");
        }
        let report: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&c.dual.report).unwrap()).unwrap();
        let cs = report["moved"]["crossings"].as_array().unwrap();
        assert_eq!(cs.len(), plan.chain.len() + 1, "{list}: {cs:?}");
        for x in cs {
            assert!(x["boundary_crossings"].as_u64().unwrap() > 0 && x["boundary_bytes"] == cs[0]["boundary_bytes"], "{list}: {cs:?}");
        }
        let eval = EvalOptions {
            common: common.clone(),
            method: MethodSpec::Mend { editor: out.join("single") },
            data: data.clone(),
            ds: DatasetKind::Vqa,
            limit: Some(2),
            max_length: 200,
            capacity: None,
        };
        let c = compare_eval(&eval, plan, dir.path()).unwrap();
        assert!(c.single.metrics.contains_key("image_locality"));
        assert!(c.metrics_agree, "{list} eval: max relative difference {}", c.max_relative_difference);
    }
}

/// Issue #48: an E-VQA target that spells a special token (`<|image_pad|>`, `<|im_end|>`)
/// would be edited in as that token, not as text: the record is refused, naming the data
/// file, the record and the token.
#[test]
fn a_target_that_is_a_special_token_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let r = roots(dir.path());
    let engine = engine(DevicePlan::single(Device::Cpu));
    for target in ["<|image_pad|>", "a cat<|im_end|>"] {
        let data = write_data(dir.path(), &[record("What is in the picture?", target, "val/a.png")]);
        let err = load_examples(&engine, &data, DatasetKind::Vqa, None, 200, Default::default(), Some(&r)).unwrap_err().to_string();
        let token = if target.contains("image_pad") { "<|image_pad|>" } else { "<|im_end|>" };
        assert!(err.contains("vqa.json") && err.contains("record 0") && err.contains("special token") && err.contains(token), "{target}: {err}");
    }
}
