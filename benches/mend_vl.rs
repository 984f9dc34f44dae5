//! MEND on a small Qwen2-VL (random f32 weights) on CPU, one E-VQA example per step:
//! what dualedit's meta-training step and edit cost, phase by phase, against the same
//! computation in PyTorch as EasyEdit's `MultimodalTrainer` + MEND does it
//! (scripts/bench_mend_vl_easyedit.py, which builds the same sizes and token layout).
//!
//! Configurations (environment, so that `cargo bench`'s own arguments pass through):
//! - `DUALEDIT_BENCH_MODEL`: `small` (benches/vl_configs/qwen2_vl.json: text 4 × 512,
//!   vocabulary 4096, vision tower 4 × 256; the default) or `tiny`
//!   (benches/vl_configs/qwen2_vl_tiny.json: text 4 × 192, tower 2 × 128) or `medium`
//!   (benches/vl_configs/qwen2_vl_medium.json: text 8 × 1024, vocabulary 16384, tower
//!   4 × 512; 146 M parameters, the size of the issue #35's "small");
//! - `DUALEDIT_BENCH_SIDE`: image side in pixels, 224 or 448 (default 448: 1024 patches,
//!   256 image tokens per image);
//! - `DUALEDIT_BENCH_DTYPE`: `f32` (default) or `bf16` (the model's weights; the editor's
//!   weights stay f32 on both sides, its `U`/`V` products follow a bf16 model into bf16
//!   here as in a run, `Editor::products_for`; EasyEdit's `.float()` editor computes them
//!   in f32);
//! - `DUALEDIT_BENCH_EDITOR_PRODUCTS=f32`: f32 editor products in a bf16 bench (the
//!   path before, for an A/B);
//! - `DUALEDIT_BENCH_RUNS` / `DUALEDIT_BENCH_WARMUP`: timed and warm-up runs (10 / 3).
//!
//! Sizes (both sides): three distinct images, image views `<|vision_start|>` + image
//! pads + `<|vision_end|>` + 13 question tokens + 3 answer tokens, the text-only `loc`
//! view 13 + 3 tokens; MEND's default editor (rank 1920, combine, shared, one hidden
//! layer) on the up/down projections of blocks 1–3 (two shared editors, 3 modes each),
//! batch 1, one libtorch thread.
//!
//! Output, in this order:
//! 1. the per-phase profile of one meta-training micro-step and of one edit (mean of
//!    `RUNS` after the warm-up, from the engine's phase timeline): milliseconds, GFLOP
//!    counted from the batches' shapes, and GFLOP/s, beside a one-thread `Tensor::mm`
//!    peak in f32 and bf16 (1024³); the step's total also by this thread's CPU time
//!    against the peak by CPU time (under load the wall clock deflates both);
//! 2. medians (wall clock, and the thread's CPU time, which the other processes of a
//!    shared machine disturb far less) of `train_microbatch` (the tower on the images'
//!    pixel values + `meta_loss` + backward), `adam_step` (clipping + Adam over the
//!    editor) and `edit` (the tower on the edit image's pixel values, capture, the
//!    editor): the same work as the Python script's lines of those names, which is given
//!    pixel values; and `train_from_files` / `edit_from_file`, which also read and
//!    preprocess the PNGs each time, as training and `dualedit edit` do.
//!
//! Arguments: `--ab`: only the A/B of #35 (the micro-step before — every forward from
//! the embedding, the four scored views in one padded forward, the editor's products
//! always transposed — and after, alternating, medians of `RUNS` rounds after one warm-up
//! each); `--ab-editor`: the same A/B of the editor's products alone; `--ab-rows`: the
//! A/B of the last block at every row or at the scored rows only (micro-step and edit,
//! from pixel values, wall clock and CPU time); `--criterion`: criterion's statistics of
//! one micro-step and one edit instead of 2; `--timings`: 2 alone (what
//! scripts/bench_mend_vl_compare.sh runs).
//!
//! `./x bench --bench mend_vl` (or `DUALEDIT_BENCH_SIDE=224 ./x bench --bench mend_vl --
//! --criterion`); results in BENCHMARKS.md and docs/notebook/mend-step.md ("#35").
use std::collections::BTreeMap;
use std::path::Path;
use std::time::{Duration, Instant};

use dualedit::config::MendConfig;
use dualedit::data::multimodal::StepImages;
use dualedit::data::TokenBatch;
use dualedit::data::{EditExample, Example, ImageRef};
use dualedit::device::DevicePlan;
use dualedit::mend::optim::Adam;
use dualedit::mend::{Editor, Engine, Factors};
use dualedit::model::qwen2_vl::Qwen2Vl;
use dualedit::model::vision::{image as vl_image, PreparedImage};
use dualedit::model::{load_model, random_params, Model, ParamView};
use dualedit::mend::train::{meta_loss, EditBatches, EditedGroup, View};
use tch::{Device, Kind, Tensor};

const QUESTION: usize = 13;
const ANSWER: usize = 3;

