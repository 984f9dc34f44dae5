//! Edit metrics as EasyEdit reports them: reliability, generalisation, locality,
//! portability (teacher-forced token accuracies), plus whole-answer edit success, NLL
//! before and after, and edit time.
use serde::Serialize;
use tch::Tensor;

use crate::data::multimodal::StepImages;
use crate::data::{EditExample, Example, TokenBatch};
use crate::mend::{losses, Engine};
use crate::model::Overrides;
use crate::Result;

/// The edit metrics of one record (`Metrics<bool>`, [`RecordMetrics`]: whether the whole
/// answer came out) or their means over records in a [`Summary`] (`Metrics<f64>`: the
/// share of records). An optional figure is absent (`None`) for a record that does not
/// measure it (no rephrase, no locality prompt, no portability questions, no images); a
/// summary's is the mean over the records that do, `None` when none does (an edit request
/// file may have no locality prompt: nothing was measured, which is not "kept").
#[derive(Debug, Clone, Default, Serialize)]
pub struct Metrics<S> {
    pub reliability: f64,
    /// None without a rephrase (EasyEdit then has no rephrase accuracy).
    pub generalization: Option<f64>,
    pub locality: Option<f64>,
    pub portability: Option<f64>,
    pub edit_success: S,
    pub nll_pre: f64,
    pub nll_post: f64,
    /// The call's edit time divided by its number of edits (a batch's one edit is shared
    /// by its requests; in a row, each request's own): the same for every request of a call.
    pub seconds_per_edit: f64,
    /// Multimodal: accuracy of the target with the rephrase image (EasyEdit's
    /// `rephrase_image_acc`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub image_generalization: Option<f64>,
    /// Multimodal: share of the `loc_image` top-10 token lists unchanged by the edit, at
    /// every position of the sequence (prompt, image tokens, answer), entry by entry, as
    /// EasyEdit computes `multimodal_locality_acc`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub image_locality: Option<f64>,
    /// Multimodal: share of the `loc_image` answer tokens whose top-1 prediction the edit
    /// leaves unchanged, as `locality` measures text: whether the unrelated image's answer
    /// stays, where EasyEdit's top-10 lists also count reorderings among unlikely tokens.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub image_locality_top1: Option<f64>,
}

/// One record's metrics.
pub type RecordMetrics = Metrics<bool>;

/// The summary's figures under the names EasyEdit's multimodal evaluation prints them
/// with (present in reports of image edits).
#[derive(Debug, Clone, Default, Serialize, PartialEq)]
pub struct EasyEditNames {
    pub rewrite_acc: f64,
    pub rephrase_acc: Option<f64>,
    pub rephrase_image_acc: Option<f64>,
    pub locality_acc: Option<f64>,
    pub multimodal_locality_acc: Option<f64>,
}

/// The metrics' means over `n` records (the same fields at the top level of the JSON).
#[derive(Debug, Clone, Default, Serialize)]
pub struct Summary {
    pub n: usize,
    #[serde(flatten)]
    pub means: Metrics<f64>,
    /// The same figures with EasyEdit's names (image edits only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub easyedit: Option<EasyEditNames>,
}

/// A summary's figures read as `summary.reliability`, as the means they are.
impl std::ops::Deref for Summary {
    type Target = Metrics<f64>;
    fn deref(&self) -> &Metrics<f64> {
        &self.means
    }
}

