//! The meta-training step as `benches/mend.rs` and `benches/real.rs` time it: one micro-batch
//! (forward, edit, edited forwards, backward, scaled by `accumulate`) and the optimiser step
//! it is amortised over; then the process's peak resident set.
use criterion::{black_box, Criterion};
use dualedit::config::MendConfig;
use dualedit::device::memory;
use dualedit::mend::optim::Adam;
use dualedit::mend::{Editor, Engine};
use dualedit::mend::train::{meta_loss, EditBatches};
use tch::Device;

/// Benches `{prefix}/train_microbatch` and `{prefix}/adam_step`, then prints the summary
/// and the peak resident set.
pub fn bench_step(c: &mut Criterion, prefix: &str, engine: &Engine, editor: &mut Editor, b: &EditBatches, cfg: &MendConfig) {
    let (net, lrs) = editor.trainables();
    let mut adam = Adam::new(vec![(cfg.lr, net), (cfg.lr_lr, lrs)]);
    c.bench_function(&format!("{prefix}/train_microbatch"), |bench| {
        bench.iter(|| {
            let (loss, parts) = meta_loss(engine, editor, b, true).expect("meta loss");
            (loss / cfg.accumulate as f64).backward();
            black_box(parts)
        })
    });
    c.bench_function(&format!("{prefix}/adam_step"), |bench| {
        bench.iter(|| {
            adam.clip(cfg.grad_clip);
            adam.step();
        })
    });
    adam.zero_grad();
    c.final_summary();

    let m = memory::sample(Device::Cpu).expect("rss");
    println!(
        "editor parameters: {}; peak resident set of the process: {} ({} bytes)",
        editor.n_parameters(),
        memory::format_bytes(m.peak_allocated_bytes),
        m.peak_allocated_bytes
    );
    println!("a meta-training step = {0} x train_microbatch + adam_step (accumulate {0})", cfg.accumulate);
}
