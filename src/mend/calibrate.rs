//! Edit-strength calibration (issue #46): a plain MEND edit scaled, on the edit prompt
//! itself, to the strength that makes it with a margin, before anything is measured or
//! committed.
//!
//! Why: the editor's update has one strength per weight (its learned edit learning rates),
//! whatever the request. Most edits overshoot: on the real model (SmolLM2-135M, CounterFact)
//! half of them still make their target at half strength, and the surplus moves the
//! neighbourhood prompts, which share the edit's relation, template and old answer, along
//! with the edit (locality 0.868). A few undershoot and miss their target. Calibration
//! scales each edit `ΔW → s·ΔW` (every edited weight alike, as the guard scales):
//!
//! * made at full strength: `s = min(margin · s*, 1)`, `s*` the smallest scale in
//!   [1/64 ([`MIN_SCALE`]), 1] that still makes it (bisection on a log scale);
//! * not made at full strength: the smallest `s` in (1, `max_scale`] that makes it, up a
//!   doubling ladder and then by bisection;
//! * made at no scale up to `max_scale`: with `passes` > 1, the editor steps again from
//!   the weights its step reached (the gradient recaptured there) and the summed edit is
//!   calibrated as above, up to `passes` steps in all. Scaling one step only moves along
//!   its direction; a target that direction cannot reach (a second answer token that the
//!   first step's change pushes aside) needs the gradient where the first step left it.
//!   None makes it: the edit as it came (`s = 1`).
//!
//! "Makes it" is the guard's test: every answer token of every edit example is the model's
//! top-1 ([`crate::mend::guard::edits_made`]). Only the edit's own prompt and target are
//! read, never a locality or rephrase prompt. The forwards start from the batch's cached
//! activations at the first edited block, so each costs the edited blocks and the head.
use serde::{Deserialize, Serialize};
use tch::{Kind, Tensor};

use crate::data::TokenBatch;
use crate::mend::guard::{makes_edit, scale_overrides, MIN_SCALE};
use crate::mend::{Editor, Engine};
use crate::model::{LowRank, Overrides};
use crate::{Error, Result};

/// Bisection steps of a search: on [1/64, 1/2] they pin `s*` to within 6 %.
const STEPS: usize = 6;

/// How an editor's plain MEND edits are calibrated: `calibration` in its `editor.json`
/// (an edit-time setting like `key_stats`, not part of the trained network; absent: the
/// editor's update as it comes, MEND's behaviour).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Calibration {
    /// An edit made at full strength keeps `margin` times the smallest scale that makes it
    /// (at most 1). At least 1: a margin below 1 would not make the edit.
    pub margin: f64,
    /// An edit not made at full strength is scaled up, at most to this (1: never).
    #[serde(default = "one")]
    pub max_scale: f64,
    /// Editor steps an edit may take in all, each recaptured where the last left the
    /// weights, while no scale up to `max_scale` makes it (1: one step, MEND's).
    /// Left out of editor.json at its default, so that an editor written before it existed
    /// reads and writes back unchanged (`dualedit stats` rewrites editor.json).
    #[serde(default = "one_pass", skip_serializing_if = "is_one_pass")]
    pub passes: usize,
}

fn one() -> f64 {
    1.0
}

fn one_pass() -> usize {
    1
}

fn is_one_pass(passes: &usize) -> bool {
    *passes == 1
}

/// The most editor steps [`Calibration::passes`] allows: each costs a capture and a scale
/// search, and an edit eight steps cannot make is not one the editor can make.
pub const MAX_PASSES: usize = 8;

impl Calibration {
    /// Refuses a margin or `max_scale` outside [1, 64] (or not a number), or `passes`
    /// outside [1, [`MAX_PASSES`]], naming the field.
    pub fn validate(&self) -> Result<()> {
        for (name, v) in [("calibration.margin", self.margin), ("calibration.max_scale", self.max_scale)] {
            if !(v.is_finite() && (1.0..=64.0).contains(&v)) {
                return Err(Error::input(format!("`{name}` must be a number in [1, 64], got {v}")));
            }
        }
        if !(1..=MAX_PASSES).contains(&self.passes) {
            return Err(Error::input(format!("`calibration.passes` must be in [1, {MAX_PASSES}], got {}", self.passes)));
        }
        Ok(())
    }
}

