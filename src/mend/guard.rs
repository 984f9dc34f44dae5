//! The commit guard (issue #24): before an edit is committed into the weights, its effect
//! on a small set of locality probes is measured, and an edit that would break them beyond
//! a threshold is scaled back or refused, so that a run of edits never ends with a model
//! that answers nonsense (and `--save` never writes one).
//!
//! Why a guard: MEND's editor is trained to edit the *unedited* model once. Its inputs are
//! normalised with statistics of that model, and most of an edit is the editor's answer to
//! the normalisation offsets rather than to the gradient (an edit of a request the model
//! already answers is as large as any other). Edits committed one after another add up and
//! move the inputs of later edits out of the editor's distribution: on the embedded default
//! the third edit of the five requests moved `h.1.mlp.c_proj` by 61 times its norm
//! (a nearly dead MLP unit, training std 7.7e-3, switched on by the first two commits and
//! normalised to 1062 standard deviations). Nothing in a single edit shows this coming,
//! so the guard looks at what the edit does, not at how it was made.
//!
//! What it measures, on the probes (prompts with answers, e.g. a request file's locality
//! prompts): the top-1 agreement of the edited model (the current weights plus the proposed
//! edit) with a reference model, usually the weights the run started from, and the mean KL
//! from the reference. The decision:
//!
//! * **accepted**: agreement ≥ `min_agreement`, the drop from the agreement before the
//!   edit ≤ `max_drop`, and KL ≤ `max_kl`;
//! * **scaled**: the edit fails at full size but passes at a smaller scale `s` (the edit
//!   `W + s·ΔW`, the largest `s` ≥ `min_scale` found by bisection) that still makes the edit
//!   (every answer token of the edit prompt is the model's top-1; of a batch's edits, at
//!   least one, and the report says how many);
//! * **refused**: no scale ≥ `min_scale` passes, or the largest passing scale no longer
//!   makes the edit (of a batch: none of its edits). Nothing is committed.
//!
//! Optionally (`shrink`), an accepted edit is also shrunk to the smallest scale in a halving
//! ladder that still makes the edit: MEND's edits overshoot (a single one moves an MLP
//! weight by 10–75 % of its norm on the embedded default), and a smaller edit leaves more
//! room for the edits after it.
use serde::{Deserialize, Serialize};
use tch::{Kind, Tensor};

use crate::data::{Example, TokenBatch};
use crate::mend::{losses, Engine};
use crate::model::{LowRank, Overrides, RowScaled};
use crate::{Error, Result};

/// Thresholds of the guard. The defaults keep at least 90 % of the probes' top-1 answers of
/// the reference, allow no single edit to change more than 5 % of them, and keep the KL below
/// 1 nat per probe position.
#[derive(Debug, Clone, Serialize)]
pub struct GuardConfig {
    /// The least top-1 agreement with the reference the model may have after the edit.
    pub min_agreement: f64,
    /// The most one edit may lower the agreement; a batch of n edits may lower it by n
    /// times this ([`Self::for_edits`]).
    pub max_drop: f64,
    /// The largest mean KL(reference ‖ edited) per probe position, in nats.
    pub max_kl: f64,
    /// Try smaller scales of an edit that fails at full size (otherwise refuse it at once).
    pub scale_back: bool,
    /// The smallest scale tried.
    pub min_scale: f64,
    /// Shrink every accepted edit to the smallest scale (1, ½, ¼, … ≥ `min_scale`) that
    /// still makes it.
    pub shrink: bool,
}

/// The smallest scale an edit is scaled back or shrunk to by default (and by
/// [`crate::mend::calibrate`]).
pub const MIN_SCALE: f64 = 1.0 / 64.0;

impl Default for GuardConfig {
    fn default() -> Self {
        Self { min_agreement: 0.9, max_drop: 0.05, max_kl: 1.0, scale_back: true, min_scale: MIN_SCALE, shrink: false }
    }
}

impl GuardConfig {
    /// Refuses thresholds that make no sense, naming the setting by its field (`guard
    /// `max_kl``; [`Self::validate_named`] names them otherwise): an agreement or a drop
    /// outside [0, 1], a negative KL, a scale outside (0, 1], or NaN / infinity anywhere
    /// (NaN compares false, so it would quietly refuse every edit). Checked before any
    /// edit is made, wherever a guard is configured (`edit`, `eval`, `serve`, the library).
    pub fn validate(&self) -> Result<()> {
        self.validate_named(|key| format!("guard `{key}`"))
    }

