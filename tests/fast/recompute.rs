//! `recompute`: the edited forwards keep only each block's input and recompute the blocks
//! in the backward. Losses and editor gradients must equal those of the ordinary
//! backward, on one device and on a split plan, for GPT-2 and LLaMA; the block-by-block
//! forward must equal the whole forward.
use crate::common;
use std::collections::{BTreeMap, HashSet};
use std::path::Path;

use common::{fixture, TRAIN_RECORDS};
use dualedit::config::MendConfig;
use dualedit::data::easyedit::{parse_records, DatasetKind};
use dualedit::data::examples::prepare;
use dualedit::data::EditExample;
use dualedit::device::DevicePlan;
use dualedit::mend::optim::Adam;
use dualedit::mend::Engine;
use dualedit::model::{load_model, BlockIo, ForwardInput, ParamView};
use dualedit::mend::train::{meta_loss, validate, EditBatches, StepLosses};
use tch::{Device, Kind, Tensor};

const TOL: f64 = 1e-5;

fn engine(name: &str, plan: DevicePlan, edit: &[&str]) -> Engine {
    let lm = load_model(&fixture(name), Device::Cpu, Kind::Float).unwrap();
    let edit: Vec<String> = edit.iter().map(|s| s.to_string()).collect();
    Engine::new(lm, plan, &edit).unwrap()
}

fn examples(engine: &Engine) -> Vec<EditExample> {
    let (recs, _) = parse_records(TRAIN_RECORDS, Path::new("inline.json"), DatasetKind::Counterfact).unwrap();
    prepare(&engine.lm.tokenizer, &recs, 64, Path::new("inline.json")).unwrap()
}

/// Per step: the losses, and every editor tensor's gradient (before the Adam step).
type Trace = Vec<(StepLosses, BTreeMap<String, Tensor>)>;

/// A few meta-training steps (batches of 2 padded examples, Adam after each) from seed 7,
/// without recompute on `plain` and with it on `recomputed`, in lockstep: both editors
/// start equal and both take the step of the ordinary gradient, so they stay equal and
/// each step compares the two gradients at the same point. (Two free-running trajectories
/// drift apart at the 1e-5 level after a step or two: Adam moves every parameter by about
/// its learning rate whatever the gradient's size, so the rounding noise in gradients that
/// are ~0, such as a bias at the identity start, becomes a real difference.)
fn lockstep(plain: &Engine, recomputed: &Engine, steps: usize) -> (Trace, Trace) {
    let ex = examples(plain);
    let pad = plain.lm.tokenizer.pad_id();
    let mut sides = Vec::new();
    let cfg = |recompute| MendConfig { rank: 16, lr: 1e-3, edit_lr: 1e-2, lr_lr: 1e-3, recompute, ..MendConfig::default() };
    let (a, mut b) = common::twin_editors(&cfg(false), &plain.edit_params);
    b.config = cfg(true);
    for editor in [a, b] {
        let cfg = editor.config.clone();
        let (net, lrs) = editor.trainables();
        let adam = Adam::new(vec![(cfg.lr, net), (cfg.lr_lr, lrs)]);
        sides.push((editor, adam, Trace::new()));
    }
    for step in 0..steps {
        let group = [&ex[(2 * step) % ex.len()], &ex[(2 * step + 1) % ex.len()]];
        let b = EditBatches::new(&group, pad, Device::Cpu);
        for (engine, (editor, _, trace)) in [plain, recomputed].into_iter().zip(sides.iter_mut()) {
            let (loss, parts) = meta_loss(engine, editor, &b, true).unwrap();
            assert!((loss.double_value(&[]) - parts.loss).abs() <= 1e-6 * (1.0 + parts.loss.abs()), "the tensor carries the loss");
            // Accumulation divides by the micro-batch count (3: not a power of two, so
            // the two paths' scaling is not exact).
            (loss / 3.0).backward();
            let grads = editor.named_tensors().into_iter().map(|(n, t)| (n, t.grad().copy())).collect();
            trace.push((parts, grads));
        }
        let plain_grads = &sides[0].2[step].1;
        let _g = tch::no_grad_guard();
        for (n, t) in sides[1].0.named_tensors() {
            t.grad().copy_(&plain_grads[&n]);
        }
        for (_, adam, _) in sides.iter_mut() {
            adam.step();
            adam.zero_grad();
        }
    }
    // Validation (no grad) takes the ordinary path either way and must agree too.
    for (engine, (editor, _, trace)) in [plain, recomputed].into_iter().zip(sides.iter_mut()) {
        let val = validate(engine, editor, &ex[..2]).unwrap();
        trace.push((StepLosses { loss: val.loss, edit_nll: 0.0, loc_kl: val.loc_kl, edit_acc: val.edit_acc, loc_acc: val.loc_acc, ..Default::default() }, BTreeMap::new()));
    }
    let mut traces = sides.into_iter().map(|(_, _, t)| t);
    (traces.next().unwrap(), traces.next().unwrap())
}

