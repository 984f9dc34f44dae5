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
        let got = dualedit::placed::generate::answer(s.engine(), &e.inner).unwrap();
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

/// Requests no editor was meta-trained on (issue #36): `scripts/seq_requests.py
/// tests/fixtures/many --fresh-targets 50`, one record per fact, each fact given an object
/// of its relation that no training or held-out record gives it.
fn fresh() -> PathBuf {
    common::root().join("tests/fixtures/many/fresh-50.json")
}

/// What `dualedit edit` / `eval` run without `--method`: `--method auto` with the embedded
/// default's `data/editor`, whose editor.json names `data/editor-many` for many edits.
fn default_spec(many: bool) -> MethodSpec {
    MethodSpec::Auto { editor: common::root().join("data/editor"), ls: LsChoice::default(), unrelated: None, many }
}

/// Issue #36, item 1: a batch the guard refuses commits nothing, says so in `refused`,
/// and `dualedit edit` (`run_edit`) fails with the guard's numbers after writing its
/// report, never a success with `nll_post == nll_pre`.
#[test]
fn a_batch_the_guard_refuses_is_an_error_with_its_numbers() {
    let (records, _) = load_records(&requests(), DatasetKind::Requests).unwrap();
    // Ten summed MEND edits break the probes (docs/notebook/many-edits.md, part 2), and without
    // scaling back the guard refuses them.
    let strict = GuardConfig { scale_back: false, ..GuardConfig::default() };
    let mut s = session(&MethodSpec::Mend { editor: common::root().join("data/editor") });
    s.guard = Some(strict.clone());
    let examples = prepare(&s.engine().lm.tokenizer, &records, 32, &requests()).unwrap();
    let before = s.score("The capital of Vacorp is").unwrap();
    let out = s.edit_examples(&records, &examples, false).unwrap();
    assert_eq!((out.refused, s.edits_total()), (10, 0));
    assert_eq!(s.score("The capital of Vacorp is").unwrap().logprobs, before.logprobs, "nothing committed");
    let err = out.refused_error().expect("all refused").to_string();
    assert!(err.contains("refused all 10 edits") && err.contains("nothing was committed"), "{err}");
    assert!(err.contains("agreement") && err.contains("`guard`=false"), "the numbers and the way out: {err}");
    // The CLI's run: an error naming its report, which is written; nothing saved.
    let dir = tempfile::tempdir().unwrap();
    let opts = dualedit::run::EditOptions {
        common: Common { report: Some(dir.path().join("edit.json")), ..Common::single(common::root().join("data/model"), Device::Cpu) },
        method: MethodSpec::Mend { editor: common::root().join("data/editor") },
        requests: requests(),
        ds: DatasetKind::Requests,
        sequential: false,
        save: Some(dir.path().join("saved")),
        max_length: 32,
        guard: Some(strict),
        stepwise: None,
    };
    let err = dualedit::run::run_edit(&opts).err().expect("a refused batch fails the run").to_string();
    assert!(err.contains("refused all 10 edits") && err.contains("edit.json"), "{err}");
    assert!(dir.path().join("edit.json").is_file() && !dir.path().join("saved").exists());
}