    /// [`Self::validate`] with each setting named by `name(field)`: the option types name
    /// them `` `guard_max_kl` `` (the Python keyword, the CLI's `--guard-max-kl`), `serve`'s
    /// per-request `guard` object `` `max_kl` ``.
    pub fn validate_named(&self, name: impl Fn(&str) -> String) -> Result<()> {
        let bad = |key: &str, range: &str, v: f64| Error::input(format!("{} must be a number in {range}, got {v}", name(key)));
        let unit = |v: f64| v.is_finite() && (0.0..=1.0).contains(&v);
        if !unit(self.min_agreement) {
            return Err(bad("min_agreement", "[0, 1]", self.min_agreement));
        }
        if !unit(self.max_drop) {
            return Err(bad("max_drop", "[0, 1]", self.max_drop));
        }
        if !(self.max_kl.is_finite() && self.max_kl >= 0.0) {
            return Err(bad("max_kl", "[0, ∞) (nats, finite)", self.max_kl));
        }
        if !(self.min_scale.is_finite() && 0.0 < self.min_scale && self.min_scale <= 1.0) {
            return Err(bad("min_scale", "(0, 1]", self.min_scale));
        }
        Ok(())
    }

    /// The thresholds for a proposal that makes `edits` edits at once. `max_drop` bounds
    /// each edit, so a batch of n edits may lower the agreement by n times it, as n edits
    /// in a row may; the floor `min_agreement` and `max_kl` bound the whole. (Held to one
    /// edit's drop, 100 CounterFact edits in one batch were scaled back to 0.40 and made
    /// 14 of them; at the floor, 47.)
    pub fn for_edits(&self, edits: usize) -> Self {
        Self { max_drop: (self.max_drop * edits.max(1) as f64).min(1.0), ..self.clone() }
    }
}

/// Changes to a [`GuardConfig`] one request asks for (`serve`'s `/edit` body field
/// `guard`): each key given replaces the server's setting, the rest stay. `refuse` is
/// the inverse of `scale_back` (as `--guard-refuse`). Unknown keys are refused.
#[derive(Debug, Clone, Default, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct GuardOverrides {
    pub min_agreement: Option<f64>,
    pub max_drop: Option<f64>,
    pub max_kl: Option<f64>,
    pub refuse: Option<bool>,
    pub shrink: Option<bool>,
}

impl GuardOverrides {
    /// `base` with these changes, validated, each setting named by its key here.
    pub fn apply(&self, base: &GuardConfig) -> Result<GuardConfig> {
        let c = GuardConfig {
            min_agreement: self.min_agreement.unwrap_or(base.min_agreement),
            max_drop: self.max_drop.unwrap_or(base.max_drop),
            max_kl: self.max_kl.unwrap_or(base.max_kl),
            scale_back: self.refuse.map_or(base.scale_back, |r| !r),
            shrink: self.shrink.unwrap_or(base.shrink),
            min_scale: base.min_scale,
        };
        c.validate_named(|key| format!("`{key}`"))?;
        Ok(c)
    }
}

/// The most probes a guard measures. A call's probes are its requests' locality prompts, so
/// 1,000 edits in a row would run every check's forward over 1,000 prompts (about 10 s each
/// on the real model, two cores); 128 evenly spaced ones give the agreement to 1/128, finer
/// than the default `max_drop` of 0.05, for an eighth of that.
pub const MAX_PROBES: usize = 128;

/// Prompts whose answers an edit should leave alone, with the reference model's view of them.
pub struct Probes {
    batch: TokenBatch,
    /// The reference's view of the scored positions.
    reference: Reference,
    /// The probes' examples, for [`Probes::subset`]; empty when they show images (their
    /// features are not collated again).
    examples: Vec<Example>,
}

/// The reference model at the probes' scored positions, what every measure compares
/// with, computed once: its log-probabilities and probabilities (f32 `[N, V]`) and its
/// top-1 tokens `[N]`.
struct Reference {
    lp: Tensor,
    p: Tensor,
    top: Tensor,
}

impl Reference {
    fn of(logits: &Tensor) -> Reference {
        let lp = logits.to_kind(Kind::Float).log_softmax(-1, Kind::Float);
        Reference { p: lp.exp(), top: logits.argmax(-1, false), lp }
    }

    /// The positions `at` (int64 `[M]`).
    fn select(&self, at: &Tensor) -> Reference {
        Reference { lp: self.lp.index_select(0, at), p: self.p.index_select(0, at), top: self.top.index_select(0, at) }
    }
}

/// A probe measure with each probe's own top-1 agreement (the share of its scored
/// positions), which tells the guard's scale search which probes an edit can change.
#[derive(Debug, Clone, PartialEq)]
pub struct ProbeMeasure {
    pub score: ProbeScore,
    pub per_probe: Vec<f64>,
}