/// What to measure (see the module doc for the variables).
struct Setup {
    model: String,
    side: u32,
    kind: Kind,
    runs: usize,
    warmup: usize,
}

impl Setup {
    fn from_env() -> Self {
        let var = |k: &str, d: &str| std::env::var(k).unwrap_or_else(|_| d.to_string());
        let model = var("DUALEDIT_BENCH_MODEL", "small");
        assert!(["small", "tiny", "medium"].contains(&model.as_str()), "DUALEDIT_BENCH_MODEL must be small, tiny or medium, not {model:?}");
        let side: u32 = var("DUALEDIT_BENCH_SIDE", "448").parse().expect("DUALEDIT_BENCH_SIDE: a number of pixels");
        assert!(side >= 56 && side.is_multiple_of(28), "DUALEDIT_BENCH_SIDE must be a multiple of 28 (≥ 56), not {side}");
        let kind = match var("DUALEDIT_BENCH_DTYPE", "f32").as_str() {
            "f32" => Kind::Float,
            "bf16" => Kind::BFloat16,
            other => panic!("DUALEDIT_BENCH_DTYPE must be f32 or bf16, not {other:?}"),
        };
        let runs = var("DUALEDIT_BENCH_RUNS", "10").parse().expect("DUALEDIT_BENCH_RUNS: a count");
        let warmup = var("DUALEDIT_BENCH_WARMUP", "3").parse().expect("DUALEDIT_BENCH_WARMUP: a count");
        assert!(runs >= 1, "DUALEDIT_BENCH_RUNS must be at least 1");
        Self { model, side, kind, runs, warmup }
    }

    fn config_file(&self) -> &'static str {
        match self.model.as_str() {
            "tiny" => "benches/vl_configs/qwen2_vl_tiny.json",
            "medium" => "benches/vl_configs/qwen2_vl_medium.json",
            _ => "benches/vl_configs/qwen2_vl.json",
        }
    }

    /// Image tokens per image: `(side / 14)²` patches merged 2 × 2.
    fn image_tokens(&self) -> usize {
        let g = (self.side / 14) as usize;
        g * g / 4
    }
}

/// The bench config as an HF directory with random weights, the fixture's tokenizer (never
/// used: token ids are built below) and preprocessor, and three distinct PNG images.
fn model_dir(setup: &Setup) -> tempfile::TempDir {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let dir = tempfile::tempdir().expect("tempdir");
    let text = std::fs::read_to_string(root.join(setup.config_file())).expect("bench config");
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
        let img = image::RgbImage::from_fn(setup.side, setup.side, |x, y| {
            image::Rgb([(x as u8).wrapping_mul(seed), (y as u8).wrapping_add(seed), ((x + y) as u8).wrapping_mul(7)])
        });
        img.save(dir.path().join(name)).expect("image");
    }
    dir
}

/// Token ids `(seed·131 + i·17) mod 4000 + 10` (scripts/bench_mend_vl_easyedit.py builds
/// the same), after the image run when `image` is given; the last 3 are the answer.
fn example(seed: usize, image: Option<&Path>, json: &serde_json::Value, setup: &Setup) -> Example {
    let tok = |k: &str| json[k].as_i64().expect("token id");
    let mut ids = Vec::new();
    if image.is_some() {
        ids.push(tok("vision_start_token_id"));
        ids.extend(std::iter::repeat_n(tok("image_token_id"), setup.image_tokens()));
        ids.push(tok("vision_end_token_id"));
    }
    ids.extend((0..QUESTION + ANSWER).map(|i| ((seed * 131 + i * 17) % 4000 + 10) as i64));
    let answer_start = ids.len() - ANSWER;
    let g = setup.side as i64 / 14;
    let image = image.map(|p| ImageRef { path: p.to_path_buf(), grid: [1, g, g] });
    Example { ids, answer_start, image }
}

/// This thread's CPU time in milliseconds (`/proc/thread-self/schedstat`, nanoseconds on
/// the CPU): with one libtorch thread every op and the backward run on the calling thread,
/// so this counts the work and not the time other processes held the core. `None` where
/// the file is missing (not Linux).
fn cpu_ms() -> Option<f64> {
    let s = std::fs::read_to_string("/proc/thread-self/schedstat").ok()?;
    Some(s.split_whitespace().next()?.parse::<f64>().ok()? / 1e6)
}