impl Summary {
    pub fn of(records: &[RecordMetrics]) -> Self {
        let n = records.len();
        let mean = |f: &dyn Fn(&RecordMetrics) -> Option<f64>| {
            let v: Vec<f64> = records.iter().filter_map(f).collect();
            (!v.is_empty()).then(|| v.iter().sum::<f64>() / v.len() as f64)
        };
        let reliability = mean(&|r| Some(r.reliability)).unwrap_or(0.0);
        let (generalization, locality) = (mean(&|r| r.generalization), mean(&|r| r.locality));
        let (image_generalization, image_locality) = (mean(&|r| r.image_generalization), mean(&|r| r.image_locality));
        let easyedit = (image_generalization.is_some() || image_locality.is_some()).then_some(EasyEditNames {
            rewrite_acc: reliability,
            rephrase_acc: generalization,
            rephrase_image_acc: image_generalization,
            locality_acc: locality,
            multimodal_locality_acc: image_locality,
        });
        let means = Metrics {
            reliability,
            generalization,
            locality,
            portability: mean(&|r| r.portability),
            edit_success: mean(&|r| Some(if r.edit_success { 1.0 } else { 0.0 })).unwrap_or(0.0),
            nll_pre: mean(&|r| Some(r.nll_pre)).unwrap_or(0.0),
            nll_post: mean(&|r| Some(r.nll_post)).unwrap_or(0.0),
            seconds_per_edit: mean(&|r| Some(r.seconds_per_edit)).unwrap_or(0.0),
            image_generalization,
            image_locality,
            image_locality_top1: mean(&|r| r.image_locality_top1),
        };
        Self { n, means, easyedit }
    }
}

/// Scores of one batch of examples under the edited (or, with no overrides, unedited) model.
struct Scored {
    acc: Vec<f64>,
    exact: Vec<bool>,
    nll: Vec<f64>,
    logits: Tensor,
    batch: TokenBatch,
}

fn score(engine: &Engine, overrides: &Overrides, examples: &[&Example], images: Option<&StepImages>) -> Result<Scored> {
    let batch = engine.collate_with(examples, images)?;
    let logits = if overrides.is_empty() { engine.base_logits(&batch)? } else { engine.edited_logits(overrides, &batch)? };
    let (t, rows, b) = (batch.kept_targets(), batch.kept_rows(), batch.batch_size());
    let (acc, exact) = losses::token_accuracy(&logits, &t, &rows, b);
    let nll = losses::nll_per_row(&logits, &t, &rows, b);
    Ok(Scored { acc, exact, nll, logits, batch })
}

/// Locality prompts scored to one forward (see [`locality_batches`]).
const LOC_BATCH: usize = 64;

/// The locality prompts of `examples` (of those that have one, in order), [`LOC_BATCH`] to
/// a batch. Scored one a forward, before and after, they took 11–20 s of a 100-request
/// `edit`'s ~60 s of wall time on a 2-core machine (the edit itself: 5 s); the requests' own
/// prompts were scored in one batch already.
fn locality_batches<'a>(examples: &[&'a EditExample]) -> Vec<Vec<&'a Example>> {
    let locs: Vec<&Example> = examples.iter().filter_map(|e| e.loc.as_ref()).collect();
    locs.chunks(LOC_BATCH).map(<[_]>::to_vec).collect()
}

/// The unedited model's view of a group of examples, measured before any edit.
pub struct Before {
    nll: Vec<f64>,
    /// Per batch of [`locality_batches`]: the unedited top-1 ids at its scored positions.
    loc: Vec<Tensor>,
    /// Each example's `loc_image` (multimodal): its unedited [`TopTen`].
    loc_image: Vec<Option<TopTen>>,
}

/// The top-10 token ids `[T, 10]` (int64, best first) at every position of an example,
/// and the rows of its answer's positions: what the image-locality metrics compare, kept
/// instead of logits (`[T, V]` is ~240 MB a record for Qwen2-VL at 400 tokens).
struct TopTen {
    ids: Tensor,
    answer: std::ops::Range<i64>,
}

impl TopTen {
    /// `e` scored at every position: a dummy token is appended as the last target so that
    /// every real token, the answer's last included, is an input position.
    fn of(engine: &Engine, overrides: &Overrides, e: &Example, images: Option<&StepImages>) -> Result<Self> {
        let mut ids = e.ids.clone();
        ids.push(engine.lm.tokenizer.pad_id());
        let every = Example { ids, answer_start: 1, image: e.image.clone() };
        let logits = score(engine, overrides, &[&every], images)?.logits;
        let ids = crate::error::guard(|| Ok(logits.to_kind(tch::Kind::Float).topk(10.min(logits.size()[1]), -1, true, true).1))?;
        Ok(Self { ids, answer: e.answer_start as i64 - 1..e.ids.len() as i64 - 1 })
    }

