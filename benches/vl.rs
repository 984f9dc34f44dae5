//! Vision-language forward on CPU: image preprocessing, the vision tower, and the text
//! forward with the image tokens, for a small Qwen2-VL and Qwen2.5-VL
//! (benches/vl_configs/*.json: text 4 × 512, vision 4 × 256) and the 400 × 300 test image
//! resized to 392 × 308 (616 patches, 154 image tokens) followed by 32 text tokens.
//!
//! scripts/bench_vl_transformers.py times transformers on the same configs, image and
//! tokens. Both run on one thread. Run with `./x bench --bench vl`; results are recorded
//! in BENCHMARKS.md.
use std::collections::HashSet;
use std::path::Path;
use std::time::Duration;

use criterion::{black_box, criterion_group, criterion_main, Criterion};
use dualedit::model::qwen2_vl::Qwen2Vl;
use dualedit::model::vision::{image, ImageProcessorConfig};
use dualedit::model::{random_params, ForwardInput, Model, ParamView};
use tch::{Device, Kind, Tensor};

const TEXT_TOKENS: i64 = 32;

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

fn processor() -> ImageProcessorConfig {
    ImageProcessorConfig { max_pixels: 28 * 28 * 256, ..ImageProcessorConfig::default() }
}

fn bench_family(c: &mut Criterion, file: &str) {
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(root().join("benches/vl_configs").join(file)).expect("bench config")).expect("JSON");
    let arch = json["architectures"][0].as_str().expect("architecture");
    let model = Model::new(Qwen2Vl::from_json(&json, arch).expect("VL config"));
    let vl = model.family().vision_language().expect("VL model");
    let store = random_params(&model, Device::Cpu, Kind::Float, 0);
    let params = ParamView::frozen(&store);
    let path = root().join("tests/fixtures/vl_images/big.png");
    let proc = processor();
    let img = image::prepare(&path, &proc).expect("image");
    assert_eq!(img.grid, [1, 22, 28]);
    let mut ids = vl.image_prompt(&img.grid);
    ids.extend((0..TEXT_TOKENS).map(|i| (i * 37 + 11) % 4000));
    let input_ids = Tensor::from_slice(&ids).unsqueeze(0);
    let pos = vl.mrope_positions(&ids, &[img.grid]).expect("positions").unsqueeze(1);
    let none = HashSet::new();

    let mut group = c.benchmark_group(file.trim_end_matches(".json"));
    group.sample_size(10).warm_up_time(Duration::from_secs(2)).measurement_time(Duration::from_secs(8));
    group.bench_function("preprocess_png_400x300", |b| b.iter(|| black_box(image::prepare(&path, &proc).expect("image"))));
    group.bench_function("vision_tower_616_patches", |b| {
        b.iter(|| black_box(vl.image_features(&params, &img.pixel_values, &[img.grid]).expect("vision")))
    });
    let feats = vl.image_features(&params, &img.pixel_values, &[img.grid]).expect("vision");
    let forward = |feats: &Tensor| {
        let _g = tch::no_grad_guard();
        let input = ForwardInput { position_ids: Some(&pos), image_embeds: Some(feats), ..ForwardInput::new(&input_ids, &none) };
        model.forward(&params, &input).expect("forward").logits
    };
    group.bench_function("text_forward_188_tokens", |b| b.iter(|| black_box(forward(&feats))));
    group.bench_function("vision_and_text_forward", |b| {
        b.iter(|| {
            let feats = vl.image_features(&params, &img.pixel_values, &[img.grid]).expect("vision");
            black_box(forward(&feats))
        })
    });
    group.finish();
}

fn bench_vl(c: &mut Criterion) {
    // One thread on both sides: this CPU is shared, and one thread measures steadier.
    tch::set_num_threads(1);
    bench_family(c, "qwen2_vl.json");
    bench_family(c, "qwen2_5_vl.json");
}

criterion_group!(benches, bench_vl);
criterion_main!(benches);
