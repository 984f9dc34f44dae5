//! The layer split on CPU (#23): one meta-training micro-step (`meta_loss` + backward) of
//! MEND's default editor (rank 1920, the MLPs of blocks 9–11) on a GPT-2-small-shaped
//! model (124 M parameters, random weights), single device against the split paths on
//! one CPU through the mover (`DevicePlan::split_on`):
//!
//! - `single`: everything on the CPU, no mover.
//! - `replica`: the sub-device replica path (the unedited locality on the worker thread).
//! - `balanced k, per batch`: the layer split with the frozen prefix once per batch, the
//!   scored views cut from the edited batch's boundary (`EditBatches::for_config`).
//! - `balanced k, per view`: the same without cutting the views from the edited batch
//!   (`EditBatches::new`): each of the three batches runs its own prefix, which is as
//!   many prefixes per micro-step as before the boundary cache (one per forward).
//!
//! Prints the median seconds per micro-step, the boundary crossings per micro-step and
//! the timeline's busy / overlap summary. A plain timing loop (not criterion), the
//! placements interleaved micro-step by micro-step: a few each keep it to a minute or two
//! on a small machine.
//!
//! `./x bench --bench split` (env: `SPLIT_TOKENS` tokens per example, default 17;
//! `SPLIT_STEPS` micro-steps timed, default 5; `SPLIT_K` boundary, default 7).
use std::time::Instant;

use dualedit::config::MendConfig;
use dualedit::data::{EditExample, Example};
use dualedit::device::DevicePlan;
use dualedit::mend::{Editor, Engine};
use dualedit::model::gpt2::{Gpt2, Gpt2Config};
use dualedit::model::{load_model, random_params, Model};
use dualedit::mend::train::{meta_loss, EditBatches};
use tch::{Device, Kind, Tensor};

fn env(name: &str, default: usize) -> usize {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

/// A GPT-2-small-shaped HF directory with random weights (as `benches/mend.rs`).
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

fn example(seed: i64, tokens: usize) -> Example {
    tch::manual_seed(seed);
    let ids = Vec::<i64>::try_from(Tensor::randint(50257, [tokens as i64], (Kind::Int64, Device::Cpu))).expect("ids");
    Example { ids, answer_start: tokens - 3, image: None }
}

/// One placement under test, its engine and editor, and its timings so far.
struct Run {
    name: String,
    plan: DevicePlan,
    /// Whether the scored views' boundaries are cut from the edited batch's.
    share: bool,
    engine: Engine,
    editor: Editor,
    times: Vec<f64>,
    crossings: u64,
}

fn main() {
    let (tokens, steps, k) = (env("SPLIT_TOKENS", 17), env("SPLIT_STEPS", 5), env("SPLIT_K", 7));
    let dir = model_dir();
    let cfg = MendConfig::default();
    let ex = EditExample {
        inner: example(1, tokens),
        outer: example(2, tokens),
        rephrased: true,
        loc: Some(example(3, tokens)),
        portability: vec![],
        outer_image: None,
        loc_image: None,
    };
    let split = DevicePlan::split_on(Device::Cpu, Device::Cpu);
    let runs: Vec<(String, DevicePlan, bool)> = vec![
        ("single".into(), DevicePlan::single(Device::Cpu), true),
        ("replica (cpu + cpu)".into(), split, true),
        (format!("balanced k={k}, prefix per batch"), split.balanced(k).expect("plan"), true),
        (format!("balanced k={k}, prefix per view (as before)"), split.balanced(k).expect("plan"), false),
    ];
    println!("GPT-2-small-shaped, MEND default (rank 1920, MLPs 9-11), {tokens}-token examples, {steps} micro-steps each after 1 warm-up, placements interleaved");
    // Interleaved, one micro-step of each placement in turn: on a shared machine the load
    // then falls on all of them alike.
    let mut set: Vec<Run> = runs
        .into_iter()
        .map(|(name, plan, share)| {
            let lm = load_model(dir.path(), Device::Cpu, Kind::Float).expect("load");
            let engine = Engine::new(lm, plan, &cfg.edit_params).expect("engine");
            let editor = Editor::new(&cfg, engine.edit_params.clone(), Device::Cpu, 0).expect("editor");
            Run { name, plan, share, engine, editor, times: Vec::new(), crossings: 0 }
        })
        .collect();
    for i in 0..=steps {
        for Run { plan, share, engine, editor, times, crossings, .. } in set.iter_mut() {
            let before = engine.mover.stats().boundary_crossings;
            engine.timeline.set_on(i > 0);
            engine.timeline.at(i, 0);
            let t = Instant::now();
            let b = if *share { EditBatches::for_config(engine, &[&ex], &cfg).expect("batches") } else { EditBatches::new(&[&ex], 0, Device::Cpu) };
            let (loss, _) = meta_loss(engine, editor, &b, true).expect("meta_loss");
            engine.timeline.span(if plan.split { "sub" } else { "main" }, "backward", || loss.backward());
            if i > 0 {
                times.push(t.elapsed().as_secs_f64());
                *crossings = engine.mover.stats().boundary_crossings - before;
            }
        }
    }
    for Run { name, engine, mut times, crossings, .. } in set {
        times.sort_by(f64::total_cmp);
        let median = times[times.len() / 2];
        let s = engine.timeline.summary();
        // Per micro-step (the timeline's wall would span the interleaved placements).
        let busy: Vec<String> = s.busy_s.iter().map(|(d, b)| format!("{d} busy {:.3}", b / steps as f64)).collect();
        println!(
            "{name:<44} median {median:.3} s/micro-step (min {:.3}, max {:.3}); boundary crossings/micro-step {crossings}; {}, overlap {:.3}",
            times[0],
            times[times.len() - 1],
            busy.join(", "),
            s.overlap_s / steps as f64
        );
        let phases: Vec<String> = s.phase_s.iter().map(|(p, t)| format!("{p} {:.3}", t / steps as f64)).collect();
        println!("    per micro-step: {}", phases.join(", "));
    }
}
