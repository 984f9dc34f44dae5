//! The commit guard (issue #24): harmless edits pass, an edit that would break the locality
//! probes is scaled back or refused, and what it returns keeps the probes within bounds.
use crate::common;
use std::collections::HashMap;
use std::path::Path;

use common::{fixture, RECORDS};

use dualedit::config::MendConfig;
use dualedit::data::easyedit::{parse_records, DatasetKind};
use dualedit::data::examples::prepare;
use dualedit::data::{Example, TokenBatch};
use dualedit::device::DevicePlan;
use dualedit::mend::guard::{check_edit, scale_overrides, Decision, GuardConfig, Probes, MAX_PROBES};
use dualedit::mend::{Editor, Engine};
use dualedit::model::{load_model, Overrides, RowScaled};
use tch::{Device, Kind, Tensor};

fn setup() -> (Engine, Editor, Vec<dualedit::data::EditExample>) {
    let lm = load_model(&fixture("gpt2"), Device::Cpu, Kind::Float).unwrap();
    let engine = Engine::new(lm, DevicePlan::single(Device::Cpu), &[]).unwrap();
    let (recs, _) = parse_records(RECORDS, Path::new("inline.json"), DatasetKind::Requests).unwrap();
    let ex = prepare(&engine.lm.tokenizer, &recs, 64, Path::new("inline.json")).unwrap();
    // An untrained editor is the identity: a plain gradient step of size edit_lr.
    let cfg = MendConfig { rank: 8, norm: false, edit_lr: 1e-4, ..MendConfig::default() };
    let editor = Editor::new(&cfg, engine.edit_params.clone(), Device::Cpu, 0).unwrap();
    (engine, editor, ex)
}

fn edit_of(engine: &Engine, editor: &mut Editor, e: &Example) -> (Overrides, TokenBatch) {
    let _g = tch::no_grad_guard();
    let b = TokenBatch::collate(&[e], engine.lm.tokenizer.pad_id(), Device::Cpu);
    let (_, f) = engine.capture(&b).unwrap();
    (engine.edit_low_rank(editor, &f, false).unwrap(), b)
}

fn full(engine: &Engine, ov: &Overrides) -> HashMap<String, Tensor> {
    engine.lm.params.materialise(ov, |n| engine.lm.model.layout(n)).unwrap().into_iter().collect()
}

#[test]
fn scaled_edit_is_w_plus_s_delta() {
    let (engine, mut editor, ex) = setup();
    let (ov, _) = edit_of(&engine, &mut editor, &ex[0].inner);
    // Large enough that W + ΔW − W keeps ΔW's digits in f32.
    let ov = scale_overrides(&engine, &ov, 1e3).unwrap();
    let (one, half) = (full(&engine, &ov), full(&engine, &scale_overrides(&engine, &ov, 0.5).unwrap()));
    for p in &engine.edit_params {
        let w = engine.weight(&p.name).unwrap();
        let want = (&one[&p.name] - w) * 0.5;
        let rel = (&half[&p.name] - w - &want).norm().double_value(&[]) / want.norm().double_value(&[]);
        assert!(rel < 1e-4, "{}: {rel}", p.name);
    }
}

