//! Capacity measurement (issue #24): how many edits a model keeps.
//!
//! A dataset's records are cut into groups of `N`. Each group starts from the unedited
//! model ([`Session::reset`]) and is edited either as one batch of `N` or as `N` edits
//! committed one after another (the session's guard and stepwise settings apply), through
//! [`Session::edit_examples`], the same path `dualedit edit` takes. The metrics of all `N`
//! records are measured after the group's last edit (EasyEdit's sequential evaluation),
//! and the mean NLL of unrelated text before and after the group tells how far the model
//! drifted beyond the locality prompts.
use serde::Serialize;

use crate::data::easyedit::EditRecord;
use crate::data::{EditExample, Example};
use crate::edit::conflicts::{self, Conflict};
use crate::edit::eval::RecordMetrics;
use crate::mend::guard::Decision;
use crate::mend::losses;
use crate::edit::session::Session;
use crate::{Error, Result};

/// How the records of one group are edited.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase", tag = "mode", content = "n")]
pub enum Grouping {
    /// `N` records in one batch edit.
    Batch(usize),
    /// `N` records edited one after another, each committed before the next.
    Sequential(usize),
}

impl Grouping {
    pub fn size(&self) -> usize {
        match *self {
            Grouping::Batch(n) | Grouping::Sequential(n) => n,
        }
    }

    /// The same grouping with groups of `n`.
    fn with_size(self, n: usize) -> Self {
        match self {
            Grouping::Batch(_) => Grouping::Batch(n),
            Grouping::Sequential(_) => Grouping::Sequential(n),
        }
    }
}

/// Mean NLL per token of the unrelated texts, before and after one group's edits.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Drift {
    /// Texts scored (those naming an edited subject are left out).
    pub texts: usize,
    pub nll_before: f64,
    pub nll_after: f64,
}

/// What [`measure`] found, besides the per-record metrics.
#[derive(Debug, Clone, Serialize)]
pub struct CapacityReport {
    /// The grouping that ran: `n` is at most the number of records.
    #[serde(flatten)]
    pub grouping: Grouping,
    /// The group size asked for, when it was larger than the records and cut to them
    /// (a group of 100000 on 50 records edits the 50: `n` says 50, this 100000).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub n_requested: Option<usize>,
    /// Groups edited (the last one may be smaller than `N`).
    pub groups: usize,
    /// Wall-clock seconds of the edits (commits and guard included, measuring excluded)
    /// divided by the number of records.
    pub seconds_per_edit: f64,
    /// Means over groups of [`Drift`]; `None` without unrelated texts.
    pub drift: Option<Drift>,
    /// The guard's decisions over all groups (all zero without a guard).
    pub guard_accepted: usize,
    pub guard_scaled: usize,
    pub guard_refused: usize,
    /// Over all groups: locality prompts naming a subject edited in the same group (left
    /// out of the guard's verdict and of the drift texts) and pairs of contradictory
    /// requests ([`crate::edit::conflicts`]).
    pub locality_conflicts: usize,
    pub contradictions: usize,
}

/// Mean over `texts` of each one's mean NLL per token (every token after the first),
/// under the session's current weights, scored in batches of 64. Texts longer than the
/// model's context are cut to it; texts of fewer than two tokens are left out.
fn mean_nll(session: &Session, texts: &[&str]) -> Result<(usize, f64)> {
    let engine = session.engine();
    let max = session.max_positions().max(2);
    let mut examples = Vec::with_capacity(texts.len());
    for t in texts {
        let mut ids = engine.lm.tokenizer.encode(t)?;
        ids.truncate(max);
        if ids.len() >= 2 {
            examples.push(Example { ids, answer_start: 1, image: None });
        }
    }
    let _g = tch::no_grad_guard();
    let mut sum = 0.0;
    for chunk in examples.chunks(64) {
        let refs: Vec<&Example> = chunk.iter().collect();
        let batch = engine.collate(&refs)?;
        let logits = engine.base_logits(&batch)?;
        sum += crate::error::guard(|| {
            Ok(losses::nll_per_row(&logits, &batch.kept_targets(), &batch.kept_rows(), batch.batch_size()).iter().sum::<f64>())
        })?;
    }
    Ok((examples.len(), sum / examples.len().max(1) as f64))
}

