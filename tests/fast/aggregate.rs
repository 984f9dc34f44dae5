//! Meta-training through the least-squares aggregation (`aggregate: least_squares`, issue
//! #36, MALMEN): the differentiable solve is the one `--method mend-ls` makes at edit time,
//! its gradient is the normal equation's, and the training loss reaches the editor.
use crate::common;
use std::collections::HashMap;
use std::path::Path;

use common::{fixture, RECORDS};

use dualedit::config::{Aggregate, LsConfig, MendConfig};
use dualedit::data::easyedit::{parse_records, DatasetKind};
use dualedit::data::examples::prepare;
use dualedit::data::Example;
use dualedit::device::DevicePlan;
use dualedit::mend::ls::{self, KeyMemory, LsEditor};
use dualedit::mend::{Editor, Engine};
use dualedit::model::{load_model, Overrides};
use dualedit::mend::train::{meta_loss_aggregated, EditBatches};
use tch::{Device, Kind, Tensor};

/// `S = (KᵀK + λ·I + μ·C)⁻¹ KᵀT` and the gradient autograd takes through `linalg_solve`,
/// against the closed form `∂L/∂T = K·A⁻¹·∂L/∂S` (A symmetric) and central finite
/// differences, in f64 on a tiny case.
#[test]
fn solve_gradient_is_the_normal_equations() {
    common::init();
    let (k, t, m, w) = dualedit::rng::torch_seeded(11, || {
        let o = (Kind::Double, Device::Cpu);
        (Tensor::randn([6, 4], o), Tensor::randn([6, 3], o), Tensor::randn([4, 4], o), Tensor::randn([4, 3], o))
    });
    let c = m.matmul(&m.tr());
    let cfg = LsConfig { lambda: 0.1, cov_weight: 0.5, rounds: 0 };
    // A nonlinear loss of S, so the gradient depends on where it is taken. (λ is scaled by
    // the keys' mean squared norm in f32, hence agreement to 1e-6, not to f64's last digits.)
    let loss = |t: &Tensor| {
        let s = ls::solve_keys(&k, t, &cfg, Some(&c));
        (&s * &w).sum(Kind::Double) + s.square().sum(Kind::Double) * 0.5
    };
    let tg = t.copy().set_requires_grad(true);
    let s = ls::solve_keys(&k, &tg, &cfg, Some(&c));
    let l = (&s * &w).sum(Kind::Double) + s.square().sum(Kind::Double) * 0.5;
    let g = Tensor::run_backward(&[&l], &[&tg], false, false).pop().unwrap();

    let _g = tch::no_grad_guard();
    let lambda = 0.1 * k.square().sum_dim_intlist(1, false, Kind::Double).mean(Kind::Double).double_value(&[]);
    let a = k.tr().matmul(&k) + Tensor::eye(4, (Kind::Double, Device::Cpu)) * lambda + &c * 0.5;
    let s_closed = a.inverse().matmul(&k.tr()).matmul(&t);
    let s_rel = (&s.detach() - &s_closed).norm().double_value(&[]) / s_closed.norm().double_value(&[]);
    assert!(s_rel < 1e-6, "solve differs from the closed form by {s_rel}");
    let g_closed = k.matmul(&a.inverse()).matmul(&(&w + &s_closed));
    let g_rel = (&g - &g_closed).norm().double_value(&[]) / g_closed.norm().double_value(&[]);
    assert!(g_rel < 1e-6, "autograd's gradient differs from the closed form by {g_rel}");
    let eps = 1e-6;
    for (r, col) in [(0i64, 0i64), (3, 1), (5, 2)] {
        let bump = |d: f64| {
            let tt = t.copy();
            let _ = tt.get(r).get(col).f_add_scalar_(d).unwrap();
            loss(&tt).double_value(&[])
        };
        let fd = (bump(eps) - bump(-eps)) / (2.0 * eps);
        let ag = g.get(r).get(col).double_value(&[]);
        assert!((fd - ag).abs() < 1e-6 * (1.0 + ag.abs()), "∂L/∂T[{r},{col}]: finite differences {fd}, autograd {ag}");
    }
}

