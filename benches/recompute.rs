//! Recomputation (`recompute: true`, `dualedit train --recompute`) against the ordinary
//! edited forwards: peak memory and time of one meta-training micro-step (capture, editor,
//! edited forwards of edit_outer and locality, backward into the editor) on a
//! GPT-2-small-shaped model (124 M parameters, random weights, built in memory) on CPU,
//! MEND's default editor (rank 1920, combine, shared), batch 4 × 256 tokens, 16 scored
//! positions per example.
//!
//! Two edit sets: MEND's default (the MLPs of the last 3 blocks) and a deep one (the MLPs
//! of blocks 4, 6, 8, 10, 11), where the edited forwards keep the activations of 8 blocks.
//!
//! Memory: each (edit set, recompute) case runs in a fresh child process (this binary,
//! re-run with `DUALEDIT_RECOMPUTE_CASE` set) with `MALLOC_MMAP_THRESHOLD_=131072`, as the
//! planner test does (glibc's dynamic threshold otherwise keeps freed tensor memory
//! resident and the RSS stops following the live bytes). The child builds everything, runs
//! one full micro-step plus Adam step (so the editor's gradients exist), then measures two
//! more micro-steps: the peak RSS (`VmHWM`, reset through `/proc/self/clear_refs`) minus
//! the RSS just before the step, i.e. the memory one micro-step needs on top of what the
//! run holds anyway (weights, editor, its gradients and Adam moments).
//!
//! Time: in this process (default malloc), one micro-step (`meta_loss` + backward) of each
//! variant per round, interleaved and in alternating order, so that other load on the
//! machine hits both alike; reported as medians and the per-round ratio. (Not criterion: a
//! step takes 15–60 s here, and criterion's back-to-back samples of one variant, then the
//! other, would turn any change in background load into a difference between them.)
//!
//! `./x bench --bench recompute`; results in BENCHMARKS.md. Environment:
//! `DUALEDIT_RECOMPUTE_NO_TIME=1` / `DUALEDIT_RECOMPUTE_NO_MEMORY=1` skip a part,
//! `DUALEDIT_RECOMPUTE_EDITS=last3|deep` runs one edit set, `DUALEDIT_RECOMPUTE_ROUNDS=N`
//! sets the timing rounds (default 5), `DUALEDIT_RECOMPUTE_THREADS=N` libtorch's intra-op
//! threads (default 1: on a shared 2-core machine a second thread mostly waits).
use std::collections::BTreeMap;
use std::process::Command;
use std::time::Instant;

use std::hint::black_box;
use dualedit::config::MendConfig;
use dualedit::data::{EditExample, Example};
use dualedit::device::memory::{format_bytes, reset_peak, sample};
use dualedit::device::DevicePlan;
use dualedit::mend::optim::Adam;
use dualedit::mend::{Editor, Engine};
use dualedit::model::gpt2::{Gpt2, Gpt2Config};
use dualedit::model::{random_params, LoadedModel, Model, Tokenizer};
use dualedit::planner::{plan_model, Group, Phase, PlanOptions};
use dualedit::mend::train::{meta_loss, EditBatches};
use tch::{Device, Kind, Tensor};

const CASE_ENV: &str = "DUALEDIT_RECOMPUTE_CASE";
const RESULT_TAG: &str = "RECOMPUTE_RESULT ";
const BATCH: usize = 4;
const TOKENS: usize = 256;
const KEPT: usize = 16;
const MIB: f64 = 1024.0 * 1024.0;

/// Edit sets: name and edited blocks (MLP c_fc and c_proj of each).
const EDITS: &[(&str, &[i64])] = &[("last3", &[9, 10, 11]), ("deep", &[4, 6, 8, 10, 11])];

fn config(layers: &[i64], recompute: bool) -> MendConfig {
    let edit_params = layers.iter().flat_map(|l| ["c_fc", "c_proj"].map(|m| format!("transformer.h.{l}.mlp.{m}.weight"))).collect();
    MendConfig { batch_size: BATCH, accumulate: 1, edit_params, recompute, ..MendConfig::default() }
}

