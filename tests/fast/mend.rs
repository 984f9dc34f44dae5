//! MEND: identity editor = autograd, normalisation statistics, checkpoints, training
//! raises the target's probability, bad input.
use crate::common;
use std::collections::HashMap;
use std::path::Path;

use common::{fixture, RECORDS};

use dualedit::config::{EditorMode, MendConfig};
use dualedit::data::easyedit::{parse_records, DatasetKind};
use dualedit::data::examples::prepare;
use dualedit::data::{Example, TokenBatch};
use dualedit::device::DevicePlan;
use dualedit::mend::{checkpoint, Editor, Engine};
use dualedit::model::{load_model, ForwardInput, Overrides, ParamView};
use dualedit::mend::train::{meta_loss, EditBatches};
use tch::{Device, Kind, Tensor};

fn engine(name: &str) -> Engine {
    engine_editing(name, &[])
}

/// An engine editing `edits` (empty: the model's default MLP weights).
fn engine_editing(name: &str, edits: &[String]) -> Engine {
    let lm = load_model(&fixture(name), Device::Cpu, Kind::Float).unwrap();
    Engine::new(lm, DevicePlan::single(Device::Cpu), edits).unwrap()
}

fn examples(engine: &Engine) -> Vec<dualedit::data::EditExample> {
    let (recs, _) = parse_records(RECORDS, Path::new("inline.json"), DatasetKind::Requests).unwrap();
    prepare(&engine.lm.tokenizer, &recs, 64, Path::new("inline.json")).unwrap()
}

/// Moves a fresh editor off the identity: random `U`, scales and shifts (seeded; every
/// libtorch draw goes through the lock, so parallel tests do not change each other's).
fn perturb(editor: &Editor) {
    dualedit::rng::torch_seeded(2, || {
        tch::no_grad(|| {
            for (n, mut t) in editor.named_tensors() {
                if n.ends_with(".u") || n.ends_with(".scale") || n.ends_with(".shift") {
                    let _ = t.f_add_(&(Tensor::randn_like(&t) * 0.1)).unwrap();
                }
            }
        })
    });
}

/// A fresh editor for `engine`'s edited weights, its random init drawn from `seed`.
fn seeded_editor(engine: &Engine, cfg: &MendConfig, seed: i64) -> Editor {
    Editor::new(cfg, engine.edit_params.clone(), Device::Cpu, seed).unwrap()
}

fn identity_config(mode: EditorMode) -> MendConfig {
    MendConfig { norm: false, rank: 16, mode, ..MendConfig::default() }
}

/// With U = 0 and no normalisation the editor is the identity, so its pseudo-gradient
/// Σ δ xᵀ must equal autograd's gradient of the edit loss w.r.t. each edited weight.
fn identity_equals_autograd(name: &str) {
    identity_equals_autograd_on(engine(name), name, EditorMode::Combine);
}

fn identity_equals_autograd_on(engine: Engine, name: &str, mode: EditorMode) {
    let ex = examples(&engine);
    let batch = TokenBatch::collate(&[&ex[0].inner, &ex[1].inner], engine.lm.tokenizer.pad_id(), Device::Cpu);
    let (_, factors) = engine.capture(&batch).unwrap();
    let mut editor = Editor::new(&identity_config(mode), engine.edit_params.clone(), Device::Cpu, 0).unwrap();
    // Autograd reference: the same loss with the edited weights as leaves.
    let leaves: Overrides = engine
        .edit_params
        .iter()
        .map(|p| (p.name.clone(), engine.weight(&p.name).unwrap().detach().set_requires_grad(true)))
        .collect();
    let view = ParamView::new(&engine.lm.params, Some(&leaves));
    let none = Default::default();
    let logits = engine.lm.model.forward(&view, &batch.forward_input(&none)).unwrap().logits;
    // The edit loss of a batch: the sum over its examples of each one's mean NLL.
    let nll = -logits.log_softmax(-1, Kind::Float).gather(1, &batch.kept_targets().unsqueeze(1), false).squeeze_dim(1);
    let rows = batch.kept_rows();
    let counts = Tensor::zeros([batch.batch_size()], (Kind::Float, Device::Cpu)).index_add(0, &rows, &nll.ones_like());
    let loss = (nll / counts.index_select(0, &rows)).sum(Kind::Float);
    let names: Vec<&String> = engine.edit_params.iter().map(|p| &p.name).collect();
    let ws: Vec<&Tensor> = names.iter().map(|n| &leaves.dense()[*n]).collect();
    let grads = Tensor::run_backward(&[&loss], &ws, false, false);
    for (i, g) in grads.iter().enumerate() {
        let pseudo = editor.pseudo_grad(i, &factors[i], false);
        assert_eq!(pseudo.size(), g.size(), "{name}: {} layout", names[i]);
        let rel = (&pseudo - g).norm().double_value(&[]) / g.norm().double_value(&[]);
        assert!(rel < 1e-4, "{name} ({mode:?}): {}: relative error {rel}", names[i]);
    }
}

#[test]
fn identity_editor_equals_autograd_conv1d() {
    identity_equals_autograd("gpt2");
}

#[test]
fn identity_editor_equals_autograd_linear() {
    identity_equals_autograd("llama");
}

/// Attention weights are edited as MLP weights are: the output projection, whose inputs
/// carry what attention read from the subject, and the fused QKV projection.
#[test]
fn identity_editor_equals_autograd_attention() {
    let edits: Vec<String> = ["h.0.attn.c_proj", "h.2.attn.c_proj", "h.1.attn.c_attn", "h.2.mlp.c_fc"]
        .iter()
        .map(|n| format!("transformer.{n}.weight"))
        .collect();
    identity_equals_autograd_on(engine_editing("gpt2", &edits), "gpt2 attention", EditorMode::Combine);
}