fn setup() -> (Engine, Vec<dualedit::data::EditExample>, MendConfig, Vec<Tensor>) {
    common::init();
    let lm = load_model(&fixture("gpt2"), Device::Cpu, Kind::Float).unwrap();
    let engine = Engine::new(lm, DevicePlan::single(Device::Cpu), &[]).unwrap();
    let (recs, _) = parse_records(RECORDS, Path::new("inline.json"), DatasetKind::Requests).unwrap();
    let ex = prepare(&engine.lm.tokenizer, &recs, 64, Path::new("inline.json")).unwrap();
    let cfg = MendConfig {
        rank: 16,
        aggregate: Aggregate::LeastSquares,
        ls: LsConfig { lambda: 1e-2, cov_weight: 0.5, rounds: 0 },
        // Named for the config's check; the tests pass the Grams of `texts` themselves.
        key_stats_text: Some("corpus.txt".into()),
        ..MendConfig::default()
    };
    let texts: Vec<String> = ["The weather is fine today.", "A river runs through the old town.", "Numbers are not letters."].map(String::from).into();
    let grams = ls::unrelated_grams(&engine, &texts).unwrap();
    (engine, ex, cfg, grams)
}

/// The weights an override set makes, by edited weight.
fn weights(engine: &Engine, ov: &Overrides) -> HashMap<String, Tensor> {
    engine.lm.params.materialise(ov, |n| engine.lm.model.layout(n)).unwrap().into_iter().collect()
}

/// The training solve (under grad mode, through the editor's differentiable terms) gives
/// the weights the edit-time `mend-ls` solve gives for the same batch (no rounds), and the
/// meta-training loss through it has a gradient on the editor's network and edit rates.
#[test]
fn training_solve_is_the_edit_time_solve_and_trains_the_editor() {
    let (engine, ex, cfg, grams) = setup();
    let inner: Vec<&Example> = ex.iter().map(|e| &e.inner).collect();
    let batch = engine.collate(&inner).unwrap();
    let editor = Editor::new(&cfg, engine.edit_params.clone(), Device::Cpu, 4).unwrap();
    let mut lse = LsEditor { editor, config: cfg.ls, memory: KeyMemory::default(), stats_text: None, unrelated: grams.iter().map(Tensor::shallow_clone).collect(), single_mend: false };
    let at_edit = weights(&engine, &ls::edit(&engine, &mut lse, &batch, &[]).unwrap());
    let mut editor = lse.editor;

    let (_, factors, positions) = engine.capture_by_example(&batch, &HashMap::new()).unwrap();
    let t_len = batch.input_ids.size()[1];
    let trained = ls::aggregate(&engine, &mut editor, (&factors, &positions, t_len), &cfg.ls, &grams, false).unwrap();
    let at_train = weights(&engine, &trained);
    for p in &engine.edit_params {
        let w0 = engine.weight(&p.name).unwrap();
        let (de, dt) = (&at_edit[&p.name] - w0, (&at_train[&p.name] - w0).detach());
        let n = de.norm().double_value(&[]);
        assert!(n > 0.0, "{}: the edit changed nothing", p.name);
        let rel = (&de - &dt).norm().double_value(&[]) / n;
        assert!(rel < 1e-4, "{}: the training solve differs from the edit-time one by {rel} (relative)", p.name);
    }

    let refs: Vec<&dualedit::data::EditExample> = ex.iter().collect();
    let b = EditBatches::for_config(&engine, &refs, &cfg).unwrap();
    let (loss, parts) = meta_loss_aggregated(&engine, &mut editor, &b, true, &grams).unwrap();
    assert!(parts.loss.is_finite() && parts.loc_kl >= 0.0, "{parts:?}");
    loss.backward();
    let (net, lrs) = editor.trainables();
    let moved = net.iter().filter(|t| t.grad().defined() && t.grad().abs().sum(Kind::Float).double_value(&[]) > 0.0).count();
    assert!(moved > 0, "no editor tensor got a gradient through the solve");
    assert!(lrs[0].grad().abs().sum(Kind::Float).double_value(&[]) > 0.0, "the edit rates got no gradient through the solve");

    // Without the key statistics the solve would silently drop μ: one clear error instead.
    let err = meta_loss_aggregated(&engine, &mut editor, &b, true, &[]).unwrap_err().to_string();
    assert!(err.contains("key statistics"), "{err}");
}

/// `aggregate` is a typed option, written only when not `sum`.
#[test]
fn aggregate_option_reads_writes_and_checks() {
    let cfg: MendConfig = serde_json::from_str(r#"{"aggregate": "least_squares", "key_stats_text": "corpus.txt"}"#).unwrap();
    assert_eq!(cfg.aggregate, Aggregate::LeastSquares);
    cfg.validate().unwrap();
    assert!(serde_json::to_string(&cfg).unwrap().contains(r#""aggregate":"least_squares","key_stats_text":"corpus.txt""#));
    assert!(!serde_json::to_string(&MendConfig::default()).unwrap().contains("aggregate"));
    assert!(serde_json::from_str::<MendConfig>(r#"{"aggregate": "mean"}"#).is_err());
}
