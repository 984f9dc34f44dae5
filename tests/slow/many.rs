//! Many edits on the embedded default (issue #24): `mend-ls` keeps five sequential edits
//! and the unrelated prompts' answers, sequential `mend-ls` is the batch by construction,
//! the guard refuses a destructive edit, and `eval --edits-per-batch / --sequential`
//! reaches the targets at 10 edits with `data/editor` and at 100 (the size) with
//! `data/editor-many` and its re-solve rounds.
//!
//! The requests are `tests/fixtures/many/distinct-{10,100}.json`, written by
//! `scripts/seq_requests.py tests/fixtures/many 10 100` from the embedded world: one record
//! per fact, locality prompts that no request edits.
use crate::common;
use std::path::{Path, PathBuf};

use dualedit::edit::capacity::Grouping;
use dualedit::data::easyedit::{load_records, DatasetKind, EditRecord};
use dualedit::data::examples::prepare;
use dualedit::edit::{LoadOptions, MethodSpec};
use dualedit::mend::guard::{Decision, GuardConfig};
use dualedit::mend::ls::{LsChoice, LsConfig};
use dualedit::run::{run_eval, CapacityOptions, Common, EvalOptions};
use dualedit::edit::session::Session;
use tch::Device;

fn requests() -> PathBuf {
    common::root().join("tests/fixtures/many/distinct-10.json")
}

fn hundred() -> PathBuf {
    common::root().join("tests/fixtures/many/distinct-100.json")
}

/// The world's corpus without the lines that state a fact the requests edit: the unrelated
/// text whose keys `mend-ls` keeps (as MEMIT keeps generic text's key covariance).
fn keep_text(records: &[EditRecord], dir: &Path) -> PathBuf {
    let corpus = std::fs::read_to_string(common::root().join("data/world/corpus.txt")).unwrap();
    let states = |l: &str| {
        records.iter().any(|r| r.subject.as_deref().is_some_and(|s| l.contains(s)) && r.ground_truth.as_deref().is_some_and(|g| l.contains(g)))
    };
    let kept: Vec<&str> = corpus.lines().filter(|l| !states(l)).collect();
    assert!(kept.len() > 500, "most of the corpus is unrelated to 10 edits");
    let path = dir.join("keep.txt");
    std::fs::write(&path, kept.join("\n")).unwrap();
    path
}

/// `data/editor` with the settings measured for it (λ 0.01, keep weight 0.01, no rounds).
fn ls_spec(keep: PathBuf) -> MethodSpec {
    MethodSpec::MendLs { editor: common::root().join("data/editor"), ls: LsChoice::all(LsConfig::default()), unrelated: Some(keep) }
}

/// `data/editor-many` with the settings its editor.json carries (`ls` unless overridden).
fn many_spec(keep: PathBuf, ls: LsChoice) -> MethodSpec {
    MethodSpec::MendLs { editor: common::root().join("data/editor-many"), ls, unrelated: Some(keep) }
}

fn session(spec: &MethodSpec) -> Session {
    Session::open_method(&common::root().join("data/model"), spec, &LoadOptions::default()).unwrap()
}

#[test]
fn five_sequential_ls_edits_keep_their_answers_and_the_unrelated_prompts() {
    let dir = tempfile::tempdir().unwrap();
    let (records, _) = load_records(&requests(), DatasetKind::Requests).unwrap();
    let records = &records[..5];
    let mut s = session(&ls_spec(keep_text(records, dir.path())));
    let examples = prepare(&s.engine().lm.tokenizer, records, 32, &requests()).unwrap();
    let out = s.edit_examples(records, &examples, true).unwrap();
    assert_eq!(out.edits_total, 5);
    // After the fifth edit, every request answers its new target, and the locality
    // prompts (facts no request edits) answer as the unedited model did.
    for r in &out.requests {
        assert!(r.metrics.edit_success, "{:?} -> {:?} now answers {:?}", r.prompt, r.target_new, r.answer_after);
        assert_eq!(r.answer_after.trim(), r.target_new.trim());
    }
    let loc = out.summary.locality.unwrap();
    assert!(loc >= 0.9, "locality of the unrelated prompts after 5 sequential edits: {loc}");
    // The same five edits summed as MEND makes them break the model (the defect),
    // so the test above is one that summed edits fail.
    let mut plain = session(&MethodSpec::Mend { editor: common::root().join("data/editor") });
    let summed = plain.edit_examples(records, &examples, true).unwrap().summary;
    assert!(summed.reliability < 0.8 || summed.locality.unwrap() < 0.9, "summed MEND: {summed:?}");
}

