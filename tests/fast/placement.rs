//! Placements on a CPU-only machine (#23): the layer split (`--placement balanced`) and the
//! optimiser offload (`--optimizer-device`) run their cross-device code paths on one CPU
//! through the mover ([`DevicePlan::split_on`]) and must give the single-device run's
//! losses and metrics; the mover's byte counter shows what crosses.
use crate::common;
use common::{fixture, TRAIN_RECORDS};

use dualedit::run::compare::{compare_eval, compare_train, Comparison};
use dualedit::config::MendConfig;
use dualedit::data::{DatasetKind, EditExample, Example};
use dualedit::device::{DevicePlan, OptimizerDevice, Placement};
use dualedit::edit::MethodSpec;
use dualedit::mend::{Editor, Engine};
use dualedit::model::load_model;
use dualedit::run::{Common, EvalOptions, TrainOptions};
use dualedit::mend::train::{meta_loss, EditBatches, StepLosses};
use tch::{Device, Kind};

/// The last block's MLP of a 3-block fixture: the layer split can put block 0 on main.
fn last_mlp(model: &str) -> Vec<String> {
    match model {
        "gpt2" => vec!["transformer.h.2.mlp.c_fc.weight".into(), "transformer.h.2.mlp.c_proj.weight".into()],
        _ => vec!["model.layers.2.mlp.up_proj.weight".into(), "model.layers.2.mlp.down_proj.weight".into()],
    }
}

fn config(model: &str, recompute: bool) -> MendConfig {
    MendConfig {
        rank: 16,
        lr: 1e-3,
        edit_lr: 1e-3,
        accumulate: 2,
        max_steps: 4,
        val_every: 2,
        val_records: 1,
        max_length: 64,
        recompute,
        edit_params: last_mlp(model),
        ..MendConfig::default()
    }
}

/// Evaluation of `opts`'s data (CounterFact, 64 tokens) with the editor trained at
/// `editor`, its report at `report`.
fn eval_options(opts: &TrainOptions, report: std::path::PathBuf, editor: std::path::PathBuf) -> EvalOptions {
    EvalOptions {
        common: Common { report: Some(report), ..opts.common.clone() },
        method: MethodSpec::Mend { editor },
        data: opts.data.clone(),
        ds: DatasetKind::Counterfact,
        limit: None,
        max_length: 64,
        capacity: None,
    }
}

fn train_options(dir: &std::path::Path, model: &str, cfg: MendConfig, name: &str) -> TrainOptions {
    let data = dir.join("cf.json");
    std::fs::write(&data, TRAIN_RECORDS).unwrap();
    TrainOptions {
        common: Common { seed: 3, ..Common::single(fixture(model), Device::Cpu) },
        data,
        ds: DatasetKind::Counterfact,
        config: cfg,
        out: dir.join(name),
        limit: None,
        resume: false,
        init: None,
        progress: false,
    }
}

fn assert_agree(c: &Comparison, what: &str) {
    assert!(!c.single.metrics.is_empty());
    for (k, a) in &c.single.metrics {
        let b = c.dual.metrics[k];
        assert!((a - b).abs() <= 1e-5 * (1.0 + a.abs()) + 1e-6, "{what}: {k}: single {a} vs placed {b}");
    }
}

/// A text example: `ids` with its last `kept` tokens labelled.
fn ex(ids: &[i64], kept: usize) -> Example {
    Example { ids: ids.to_vec(), answer_start: ids.len() - kept, image: None }
}

/// One meta-training micro-step (loss and backward) on a fixed rephrased example with a
/// locality prompt: the editor (with its gradients) and the mover's counters after it.
fn one_meta_step(engine: &Engine, cfg: &MendConfig) -> (Editor, dualedit::device::MoverStats) {
    let mut editor = Editor::new(cfg, engine.edit_params.clone(), Device::Cpu, 0).unwrap();
    let example = EditExample {
        inner: ex(&[5, 6, 7, 8, 9, 10], 2),
        outer: ex(&[11, 12, 7, 8, 9, 10], 2),
        rephrased: true,
        loc: Some(ex(&[20, 21, 22, 23, 24], 3)),
        portability: Vec::new(),
        outer_image: None,
        loc_image: None,
        neighbours: Vec::new(),
    };
    let b = EditBatches::for_config(engine, &[&example], cfg).unwrap();
    let (loss, _) = meta_loss(engine, &mut editor, &b, true).unwrap();
    loss.backward();
    (editor, engine.mover.stats())
}

