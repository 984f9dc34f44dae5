//! `mend-ls`: MEND's per-edit updates combined by least squares over their keys, as MALMEN
//! (Tan et al., 2024) aggregates many edits, instead of summed (issue #24).
//!
//! Why: summed, N MEND edits add N rank-r updates whose effects on each other's keys (and
//! on unrelated ones) pile up; on the embedded default 10 edits in one batch or one after
//! another already break the model. Here the editor still turns each edit's gradient
//! factors into its update `M_i = Σ_rows aᵀb` (shape `[d_in, d_out]` in `x·W` orientation),
//! but what is kept of it is only what it does at the edit's own keys: for every row `t`
//! of edit `i` the key `k_t` (the layer's input at that token, `[d_in]`) and the value
//! shift `v_t = k_t·M_i` (`[d_out]`). The weight's change `S` (`[d_in, d_out]`) then solves
//!
//! ```text
//!     min_S  Σ_t ‖k_t·S − v_t‖² + λ·‖S‖²      S = (KᵀK + λ·I)⁻¹ KᵀV
//! ```
//!
//! over all edits' rows `K` (`[R, d_in]`), `V` (`[R, d_out]`), for each edited weight
//! separately (MALMEN's normal equation, in the primal form: a `d_in × d_in` solve).
//! Optionally `+ μ·Σ_j ‖c_j·S‖²` over keys `c_j` of unrelated text (`CᵀC` added to the
//! normal matrix), which asks `S` to leave the layer's outputs there alone, as MEMIT's
//! key covariance does. From the editor's key statistics each solve leaves out the lines
//! that state a fact the edits rewrite ([`Fact`]): kept, they would ask `S` to keep the
//! old fact at the edit's own rephrasings (docs/notebook/many-edits.md, "Many edits, part 7").
//!
//! **Re-solve rounds** ([`LsConfig::rounds`]). One solve leaves some edits short of their
//! target: the solve balances them against each other and the unrelated keys. A round
//! checks which edits' prompts do not yet answer their targets at the solved weights,
//! captures those again there, and adds the editor's new value shifts (at the edits' keys
//! of the first capture) to their targets before solving again, so the push goes where an
//! edit still fails rather than to all (scaling every target instead moves all edits and
//! the unrelated text together; docs/notebook/many-edits.md, part 3). A round that does not
//! make more edits answer is dropped and ends the search, so rounds never end worse than one
//! solve on the edits' own prompts. They need an editor whose inputs stay in its training range
//! at edited weights: the shipped `data/editor-many` edits only the MLP output projections.
//!
//! Edits one after another re-solve over every edit so far from the weights the first
//! one started from, `W0` ([`KeyMemory`]): a new edit is captured at `W0` (the current
//! weights minus the remembered change), its rows target their own shift `v`, earlier rows
//! keep their targets, so a later edit cannot overwrite an earlier one's values and,
//! without rounds, N sequential edits are the batch of N by construction. With rounds,
//! every call checks the remembered edits too (a later edit can break an earlier one) and
//! may push any of them. Capturing on the edited weights instead (targets `k·S_prev + v`)
//! was measured first: the editor's inputs leave its training distribution after a few
//! commits and 10 sequential edits broke the model (0.00 reliability;
//! docs/notebook/many-edits.md, part 2).
use std::collections::{BTreeSet, HashMap};

use tch::{Kind, Tensor};
use tracing::debug;

pub use crate::config::LsConfig;
use crate::data::{EditRecord, Example, TokenBatch};
use crate::mend::stats::{weight_scale, SummedText};
use crate::mend::{losses, Editor, Engine};
use crate::model::Overrides;
use crate::{Error, Result};

/// What a user sets of [`LsConfig`] (the `--ls-*` flags); the rest comes from the editor
/// (`MendConfig::ls` in its `editor.json`).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct LsChoice {
    pub lambda: Option<f64>,
    pub cov_weight: Option<f64>,
    pub rounds: Option<usize>,
}

impl LsChoice {
    /// Everything from `flags`, nothing from an editor.
    pub fn all(c: LsConfig) -> Self {
        Self { lambda: Some(c.lambda), cov_weight: Some(c.cov_weight), rounds: Some(c.rounds) }
    }

    /// The ranges the settings must lie in: one error naming the field
    /// ([`crate::edit::options::MethodOptions`]'s `ls_*`).
    pub fn check(&self) -> Result<()> {
        if let Some(w) = self.cov_weight.filter(|w| !(w.is_finite() && *w >= 0.0)) {
            return Err(Error::input(format!("ls_keep_weight must be a number >= 0, got {w}")));
        }
        if let Some(l) = self.lambda.filter(|l| !(l.is_finite() && *l > 0.0)) {
            return Err(Error::input(format!("ls_lambda must be a positive number, got {l}")));
        }
        if let Some(r) = self.rounds.filter(|r| *r > crate::config::MAX_LS_ROUNDS) {
            return Err(Error::input(format!("ls_rounds must be at most {}, got {r}", crate::config::MAX_LS_ROUNDS)));
        }
        Ok(())
    }

    /// The settings: what was chosen here, the rest from `editor`'s.
    pub fn resolve(&self, editor: &LsConfig) -> LsConfig {
        LsConfig {
            lambda: self.lambda.unwrap_or(editor.lambda),
            cov_weight: self.cov_weight.unwrap_or(editor.cov_weight),
            rounds: self.rounds.unwrap_or(editor.rounds),
        }
    }
}