/// Issue #36, item 2: statistics computed over a text, written whole into an editor's
/// folder and named in its editor.json, read back equal; an editor of other weights and
/// an empty text are errors naming the file.
#[test]
fn key_statistics_round_trip_and_refuse_what_does_not_fit() {
    use dualedit::mend::stats::{KeyStats, KEY_STATS_FILE};
    let dir = tempfile::tempdir().unwrap();
    let editor = dir.path().join("editor");
    std::fs::create_dir(&editor).unwrap();
    for f in ["editor.json", "editor.safetensors"] {
        std::fs::copy(common::root().join("data/editor-many").join(f), editor.join(f)).unwrap();
    }
    let text = dir.path().join("text.txt");
    std::fs::write(&text, "Vikica does business in mining.\n\nKremmum works as a sailor.\n").unwrap();
    let opts = LoadOptions::default();
    let names = dualedit::edit::editor_params(&editor).unwrap();
    let engine = dualedit::edit::open_engine(&common::root().join("data/model"), &opts, &names).unwrap();
    let mut stats = KeyStats::compute(&engine, &text, 1_000_000, false).unwrap();
    assert_eq!(stats.meta.lines, 2);
    assert_eq!(stats.sums.len(), names.len());
    let path = stats.write_for_editor(&editor).unwrap();
    assert_eq!(path, editor.join(KEY_STATS_FILE));
    let meta = dualedit::mend::checkpoint::read_editor_json(&editor).unwrap();
    assert_eq!(meta.key_stats.as_deref(), Some(KEY_STATS_FILE));
    let back = KeyStats::load(&path, &engine).unwrap();
    assert_eq!(back.meta, stats.meta);
    for (a, b) in back.sums.iter().zip(&stats.sums) {
        // Stored in f32.
        let rel = (a - b).norm().double_value(&[]) / b.norm().double_value(&[]);
        assert!(rel < 1e-6, "{rel}");
    }
    // `--max-tokens` stops the pass: fewer tokens than the whole text.
    let capped = KeyStats::compute(&engine, &text, 5, false).unwrap();
    assert!(capped.meta.tokens <= 6.0 && capped.meta.tokens < stats.meta.tokens, "{:?}", capped.meta);
    // Statistics of other weights (data/editor edits the input projections too).
    let other = dualedit::edit::open_engine(&common::root().join("data/model"), &opts, &dualedit::edit::editor_params(&common::root().join("data/editor")).unwrap()).unwrap();
    let err = KeyStats::load(&path, &other).err().expect("other weights").to_string();
    assert!(err.contains(KEY_STATS_FILE) && err.contains("edits"), "{err}");
    let empty = dir.path().join("empty.txt");
    std::fs::write(&empty, "\n  \n").unwrap();
    let err = KeyStats::compute(&engine, &empty, 1000, false).err().expect("empty text").to_string();
    assert!(err.contains("empty.txt"), "{err}");
}

/// An editor folder in `dir/name` with `data/editor-many`'s weights and statistics over
/// `text` (written with its fingerprint, as `dualedit stats` does).
fn editor_with_stats(dir: &Path, name: &str, text: &Path) -> PathBuf {
    let editor = dir.join(name);
    std::fs::create_dir(&editor).unwrap();
    for f in ["editor.json", "editor.safetensors"] {
        std::fs::copy(common::root().join("data/editor-many").join(f), editor.join(f)).unwrap();
    }
    let names = dualedit::edit::editor_params(&editor).unwrap();
    let engine = dualedit::edit::open_engine(&common::root().join("data/model"), &LoadOptions::default(), &names).unwrap();
    dualedit::mend::stats::KeyStats::compute(&engine, text, usize::MAX, false).unwrap().write_for_editor(&editor).unwrap();
    editor
}

/// The edited weights after one unguarded batch of `records` with `mend-ls` (one solve, no
/// rounds) and the editor's statistics.
fn solved(editor: &Path, records: &[EditRecord]) -> Vec<tch::Tensor> {
    let ls = LsChoice { rounds: Some(0), ..LsChoice::default() };
    let mut s = session(&MethodSpec::MendLs { editor: editor.to_path_buf(), ls, unrelated: None });
    s.guard = None;
    let examples = prepare(&s.engine().lm.tokenizer, records, 32, &fresh()).unwrap();
    s.edit_examples(records, &examples, false).unwrap();
    let names = dualedit::edit::editor_params(editor).unwrap();
    names.iter().map(|n| s.engine().weight(n).unwrap().copy()).collect()
}

fn max_rel_diff(a: &[tch::Tensor], b: &[tch::Tensor]) -> f64 {
    a.iter().zip(b).map(|(a, b)| (a - b).abs().max().double_value(&[]) / b.abs().max().double_value(&[])).fold(0.0, f64::max)
}