fn balanced(at: usize) -> DevicePlan {
    DevicePlan::split_on(Device::Cpu, Device::Cpu).balanced(at).unwrap()
}

#[test]
fn layer_split_trains_and_evaluates_as_one_device() {
    let dir = tempfile::tempdir().unwrap();
    // GPT-2 (tied head: its copy on sub) and LLaMA (rotary tables cross with the hidden state).
    for model in ["gpt2", "llama"] {
        let opts = train_options(dir.path(), model, config(model, false), &format!("{model}-train"));
        let c = compare_train(&opts, balanced(1)).unwrap();
        assert_agree(&c, &format!("{model} train, layer split at block 1"));
        let report: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&c.dual.report).unwrap()).unwrap();
        assert_eq!(report["devices"]["placement"], "balanced", "{report}");
        assert_eq!(report["devices"]["boundary"], 1);
        // The timeline: every phase of the first steps, on the device it ran on.
        let tl = &report["metrics"]["timeline"];
        let phases: std::collections::BTreeSet<String> = tl["spans"]
            .as_array()
            .unwrap()
            .iter()
            .map(|s| format!("{}/{}", s["device"].as_str().unwrap(), s["phase"].as_str().unwrap()))
            .collect();
        for p in ["main/prefix", "sub/capture", "main/editor", "sub/unedited forwards", "sub/edited forwards", "sub/backward", "main/optimiser"] {
            assert!(phases.contains(p), "{p} missing from {phases:?}");
        }
        let sum = &tl["summary"];
        assert_eq!(sum["steps"], 3, "{sum}");
        let (wall, overlap) = (sum["wall_s"].as_f64().unwrap(), sum["overlap_s"].as_f64().unwrap());
        for dev in ["main", "sub"] {
            let busy = sum["busy_s"][dev].as_f64().unwrap();
            assert!(busy > 0.0 && busy <= wall + 1e-9, "{sum}");
        }
        assert!(overlap >= 0.0 && overlap <= wall, "{sum}");
        assert!(sum["text"].as_str().unwrap().contains("overlap"), "{sum}");
        // One device: everything on main, nothing overlaps.
        let single: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&c.single.report).unwrap()).unwrap();
        let sum = &single["metrics"]["timeline"]["summary"];
        assert_eq!(sum["busy_s"].as_object().unwrap().keys().collect::<Vec<_>>(), ["main"], "{sum}");
        assert_eq!(sum["overlap_s"].as_f64().unwrap(), 0.0);
        if model == "gpt2" {
            // Evaluation with the editor trained above, split at block 0 (embedding alone on main).
            let eval = eval_options(&opts, dir.path().join("eval.json"), dir.path().join("gpt2-train/single"));
            let c = compare_eval(&eval, balanced(0), dir.path()).unwrap();
            assert_agree(&c, "gpt2 eval, layer split at block 0");
        }
    }
}

#[test]
fn recomputed_layer_split_with_offloaded_optimizer_matches() {
    let dir = tempfile::tempdir().unwrap();
    let opts = train_options(dir.path(), "gpt2", config("gpt2", true), "rc");
    let plan = balanced(2).with_optimizer(OptimizerDevice::Sub);
    let c = compare_train(&opts, plan).unwrap();
    assert_agree(&c, "recompute, layer split at block 2, optimiser on sub");
}