impl Probes {
    /// Probes from `examples` (prompt + answer; the answer positions are the ones scored),
    /// with the engine's current weights as the reference. `None` when there are none.
    /// Of more than [`MAX_PROBES`] examples, that many evenly spaced ones (the first
    /// included), the same on every run. Examples may show images (an E-VQA request's
    /// `loc_image`: an unrelated image and question); their features are computed once,
    /// here, by the frozen tower.
    pub fn new(engine: &Engine, examples: &[&Example]) -> Result<Option<Self>> {
        if examples.is_empty() {
            return Ok(None);
        }
        let _g = tch::no_grad_guard();
        let n = examples.len();
        if n > MAX_PROBES {
            tracing::info!("the commit guard measures {MAX_PROBES} of the call's {n} locality prompts, evenly spaced");
        }
        let m = n.min(MAX_PROBES);
        let sample: Vec<&Example> = (0..m).map(|i| examples[i * n / m]).collect();
        let batch = engine.collate(&sample)?;
        let reference = crate::error::guard(|| Ok(Reference::of(&engine.base_logits(&batch)?)))?;
        let text = sample.iter().all(|e| e.image.is_none());
        let examples = if text { sample.into_iter().cloned().collect() } else { Vec::new() };
        Ok(Some(Self { batch, reference, examples }))
    }

    /// The probes `rows` (ascending indices into these) alone, with their prefix
    /// activations cut from this batch's and their reference logits taken from these, so
    /// that measuring them costs only the edited blocks over their rows and gives exactly
    /// what the whole measure gives for them. `None` for probes that show images.
    pub fn subset(&self, engine: &Engine, rows: &[usize]) -> Result<Option<Probes>> {
        if self.examples.is_empty() || rows.is_empty() {
            return Ok(None);
        }
        if rows.windows(2).any(|w| w[0] >= w[1]) || rows.last().is_some_and(|&r| r >= self.examples.len()) {
            return Err(Error::Internal(format!("probe rows {rows:?} of {} are not ascending indices", self.examples.len())));
        }
        let examples: Vec<&Example> = rows.iter().map(|&r| &self.examples[r]).collect();
        let batch = engine.collate(&examples)?;
        let rows64: Vec<i64> = rows.iter().map(|&r| r as i64).collect();
        engine.share_boundary_rows(&self.batch, &batch, &rows64)?;
        let reference = crate::error::guard(|| {
            // The whole batch's scored positions, row-major: those of the chosen rows, in
            // order, are the subset's own (collated from the same examples).
            let kept = self.batch.kept_rows().to_device(self.reference.top.device());
            let chosen = Tensor::from_slice(&rows64).to_device(kept.device());
            let at = kept.unsqueeze(1).eq_tensor(&chosen.unsqueeze(0)).any_dim(1, false).nonzero().squeeze_dim(1);
            Ok(self.reference.select(&at))
        })?;
        Ok(Some(Probes { batch, reference, examples: Vec::new() }))
    }

    pub fn len(&self) -> usize {
        self.batch.batch_size() as usize
    }

