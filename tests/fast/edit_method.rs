//! A new edit method needs one place: an `impl EditMethod`. This toy method, defined here
//! outside the crate, runs through `Session` like the built-in ones: the session commits
//! its proposals, asks the guard about them, tells the method what became of each, and
//! puts the weights and the method's state back when a call fails or the session resets.
use std::sync::{Arc, Mutex};

use dualedit::data::TokenBatch;
use dualedit::device::DevicePlan;
use dualedit::edit::method::Snapshot;
use dualedit::edit::session::Session;
use dualedit::edit::{EditCall, EditMethod};
use dualedit::mend::guard::GuardConfig;
use dualedit::mend::Engine;
use dualedit::model::{load_model, Overrides};
use tch::{Device, Kind, Tensor};

use crate::common;

/// Adds `step` to every edited weight, times the number of requests in the batch; fails
/// its proposal number `fail_at` (counting from 1). It remembers how many of its edits
/// were committed (its state), and logs every call the session makes.
struct Nudge {
    step: f64,
    fail_at: Option<usize>,
    proposals: usize,
    committed: usize,
    log: Arc<Mutex<Vec<String>>>,
}

impl Nudge {
    fn note(&self, s: String) {
        self.log.lock().unwrap().push(s);
    }
}

impl EditMethod for Nudge {
    fn name(&self) -> &'static str {
        "nudge"
    }

    fn propose(&mut self, engine: &Engine, inner: &TokenBatch, call: &EditCall) -> dualedit::Result<Overrides> {
        self.proposals += 1;
        self.note(format!("propose {} sequential={}", inner.batch_size(), call.sequential));
        if self.fail_at == Some(self.proposals) {
            return Err(dualedit::Error::Torch(format!("nudge failed at proposal {}", self.proposals)));
        }
        engine.edit_params.iter().map(|p| Ok((p.name.clone(), engine.weight(&p.name)? + self.step * inner.batch_size() as f64))).collect()
    }

    fn committed(&mut self, scale: f64) {
        self.committed += usize::from(scale > 0.0);
        self.note(format!("committed {scale}"));
    }

    fn snapshot(&self) -> Snapshot {
        Box::new(self.committed)
    }

    fn restore(&mut self, snapshot: Snapshot) {
        self.committed = *snapshot.downcast::<usize>().unwrap();
        self.note(format!("restore {}", self.committed));
    }

    fn reset(&mut self) {
        self.committed = 0;
        self.note("reset".into());
    }
}

fn session(step: f64, fail_at: Option<usize>) -> (Session, Arc<Mutex<Vec<String>>>, String, Tensor) {
    let lm = load_model(&common::fixture("gpt2"), Device::Cpu, Kind::Float).unwrap();
    let engine = Engine::new(lm, DevicePlan::single(Device::Cpu), &[]).unwrap();
    let name = engine.edit_params[0].name.clone();
    let loaded = engine.weight(&name).unwrap().copy();
    let log = Arc::new(Mutex::new(Vec::new()));
    let toy = Nudge { step, fail_at, proposals: 0, committed: 0, log: log.clone() };
    (Session::with_method(engine, Box::new(toy)), log, name, loaded)
}

fn taken(log: &Arc<Mutex<Vec<String>>>) -> Vec<String> {
    std::mem::take(&mut *log.lock().unwrap())
}

#[test]
fn a_toy_method_runs_through_the_session_commit_guard_rollback_and_reset() {
    common::init();
    let records = common::records();
    let (mut s, log, name, loaded) = session(1e-4, None);
    let diff = |s: &Session| f64::try_from((s.engine().weight(&name).unwrap() - &loaded).abs().max()).unwrap();

    // A batch: one proposal of every request, committed whole without a guard.
    let out = s.edit(&records[..2]).unwrap();
    assert_eq!((out.method, out.refused, s.edits_total(), s.method_name()), ("nudge", 0, 2, "nudge"));
    assert_eq!(taken(&log), ["propose 2 sequential=false", "committed 1"]);
    assert!((diff(&s) - 2e-4).abs() < 1e-6, "the committed weight moved by {}", diff(&s));

    // One after another: a proposal per request, each at the weights the one before left.
    let out = s.edit_examples(&records[..2], &examples(&s, &records[..2]), true).unwrap();
    assert_eq!((out.sequential, s.edits_total()), (true, 4));
    assert_eq!(taken(&log), ["propose 1 sequential=true", "committed 1", "propose 1 sequential=true", "committed 1"]);
    assert!((diff(&s) - 4e-4).abs() < 1e-6);

    // Reset: the loaded weights back, and the method forgets its edits.
    s.reset().unwrap();
    assert_eq!(taken(&log), ["reset"]);
    assert_eq!((diff(&s), s.edits_total()), (0.0, 0));

    // The guard judges the toy's proposals like any method's: a huge nudge breaks the
    // locality probes and is refused, and the method hears scale 0.
    let (mut big, big_log, big_name, big_loaded) = session(1.0, None);
    big.guard = Some(GuardConfig { scale_back: false, ..GuardConfig::default() });
    let out = big.edit(&records[..1]).unwrap();
    assert_eq!((out.refused, out.guard.len(), big.edits_total()), (1, 1, 0), "{:?}", out.guard);
    assert_eq!(taken(&big_log), ["propose 1 sequential=false", "committed 0"]);
    assert!(big.engine().weight(&big_name).unwrap().equal(&big_loaded), "a refused proposal is not committed");
}

#[test]
fn a_toy_method_that_fails_mid_call_leaves_weights_and_state_as_before() {
    common::init();
    let records = common::records();
    // Proposal 3 fails: the second request of the second, sequential call.
    let (mut s, log, name, _) = session(1e-4, Some(3));
    s.edit(&records[..1]).unwrap();
    let before = s.engine().weight(&name).unwrap().copy();
    taken(&log);
    let err = s.edit_examples(&records[..2], &examples(&s, &records[..2]), true).unwrap_err().to_string();
    assert!(err.contains("nudge failed at proposal 3"), "{err}");
    // The first request of the failed call was committed, then put back; the method's
    // count of committed edits is the one before the call.
    assert_eq!(taken(&log), ["propose 1 sequential=true", "committed 1", "propose 1 sequential=true", "restore 1"]);
    assert!(s.engine().weight(&name).unwrap().equal(&before));
    assert_eq!(s.edits_total(), 1);
}

fn examples(s: &Session, records: &[dualedit::data::EditRecord]) -> Vec<dualedit::data::EditExample> {
    dualedit::data::examples::prepare(&s.engine().lm.tokenizer, records, 64, std::path::Path::new("inline.json")).unwrap()
}