/// ZeRO-Offload-style optimiser state on the default placement: the same losses; the
/// report counts the gradients out and the updates back.
#[test]
fn offloaded_optimizer_matches_the_default_placement() {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = config("gpt2", false);
    cfg.edit_params.clear(); // MEND's default: the last three MLPs
    let opts = train_options(dir.path(), "gpt2", cfg, "opt");
    let plan = DevicePlan::single(Device::Cpu).with_optimizer(OptimizerDevice::Cpu);
    let c = compare_train(&opts, plan).unwrap();
    assert_agree(&c, "optimiser offloaded to the CPU");
    let train_report = |side: &str| -> serde_json::Value {
        let text = std::fs::read_to_string(dir.path().join("opt").join(side).join("report.json")).unwrap();
        serde_json::from_str(&text).unwrap()
    };
    let (single, offloaded) = (train_report("single"), train_report("dual"));
    assert_eq!(single["metrics"]["optimizer_bytes_moved"], 0, "{single}");
    let params = offloaded["metrics"]["editor_parameters"].as_u64().unwrap();
    let steps = offloaded["metrics"]["steps"].as_u64().unwrap();
    // Every editor tensor has a gradient each step: 4 bytes out, 4 back per parameter.
    assert_eq!(offloaded["metrics"]["optimizer_bytes_moved"].as_u64().unwrap(), steps * params * 8, "{offloaded}");
}

/// The fixture `family` placed by `plan` for an editor of `config(family, false)`, with its
/// model and each parameter's element count (what the mover's byte counts are checked
/// against).
fn placed(family: &str, plan: DevicePlan) -> (Engine, dualedit::model::Model, std::collections::HashMap<String, i64>, MendConfig) {
    let lm = load_model(&fixture(family), Device::Cpu, Kind::Float).unwrap();
    let model = lm.model.clone();
    let sizes = model.expected_params().into_iter().map(|(n, s)| (n, s.iter().product::<i64>())).collect();
    let cfg = config(family, false);
    let engine = Engine::new(lm, plan, &cfg.edit_params).unwrap();
    (engine, model, sizes, cfg)
}

/// What crosses the mover under the layer split: the sub-side weights once at setup, then
/// per micro-step only activations, factors and targets: never a frozen weight.
#[test]
fn layer_split_moves_weights_once_then_only_activations() {
    let (engine, model, sizes, cfg) = placed("gpt2", balanced(1));
    assert!(engine.layer_split());
    let setup = engine.mover.stats();
    // Blocks 1 and 2, ln_f, and the tied embedding's copy for the head.
    let (on_sub, tied) = model.sub_side_params(1);
    assert_eq!(tied, Some("transformer.wte.weight"));
    assert!(on_sub.iter().any(|n| n.starts_with("transformer.h.1.")) && !on_sub.iter().any(|n| n.starts_with("transformer.h.0.")));
    assert!(on_sub.contains(&"transformer.ln_f.weight".to_string()));
    let expected: i64 = on_sub.iter().map(|n| sizes[n]).sum::<i64>() + sizes["transformer.wte.weight"];
    assert_eq!(setup.bytes_to_sub, expected as u64 * 4);
    assert_eq!(setup.bytes_to_main, 0);

    let (editor, step) = one_meta_step(&engine, &cfg);
    let to_sub = step.bytes_to_sub - setup.bytes_to_sub;
    let to_main = step.bytes_to_main - setup.bytes_to_main;
    // The hidden states at the boundary, [B, T, 64] f32, once per batch: the capture's
    // (5 input tokens: an example's last token is only a target) and those of the edited
    // forward over rephrase + locality (2 × 5); the unedited locality forward starts from
    // its rows of the latter and crosses nothing (before: 3 crossings, (5 + 2 × 5 + 4) × d).
    let d = 64 * 4;
    let boundary = (5 + 2 * 5) * d;
    assert_eq!(step.boundary_crossings - setup.boundary_crossings, 2, "{step:?}");
    assert_eq!(step.boundary_bytes - setup.boundary_bytes, boundary as u64, "{step:?}");
    assert!(to_sub >= boundary as u64, "{to_sub} bytes to sub, boundary activations alone are {boundary}");
    // No frozen weight crossed: less than the smallest matrix of a block.
    let smallest = on_sub.iter().filter(|n| n.ends_with(".weight") && !n.contains("ln_")).map(|n| sizes[n]).min().unwrap() as u64 * 4;
    assert!(to_sub < smallest, "{to_sub} bytes to sub per micro-step, a frozen matrix is {smallest}");
    // Back: the factors for the editor (x and δ of 2 weights, ≤ 6 rows) and the loss.
    assert!(to_main > 0 && to_main < smallest, "{to_main} bytes to main");
    // The edited weights' gradients exist on the editor: the backward crossed back.
    let (net, _) = editor.trainables();
    assert!(net.iter().any(|t| t.grad().defined()));
}