#[test]
fn sequential_ls_edits_are_the_batch_of_them() {
    let dir = tempfile::tempdir().unwrap();
    let (records, _) = load_records(&requests(), DatasetKind::Requests).unwrap();
    let records = &records[..4];
    let spec = ls_spec(keep_text(records, dir.path()));
    let (mut seq, mut batch) = (session(&spec), session(&spec));
    let examples = prepare(&seq.engine().lm.tokenizer, records, 32, &requests()).unwrap();
    seq.edit_examples(records, &examples, true).unwrap();
    batch.edit_examples(records, &examples, false).unwrap();
    for p in &seq.engine().edit_params {
        let (a, b) = (seq.engine().weight(&p.name).unwrap(), batch.engine().weight(&p.name).unwrap());
        let rel = (a - b).norm().double_value(&[]) / b.norm().double_value(&[]);
        assert!(rel < 1e-4, "{}: sequential and batch weights differ by {rel}", p.name);
    }
    // And a reset forgets the remembered edits: the next edit starts from nothing.
    seq.reset().unwrap();
    let one = seq.edit_examples(&records[..1], &examples[..1], true).unwrap();
    let mut fresh = session(&spec);
    let alone = fresh.edit_examples(&records[..1], &examples[..1], true).unwrap();
    assert_eq!(one.requests[0].answer_after, alone.requests[0].answer_after);
}

#[test]
fn a_failed_ls_edit_call_forgets_what_it_remembered() {
    let dir = tempfile::tempdir().unwrap();
    let (records, _) = load_records(&requests(), DatasetKind::Requests).unwrap();
    let records = &records[..4];
    let spec = ls_spec(keep_text(records, dir.path()));
    let (mut s, mut batch) = (session(&spec), session(&spec));
    let examples = prepare(&s.engine().lm.tokenizer, records, 32, &requests()).unwrap();
    s.edit_examples(&records[..2], &examples[..2], true).unwrap();
    // The call fails after its first commit: weights and the remembered edits go back.
    s.inject_fault_after_commits(Some(1));
    assert!(s.edit_examples(&records[2..], &examples[2..], true).is_err());
    s.inject_fault_after_commits(None);
    s.edit_examples(&records[2..], &examples[2..], true).unwrap();
    // Had the failed call's edit stayed remembered, the re-solve would count it twice.
    batch.edit_examples(records, &examples, false).unwrap();
    for p in &s.engine().edit_params {
        let (a, b) = (s.engine().weight(&p.name).unwrap(), batch.engine().weight(&p.name).unwrap());
        let rel = (a - b).norm().double_value(&[]) / b.norm().double_value(&[]);
        assert!(rel < 1e-4, "{}: after a failed call the edits differ from the batch by {rel}", p.name);
    }
}