/// `CᵀC` `[d_in, d_in]` of every edited weight's inputs at every token of `texts` (the
/// unrelated keys), under the engine's current weights, in batches of 64. Logs its
/// progress (texts done, elapsed, estimated time left) every 10 % or 30 s.
pub fn unrelated_grams(engine: &Engine, texts: &[String]) -> Result<Vec<Tensor>> {
    let mut examples = Vec::with_capacity(texts.len());
    let start = std::time::Instant::now();
    let mut progress = Progress::new(texts.len() * 2, "keys of the unrelated text");
    for t in texts {
        progress.step(1, start);
        if let Some((ids, _)) = crate::mend::stats::line_ids(engine, t, usize::MAX)? {
            examples.push(Example { ids, answer_start: 1, image: None });
        }
    }
    if examples.is_empty() {
        return Err(Error::input("no unrelated text to take keys from"));
    }
    let mut grams: Option<Vec<Tensor>> = None;
    progress.done = texts.len();
    for chunk in examples.chunks(64) {
        progress.step(chunk.len(), start);
        let refs: Vec<&Example> = chunk.iter().collect();
        let xs = engine.layer_inputs(&engine.collate(&refs)?)?;
        grams = Some(crate::error::guard(|| {
            let g: Vec<Tensor> = xs.iter().map(|x| x.tr().matmul(x)).collect();
            Ok(match grams.take() {
                Some(acc) => acc.into_iter().zip(g).map(|(a, b)| a + b).collect(),
                None => g,
            })
        })?);
    }
    grams.ok_or_else(|| Error::input("no unrelated text to take keys from"))
}

/// Log lines of a long loop (`done`/`total` units: tokenising counts one per text, the
/// forwards one per example): one at every 10 % and at least every 30 s.
struct Progress {
    total: usize,
    done: usize,
    what: &'static str,
    next_tenth: usize,
    last: std::time::Instant,
}

impl Progress {
    fn new(total: usize, what: &'static str) -> Self {
        Self { total: total.max(1), done: 0, what, next_tenth: 1, last: std::time::Instant::now() }
    }

    fn step(&mut self, n: usize, start: std::time::Instant) {
        self.done += n;
        let tenth = self.done * 10 / self.total;
        if tenth >= self.next_tenth || self.last.elapsed().as_secs() >= 30 {
            self.next_tenth = tenth + 1;
            self.last = std::time::Instant::now();
            let elapsed = start.elapsed().as_secs_f64();
            let eta = elapsed * (self.total.saturating_sub(self.done)) as f64 / self.done.max(1) as f64;
            tracing::info!("{}: {}% ({:.0} s, about {:.0} s left)", self.what, self.done * 100 / self.total, elapsed, eta);
        }
    }
}

/// A fact an edit rewrites, as its request states it: the subject and its answer before
/// the edit (EasyEdit's `subject` and `ground_truth`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fact {
    pub subject: String,
    pub old: String,
}

impl Fact {
    /// The fact of a request that names both (trimmed, non-empty); else `None`.
    pub fn of(record: &EditRecord) -> Option<Fact> {
        let subject = record.subject.as_deref()?.trim();
        let old = record.ground_truth.as_deref()?.trim();
        (!subject.is_empty() && !old.is_empty()).then(|| Fact { subject: subject.into(), old: old.into() })
    }

    /// Whether a line of text states it: names both the subject and the old answer.
    fn stated_in(&self, line: &str) -> bool {
        line.contains(&self.subject) && line.contains(&self.old)
    }
}

/// The lines of the key statistics' text left out of the solve: those that state a fact
/// one of the remembered edits rewrote ([`SummedText`]), with their keys' sums.
#[derive(Default)]
struct LeftOut {
    /// Indices into [`SummedText::lines`].
    lines: BTreeSet<usize>,
    /// `Σ k kᵀ` of their keys per edited weight, f32 `[d_in, d_in]` (empty: no line).
    sums: Vec<Tensor>,
    /// Their tokens, counted as the statistics count them.
    tokens: f64,
}

impl LeftOut {
    fn shallow(&self) -> LeftOut {
        LeftOut { lines: self.lines.clone(), sums: self.sums.iter().map(Tensor::shallow_clone).collect(), tokens: self.tokens }
    }
}

/// Per edited weight: every committed edit's keys `K` `[R, d_in]`, targets `T` `[R, d_out]`
/// (relative to the weights the memory started from), the edit each row belongs to `[R]`
/// (int64, numbered in commit order), their Gram `KᵀK` `[d_in, d_in]` and `KᵀT` `[d_in,
/// d_out]` (kept, so that an edit in a row adds its own rows' instead of recomputing all
/// of them: at 1,000 edits in a row, ~10,000 rows, a product that grows with every edit)
/// and the change `S` `[d_in, d_out]` committed so far.
#[derive(Default)]
struct Layer {
    k: Option<Tensor>,
    t: Option<Tensor>,
    edit: Option<Tensor>,
    gram: Option<Tensor>,
    kt: Option<Tensor>,
    s: Option<Tensor>,
}