/// With recomputation every scored view is a pass of its own (rephrase, locality) and the
/// locality batch is also forwarded unedited: still one crossing per batch, and the
/// meta-loss and the editor's gradients equal the single-device run's with the views'
/// boundaries cut from the edited batch's or computed for each batch.
#[test]
fn recomputed_passes_share_one_boundary_per_batch() {
    let dir = fixture("gpt2");
    let mut cfg = config("gpt2", true);
    cfg.edit_params = vec!["transformer.h.1.mlp.c_fc.weight".into(), "transformer.h.2.mlp.c_proj.weight".into()];
    let example = EditExample {
        inner: ex(&[5, 6, 7, 8, 9, 10], 2),
        outer: ex(&[11, 12, 7, 8, 9, 10, 3], 3),
        rephrased: true,
        loc: Some(ex(&[20, 21, 22, 23, 24], 3)),
        portability: Vec::new(),
        outer_image: None,
        loc_image: None,
        neighbours: Vec::new(),
    };
    let run = |plan: DevicePlan, share: bool| {
        let engine = Engine::new(load_model(&dir, Device::Cpu, Kind::Float).unwrap(), plan, &cfg.edit_params).unwrap();
        let mut editor = Editor::new(&cfg, engine.edit_params.clone(), Device::Cpu, 0).unwrap();
        let before = engine.mover.stats();
        let b = if share {
            EditBatches::for_config(&engine, &[&example], &cfg).unwrap()
        } else {
            EditBatches::new(&[&example], 0, Device::Cpu)
        };
        let (loss, parts) = meta_loss(&engine, &mut editor, &b, true).unwrap();
        loss.backward();
        let after = engine.mover.stats();
        let (net, _) = editor.trainables();
        let grad: f64 = net.iter().filter(|t| t.grad().defined()).map(|t| t.grad().square().sum(Kind::Double).double_value(&[])).sum();
        (parts.loss, grad, after.boundary_crossings - before.boundary_crossings, after.boundary_bytes - before.boundary_bytes)
    };
    let (single_loss, single_grad, n, _) = run(DevicePlan::single(Device::Cpu), true);
    assert_eq!(n, 0);
    let (loss, grad, crossings, bytes) = run(balanced(1), true);
    // Inner (5 input tokens) and rephrase + locality (2 × 6), each once.
    assert_eq!((crossings, bytes), (2, (5 + 2 * 6) * 64 * 4));
    // Batches not cut from the edited one (`EditBatches::new`): each crosses once (inner,
    // rephrase, locality), the locality's unedited forward and its pass sharing one.
    let (unshared_loss, unshared_grad, crossings, _) = run(balanced(1), false);
    assert_eq!(crossings, 3);
    for (what, l, g) in [("shared", loss, grad), ("unshared", unshared_loss, unshared_grad)] {
        assert!((l - single_loss).abs() <= 1e-5 * (1.0 + single_loss.abs()), "{what}: loss {l} vs single {single_loss}");
        assert!((g - single_grad).abs() <= 1e-4 * (1.0 + single_grad.abs()), "{what}: |grad|² {g} vs single {single_grad}");
    }
    assert!(single_grad > 0.0);
}

#[test]
fn layer_split_refuses_bad_boundaries() {
    let lm = load_model(&fixture("gpt2"), Device::Cpu, Kind::Float).unwrap();
    // Above the first edited block (block 2): the blocks needing gradients would be on main.
    let err = Engine::new(lm, balanced(3), &last_mlp("gpt2")).err().unwrap().to_string();
    assert!(err.contains("at most the first edited block"), "{err}");
    let err = DevicePlan::single(Device::Cpu).balanced(1).unwrap_err().to_string();
    assert!(err.contains("`sub_device`"), "{err}");
    assert_eq!(balanced(1).placement, Placement::Balanced);
}