#[test]
fn guard_refuses_a_destructive_sequential_edit_on_the_embedded_default() {
    let (records, _) = load_records(&requests(), DatasetKind::Requests).unwrap();
    let records = &records[..5];
    let mut s = session(&MethodSpec::Mend { editor: common::root().join("data/editor") });
    s.guard = Some(GuardConfig { scale_back: false, ..GuardConfig::default() });
    let examples = prepare(&s.engine().lm.tokenizer, records, 32, &requests()).unwrap();
    let out = s.edit_examples(records, &examples, true).unwrap();
    assert_eq!(out.guard.len(), 5);
    let refused: Vec<_> = out.guard.iter().filter(|g| g.decision == Decision::Refused).collect();
    assert!(!refused.is_empty(), "summed MEND edits one after another break the probes; the guard refuses some");
    for g in &refused {
        assert!(g.full.agreement < 0.9 || g.full.kl > 1.0, "refused only what breaks the probes: {}", g.message);
        assert_eq!(g.after, g.before, "a refused edit commits nothing");
    }
    assert!(out.summary.locality.unwrap() >= 0.9, "the model the guard leaves keeps the unrelated answers");
}

fn capacity(grouping: Grouping, keep: PathBuf, report: PathBuf) -> dualedit::run::EvalOutput {
    capacity_of(ls_spec(keep), requests(), grouping, report)
}

fn capacity_of(method: MethodSpec, data: PathBuf, grouping: Grouping, report: PathBuf) -> dualedit::run::EvalOutput {
    let opts = EvalOptions {
        common: Common { report: Some(report), ..Common::single(common::root().join("data/model"), Device::Cpu) },
        method,
        data,
        ds: DatasetKind::Counterfact,
        limit: None,
        max_length: 32,
        capacity: Some(CapacityOptions { grouping, guard: None, stepwise: None, drift_text: Some(common::root().join("data/world/corpus.txt")) }),
    };
    run_eval(&opts, |_, _| {}).unwrap().0
}

#[test]
fn ten_edits_in_one_batch_and_one_after_another_reach_the_targets() {
    let dir = tempfile::tempdir().unwrap();
    let (records, _) = load_records(&requests(), DatasetKind::Requests).unwrap();
    let keep = keep_text(&records, dir.path());
    for g in [Grouping::Batch(10), Grouping::Sequential(10)] {
        let out = capacity(g, keep.clone(), dir.path().join("report.json"));
        let _ = std::fs::remove_file(dir.path().join("report.json"));
        let c = out.capacity.as_ref().unwrap();
        assert_eq!((out.summary.n, c.groups), (10, 1));
        let (rel, loc) = (out.summary.reliability, out.summary.locality.unwrap());
        let want = if matches!(g, Grouping::Batch(_)) { 0.9 } else { 0.8 };
        assert!(rel >= want && loc >= 0.9, "{g:?}: reliability {rel}, locality {loc}");
        let d = c.drift.as_ref().unwrap();
        assert!(d.texts > 700, "corpus lines naming an edited subject are left out of the drift: {}", d.texts);
        assert!(d.nll_after - d.nll_before < 0.1, "{g:?}: unrelated-text NLL {} -> {}", d.nll_before, d.nll_after);
        assert!(c.seconds_per_edit > 0.0);
    }
}

/// The targets at its size: 100 edits in one batch (reliability and locality ≥ 0.9)
/// and one after another (≥ 0.8, ≥ 0.9 for all 100 after the last), with the editor for
/// many edits and the settings in its editor.json; and without the re-solve rounds the
/// same editor misses the batch target, so the rounds are what this test holds.
#[test]
fn hundred_edits_in_one_batch_and_one_after_another_reach_the_targets() {
    let dir = tempfile::tempdir().unwrap();
    let (records, _) = load_records(&hundred(), DatasetKind::Requests).unwrap();
    assert_eq!(records.len(), 100);
    let keep = keep_text(&records, dir.path());
    let run = |ls: LsChoice, g: Grouping| {
        let out = capacity_of(many_spec(keep.clone(), ls), hundred(), g, dir.path().join("report.json"));
        let _ = std::fs::remove_file(dir.path().join("report.json"));
        assert_eq!(out.summary.n, 100);
        out
    };
    for (g, want) in [(Grouping::Batch(100), 0.9), (Grouping::Sequential(100), 0.8)] {
        let out = run(LsChoice::default(), g);
        let (rel, loc) = (out.summary.reliability, out.summary.locality.unwrap());
        println!("{g:?}: reliability {rel}, generalization {:?}, locality {loc}", out.summary.generalization);
        assert!(rel >= want && loc >= 0.9, "{g:?}: reliability {rel}, locality {loc}");
        let d = out.capacity.as_ref().unwrap().drift.as_ref().unwrap();
        assert!(d.nll_after - d.nll_before < 0.1, "{g:?}: unrelated-text NLL {} -> {}", d.nll_before, d.nll_after);
    }
    let once = run(LsChoice { rounds: Some(0), ..LsChoice::default() }, Grouping::Batch(100));
    assert!(once.summary.reliability < 0.9, "one solve alone already reaches {}", once.summary.reliability);
}

