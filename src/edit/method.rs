//! The edit-method interface: how an edit is made, apart from who runs the call.
//!
//! [`super::session::Session`] orchestrates every edit call (conflicts, the commit guard,
//! stepwise steps, commits, rollback on failure, the outcome); a method only proposes
//! edited weights for a batch of requests, and hears what became of each proposal, so
//! that a method with memory (`mend-ls` remembers the edits it solved over) can follow
//! the session's commits, rollbacks and resets. What a method needs from the runtime is
//! the [`Engine`]: the frozen weights and the edited names (`Engine::weight`,
//! `Engine::edit_params`), the captured gradient factors (`Engine::capture`), and the
//! editor's forward (`Engine::edit_low_rank`).
//!
//! The built-in methods are [`Unedited`], [`FineTune`], [`Mend`] and `mend-ls`
//! ([`LsEditor`]); [`super::open`] builds one from the user's [`super::MethodSpec`]. A new
//! method implements [`EditMethod`] and is handed to [`super::session::Session::with_method`]
//! (and, to be named on the command line, gets a `MethodSpec` variant opened there).
use std::any::Any;

use tch::Kind;

use crate::data::TokenBatch;
use crate::mend::calibrate::calibrate;
use crate::mend::ls::{Fact, LsConfig, LsEditor};
use crate::mend::stepwise::{self, Stepwise};
use crate::mend::{Editor, Engine};
use crate::model::Overrides;
use crate::{Error, Result};

/// A method's state as it was, for [`EditMethod::restore`] after a failed call.
pub type Snapshot = Box<dyn Any + Send>;

/// What one proposal is asked for.
#[derive(Clone, Copy)]
pub struct EditCall<'a> {
    /// The method the caller asked for (`Auto`: as the session was opened).
    pub call: CallMethod,
    /// One edit of a run made one after another (`true`), or one batch of every request.
    pub sequential: bool,
    /// The facts the requests rewrite (those that name them), which `mend-ls` leaves out
    /// of its key statistics.
    pub facts: &'a [Fact],
    /// Each sequential edit made in small steps ([`crate::mend::stepwise`]): this
    /// proposal is one step.
    pub stepwise: Option<&'a Stepwise>,
}

impl EditCall<'_> {
    /// One batch edit as the session was opened, rewriting no named fact.
    pub fn batch() -> EditCall<'static> {
        EditCall { call: CallMethod::Auto, sequential: false, facts: &[], stepwise: None }
    }
}

/// How an edit is made: proposed weights for a batch of requests, never committed here.
pub trait EditMethod: Send {
    /// The method's name in reports (`mend`, `mend-ls`, `ft`, `unedited`).
    fn name(&self) -> &'static str;

    /// The name a call of `requests` requests (`sequential`: one after another) made as
    /// `call` asks reports: [`EditMethod::name`], unless the method makes such a call
    /// another way (`mend-ls` makes a single request with plain MEND).
    fn name_for(&self, call: CallMethod, requests: usize, sequential: bool) -> &'static str {
        let _ = (call, requests, sequential);
        self.name()
    }

    /// Whether this method can make edits as `call` asks; an error says why not. A
    /// method without an editor makes only `auto` calls.
    fn check(&self, call: &EditCall) -> Result<()> {
        match call.call {
            CallMethod::Auto => Ok(()),
            CallMethod::Mend => Err(Error::input(format!("method \"mend\" needs a session opened with an editor (this one: {:?})", self.name()))),
            CallMethod::MendLs => Err(needs_mend_ls(self.name())),
        }
    }

    /// The edited weights for the edit examples of `inner` (one batch), against the
    /// engine's current weights; nothing is committed.
    fn propose(&mut self, engine: &Engine, inner: &TokenBatch, call: &EditCall) -> Result<Overrides>;

    /// The last proposal was committed at `scale` (the guard may scale it back; 0: it was
    /// refused).
    fn committed(&mut self, scale: f64) {
        let _ = scale;
    }

    /// The method's state now, for [`EditMethod::restore`].
    fn snapshot(&self) -> Snapshot {
        Box::new(())
    }

    /// Puts back a [`EditMethod::snapshot`]: the call that followed it failed and the
    /// session put the weights back.
    fn restore(&mut self, snapshot: Snapshot) {
        let _ = snapshot;
    }

    /// The weights are the loaded ones again: forget every edit.
    fn reset(&mut self) {}

    /// The `mend-ls` settings in use, for reports.
    fn ls_config(&self) -> Option<LsConfig> {
        None
    }
}

fn needs_mend_ls(name: &str) -> Error {
    Error::input(format!(
        "method \"mend-ls\" needs a session opened with method \"mend-ls\", or \"auto\" with an editor that names an editor for many edits or has key statistics (this one: {name:?})"
    ))
}

/// Proposes `method`'s edit of `inner` for `call`, without autograd (edits are made, not
/// trained, here), after checking the method can make it.
pub fn propose(engine: &Engine, method: &mut dyn EditMethod, inner: &TokenBatch, call: &EditCall) -> Result<Overrides> {
    let _g = tch::no_grad_guard();
    method.check(call)?;
    method.propose(engine, inner, call)
}

/// The method one edit call asks for, among those its session's method can make (the
/// library's `Session.edit(method=...)`): as opened (`Auto`), plain MEND with the
/// session's editor, or `mend-ls`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum CallMethod {
    #[default]
    Auto,
    Mend,
    MendLs,
}