fn gpt2_small() -> Model {
    let config: Gpt2Config = serde_json::from_value(serde_json::json!({
        "vocab_size": 50257, "n_embd": 768, "n_layer": 12, "n_head": 12, "n_positions": 1024,
    }))
    .expect("config");
    Model::new(Gpt2::new(config).expect("model"))
}

fn engine(edit_params: &[String]) -> Engine {
    let tokenizer = Tokenizer::from_file(&std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/gpt2/tokenizer.json")).expect("tokenizer");
    let model = gpt2_small();
    let params = random_params(&model, Device::Cpu, Kind::Float, 0);
    let lm = LoadedModel { dir: "random-gpt2-small".into(), model, params, tokenizer, config_json: serde_json::json!({}) };
    Engine::new(lm, DevicePlan::single(Device::Cpu), edit_params).expect("engine")
}

fn batches(engine: &Engine) -> EditBatches {
    tch::manual_seed(1);
    let example = || {
        let ids = Tensor::randint(50257, [TOKENS as i64], (Kind::Int64, Device::Cpu));
        Example { ids: Vec::<i64>::try_from(&ids).expect("ids"), answer_start: TOKENS - KEPT, image: None }
    };
    let examples: Vec<EditExample> =
        (0..BATCH).map(|_| EditExample { inner: example(), outer: example(), rephrased: true, loc: Some(example()), portability: vec![], outer_image: None, loc_image: None }).collect();
    let refs: Vec<&EditExample> = examples.iter().collect();
    EditBatches::new(&refs, engine.lm.tokenizer.pad_id(), Device::Cpu)
}

fn rss() -> (u64, u64) {
    let s = sample(Device::Cpu).expect("rss");
    (s.current_allocated_bytes, s.peak_allocated_bytes)
}

/// One case in this (fresh) process: memory figures in bytes, seconds per micro-step.
fn measure(layers: &[i64], recompute: bool) -> BTreeMap<String, f64> {
    // libtorch initialisation and thread pools first.
    {
        let x = Tensor::randn([64, 256], (Kind::Float, Device::Cpu)).set_requires_grad(true);
        x.matmul(&x.tr()).gelu("tanh").log_softmax(-1, Kind::Float).sum(Kind::Float).backward();
    }
    let (start, _) = rss();
    let cfg = config(layers, recompute);
    let engine = engine(&cfg.edit_params);
    let mut editor = Editor::new(&cfg, engine.edit_params.clone(), Device::Cpu, 0).expect("editor");
    let b = batches(&engine);
    let (net, lrs) = editor.trainables();
    let mut adam = Adam::new(vec![(cfg.lr, net), (cfg.lr_lr, lrs)]);
    let mut out = BTreeMap::new();
    let (mut step_peak, mut fwd_peak, mut seconds) = (0u64, 0u64, Vec::new());
    for i in 0..3 {
        let (before, _) = rss();
        reset_peak(Device::Cpu).expect("reset");
        let t = Instant::now();
        let (loss, parts) = meta_loss(&engine, &mut editor, &b, true).expect("meta loss");
        let (_, p_fwd) = rss();
        loss.backward();
        drop(loss);
        let dt = t.elapsed().as_secs_f64();
        let (_, p_step) = rss();
        adam.step();
        adam.zero_grad();
        if i == 0 {
            out.insert("loss".into(), parts.loss);
            out.insert("resident".into(), before.saturating_sub(start) as f64);
        } else {
            // From the second step on: the editor's gradients and Adam moments exist.
            out.insert("resident".into(), before.saturating_sub(start) as f64);
            fwd_peak = fwd_peak.max(p_fwd.saturating_sub(before));
            step_peak = step_peak.max(p_step.saturating_sub(before));
            seconds.push(dt);
        }
    }
    out.insert("micro_step_peak".into(), step_peak as f64);
    out.insert("forward_phase_peak".into(), fwd_peak as f64);
    out.insert("seconds".into(), seconds.iter().sum::<f64>() / seconds.len() as f64);
    out
}

fn run_child(name: &str, recompute: bool) -> BTreeMap<String, f64> {
    let out = Command::new(std::env::current_exe().expect("exe"))
        .env(CASE_ENV, format!("{name}:{recompute}"))
        .env("MALLOC_MMAP_THRESHOLD_", "131072")
        .output()
        .expect("child");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "case {name} failed:\n{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    let line = stdout.lines().find_map(|l| l.strip_prefix(RESULT_TAG)).unwrap_or_else(|| panic!("no result from {name}:\n{stdout}"));
    serde_json::from_str(line).expect("result")
}

/// The planner's transient bytes of a micro-step on one CPU (largest group but resident).
fn planned(layers: &[i64], recompute: bool) -> f64 {
    let opts = PlanOptions::new("cpu", None, Kind::Float, TOKENS as i64, Some(KEPT as i64)).expect("opts");
    let plan = plan_model(&gpt2_small(), &config(layers, recompute), &opts).expect("plan");
    [Group::Capture, Group::EditedForward, Group::Backward, Group::OptimizerStep]
        .iter()
        .map(|g| plan.group_bytes("cpu", Phase::Train, *g) as f64)
        .fold(0.0, f64::max)
}

/// CPU time of this process (all threads), seconds.
fn cpu_seconds() -> f64 {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    let fields: Vec<&str> = stat.rsplit_once(')').map(|(_, r)| r.split_whitespace().collect()).unwrap_or_default();
    let ticks = |i: usize| fields.get(i).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0);
    (ticks(11) + ticks(12)) / 100.0 // utime + stime, in clock ticks of 1/100 s
}