/// Median milliseconds (wall clock, and this thread's CPU time) of `runs` runs after
/// `warmup` warm-up runs.
fn timed(name: &str, setup: &Setup, mut f: impl FnMut()) -> f64 {
    for _ in 0..setup.warmup {
        f();
    }
    let (mut ms, mut cpu) = (Vec::new(), Vec::new());
    for _ in 0..setup.runs {
        let (t, c) = (Instant::now(), cpu_ms());
        f();
        ms.push(t.elapsed().as_secs_f64() * 1e3);
        if let (Some(a), Some(b)) = (c, cpu_ms()) {
            cpu.push(b - a);
        }
    }
    let m = median(&mut ms);
    let c = if cpu.is_empty() { f64::NAN } else { median(&mut cpu) };
    println!("{name:<18} median {m:8.1} ms  (min {:.1}, max {:.1})  cpu median {c:8.1} ms", ms[0], ms[ms.len() - 1]);
    m
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

/// One-thread GEMM peak: the best GFLOP/s of `[n, n]·[n, n]` products of `kind`, by the
/// wall clock and by this thread's CPU time (which the machine's other processes do not
/// deflate; see [`cpu_ms`]).
fn gemm_peak(kind: Kind) -> (f64, f64) {
    let n = 1024;
    let (a, b) = (Tensor::randn([n, n], (kind, Device::Cpu)), Tensor::randn([n, n], (kind, Device::Cpu)));
    let (mut best, mut best_cpu) = (f64::MAX, f64::MAX);
    for _ in 0..8 {
        let (t, c) = (Instant::now(), cpu_ms());
        let _ = std::hint::black_box(a.mm(&b));
        best = best.min(t.elapsed().as_secs_f64());
        if let (Some(c0), Some(c1)) = (c, cpu_ms()) {
            best_cpu = best_cpu.min((c1 - c0) / 1e3);
        }
    }
    let flops = 2.0 * (n * n * n) as f64 / 1e9;
    (flops / best, if best_cpu > 0.0 && best_cpu < f64::MAX { flops / best_cpu } else { f64::NAN })
}

/// Rows of a batch (`B·T`, padding included: what its forward computes).
fn rows(b: &TokenBatch) -> f64 {
    (b.batch_size() * b.input_ids.size()[1]) as f64
}

/// Scored (kept) positions of a batch.
fn kept(b: &TokenBatch) -> f64 {
    b.keep.sum(Kind::Int64).int64_value(&[]) as f64
}

/// The model's sizes for counting FLOPs (matrix products only: norms, activations,
/// softmax and rotary embeddings are left out).
struct Sizes {
    /// Linear-layer FLOPs of one text block per token row (`2·Σ` its matrices).
    per_block: f64,
    /// The part of `per_block` that the last block still computes at every row when it
    /// runs at the kept rows only (k_proj, v_proj: the keys and values).
    kv_per_row: f64,
    /// Whether the last block runs at the kept rows only (`Engine::last_block_at_kept`).
    last_at_kept: bool,
    hidden: f64,
    /// Blocks below the first edited one (the prefix) and from it up.
    below: f64,
    above: f64,
    /// LM head FLOPs per scored row.
    head: f64,
    /// Vision tower FLOPs of one image of `P` patches (its linear layers, the merger at
    /// `P / 4` rows, full attention within the image).
    tower: f64,
}

impl Sizes {
    fn new(engine: &Engine, json: &serde_json::Value, setup: &Setup) -> Self {
        let params = |f: &dyn Fn(&str) -> bool| -> f64 { engine.lm.params.iter().filter(|(n, t)| f(n) && t.dim() >= 2).map(|(_, t)| t.numel() as f64).sum() };
        let first = engine.edit_params.iter().filter_map(|p| engine.lm.model.block_of(&p.name)).min().unwrap_or(0) as f64;
        let n_blocks = engine.lm.model.n_blocks() as f64;
        let hidden = json["hidden_size"].as_f64().expect("hidden");
        let p = ((setup.side / 14) * (setup.side / 14)) as f64;
        let v = &json["vision_config"];
        let (depth, e) = (v["depth"].as_f64().expect("depth"), v["embed_dim"].as_f64().expect("embed_dim"));
        let tower = 2.0 * p * params(&|n| n.starts_with("visual.") && !n.contains("merger")) + 2.0 * (p / 4.0) * params(&|n| n.contains("visual.merger")) + depth * 4.0 * p * p * e;
        Self {
            per_block: 2.0 * params(&|n| n.starts_with("model.layers.0.")),
            kv_per_row: 2.0 * params(&|n| n.starts_with("model.layers.0.self_attn.k_proj") || n.starts_with("model.layers.0.self_attn.v_proj")),
            last_at_kept: engine.last_block_at_kept,
            hidden,
            below: first,
            above: n_blocks - first,
            head: 2.0 * json["vocab_size"].as_f64().expect("vocab") * hidden,
            tower,
        }
    }

    /// Forward FLOPs of `blocks` text blocks over a batch: `(linear, attention)`. With
    /// `top` (the blocks end at the model's last one), the last block's queries, attention
    /// output and MLP at `B·M` rows only when [`Sizes::last_at_kept`] (`M`: the most kept
    /// positions of a row).
    fn blocks(&self, b: &TokenBatch, blocks: f64, top: bool) -> (f64, f64) {
        let t = b.input_ids.size()[1] as f64;
        let bs = b.batch_size() as f64;
        let full = |n: f64| (n * rows(b) * self.per_block, n * 4.0 * bs * t * t * self.hidden);
        if !(top && self.last_at_kept && blocks >= 1.0) {
            return full(blocks);
        }
        let m = b.keep.sum_dim_intlist(1, false, Kind::Int64).max().int64_value(&[]) as f64;
        let (l, a) = full(blocks - 1.0);
        (l + rows(b) * self.kv_per_row + bs * m * (self.per_block - self.kv_per_row), a + 4.0 * bs * m * t * self.hidden)
    }

    /// Forward plus an input-gradient backward (the frozen weights get no gradient): the
    /// linear layers once more, attention's two products twice.
    fn blocks_fwd_bwd(&self, b: &TokenBatch, blocks: f64, top: bool) -> (f64, f64) {
        let (l, a) = self.blocks(b, blocks, top);
        (l, a + l + 2.0 * a)
    }
}

/// FLOPs per phase of one micro-step (`edit`: of one edit instead), keyed as the timeline
/// names the phases. `rows_w`: the factor rows of each edited weight (rows with signal).
fn phase_flops(s: &Sizes, b: &EditBatches, editor: &EditorShape, rows_w: &[f64], edit: bool) -> BTreeMap<&'static str, f64> {
    let mut f = BTreeMap::new();
    let sum = |(l, a): (f64, f64)| l + a;
    let images = if edit { 1.0 } else { 3.0 };
    f.insert("tower + collate", images * s.tower);
    let (cap_l, cap_a) = s.blocks_fwd_bwd(&b.inner, s.above, true);
    f.insert("capture", cap_l + cap_a + 2.0 * s.head * kept(&b.inner));
    let editor_fwd = editor.forward(rows_w);
    f.insert("editor", editor_fwd);
    if edit {
        f.insert("prefix", sum(s.blocks(&b.inner, s.below, false)));
        return f;
    }
    // The batches whose prefix runs: the capture's, each edited group's (or its one view's).
    let groups: Vec<&TokenBatch> = b.edited.iter().map(|g| g.batch.as_ref().unwrap_or_else(|| b.view(g.views[0]).expect("view"))).collect();
    f.insert("prefix", sum(s.blocks(&b.inner, s.below, false)) + groups.iter().map(|g| sum(s.blocks(g, s.below, false))).sum::<f64>());
    let loc: Vec<&TokenBatch> = [b.loc.as_ref(), b.loc_image.as_ref()].into_iter().flatten().collect();
    f.insert("unedited forwards", loc.iter().map(|l| sum(s.blocks(l, s.above, true)) + s.head * kept(l)).sum());
    let scored: f64 = [Some(&b.outer), b.outer_image.as_ref(), b.loc.as_ref(), b.loc_image.as_ref()].into_iter().flatten().map(kept).sum();
    let edited_rows: f64 = groups.iter().map(|g| rows(g)).sum();
    // The factored edit `x·W + (x·aᵀ)·b` per edited weight: two products of R_w rows.
    let low_rank: f64 = editor.dims.iter().zip(rows_w).map(|((d_in, d_out), r)| 2.0 * edited_rows * r * (d_in + d_out)).sum();
    f.insert("edited forwards", groups.iter().map(|g| sum(s.blocks(g, s.above, true))).sum::<f64>() + low_rank + s.head * scored);
    // The backward: the edited forwards' input gradients, the factored edit's gradients
    // (x, a and b: twice its forward), the head's input gradient, and the editor's (its
    // weights' gradients in both layers, 3 products each, and its input gradient in the
    // second, 1 more: 7 products against the forward's 4).
    let edited_bwd: f64 = groups.iter().map(|g| s.blocks_fwd_bwd(g, s.above, true)).map(|(l, a)| l + a).sum::<f64>() - groups.iter().map(|g| sum(s.blocks(g, s.above, true))).sum::<f64>();
    f.insert("backward (edited forwards)", edited_bwd + 2.0 * low_rank + s.head * scored);
    f.insert("backward (editor)", 1.75 * editor_fwd);
    f
}