/// Absolute slack on top of the relative `TOL`. The locality KL is small (~0.01 nats) but
/// summed from log-probabilities of order 1, so f32 rounding and the thread-dependent
/// order of libtorch's reductions move it by ~1e-7 absolute: ~1e-5 of its own size.
const ABS_TOL: f64 = 1e-6;

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() <= TOL * a.abs().max(b.abs()) + ABS_TOL
}

fn assert_same(what: &str, plain: &Trace, recomputed: &Trace) {
    assert_eq!(plain.len(), recomputed.len());
    let mut worst = (0.0f64, 0.0f64);
    for (step, ((lp, gp), (lr, gr))) in plain.iter().zip(recomputed).enumerate() {
        for ((name, a), (_, b)) in common::loss_parts(lp).into_iter().zip(common::loss_parts(lr)) {
            assert!(close(a, b), "{what} step {step}: {name} {a} without recompute, {b} with");
            worst.0 = worst.0.max((a - b).abs() / a.abs().max(1e-12));
        }
        assert!(lp.loss > 0.0 && lp.loc_kl.is_finite());
        assert_eq!(gp.len(), gr.len());
        if gp.is_empty() {
            continue; // validation
        }
        // Per parameter group (the editor network, the edit learning rates: each has its
        // own Adam), as one vector: single entries whose gradient is ~0 (a bias at the
        // identity start) differ by rounding noise only.
        for group in ["editor.", "edit_lrs"] {
            let pick = |g: &BTreeMap<String, Tensor>| -> Tensor {
                Tensor::cat(&g.iter().filter(|(n, _)| n.starts_with(group)).map(|(_, t)| t.reshape([-1])).collect::<Vec<_>>(), 0)
            };
            let (a, b) = (pick(gp), pick(gr));
            let (na, diff) = (a.norm().double_value(&[]), (&a - &b).norm().double_value(&[]));
            worst.1 = worst.1.max(diff / na.max(1e-12));
            assert!(diff <= TOL * na, "{what} step {step}: gradient of {group}: |a|={na}, |a-b|={diff}");
        }
    }
    eprintln!("{what}: largest relative difference: losses {:.1e}, gradients {:.1e}", worst.0, worst.1);
    // The editor learned something: some gradient is non-zero after the first step.
    assert!(plain[1].1.values().any(|g| g.norm().double_value(&[]) > 0.0));
}

#[test]
fn gpt2_losses_and_gradients_equal_without_recompute() {
    let e = engine("gpt2", DevicePlan::single(Device::Cpu), &[]);
    let (plain, recomputed) = lockstep(&e, &e, 4);
    assert_same("gpt2", &plain, &recomputed);
}

#[test]
fn llama_losses_and_gradients_equal_without_recompute() {
    // Blocks 1 and 2 only, attention weights too: block 0 runs without grad, the
    // recomputed blocks carry the gradient through attention with GQA and RoPE.
    let edit = ["model.layers.1.self_attn.q_proj.weight", "model.layers.1.mlp.up_proj.weight", "model.layers.2.mlp.down_proj.weight"];
    let e = engine("llama", DevicePlan::single(Device::Cpu), &edit);
    let (plain, recomputed) = lockstep(&e, &e, 4);
    assert_same("llama", &plain, &recomputed);
}

#[test]
fn split_plan_with_recompute_equals_single_device_without() {
    let split = DevicePlan::split_on(Device::Cpu, Device::Cpu);
    for (name, edit) in [("gpt2", vec!["transformer.h.1.attn.c_proj.weight", "transformer.h.2.mlp.c_fc.weight"]), ("llama", vec![])] {
        let single = engine(name, DevicePlan::single(Device::Cpu), &edit);
        let dual = engine(name, split, &edit);
        let before = dual.mover.stats();
        let (plain, recomputed) = lockstep(&single, &dual, 3);
        let moved = dual.mover.stats();
        assert_same(&format!("{name} split"), &plain, &recomputed);
        // W' went to the sub-device and its gradients came back through the mover.
        let w_bytes: u64 = dual.edit_params.iter().map(|p| 4 * p.shape.iter().product::<i64>() as u64).sum();
        assert!(moved.bytes_to_sub - before.bytes_to_sub >= 2 * w_bytes, "{moved:?}");
        assert!(moved.bytes_to_main - before.bytes_to_main >= 2 * w_bytes, "{moved:?}");
    }
}