#[test]
fn each_row_at_its_own_scale_is_the_weight_scaled_that_much() {
    // What the guard's smallest-scale search asks in one forward: the edit's batch repeated
    // once per scale, row b seeing W + s_b·D, against one forward of W + s·D per scale.
    let _g = tch::no_grad_guard();
    let (engine, mut editor, ex) = setup();
    let (ov, batch) = edit_of(&engine, &mut editor, &ex[0].inner);
    let big = full(&engine, &scale_overrides(&engine, &ov, 1e3).unwrap());
    let scales = [0.25f32, 1.0, 0.0];
    let rows = [0i64, 0, 0];
    let repeated = batch.rows(&rows).unwrap();
    engine.share_boundary_rows(&batch, &repeated, &rows).unwrap();
    let mut per_row = Overrides::new();
    for (name, w2) in &big {
        let d = w2 - engine.weight(name).unwrap();
        per_row.insert_row_scaled(name.clone(), RowScaled { delta: d, scales: Tensor::from_slice(&scales) });
    }
    let got = engine.edited_logits(&per_row, &repeated).unwrap();
    let n = batch.kept_targets().size()[0];
    assert_eq!(got.size()[0], 3 * n);
    for (i, s) in scales.iter().enumerate() {
        let at: Overrides = big.iter().map(|(name, w2)| (name.clone(), engine.weight(name).unwrap() + (w2 - engine.weight(name).unwrap()) * f64::from(*s))).collect();
        let want = engine.edited_logits(&at, &batch).unwrap();
        let diff = (got.narrow(0, i as i64 * n, n) - &want).abs().max().double_value(&[]);
        assert!(diff < 1e-3 * want.abs().max().double_value(&[]), "scale {s}: {diff}");
    }
    // Scale 0 is the current weights, and a per-row change stands for no single weight.
    let base = engine.edited_logits(&Overrides::new(), &batch).unwrap();
    assert!((got.narrow(0, 2 * n, n) - base).abs().max().double_value(&[]) < 1e-3);
    assert!(engine.lm.params.materialise(&per_row, |n| engine.lm.model.layout(n)).is_err());
}

#[test]
fn harmless_edit_is_accepted_and_a_destructive_one_is_not_committed_as_is() {
    let (engine, mut editor, ex) = setup();
    let loc: Vec<&Example> = ex.iter().filter_map(|e| e.loc.as_ref()).collect();
    let probes = Probes::new(&engine, &loc).unwrap().expect("the records have locality prompts");
    assert_eq!(probes.len(), 3);
    let cfg = GuardConfig::default();

    // A small gradient step leaves the probes' answers as they were.
    let (ov, batch) = edit_of(&engine, &mut editor, &ex[0].inner);
    let (kept, rep) = check_edit(&engine, &ov, &probes, Some(&batch), &cfg).unwrap();
    assert_eq!(rep.decision, Decision::Accepted, "{}", rep.message);
    assert!(kept.is_some() && rep.scale == 1.0 && rep.before.agreement == 1.0);

    // The same edit a million times larger answers nonsense: never committed at full size.
    let huge = scale_overrides(&engine, &ov, 1e6).unwrap();
    let (kept, rep) = check_edit(&engine, &huge, &probes, Some(&batch), &cfg).unwrap();
    assert!(rep.full.agreement < cfg.min_agreement || rep.full.kl > cfg.max_kl, "the huge edit breaks the probes: {}", rep.message);
    assert_ne!(rep.decision, Decision::Accepted, "{}", rep.message);
    match rep.decision {
        Decision::Refused => {
            assert!(kept.is_none() && rep.scale == 0.0);
            assert!(rep.message.contains("refused"), "{}", rep.message);
        }
        Decision::Scaled => {
            // What the guard hands back keeps the probes within its limits.
            let kept = kept.unwrap();
            let now = probes.measure(&engine, &kept).unwrap();
            assert!(rep.scale < 1.0 && now.agreement >= cfg.min_agreement && now.kl <= cfg.max_kl, "{}", rep.message);
            // Measured on every probe, whichever probes the search measured.
            assert_eq!(rep.after, now);
            assert_eq!(rep.edit_success, Some(true));
        }
        Decision::Accepted => unreachable!(),
    }

    // Without scaling back it is refused outright, with the numbers in the message.
    let strict = GuardConfig { scale_back: false, ..GuardConfig::default() };
    let (kept, rep) = check_edit(&engine, &huge, &probes, Some(&batch), &strict).unwrap();
    assert!(kept.is_none() && rep.decision == Decision::Refused);
    assert!(rep.message.contains("top-1 agreement"), "{}", rep.message);
}