/// Every mode starts as the identity: a factor with an MLP goes through it (U = 0), one
/// without passes as captured. `configs/zsre-small.json` uses `separate`.
#[test]
fn identity_editor_equals_autograd_in_every_mode() {
    use EditorMode::*;
    for mode in [Combine, XOnly, DeltaOnly, OneSided, Separate] {
        identity_equals_autograd_on(engine("gpt2"), "gpt2", mode);
    }
}

/// MEND's batched setting (issue #24): a batch edit is the sum of its examples' single
/// edits. The capture gives each example of a batch the `δ` it has alone and the editor
/// transforms rows independently, so the update of a batch of two examples of different
/// lengths (padded) equals the sum of their updates, with a trained-like editor
/// (normalisation statistics, non-identity network). A capture scoring the mean over all
/// the batch's tokens shrank each example's `δ` and failed this.
#[test]
fn batch_edit_is_the_sum_of_single_edits() {
    let engine = engine("gpt2");
    let ex = examples(&engine);
    let pad = engine.lm.tokenizer.pad_id();
    let mut editor = seeded_editor(&engine, &MendConfig { rank: 16, ..MendConfig::default() }, 5);
    for e in &ex {
        let (_, f) = engine.capture(&TokenBatch::collate(&[&e.inner], pad, Device::Cpu)).unwrap();
        let _ = editor.pseudo_grads(&f, true);
    }
    perturb(&editor);
    let _g = tch::no_grad_guard();
    assert_ne!(ex[0].inner.ids.len(), ex[2].inner.ids.len(), "the batch is padded");
    let mut delta_w = |batch: &[&dualedit::data::Example]| -> Vec<Tensor> {
        let (_, f) = engine.capture(&TokenBatch::collate(batch, pad, Device::Cpu)).unwrap();
        let ov = engine.edit_low_rank(&mut editor, &f, false).unwrap();
        let full: HashMap<String, Tensor> = engine.lm.params.materialise(&ov, |n| engine.lm.model.layout(n)).unwrap().into_iter().collect();
        engine.edit_params.iter().map(|p| &full[&p.name] - engine.weight(&p.name).unwrap()).collect()
    };
    let both = delta_w(&[&ex[0].inner, &ex[2].inner]);
    let (one, two) = (delta_w(&[&ex[0].inner]), delta_w(&[&ex[2].inner]));
    for (i, p) in engine.edit_params.iter().enumerate() {
        let sum = &one[i] + &two[i];
        let rel = (&both[i] - &sum).norm().double_value(&[]) / sum.norm().double_value(&[]);
        assert!(rel < 1e-4, "{}: batch update differs from the sum of single updates by {rel} (relative)", p.name);
    }
}

#[test]
fn capture_keeps_only_rows_with_signal() {
    let engine = engine("gpt2");
    let ex = examples(&engine);
    // Two examples of different lengths: padding rows must be dropped.
    let batch = TokenBatch::collate(&[&ex[0].inner, &ex[2].inner], engine.lm.tokenizer.pad_id(), Device::Cpu);
    let (nll, factors) = engine.capture(&batch).unwrap();
    assert!(nll.is_finite() && nll > 0.0);
    let real = batch.attention_mask.sum(Kind::Int64).int64_value(&[]);
    for f in &factors {
        assert_eq!(f.x.size()[0], f.delta.size()[0]);
        assert!(f.x.size()[0] <= real, "{} rows kept but only {real} real tokens", f.x.size()[0]);
        assert!(f.delta.abs().sum(Kind::Float).double_value(&[]) > 0.0);
    }
}

#[test]
fn running_stats_match_two_pass_statistics() {
    let engine = engine("gpt2");
    let ex = examples(&engine);
    let cfg = MendConfig { rank: 8, ..MendConfig::default() };
    let mut editor = Editor::new(&cfg, engine.edit_params.clone(), Device::Cpu, 0).unwrap();
    let mut xs = Vec::new();
    for e in &ex {
        let b = TokenBatch::collate(&[&e.inner], engine.lm.tokenizer.pad_id(), Device::Cpu);
        let (_, f) = engine.capture(&b).unwrap();
        let _ = editor.transform(0, &f[0], true);
        xs.push(f[0].x.shallow_clone());
    }
    let all = Tensor::cat(&xs, 0);
    let (stats, counts) = editor.named_stats();
    let stats: HashMap<String, Tensor> = stats.into_iter().collect();
    // Param 0 (h.0.mlp.c_fc) shares its editor with the other c_fc weights: key "64x256".
    let mean = &stats["stats.64x256.x.mean"];
    let m2 = &stats["stats.64x256.x.m2"];
    assert_eq!(counts["64x256.x"], all.size()[0] as f64);
    let ref_mean = all.mean_dim(0, false, Kind::Float);
    let ref_var = all.var_dim(0, true, false);
    assert!((mean - &ref_mean).abs().max().double_value(&[]) < 1e-5);
    let var = m2 / (all.size()[0] as f64 - 1.0);
    assert!((var - &ref_var).abs().max().double_value(&[]) < 1e-4);
    // Not updated outside training.
    let b = TokenBatch::collate(&[&ex[0].inner], engine.lm.tokenizer.pad_id(), Device::Cpu);
    let (_, f) = engine.capture(&b).unwrap();
    let _ = editor.transform(0, &f[0], false);
    assert_eq!(editor.named_stats().1["64x256.x"], all.size()[0] as f64);
}