/// Two ways of computing one meta-training step agree: its loss parts within 1e-5, the
/// editor's gradients within 1e-4 of their largest; and the edit moved the locality logits
/// (else the comparison would mean nothing).
fn assert_same_step(what: &str, (a_is, b_is): (&str, &str), (p0, g0): (&StepLosses, &tch::Tensor), (p1, g1): (&StepLosses, &tch::Tensor)) {
    for ((k, a), (_, b)) in common::loss_parts(p0).into_iter().zip(common::loss_parts(p1)) {
        assert!((a - b).abs() <= 1e-5 * (1.0 + a.abs()) + 1e-7, "{what}: {k}: {a_is} {a}, {b_is} {b}");
    }
    assert!(p0.loc_kl > 0.0, "{what}: the edit must move the locality logits for the test to mean something");
    let scale = g0.abs().max().double_value(&[]);
    let diff = (g0 - g1).abs().max().double_value(&[]);
    assert!(scale > 0.0 && diff <= 1e-4 * scale, "{what}: editor gradients differ by {diff} (largest {scale})");
}

/// An edit of 2 answer tokens after 4, a rephrase and a locality prompt (no images).
fn six_token_example() -> EditExample {
    EditExample {
        inner: ex(&[5, 6, 7, 8, 9, 10], 2),
        outer: ex(&[11, 12, 7, 8, 9, 10, 3], 3),
        rephrased: true,
        loc: Some(ex(&[20, 21, 22, 23], 2)),
        portability: Vec::new(),
        outer_image: None,
        loc_image: None,
        neighbours: Vec::new(),
    }
}

/// The prefix once per batch in every placement (#35): with an editor of block 2 only,
/// every forward of a batch (capture, unedited locality, edited views, recomputed passes)
/// starts at block 2 from activations computed once, and the meta-loss, its parts and the
/// editor's gradients equal those of forwards from the embedding (`share_prefix` off; a
/// layer split then starts at its own boundary, block 1).
#[test]
fn shared_prefix_gives_the_same_step_in_every_placement() {
    let example = six_token_example();
    for model in ["gpt2", "llama"] {
        let dir = fixture(model);
        for recompute in [false, true] {
            let cfg = config(model, recompute);
            let run = |plan: DevicePlan, share: bool| {
                let mut engine = Engine::new(load_model(&dir, Device::Cpu, Kind::Float).unwrap(), plan, &cfg.edit_params).unwrap();
                engine.share_prefix = share;
                let mut editor = Editor::new(&cfg, engine.edit_params.clone(), Device::Cpu, 0).unwrap();
                let b = EditBatches::for_config(&engine, &[&example], &cfg).unwrap();
                let at = engine.boundary(b.loc.as_ref().unwrap()).unwrap().map(|e| e.at);
                let (loss, parts) = meta_loss(&engine, &mut editor, &b, true).unwrap();
                loss.backward();
                let (net, _) = editor.trainables();
                let grads: Vec<tch::Tensor> = net.iter().filter(|t| t.grad().defined()).map(|t| t.grad().reshape([-1])).collect();
                (parts, tch::Tensor::cat(&grads, 0), at)
            };
            for (name, plan, unshared_at) in [
                ("single", DevicePlan::single(Device::Cpu), None),
                ("replica", DevicePlan::split_on(Device::Cpu, Device::Cpu), None),
                ("balanced", balanced(1), Some(1)),
            ] {
                let what = format!("{model}, recompute {recompute}, {name}");
                let (p0, g0, at0) = run(plan, false);
                let (p1, g1, at1) = run(plan, true);
                assert_eq!((at0, at1), (unshared_at, Some(2)), "{what}");
                assert_same_step(&what, ("from the embedding", "from the prefix"), (&p0, &g0), (&p1, &g1));
            }
        }
    }
}