/// Issue #47: the guard's scale search measures only the probes an edit's scale can change,
/// from the whole batch's prefix activations and reference: what it measures of them is
/// what the whole measure gives, for probes of several lengths, rows not in one run, on a
/// family with absolute positions and on one with rotary ones.
#[test]
fn a_subset_of_the_probes_measures_as_the_whole_does() {
    for family in ["gpt2", "llama"] {
        let lm = load_model(&fixture(family), Device::Cpu, Kind::Float).unwrap();
        let engine = Engine::new(lm, DevicePlan::single(Device::Cpu), &[]).unwrap();
        let (recs, _) = parse_records(RECORDS, Path::new("inline.json"), DatasetKind::Requests).unwrap();
        let ex = prepare(&engine.lm.tokenizer, &recs, 64, Path::new("inline.json")).unwrap();
        let cfg = MendConfig { rank: 8, norm: false, edit_lr: 1e-2, ..MendConfig::default() };
        let mut editor = Editor::new(&cfg, engine.edit_params.clone(), Device::Cpu, 0).unwrap();
        // Locality prompts, rephrases and prompts: probes of different lengths.
        let probes: Vec<&Example> = ex.iter().flat_map(|e| [e.loc.as_ref().unwrap(), &e.outer, &e.inner]).collect();
        let lens: Vec<usize> = probes.iter().map(|p| p.ids.len()).collect();
        let probes = Probes::new(&engine, &probes).unwrap().unwrap();
        let (ov, _) = edit_of(&engine, &mut editor, &ex[0].inner);
        let ov = scale_overrides(&engine, &ov, 1e3).unwrap();
        let whole = probes.measure_each(&engine, &ov).unwrap();
        let rows = [1, 2, 5, 6];
        assert!(rows.iter().map(|&r| lens[r]).max() < lens.iter().max().copied(), "{family}: the subset is shorter than the batch: {lens:?}");
        let sub = probes.subset(&engine, &rows).unwrap().expect("text probes");
        assert_eq!(sub.len(), rows.len());
        let part = sub.measure_each(&engine, &ov).unwrap();
        let want: Vec<f64> = rows.iter().map(|&r| whole.per_probe[r]).collect();
        assert_eq!(part.per_probe, want, "{family}");
        assert!(want.iter().any(|a| *a < 1.0), "{family}: the edit changes some of them: {want:?}");
        assert_eq!(sub.measure_each(&engine, &Overrides::new()).unwrap().per_probe, vec![1.0; rows.len()], "{family}: the reference is the subset's own");
        assert!(probes.subset(&engine, &[2, 1]).is_err() && probes.subset(&engine, &[probes.len()]).is_err());
    }
}

/// Issue #47: a call's probes are its requests' locality prompts; of a thousand, the guard
/// measures a bounded, evenly spaced sample, so a check of an edit in a row does not cost a
/// forward over all of them.
#[test]
fn a_large_call_measures_a_bounded_sample_of_its_probes() {
    let (engine, _, ex) = setup();
    let loc: Vec<&Example> = ex.iter().filter_map(|e| e.loc.as_ref()).cycle().take(3 * MAX_PROBES + 1).collect();
    let probes = Probes::new(&engine, &loc).unwrap().unwrap();
    assert_eq!(probes.len(), MAX_PROBES);
    let now = probes.measure(&engine, &Overrides::new()).unwrap();
    assert!(now.agreement == 1.0 && now.kl.abs() < 1e-6, "{now:?}");
    let few = Probes::new(&engine, &loc[..MAX_PROBES - 1]).unwrap().unwrap();
    assert_eq!(few.len(), MAX_PROBES - 1);
}