#[test]
fn blocks_one_at_a_time_equal_the_forward() {
    for name in ["gpt2", "llama", "qwen2"] {
        let e = engine(name, DevicePlan::single(Device::Cpu), &[]);
        let ex = examples(&e);
        let b = EditBatches::new(&[&ex[0], &ex[3]], e.lm.tokenizer.pad_id(), Device::Cpu);
        let capture: HashSet<String> = e.edit_names().into_iter().collect();
        // The last block at every row here (by default it runs at the kept rows only: below).
        let input = ForwardInput {
            attention_mask: Some(&b.outer.attention_mask),
            keep: Some(&b.outer.keep),
            full_last_block: true,
            ..ForwardInput::new(&b.outer.input_ids, &capture)
        };
        let p = ParamView::frozen(&e.lm.params);
        let _g = tch::no_grad_guard();
        let whole = e.lm.model.forward(&p, &input).unwrap();
        let (mut x, ctx) = e.lm.model.embed(&p, &input, 0).unwrap();
        let mut captures = BTreeMap::new();
        for i in 0..e.lm.model.n_blocks() {
            x = e.lm.model.block(BlockIo { params: &p, layer: i, x: &x, ctx: &ctx, capture: &capture, captures: &mut captures, cache: None, rows: None }).unwrap();
        }
        let logits = e.lm.model.head(&p, &x, input.keep).unwrap();
        assert!(logits.equal(&whole.logits), "{name}: logits differ");
        assert_eq!(captures.len(), whole.captures.len());
        for (n, c) in &whole.captures {
            assert!(c.h.equal(&captures[n].h) && c.x.equal(&captures[n].x), "{name}: capture {n} differs");
        }
        // By default the last block runs at the kept rows: the same blocks with
        // `BlockIo::rows` for the last one, and the head over its kept rows.
        let input = ForwardInput { full_last_block: false, ..input };
        let at_kept = e.lm.model.forward(&p, &input).unwrap();
        let rows = dualedit::model::QueryRows::from_keep(&b.outer.keep).unwrap().expect("fewer kept rows than tokens");
        let (mut x, ctx) = e.lm.model.embed(&p, &input, 0).unwrap();
        let mut captures = BTreeMap::new();
        let n = e.lm.model.n_blocks();
        for i in 0..n {
            let r = (i + 1 == n).then_some(&rows);
            x = e.lm.model.block(BlockIo { params: &p, layer: i, x: &x, ctx: &ctx, capture: &capture, captures: &mut captures, cache: None, rows: r }).unwrap();
        }
        let d = x.size()[2];
        let hidden = e.lm.model.final_norm(&p, &x).unwrap().reshape([-1, d]).index_select(0, &rows.kept);
        let logits = dualedit::model::lm_head(&hidden, e.lm.model.head_weight(&p).unwrap());
        assert!(logits.equal(&at_kept.logits), "{name}: logits at the kept rows differ");
        assert!((&logits - &whole.logits).abs().max().double_value(&[]) < 1e-4, "{name}: the kept rows' logits are not the whole block's");
        for (n, c) in &at_kept.captures {
            assert!(c.h.equal(&captures[n].h) && c.x.equal(&captures[n].x), "{name}: capture {n} differs");
        }
        assert_eq!(e.lm.model.block_of(&e.edit_names()[0]), Some(e.lm.model.n_blocks() - 3));
        assert_eq!(e.lm.model.block_of("lm_head.weight"), None);
    }
}

#[test]
fn recompute_refuses_weights_outside_the_blocks() {
    let e = engine("gpt2", DevicePlan::single(Device::Cpu), &[]);
    let ex = examples(&e);
    let b = EditBatches::new(&[&ex[0]], e.lm.tokenizer.pad_id(), Device::Cpu);
    let none = HashSet::new();
    let w = e.lm.params.get("transformer.wte.weight").unwrap().detach().set_requires_grad(true);
    let ov = [("transformer.wte.weight".to_string(), w)].into_iter().collect();
    let p = ParamView::new(&e.lm.params, Some(&ov));
    let wrt = ["transformer.wte.weight".to_string()];
    let mut grads = vec![None];
    let err = dualedit::model::recompute::grad_by_blocks(&e.lm.model, &p, &b.outer.forward_input(&none), &wrt, &mut grads, |l| Ok(l.sum(Kind::Float)))
        .unwrap_err()
        .to_string();
    assert!(err.contains("transformer.wte.weight") && err.contains("block"), "{err}");
}

#[test]
fn train_command_takes_recompute() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("cf.json");
    std::fs::write(&data, TRAIN_RECORDS).unwrap();
    let cfg = dir.path().join("cfg.json");
    std::fs::write(&cfg, r#"{"rank": 8, "accumulate": 1, "max_steps": 2, "val_every": 2, "val_records": 1, "max_length": 64}"#).unwrap();
    let out = dir.path().join("ed");
    let status = common::dualedit_cmd()
        .args(["train", "--model", fixture("gpt2").to_str().unwrap(), "--data", data.to_str().unwrap(), "--ds", "counterfact"])
        .args(["--config", cfg.to_str().unwrap(), "--out", out.to_str().unwrap(), "--recompute"])
        .env("OMP_NUM_THREADS", "1")
        .output()
        .unwrap();
    assert!(status.status.success(), "{}", String::from_utf8_lossy(&status.stderr));
    let meta: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(out.join("editor.json")).unwrap()).unwrap();
    assert_eq!(meta["config"]["recompute"], true, "{meta}");
}