/// The editor's shape: per edited weight `(d_in, d_out)` and its shared editor's index,
/// the editors' widths `d_in + d_out` (combine mode) and rank, and layers.
struct EditorShape {
    dims: Vec<(f64, f64)>,
    rank: f64,
    layers: f64,
    /// Whether the editor applies its dense products (evaluation, after a few edits).
    dense: bool,
}

impl EditorShape {
    /// Forward FLOPs: per factor row, each layer's `u·(v·x)` (two products of width × rank),
    /// or with [`EditorShape::dense`] its one product `(u·v)·x` where the rank is more than
    /// half the width.
    fn forward(&self, rows_w: &[f64]) -> f64 {
        self.dims
            .iter()
            .zip(rows_w)
            .map(|((i, o), r)| {
                let (w, rank) = (i + o, self.rank.min(i + o));
                let per_row = if self.dense && 2.0 * rank > w { 2.0 * w * w } else { 2.0 * 2.0 * w * rank };
                r * self.layers * per_row
            })
            .sum()
    }
}

/// Mean milliseconds per phase over `runs` runs of `f` (after `warmup`), from the engine's
/// timeline (nested spans' time given to the innermost), and the mean wall time.
fn phases(engine: &Engine, setup: &Setup, mut f: impl FnMut(&Engine)) -> (BTreeMap<String, f64>, (f64, f64)) {
    for _ in 0..setup.warmup {
        f(engine);
    }
    let before = engine.timeline.spans().len();
    engine.timeline.set_on(true);
    let (t, c) = (Instant::now(), cpu_ms());
    for i in 0..setup.runs {
        engine.timeline.at(i, 0);
        f(engine);
    }
    let wall = t.elapsed().as_secs_f64() * 1e3 / setup.runs as f64;
    let cpu = match (c, cpu_ms()) {
        (Some(a), Some(b)) => (b - a) / setup.runs as f64,
        _ => f64::NAN,
    };
    engine.timeline.set_on(false);
    let spans = engine.timeline.spans();
    let summary = dualedit::device::timeline::summarise(&spans[before.min(spans.len())..]);
    let per = summary.phase_s.into_iter().map(|(k, v)| (k.trim_start_matches("main/").to_string(), v * 1e3 / setup.runs as f64)).collect();
    (per, (wall, cpu))
}