fn target_logprob(engine: &Engine, overrides: &Overrides, e: &dualedit::data::Example) -> f64 {
    let b = TokenBatch::collate(&[e], engine.lm.tokenizer.pad_id(), Device::Cpu);
    let logits = if overrides.is_empty() { engine.base_logits(&b).unwrap() } else { engine.edited_logits(overrides, &b).unwrap() };
    -dualedit::mend::losses::nll(&logits, &b.kept_targets()).double_value(&[])
}

#[test]
fn training_raises_target_probability_and_checkpoint_round_trips() {
    training_raises_target_probability_and_round_trips(EditorMode::Combine);
}

#[test]
fn separate_editor_trains_and_round_trips() {
    training_raises_target_probability_and_round_trips(EditorMode::Separate);
}

fn training_raises_target_probability_and_round_trips(mode: EditorMode) {
    let engine = engine("gpt2");
    let ex = examples(&engine);
    let cfg = MendConfig { rank: 32, lr: 1e-3, edit_lr: 1e-3, mode, ..MendConfig::default() };
    let mut editor = seeded_editor(&engine, &cfg, 0);
    let (net, lrs) = editor.trainables();
    let mut adam = dualedit::mend::optim::Adam::new(vec![(cfg.lr, net), (cfg.lr_lr, lrs)]);
    let pad = engine.lm.tokenizer.pad_id();
    let mut first = None;
    let mut last = 0.0;
    for step in 0..40 {
        let e = &ex[step % ex.len()];
        let b = EditBatches::new(&[e], pad, Device::Cpu);
        let (loss, parts) = meta_loss(&engine, &mut editor, &b, true).unwrap();
        loss.backward();
        adam.step();
        adam.zero_grad();
        first.get_or_insert(parts.edit_nll);
        last = parts.edit_nll;
    }
    assert!(last < first.unwrap(), "{mode:?}: edit NLL did not fall: {first:?} -> {last}");
    // The trained editor raises the new target's probability on an edit.
    let _g = tch::no_grad_guard();
    let b = TokenBatch::collate(&[&ex[0].inner], pad, Device::Cpu);
    let (_, f) = engine.capture(&b).unwrap();
    let ov = engine.edit(&mut editor, &f, false).unwrap();
    let before = target_logprob(&engine, &Overrides::new(), &ex[0].inner);
    let after = target_logprob(&engine, &ov, &ex[0].inner);
    assert!(after > before + 0.1, "{mode:?}: log p(target) {before} -> {after}");

    // Round trip: a reloaded editor makes exactly the same edit.
    let dir = tempfile::tempdir().unwrap();
    checkpoint::save_editor(dir.path(), &editor, &engine, 40).unwrap();
    let (mut loaded, meta) = checkpoint::load_editor(dir.path(), &engine).unwrap();
    assert_eq!(meta.step, 40);
    let ov2 = engine.edit(&mut loaded, &f, false).unwrap();
    for (n, t) in ov.dense() {
        assert!((t - &ov2.dense()[n]).abs().max().double_value(&[]) < 1e-6, "{mode:?}: {n} differs after reload");
    }

    // An editor trained for another model is refused with a clear error.
    let other = self::engine("qwen2");
    let err = checkpoint::load_editor(dir.path(), &other).unwrap_err().to_string();
    assert!(err.contains("editor.safetensors") && err.contains("another model"), "{err}");
}

/// At initialisation (U = 0) every pre-activation of the first editor layer is exactly 0.
/// The reference code uses clamp(min = 0) there, whose gradient at 0 is 1, so that layer
/// learns; relu's gradient at 0 is 0 and would leave it dead for the whole training.
#[test]
fn every_editor_layer_gets_a_gradient_at_initialisation() {
    let engine = engine("gpt2");
    let ex = examples(&engine);
    // Two editors (c_fc and c_proj shapes) × MLPs per editor × two layers × (u, bias).
    for (mode, mlps) in [(EditorMode::Combine, 1), (EditorMode::Separate, 2)] {
        let cfg = MendConfig { rank: 16, n_hidden: 1, mode, ..MendConfig::default() };
        let mut editor = seeded_editor(&engine, &cfg, 0);
        let b = EditBatches::new(&[&ex[0]], engine.lm.tokenizer.pad_id(), Device::Cpu);
        let (loss, _) = meta_loss(&engine, &mut editor, &b, true).unwrap();
        loss.backward();
        let mut checked = 0;
        for (name, t) in editor.named_tensors() {
            if name.ends_with(".u") || name.ends_with(".bias") {
                let g = t.grad();
                assert!(g.defined() && g.abs().max().double_value(&[]) > 0.0, "{mode:?}: {name} got no gradient");
                checked += 1;
            }
        }
        assert_eq!(checked, 2 * mlps * 2 * 2, "{mode:?}");
    }
}