    /// The measure on the reference weights themselves, without their forward: every
    /// probe agrees and the KL is 0 (the logits are the reference's, bit for bit).
    pub fn at_reference(&self) -> ProbeMeasure {
        ProbeMeasure { score: ProbeScore { agreement: 1.0, kl: 0.0 }, per_probe: vec![1.0; self.len()] }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Top-1 agreement with the reference (mean over probes of the share of their scored
    /// positions) and mean KL(reference ‖ model) per position, for the current weights plus
    /// `overrides`.
    pub fn measure(&self, engine: &Engine, overrides: &Overrides) -> Result<ProbeScore> {
        Ok(self.measure_each(engine, overrides)?.score)
    }

    /// [`Probes::measure`] with each probe's agreement.
    pub fn measure_each(&self, engine: &Engine, overrides: &Overrides) -> Result<ProbeMeasure> {
        let _g = tch::no_grad_guard();
        let logits = if overrides.is_empty() { engine.base_logits(&self.batch)? } else { engine.edited_logits(overrides, &self.batch)? };
        crate::error::guard(|| {
            let per_probe = losses::token_accuracy(&logits, &self.reference.top, &self.batch.kept_rows(), self.batch.batch_size()).0;
            let kl = losses::kl_from(&self.reference.p, &self.reference.lp, &logits).double_value(&[]);
            let score = ProbeScore { agreement: per_probe.iter().sum::<f64>() / per_probe.len().max(1) as f64, kl };
            Ok(ProbeMeasure { score, per_probe })
        })
    }
}

#[derive(Debug, Clone, Copy, Serialize, PartialEq)]
pub struct ProbeScore {
    pub agreement: f64,
    pub kl: f64,
}

#[derive(Debug, Clone, Copy, Serialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum Decision {
    Accepted,
    Scaled,
    Refused,
}

/// What the guard decided about one edit, with its numbers.
#[derive(Debug, Clone, Serialize)]
pub struct GuardReport {
    pub decision: Decision,
    /// The scale of the edit that is committed (0 when refused).
    pub scale: f64,
    /// The probes before the edit (current weights).
    pub before: ProbeScore,
    /// The probes with the full edit.
    pub full: ProbeScore,
    /// The probes with what is committed (the current weights again when refused).
    pub after: ProbeScore,
    /// Whether the committed edit makes the edit (every answer token top-1), when known.
    pub edit_success: Option<bool>,
    /// One line for logs and reports.
    pub message: String,
    /// Each probe's agreement with what is committed: the next edit's `before`.
    #[serde(skip)]
    pub after_per_probe: Vec<f64>,
}

impl GuardReport {
    /// The probes' measure on the weights with what is committed.
    pub fn after_measure(&self) -> ProbeMeasure {
        ProbeMeasure { score: self.after, per_probe: self.after_per_probe.clone() }
    }
}

/// `overrides` with every weight change scaled by `s`: low-rank changes as `(s·a, b)`,
/// replaced weights `W'` as `W + s·(W' − W)`.
pub fn scale_overrides(engine: &Engine, overrides: &Overrides, s: f64) -> Result<Overrides> {
    let _g = tch::no_grad_guard();
    crate::error::guard(|| {
        let mut out = Overrides::new();
        for name in overrides.names() {
            if let Some(l) = overrides.low_rank(name) {
                out.insert_low_rank(name.clone(), LowRank { a: &l.a * s, b: l.b.shallow_clone() });
            } else if let Some(w2) = overrides.get(name) {
                let w32 = engine.weight(name)?.to_kind(Kind::Float);
                // In place: one new tensor per weight at each scale a search tries.
                let mut scaled = w2.to_kind(Kind::Float) - &w32;
                scaled *= s;
                scaled += &w32;
                out.insert(name.clone(), scaled.to_kind(w2.kind()));
            }
        }
        Ok(out)
    })
}

/// An edit's weight changes `D = W' − W` from the current weights, taken once, for asking
/// at which scales its own batch is made in one forward: the batch repeated once per
/// scale, each copy's rows seeing `W + s·D` ([`RowScaled`]). A step of the smallest-scale
/// search otherwise builds every scaled weight and runs a forward of its own; on the real
/// model that was 15 ms a step, 8 steps a refusal.
struct AtScales<'a> {
    deltas: Vec<(String, Tensor)>,
    edit: &'a TokenBatch,
}

/// The most rows of an edit's batch [`AtScales`] repeats. A forward of a few rows costs
/// about what one row does (it reads every edited weight and the head once), so asking 16
/// scales in 2 forwards beats 8 in 8; with many rows the cost goes by the row, and the
/// rounds ask twice the scales.
const AT_SCALES_MAX_ROWS: i64 = 4;

impl<'a> AtScales<'a> {
    /// `None` when `overrides` has a change other than a replaced weight, or `edit` shows
    /// images or has more than [`AT_SCALES_MAX_ROWS`] rows: the search then asks one scale
    /// at a time.
    fn new(engine: &Engine, overrides: &Overrides, edit: &'a TokenBatch) -> Result<Option<Self>> {
        let _g = tch::no_grad_guard();
        let dense = overrides.names().all(|n| overrides.get(n).is_some());
        if !dense || edit.shows_images() || edit.batch_size() > AT_SCALES_MAX_ROWS {
            return Ok(None);
        }
        let mut deltas = Vec::new();
        for name in overrides.names() {
            if let Some(w2) = overrides.get(name) {
                let w32 = engine.weight(name)?.to_kind(Kind::Float);
                deltas.push((name.clone(), crate::error::guard(|| Ok(w2.to_kind(Kind::Float) - &w32))?));
            }
        }
        Ok(Some(AtScales { deltas, edit }))
    }