impl Layer {
    fn shallow(&self) -> Layer {
        let c = |t: &Option<Tensor>| t.as_ref().map(Tensor::shallow_clone);
        Layer { k: c(&self.k), t: c(&self.t), edit: c(&self.edit), gram: c(&self.gram), kt: c(&self.kt), s: c(&self.s) }
    }
}

/// The last [`edit`]'s proposal, which [`KeyMemory::commit`] makes the memory.
struct Proposal {
    /// All rows (the remembered ones first) with their proposed targets and `S`.
    layers: Vec<Layer>,
    /// The remembered rows' targets before this edit (re-solve rounds may change them).
    old_t: Vec<Option<Tensor>>,
    /// How many edits the proposal adds.
    edits: i64,
    /// The new edits' requests (kept only when rounds may check them again).
    examples: Vec<Example>,
    /// Times each edit (remembered, then new) has been pushed by a round, this call included.
    pushes: Vec<usize>,
    /// The statistics' lines left out, these edits' facts' included.
    left_out: LeftOut,
}

/// The edits a session has committed with `mend-ls`, for re-solving over all of them.
#[derive(Default)]
pub struct KeyMemory {
    layers: Vec<Layer>,
    /// Edits committed (rows are numbered by these).
    edits: i64,
    /// Each committed edit's request, in commit order, when re-solve rounds are on (they
    /// check whether every remembered edit still answers).
    examples: Vec<Example>,
    /// How many rounds have pushed each of them: at most `rounds` over an edit's life, so
    /// that edits one after another are pushed no more than the same edits in one batch.
    pushes: Vec<usize>,
    /// The statistics' lines that state a committed edit's fact, out of every solve.
    left_out: LeftOut,
    pending: Option<Proposal>,
}

impl KeyMemory {
    /// The committed edits, sharing their tensors (a commit replaces them, never changes
    /// them in place): what a failed edit call puts back ([`crate::edit::session::Session::edit_examples`]).
    pub fn snapshot(&self) -> KeyMemory {
        KeyMemory {
            layers: self.layers.iter().map(Layer::shallow).collect(),
            edits: self.edits,
            examples: self.examples.clone(),
            pushes: self.pushes.clone(),
            left_out: self.left_out.shallow(),
            pending: None,
        }
    }

    /// Forgets every edit (the session was reset to its loaded weights).
    pub fn clear(&mut self) {
        *self = Self::default();
    }

    /// Records the last proposed edit as committed at `scale` (1: as proposed; the guard
    /// may scale it back, `W + s·ΔW`). At a scale below 1 every row's stored target moves
    /// the same fraction from where it was (for the new rows, `k·S_prev`) towards the
    /// proposed one and `S = S_prev + s·(S_new − S_prev)`: exact for `S`, approximate for
    /// the targets.
    pub fn commit(&mut self, scale: f64) {
        let Some(p) = self.pending.take() else { return };
        if scale <= 0.0 {
            return;
        }
        let _g = tch::no_grad_guard();
        let mut layers = Vec::with_capacity(p.layers.len());
        for (i, (new, old_t)) in p.layers.into_iter().zip(p.old_t).enumerate() {
            let (Some(k), Some(t), Some(edit), Some(gram), Some(kt), Some(s)) = (new.k, new.t, new.edit, new.gram, new.kt, new.s) else {
                layers.push(Layer::default());
                continue;
            };
            let prev = self.layers.get(i);
            let s_prev = prev.and_then(|l| l.s.as_ref()).map_or_else(|| s.zeros_like(), Tensor::shallow_clone);
            let (t, kt, s) = if scale < 1.0 {
                // Where each row's target was: stored for the remembered rows, `k·S_prev`
                // (what the weights did there) for the new ones.
                let n_old = old_t.as_ref().map_or(0, |o| o.size()[0]);
                let k_new = k.narrow(0, n_old, k.size()[0] - n_old);
                let fresh = k_new.matmul(&s_prev);
                // `KᵀT` of the scaled targets by linearity, `KᵀT_base + s·(KᵀT_prop − KᵀT_base)`,
                // with `KᵀT_base` the stored one plus the new rows' `K_newᵀ·(K_new·S_prev)`:
                // the new rows' work instead of a product over every row (at 1,000 edits
                // in a row, ~50 GFLOP a scaled-back commit at 3,000 rows).
                let kt_fresh = k_new.tr().matmul(&fresh);
                let kt_base = match prev.and_then(|l| l.kt.as_ref()) {
                    Some(kt_old) => kt_old + kt_fresh,
                    None => kt_fresh,
                };
                let base = match old_t {
                    Some(o) => Tensor::cat(&[o, fresh], 0),
                    None => fresh,
                };
                let t = &base + (&t - &base) * scale;
                (t, &kt_base + (&kt - &kt_base) * scale, &s_prev + (&s - &s_prev) * scale)
            } else {
                (t, kt, s)
            };
            layers.push(Layer { k: Some(k), t: Some(t), edit: Some(edit), gram: Some(gram), kt: Some(kt), s: Some(s) });
        }
        self.edits += p.edits;
        self.examples.extend(p.examples);
        self.pushes = p.pushes;
        self.left_out = p.left_out;
        self.layers = layers;
    }

    /// Edits remembered.
    pub fn edits(&self) -> i64 {
        self.edits
    }
}