/// Issue #36, generalisation: the solve leaves out of the key statistics the lines that
/// state a fact the edits rewrite (subject and old answer), exactly as statistics computed
/// without those lines; requests that name no subject leave nothing out; a text changed
/// since the statistics were summed is not used.
#[test]
fn the_solve_leaves_the_edited_facts_own_lines_out_of_the_statistics() {
    use dualedit::mend::stats::SummedText;
    let dir = tempfile::tempdir().unwrap();
    let (records, _) = load_records(&fresh(), DatasetKind::Requests).unwrap();
    let records = &records[..10];
    let corpus = common::root().join("data/world/corpus.txt");
    let full = editor_with_stats(dir.path(), "full", &corpus);
    let without = editor_with_stats(dir.path(), "without", &keep_text(records, dir.path()));
    let left_out = solved(&full, records);
    let same = max_rel_diff(&left_out, &solved(&without, records));
    // Without subjects nothing is left out: the full statistics' solve, another one.
    let anonymous: Vec<EditRecord> = records.iter().map(|r| EditRecord { subject: None, ..r.clone() }).collect();
    let other = max_rel_diff(&solved(&full, &anonymous), &left_out);
    println!("largest weight change between the solves, relative to the weight: {same:.2e} (statistics without the lines), {other:.2e} (nothing left out)");
    // The solve is f32 at λ 1e-6: the two ways of forming the same statistics (f64 sums
    // less f32 ones, f64 sums of fewer lines) round differently, by 3e-3 of the weight
    // here (7.9e-4 at λ 1e-4, 1.8e-4 at λ 1e-2: rounding, amplified by the conditioning).
    assert!(same < 1e-2 && other > 10.0 * same, "leaving the lines out = statistics without them: {same} against {other}");
    // The text is found beside an ancestor of the editor when it was given relative, and
    // only while its summed lines are unchanged.
    let stats = dualedit::mend::stats::KeyStats::load(&full.join("key-stats.safetensors"), &dualedit::edit::open_engine(&common::root().join("data/model"), &LoadOptions::default(), &dualedit::edit::editor_params(&full).unwrap()).unwrap()).unwrap();
    let text = SummedText::find(&stats.meta, &full).expect("the corpus as summed");
    assert_eq!((text.lines.len(), text.tokens), (stats.meta.lines, stats.meta.tokens));
    std::fs::create_dir(dir.path().join("world")).unwrap();
    let moved = dir.path().join("world/corpus.txt");
    std::fs::copy(&corpus, &moved).unwrap();
    let relative = dualedit::mend::stats::StatsMeta { text: "world/corpus.txt".into(), ..stats.meta.clone() };
    assert!(SummedText::find(&relative, &full).is_some(), "found under the editor's parent");
    let changed = std::fs::read_to_string(&moved).unwrap().replacen("mining", "fishing", 1);
    std::fs::write(&moved, changed).unwrap();
    assert!(SummedText::find(&relative, &full).is_none(), "a changed text is not used");
    let older = dualedit::mend::stats::StatsMeta { text_fnv: None, ..stats.meta.clone() };
    assert!(SummedText::find(&older, &full).is_none(), "statistics without a fingerprint leave nothing out");
}