    /// Whether the edit is made at each of `scales` (of a batch, at least one of its edits:
    /// what [`scale_search`] asks).
    fn made(&self, engine: &Engine, scales: &[f64]) -> Result<Vec<bool>> {
        let _g = tch::no_grad_guard();
        let b = self.edit.batch_size();
        let rows: Vec<i64> = scales.iter().flat_map(|_| 0..b).collect();
        let batch = self.edit.rows(&rows).ok_or_else(|| Error::Internal("an image batch asked at several scales".into()))?;
        engine.share_boundary_rows(self.edit, &batch, &rows)?;
        let per_row: Vec<f32> = scales.iter().flat_map(|&s| std::iter::repeat(s as f32).take(b as usize)).collect();
        let device = self.deltas.first().map_or(tch::Device::Cpu, |(_, d)| d.device());
        let per_row = Tensor::from_slice(&per_row).to_device(device);
        let mut overrides = Overrides::new();
        for (name, d) in &self.deltas {
            overrides.insert_row_scaled(name.clone(), RowScaled { delta: d.shallow_clone(), scales: per_row.shallow_clone() });
        }
        let logits = engine.edited_logits(&overrides, &batch)?;
        crate::error::guard(|| {
            let (_, exact) = losses::token_accuracy(&logits, &batch.kept_targets(), &batch.kept_rows(), batch.batch_size());
            Ok(exact.chunks(b.max(1) as usize).map(|c| c.iter().any(|e| *e)).collect())
        })
    }
}

/// How many examples of `edit` the current weights plus `overrides` make (every answer
/// token the top-1 prediction), of how many.
pub fn edits_made(engine: &Engine, overrides: &Overrides, edit: &TokenBatch) -> Result<(usize, usize)> {
    let _g = tch::no_grad_guard();
    let logits = engine.edited_logits(overrides, edit)?;
    crate::error::guard(|| {
        let (_, exact) = losses::token_accuracy(&logits, &edit.kept_targets(), &edit.kept_rows(), edit.batch_size());
        Ok((exact.iter().filter(|e| **e).count(), exact.len()))
    })
}

/// Whether the current weights plus `overrides` make every answer token of every example
/// in `edit` the top-1 prediction.
pub fn makes_edit(engine: &Engine, overrides: &Overrides, edit: &TokenBatch) -> Result<bool> {
    let (made, of) = edits_made(engine, overrides, edit)?;
    Ok(made == of)
}

/// Slack for the agreement comparisons: agreements are means of shares, and 1.0 − 0.95
/// is 0.050000000000000044, so one probe in twenty changed would otherwise exceed a
/// `max_drop` of 0.05 that it meets exactly.
const AGREEMENT_SLACK: f64 = 1e-9;

fn passes(cfg: &GuardConfig, before: &ProbeScore, s: &ProbeScore) -> bool {
    s.agreement + AGREEMENT_SLACK >= cfg.min_agreement
        && before.agreement - s.agreement <= cfg.max_drop + AGREEMENT_SLACK
        && s.kl <= cfg.max_kl
        && s.kl.is_finite()
}

/// Decides whether `overrides` (a proposed edit on the engine's current weights) may be
/// committed, measured on `probes`; `edit` is the edit's own batch (prompt + new target,
/// a row per edit: their number sets the drop limit, [`GuardConfig::for_edits`]), used to
/// check that a scaled-back edit still makes the edit. Returns the overrides to
/// commit (`None` when refused) and the report. Commits nothing itself.
///
/// Measures the probes on the current weights first: [`check_edit_at`] takes that measure
/// from a caller that knows it (a run of edits, whose last check measured it:
/// [`GuardReport::after_measure`]).
pub fn check_edit(
    engine: &Engine,
    overrides: &Overrides,
    probes: &Probes,
    edit: Option<&TokenBatch>,
    cfg: &GuardConfig,
) -> Result<(Option<Overrides>, GuardReport)> {
    let before = probes.measure_each(engine, &Overrides::new())?;
    check_edit_at(engine, overrides, probes, edit, cfg, &before)
}

