//! The pieces of one edit call that [`super::session::Session`] runs: its commits, each
//! keeping what it replaced so a failed call can be undone, and its commit guard, which
//! measures each proposal on the call's locality probes before it is committed.
use std::collections::HashMap;

use tch::Tensor;

use crate::data::{Example, TokenBatch};
use crate::mend::guard::{self, GuardConfig, GuardReport, Probes};
use crate::mend::Engine;
use crate::model::Overrides;
use crate::{Error, Result};

/// The commits of one edit call. Each keeps the loaded tensor of every weight it changes
/// for the first time in the session (`originals`, what `reset` puts back) and the tensor
/// before the call (`before_call`, what a failed call puts back).
pub(super) struct Commits<'a> {
    pub before_call: &'a mut HashMap<String, Tensor>,
    pub originals: &'a mut HashMap<String, Tensor>,
    /// Commits made so far in this call.
    count: usize,
    /// Test builds: fail right after this many commits.
    fault_after: Option<usize>,
}

impl<'a> Commits<'a> {
    pub fn new(before_call: &'a mut HashMap<String, Tensor>, originals: &'a mut HashMap<String, Tensor>, fault_after: Option<usize>) -> Self {
        Self { before_call, originals, count: 0, fault_after }
    }

    /// Writes `overrides` into the engine's weights (both devices).
    pub fn commit(&mut self, engine: &mut Engine, overrides: &Overrides) -> Result<()> {
        for name in overrides.names() {
            if !self.before_call.contains_key(name) {
                self.before_call.insert(name.clone(), engine.weight(name)?.shallow_clone());
            }
            if !self.originals.contains_key(name) {
                self.originals.insert(name.clone(), engine.weight(name)?.shallow_clone());
            }
        }
        engine.commit(overrides)?;
        self.count += 1;
        if self.fault_after == Some(self.count) {
            return Err(Error::Torch(format!("injected fault after commit {}", self.count)));
        }
        Ok(())
    }
}

/// The commit guard of one call: its settings and probes (`None` when off, or when the
/// call has no probe to measure), and its decision on each proposal so far.
pub(super) struct CallGuard<'a> {
    active: Option<(&'a GuardConfig, Probes)>,
    pub reports: Vec<GuardReport>,
    /// The probes' measure on the weights as the last check left them (what it returned
    /// committed, or nothing when it refused): the next check's `before`, not measured again.
    current: Option<guard::ProbeMeasure>,
}

impl<'a> CallGuard<'a> {
    /// The guard over `probes` (the call's locality prompts, the excluded ones left out:
    /// `excluded_any` says whether there were any) with `cfg`, measured against the
    /// weights now.
    pub fn new(engine: &Engine, cfg: Option<&'a GuardConfig>, probes: &[&Example], excluded_any: bool) -> Result<Self> {
        let active = match cfg {
            Some(cfg) => guard::Probes::new(engine, probes)?.map(|p| (cfg, p)),
            None => None,
        };
        if cfg.is_some() && active.is_none() {
            let why = if excluded_any { "every locality prompt names a subject this call edits" } else { "no request has a locality prompt" };
            tracing::warn!("{why}: the commit guard has nothing to measure and is off");
        }
        // The probes' reference is the weights now: the first check starts from it.
        let current = active.as_ref().map(|(_, p)| p.at_reference());
        Ok(Self { active, reports: Vec::new(), current })
    }

    /// Whether proposals are measured (and reported).
    pub fn on(&self) -> bool {
        self.active.is_some()
    }

    /// The proposal to commit (whole or scaled back), or `None` when the guard refuses it.
    /// The caller commits what it returns before the next check, which takes the probes'
    /// score of those weights from this one.
    pub fn check(&mut self, engine: &Engine, proposal: Overrides, inner: &TokenBatch) -> Result<Option<Overrides>> {
        let Some((cfg, probes)) = &self.active else { return Ok(Some(proposal)) };
        let before = match self.current.take() {
            Some(m) => m,
            None => probes.measure_each(engine, &Overrides::new())?,
        };
        let (kept, rep) = guard::check_edit_at(engine, &proposal, probes, Some(inner), cfg, &before)?;
        self.current = Some(rep.after_measure());
        match rep.decision {
            guard::Decision::Accepted => tracing::info!("{}", rep.message),
            _ => tracing::warn!("edit {}: {}", self.reports.len(), rep.message),
        }
        self.reports.push(rep);
        Ok(kept)
    }

    /// The scale the last checked proposal was committed at (`kept`: it was; 0 when
    /// refused; 1 without a guard).
    pub fn committed_scale(&self, kept: bool) -> f64 {
        match (kept, self.on()) {
            (false, _) => 0.0,
            (true, true) => self.reports.last().map_or(1.0, |r| r.scale),
            (true, false) => 1.0,
        }
    }

    /// The last refusal's reason, for a request's result.
    pub fn last_reason(&self) -> String {
        self.reports.last().map_or_else(|| "refused by the commit guard".to_string(), |r| r.message.clone())
    }
}