/// A round that makes no more edits answer is dropped: with `data/editor`, whose inputs leave
/// their training range at edited weights (re-solving on them broke the model before the
/// rule), asking for rounds changes nothing in one batch.
#[test]
fn re_solve_rounds_never_end_worse_than_one_solve() {
    let dir = tempfile::tempdir().unwrap();
    let (records, _) = load_records(&hundred(), DatasetKind::Requests).unwrap();
    let records = &records[..40];
    let keep = keep_text(records, dir.path());
    let ls = |rounds| MethodSpec::MendLs { editor: common::root().join("data/editor"), ls: LsChoice { rounds: Some(rounds), ..LsChoice::all(LsConfig::default()) }, unrelated: Some(keep.clone()) };
    let (mut once, mut rounds) = (session(&ls(0)), session(&ls(3)));
    let examples = prepare(&once.engine().lm.tokenizer, records, 32, &hundred()).unwrap();
    let a = once.edit_examples(records, &examples, false).unwrap().summary;
    let b = rounds.edit_examples(records, &examples, false).unwrap().summary;
    assert!(b.edit_success >= a.edit_success, "rounds {b:?} against one solve {a:?}");
    assert!(b.locality.unwrap() >= 0.5, "the rounds broke the model: {b:?}");
}

/// Edits in two calls with the editor for many edits: the first call's edits still answer
/// after the second call (re-solved over all of them, each call's rounds checking the
/// remembered edits too), and a reset forgets them all.
#[test]
fn later_calls_keep_the_earlier_edits_and_a_reset_forgets_them() {
    let dir = tempfile::tempdir().unwrap();
    let (records, _) = load_records(&hundred(), DatasetKind::Requests).unwrap();
    let records = &records[..30];
    let mut s = session(&many_spec(keep_text(records, dir.path()), LsChoice::default()));
    let examples = prepare(&s.engine().lm.tokenizer, records, 32, &hundred()).unwrap();
    let first = s.edit_examples(&records[..20], &examples[..20], false).unwrap();
    let later = s.edit_examples(&records[20..], &examples[20..], true).unwrap();
    assert_eq!(later.edits_total, 30);
    // After the last call the first twenty still answer their targets.
    let mut still = 0;
    for (r, e) in records[..20].iter().zip(&examples[..20]) {
        let got = dualedit::edit::answer(s.engine(), &e.inner).unwrap();
        still += usize::from(got.trim() == r.target_new.trim());
    }
    let made = first.requests.iter().filter(|r| r.metrics.edit_success).count();
    assert!(made >= 18 && still >= made - 1, "{made} of the first 20 made, {still} still answer after 10 more");
    s.reset().unwrap();
    let again = s.edit_examples(&records[..1], &examples[..1], true).unwrap();
    let mut fresh = session(&many_spec(keep_text(records, dir.path()), LsChoice::default()));
    let alone = fresh.edit_examples(&records[..1], &examples[..1], true).unwrap();
    assert_eq!(again.requests[0].answer_after, alone.requests[0].answer_after);
}