/// `wall`: wall-clock and CPU milliseconds per run; `peak`: the mm peak by each.
fn print_phases(what: &str, per: &BTreeMap<String, f64>, (wall, cpu): (f64, f64), flops: &BTreeMap<&'static str, f64>, (peak, peak_cpu): (f64, f64)) {
    println!("{what}: {wall:.1} ms per run (phases: mean ms, GFLOP counted, GFLOP/s)");
    let mut total_flops = 0.0;
    for (phase, ms) in per {
        let gf = flops.get(phase.as_str()).copied().unwrap_or(0.0) / 1e9;
        total_flops += gf;
        let rate = if gf > 0.0 { format!("{:7.1}", gf / ms * 1e3) } else { "      -".into() };
        println!("  {phase:<28} {ms:9.1} ms {:5.1} % {gf:8.2} GFLOP {rate} GFLOP/s", 100.0 * ms / wall);
    }
    println!("  {:<28} {wall:9.1} ms         {total_flops:8.2} GFLOP {:7.1} GFLOP/s = {:.0} % of the one-thread mm peak ({peak:.1})", "total", total_flops / wall * 1e3, 100.0 * total_flops / wall * 1e3 / peak);
    println!(
        "  by CPU time: {cpu:.1} ms per run, {:.1} GFLOP/s = {:.0} % of the mm peak by CPU time ({peak_cpu:.1})",
        total_flops / cpu * 1e3,
        100.0 * total_flops / cpu * 1e3 / peak_cpu
    );
}

/// The step of the A/B of #35: `before`, every forward from the embedding, the four
/// scored views in one padded forward and the editor's products always transposed;
/// after, the prefix once per batch, views grouped, the editor's plain products above
/// [`dualedit::mend::editor::EDITOR_SKINNY_ROWS`] rows.
/// The features of the step's images from their pixel values (read and preprocessed
/// beforehand): the tower alone, as the PyTorch side, which is given pixel values.
fn tower<'a>(engine: &'a Engine, prepared: &[PreparedImage]) -> StepImages<'a> {
    let vl = engine.lm.model.family().vision_language().expect("a VL model");
    StepImages::from_prepared(vl, &ParamView::frozen(&engine.lm.params), prepared).expect("tower")
}

/// One micro-step (`meta_loss` + backward) from pixel values.
fn step_px(engine: &Engine, editor: &mut Editor, ex: &EditExample, cfg: &MendConfig, prepared: &[PreparedImage]) {
    let images = tower(engine, prepared);
    let b = EditBatches::for_config_with(engine, &[ex], cfg, Some(&images)).expect("batches");
    let (loss, _) = meta_loss(engine, editor, &b, true).expect("meta loss");
    (loss / cfg.accumulate as f64).backward();
}

/// One edit from the edit image's pixel values: tower, capture, editor.
fn edit_px(engine: &Engine, editor: &mut Editor, ex: &EditExample, prepared: &PreparedImage) {
    let _g = tch::no_grad_guard();
    let images = tower(engine, std::slice::from_ref(prepared));
    let inner = engine.collate_with(&[&ex.inner], Some(&images)).expect("inner batch");
    let (_, factors) = engine.capture(&inner).expect("capture");
    std::hint::black_box(engine.edit_low_rank(editor, &factors, false).expect("edit"));
}

/// Edits until the editor has formed its dense products (`Editor::dense_products`: after
/// a few edits with the same editor weights, as in any session of edits; at most 20),
/// so that the timed edits are the steady state the Python side's are; prints how many.
/// A one-off edit runs the factored products (the edit of `--ab-rows`).
fn steady_editor(engine: &Engine, editor: &mut Editor, ex: &EditExample, prepared: &PreparedImage) {
    let mut n = 0;
    while editor.dense_products() == 0 && n < 20 {
        edit_px(engine, editor, ex, prepared);
        n += 1;
    }
    println!("editor: {} layers use their dense product U·V after {n} edits", editor.dense_products());
}