/// An edit outside training keeps each f32 weight's change factored (`x·W + (x·aᵀ)·b`):
/// it must score as the full `W'` does, on one device and across the split, and commit to
/// exactly that `W'`.
fn low_rank_edit_equals_dense(name: &str) {
    let mut engine = engine(name);
    let ex = examples(&engine);
    // Random U so the editor is not the identity; norm on, as trained editors are.
    let mut editor = seeded_editor(&engine, &MendConfig { rank: 16, ..MendConfig::default() }, 0);
    let _g = tch::no_grad_guard();
    dualedit::rng::torch_seeded(1, || {
        for (n, t) in editor.named_tensors() {
            if n.ends_with(".u") {
                t.detach().copy_(&(Tensor::randn_like(&t) * 0.05));
            }
        }
    });
    let _ = editor.edit_lrs.detach().fill_(0.3);
    let b = TokenBatch::collate(&[&ex[0].inner], engine.lm.tokenizer.pad_id(), Device::Cpu);
    let (_, f) = engine.capture(&b).unwrap();
    let dense = engine.edit(&mut editor, &f, false).unwrap();
    let low = engine.edit_low_rank(&mut editor, &f, false).unwrap();
    assert!(low.dense().is_empty(), "{name}: f32 weights stay factored");
    assert_eq!(low.names().count(), engine.edit_params.len());
    let probe = [&ex[0].inner, &ex[0].outer, &ex[1].inner];
    let batch = TokenBatch::collate(&probe, engine.lm.tokenizer.pad_id(), Device::Cpu);
    let want = engine.edited_logits(&dense, &batch).unwrap();
    let got = engine.edited_logits(&low, &batch).unwrap();
    let base = engine.base_logits(&batch).unwrap();
    let moved = (&want - &base).abs().max().double_value(&[]);
    assert!(moved > 1e-3, "{name}: the edit must change the logits ({moved})");
    let err = (&got - &want).abs().max().double_value(&[]);
    assert!(err < 1e-4 * (1.0 + moved), "{name}: low-rank vs dense logits differ by {err}");
    // Across the split only the factors travel, and the logits are the same.
    let lm = load_model(&fixture(name), Device::Cpu, Kind::Float).unwrap();
    let dual = Engine::new(lm, DevicePlan::split_on(Device::Cpu, Device::Cpu), &[]).unwrap();
    let split = dual.edited_logits(&low, &batch).unwrap();
    assert!((&split - &want).abs().max().double_value(&[]) < 1e-4 * (1.0 + moved), "{name}: split differs");
    let factor_bytes: i64 = f.iter().map(|f| f.x.numel() as i64 * 4 + f.delta.numel() as i64 * 4).sum();
    let edited_bytes: i64 = dual.edit_params.iter().map(|p| p.shape.iter().product::<i64>() * 4).sum();
    let carried = dual.mover.stats().bytes_to_sub as i64;
    assert!(carried < factor_bytes + 4096 && carried < edited_bytes, "{name}: carried {carried} bytes");
    // Committing writes the dense W'.
    engine.commit(&low).unwrap();
    for (n, w) in dense.dense() {
        let err = (engine.weight(n).unwrap() - w).abs().max().double_value(&[]);
        assert!(err < 1e-6, "{name}: committed {n} differs from W' by {err}");
    }
}

#[test]
fn low_rank_edit_equals_dense_conv1d() {
    low_rank_edit_equals_dense("gpt2");
}

#[test]
fn low_rank_edit_equals_dense_linear() {
    low_rank_edit_equals_dense("llama");
}

#[test]
fn dual_device_path_gives_the_same_losses() {
    let single = engine("gpt2");
    let lm = load_model(&fixture("gpt2"), Device::Cpu, Kind::Float).unwrap();
    let dual = Engine::new(lm, DevicePlan::split_on(Device::Cpu, Device::Cpu), &[]).unwrap();
    let ex = examples(&single);
    let cfg = MendConfig { rank: 16, lr: 1e-3, ..MendConfig::default() };
    let pad = single.lm.tokenizer.pad_id();
    let mut runs = Vec::new();
    let (a, b) = common::twin_editors(&cfg, &single.edit_params);
    for (engine, mut editor) in [(&single, a), (&dual, b)] {
        let (net, lrs) = editor.trainables();
        let mut adam = dualedit::mend::optim::Adam::new(vec![(cfg.lr, net), (cfg.lr_lr, lrs)]);
        let mut losses = Vec::new();
        for step in 0..6 {
            let b = EditBatches::new(&[&ex[step % ex.len()]], pad, Device::Cpu);
            let (loss, parts) = meta_loss(engine, &mut editor, &b, true).unwrap();
            loss.backward();
            adam.step();
            adam.zero_grad();
            losses.push(parts.loss);
        }
        runs.push(losses);
    }
    for (a, b) in runs[0].iter().zip(&runs[1]) {
        assert!((a - b).abs() <= 1e-5 * (1.0 + a.abs()), "single {a} vs dual {b}");
    }
    // Only the edit's factors and the batches went to the sub-device, never a weight; only
    // the scalar loss came back (the losses are computed where the logits are).
    let moved = dual.mover.stats();
    assert_eq!(single.mover.stats().transfers, 0);
    let edited_bytes: u64 = dual.edit_params.iter().map(|p| p.shape.iter().product::<i64>() as u64 * 4).sum();
    assert!(moved.bytes_to_sub > 0 && moved.bytes_to_main > 0);
    // Per step: the factors (lr·x̃, δ̃) of one edit, rows of (d_in + d_out) f32 for each
    // edited weight (outer and loc share one edited forward), plus small batches.
    let per_step = moved.bytes_to_sub as f64 / 6.0;
    let row_bytes: i64 = dual.edit_params.iter().map(|p| (p.in_out().0 + p.in_out().1) * 4).sum();
    let max_rows = ex.iter().map(|e| e.inner.ids.len()).max().unwrap() as f64;
    assert!(per_step < max_rows * row_bytes as f64 + 4096.0, "moved {per_step} bytes per step, factors of up to {max_rows} rows are {row_bytes} bytes a row");
    assert!(per_step < edited_bytes as f64 / 2.0, "moved {per_step} bytes per step, the edited weights are {edited_bytes}");
    assert_eq!(moved.bytes_to_main, 6 * 4, "one f32 loss per step comes back: {moved:?}");
}