/// Issue #36, item 4: the default method picks by the number of requests, and the
/// shipped editor for many edits carries its statistics.
#[test]
fn the_default_method_is_mend_for_one_request_and_mend_ls_for_several() {
    let (one, single) = default_spec(false).resolved().unwrap();
    assert!(matches!(one, MethodSpec::Mend { .. }) && !single);
    let (many, single) = default_spec(true).resolved().unwrap();
    match many {
        MethodSpec::MendLs { editor, unrelated: None, .. } => assert!(editor.ends_with("editor-many"), "{editor:?}"),
        other => panic!("several edits: {other:?}"),
    }
    assert!(single, "a session opened for many edits makes a single request with plain mend");
    assert!(dualedit::mend::stats::editor_stats_path(&common::root().join("data/editor-many")).unwrap().is_some_and(|p| p.is_file()));
    // A session opened for many edits: one request is a plain MEND edit of editor-many;
    // two are a solve.
    let (records, _) = load_records(&fresh(), DatasetKind::Requests).unwrap();
    let mut s = session(&default_spec(true));
    let examples = prepare(&s.engine().lm.tokenizer, &records[..3], 32, &fresh()).unwrap();
    assert_eq!(s.edit_examples(&records[..1], &examples[..1], false).unwrap().method, "mend");
    s.reset().unwrap();
    assert_eq!(s.edit_examples(&records[..2], &examples[..2], false).unwrap().method, "mend-ls");
    assert_eq!(s.edit_examples(&records[2..3], &examples[2..3], false).unwrap().method, "mend-ls", "after mend-ls edits, one more joins the solve");
}

/// Issue #36, item 5: the default command (`--method auto`, no keep text, the guard on)
/// on 50 requests in one batch and 20 one after another, measured after the last edit.
#[test]
fn the_default_command_holds_fifty_in_one_batch_and_twenty_in_a_row() {
    let dir = tempfile::tempdir().unwrap();
    let run = |g: Grouping, limit: usize| {
        let opts = EvalOptions {
            common: Common { report: Some(dir.path().join("report.json")), ..Common::single(common::root().join("data/model"), Device::Cpu) },
            method: default_spec(true),
            data: fresh(),
            ds: DatasetKind::Counterfact,
            limit: Some(limit),
            max_length: 32,
            capacity: Some(CapacityOptions { grouping: g, guard: Some(GuardConfig::default()), stepwise: None, drift_text: Some(common::root().join("data/world/corpus.txt")) }),
        };
        let out = run_eval(&opts, |_, _| {}).unwrap().0;
        let _ = std::fs::remove_file(dir.path().join("report.json"));
        assert_eq!((out.summary.n, out.method.as_str()), (limit, "mend-ls"));
        let s = &out.summary;
        println!("{g:?}: reliability {}, generalization {:?}, locality {:?}", s.reliability, s.generalization, s.locality);
        (s.reliability, s.generalization.unwrap(), s.locality.unwrap(), out.capacity.unwrap().drift.unwrap())
    };
    let (rel, gen, loc, drift) = run(Grouping::Batch(50), 50);
    assert!(rel >= BATCH.0 && gen >= BATCH.1 && loc >= BATCH.2, "50 in one batch: {rel} / {gen} / {loc}");
    assert!(drift.nll_after - drift.nll_before < 0.1, "unrelated-text NLL {} -> {}", drift.nll_before, drift.nll_after);
    let (rel, gen, loc, _) = run(Grouping::Sequential(20), 20);
    assert!(rel >= SEQUENTIAL.0 && gen >= SEQUENTIAL.1 && loc >= SEQUENTIAL.2, "20 one after another: {rel} / {gen} / {loc}");
}

/// What the default command reaches (reliability, generalisation, locality) less a margin:
/// measured 0.96 / 0.40 / 1.00 in one batch of 50 and 0.89 / 0.45 / 1.00 for 20 in a row
/// (0.94 / 0.35 and 0.81 / 0.29 before the statistics left the edited facts' lines out
/// and `data/editor-many` took a fourth re-solve round).
/// The targets are 0.95 / 0.80 / 0.90 and 0.90 / 0.75 / 0.90: reliability in one
/// batch is met here, sequential reliability and generalisation are not
/// (docs/notebook/many-edits.md, "Many edits by default" and part 7).
const BATCH: (f64, f64, f64) = (0.93, 0.36, 0.9);
const SEQUENTIAL: (f64, f64, f64) = (0.82, 0.4, 0.9);
