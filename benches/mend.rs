//! MEND on a GPT-2-small-shaped model (124 M parameters, random weights) on CPU, with the
//! default MEND config (rank 1920, combine, shared, last 3 MLPs), 17-token examples:
//! one edit as `edit`/`eval` make it (gradient capture + editor, the change kept as
//! low-rank factors: `Engine::edit_low_rank`) and one meta-training step
//! (micro-batch forward/backward + amortised Adam step over `accumulate` micro-batches).
//! After the timings it prints the peak resident set of the process.
//!
//! `./x bench --bench mend`; results in BENCHMARKS.md.
#[path = "common/step.rs"]
mod step;
use std::time::Duration;

use criterion::{black_box, Criterion};
use dualedit::config::MendConfig;
use dualedit::data::{EditExample, Example, TokenBatch};
use dualedit::device::memory;
use dualedit::device::DevicePlan;
use dualedit::mend::{Editor, Engine};
use dualedit::model::gpt2::{Gpt2, Gpt2Config};
use dualedit::model::{load_model, random_params, Model};
use dualedit::mend::train::{meta_loss, EditBatches};
use tch::{Device, Kind, Tensor};

const TOKENS: usize = 17;
const ANSWER: usize = 3;

/// A GPT-2-small-shaped HF directory with random weights (and the fixture's tokenizer,
/// which the benchmark never uses for text: token ids are random).
fn model_dir() -> tempfile::TempDir {
    let dir = tempfile::tempdir().expect("tempdir");
    let config = serde_json::json!({
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": 50257, "n_embd": 768,
        "n_layer": 12, "n_head": 12, "n_positions": 1024, "activation_function": "gelu_new"
    });
    std::fs::write(dir.path().join("config.json"), config.to_string()).expect("config");
    let model = Model::new(Gpt2::new(serde_json::from_value::<Gpt2Config>(config).expect("cfg")).expect("model"));
    let store = random_params(&model, Device::Cpu, Kind::Float, 0);
    let tensors: Vec<(String, Tensor)> = store.iter().map(|(n, t)| (n.clone(), t.shallow_clone())).collect();
    dualedit::io::write_safetensors(&dir.path().join("model.safetensors"), &tensors, Default::default()).expect("weights");
    let tok = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/gpt2/tokenizer.json");
    std::fs::copy(tok, dir.path().join("tokenizer.json")).expect("tokenizer");
    dir
}

fn example(seed: i64) -> Example {
    tch::manual_seed(seed);
    let ids = Vec::<i64>::try_from(Tensor::randint(50257, [TOKENS as i64], (Kind::Int64, Device::Cpu))).expect("ids");
    Example { ids, answer_start: TOKENS - ANSWER, image: None }
}

fn main() {
    memory::tune_host_allocator();
    let dir = model_dir();
    let lm = load_model(dir.path(), Device::Cpu, Kind::Float).expect("load");
    let engine = Engine::new(lm, DevicePlan::single(Device::Cpu), &[]).expect("engine");
    let cfg = MendConfig::default();
    let mut editor = Editor::new(&cfg, engine.edit_params.clone(), Device::Cpu, 0).expect("editor");
    let ex = EditExample { inner: example(1), outer: example(2), rephrased: true, loc: Some(example(3)), portability: vec![], outer_image: None, loc_image: None };
    let pad = 0;
    let mut c = Criterion::default()
        .sample_size(10)
        .warm_up_time(Duration::from_secs(3))
        .measurement_time(Duration::from_secs(15))
        .configure_from_args();

    // Give the editor non-trivial statistics first, as after training.
    let b = EditBatches::new(&[&ex], pad, Device::Cpu);
    let (loss, _) = meta_loss(&engine, &mut editor, &b, true).expect("warm-up");
    loss.backward();

    let inner = TokenBatch::collate(&[&ex.inner], pad, Device::Cpu);
    // The two halves of an edit, to see where its time goes.
    c.bench_function("mend_gpt2_small/capture_17tok", |bench| {
        bench.iter(|| {
            let _g = tch::no_grad_guard();
            black_box(engine.capture(&inner).expect("capture"))
        })
    });
    let (_, factors) = engine.capture(&inner).expect("capture");
    c.bench_function("mend_gpt2_small/editor_17tok", |bench| {
        bench.iter(|| {
            let _g = tch::no_grad_guard();
            black_box(engine.edit_low_rank(&mut editor, &factors, false).expect("edit"))
        })
    });
    c.bench_function("mend_gpt2_small/edit_17tok", |bench| {
        bench.iter(|| {
            let _g = tch::no_grad_guard();
            let (_, factors) = engine.capture(&inner).expect("capture");
            black_box(engine.edit_low_rank(&mut editor, &factors, false).expect("edit"))
        })
    });

    step::bench_step(&mut c, "mend_gpt2_small", &engine, &mut editor, &b, &cfg);
}