/// #35: the last block's queries, attention output, o_proj and MLP only at the scored
/// positions (`Engine::last_block_at_kept`) give the same capture (factors and where each
/// row came from), meta-loss, parts and editor gradients as the whole last block, with
/// edited weights in the last block's attention output and MLP and one below it, a
/// batch of two examples of different lengths and answer lengths (padding, and a padding
/// query row), in every placement, with and without recomputation.
#[test]
fn last_block_at_the_kept_rows_gives_the_same_capture_and_step() {
    let examples = [
        six_token_example(),
        EditExample {
            inner: ex(&[30, 31, 32, 33, 34, 35, 36, 37, 38], 3),
            outer: ex(&[40, 41, 42, 43], 1),
            rephrased: true,
            loc: Some(ex(&[50, 51, 52, 53, 54, 55, 56], 3)),
            portability: Vec::new(),
            outer_image: None,
            loc_image: None,
            neighbours: Vec::new(),
        },
    ];
    let refs: Vec<&EditExample> = examples.iter().collect();
    for model in ["gpt2", "llama"] {
        let dir = fixture(model);
        let edited: Vec<String> = match model {
            "gpt2" => ["h.1.mlp.c_proj", "h.2.attn.c_proj", "h.2.mlp.c_fc", "h.2.mlp.c_proj"].iter().map(|m| format!("transformer.{m}.weight")).collect(),
            _ => ["1.mlp.down_proj", "2.self_attn.o_proj", "2.mlp.up_proj", "2.mlp.down_proj"].iter().map(|m| format!("model.layers.{m}.weight")).collect(),
        };
        // The last block really runs at the kept rows: 2 examples, at most 3 answer tokens.
        {
            let cfg = MendConfig { edit_params: edited.clone(), ..config(model, false) };
            let engine = Engine::new(load_model(&dir, Device::Cpu, Kind::Float).unwrap(), DevicePlan::single(Device::Cpu), &edited).unwrap();
            let b = EditBatches::for_config(&engine, &refs, &cfg).unwrap();
            let capture: std::collections::HashSet<String> = edited.iter().cloned().collect();
            let out = engine.lm.model.forward_hidden(&dualedit::model::ParamView::frozen(&engine.lm.params), &b.inner.forward_input(&capture)).unwrap();
            let (below, last) = (&out.captures[&edited[0]], &out.captures[&edited[3]]);
            assert_eq!((&last.x.size()[..2], last.rows.as_ref().map(|r| r.size())), (&[2, 3][..], Some(vec![6])), "{model}: the last block's query rows");
            assert_eq!((below.x.size()[..2].to_vec(), below.rows.is_none()), (b.inner.input_ids.size(), true), "{model}: a block below runs at every row");
        }
        for recompute in [false, true] {
            let cfg = MendConfig { edit_params: edited.clone(), ..config(model, recompute) };
            let run = |plan: DevicePlan, at_kept: bool| {
                let mut engine = Engine::new(load_model(&dir, Device::Cpu, Kind::Float).unwrap(), plan, &cfg.edit_params).unwrap();
                engine.last_block_at_kept = at_kept;
                let mut editor = Editor::new(&cfg, engine.edit_params.clone(), Device::Cpu, 0).unwrap();
                let b = EditBatches::for_config(&engine, &refs, &cfg).unwrap();
                let (nll, factors, at) = engine.capture_by_example(&b.inner, &Default::default()).unwrap();
                let (loss, parts) = meta_loss(&engine, &mut editor, &b, true).unwrap();
                loss.backward();
                let (net, _) = editor.trainables();
                let grads: Vec<tch::Tensor> = net.iter().filter(|t| t.grad().defined()).map(|t| t.grad().reshape([-1])).collect();
                (nll, factors, at, parts, tch::Tensor::cat(&grads, 0))
            };
            for (name, plan) in [("single", DevicePlan::single(Device::Cpu)), ("replica", DevicePlan::split_on(Device::Cpu, Device::Cpu)), ("balanced", balanced(1))] {
                let what = format!("{model}, recompute {recompute}, {name}");
                let (n0, f0, at0, p0, g0) = run(plan, false);
                let (n1, f1, at1, p1, g1) = run(plan, true);
                assert!((n0 - n1).abs() <= 1e-5 * (1.0 + n0.abs()), "{what}: capture NLL {n0} vs {n1}");
                for (i, name) in edited.iter().enumerate() {
                    let pos = |t: &tch::Tensor| Vec::<i64>::try_from(t).unwrap();
                    assert_eq!(pos(&at0[i]), pos(&at1[i]), "{what}: {name}: the factor rows' positions");
                    for (k, a, b) in [("x", &f0[i].x, &f1[i].x), ("delta", &f0[i].delta, &f1[i].delta)] {
                        assert_eq!(a.size(), b.size(), "{what}: {name}: {k}");
                        let scale = a.abs().max().double_value(&[]);
                        let diff = (a - b).abs().max().double_value(&[]);
                        assert!(scale > 0.0 && diff <= 1e-4 * scale, "{what}: {name}: {k} differs by {diff} (largest {scale})");
                    }
                }
                // Both examples' answers reach the last block: rows of both batch rows.
                let t = b_tokens(&refs);
                let last = pos_rows(&at1[edited.len() - 1], t);
                assert_eq!(last, vec![0, 1], "{what}: the last block's factor rows come from both examples");
                assert_same_step(&what, ("whole last block", "kept rows"), (&p0, &g0), (&p1, &g1));
            }
        }
    }
}

