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
//!   doubling ladder and then by bisection; none: the edit as it came (`s = 1`).
//!
//! "Makes it" is the guard's test: every answer token of every edit example is the model's
//! top-1 ([`crate::mend::guard::edits_made`]). Only the edit's own prompt and target are
//! read, never a locality or rephrase prompt. The forwards start from the batch's cached
//! activations at the first edited block, so each costs the edited blocks and the head.
use serde::{Deserialize, Serialize};

use crate::data::TokenBatch;
use crate::mend::guard::{makes_edit, scale_overrides, MIN_SCALE};
use crate::mend::Engine;
use crate::model::Overrides;
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
}

fn one() -> f64 {
    1.0
}

impl Calibration {
    /// Refuses either value outside [1, 64] (or not a number), naming the field.
    pub fn validate(&self) -> Result<()> {
        for (name, v) in [("calibration.margin", self.margin), ("calibration.max_scale", self.max_scale)] {
            if !(v.is_finite() && (1.0..=64.0).contains(&v)) {
                return Err(Error::input(format!("`{name}` must be a number in [1, 64], got {v}")));
            }
        }
        Ok(())
    }
}

/// `overrides` (a plain MEND edit of `edit`, against the engine's current weights) scaled
/// as `cal` says, and the scale used.
pub fn calibrate(engine: &Engine, overrides: Overrides, edit: &TokenBatch, cal: &Calibration) -> Result<(Overrides, f64)> {
    let _g = tch::no_grad_guard();
    let makes = |s: f64| makes_edit(engine, &scale_overrides(engine, &overrides, s)?, edit);
    let s = if makes(1.0)? {
        // s* ≤ 1 / margin, or the margin keeps the full edit.
        let hi = 1.0 / cal.margin;
        if cal.margin <= 1.0 || !makes(hi)? {
            1.0
        } else if makes(MIN_SCALE)? {
            (cal.margin * MIN_SCALE).min(1.0)
        } else {
            (cal.margin * smallest_making(MIN_SCALE, hi, &makes)?).min(1.0)
        }
    } else {
        // Up a doubling ladder (far past the target an edit can make another answer, so
        // `max_scale` alone would not tell), then between the last two rungs.
        let mut lo = 1.0_f64;
        loop {
            let hi = (2.0 * lo).min(cal.max_scale);
            if hi <= lo {
                break 1.0;
            }
            if makes(hi)? {
                break smallest_making(lo, hi, &makes)?;
            }
            lo = hi;
        }
    };
    if s == 1.0 {
        return Ok((overrides, 1.0));
    }
    Ok((scale_overrides(engine, &overrides, s)?, s))
}

/// Bisection (geometric: scales span orders of magnitude) between a scale `lo` that does
/// not make the edit and one `hi` that does; returns the making end.
fn smallest_making(mut lo: f64, mut hi: f64, makes: &impl Fn(f64) -> Result<bool>) -> Result<f64> {
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

#[cfg(test)]
mod tests {
    use super::*;

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
        let ok = Calibration { margin: 2.0, max_scale: 4.0 };
        ok.validate().unwrap();
        let e = Calibration { margin: 0.5, ..ok }.validate().unwrap_err().to_string();
        assert!(e.contains("`calibration.margin`"), "{e}");
        let e = Calibration { max_scale: f64::NAN, ..ok }.validate().unwrap_err().to_string();
        assert!(e.contains("`calibration.max_scale`"), "{e}");
        let c: Calibration = serde_json::from_str(r#"{"margin": 2}"#).unwrap();
        assert_eq!(c.max_scale, 1.0);
        assert!(serde_json::from_str::<Calibration>(r#"{"margin": 2, "margn": 1}"#).is_err());
    }
}