impl CallMethod {
    /// `"auto"`, `"mend"` or `"mend-ls"`; anything else is an error naming the choices.
    pub fn parse(s: &str) -> Result<Self> {
        match s {
            "auto" => Ok(Self::Auto),
            "mend" => Ok(Self::Mend),
            "mend-ls" | "mend_ls" => Ok(Self::MendLs),
            other => Err(Error::input(format!("an edit's method must be \"auto\", \"mend\" or \"mend-ls\", got {other:?}"))),
        }
    }
}

/// No edit: the unedited model's scores.
pub struct Unedited;

impl EditMethod for Unedited {
    fn name(&self) -> &'static str {
        "unedited"
    }

    fn propose(&mut self, _: &Engine, _: &TokenBatch, _: &EditCall) -> Result<Overrides> {
        Ok(Overrides::new())
    }
}

/// One plain gradient step on the edit NLL: `W' = W − lr·∇W` (the fine-tuning baseline).
pub struct FineTune {
    pub lr: f64,
}

impl EditMethod for FineTune {
    fn name(&self) -> &'static str {
        "ft"
    }

    fn propose(&mut self, engine: &Engine, inner: &TokenBatch, _: &EditCall) -> Result<Overrides> {
        let (_, factors) = engine.capture(inner)?;
        engine
            .edit_params
            .iter()
            .zip(&factors)
            .map(|(p, f)| {
                let w = engine.weight(&p.name)?;
                let g = p.layout.outer(&f.x, &f.delta);
                Ok((p.name.clone(), (w.to_kind(Kind::Float) - g * self.lr).to_kind(w.kind())))
            })
            .collect()
    }
}

/// MEND with a trained editor: the editor turns the batch's gradient factors into a
/// low-rank change of each edited weight (summed over the batch's examples).
pub struct Mend(pub Editor);

impl EditMethod for Mend {
    fn name(&self) -> &'static str {
        "mend"
    }

    fn check(&self, call: &EditCall) -> Result<()> {
        match call.call {
            CallMethod::Auto | CallMethod::Mend => Ok(()),
            CallMethod::MendLs => Err(needs_mend_ls(self.name())),
        }
    }

    fn propose(&mut self, engine: &Engine, inner: &TokenBatch, call: &EditCall) -> Result<Overrides> {
        match call.stepwise {
            Some(sw) => stepwise::step(engine, &mut self.0, inner, sw),
            None => plain_mend(engine, &mut self.0, inner),
        }
    }
}

/// A plain MEND edit of `inner`: the editor's low-rank update, at the strength the
/// editor's `calibration` (its editor.json) sets on the edit prompt ([`calibrate`]; none:
/// as it comes).
fn plain_mend(engine: &Engine, editor: &mut Editor, inner: &TokenBatch) -> Result<Overrides> {
    let (_, factors) = engine.capture(inner)?;
    let overrides = engine.edit_low_rank(editor, &factors, false)?;
    let Some(cal) = editor.calibration else { return Ok(overrides) };
    let (overrides, scale) = calibrate(engine, editor, overrides, inner, &cal)?;
    tracing::debug!(scale, "edit calibrated");
    Ok(overrides)
}

/// `mend-ls`: MEND's per-edit updates combined by least squares over their keys
/// (MALMEN's aggregation, [`crate::mend::ls`]), re-solved over every edit it remembers.
impl EditMethod for LsEditor {
    fn name(&self) -> &'static str {
        "mend-ls"
    }

    fn name_for(&self, call: CallMethod, requests: usize, sequential: bool) -> &'static str {
        if self.plain_mend(call, requests, sequential) {
            "mend"
        } else {
            self.name()
        }
    }

    fn check(&self, call: &EditCall) -> Result<()> {
        if call.stepwise.is_some() {
            // Each step would remember the same edit again: mend-ls composes by re-solving.
            return Err(Error::input("stepwise edits are for `method` mend; mend-ls re-solves over all edits instead"));
        }
        Ok(())
    }

    fn propose(&mut self, engine: &Engine, inner: &TokenBatch, call: &EditCall) -> Result<Overrides> {
        if self.plain_mend(call.call, inner.batch_size() as usize, call.sequential) {
            // `--method auto`'s one request: plain MEND with the same editor (a single
            // edit is better made so: docs/notebook/many-edits.md, "Many edits, part 3").
            return plain_mend(engine, &mut self.editor, inner);
        }
        crate::mend::ls::edit(engine, self, inner, call.facts)
    }

    fn committed(&mut self, scale: f64) {
        self.memory.commit(scale);
    }

    fn snapshot(&self) -> Snapshot {
        Box::new(self.memory.snapshot())
    }

    fn restore(&mut self, snapshot: Snapshot) {
        if let Ok(m) = snapshot.downcast() {
            self.memory = *m;
        }
    }

    fn reset(&mut self) {
        self.memory.clear();
    }

    fn ls_config(&self) -> Option<LsConfig> {
        Some(self.config)
    }
}

impl LsEditor {
    /// Whether a call of `requests` requests (`sequential`: one after another) is plain
    /// MEND with this editor: asked for, or `auto`'s single request while no `mend-ls`
    /// edit is remembered.
    fn plain_mend(&self, call: CallMethod, requests: usize, sequential: bool) -> bool {
        match call {
            CallMethod::Mend => true,
            CallMethod::Auto => self.single_mend && requests == 1 && !sequential && self.memory.edits() == 0,
            CallMethod::MendLs => false,
        }
    }
}