/// `overrides` (a plain MEND edit of `edit` by `editor`, against the engine's current
/// weights) scaled, or stepped again and scaled, as `cal` says, and the scale applied to
/// the (summed) edit returned. No step made it: the first edit as it came, scale 1.
pub fn calibrate(engine: &Engine, editor: &mut Editor, overrides: Overrides, edit: &TokenBatch, cal: &Calibration) -> Result<(Overrides, f64)> {
    let _g = tch::no_grad_guard();
    let mut summed: Option<Overrides> = None;
    for pass in 1..=cal.passes {
        let current = summed.as_ref().unwrap_or(&overrides);
        if let Some(s) = making_scale(engine, current, edit, cal)? {
            if pass > 1 {
                tracing::debug!(pass, "edit made by a further editor step");
            }
            return Ok((scale_overrides(engine, current, s)?, s));
        }
        if pass < cal.passes {
            let next = step_again(engine, editor, current, edit)?;
            summed = Some(next);
        }
    }
    Ok((overrides, 1.0))
}

/// The scale at which `overrides` is kept: `margin` × the smallest making scale when it
/// makes the edit at full strength, else the smallest making scale up to `max_scale`;
/// `None` when no scale up to it makes the edit.
fn making_scale(engine: &Engine, overrides: &Overrides, edit: &TokenBatch, cal: &Calibration) -> Result<Option<f64>> {
    let makes = |s: f64| makes_edit(engine, &scale_overrides(engine, overrides, s)?, edit);
    if makes(1.0)? {
        // s* ≤ 1 / margin, or the margin keeps the full edit.
        let hi = 1.0 / cal.margin;
        let s = if cal.margin <= 1.0 || !makes(hi)? {
            1.0
        } else if makes(MIN_SCALE)? {
            (cal.margin * MIN_SCALE).min(1.0)
        } else {
            (cal.margin * smallest_making(MIN_SCALE, hi, &makes)?).min(1.0)
        };
        return Ok(Some(s));
    }
    // Up a doubling ladder (far past the target an edit can make another answer, so
    // `max_scale` alone would not tell), then between the last two rungs.
    let mut lo = 1.0_f64;
    loop {
        let hi = (2.0 * lo).min(cal.max_scale);
        if hi <= lo {
            return Ok(None);
        }
        if makes(hi)? {
            return Ok(Some(smallest_making(lo, hi, &makes)?));
        }
        lo = hi;
    }
}

/// `overrides` plus the editor's next step, captured at the weights `overrides` makes.
fn step_again(engine: &Engine, editor: &mut Editor, overrides: &Overrides, edit: &TokenBatch) -> Result<Overrides> {
    let at = engine.lm.params.materialise(overrides, |n| engine.lm.model.layout(n))?.into_iter().collect();
    let (_, factors, _) = engine.capture_by_example(edit, &at)?;
    let next = engine.edit_low_rank(editor, &factors, false)?;
    crate::error::guard(|| {
        let mut out = Overrides::new();
        for name in overrides.names() {
            match (overrides.low_rank(name), next.low_rank(name), overrides.get(name), next.get(name)) {
                (Some(l), Some(m), _, _) => {
                    out.insert_low_rank(name.clone(), LowRank { a: Tensor::cat(&[&l.a, &m.a], 0), b: Tensor::cat(&[&l.b, &m.b], 0) })
                }
                // Whole weights (non-f32 models): W + ΔW₁ + ΔW₂ = W'₁ + (W'₂ − W).
                (_, _, Some(w1), Some(w2)) => {
                    let w = engine.weight(name)?.to_kind(Kind::Float);
                    out.insert(name.clone(), (w1.to_kind(Kind::Float) + w2.to_kind(Kind::Float) - w).to_kind(w1.kind()))
                }
                _ => return Err(Error::Internal(format!("{name:?}: the editor's two steps are kept differently"))),
            }
        }
        Ok(out)
    })
}

/// Bisection (geometric: scales span orders of magnitude) between a scale `lo` that does
/// not make the edit and one `hi` that does; returns the making end.
pub(crate) fn smallest_making(mut lo: f64, mut hi: f64, makes: &impl Fn(f64) -> Result<bool>) -> Result<f64> {
    for _ in 0..STEPS {
        let mid = (lo * hi).sqrt();
        if makes(mid)? {
            hi = mid;
        } else {
            lo = mid;
        }
    }
    Ok(hi)
}

/// Bisection steps [`smallest_making_in_rounds`] asks about in one call: every midpoint
/// the next three steps could visit, 7 scales.
const ROUND_STEPS: usize = 3;