/// [`check_edit`] with `before`, the probes' measure on the current weights, already known.
///
/// Costs one forward of the probes with the full edit. An edit that fails at full size is
/// scaled back. When `edit` has fewer rows than the probes (an edit in a row), the smallest
/// scale that still makes it (of a batch, at least one of its edits) is found first on the
/// edit's own batch, its bisection asked 7 scales at a time in one forward of the batch
/// repeated ([`AtScales`]: 2 forwards where one scale a forward takes 8); if the probes fail there too the edit is refused after that one more
/// probe forward, otherwise the largest passing scale above it is bisected (at most 6
/// more). Otherwise the probes are bisected from `min_scale` up and the edit is checked at
/// the scale found.
///
/// The decision is the one of bisecting the probes first and then asking whether the edit
/// is made, as long as a larger scale moves the probes more and makes the edit no less; but
/// a refusal, most of a long run's decisions, costs 2 probe forwards instead of 9.
///
/// On that same assumption the search measures only the probes the edit can change: those
/// whose agreement the weights before and the full edit differ on. The others agree as much
/// at both ends (fully, most of them) and are counted so in between, and the KL is taken as
/// the full edit's, which passes. Late in a long run many probes agree only in part before
/// the edit, left so by the edits committed before it; one that the edit leaves so is not
/// measured again at every step of its search (1,000 CounterFact edits in a row went from
/// 0.669 to 0.596 s an edit, with the same decisions). Of 100 CounterFact probes an edit in
/// a row changes about a tenth, so each step of the search costs a tenth of a probe forward. The scale it finds is then
/// measured on every probe; should that fail (a probe that moves back and forth with the
/// scale), the search is run again on every probe.
pub fn check_edit_at(
    engine: &Engine,
    overrides: &Overrides,
    probes: &Probes,
    edit: Option<&TokenBatch>,
    cfg: &GuardConfig,
    before: &ProbeMeasure,
) -> Result<(Option<Overrides>, GuardReport)> {
    cfg.validate()?;
    let cfg = &cfg.for_edits(edit.map_or(1, |e| e.batch_size() as usize));
    let full = probes.measure_each(engine, overrides)?;
    let b = &before.score;
    let fmt = |p: &ProbeScore| format!("top-1 agreement {:.3}, KL {:.3}", p.agreement, p.kl);
    let limits = format!(
        "limits: agreement >= {:.2}, drop <= {:.2}, KL <= {:.2}",
        cfg.min_agreement, cfg.max_drop, cfg.max_kl
    );
    let report = |decision, scale, after: ProbeMeasure, edit_success, message| GuardReport {
        decision,
        scale,
        before: *b,
        full: full.score,
        after: after.score,
        edit_success,
        message,
        after_per_probe: after.per_probe,
    };
    if passes(cfg, b, &full.score) {
        if cfg.shrink {
            if let Some(edit) = edit {
                // The smallest scale on the halving ladder that still makes the edit.
                let (mut best, mut s) = (1.0, 0.5);
                while s >= cfg.min_scale {
                    if !makes_edit(engine, &scale_overrides(engine, overrides, s)?, edit)? {
                        break;
                    }
                    best = s;
                    s /= 2.0;
                }
                if best < 1.0 {
                    let scaled = scale_overrides(engine, overrides, best)?;
                    let after = probes.measure_each(engine, &scaled)?;
                    let message = format!("edit shrunk to scale {best} (the smallest that still makes it): probes {}", fmt(&after.score));
                    return Ok((Some(scaled), report(Decision::Scaled, best, after, Some(true), message)));
                }
            }
        }
        let message = format!("edit accepted: probes {} (before {})", fmt(&full.score), fmt(b));
        return Ok((Some(overrides.map(|t| t.shallow_clone())), report(Decision::Accepted, 1.0, full.clone(), None, message)));
    }
    let refuse = |why: String| {
        let message = format!(
            "edit refused: it would break the locality probes ({} -> {}; {limits}){why}; nothing was committed",
            fmt(b),
            fmt(&full.score)
        );
        report(Decision::Refused, 0.0, before.clone(), Some(false), message)
    };
    if !cfg.scale_back {
        return Ok((None, refuse(String::new())));
    }
    let every = |s: f64| probes.measure_each(engine, &scale_overrides(engine, overrides, s)?);
    let search = |at: &dyn Fn(f64) -> Result<ProbeMeasure>| scale_search(engine, overrides, edit, cfg, (b, probes.len()), at);
    let changing = match changing_probes(cfg, before, &full) {
        Some(rows) => probes.subset(engine, &rows)?.map(|sub| (rows, sub)),
        None => None,
    };
    let found = match changing {
        Some((rows, sub)) => {
            let few = |s: f64| -> Result<ProbeMeasure> {
                let m = sub.measure_each(engine, &scale_overrides(engine, overrides, s)?)?;
                let mut per_probe = full.per_probe.clone();
                for (&r, a) in rows.iter().zip(&m.per_probe) {
                    per_probe[r] = *a;
                }
                let agreement = per_probe.iter().sum::<f64>() / per_probe.len() as f64;
                Ok(ProbeMeasure { score: ProbeScore { agreement, kl: full.score.kl }, per_probe })
            };
            match search(&few)? {
                Found::Scale(lo, _) => match every(lo)? {
                    after if passes(cfg, b, &after.score) => Found::Scale(lo, after),
                    _ => search(&every)?,
                },
                refused => refused,
            }
        }
        None => search(&every)?,
    };
    let (lo, after) = match found {
        Found::Refused(why) => return Ok((None, refuse(why))),
        Found::Scale(lo, after) => (lo, after),
    };
    let scaled = scale_overrides(engine, overrides, lo)?;
    // Of a batch, the report says how many of its edits the scaled edit still makes (a
    // batch's full edit need not make every one either, and refusing a batch for one lost
    // edit would lose them all).
    let made = match edit {
        Some(e) => Some(edits_made(engine, &scaled, e)?),
        None => None,
    };
    if let Some((0, of)) = made {
        // A larger scale made it but this one does not (the edit is not monotone in its scale).
        return Ok((None, refuse(format!(", and scaled to {lo:.3} (probes {}) it makes none of the {of} edit(s)", fmt(&after.score)))));
    }
    let makes = match made {
        Some((m, of)) if of > 1 => format!(", making {m} of the {of} edits"),
        _ => String::new(),
    };
    let message = format!(
        "edit scaled back to {lo:.3}: at full size it would break the locality probes ({} -> {}; {limits}); scaled: {}{makes}",
        fmt(b),
        fmt(&full.score),
        fmt(&after.score)
    );
    let edit_success = made.map(|(m, of)| m == of);
    Ok((Some(scaled), report(Decision::Scaled, lo, after, edit_success, message)))
}