/// Tokens of the inner batch of `examples` (the longest input: its ids but the last).
fn b_tokens(examples: &[&EditExample]) -> i64 {
    examples.iter().map(|e| e.inner.ids.len() as i64 - 1).max().unwrap()
}

/// The distinct batch rows (`pos / t`) of flat positions `b·t + j`.
fn pos_rows(at: &tch::Tensor, t: i64) -> Vec<i64> {
    let mut rows: Vec<i64> = Vec::<i64>::try_from(at).unwrap().iter().map(|p| p / t).collect();
    rows.dedup();
    rows
}

/// A chain of `n` logical CPU devices (`cpu` + `cpu:1,...,cpu:{n-1}`) under the layer split:
/// main holds blocks below `chain_at[0]`, `cpu:i` blocks `[chain_at[i-1], chain_at[i])`, the
/// last blocks from `at` with the head.
fn chain(n: usize, chain_at: Vec<usize>, at: usize) -> DevicePlan {
    let subs: Vec<String> = (1..n).map(|i| format!("cpu:{i}")).collect();
    DevicePlan::parse("cpu", Some(&subs.join(","))).unwrap().balanced_chain(chain_at, at).unwrap()
}

/// The boundary crossings of a run report's chain: `(from, to, at, bytes, crossings)`.
fn crossings(report: &serde_json::Value) -> Vec<(String, String, u64, u64, u64)> {
    report["moved"]["crossings"]
        .as_array()
        .unwrap_or_else(|| panic!("no crossings in {}", report["moved"]))
        .iter()
        .map(|c| {
            let s = |k: &str| c[k].as_str().unwrap().to_string();
            let u = |k: &str| c[k].as_u64().unwrap();
            (s("from"), s("to"), u("at"), u("boundary_bytes"), u("boundary_crossings"))
        })
        .collect()
}

/// #38: three and four devices (blocks over a chain of logical CPU devices) train and
/// evaluate as one device, and every crossing of the chain carries each batch's hidden
/// states once, counted on its own.
#[test]
fn chains_of_three_and_four_devices_train_and_evaluate_as_one_device() {
    let dir = tempfile::tempdir().unwrap();
    for (model, n, chain_at) in [("gpt2", 3, vec![1]), ("llama", 4, vec![0, 1]), ("gpt2", 4, vec![0, 1])] {
        let opts = train_options(dir.path(), model, config(model, false), &format!("{model}-chain{n}"));
        let plan = chain(n, chain_at.clone(), 2);
        let c = compare_train(&opts, plan).unwrap();
        let what = format!("{model} train over {n} devices, blocks from {chain_at:?} then 2");
        assert_agree(&c, &what);
        let report: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&c.dual.report).unwrap()).unwrap();
        assert_eq!(report["devices"]["sub"], format!("cpu:{}", n - 1), "{what}");
        let listed: Vec<(String, u64)> = serde_json::from_value(report["devices"]["chain"].clone()).unwrap();
        assert_eq!(listed, (1..n - 1).map(|i| (format!("cpu:{i}"), chain_at[i - 1] as u64)).collect::<Vec<_>>(), "{what}");
        let cs = crossings(&report);
        assert_eq!(cs.len(), n - 1, "{what}: {cs:?}");
        let names: Vec<String> = std::iter::once("cpu".to_string()).chain((1..n).map(|i| format!("cpu:{i}"))).collect();
        let ats: Vec<u64> = chain_at.iter().map(|&a| a as u64).chain([2]).collect();
        for (i, (from, to, at, bytes, count)) in cs.iter().enumerate() {
            assert_eq!((from, to, *at), (&names[i], &names[i + 1], ats[i]), "{what}: crossing {i}");
            // Hidden states [B, T, 64] f32, once per batch's prefix on every crossing.
            assert!(*count > 0 && *bytes > 0 && bytes % (64 * 4) == 0, "{what}: crossing {i}: {bytes} bytes in {count}");
            assert_eq!((*bytes, *count), (cs[0].3, cs[0].4), "{what}: every crossing carries the same prefixes");
        }
        if model == "gpt2" && n == 4 {
            let eval = eval_options(&opts, dir.path().join("eval-chain.json"), dir.path().join("gpt2-chain4/single"));
            let c = compare_eval(&eval, plan, dir.path()).unwrap();
            assert_agree(&c, "gpt2 eval over 4 devices");
        }
    }
}

