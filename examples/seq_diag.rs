//! Issue #24 diagnostics: commits MEND edits one after another on the embedded default and
//! prints, per edit, what goes into and comes out of the editor and what the commit does.
//!
//!     cargo run --release --example seq_diag -- REQUESTS.json [N] [MODEL] [EDITOR]
//!
//! Per edit and edited weight: the captured rows, ‖x‖ and ‖δ‖ (mean row norms), the
//! editor-normalised inputs' mean row norms, ‖ΔW‖/‖W‖, and the committed weight's dtype,
//! contiguity and strides. Per edit: the edit NLL, the learned edit rates, the KL and top-1
//! agreement of the probes (every request's locality prompt) against the unedited model, and
//! the reliability of the edits committed so far.
use std::collections::BTreeMap;
use std::path::PathBuf;

use dualedit::data::easyedit::DatasetKind;
use dualedit::data::{Example, TokenBatch};
use dualedit::edit::{editor_params, make_edit, open_engine, LoadOptions, Mend};
use dualedit::mend::{losses, Engine};
use dualedit::model::Overrides;
use tch::{Kind, Tensor};

fn row_norm(t: &Tensor) -> f64 {
    if t.size()[0] == 0 {
        return 0.0;
    }
    t.norm_scalaropt_dim(2.0, [1i64].as_slice(), false).mean(Kind::Float).double_value(&[])
}

fn scored(engine: &Engine, ov: &Overrides, ex: &[&Example]) -> (Tensor, TokenBatch) {
    let b = TokenBatch::collate(ex, engine.lm.tokenizer.pad_id(), engine.plan.main);
    let l = if ov.is_empty() { engine.base_logits(&b).unwrap() } else { engine.edited_logits(ov, &b).unwrap() };
    (l, b)
}

/// Per editor group (`{d_in}x{d_out}`): mean and unbiased variance of the edited layers'
/// inputs over `sentences` under the current weights.
fn x_stats(engine: &Engine, sentences: &[Vec<i64>]) -> BTreeMap<String, (Tensor, Tensor)> {
    let set: std::collections::HashSet<String> = engine.edit_names().into_iter().collect();
    let mut rows: BTreeMap<String, Vec<Tensor>> = BTreeMap::new();
    let pad = engine.lm.tokenizer.pad_id();
    for chunk in sentences.chunks(64) {
        let t = chunk.iter().map(|s| s.len()).max().unwrap();
        let mut ids = vec![pad; chunk.len() * t];
        let mut mask = vec![0i64; chunk.len() * t];
        for (i, s) in chunk.iter().enumerate() {
            ids[i * t..i * t + s.len()].copy_from_slice(s);
            mask[i * t..i * t + s.len()].fill(1);
        }
        let ids = Tensor::from_slice(&ids).reshape([chunk.len() as i64, t as i64]);
        let mask = Tensor::from_slice(&mask).reshape([chunk.len() as i64, t as i64]);
        let input = dualedit::model::ForwardInput { attention_mask: Some(&mask), ..dualedit::model::ForwardInput::new(&ids, &set) };
        let out = engine.lm.model.forward(&dualedit::model::ParamView::frozen(&engine.lm.params), &input).unwrap();
        let m = mask.reshape([-1]).eq(1);
        for p in &engine.edit_params {
            let (i, o) = p.in_out();
            let x = out.captures[&p.name].x.reshape([-1, i]).index_select(0, &m.nonzero().squeeze_dim(1));
            rows.entry(format!("{i}x{o}")).or_default().push(x);
        }
    }
    rows.into_iter()
        .map(|(k, v)| {
            let x = Tensor::cat(&v, 0);
            (k, (x.mean_dim(0, false, Kind::Float), x.var_dim(0, true, false)))
        })
        .collect()
}

/// Replaces the editor's x statistics by `fresh` (same row counts).
fn set_x_stats(ed: &mut dualedit::mend::Editor, fresh: &BTreeMap<String, (Tensor, Tensor)>) {
    let (stats, counts) = ed.named_stats();
    let mut all: BTreeMap<String, Tensor> = ed.named_tensors().into_iter().collect();
    for (n, t) in stats {
        all.insert(n, t);
    }
    for (k, (mean, var)) in fresh {
        let c = counts[&format!("{k}.x")];
        all.insert(format!("stats.{k}.x.mean"), mean.shallow_clone());
        all.insert(format!("stats.{k}.x.m2"), var * (c - 1.0));
    }
    ed.load_tensors(&all, &counts).unwrap();
}