    /// (top-10 lists at every position, top-1 at the answer): the shares of entries equal.
    fn agreement(&self, before: &TopTen) -> (f64, f64) {
        let share = |a: &Tensor, b: &Tensor| a.eq_tensor(&b.to_device(a.device())).to_kind(tch::Kind::Double).mean(tch::Kind::Double).double_value(&[]);
        let answer = |t: &TopTen| t.ids.slice(0, t.answer.start, t.answer.end, 1).select(1, 0);
        (share(&self.ids, &before.ids), share(&answer(self), &answer(before)))
    }
}

/// Every example of every view of `examples` (for [`Engine::images`]: one tower forward
/// per distinct image of an edit, shared by the views and by before / after).
pub fn all_views<'a>(examples: &[&'a EditExample]) -> Vec<&'a Example> {
    examples
        .iter()
        .flat_map(|e| [Some(&e.inner), Some(&e.outer), e.outer_image.as_ref(), e.loc.as_ref(), e.loc_image.as_ref()].into_iter().flatten().chain(&e.portability))
        .collect()
}

/// `images`: the features of the examples' images ([`Engine::images`] of [`all_views`]).
pub fn measure_before(engine: &Engine, examples: &[&EditExample], images: Option<&StepImages>) -> Result<Before> {
    let _g = tch::no_grad_guard();
    let inner: Vec<&Example> = examples.iter().map(|e| &e.inner).collect();
    let nll = score(engine, &Overrides::new(), &inner, images)?.nll;
    let loc = locality_batches(examples)
        .iter()
        .map(|batch| Ok(score(engine, &Overrides::new(), batch, images)?.logits.argmax(-1, false)))
        .collect::<Result<_>>()?;
    let loc_image = examples
        .iter()
        .map(|e| e.loc_image.as_ref().map(|l| TopTen::of(engine, &Overrides::new(), l, images)).transpose())
        .collect::<Result<_>>()?;
    Ok(Before { nll, loc, loc_image })
}

/// Metrics of each example under the edited weights `overrides`.
pub fn measure_after(
    engine: &Engine,
    overrides: &Overrides,
    examples: &[&EditExample],
    before: &Before,
    seconds_per_edit: f64,
    images: Option<&StepImages>,
) -> Result<Vec<RecordMetrics>> {
    let _g = tch::no_grad_guard();
    let inner: Vec<&Example> = examples.iter().map(|e| &e.inner).collect();
    let outer: Vec<&Example> = examples.iter().map(|e| &e.outer).collect();
    let rel = score(engine, overrides, &inner, images)?;
    let gen = score(engine, overrides, &outer, images)?;
    // Each locality prompt's share of answer positions whose top-1 the edit left.
    let mut locality = Vec::with_capacity(examples.len());
    for (batch, pre) in locality_batches(examples).iter().zip(&before.loc) {
        let post = score(engine, overrides, batch, images)?;
        locality.extend(losses::token_accuracy(&post.logits, pre, &post.batch.kept_rows(), batch.len() as i64).0);
    }
    let mut locality = locality.into_iter();
    let mut out = Vec::with_capacity(examples.len());
    for (i, e) in examples.iter().enumerate() {
        let locality = e.loc.as_ref().and_then(|_| locality.next());
        let portability = if e.portability.is_empty() {
            None
        } else {
            let ex: Vec<&Example> = e.portability.iter().collect();
            let p = score(engine, overrides, &ex, images)?;
            Some(p.acc.iter().sum::<f64>() / p.acc.len() as f64)
        };
        let image_generalization = match &e.outer_image {
            Some(o) => Some(score(engine, overrides, &[o], images)?.acc[0]),
            None => None,
        };
        let (image_locality, image_locality_top1) = match (&e.loc_image, &before.loc_image[i]) {
            (Some(l), Some(pre)) => {
                let (top10, top1) = TopTen::of(engine, overrides, l, images)?.agreement(pre);
                (Some(top10), Some(top1))
            }
            _ => (None, None),
        };
        out.push(RecordMetrics {
            reliability: rel.acc[i],
            generalization: e.rephrased.then(|| gen.acc[i]),
            locality,
            portability,
            edit_success: rel.exact[i],
            nll_pre: before.nll[i],
            nll_post: rel.nll[i],
            seconds_per_edit,
            image_generalization,
            image_locality,
            image_locality_top1,
        });
    }
    Ok(out)
}