/// What [`scale_search`] found: the largest passing scale with its measure, or why the
/// edit is refused (the end of the refusal's message).
enum Found {
    Scale(f64, ProbeMeasure),
    Refused(String),
}

/// The probes an edit's scale can change, for a full edit `full` that fails the guard
/// from `before`: those whose agreement the two differ on. `None` when the KL
/// is what fails (every probe counts in it), when every probe can change, or when the
/// measures are not of the same probes.
fn changing_probes(cfg: &GuardConfig, before: &ProbeMeasure, full: &ProbeMeasure) -> Option<Vec<usize>> {
    let (b, f) = (&before.per_probe, &full.per_probe);
    if b.len() != f.len() || !(full.score.kl.is_finite() && full.score.kl <= cfg.max_kl) {
        return None;
    }
    let rows: Vec<usize> = (0..f.len()).filter(|&i| b[i] != f[i]).collect();
    (!rows.is_empty() && rows.len() < f.len()).then_some(rows)
}

/// The guard's scale search for an edit that fails at full size ([`check_edit_at`]), with
/// the probes measured at a scale by `at`.
fn scale_search(
    engine: &Engine,
    overrides: &Overrides,
    edit: Option<&TokenBatch>,
    cfg: &GuardConfig,
    (before, n_probes): (&ProbeScore, usize),
    at: &dyn Fn(f64) -> Result<ProbeMeasure>,
) -> Result<Found> {
    let s_min = cfg.min_scale;
    // The scales to bisect the probes over: from a passing `lo` (with its measure) up to
    // the failing full edit.
    let (lo, lo_measure) = match edit {
        // The edit's own batch first when it is the cheaper forward (an edit in a row: one
        // request against the call's locality prompts); a batch as large as its probes
        // bisects the probes and asks about the edit once, at the end.
        Some(e) if e.batch_size() < n_probes as i64 => {
            let found = match AtScales::new(engine, overrides, e)? {
                Some(at) => {
                    let stop = |ends: &[bool]| match ends {
                        [false, _] => Some(None),
                        [true, true] => Some(Some(s_min)),
                        _ => None,
                    };
                    crate::mend::calibrate::smallest_making_in_rounds((s_min, 1.0), &[1.0, s_min], stop, &|ss: &[f64]| at.made(engine, ss))?
                }
                None => {
                    let made_at = |s: f64| -> Result<bool> { Ok(edits_made(engine, &scale_overrides(engine, overrides, s)?, e)?.0 > 0) };
                    smallest_scale(s_min, &made_at)?
                }
            };
            let Some(s_make) = found else {
                let what = if e.batch_size() > 1 { "makes none of its edits" } else { "does not make the edit" };
                return Ok(Found::Refused(format!(", and even at full size it {what}")));
            };
            let m = at(s_make)?;
            if !passes(cfg, before, &m.score) {
                let what = if e.batch_size() > 1 { "makes one of its edits" } else { "makes the edit" };
                // The agreement alone: the search may have measured only the probes the
                // scale can change, with the full edit's KL standing in for theirs.
                let probes = format!("top-1 agreement {:.3}", m.score.agreement);
                return Ok(Found::Refused(format!(", and at scale {s_make:.3}, the smallest that still {what}, probes {probes}")));
            }
            (s_make, m)
        }
        _ => {
            let m = at(s_min)?;
            if !passes(cfg, before, &m.score) {
                return Ok(Found::Refused(format!(", even at scale {s_min}")));
            }
            (s_min, m)
        }
    };
    let (mut lo, mut after, mut hi) = (lo, lo_measure, 1.0);
    for _ in 0..6 {
        if hi / lo < 1.05 {
            break;
        }
        let mid = (lo * hi).sqrt(); // geometric: scales span orders of magnitude
        let m = at(mid)?;
        if passes(cfg, before, &m.score) {
            (lo, after) = (mid, m);
        } else {
            hi = mid;
        }
    }
    Ok(Found::Scale(lo, after))
}