/// Issue #33.7: thresholds that make no sense are one clear error naming the flag and the
/// range (NaN or > 1 used to refuse every edit quietly); a request's changes are checked
/// the same way.
#[test]
fn nonsense_thresholds_are_refused_naming_the_flag() {
    use dualedit::mend::guard::GuardOverrides;
    assert!(GuardConfig::default().validate().is_ok());
    let d = GuardConfig::default;
    for (c, flag, range) in [
        (GuardConfig { min_agreement: f64::NAN, ..d() }, "guard `min_agreement`", "[0, 1]"),
        (GuardConfig { min_agreement: f64::INFINITY, ..d() }, "guard `min_agreement`", "[0, 1]"),
        (GuardConfig { min_agreement: 1.5, ..d() }, "guard `min_agreement`", "[0, 1]"),
        (GuardConfig { min_agreement: -1.0, ..d() }, "guard `min_agreement`", "[0, 1]"),
        (GuardConfig { max_drop: f64::NAN, ..d() }, "guard `max_drop`", "[0, 1]"),
        (GuardConfig { max_drop: 2.0, ..d() }, "guard `max_drop`", "[0, 1]"),
        (GuardConfig { max_drop: -0.1, ..d() }, "guard `max_drop`", "[0, 1]"),
        (GuardConfig { max_kl: f64::NAN, ..d() }, "guard `max_kl`", "[0, ∞)"),
        (GuardConfig { max_kl: -1.0, ..d() }, "guard `max_kl`", "[0, ∞)"),
        (GuardConfig { max_kl: f64::INFINITY, ..d() }, "guard `max_kl`", "[0, ∞)"),
    ] {
        let err = c.validate().expect_err(flag).to_string();
        assert!(err.contains(flag) && err.contains(range), "{err}");
    }
    // The ends of the ranges are fine.
    assert!(GuardConfig { min_agreement: 0.0, max_drop: 1.0, max_kl: 0.0, ..d() }.validate().is_ok());
    let o = GuardOverrides { max_drop: Some(3.0), ..Default::default() };
    assert!(o.apply(&d()).unwrap_err().to_string().contains("max_drop"));
    let o = GuardOverrides { refuse: Some(true), max_kl: Some(0.5), ..Default::default() };
    let c = o.apply(&d()).unwrap();
    assert!(!c.scale_back && c.max_kl == 0.5 && c.min_agreement == 0.9);
}

/// Calibration (#46) scales an edit that overshoots down to `margin` times the smallest
/// scale that makes it, scales one that misses up (within `max_scale`), and reads its
/// setting from editor.json, where a bad value is one error naming the file and the field.
#[test]
fn calibration_keeps_the_edit_made_with_its_margin_and_reads_editor_json() {
    use dualedit::mend::calibrate::{calibrate, Calibration};
    use dualedit::mend::checkpoint::{load_editor, save_editor, EDITOR_JSON};
    use dualedit::mend::guard::makes_edit;
    let (engine, mut editor, ex) = setup();
    let (ov, batch) = edit_of(&engine, &mut editor, &ex[0].inner);
    let makes = |ov: &Overrides, s: f64| makes_edit(&engine, &scale_overrides(&engine, ov, s).unwrap(), &batch).unwrap();
    // The untrained editor's step (edit_lr 1e-4) is far too small: the first power of ten
    // that makes the edit, times 8, overshoots.
    let k = (1..=8).map(|p| 10f64.powi(p)).find(|k| makes(&ov, *k)).expect("a large enough step makes the edit");
    let over = scale_overrides(&engine, &ov, 8.0 * k).unwrap();
    let cal = Calibration { margin: 2.0, max_scale: 1.0, passes: 1 };
    let (shrunk, s) = calibrate(&engine, &mut editor, over.map(|t| t.shallow_clone()), &batch, &cal).unwrap();
    assert!(s < 0.5, "an edit 8x past what makes it keeps at most 2/8 (and the bisection's slack): {s}");
    assert!(makes(&shrunk, 1.0), "the calibrated edit still makes the edit");
    let smallest = s / cal.margin;
    assert!(makes(&over, smallest) && !makes(&over, smallest / 1.06), "s* = {smallest} is the threshold within 6 %");

    // An edit that misses: scaled up when allowed, left as it is when not.
    let under = scale_overrides(&engine, &ov, k / 20.0).unwrap();
    assert!(!makes(&under, 1.0));
    let (same, s) = calibrate(&engine, &mut editor, under.map(|t| t.shallow_clone()), &batch, &cal).unwrap();
    assert!(s == 1.0 && !makes(&same, 1.0));
    let (up, s) = calibrate(&engine, &mut editor, under.map(|t| t.shallow_clone()), &batch, &Calibration { max_scale: 64.0, ..cal }).unwrap();
    assert!(s > 1.0 && s <= 20.0 * 1.06 && makes(&up, 1.0), "scaled up to {s}");

    // From editor.json; a bad margin names the file and the field.
    let dir = tempfile::tempdir().unwrap();
    editor.calibration = Some(cal);
    save_editor(dir.path(), &editor, &engine, 0).unwrap();
    assert_eq!(load_editor(dir.path(), &engine).unwrap().0.calibration, Some(cal));
    let path = dir.path().join(EDITOR_JSON);
    let text = std::fs::read_to_string(&path).unwrap().replace("\"margin\": 2.0", "\"margin\": 0.5");
    std::fs::write(&path, text).unwrap();
    let err = load_editor(dir.path(), &engine).unwrap_err().to_string();
    assert!(err.contains("editor.json") && err.contains("`calibration.margin`"), "{err}");
}