/// What each device of a chain holds, and what a micro-step carries across each crossing:
/// the blocks' weights once at setup, then only hidden states (and mask / rotary tables).
#[test]
fn chain_places_each_range_on_its_device_and_counts_each_crossing() {
    let (engine, _, sizes, cfg) = placed("llama", chain(4, vec![0, 1], 2));
    let setup = engine.mover.stats();
    let block = |i: usize| sizes.iter().filter(|(n, _)| n.starts_with(&format!("model.layers.{i}."))).map(|(_, s)| *s as u64 * 4).sum::<u64>();
    assert_eq!(setup.crossings.len(), 3, "{setup:?}");
    // cpu:1 got block 0, cpu:2 block 1 (the last crossing's weights are in bytes_to_sub).
    assert_eq!(setup.crossings[0].other_bytes, block(0), "{setup:?}");
    assert_eq!(setup.crossings[1].other_bytes, block(1), "{setup:?}");
    assert!(setup.crossings.iter().all(|c| c.boundary_crossings == 0));
    let (editor, step) = one_meta_step(&engine, &cfg);
    let d = 64 * 4;
    for (i, (a, c)) in setup.crossings.iter().zip(&step.crossings).enumerate() {
        // The capture's batch (5 tokens) and the edited forward's (2 × 5), once each.
        assert_eq!(c.boundary_crossings - a.boundary_crossings, 2, "crossing {i}: {c:?}");
        assert_eq!(c.boundary_bytes - a.boundary_bytes, (5 + 2 * 5) * d, "crossing {i}: {c:?}");
        // Besides them only the rotary tables and the mask: less than one block's weights.
        assert!(c.other_bytes - a.other_bytes < block(0), "crossing {i}: {c:?}");
    }
    let (net, _) = editor.trainables();
    assert!(net.iter().any(|t| t.grad().defined()));
}

/// A chain's flags: duplicates, the main device in the list, or the replica placement over
/// a list are one clear error naming `--sub-device`; boundaries must increase.
#[test]
fn chain_flags_are_checked() {
    for (main, list, needle) in [
        ("cpu", "cpu:1,cpu:1", "listed twice"),
        ("cpu", "cpu:1,cpu", "main device"),
        ("cpu", "cpu:1,,cpu:2", "empty device name"),
        ("cpu", "cpu:1,gpu:2", "cpu:N"),
    ] {
        let e = DevicePlan::parse(main, Some(list)).unwrap_err().to_string();
        assert!(e.contains(needle) && e.contains("`sub_device`"), "{list}: {e}");
    }
    // One sub-device equal to main stays a single-device run.
    assert!(!DevicePlan::parse("cpu", Some("cpu")).unwrap().split);
    let p = DevicePlan::parse("cpu", Some("cpu:1, cpu:2,cpu:3")).unwrap();
    assert_eq!(p.sub_list(), "cpu:1,cpu:2,cpu:3");
    assert!(p.balanced(2).is_err(), "a chain needs its boundaries");
    let e = p.balanced_chain(vec![1, 1], 2).unwrap_err().to_string();
    assert!(e.contains("must increase"), "{e}");
    let req = dualedit::device::DeviceRequest { sub_device: Some("cpu:1,cpu:2".into()), ..Default::default() };
    let e = req.plan().unwrap_err().to_string();
    assert!(e.contains("`sub_device` cpu:1,cpu:2"), "{e}");
}