/// A MEND editor whose per-edit updates are combined by least squares.
pub struct LsEditor {
    pub editor: Editor,
    pub config: LsConfig,
    pub memory: KeyMemory,
    /// [`unrelated_grams`] of the unedited model, or the editor's key statistics
    /// ([`crate::mend::stats::KeyStats::grams`]), per edited weight (empty: none).
    pub unrelated: Vec<Tensor>,
    /// The lines the key statistics in `unrelated` summed, when their text was found
    /// ([`SummedText::find`]): each edit leaves out of the solve's statistics those that
    /// state the fact it rewrites, so the solve does not keep the old fact. `None` with a
    /// keep text or without statistics.
    pub stats_text: Option<SummedText>,
    /// `--method auto`: a call with a single request and no edit remembered is plain MEND
    /// with this editor ([`crate::edit::make_edit`]), not a solve.
    pub single_mend: bool,
}

/// One edited weight's rows for a solve: keys, targets, the edit of each row.
struct Rows {
    k: Tensor,
    t: Tensor,
    edit: Tensor,
    /// `KᵀK` `[d_in, d_in]`.
    gram: Tensor,
    /// `KᵀT` `[d_in, d_out]`.
    kt: Tensor,
}

/// Each row's value shift under its own edit's update: `v_t = Σ_{s in t's edit} (k_t·a_s) b_s`,
/// for rows `k` `[R, d_in]` of edits `edit_k` `[R]` and the editor's terms `a` `[Q, d_in]`,
/// `b` `[Q, d_out]` of edits `edit_ab` `[Q]`. `[R, d_out]`; 0 for a row whose edit has no term.
///
/// Rows and terms come in runs of one edit each, in ascending edit order (a capture's rows
/// are in batch order), so each run's shifts are `(K_e·A_eᵀ)·B_e`: `Σ_e r_e·q_e` products
/// instead of the `R × Q` of every row with every term, which at 100 edits in one batch
/// (~1,000 rows) was a fifth of the edit. Unsorted edit ids take that whole product, masked.
fn shifts(k: &Tensor, edit_k: &Tensor, a: &Tensor, b: &Tensor, edit_ab: &Tensor) -> Tensor {
    let (Some(rows), Some(terms)) = (runs(edit_k), runs(edit_ab)) else {
        let same = edit_k.unsqueeze(1).eq_tensor(&edit_ab.unsqueeze(0)).to_kind(Kind::Float);
        return (k.matmul(&a.tr()) * same).matmul(b);
    };
    let d_out = b.size()[1];
    let zeros = |n: i64| Tensor::zeros([n, d_out], (b.kind(), b.device()));
    let mut parts = Vec::with_capacity(rows.len());
    for (e, start, n) in rows {
        parts.push(match terms.binary_search_by_key(&e, |t| t.0) {
            Ok(i) => {
                let (_, t0, m) = terms[i];
                k.narrow(0, start, n).matmul(&a.narrow(0, t0, m).tr()).matmul(&b.narrow(0, t0, m))
            }
            Err(_) => zeros(n),
        });
    }
    if parts.is_empty() {
        return zeros(0);
    }
    Tensor::cat(&parts, 0)
}

/// The runs `(edit, first row, rows)` of an int64 `[N]` of edit ids, when they ascend
/// (each edit one run); `None` otherwise.
fn runs(edit: &Tensor) -> Option<Vec<(i64, i64, i64)>> {
    let ids = Vec::<i64>::try_from(edit.to_device(tch::Device::Cpu)).ok()?;
    let mut out: Vec<(i64, i64, i64)> = Vec::new();
    for (i, &e) in ids.iter().enumerate() {
        match out.last_mut() {
            Some(last) if last.0 == e => last.2 += 1,
            Some(last) if last.0 > e => return None,
            _ => out.push((e, i as i64, 1)),
        }
    }
    Some(out)
}

/// `S` `[d_in, d_out]` of one weight: `(KᵀK + λ·I + μ·CᵀC)⁻¹ KᵀT`.
fn solve(rows: &Rows, config: &LsConfig, unrelated: Option<&Tensor>) -> Tensor {
    solve_gram(&rows.k, &rows.t, &rows.gram, Some(&rows.kt), config, unrelated)
}

/// The normal equation of the solve: `S = (KᵀK + λ·I + μ·C)⁻¹ KᵀT` `[d_in, d_out]` for keys
/// `k` `[R, d_in]`, targets `t` `[R, d_out]`, `λ = config.lambda · mean_t ‖k_t‖²`, `μ =
/// config.cov_weight` and the unrelated keys' Gram `C` `[d_in, d_in]` (none: no `μ` term).
/// Differentiable w.r.t. `t` when `t` requires grad, as meta-training through the solve
/// needs ([`aggregate`]); the keys and `C` are constants.
///
/// The matrix is symmetric positive definite (`λ > 0`), so it is factored by Cholesky, half
/// an LU's work, with LU kept for a factor that fails in f32; and with fewer rows than
/// outputs (an edit in a row has ~10 a request, SmolLM2's gate and up projections 1536
/// outputs) `(G⁻¹Kᵀ)·T` solves for `R` right-hand sides instead of `d_out`. Together they
/// halve the solve, which was most of an edit in a row.
pub fn solve_keys(k: &Tensor, t: &Tensor, config: &LsConfig, unrelated: Option<&Tensor>) -> Tensor {
    solve_gram(k, t, &k.tr().matmul(k), None, config, unrelated)
}