fn main() -> dualedit::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let requests = PathBuf::from(&args[1]);
    let n: usize = args.get(2).map(|s| s.parse().unwrap()).unwrap_or(5);
    let model = PathBuf::from(args.get(3).map(String::as_str).unwrap_or("data/model"));
    let editor = PathBuf::from(args.get(4).map(String::as_str).unwrap_or("data/editor"));
    let mut engine = open_engine(&model, &LoadOptions::default(), &editor_params(&editor)?)?;
    let mut method = Mend(dualedit::mend::checkpoint::load_editor(&editor, &engine)?.0);
    let (_, examples, _) = dualedit::run::load_examples(&engine, &requests, DatasetKind::Requests, Some(n), 32, Default::default(), None)?;
    let _g = tch::no_grad_guard();
    let pad = engine.lm.tokenizer.pad_id();

    // Editor statistics (frozen at eval): mean and std per editor group.
    let ed = &method.0;
    let (stats, counts) = ed.named_stats();
    let stats: BTreeMap<String, Tensor> = stats.into_iter().collect();
    println!("edit_lrs {:?}", Vec::<f64>::try_from(ed.edit_lrs.to_kind(Kind::Double)).unwrap());
    println!("stat counts {counts:?}");
    let group = |p: &dualedit::placed::EditedParam| {
        let (i, o) = p.in_out();
        format!("{i}x{o}")
    };
    let norm = |key: &str, which: &str, t: &Tensor| -> Tensor {
        let mean = &stats[&format!("stats.{key}.{which}.mean")];
        let m2 = &stats[&format!("stats.{key}.{which}.m2")];
        let c = counts[&format!("{key}.{which}")];
        (t - mean) / ((m2 / (c - 1.0)).sqrt() + 1e-7)
    };
    for (k, t) in &stats {
        if k.ends_with(".mean") {
            let key = k.trim_end_matches(".mean");
            let c = counts[&key.trim_start_matches("stats.").to_string()];
            let std = (&stats[&format!("{key}.m2")] / (c - 1.0)).sqrt();
            println!("{key}: |mean| {:.4e}  mean std {:.4e}", t.norm().double_value(&[]), std.mean(Kind::Float).double_value(&[]));
        }
    }

    let probes: Vec<&Example> = examples.iter().filter_map(|e| e.loc.as_ref()).collect();
    let (base_probe, pb) = scored(&engine, &Overrides::new(), &probes);
    let w0: BTreeMap<String, Tensor> = engine.edit_params.iter().map(|p| (p.name.clone(), engine.weight(&p.name).unwrap().copy())).collect();
    let mut prev: BTreeMap<String, Tensor> = BTreeMap::new();
    let refresh = std::env::var("REFRESH_X").is_ok();
    let corpus: Vec<Vec<i64>> = std::fs::read_to_string("data/world/corpus.txt")
        .unwrap()
        .lines()
        .take(400)
        .map(|l| engine.lm.tokenizer.encode(l).unwrap())
        .collect();
    if std::env::var("COMPARE_X").is_ok() {
        let fresh = x_stats(&engine, &corpus);
        for (k, (m, v)) in &fresh {
            let c = counts[&format!("{k}.x")];
            let std0 = (&stats[&format!("stats.{k}.x.m2")] / (c - 1.0)).sqrt();
            let m0 = &stats[&format!("stats.{k}.x.mean")];
            println!("{k}: corpus vs editor x stats: |mean diff|/|mean| {:.3}, std ratio median {:.3}",
                (m - m0).norm().double_value(&[]) / m0.norm().double_value(&[]),
                (v.sqrt() / (std0 + 1e-7)).median().double_value(&[]));
        }
    }
    for (k, e) in examples.iter().enumerate() {
        if refresh {
            let fresh = x_stats(&engine, &corpus);
            let ed = &mut method.0;
            set_x_stats(ed, &fresh);
        }
        let inner = TokenBatch::collate(&[&e.inner], pad, engine.plan.main);
        let (nll, factors) = engine.capture(&inner)?;
        println!("\n== edit {k}: nll {nll:.3}  answer tokens {}", inner.kept_targets().size()[0]);
        for (p, f) in engine.edit_params.iter().zip(&factors) {
            let key = group(p);
            let xn = norm(&key, "x", &f.x);
            let dn = norm(&key, "delta", &f.delta);
            println!(
                "  {:<34} rows {:>2} |x| {:>8.3} |d| {:>9.3e} |xn| {:>8.2} |dn| {:>8.2} |dn(0)| {:>8.2}",
                p.name,
                f.x.size()[0],
                row_norm(&f.x),
                row_norm(&f.delta),
                row_norm(&xn),
                row_norm(&dn),
                row_norm(&norm(&key, "delta", &f.delta.zeros_like())),
            );
            if f.x.size()[0] > 0 {
                let flat = xn.abs().amax([0i64].as_slice(), false);
                let j = flat.argmax(0, false).int64_value(&[]);
                let c = counts[&format!("{key}.x")];
                let std = (&stats[&format!("stats.{key}.x.m2")] / (c - 1.0)).sqrt();
                let mean = &stats[&format!("stats.{key}.x.mean")];
                println!(
                    "      max|xn| {:.1} at feature {j}: train mean {:.3e} std {:.3e}, x now {:.3e}; features with std < 1e-2: {}",
                    flat.double_value(&[j]),
                    mean.double_value(&[j]),
                    std.double_value(&[j]),
                    f.x.select(1, j).abs().max().double_value(&[]),
                    std.lt(1e-2).sum(Kind::Int64).int64_value(&[])
                );
            }
        }
        let ov = make_edit(&engine, &mut method, &inner)?;
        let full = engine.lm.params.materialise(&ov, |n| engine.lm.model.layout(n))?;
        // The editor's answer to the same x with no gradient at all (δ = 0), and the
        // alignment of this edit with the previous one.
        let zero: Vec<dualedit::mend::Factors> =
            factors.iter().map(|f| dualedit::mend::Factors { x: f.x.shallow_clone(), delta: f.delta.zeros_like() }).collect();
        let ed = &mut method.0;
        let ov0 = engine.edit_low_rank(ed, &zero, false)?;
        let full0: BTreeMap<String, Tensor> = engine.lm.params.materialise(&ov0, |n| engine.lm.model.layout(n))?.into_iter().collect();
        for (name, t) in &full {
            let w = engine.weight(name)?;
            let dw = t - w;
            let dw0 = &full0[name] - w;
            let cos_prev = prev.get(name).map(|p: &Tensor| {
                (p * &dw).sum(Kind::Float).double_value(&[]) / (p.norm().double_value(&[]) * dw.norm().double_value(&[]))
            });
            println!(
                "  {:<34} |dW(d=0)|/|dW| {:.3}  cos(dW, dW(d=0)) {:.3}  cos(dW, previous dW) {:?}",
                name,
                dw0.norm().double_value(&[]) / dw.norm().double_value(&[]),
                (&dw0 * &dw).sum(Kind::Float).double_value(&[]) / (dw0.norm().double_value(&[]) * dw.norm().double_value(&[])),
                cos_prev.map(|c| (c * 1000.0).round() / 1000.0)
            );
            prev.insert(name.clone(), dw);
        }
        for (name, t) in &full {
            let w = engine.weight(name)?;
            let dw = (t - w).norm().double_value(&[]);
            println!(
                "  {:<34} |W| {:>8.3} |dW| {:>8.4} |dW|/|W| {:.4}  drift from W0 {:.4}",
                name,
                w.norm().double_value(&[]),
                dw,
                dw / w.norm().double_value(&[]),
                (t - &w0[name]).norm().double_value(&[]) / w0[name].norm().double_value(&[])
            );
        }
        // Rows of the edit as applied, and the probes before/after committing.
        let (l_new, _) = scored(&engine, &ov, &probes);
        engine.commit(&ov)?;
        for p in &engine.edit_params {
            let w = engine.weight(&p.name)?;
            if k == 0 {
                println!("  committed {}: kind {:?} contiguous {} stride {:?}", p.name, w.kind(), w.is_contiguous(), w.stride());
            }
        }
        let (l_after, _) = scored(&engine, &Overrides::new(), &probes);
        let diff = (&l_after - &l_new).abs().max().double_value(&[]);
        let kl = losses::kl(&base_probe, &l_after).double_value(&[]);
        let agree = losses::agreement(&l_after, &base_probe, &pb.kept_rows(), pb.batch_size());
        let done: Vec<&Example> = examples[..=k].iter().map(|e| &e.inner).collect();
        let (lr, rb) = scored(&engine, &Overrides::new(), &done);
        let (acc, _) = losses::token_accuracy(&lr, &rb.kept_targets(), &rb.kept_rows(), rb.batch_size());
        println!(
            "  commit==override max|diff| {diff:.2e}  probe KL {kl:.3}  probe top-1 {:.2}  reliability so far {:.2}",
            agree.iter().sum::<f64>() / agree.len().max(1) as f64,
            acc.iter().sum::<f64>() / acc.len() as f64
        );
    }
    Ok(())
}