/// Edits `examples` (`records[i]` tokenised as `examples[i]`) in groups as `grouping` says,
/// each group from the model the session was opened with, and returns every record's
/// metrics after its group's last edit and the report. `unrelated`: texts whose NLL drift
/// is measured (a text containing an edited record's subject is skipped for that group);
/// empty: the groups' locality prompts followed by their ground truths.
pub fn measure(
    session: &mut Session,
    records: &[EditRecord],
    examples: &[EditExample],
    grouping: Grouping,
    unrelated: &[String],
    mut on_group: impl FnMut(usize, &[RecordMetrics]),
) -> Result<(Vec<RecordMetrics>, CapacityReport)> {
    let requested = grouping.size();
    if requested == 0 {
        return Err(Error::input("the group size (`edits_per_batch` / `sequential`) must be at least 1"));
    }
    if records.len() != examples.len() {
        return Err(Error::input("records and examples differ in number"));
    }
    if examples.is_empty() {
        return Err(Error::input("no records to edit (`edits_per_batch` / `sequential`)"));
    }
    // A group larger than the data edits all of it once: say so, and report what ran.
    let n = requested.min(examples.len());
    let n_requested = (n < requested).then(|| {
        tracing::warn!(requested, records = examples.len(), "the group size is larger than the records: one group of all {} records is edited", examples.len());
        requested
    });
    let grouping = grouping.with_size(n);
    let sequential = matches!(grouping, Grouping::Sequential(_));
    let (mut all, mut drifts, mut seconds) = (Vec::with_capacity(examples.len()), Vec::new(), 0.0);
    let (mut accepted, mut scaled, mut refused) = (0, 0, 0);
    let (mut locality_conflicts, mut contradictions) = (0, 0);
    for (g, (recs, exs)) in records.chunks(n).zip(examples.chunks(n)).enumerate() {
        session.reset()?;
        let texts: Vec<String> = if unrelated.is_empty() {
            let excluded = conflicts::probe_excluded(&conflicts::find(recs, &[]), recs.len());
            recs.iter()
                .zip(excluded)
                .filter(|(_, x)| !x)
                .filter_map(|(r, _)| Some(format!("{} {}", r.locality_prompt.as_ref()?, r.locality_ground_truth.as_ref()?)))
                .collect()
        } else {
            let subjects: Vec<&str> = recs.iter().filter_map(|r| r.subject.as_deref()).filter(|s| !s.is_empty()).collect();
            unrelated.iter().filter(|t| !subjects.iter().any(|s| t.contains(s))).cloned().collect()
        };
        let texts: Vec<&str> = texts.iter().map(String::as_str).collect();
        let (scored, nll_before) = mean_nll(session, &texts)?;
        let out = session.edit_examples(recs, exs, sequential)?;
        // Per-record edit seconds are the group's edit time over its size.
        seconds += out.requests.first().map_or(0.0, |r| r.metrics.seconds_per_edit) * exs.len() as f64;
        if scored > 0 {
            drifts.push(Drift { texts: scored, nll_before, nll_after: mean_nll(session, &texts)?.1 });
        }
        for c in &out.conflicts {
            match c {
                Conflict::LocalityOfEditedSubject { .. } => locality_conflicts += 1,
                Conflict::Contradiction { .. } => contradictions += 1,
            }
        }
        for rep in &out.guard {
            match rep.decision {
                Decision::Accepted => accepted += 1,
                Decision::Scaled => scaled += 1,
                Decision::Refused => refused += 1,
            }
        }
        let metrics: Vec<RecordMetrics> = out.requests.into_iter().map(|r| r.metrics).collect();
        on_group(g, &metrics);
        all.extend(metrics);
    }
    session.reset()?;
    let groups = examples.len().div_ceil(n);
    let drift = (!drifts.is_empty()).then(|| {
        let k = drifts.len() as f64;
        Drift {
            texts: drifts.iter().map(|d| d.texts).sum::<usize>() / drifts.len(),
            nll_before: drifts.iter().map(|d| d.nll_before).sum::<f64>() / k,
            nll_after: drifts.iter().map(|d| d.nll_after).sum::<f64>() / k,
        }
    });
    let report = CapacityReport {
        grouping,
        n_requested,
        groups,
        seconds_per_edit: seconds / examples.len().max(1) as f64,
        drift,
        guard_accepted: accepted,
        guard_scaled: scaled,
        guard_refused: refused,
        locality_conflicts,
        contradictions,
    };
    Ok((all, report))
}