/// `editor_only`: only the editor's products differ between before and after.
fn ab_step(engine: &mut Engine, editor: &mut Editor, ex: &EditExample, cfg: &MendConfig, before: bool, editor_only: bool) {
    engine.share_prefix = !before || editor_only;
    editor.skinny_rows = if before { i64::MAX } else { dualedit::mend::editor::EDITOR_SKINNY_ROWS };
    let mut b = EditBatches::for_config(engine, &[ex], cfg).expect("batches");
    if before && !editor_only {
        let views = [View::Outer, View::OuterImage, View::Loc, View::LocImage];
        let all = [&ex.outer, ex.outer_image.as_ref().expect("view"), ex.loc.as_ref().expect("view"), ex.loc_image.as_ref().expect("view")];
        let batch = engine.collate(&all).expect("batch");
        b.edited = vec![EditedGroup { views: views.to_vec(), batch: Some(batch) }];
    }
    let (loss, _) = meta_loss(engine, editor, &b, true).expect("meta loss");
    (loss / cfg.accumulate as f64).backward();
    engine.share_prefix = true;
    editor.skinny_rows = dualedit::mend::editor::EDITOR_SKINNY_ROWS;
}

fn main() {
    tch::set_num_threads(1);
    let setup = Setup::from_env();
    let args: Vec<String> = std::env::args().collect();
    let has = |a: &str| args.iter().any(|x| x == a);
    let dir = model_dir(&setup);
    let json: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(dir.path().join("config.json")).expect("config")).expect("JSON");
    let lm = load_model(dir.path(), Device::Cpu, setup.kind).expect("load");
    // The last three blocks, as EasyEdit's Qwen2-VL-7B preset (25–27 of 28).
    let layers = json["num_hidden_layers"].as_i64().expect("num_hidden_layers");
    let edit_params: Vec<String> = (layers - 3..layers).flat_map(|l| ["up_proj", "down_proj"].map(|m| format!("model.layers.{l}.mlp.{m}.weight"))).collect();
    let mut engine = Engine::new(lm, DevicePlan::single(Device::Cpu), &edit_params).expect("engine");
    let cfg = MendConfig { edit_params, ..MendConfig::default() };
    let mut editor = Editor::new(&cfg, engine.edit_params.clone(), Device::Cpu, 0).expect("editor");
    // As a run sets it (`Editor::products_for`); `DUALEDIT_BENCH_EDITOR_PRODUCTS=f32`
    // keeps f32 products in a bf16 bench (the path before, as EasyEdit's `.float()` editor).
    editor.product_kind = match std::env::var("DUALEDIT_BENCH_EDITOR_PRODUCTS").as_deref() {
        Ok("f32") => Kind::Float,
        _ => Editor::products_for(setup.kind, Device::Cpu),
    };
    let img = |n: &str| dir.path().join(n);
    let (edit, rephrase, loc) = (img("edit.png"), img("rephrase.png"), img("loc.png"));
    let ex = EditExample {
        inner: example(1, Some(&edit), &json, &setup),
        outer: example(2, Some(&edit), &json, &setup),
        rephrased: true,
        loc: Some(example(3, None, &json, &setup)),
        portability: vec![],
        outer_image: Some(example(1, Some(&rephrase), &json, &setup)),
        loc_image: Some(example(4, Some(&loc), &json, &setup)),
    };
    println!(
        "model {} ({:.1} M parameters), {} × {} px ({} image tokens), {:?}; torch threads {}, editor parameters {}, edited {:?}",
        setup.model,
        engine.lm.params.iter().map(|(_, t)| t.numel() as f64).sum::<f64>() / 1e6,
        setup.side,
        setup.side,
        setup.image_tokens(),
        setup.kind,
        tch::get_num_threads(),
        editor.n_parameters(),
        engine.edit_names()
    );
    let (net, lrs) = editor.trainables();
    let mut adam = Adam::new(vec![(cfg.lr, net), (cfg.lr_lr, lrs)]);
    // The images read and preprocessed once, for the timings from pixel values.
    let proc = engine.image_proc.clone().expect("image processor");
    let prepared: Vec<PreparedImage> = [&edit, &rephrase, &loc].iter().map(|p| vl_image::prepare(p, &proc).expect("image")).collect();

    if has("--ab-rows") {
        // #35: the last block at every row (before) or at the kept rows only (after),
        // alternating, micro-step and edit from pixel values.
        let (mut sb, mut sa, mut eb, mut ea) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for round in 0..setup.runs + 1 {
            for at_kept in [false, true] {
                engine.last_block_at_kept = at_kept;
                let (t, c) = (Instant::now(), cpu_ms());
                step_px(&engine, &mut editor, &ex, &cfg, &prepared);
                let step = (t.elapsed().as_secs_f64() * 1e3, cpu_ms().zip(c).map(|(b, a)| b - a).unwrap_or(f64::NAN));
                let (t, c) = (Instant::now(), cpu_ms());
                edit_px(&engine, &mut editor, &ex, &prepared[0]);
                let edit = (t.elapsed().as_secs_f64() * 1e3, cpu_ms().zip(c).map(|(b, a)| b - a).unwrap_or(f64::NAN));
                if round > 0 {
                    let (s_, e_) = if at_kept { (&mut sa, &mut ea) } else { (&mut sb, &mut eb) };
                    s_.push(step);
                    e_.push(edit);
                }
            }
        }
        adam.zero_grad();
        let med = |v: &[(f64, f64)], cpu: bool| median(&mut v.iter().map(|p| if cpu { p.1 } else { p.0 }).collect::<Vec<_>>());
        for (what, b, a) in [("micro-step", &sb, &sa), ("edit", &eb, &ea)] {
            println!(
                "A/B over {} alternating rounds, {what}: whole last block {:.1} ms (cpu {:.1}), at the kept rows {:.1} ms (cpu {:.1}): {:.2}× (cpu {:.2}×)",
                setup.runs,
                med(b, false),
                med(b, true),
                med(a, false),
                med(a, true),
                med(a, false) / med(b, false),
                med(a, true) / med(b, true)
            );
        }
        return;
    }

    if has("--ab") || has("--ab-editor") {
        let editor_only = has("--ab-editor");
        let (mut before_ms, mut after_ms) = (Vec::new(), Vec::new());
        let once = |before: bool, engine: &mut Engine, editor: &mut Editor| {
            let t = Instant::now();
            ab_step(engine, editor, &ex, &cfg, before, editor_only);
            t.elapsed().as_secs_f64() * 1e3
        };
        once(true, &mut engine, &mut editor);
        once(false, &mut engine, &mut editor);
        for _ in 0..setup.runs {
            before_ms.push(once(true, &mut engine, &mut editor));
            after_ms.push(once(false, &mut engine, &mut editor));
        }
        let (before, after) = (median(&mut before_ms), median(&mut after_ms));
        let what = if editor_only { "the editor's products always transposed" } else { "before #35" };
        println!("A/B over {} alternating rounds: {what} {before:.1} ms, after {after:.1} ms ({:.2}×)", setup.runs, after / before);
        return;
    }

    if has("--criterion") {
        let mut c = criterion::Criterion::default().sample_size(10).warm_up_time(Duration::from_secs(1)).measurement_time(Duration::from_secs(20));
        let name = format!("mend_vl/{}_{}_{}", setup.model, setup.side, if setup.kind == Kind::Float { "f32" } else { "bf16" });
        c.bench_function(&format!("{name}/train_microbatch"), |bch| {
            bch.iter(|| {
                let b = EditBatches::for_config(&engine, &[&ex], &cfg).expect("batches");
                let (loss, _) = meta_loss(&engine, &mut editor, &b, true).expect("meta loss");
                (loss / cfg.accumulate as f64).backward();
            })
        });
        adam.zero_grad();
        c.bench_function(&format!("{name}/edit"), |bch| {
            bch.iter(|| {
                let _g = tch::no_grad_guard();
                let inner = engine.collate(&[&ex.inner]).expect("inner batch");
                let (_, factors) = engine.capture(&inner).expect("capture");
                std::hint::black_box(engine.edit_low_rank(&mut editor, &factors, false).expect("edit"))
            })
        });
        c.final_summary();
        return;
    }

    // 1. The profile: FLOPs from the shapes, time from the phase timeline.
    if !has("--timings") {
        profile(&engine, &mut editor, &mut adam, &ex, &cfg, &json, &setup);
    }
    // 2. The medians the Python script prints beside them: like for like, from the images'
    // pixel values (the Python side is given them); `…_from_files` also reads and
    // preprocesses the PNGs, as training and `dualedit edit` do.
    timed("train_microbatch", &setup, || step_px(&engine, &mut editor, &ex, &cfg, &prepared));
    timed("train_from_files", &setup, || {
        let b = EditBatches::for_config(&engine, &[&ex], &cfg).expect("batches");
        let (loss, _) = meta_loss(&engine, &mut editor, &b, true).expect("meta loss");
        (loss / cfg.accumulate as f64).backward();
    });
    timed("adam_step", &setup, || {
        adam.clip(cfg.grad_clip);
        adam.step();
    });
    adam.zero_grad();
    steady_editor(&engine, &mut editor, &ex, &prepared[0]);
    timed("edit", &setup, || edit_px(&engine, &mut editor, &ex, &prepared[0]));
    timed("edit_from_file", &setup, || {
        let _g = tch::no_grad_guard();
        let inner = engine.collate(&[&ex.inner]).expect("inner batch");
        let (_, factors) = engine.capture(&inner).expect("capture");
        std::hint::black_box(engine.edit_low_rank(&mut editor, &factors, false).expect("edit"));
    });
    println!("a meta-training step = train_microbatch + adam_step / accumulate ({})", cfg.accumulate);
}