/// `mend-ls`'s solve settings are edit-time settings too: `ls` in editor.json is what the
/// loaded editor edits with (so it can be tuned without retraining, as
/// `data/real/editor-many`'s keep weight was, #47), and a bad value names the file.
#[test]
fn ls_settings_are_read_from_editor_json() {
    use dualedit::mend::checkpoint::{load_editor, save_editor, EDITOR_JSON};
    let (engine, editor, _) = setup();
    let dir = tempfile::tempdir().unwrap();
    save_editor(dir.path(), &editor, &engine, 0).unwrap();
    let path = dir.path().join(EDITOR_JSON);
    let set = |keep: f64| {
        let mut v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        v["config"]["ls"] = serde_json::json!({"lambda": 0.001, "keep_weight": keep, "rounds": 2});
        std::fs::write(&path, v.to_string()).unwrap();
    };
    set(0.1);
    let ls = load_editor(dir.path(), &engine).unwrap().0.config.ls;
    assert_eq!((ls.lambda, ls.cov_weight, ls.rounds), (0.001, 0.1, 2));
    set(-1.0);
    let err = load_editor(dir.path(), &engine).unwrap_err().to_string();
    assert!(err.contains("editor.json") && err.contains("keep weight"), "{err}");
}

/// An edit that no scale up to `max_scale` makes takes further editor steps, each
/// recaptured where the last left the weights (#46, `calibration.passes`): one pass leaves
/// it missed, a few make it.
#[test]
fn calibration_steps_again_where_no_scale_makes_the_edit() {
    use dualedit::mend::calibrate::{calibrate, Calibration};
    use dualedit::mend::guard::makes_edit;
    let (engine, mut editor, ex) = setup();
    let (ov, batch) = edit_of(&engine, &mut editor, &ex[0].inner);
    let makes = |ov: &Overrides, s: f64| makes_edit(&engine, &scale_overrides(&engine, ov, s).unwrap(), &batch).unwrap();
    // The smallest scale of the untrained editor's step that makes the edit, within 3 %.
    let k = (1..=8).map(|p| 10f64.powi(p)).find(|k| makes(&ov, *k)).expect("a large enough step makes the edit");
    let (mut lo, mut hi) = (k / 10.0, k);
    while hi / lo > 1.03 {
        let mid = (lo * hi).sqrt();
        if makes(&ov, mid) {
            hi = mid
        } else {
            lo = mid
        }
    }
    // Steps of 0.6 of that: the first misses, and max_scale 1 keeps it from being scaled up.
    editor.edit_lrs = tch::no_grad(|| &editor.edit_lrs * (0.6 * hi));
    let (short, _) = edit_of(&engine, &mut editor, &ex[0].inner);
    assert!(!makes(&short, 1.0));
    let once = Calibration { margin: 1.0, max_scale: 1.0, passes: 1 };
    let (same, s) = calibrate(&engine, &mut editor, short.map(|t| t.shallow_clone()), &batch, &once).unwrap();
    assert!(s == 1.0 && !makes(&same, 1.0));
    let (made, s) = calibrate(&engine, &mut editor, short, &batch, &Calibration { passes: 4, ..once }).unwrap();
    assert!(s == 1.0 && makes(&made, 1.0), "further steps make the edit");
}
