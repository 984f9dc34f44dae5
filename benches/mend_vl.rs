//! MEND on a small Qwen2-VL (benches/vl_configs/qwen2_vl.json: text 4 × 512, vocabulary
//! 4096; vision tower 4 × 256; random f32 weights) on CPU, one E-VQA example per step:
//! what dualedit's meta-training step and edit cost against the same computation in
//! PyTorch as EasyEdit's `MultimodalTrainer` + MEND does it
//! (scripts/bench_mend_vl_easyedit.py, which builds the same sizes and token layout).
//!
//! Sizes (both sides): three distinct 224 × 224 images (256 patches, 64 image tokens
//! each), image views `<|vision_start|>` + 64 pads + `<|vision_end|>` + 13 question
//! tokens + 3 answer tokens (82), the text-only `loc` view 13 + 3 tokens; MEND's default
//! editor (rank 1920, combine, shared, one hidden layer) on the up/down projections of
//! the last 3 blocks (two shared editors of width 1920, 3 modes each), batch 1.
//!
//! Timed (median of 10 runs after 3 warm-up runs, one libtorch thread):
//! - `train_microbatch`: `EditBatches::for_config` (reading and preprocessing the three
//!   images, the vision tower once per distinct image) + `meta_loss` + backward;
//! - `adam_step`: clipping + Adam over the editor;
//! - `edit`: the edit image's features, capture, the editor (`Engine::edit_low_rank`).
//!
//! - first, the micro-step before #35 (every forward from the embedding, the four scored
//!   views in one padded forward) and after, alternating: medians of 5 rounds after one
//!   warm-up each (`--ab`: that alone).
//!
//! Then the arithmetic of a step (linear layers of the text blocks and the head, forward
//! and the input-gradient backward, from the batches' shapes: before and after #35), the
//! achieved GFLOP/s of a step, and a one-thread `Tensor::mm` peak of this machine beside it.
//!
//! `./x bench --bench mend_vl`; results in BENCHMARKS.md ("Multimodal MEND", "#35").
use std::path::Path;
use std::time::Instant;

use dualedit::config::MendConfig;
use dualedit::data::{EditExample, Example, ImageRef};
use dualedit::device::DevicePlan;
use dualedit::mend::optim::Adam;
use dualedit::mend::{Editor, Engine};
use dualedit::model::qwen2_vl::Qwen2Vl;
use dualedit::model::{load_model, random_params, Model};
use dualedit::data::TokenBatch;
use dualedit::train::{meta_loss, EditBatches, EditedGroup, View};
use tch::{Device, Kind, Tensor};

const IMAGE_SIDE: u32 = 224;
const IMAGE_TOKENS: usize = 64; // (224 / 14)² patches / 2² merged
const QUESTION: usize = 13;
const ANSWER: usize = 3;

/// The bench config as an HF directory with random weights, the fixture's tokenizer (never
/// used: token ids are built below) and preprocessor, and three distinct PNG images.
fn model_dir() -> tempfile::TempDir {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let dir = tempfile::tempdir().expect("tempdir");
    let text = std::fs::read_to_string(root.join("benches/vl_configs/qwen2_vl.json")).expect("bench config");
    let json: serde_json::Value = serde_json::from_str(&text).expect("JSON");
    std::fs::write(dir.path().join("config.json"), &text).expect("config");
    let model = Model::new(Qwen2Vl::from_json(&json, "Qwen2VLForConditionalGeneration").expect("VL config"));
    let store = random_params(&model, Device::Cpu, Kind::Float, 0);
    let tensors: Vec<(String, Tensor)> = store.iter().map(|(n, t)| (n.clone(), t.shallow_clone())).collect();
    dualedit::io::write_safetensors(&dir.path().join("model.safetensors"), &tensors, Default::default()).expect("weights");
    std::fs::copy(root.join("tests/fixtures/qwen2_vl/tokenizer.json"), dir.path().join("tokenizer.json")).expect("tokenizer");
    // Qwen2-VL's processor defaults (the fixture's caps images at 112 × 112 pixels).
    let mut proc: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(root.join("tests/fixtures/qwen2_vl/preprocessor_config.json")).expect("processor")).expect("JSON");
    proc["size"] = serde_json::json!({ "shortest_edge": 56 * 56, "longest_edge": 28 * 28 * 1280 });
    std::fs::write(dir.path().join("preprocessor_config.json"), proc.to_string()).expect("processor");
    for (name, seed) in [("edit.png", 3u8), ("rephrase.png", 11), ("loc.png", 29)] {
        let img = image::RgbImage::from_fn(IMAGE_SIDE, IMAGE_SIDE, |x, y| {
            image::Rgb([(x as u8).wrapping_mul(seed), (y as u8).wrapping_add(seed), ((x + y) as u8).wrapping_mul(7)])
        });
        img.save(dir.path().join(name)).expect("image");
    }
    dir
}