#[test]
fn bad_training_inputs_are_clear_errors() {
    let engine = engine("gpt2");
    // A record missing a key names the index and the key.
    let err = parse_records(r#"[{"prompt": "a", "target_new": "b"}, {"prompt": "c"}]"#, Path::new("x.json"), DatasetKind::Counterfact)
        .unwrap_err()
        .to_string();
    assert!(err.contains("x.json") && err.contains("record 1") && err.contains("target_new"), "{err}");
    // Empty file.
    let err = parse_records("[]", Path::new("empty.json"), DatasetKind::Zsre).unwrap_err().to_string();
    assert!(err.contains("empty.json") && err.contains("no records"), "{err}");
    // Unknown dataset kind.
    assert!("squad".parse::<DatasetKind>().unwrap_err().to_string().contains("squad"));
    // Prompts longer than the model's context.
    let long = format!(r#"[{{"prompt": "{}", "target_new": "x"}}]"#, "word ".repeat(100));
    let (recs, _) = parse_records(&long, Path::new("long.json"), DatasetKind::Requests).unwrap();
    let err = prepare(&engine.lm.tokenizer, &recs, 64, Path::new("long.json")).unwrap_err().to_string();
    assert!(err.contains("long.json") && err.contains("record 0") && err.contains("longer than"), "{err}");
    // Impossible configs.
    for bad in [r#"{"rank": 0}"#, r#"{"lr": -1}"#, r#"{"accumulate": 0}"#, r#"{"rnak": 3}"#] {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("c.json");
        std::fs::write(&p, bad).unwrap();
        let err = MendConfig::from_file(&p).unwrap_err().to_string();
        assert!(err.contains("c.json"), "{bad}: {err}");
    }
    // Editing a weight that is not a linear layer.
    let lm = load_model(&fixture("gpt2"), Device::Cpu, Kind::Float).unwrap();
    let err = Engine::new(lm, DevicePlan::single(Device::Cpu), &["transformer.ln_f.weight".into()]).err().unwrap().to_string();
    assert!(err.contains("ln_f"), "{err}");
}

#[test]
fn forward_input_keeps_only_scored_positions() {
    let engine = engine("gpt2");
    let ex = examples(&engine);
    let b = TokenBatch::collate(&[&ex[0].inner, &ex[1].inner], engine.lm.tokenizer.pad_id(), Device::Cpu);
    let none = Default::default();
    let input: ForwardInput = b.forward_input(&none);
    let out = engine.lm.model.forward(&ParamView::frozen(&engine.lm.params), &input).unwrap();
    let n: i64 = (ex[0].inner.answer().len() + ex[1].inner.answer().len()) as i64;
    assert_eq!(out.logits.size()[0], n);
}

/// One editor pass over the rows of all weights that share an editor gives the same
/// pseudo-gradients as one pass per weight (per-row modes select each weight's scale/shift).
#[test]
fn grouped_editor_pass_equals_one_pass_per_weight() {
    for name in ["gpt2", "llama"] {
        let engine = engine(name);
        let ex = examples(&engine);
        let cfg = MendConfig { rank: 16, ..MendConfig::default() };
        let mut editor = seeded_editor(&engine, &cfg, 3);
        // Statistics from a few edits, and a non-identity network with distinct per-mode rows.
        for e in &ex {
            let b = TokenBatch::collate(&[&e.inner], engine.lm.tokenizer.pad_id(), Device::Cpu);
            let (_, f) = engine.capture(&b).unwrap();
            let _ = editor.pseudo_grads(&f, true);
        }
        perturb(&editor);
        let b = TokenBatch::collate(&[&ex[0].inner, &ex[1].inner], engine.lm.tokenizer.pad_id(), Device::Cpu);
        let (_, factors) = engine.capture(&b).unwrap();
        let grouped = editor.pseudo_grads(&factors, false);
        assert!(editor.params.len() > 2, "{name}: several weights share editors");
        for (i, g) in grouped.iter().enumerate() {
            let single = editor.pseudo_grad(i, &factors[i], false);
            let rel = (&single - g).norm().double_value(&[]) / single.norm().double_value(&[]);
            assert!(rel < 1e-5, "{name}: param {i}: relative difference {rel}");
        }
        // The edited weights (one fused GEMM each) are W − lr_i · pseudo-gradient.
        let weights: Vec<Tensor> = editor.params.iter().map(|p| engine.weight(&p.name).unwrap().shallow_clone()).collect();
        let refs: Vec<&Tensor> = weights.iter().collect();
        let edited = editor.edited_weights(&refs, &factors, false);
        for (i, (w2, g)) in edited.iter().zip(&grouped).enumerate() {
            let want = &weights[i] - g * editor.edit_lrs.get(i as i64);
            let rel = (&want - w2).norm().double_value(&[]) / (&want - &weights[i]).norm().double_value(&[]);
            assert!(rel < 1e-4, "{name}: edited weight {i}: relative difference {rel} of the update");
        }
    }
}

/// Batches leave out each example's last token (only ever a target); the scored logits
/// equal those of a forward over the whole text.
#[test]
fn collate_drops_only_the_unread_last_token() {
    let engine = engine("gpt2");
    let ex = examples(&engine);
    let e = &ex[0].inner;
    let b = TokenBatch::collate(&[e], engine.lm.tokenizer.pad_id(), Device::Cpu);
    assert_eq!(b.input_ids.size()[1] as usize, e.ids.len() - 1);
    let short = engine.base_logits(&b).unwrap();
    let ids = Tensor::from_slice(&e.ids).unsqueeze(0);
    let none = Default::default();
    let full = engine.lm.model.forward(&ParamView::frozen(&engine.lm.params), &ForwardInput::new(&ids, &none)).unwrap().logits;
    let scored = full.narrow(1, e.answer_start as i64 - 1, (e.ids.len() - e.answer_start) as i64).squeeze_dim(0);
    assert_eq!(short.size(), scored.size());
    assert!((&short - &scored).abs().max().double_value(&[]) < 1e-4);
}

/// A batch gives back the examples it was collated from (what `mend-ls` remembers of each
/// request): padding and the dropped last token are undone.
#[test]
fn a_batch_gives_back_its_examples() {
    let engine = engine("gpt2");
    let ex = examples(&engine);
    let inner: Vec<&Example> = ex.iter().map(|e| &e.inner).collect();
    assert!(inner.iter().any(|e| e.ids.len() != inner[0].ids.len()), "examples of different lengths pad the batch");
    let b = TokenBatch::collate(&inner, engine.lm.tokenizer.pad_id(), Device::Cpu);
    let back = b.examples().unwrap();
    assert_eq!(back.len(), inner.len());
    for (a, e) in back.iter().zip(&inner) {
        assert_eq!((&a.ids, a.answer_start), (&e.ids, e.answer_start));
    }
}

/// `inner_in_edit_loss` adds the edit prompts to what the edit loss scores.
#[test]
fn inner_in_edit_loss_scores_the_edit_prompt_too() {
    let engine = engine("gpt2");
    let ex = examples(&engine);
    let pad = engine.lm.tokenizer.pad_id();
    let cfg = MendConfig { rank: 16, inner_in_edit_loss: true, ..MendConfig::default() };
    let mut editor = Editor::new(&cfg, engine.edit_params.clone(), Device::Cpu, 0).unwrap();
    let with = EditBatches::for_config(&engine, &[&ex[0]], &cfg).unwrap();
    let without = EditBatches::new(&[&ex[0]], pad, Device::Cpu);
    assert_eq!(with.outer.batch_size(), 2);
    assert_eq!(without.outer.batch_size(), 1);
    let n_inner = with.inner.kept_targets().size()[0];
    assert_eq!(with.outer.kept_targets().size()[0], without.outer.kept_targets().size()[0] + n_inner);
    let (_, a) = meta_loss(&engine, &mut editor, &with, false).unwrap();
    let (_, b) = meta_loss(&engine, &mut editor, &without, false).unwrap();
    assert!(a.edit_nll.is_finite() && (a.edit_nll - b.edit_nll).abs() > 1e-6, "{a:?} vs {b:?}");
    assert!((a.loc_kl - b.loc_kl).abs() < 1e-5, "locality is scored the same way: {a:?} vs {b:?}");
}

/// Validation's locality accuracy is the locality metric `eval` reports for the same edits
/// (what `select_by: accuracy` ranks checkpoints by).
#[test]
fn validation_locality_accuracy_is_the_eval_metric() {
    let engine = engine("gpt2");
    let ex = examples(&engine);
    // Edits strong enough to move some locality predictions.
    let cfg = MendConfig { rank: 16, edit_lr: 30.0, ..MendConfig::default() };
    let mut editor = seeded_editor(&engine, &cfg, 1);
    let val = dualedit::mend::train::validate(&engine, &mut editor, &ex).unwrap();
    let recs = dualedit::edit::evaluate(&engine, &mut dualedit::edit::Mend(editor), &ex, &[], |_, _| {}).unwrap();
    let loc: Vec<f64> = recs.iter().map(|r| r.locality.unwrap()).collect();
    let mean = loc.iter().sum::<f64>() / loc.len() as f64;
    assert!((val.loc_acc - mean).abs() < 1e-9, "validation {} vs eval {mean} ({loc:?})", val.loc_acc);
    assert!(mean < 1.0, "the edits should change some locality predictions: {loc:?}");
}

/// The same seed gives the same editor while other threads build theirs: libtorch has one
/// generator per process, and CI once saw an editor whose init another test's draws had
/// changed (its run left its single-device twin after the first optimiser step).
#[test]
fn editor_init_depends_on_its_seed_alone() {
    let params = engine("gpt2").edit_params.clone();
    let cfg = MendConfig { rank: 16, ..MendConfig::default() };
    // Tensors cannot cross threads: compare the values.
    let init = |seed: i64| -> Vec<f32> {
        let (net, _) = Editor::new(&cfg, params.clone(), Device::Cpu, seed).unwrap().trainables();
        net.iter().flat_map(|t| Vec::<f32>::try_from(t.detach().flatten(0, -1)).unwrap()).collect()
    };
    let want: Vec<Vec<f32>> = (0..4).map(init).collect();
    assert_ne!(want[0], want[1], "seeds 0 and 1 gave the same editor");
    std::thread::scope(|s| {
        for seed in 0..4i64 {
            let (init, want) = (&init, &want);
            s.spawn(move || {
                for round in 0..25 {
                    let got = init(seed);
                    assert!(got == want[seed as usize], "seed {seed}, round {round}: another init");
                }
            });
        }
    });
}

/// A smooth deterministic pattern of `n` values (`f` of an arithmetic progression).
fn pattern(n: i64, phase: f64, f: fn(&Tensor) -> Tensor) -> Tensor {
    f(&(Tensor::arange(n, (Kind::Float, Device::Cpu)) * 0.37 + phase))
}

/// `rows` patterned gradient factors per edited weight (small δ, as a real capture's).
fn patterned_factors(params: &[dualedit::placed::EditedParam], rows: i64) -> Vec<dualedit::mend::Factors> {
    params
        .iter()
        .enumerate()
        .map(|(i, p)| {
            let (d_in, d_out) = p.in_out();
            dualedit::mend::Factors {
                x: pattern(rows * d_in, i as f64, Tensor::sin).reshape([rows, d_in]),
                delta: pattern(rows * d_out, i as f64, Tensor::cos).reshape([rows, d_out]) * 1e-3,
            }
        })
        .collect()
}

/// The editor's products above `EDITOR_SKINNY_ROWS` rows per pass are computed plainly
/// (`x·Vᵀ·Uᵀ`, #35), below transposed (`(U·(V·xᵀ))ᵀ`): the same transformed factors and
/// the same editor gradients as the path that always transposes (`skinny_rows = MAX`),
/// in training (the statistics updated alike). Rows per pass: 3 weights per shared editor.
#[test]
fn editor_plain_products_above_the_skinny_rows_match_the_transposed_ones() {
    use dualedit::mend::editor::EDITOR_SKINNY_ROWS;
    let params = engine("gpt2").edit_params.clone();
    let cfg = MendConfig { rank: 16, ..MendConfig::default() };
    for rows in [20i64, 70] {
        let (t0, g0) = terms_and_grads(&params, &cfg, rows, |ed| ed.skinny_rows = i64::MAX);
        let (t1, g1) = terms_and_grads(&params, &cfg, rows, |ed| ed.skinny_rows = EDITOR_SKINNY_ROWS);
        let what = format!("{rows} rows per weight ({} per pass, threshold {EDITOR_SKINNY_ROWS})", 3 * rows);
        assert_close(&t0, &t1, &g0, &g1, (1e-5, 1e-4), &what);
    }
    assert!(3 * 70 > EDITOR_SKINNY_ROWS && 3 * 20 <= EDITOR_SKINNY_ROWS, "the test must cover both paths");
}

/// #35: a bf16 model's editor on the CPU runs its `U`/`V` products in bf16 (`Editor::products_for`):
/// the transformed factors and the editor's gradients agree with the f32 products to
/// bf16's rounding, on both product paths, and the gradients stay f32 (the weights and
/// Adam state are f32). f32 and f16 models, and editors on CUDA, keep f32 products.
#[test]
fn editor_bf16_products_match_the_f32_ones_to_bf16_rounding() {
    assert_eq!(Editor::products_for(Kind::BFloat16, Device::Cpu), Kind::BFloat16);
    assert_eq!(Editor::products_for(Kind::BFloat16, Device::Cuda(0)), Kind::Float);
    assert_eq!(Editor::products_for(Kind::Float, Device::Cpu), Kind::Float);
    assert_eq!(Editor::products_for(Kind::Half, Device::Cpu), Kind::Float);
    let params = engine("gpt2").edit_params.clone();
    let cfg = MendConfig { rank: 16, ..MendConfig::default() };
    for rows in [20i64, 70] {
        let (t0, g0) = terms_and_grads(&params, &cfg, rows, |_| ());
        let (t1, g1) = terms_and_grads(&params, &cfg, rows, |ed| ed.product_kind = Kind::BFloat16);
        assert!(t1.iter().all(|t| t.kind() == Kind::Float) && g1.kind() == Kind::Float);
        // Exactly equal would mean the products were not rounded at all.
        assert!(t0.iter().zip(&t1).any(|(a, b)| (a - b).abs().max().double_value(&[]) > 0.0), "bf16 products changed nothing");
        assert_close(&t0, &t1, &g0, &g1, (2e-2, 5e-2), &format!("{rows} rows per weight, bf16 products"));
    }
}

/// One training pass of a patterned editor (every tensor moved off its init: U = 0 would
/// hide the products) over `rows` patterned factor rows per weight, set up by `setup`:
/// the edit terms and the editor's gradients of a patterned loss of them.
fn terms_and_grads(params: &[dualedit::placed::EditedParam], cfg: &MendConfig, rows: i64, setup: impl Fn(&mut Editor)) -> (Vec<Tensor>, Tensor) {
    let mut ed = Editor::new(cfg, params.to_vec(), Device::Cpu, 0).unwrap();
    setup(&mut ed);
    let (net, _) = ed.trainables();
    tch::no_grad(|| {
        for (i, t) in net.iter().enumerate() {
            let mut t = t.shallow_clone();
            let _ = t.g_add_(&(pattern(t.numel() as i64, i as f64, Tensor::sin).reshape(t.size()) * 0.05));
        }
    });
    let factors = patterned_factors(params, rows);
    let terms = ed.edit_terms(&factors, true);
    let loss = terms
        .iter()
        .enumerate()
        .map(|(i, (a, b))| (a * pattern(a.numel() as i64, 1.0 + i as f64, Tensor::cos).reshape(a.size())).sum(Kind::Float) + (b * pattern(b.numel() as i64, 2.0 + i as f64, Tensor::sin).reshape(b.size())).sum(Kind::Float))
        .fold(Tensor::zeros([], (Kind::Float, Device::Cpu)), |x, y| x + y);
    loss.backward();
    let out = terms.iter().flat_map(|(a, b)| [a.detach(), b.detach()]).collect();
    let grads: Vec<Tensor> = net.iter().filter(|t| t.grad().defined()).map(|t| t.grad().reshape([-1])).collect();
    (out, Tensor::cat(&grads, 0))
}

/// Terms and gradients of two [`terms_and_grads`] runs agree within `tol` (terms,
/// gradients) of their largest magnitude.
fn assert_close(t0: &[Tensor], t1: &[Tensor], g0: &Tensor, g1: &Tensor, tol: (f64, f64), what: &str) {
    for (a, b) in t0.iter().zip(t1) {
        let scale = a.abs().max().double_value(&[]);
        let diff = (a - b).abs().max().double_value(&[]);
        assert!(scale > 0.0 && diff <= tol.0 * scale, "{what}: transformed factors differ by {diff} (largest {scale})");
    }
    let scale = g0.abs().max().double_value(&[]);
    let diff = (g0 - g1).abs().max().double_value(&[]);
    assert!(scale > 0.0 && diff <= tol.1 * scale, "{what}: editor gradients differ by {diff} (largest {scale})");
}

/// #35: outside the autograd graph an editor layer whose rank is more than half its width
/// applies `U·V` as one product once the rows it has transformed would have paid for
/// forming it: a one-off edit stays factored, the next edits are dense and equal to the
/// factored ones up to rounding; training never forms it, and an in-place change of the
/// weights (an optimiser step) starts again from the factors, with the new weights.
#[test]
fn editor_dense_products_in_evaluation_match_the_factors() {
    let params = engine("gpt2").edit_params.clone();
    // MEND's default rank 1920 on the fixture's widths (320): rank = width, break-even 320 rows.
    let cfg = MendConfig::default();
    let perturb = |ed: &Editor, phase: f64| {
        let (net, _) = ed.trainables();
        tch::no_grad(|| {
            for (i, t) in net.iter().enumerate() {
                let mut t = t.shallow_clone();
                let _ = t.g_add_(&(pattern(t.numel() as i64, phase + i as f64, Tensor::sin).reshape(t.size()) * 0.05));
            }
        });
    };
    let rows = 60;
    let factors = patterned_factors(&params, rows);
    let close = |a: &[(Tensor, Tensor)], b: &[(Tensor, Tensor)], what: &str| {
        for ((a0, a1), (b0, b1)) in a.iter().zip(b) {
            for (x, y) in [(a0, b0), (a1, b1)] {
                let scale = x.abs().max().double_value(&[]);
                let diff = (x - y).abs().max().double_value(&[]);
                assert!(scale > 0.0 && diff <= 1e-5 * scale, "{what}: differs by {diff} (largest {scale})");
            }
        }
    };
    let mut ed = Editor::new(&cfg, params.clone(), Device::Cpu, 0).unwrap();
    perturb(&ed, 0.0);
    let _ = ed.edit_terms(&factors, true);
    let _ = ed.edit_terms(&factors, true);
    assert_eq!(ed.dense_products(), 0, "training keeps the factors (U and V need their gradients)");
    let _g = tch::no_grad_guard();
    let first = ed.edit_terms(&factors, false);
    assert_eq!(ed.dense_products(), 0, "180 rows per editor: below the break-even, factored");
    let second = ed.edit_terms(&factors, false);
    assert_eq!(ed.dense_products(), 4, "360 rows: both layers of both editors dense");
    close(&first, &second, "dense against factored");
    // An in-place change (as Adam's) starts again, from the new weights.
    perturb(&ed, 7.0);
    let mut fresh = Editor::new(&cfg, params.clone(), Device::Cpu, 1).unwrap();
    let mut saved: std::collections::BTreeMap<String, Tensor> = ed.named_tensors().into_iter().map(|(n, t)| (n, t.detach().copy())).collect();
    let (stats, counts) = ed.named_stats();
    saved.extend(stats);
    fresh.load_tensors(&saved, &counts).unwrap();
    let want = fresh.edit_terms(&factors, false);
    let third = ed.edit_terms(&factors, false);
    assert_eq!(ed.dense_products(), 0, "the weights changed: factored again");
    close(&want, &third, "after the change, factored");
    let fourth = ed.edit_terms(&factors, false);
    assert_eq!(ed.dense_products(), 4);
    close(&want, &fourth, "after the change, dense");
    assert!((&first[0].0 - &third[0].0).abs().max().double_value(&[]) > 1e-6, "the change must move the edit for the test to mean something");
    // bf16 products (a bf16 model): the dense product is formed again in bf16, and the
    // edits stay within bf16's rounding of the f32 ones.
    ed.product_kind = Kind::BFloat16;
    let fifth = ed.edit_terms(&factors, false);
    assert_eq!(ed.dense_products(), 4, "same weights, another dtype: formed again at once (it paid already)");
    for ((a, b), (c, d)) in want.iter().zip(&fifth) {
        for (x, y) in [(a, c), (b, d)] {
            let scale = x.abs().max().double_value(&[]);
            assert!((x - y).abs().max().double_value(&[]) <= 2e-2 * scale && y.kind() == Kind::Float);
        }
    }
}

/// A training edit's `neighbours` join its locality batch: the locality KL is the mean over
/// every locality position, so with one neighbour it is the position-weighted mean of the
/// edit's KL on its own prompt and on the neighbour alone (the same edit either way).
#[test]
fn neighbours_join_the_locality_loss_position_by_position() {
    let engine = engine("gpt2");
    let ex = examples(&engine);
    let cfg = MendConfig { rank: 16, ..MendConfig::default() };
    let mut editor = seeded_editor(&engine, &cfg, 0);
    perturb(&editor);
    let own = ex[0].clone();
    let other = ex.iter().find_map(|e| e.loc.clone().filter(|l| l.ids != own.loc.as_ref().unwrap().ids)).expect("a second locality prompt");
    let with = dualedit::data::EditExample { neighbours: vec![other.clone()], ..own.clone() };
    let alone = dualedit::data::EditExample { loc: Some(other.clone()), ..own.clone() };
    let mut kl = |e: &dualedit::data::EditExample| {
        let b = EditBatches::for_config(&engine, &[e], &cfg).unwrap();
        let rows = b.loc.as_ref().unwrap().batch_size();
        (meta_loss(&engine, &mut editor, &b, false).unwrap().1.loc_kl, rows)
    };
    let ((k_own, r_own), (k_other, _), (k_with, r_with)) = (kl(&own), kl(&alone), kl(&with));
    assert_eq!((r_own, r_with), (1, 2));
    let (p_own, p_other) = (own.loc.as_ref().unwrap().answer().len() as f64, other.answer().len() as f64);
    let expected = (p_own * k_own + p_other * k_other) / (p_own + p_other);
    assert!(k_own > 0.0 && k_other > 0.0, "{k_own} {k_other}");
    assert!((k_with - expected).abs() <= 1e-5 * expected.abs() + 1e-7, "{k_with} vs {expected} ({k_own}, {k_other})");
}
