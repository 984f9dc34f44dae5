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
//! `./x bench --bench mend_vl`; results in BENCHMARKS.md ("Multimodal MEND").
use std::path::Path;
use std::time::Instant;

use dualedit::config::MendConfig;
use dualedit::data::{EditExample, Example, ImageRef};
use dualedit::device::DevicePlan;
use dualedit::mend::optim::Adam;
use dualedit::mend::{Editor, Engine};
use dualedit::model::qwen2_vl::Qwen2Vl;
use dualedit::model::{load_model, random_params, Model};
use dualedit::train::{meta_loss, EditBatches};
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

fn main() {
    tch::set_num_threads(1);
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
    timed("train_microbatch", || {
        let b = EditBatches::for_config(&engine, &[&ex], &cfg).expect("batches");
        let (loss, _) = meta_loss(&engine, &mut editor, &b, true).expect("meta loss");
        (loss / cfg.accumulate as f64).backward();
    });
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