/// Token ids `(seed·131 + i·17) mod 4000 + 10` (scripts/bench_mend_vl_easyedit.py builds
/// the same), after the image run when `image` is given; the last 3 are the answer.
fn example(seed: usize, image: Option<&Path>, json: &serde_json::Value) -> Example {
    let tok = |k: &str| json[k].as_i64().expect("token id");
    let mut ids = Vec::new();
    if image.is_some() {
        ids.push(tok("vision_start_token_id"));
        ids.extend(std::iter::repeat_n(tok("image_token_id"), IMAGE_TOKENS));
        ids.push(tok("vision_end_token_id"));
    }
    ids.extend((0..QUESTION + ANSWER).map(|i| ((seed * 131 + i * 17) % 4000 + 10) as i64));
    let answer_start = ids.len() - ANSWER;
    let image = image.map(|p| ImageRef { path: p.to_path_buf(), grid: [1, IMAGE_SIDE as i64 / 14, IMAGE_SIDE as i64 / 14] });
    Example { ids, answer_start, image }
}

/// Median milliseconds of 10 runs after 3 warm-up runs.
fn timed(name: &str, mut f: impl FnMut()) -> f64 {
    for _ in 0..3 {
        f();
    }
    let mut ms: Vec<f64> = (0..10)
        .map(|_| {
            let t = Instant::now();
            f();
            t.elapsed().as_secs_f64() * 1e3
        })
        .collect();
    ms.sort_by(f64::total_cmp);
    let median = (ms[4] + ms[5]) / 2.0;
    println!("{name:<18} median {median:8.1} ms  (min {:.1}, max {:.1})", ms[0], ms[9]);
    median
}

/// One-thread GEMM peak: the best GFLOP/s of `[n, n]·[n, n]` products in f32.
fn gemm_peak() -> f64 {
    let n = 1024;
    let (a, b) = (Tensor::randn([n, n], (Kind::Float, Device::Cpu)), Tensor::randn([n, n], (Kind::Float, Device::Cpu)));
    let mut best = f64::MAX;
    for _ in 0..8 {
        let t = Instant::now();
        std::hint::black_box(a.mm(&b));
        best = best.min(t.elapsed().as_secs_f64());
    }
    2.0 * (n * n * n) as f64 / best / 1e9
}

/// Rows of a batch (`B·T`, padding included: what its forward computes).
fn rows(b: &TokenBatch) -> f64 {
    (b.batch_size() * b.input_ids.size()[1]) as f64
}

/// Linear-layer FLOPs of one micro-step's text side: `(prefix rows, rows above the
/// prefix, grad rows)` times the per-row cost of the blocks below / above the first
/// edited block, plus the head at the scored rows. `shared`: the #35 paths (prefix once
/// per batch, views grouped); otherwise every forward from the embedding over the four
/// views padded together. Grad rows (capture and edited backward, input gradients only:
/// the frozen weights get none) pass through the blocks above the prefix once more.
fn step_flops(b: &EditBatches, one: &TokenBatch, shared: bool, per_block: f64, blocks: (f64, f64), head: f64) -> f64 {
    let (below, above) = blocks;
    let (loc, loc_image) = (b.loc.as_ref().map_or(0.0, rows), b.loc_image.as_ref().map_or(0.0, rows));
    let inner = rows(&b.inner);
    let edited: f64 = if shared {
        b.edited.iter().map(|g| g.batch.as_ref().map_or_else(|| rows(b.view(g.views[0]).expect("view")), rows)).sum()
    } else {
        rows(one)
    };
    let (prefix_rows, upper_rows) = if shared { (inner + edited, inner + edited + loc + loc_image) } else { (inner + edited + loc + loc_image, inner + edited + loc + loc_image) };
    let kept = |t: &TokenBatch| t.keep.sum(Kind::Int64).int64_value(&[]) as f64;
    let scored = kept(&b.inner) + [Some(&b.outer), b.outer_image.as_ref(), b.loc.as_ref(), b.loc_image.as_ref()].into_iter().flatten().map(kept).sum::<f64>();
    per_block * (below * prefix_rows + above * upper_rows + above * (inner + edited)) + head * 2.0 * scored
}