/// [`solve_keys`] with `kk = KᵀK` given (`mean_t ‖k_t‖²` is its trace over `R`) and, kept
/// beside the rows of an edit in a row, `kt = KᵀT` (`None`: computed here when needed),
/// solving for whichever right-hand sides cost less: `R` rows, or the `d_out` columns of
/// `KᵀT` (at 100 edits in a row, ~1,000 rows, the columns halve the solve of SmolLM2's
/// gate and up projections).
fn solve_gram(k: &Tensor, t: &Tensor, kk: &Tensor, kt: Option<&Tensor>, config: &LsConfig, unrelated: Option<&Tensor>) -> Tensor {
    let (rows, d_in) = (k.size()[0], k.size()[1]);
    let lambda = config.lambda * (kk.trace().double_value(&[]) / rows.max(1) as f64).max(1e-12);
    let mut gram = kk + Tensor::eye(d_in, (Kind::Float, k.device())) * lambda;
    if let Some(c) = unrelated {
        gram += c.to_device(k.device()) * config.cov_weight;
    }
    // `(G⁻¹Kᵀ)·T` costs `2·d_in·R·(d_in + d_out)`, `G⁻¹(KᵀT)` `2·d_in²·d_out` with `KᵀT`
    // kept and `2·d_in·d_out·(R + d_in)` without.
    let d_out = t.size()[1];
    let few_rows = match kt {
        Some(_) => rows * (d_in + d_out) < d_in * d_out,
        None => rows < d_out,
    };
    let kt = || kt.map_or_else(|| k.tr().matmul(t), Tensor::shallow_clone);
    let (factor, info) = gram.linalg_cholesky_ex(false, false);
    if info.int64_value(&[]) != 0 {
        return Tensor::linalg_solve(&gram, &kt(), true);
    }
    // `L⁻ᵀ(L⁻¹·rhs)` as two triangular solves: `cholesky_solve` gave the same floats
    // with a copy of its operands (2 % of an edit in a row at 300, part 23).
    let solve = |rhs: &Tensor| factor.tr().linalg_solve_triangular(&factor.linalg_solve_triangular(rhs, false, true, false), true, true, false);
    match few_rows {
        true => solve(&k.tr().contiguous()).matmul(t),
        false => solve(&kt()),
    }
}

/// The edit of a batch as meta-training through the least-squares aggregation scores it
/// (`aggregate: least_squares`, MALMEN): the editor's terms of the captured `factors`
/// (rows of example `positions / t_len`, [`Engine::capture_by_example`]) turned into each
/// row's value shift at its own edit's update, and one solve per edited weight against the
/// unrelated keys' Grams `unrelated` (the key statistics, `μ`-weighted; empty: none),
/// exactly the first solve of [`edit`] without rounds. Differentiable w.r.t. the editor
/// under grad mode: its terms reach `S` through the shifts and `linalg_solve`.
/// Per weight the override `(I, S)` (`x·W + x·S`; `W + S` itself for non-f32 weights).
pub fn aggregate(
    engine: &Engine,
    editor: &mut Editor,
    (factors, positions, t_len): (&[crate::mend::Factors], &[Tensor], i64),
    config: &LsConfig,
    unrelated: &[Tensor],
    training: bool,
) -> Result<Overrides> {
    config.validate()?;
    let terms = editor.edit_terms(factors, training);
    let s = crate::error::guard(|| {
        let mut s = Vec::with_capacity(terms.len());
        for (i, (p, (a, b))) in engine.edit_params.iter().zip(terms).enumerate() {
            let k = &factors[i].x;
            if a.size()[0] != k.size()[0] {
                return Err(Error::Internal(format!("{}: the editor gave {} rows for {} keys", p.name, a.size()[0], k.size()[0])));
            }
            let edit = positions[i].divide_scalar_mode(t_len, "floor");
            let v = shifts(k, &edit, &a, &b, &edit);
            s.push(solve_keys(k, &v, config, unrelated.get(i)));
        }
        Ok(s)
    })?;
    overrides(engine, &KeyMemory::default(), &s)
}

