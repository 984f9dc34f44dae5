//! Forward (and forward+backward) cost of a GPT-2-small-shaped model on CPU.
//!
//! Random f32 weights (`random_params`), batch 1, 64 random token ids. Run with
//! `./x bench --bench forward`; results are recorded in BENCHMARKS.md.
use std::collections::HashSet;
use std::time::Duration;

use criterion::{black_box, criterion_group, criterion_main, Criterion};
use dualedit::model::gpt2::{Gpt2, Gpt2Config};
use dualedit::model::{random_params, ForwardInput, Model, Overrides, ParamView};
use tch::{Device, Kind, Reduction, Tensor};

const SEQ: i64 = 64;
const KEEP_LAST: i64 = 16;

fn gpt2_small() -> Model {
    let config: Gpt2Config = serde_json::from_value(serde_json::json!({
        "vocab_size": 50257,
        "n_embd": 768,
        "n_layer": 12,
        "n_head": 12,
        "n_positions": 1024,
    }))
    .expect("GPT-2 config");
    Model::new(Gpt2::new(config).expect("GPT-2 model"))
}

fn bench_forward(c: &mut Criterion) {
    let device = Device::Cpu;
    let model = gpt2_small();
    let vocab = model.info().vocab_size;
    let store = random_params(&model, device, Kind::Float, 0);
    let ids = Tensor::randint(vocab, [1, SEQ], (Kind::Int64, device));
    let no_capture = HashSet::new();

    let mut group = c.benchmark_group("gpt2_small");
    group.sample_size(10).warm_up_time(Duration::from_secs(2)).measurement_time(Duration::from_secs(10));

    // 1. Inference forward, logits for every position.
    group.bench_function("forward_seq64", |b| {
        let view = ParamView::frozen(&store);
        b.iter(|| {
            let _g = tch::no_grad_guard();
            let out = model.forward(&view, &ForwardInput::new(&ids, &no_capture)).expect("forward");
            black_box(out.logits)
        })
    });

    // 2. Forward with grad for MEND's default edit weights, next-token loss, backward.
    let edit = model.default_edit_params();
    assert_eq!(edit.len(), 6, "MLP weights of the last 3 blocks");
    let targets = ids.narrow(1, 1, SEQ - 1).reshape([-1]);
    group.bench_function("forward_backward_seq64", |b| {
        b.iter(|| {
            let overrides: Overrides = edit
                .iter()
                .map(|n| (n.clone(), store.get(n).expect("edit weight").detach().set_requires_grad(true)))
                .collect();
            let view = ParamView::new(&store, Some(&overrides));
            let out = model.forward(&view, &ForwardInput::new(&ids, &no_capture)).expect("forward");
            // Position t predicts token t+1 (Hugging Face's shift).
            let logits = out.logits.narrow(1, 0, SEQ - 1).reshape([-1, vocab]);
            let loss = logits.cross_entropy_loss::<Tensor>(&targets, None, Reduction::Mean, -100, 0.0);
            let weights: Vec<&Tensor> = edit.iter().map(|n| &overrides.dense()[n]).collect();
            let grads = Tensor::run_backward(&[&loss], &weights, false, false);
            black_box(grads)
        })
    });

    // 3. Inference forward with logits only at the last 16 positions.
    let keep = Tensor::arange(SEQ, (Kind::Int64, device)).ge(SEQ - KEEP_LAST).unsqueeze(0);
    group.bench_function("forward_keep_last16", |b| {
        let view = ParamView::frozen(&store);
        b.iter(|| {
            let _g = tch::no_grad_guard();
            let mut input = ForwardInput::new(&ids, &no_capture);
            input.keep = Some(&keep);
            let out = model.forward(&view, &input).expect("forward");
            debug_assert_eq!(out.logits.size(), vec![KEEP_LAST, vocab]);
            black_box(out.logits)
        })
    });

    group.finish();
}

criterion_group!(benches, bench_forward);
criterion_main!(benches);