/// [`smallest_making`] with `makes_all` answering for several scales at once (one batched
/// forward): each call takes every midpoint the next [`ROUND_STEPS`] steps could visit, so
/// the 6 steps are 2 calls of 7 scales. `first` are asked along with the first call, and
/// `stop` reads their answers: `Some` ends the search with that result (the edit made at
/// no scale, or already at the smallest). The midpoints are computed as the sequential
/// bisection computes them, so given the same answers it returns the same scale.
pub(crate) fn smallest_making_in_rounds(
    (mut lo, mut hi): (f64, f64),
    first: &[f64],
    stop: impl Fn(&[bool]) -> Option<Option<f64>>,
    makes_all: &impl Fn(&[f64]) -> Result<Vec<bool>>,
) -> Result<Option<f64>> {
    let mut steps = 0;
    let mut first = Some(first);
    while steps < STEPS {
        let levels = ROUND_STEPS.min(STEPS - steps);
        // The midpoints in heap order: node i's left child (the midpoint made: hi moves
        // down) is 2i+1, its right one 2i+2.
        let mut mids = vec![0.0; (1 << levels) - 1];
        let mut spans = vec![(lo, hi)];
        for i in 0..mids.len() {
            let (l, h) = spans[i];
            let mid = (l * h).sqrt();
            mids[i] = mid;
            spans.extend([(l, mid), (mid, h)]);
        }
        let ends = first.take().unwrap_or_default();
        let asked: Vec<f64> = ends.iter().chain(&mids).copied().collect();
        let answers = makes_all(&asked)?;
        if answers.len() != asked.len() {
            return Err(Error::Internal(format!("{} answers for {} scales", answers.len(), asked.len())));
        }
        if let Some(done) = stop(&answers[..ends.len()]) {
            return Ok(done);
        }
        let mut i = 0;
        for _ in 0..levels {
            if answers[ends.len() + i] {
                hi = mids[i];
                i = 2 * i + 1;
            } else {
                lo = mids[i];
                i = 2 * i + 2;
            }
        }
        steps += levels;
    }
    Ok(Some(hi))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rounds_find_the_sequential_bisections_scale() {
        for k in 0..200 {
            let threshold = MIN_SCALE * (64f64).powf(k as f64 / 199.0);
            let one = smallest_making(MIN_SCALE, 1.0, &|s| Ok(s >= threshold)).unwrap();
            let asked = std::cell::Cell::new(0);
            let all = |ss: &[f64]| {
                asked.set(asked.get() + 1);
                Ok(ss.iter().map(|s| *s >= threshold).collect())
            };
            let rounds = smallest_making_in_rounds((MIN_SCALE, 1.0), &[], |_| None, &all).unwrap();
            assert_eq!(rounds, Some(one), "threshold {threshold}");
            assert_eq!(asked.get(), 2);
        }
        // `stop` sees the first scales' answers, in their order, before any walk.
        let all = |ss: &[f64]| Ok(ss.iter().map(|s| *s >= 0.5).collect());
        let stopped = smallest_making_in_rounds((MIN_SCALE, 1.0), &[1.0, MIN_SCALE], |a| (a == [true, false]).then_some(None), &all).unwrap();
        assert_eq!(stopped, None);
    }

    #[test]
    fn bisection_finds_the_threshold_within_its_precision() {
        let threshold = 0.3;
        let s = smallest_making(MIN_SCALE, 0.5, &|s| Ok(s >= threshold)).unwrap();
        assert!(s >= threshold && s < threshold * 1.06, "{s}");
        let up = smallest_making(1.0, 4.0, &|s| Ok(s >= 1.7)).unwrap();
        assert!((1.7..1.7 * 1.03).contains(&up), "{up}");
    }

    #[test]
    fn bad_settings_name_the_field() {
        let ok = Calibration { margin: 2.0, max_scale: 4.0, passes: 1 };
        ok.validate().unwrap();
        let e = Calibration { margin: 0.5, ..ok }.validate().unwrap_err().to_string();
        assert!(e.contains("`calibration.margin`"), "{e}");
        let e = Calibration { max_scale: f64::NAN, ..ok }.validate().unwrap_err().to_string();
        assert!(e.contains("`calibration.max_scale`"), "{e}");
        let e = Calibration { passes: 0, ..ok }.validate().unwrap_err().to_string();
        assert!(e.contains("`calibration.passes`"), "{e}");
        let c: Calibration = serde_json::from_str(r#"{"margin": 2}"#).unwrap();
        assert_eq!((c.max_scale, c.passes), (1.0, 1));
        assert_eq!(serde_json::to_string(&Calibration { passes: 1, ..ok }).unwrap(), r#"{"margin":2.0,"max_scale":4.0}"#);
        let four = Calibration { passes: 4, ..ok };
        assert_eq!(serde_json::from_str::<Calibration>(&serde_json::to_string(&four).unwrap()).unwrap(), four);
        assert!(serde_json::from_str::<Calibration>(r#"{"margin": 2, "margn": 1}"#).is_err());
    }
}