/// The edit of `inner` (one or many examples) on the engine's current weights: for each
/// edited weight the change from the current weights to `W0 + S`, with `S` re-solved over
/// the remembered edits and these (with rounds, pushed until no more of them answer); as a
/// low-rank override `(I, S − S_prev)` (rank `d_in`).
/// Not committed: [`KeyMemory::commit`] records it once the caller has committed it.
pub fn edit(engine: &Engine, ls: &mut LsEditor, inner: &TokenBatch, facts: &[Fact]) -> Result<Overrides> {
    let _g = tch::no_grad_guard();
    ls.config.validate()?;
    let first = ls.memory.edits;
    // The requests the rounds check: the remembered ones, then these.
    let new_requests = match ls.config.rounds {
        0 => Vec::new(),
        _ => inner.examples().ok_or_else(|| Error::input("mend-ls re-solve rounds check each request's answer and need text requests: use `ls_rounds` 0 with images"))?,
    };
    // Captured at the weights the remembered edits started from, `W0 = W − S_prev`: each
    // edit's keys and shifts are those it would have in one batch with all the others.
    let undo: Vec<Option<Tensor>> = ls.memory.layers.iter().map(|l| l.s.as_ref().map(|s| -s)).collect();
    let w0 = weights_plus(engine, &undo)?;
    let (_, factors, positions) = engine.capture_by_example(inner, &w0)?;
    let left_out = leave_out(engine, ls, facts, &w0)?;
    let unrelated = unrelated_without(ls, &left_out);
    let t_len = inner.input_ids.size()[1];
    let terms = ls.editor.edit_terms(&factors, false);
    let mut rows: Vec<Rows> = crate::error::guard(|| {
        let mut rows = Vec::with_capacity(engine.edit_params.len());
        for (i, (p, (a, b))) in engine.edit_params.iter().zip(terms).enumerate() {
            let k = &factors[i].x;
            if a.size()[0] != k.size()[0] {
                return Err(Error::Internal(format!("{}: the editor gave {} rows for {} keys", p.name, a.size()[0], k.size()[0])));
            }
            let edit = positions[i].divide_scalar_mode(t_len, "floor") + first;
            // Targets relative to W0, where the keys were captured; remembered rows first.
            let v = shifts(k, &edit, &a, &b, &edit);
            let prev = ls.memory.layers.get(i);
            let (gram, kt) = (k.tr().matmul(k), k.tr().matmul(&v));
            rows.push(match prev.and_then(|l| Some((l.k.as_ref()?, l.t.as_ref()?, l.edit.as_ref()?, l.gram.as_ref()?, l.kt.as_ref()?))) {
                Some((k0, t0, e0, g0, kt0)) => Rows {
                    k: Tensor::cat(&[k0, k], 0),
                    t: Tensor::cat(&[t0, &v], 0),
                    edit: Tensor::cat(&[e0, &edit], 0),
                    gram: g0 + gram,
                    kt: kt0 + kt,
                },
                None => Rows { k: k.shallow_clone(), t: v, edit, gram, kt },
            });
        }
        Ok(rows)
    })?;
    let mut s = solve_all(&ls.config, &unrelated, &rows)?;
    let mut out = overrides(engine, &ls.memory, &s)?;
    let mut pushes = ls.memory.pushes.clone();
    if ls.config.rounds > 0 {
        let requests: Vec<&Example> = ls.memory.examples.iter().chain(&new_requests).collect();
        let all = engine.collate(&requests)?;
        let mut answers = answering(engine, &out, &all)?;
        pushes.resize(requests.len(), 0);
        for round in 1..=ls.config.rounds {
            let answered = answers.iter().filter(|a| **a).count();
            let failing: Vec<i64> = (0..answers.len()).filter(|&e| !answers[e] && pushes[e] < ls.config.rounds).map(|e| e as i64).collect();
            debug!(round, answered, of = answers.len(), pushed = failing.len(), "mend-ls re-solve");
            if failing.is_empty() {
                break;
            }
            // The failing edits captured at the solved weights `W0 + S`; the editor's new
            // update of each, taken at its first capture's keys, is added to its targets.
            let fails = engine.collate(&failing.iter().map(|&e| requests[e as usize]).collect::<Vec<_>>())?;
            let (_, f2, pos2) = engine.capture_by_example(&fails, &weights_plus(engine, &changes(&ls.memory, &s).into_iter().map(Some).collect::<Vec<_>>())?)?;
            let terms2 = ls.editor.edit_terms(&f2, false);
            let t2 = fails.input_ids.size()[1];
            let pushed: Vec<Rows> = crate::error::guard(|| {
                let ids = Tensor::from_slice(&failing);
                Ok(rows
                    .iter()
                    .zip(terms2)
                    .zip(&pos2)
                    .map(|((r, (a, b)), pos)| {
                        let edit2 = ids.to_device(pos.device()).index_select(0, &pos.divide_scalar_mode(t2, "floor"));
                        let push = shifts(&r.k, &r.edit, &a, &b, &edit2);
                        Rows {
                            k: r.k.shallow_clone(),
                            t: &r.t + &push,
                            edit: r.edit.shallow_clone(),
                            gram: r.gram.shallow_clone(),
                            kt: &r.kt + r.k.tr().matmul(&push),
                        }
                    })
                    .collect())
            })?;
            let s2 = solve_all(&ls.config, &unrelated, &pushed)?;
            let out2 = overrides(engine, &ls.memory, &s2)?;
            let answers2 = answering(engine, &out2, &all)?;
            let answered2 = answers2.iter().filter(|a| **a).count();
            if answered2 <= answered {
                debug!(round, answered, answered2, "a re-solve round that makes no more edits answer is dropped");
                break;
            }
            (rows, s, out, answers) = (pushed, s2, out2, answers2);
            for &e in &failing {
                pushes[e as usize] += 1;
            }
        }
    }
    let old_t = (0..rows.len()).map(|i| ls.memory.layers.get(i).and_then(|l| l.t.as_ref().map(Tensor::shallow_clone))).collect();
    ls.memory.pending = Some(Proposal {
        layers: rows
            .into_iter()
            .zip(s)
            .map(|(r, s)| Layer { k: Some(r.k), t: Some(r.t), edit: Some(r.edit), gram: Some(r.gram), kt: Some(r.kt), s: Some(s) })
            .collect(),
        old_t,
        edits: inner.batch_size(),
        examples: new_requests,
        pushes,
        left_out,
    });
    Ok(out)
}