fn main() {
    let threads: i32 = std::env::var("DUALEDIT_RECOMPUTE_THREADS").ok().and_then(|v| v.parse().ok()).unwrap_or(1);
    tch::set_num_threads(threads);
    if let Ok(case) = std::env::var(CASE_ENV) {
        let (name, recompute) = case.split_once(':').expect("case");
        let layers = EDITS.iter().find(|(n, _)| *n == name).expect("known case").1;
        let figures = measure(layers, recompute == "true");
        println!("{RESULT_TAG}{}", serde_json::to_string(&figures).expect("json"));
        return;
    }
    println!(
        "GPT-2-small shape, random weights, CPU ({} intra-op thread(s); DUALEDIT_RECOMPUTE_THREADS), rank 1920, batch {BATCH} x {TOKENS} tokens, {KEPT} scored per example",
        tch::get_num_threads()
    );
    println!("peak RSS increase of one micro-step over the RSS before it (fresh child process per case, MALLOC_MMAP_THRESHOLD_=131072)");
    println!("{:<6} {:<9} {:>13} {:>13} {:>13} {:>10}", "edits", "recompute", "micro-step", "meta_loss", "planned", "resident");
    let mut results = BTreeMap::new();
    let only = std::env::var("DUALEDIT_RECOMPUTE_EDITS").ok();
    let edits: Vec<&(&str, &[i64])> = EDITS.iter().filter(|(n, _)| only.as_deref().is_none_or(|o| o == *n)).collect();
    let memory = std::env::var_os("DUALEDIT_RECOMPUTE_NO_MEMORY").is_none();
    for (name, layers) in edits.iter().copied().filter(|_| memory) {
        for recompute in [false, true] {
            let m = run_child(name, recompute);
            println!(
                "{:<6} {:<9} {:>9.1} MiB {:>9.1} MiB {:>9.1} MiB {:>6.0} MiB",
                name,
                recompute,
                m["micro_step_peak"] / MIB,
                m["forward_phase_peak"] / MIB,
                planned(layers, recompute) / MIB,
                m["resident"] / MIB
            );
            results.insert((name.to_string(), recompute), m);
        }
        let (a, b) = (&results[&(name.to_string(), false)], &results[&(name.to_string(), true)]);
        assert!((a["loss"] - b["loss"]).abs() <= 1e-5 * a["loss"].abs(), "losses differ: {} vs {}", a["loss"], b["loss"]);
        println!(
            "{name}: recompute saves {} of the micro-step's peak ({:.0} %); same first loss {:.6}",
            format_bytes((a["micro_step_peak"] - b["micro_step_peak"]).max(0.0) as u64),
            100.0 * (1.0 - b["micro_step_peak"] / a["micro_step_peak"]),
            a["loss"]
        );
    }
    if std::env::var_os("DUALEDIT_RECOMPUTE_NO_TIME").is_some() {
        return;
    }

    // Time: plain and recompute steps interleaved (the order alternating each round), so
    // that load from other processes on the machine hits both alike; per round, the ratio.
    let rounds: usize = std::env::var("DUALEDIT_RECOMPUTE_ROUNDS").ok().and_then(|v| v.parse().ok()).unwrap_or(5);
    println!("\nseconds per micro-step (meta_loss + backward), {rounds} interleaved rounds after one warm-up step each, this process (default malloc); cpu = user+system time of the process");
    for (name, layers) in edits.iter().copied() {
        // One engine per edit set; the flag lives in the editor's config.
        let engine = engine(&config(layers, false).edit_params);
        let b = batches(&engine);
        let mut editors: Vec<Editor> = [false, true]
            .iter()
            .map(|&r| {
                Editor::new(&config(layers, r), engine.edit_params.clone(), Device::Cpu, 0).expect("editor")
            })
            .collect();
        let step = |editor: &mut Editor| -> (f64, f64) {
            let (t, c) = (Instant::now(), cpu_seconds());
            let (loss, parts) = meta_loss(&engine, editor, &b, true).expect("meta loss");
            loss.backward();
            black_box(parts);
            let dt = (t.elapsed().as_secs_f64(), cpu_seconds() - c);
            for t in editor.named_tensors().into_iter().map(|(_, t)| t) {
                let mut g = t.grad();
                if g.defined() {
                    let _ = g.zero_();
                }
            }
            dt
        };
        for e in editors.iter_mut() {
            step(e);
        }
        let (mut plain, mut rec, mut ratio) = (Vec::new(), Vec::new(), Vec::new());
        let (mut plain_cpu, mut rec_cpu) = (Vec::new(), Vec::new());
        for round in 0..rounds {
            let (p, r) = if round % 2 == 0 {
                let p = step(&mut editors[0]);
                (p, step(&mut editors[1]))
            } else {
                let r = step(&mut editors[1]);
                (step(&mut editors[0]), r)
            };
            plain.push(p.0);
            rec.push(r.0);
            plain_cpu.push(p.1);
            rec_cpu.push(r.1);
            ratio.push(r.0 / p.0);
        }
        println!("{name}: wall  plain {}  recompute {}", stats(&plain), stats(&rec));
        println!("{name}: cpu   plain {}  recompute {}", stats(&plain_cpu), stats(&rec_cpu));
        println!(
            "{name}: recompute/plain wall time per round: median {:.3} (min {:.3}, max {:.3}); median cpu time ratio {:.3}",
            median(&ratio),
            ratio.iter().cloned().fold(f64::INFINITY, f64::min),
            ratio.iter().cloned().fold(0.0, f64::max),
            median(&rec_cpu) / median(&plain_cpu)
        );
    }
}

fn median(v: &[f64]) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(|a, b| a.total_cmp(b));
    let n = s.len();
    if n % 2 == 1 {
        s[n / 2]
    } else {
        (s[n / 2 - 1] + s[n / 2]) / 2.0
    }
}

fn stats(v: &[f64]) -> String {
    let mean = v.iter().sum::<f64>() / v.len() as f64;
    format!("median {:.2} s (mean {:.2}, min {:.2}, max {:.2})", median(v), mean, v.iter().cloned().fold(f64::INFINITY, f64::min), v.iter().cloned().fold(0.0, f64::max))
}