fn main() {
    tch::set_num_threads(1);
    let ab_only = std::env::args().any(|a| a == "--ab");
    let dir = model_dir();
    let json: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(dir.path().join("config.json")).expect("config")).expect("JSON");
    let lm = load_model(dir.path(), Device::Cpu, Kind::Float).expect("load");
    let edit_params: Vec<String> = (1..4).flat_map(|l| ["up_proj", "down_proj"].map(|m| format!("model.layers.{l}.mlp.{m}.weight"))).collect();
    let engine = Engine::new(lm, DevicePlan::single(Device::Cpu), &edit_params).expect("engine");
    let cfg = MendConfig { edit_params, ..MendConfig::default() };
    let mut editor = Editor::new(&cfg, engine.edit_params.clone(), Device::Cpu, 0).expect("editor");
    let img = |n: &str| dir.path().join(n);
    let (edit, rephrase, loc) = (img("edit.png"), img("rephrase.png"), img("loc.png"));
    let ex = EditExample {
        inner: example(1, Some(&edit), &json),
        outer: example(2, Some(&edit), &json),
        rephrased: true,
        loc: Some(example(3, None, &json)),
        portability: vec![],
        outer_image: Some(example(1, Some(&rephrase), &json)),
        loc_image: Some(example(4, Some(&loc), &json)),
    };
    println!(
        "torch threads {}, editor parameters {}, edited {:?}",
        tch::get_num_threads(),
        editor.n_parameters(),
        engine.edit_names()
    );

    let (net, lrs) = editor.trainables();
    let mut adam = Adam::new(vec![(cfg.lr, net), (cfg.lr_lr, lrs)]);
    let views = [View::Outer, View::OuterImage, View::Loc, View::LocImage];
    let all = [&ex.outer, ex.outer_image.as_ref().expect("view"), ex.loc.as_ref().expect("view"), ex.loc_image.as_ref().expect("view")];
    // The step as before #35: every forward from the embedding, one padded edited forward.
    let mut step = |engine: &mut Engine, editor: &mut Editor, before: bool| {
        engine.share_prefix = !before;
        let mut b = EditBatches::for_config(engine, &[&ex], &cfg).expect("batches");
        if before {
            let batch = engine.collate(&all).expect("batch");
            b.edited = vec![EditedGroup { views: views.to_vec(), batch: Some(batch) }];
        }
        let (loss, _) = meta_loss(engine, editor, &b, true).expect("meta loss");
        (loss / cfg.accumulate as f64).backward();
    };
    let mut engine = engine;
    let (mut before_ms, mut after_ms) = (Vec::new(), Vec::new());
    let mut once = |before: bool, engine: &mut Engine, editor: &mut Editor| {
        let t = Instant::now();
        step(engine, editor, before);
        t.elapsed().as_secs_f64() * 1e3
    };
    // One warm-up of each, then 5 alternating rounds.
    once(true, &mut engine, &mut editor);
    once(false, &mut engine, &mut editor);
    for _ in 0..5 {
        before_ms.push(once(true, &mut engine, &mut editor));
        after_ms.push(once(false, &mut engine, &mut editor));
    }
    let median = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let (before, after) = (median(&mut before_ms), median(&mut after_ms));
    println!("A/B over 5 alternating rounds: before #35 {before:.1} ms, after {after:.1} ms ({:.2}×)", after / before);

    // The arithmetic of the step, from the shapes.
    let b = EditBatches::for_config(&engine, &[&ex], &cfg).expect("batches");
    let one = engine.collate(&all).expect("batch");
    let params = |prefix: &str| -> f64 {
        engine.lm.params.iter().filter(|(n, t)| n.starts_with(prefix) && t.dim() == 2).map(|(_, t)| t.numel() as f64).sum()
    };
    let per_block = 2.0 * params("model.layers.0.");
    let first = engine.edit_params.iter().filter_map(|p| engine.lm.model.block_of(&p.name)).min().unwrap_or(0) as f64;
    let n_blocks = engine.lm.model.n_blocks() as f64;
    let head = 2.0 * (json["vocab_size"].as_f64().expect("vocab") * json["hidden_size"].as_f64().expect("hidden"));
    let f_before = step_flops(&b, &one, false, per_block, (first, n_blocks - first), head);
    let f_after = step_flops(&b, &one, true, per_block, (first, n_blocks - first), head);
    let peak = gemm_peak();
    println!(
        "text linear FLOPs of a micro-step: before #35 {:.2} GFLOP, after {:.2} GFLOP ({:.0} % avoided); {:.1} / {:.1} GFLOP/s achieved on them; one-thread mm peak {peak:.1} GFLOP/s",
        f_before / 1e9,
        f_after / 1e9,
        100.0 * (1.0 - f_after / f_before),
        f_before / before * 1e3 / 1e9,
        f_after / after * 1e3 / 1e9
    );
    if ab_only {
        return;
    }
    timed("adam_step", || {
        adam.clip(cfg.grad_clip);
        adam.step();
    });
    adam.zero_grad();
    timed("edit", || {
        let _g = tch::no_grad_guard();
        let inner = engine.collate(&[&ex.inner]).expect("inner batch");
        let (_, factors) = engine.capture(&inner).expect("capture");
        std::hint::black_box(engine.edit_low_rank(&mut editor, &factors, false).expect("edit"));
    });
    println!("a meta-training step = train_microbatch + adam_step / accumulate ({})", cfg.accumulate);
}