/// The smallest scale in `[s_min, 1]` at which `made` holds (to the calibration's bisection
/// resolution), assuming a larger scale makes no fewer edits; `None` when it does not hold at 1.
fn smallest_scale(s_min: f64, made: &impl Fn(f64) -> Result<bool>) -> Result<Option<f64>> {
    if !made(1.0)? {
        return Ok(None);
    }
    if made(s_min)? {
        return Ok(Some(s_min));
    }
    crate::mend::calibrate::smallest_making(s_min, 1.0, made).map(Some)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_drop_or_agreement_exactly_at_the_limit_passes() {
        let cfg = GuardConfig::default();
        let before = ProbeScore { agreement: 1.0, kl: 0.0 };
        // One probe of twenty changed: a drop of exactly 0.05 in real numbers.
        let one_in_twenty = ProbeScore { agreement: 19.0 / 20.0, kl: 0.2 };
        assert!(passes(&cfg, &before, &one_in_twenty));
        let two_in_twenty = ProbeScore { agreement: 18.0 / 20.0, kl: 0.2 };
        assert!(!passes(&cfg, &before, &two_in_twenty), "a drop of 0.10 is beyond 0.05");
        let at_min = GuardConfig { max_drop: 1.0, min_agreement: 0.7, ..cfg.clone() };
        assert!(passes(&at_min, &before, &ProbeScore { agreement: 0.1 * 7.0, kl: 0.0 }));
        assert!(!passes(&cfg, &before, &ProbeScore { agreement: 1.0, kl: f64::NAN }));
    }

    /// Issue #47: `max_drop` is one edit's; of twenty probes one edit may change one, a
    /// batch of three edits two (the floor's limit, below its 0.15), and no batch more.
    #[test]
    fn a_batch_may_drop_the_agreement_by_each_of_its_edits_share() {
        let cfg = GuardConfig::default();
        let before = ProbeScore { agreement: 1.0, kl: 0.0 };
        let changed = |n: f64| ProbeScore { agreement: (20.0 - n) / 20.0, kl: 0.2 };
        assert_eq!(cfg.for_edits(1).max_drop, cfg.max_drop);
        assert_eq!(cfg.for_edits(0).max_drop, cfg.max_drop);
        assert!(!passes(&cfg.for_edits(1), &before, &changed(2.0)));
        assert!(passes(&cfg.for_edits(3), &before, &changed(2.0)));
        assert!(!passes(&cfg.for_edits(3), &before, &changed(4.0)), "0.80 is below the floor and beyond 0.15");
        let batch = cfg.for_edits(100);
        assert_eq!(batch.max_drop, 1.0);
        assert!((batch.min_agreement, batch.max_kl) == (cfg.min_agreement, cfg.max_kl));
        assert!(passes(&batch, &before, &changed(2.0)) && !passes(&batch, &before, &changed(3.0)), "the floor 0.9 binds");
    }

    /// The scale search measures the probes whose agreement the full edit changes: not one
    /// that agrees fully at both ends, nor one left as it was in part (by earlier edits).
    #[test]
    fn the_search_measures_only_the_probes_the_full_edit_changes() {
        let cfg = GuardConfig::default();
        let measure = |per_probe: Vec<f64>, kl| ProbeMeasure { score: ProbeScore { agreement: 0.0, kl }, per_probe };
        let before = measure(vec![1.0, 0.5, 0.5, 1.0, 0.0], 0.0);
        let full = measure(vec![1.0, 0.5, 0.0, 0.5, 0.0], 0.2);
        assert_eq!(changing_probes(&cfg, &before, &full), Some(vec![2, 3]));
        assert_eq!(changing_probes(&cfg, &before, &measure(full.per_probe.clone(), f64::INFINITY)), None, "a failing KL counts every probe");
        assert_eq!(changing_probes(&cfg, &before, &measure(vec![0.25; 5], 0.2)), None, "every probe changes");
        assert_eq!(changing_probes(&cfg, &before, &measure(before.per_probe.clone(), 0.2)), None, "none changes");
        assert_eq!(changing_probes(&cfg, &before, &measure(vec![1.0; 4], 0.2)), None, "other probes");
    }
}