/// [`solve`] for every edited weight, against `unrelated[i]` (none past its end).
fn solve_all(config: &LsConfig, unrelated: &[Tensor], rows: &[Rows]) -> Result<Vec<Tensor>> {
    crate::error::guard(|| Ok(rows.iter().enumerate().map(|(i, r)| solve(r, config, unrelated.get(i))).collect()))
}

/// The remembered edits' left-out lines plus the statistics' lines (not yet left out)
/// that state one of `facts`, their keys taken at the weights `w0` the edits' keys are
/// captured at (the statistics' own keys are the unedited model's, which `w0` is for a
/// session that started from it).
fn leave_out(engine: &Engine, ls: &LsEditor, facts: &[Fact], w0: &HashMap<String, Tensor>) -> Result<LeftOut> {
    let mut out = ls.memory.left_out.shallow();
    let Some(text) = &ls.stats_text else { return Ok(out) };
    // A last line cut by --max-tokens was summed only in part: never left out.
    let summed = text.lines.len().saturating_sub(usize::from(text.cut_last));
    let new: Vec<usize> = (0..summed).filter(|i| !out.lines.contains(i) && facts.iter().any(|f| f.stated_in(&text.lines[*i]))).collect();
    if new.is_empty() {
        return Ok(out);
    }
    let mut examples = Vec::with_capacity(new.len());
    for &i in &new {
        if let Some((ids, _)) = crate::mend::stats::line_ids(engine, &text.lines[i], usize::MAX)? {
            out.tokens += ids.len() as f64;
            examples.push(Example { ids, answer_start: 1, image: None });
        }
    }
    for chunk in examples.chunks(64) {
        let xs = engine.layer_inputs_at(&engine.collate(&chunk.iter().collect::<Vec<_>>())?, w0)?;
        out.sums = crate::error::guard(|| {
            let g = xs.iter().map(|x| x.tr().matmul(x));
            Ok(match out.sums.is_empty() {
                true => g.collect(),
                false => out.sums.iter().zip(g).map(|(a, b)| a + b).collect(),
            })
        })?;
    }
    debug!(lines = new.len(), tokens = out.tokens, "mend-ls leaves the statistics' lines stating the edited facts out of the solve");
    out.lines.extend(new);
    Ok(out)
}

/// The solve's unrelated Grams without the `left` lines: the statistics `Σ k kᵀ` less
/// theirs, weighted for the tokens that remain (`unrelated` holds the statistics already
/// weighted for all of theirs, [`crate::mend::stats::KeyStats::grams`]).
fn unrelated_without(ls: &LsEditor, left: &LeftOut) -> Vec<Tensor> {
    match &ls.stats_text {
        Some(text) if !left.sums.is_empty() => {
            let (all, rest) = (weight_scale(text.tokens), weight_scale((text.tokens - left.tokens).max(1.0)));
            ls.unrelated.iter().zip(&left.sums).map(|(u, e)| (u - e.to_device(u.device()) * all) * (rest / all)).collect()
        }
        _ => ls.unrelated.iter().map(Tensor::shallow_clone).collect(),
    }
}

/// Per edited weight, the change from the current weights to `W0 + s`: `s − S_prev`.
fn changes(memory: &KeyMemory, s: &[Tensor]) -> Vec<Tensor> {
    s.iter()
        .enumerate()
        .map(|(i, s)| match memory.layers.get(i).and_then(|l| l.s.as_ref()) {
            Some(p) => s - p,
            None => s.shallow_clone(),
        })
        .collect()
}

/// The override taking the current weights to `W0 + s`: `W' = W + (s − S_prev)` per weight.
/// Dense, not a low-rank term: `S` has rank `d_in`, and as `(I, S)` every forward and every
/// commit paid a `d_in × d_in` product for the identity (for SmolLM2's `down_proj`, a
/// 1536² GEMM per row batch: a fifth of an edit in a row, docs/notebook/many-edits.md).
fn overrides(engine: &Engine, memory: &KeyMemory, s: &[Tensor]) -> Result<Overrides> {
    let change: Vec<Option<Tensor>> = changes(memory, s).into_iter().map(Some).collect();
    Ok(Overrides::from_iter(weights_plus(engine, &change)?))
}

/// The current edited weights plus `change[i]` (`[d_in, d_out]`; `None` or missing:
/// unchanged), by name, in each weight's layout and kind (summed in f32): the weights
/// [`Engine::capture_by_example`] captures at.
fn weights_plus(engine: &Engine, change: &[Option<Tensor>]) -> Result<HashMap<String, Tensor>> {
    crate::error::guard(|| {
        let mut at = HashMap::new();
        for (p, c) in engine.edit_params.iter().zip(change) {
            if let Some(c) = c {
                let w = engine.weight(&p.name)?;
                let c = c.to_device(w.device());
                let oriented = match p.layout {
                    crate::model::WeightLayout::Linear => c.tr(),
                    crate::model::WeightLayout::Conv1d => c,
                };
                at.insert(p.name.clone(), (w.to_kind(Kind::Float) + oriented).to_kind(w.kind()));
            }
        }
        Ok(at)
    })
}