/// The per-phase profile of a micro-step and of an edit (module doc, output 1).
fn profile(engine: &Engine, editor: &mut Editor, adam: &mut Adam, ex: &EditExample, cfg: &MendConfig, json: &serde_json::Value, setup: &Setup) {
    let sizes = Sizes::new(engine, json, setup);
    let b = EditBatches::for_config(engine, &[ex], cfg).expect("batches");
    let (_, factors) = engine.capture(&b.inner).expect("capture");
    let rows_w: Vec<f64> = factors.iter().map(|f| f.x.size()[0] as f64).collect();
    let mut shape = EditorShape {
        dims: engine.edit_params.iter().map(|p| p.in_out()).map(|(i, o)| (i as f64, o as f64)).collect(),
        rank: cfg.rank as f64,
        layers: (cfg.n_hidden + 1) as f64,
        dense: false,
    };
    println!("factor rows per edited weight (rows with signal): {rows_w:?}");
    let peak32 = gemm_peak(Kind::Float);
    let peak16 = gemm_peak(Kind::BFloat16);
    println!(
        "one-thread mm peak (1024³), wall clock / CPU time: f32 {:.1} / {:.1} GFLOP/s, bf16 {:.1} / {:.1} GFLOP/s",
        peak32.0, peak32.1, peak16.0, peak16.1
    );
    let peak = if setup.kind == Kind::Float { peak32 } else { peak16 };

    // The editor's backward alone (same factors, random cotangents on its outputs): the
    // timeline's backward is the edited forwards' and the editor's together.
    let mut editor_bwd = Vec::new();
    for i in 0..setup.warmup + setup.runs {
        let terms = editor.edit_terms(&factors, true);
        let t = Instant::now();
        let s = terms.iter().map(|(a, b)| (a * a.randn_like()).sum(Kind::Float) + (b * b.randn_like()).sum(Kind::Float)).fold(Tensor::zeros([], (Kind::Float, Device::Cpu)), |x, y| x + y);
        s.backward();
        if i >= setup.warmup {
            editor_bwd.push(t.elapsed().as_secs_f64() * 1e3);
        }
    }
    adam.zero_grad();
    let editor_bwd = median(&mut editor_bwd);
    let (mut per, wall) = phases(engine, setup, |engine| {
        let tl = &engine.timeline;
        tl.span("main", "losses and the rest", || {
            let prepared: Vec<PreparedImage> = tl.span("main", "read + preprocess images", || {
                [&ex.inner, ex.outer_image.as_ref().expect("view"), ex.loc_image.as_ref().expect("view")]
                    .iter()
                    .map(|e| vl_image::prepare(&e.image.as_ref().expect("image").path, engine.image_proc.as_ref().expect("processor")).expect("image"))
                    .collect()
            });
            let b = tl.span("main", "tower + collate", || EditBatches::for_config_with(engine, &[ex], cfg, Some(&tower(engine, &prepared)))).expect("batches");
            let (loss, _) = meta_loss(engine, editor, &b, true).expect("meta loss");
            tl.span("main", "backward", || (loss / cfg.accumulate as f64).backward());
        })
    });
    if let Some(bwd) = per.remove("backward") {
        per.insert("backward (editor)".into(), editor_bwd.min(bwd));
        per.insert("backward (edited forwards)".into(), (bwd - editor_bwd).max(0.0));
    }
    adam.zero_grad();
    print_phases("meta-training micro-step", &per, wall, &phase_flops(&sizes, &b, &shape, &rows_w, false), peak);
    steady_editor(engine, editor, ex, &vl_image::prepare(&ex.inner.image.as_ref().expect("image").path, engine.image_proc.as_ref().expect("processor")).expect("image"));
    let (per, wall) = phases(engine, setup, |engine| {
        let _g = tch::no_grad_guard();
        let tl = &engine.timeline;
        tl.span("main", "losses and the rest", || {
            let prepared = tl.span("main", "read + preprocess images", || vl_image::prepare(&ex.inner.image.as_ref().expect("image").path, engine.image_proc.as_ref().expect("processor"))).expect("image");
            let inner = tl.span("main", "tower + collate", || engine.collate_with(&[&ex.inner], Some(&tower(engine, std::slice::from_ref(&prepared))))).expect("inner batch");
            let (_, factors): (f64, Vec<Factors>) = tl.span("main", "capture", || engine.capture(&inner)).expect("capture");
            std::hint::black_box(tl.span("main", "editor", || engine.edit_low_rank(editor, &factors, false)).expect("edit"));
        })
    });
    shape.dense = editor.dense_products() > 0;
    print_phases("edit", &per, wall, &phase_flops(&sizes, &b, &shape, &rows_w, true), peak);
}