/// Per example of `batch`: whether every answer token is the top-1 prediction under the
/// current weights plus `ov` (the edit made, as `guard::makes_edit` asks of a whole batch).
fn answering(engine: &Engine, ov: &Overrides, batch: &TokenBatch) -> Result<Vec<bool>> {
    let logits = engine.edited_logits(ov, batch)?;
    crate::error::guard(|| {
        let dev = logits.device();
        Ok(losses::token_accuracy(&logits, &batch.kept_targets().to_device(dev), &batch.kept_rows().to_device(dev), batch.batch_size()).1)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The per-edit products are the masked product of every row with every term, also for
    /// an edit with rows and no terms (zero shifts) and terms of an edit with no rows.
    #[test]
    fn shifts_by_edit_are_the_masked_product() {
        let _g = tch::no_grad_guard();
        let opts = (Kind::Float, tch::Device::Cpu);
        let (k, a, b) = (Tensor::randn([7, 5], opts), Tensor::randn([6, 5], opts), Tensor::randn([6, 3], opts));
        let edit_k = Tensor::from_slice(&[0i64, 0, 1, 1, 1, 3, 3]);
        let edit_ab = Tensor::from_slice(&[0i64, 0, 2, 3, 3, 3]);
        let same = edit_k.unsqueeze(1).eq_tensor(&edit_ab.unsqueeze(0)).to_kind(Kind::Float);
        let want = (k.matmul(&a.tr()) * same).matmul(&b);
        let got = shifts(&k, &edit_k, &a, &b, &edit_ab);
        assert!(got.allclose(&want, 1e-5, 1e-6, false), "{got} vs {want}");
        assert_eq!(got.narrow(0, 2, 3).abs().sum(Kind::Float).double_value(&[]), 0.0, "edit 1 has no terms");
        let unsorted = Tensor::from_slice(&[1i64, 0, 1, 1, 0, 3, 3]);
        let same = unsorted.unsqueeze(1).eq_tensor(&edit_ab.unsqueeze(0)).to_kind(Kind::Float);
        assert!(shifts(&k, &unsorted, &a, &b, &edit_ab).allclose(&(k.matmul(&a.tr()) * same).matmul(&b), 1e-5, 1e-6, false));
        assert_eq!(runs(&unsorted), None);
        assert_eq!(runs(&edit_k), Some(vec![(0, 0, 2), (1, 2, 3), (3, 5, 2)]));
    }

    /// A commit scaled back keeps `KᵀT` by linearity and gives what scaling every row's
    /// target and multiplying the rows out gives, over remembered rows and for a first
    /// commit.
    #[test]
    fn a_scaled_commit_is_every_row_scaled_and_multiplied_out() {
        let _g = tch::no_grad_guard();
        let opts = (Kind::Double, tch::Device::Cpu);
        let (d_in, d_out, scale) = (4, 3, 0.3);
        let (k0, t0, s0) = (Tensor::randn([5, d_in], opts), Tensor::randn([5, d_out], opts), Tensor::randn([d_in, d_out], opts));
        let (k1, v1) = (Tensor::randn([4, d_in], opts), Tensor::randn([4, d_out], opts));
        let layer = |k: &Tensor, t: &Tensor, s: &Tensor| Layer {
            k: Some(k.shallow_clone()),
            t: Some(t.shallow_clone()),
            edit: Some(Tensor::zeros([k.size()[0]], (Kind::Int64, tch::Device::Cpu))),
            gram: Some(k.tr().matmul(k)),
            kt: Some(k.tr().matmul(t)),
            s: Some(s.shallow_clone()),
        };
        let propose = |memory: &mut KeyMemory, k: &Tensor, t: &Tensor, old_t: Option<Tensor>| {
            let s_new = Tensor::randn([d_in, d_out], opts);
            memory.pending = Some(Proposal { layers: vec![layer(k, t, &s_new)], old_t: vec![old_t], edits: 1, examples: Vec::new(), pushes: Vec::new(), left_out: LeftOut::default() });
            s_new
        };
        // A first commit: the base is `k·0`.
        let mut first = KeyMemory::default();
        let s_new = propose(&mut first, &k1, &v1, None);
        first.commit(scale);
        let l = &first.layers[0];
        assert!(l.t.as_ref().unwrap().allclose(&(&v1 * scale), 1e-10, 1e-10, false));
        assert!(l.kt.as_ref().unwrap().allclose(&k1.tr().matmul(&(&v1 * scale)), 1e-10, 1e-10, false));
        assert!(l.s.as_ref().unwrap().allclose(&(&s_new * scale), 1e-10, 1e-10, false));
        // Over remembered rows whose proposed targets a round moved.
        let mut memory = KeyMemory { layers: vec![layer(&k0, &t0, &s0)], ..KeyMemory::default() };
        let (k, t) = (Tensor::cat(&[&k0, &k1], 0), Tensor::cat(&[&(&t0 + 0.5), &v1], 0));
        let s_prop = propose(&mut memory, &k, &t, Some(t0.shallow_clone()));
        memory.commit(scale);
        let base = Tensor::cat(&[&t0, &k1.matmul(&s0)], 0);
        let want = &base + (&t - &base) * scale;
        let l = &memory.layers[0];
        assert!(l.t.as_ref().unwrap().allclose(&want, 1e-10, 1e-10, false));
        assert!(l.kt.as_ref().unwrap().allclose(&k.tr().matmul(&want), 1e-10, 1e-10, false));
        assert!(l.s.as_ref().unwrap().allclose(&(&s0 + (&s_prop - &s0) * scale), 1e-10, 1e-10, false));
    }
}
