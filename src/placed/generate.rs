//! Greedy decoding: with the KV cache for text, one full forward per token for a prompt
//! that shows images; and an example's greedy answer under the current weights.
use serde::Serialize;
use tch::{Kind, Tensor};

use super::Placed;
use crate::data::Example;
use crate::model::vision::Grid;
use crate::model::{ForwardInput, KvCache, LoadedModel, ParamView, VisionLanguage};
use crate::{Error, Result};

/// Why a greedy continuation stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Finish {
    /// The requested number of tokens was generated.
    Length,
    /// An end-of-sequence token was generated (it is included in the tokens).
    Eos,
    /// The model's context is full.
    Context,
}

/// Greedy continuation of `prompt` ids under the weights seen through `params` (edited or
/// not), with a KV cache: the prompt runs once, then one token per step, and the LM head
/// runs on the last position only. Stops after `max_new` tokens, at any of `eos`, or when
/// the context is full.
pub fn greedy(lm: &LoadedModel, params: &ParamView, prompt: &[i64], max_new: usize, eos: &[i64]) -> Result<(Vec<i64>, Finish)> {
    if prompt.is_empty() {
        return Err(Error::input("prompt is empty (it encodes to no tokens)"));
    }
    let _g = tch::no_grad_guard();
    let device = params.device();
    let max = lm.model.info().max_positions.max(0) as usize;
    let none = Default::default();
    let mut cache = KvCache::new();
    let mut feed = prompt.to_vec();
    let mut out = Vec::new();
    while out.len() < max_new {
        if prompt.len() + out.len() >= max {
            return Ok((out, Finish::Context));
        }
        let (ids, keep) = crate::error::guard(|| {
            let n = feed.len() as i64;
            let ids = Tensor::from_slice(&feed).unsqueeze(0).to_device(device);
            Ok((ids, Tensor::arange(n, (Kind::Int64, device)).eq(n - 1).unsqueeze(0)))
        })?;
        let input = ForwardInput { keep: Some(&keep), ..ForwardInput::new(&ids, &none) };
        let logits = lm.model.forward_cached(params, &input, &mut cache)?.logits;
        let next = crate::error::guard(|| Ok(logits.reshape([-1]).argmax(0, false).int64_value(&[])))?;
        out.push(next);
        if eos.contains(&next) {
            return Ok((out, Finish::Eos));
        }
        feed = vec![next];
    }
    Ok((out, Finish::Length))
}

/// [`greedy`] for a prompt that shows images: `prompt` holds the image runs (whose
/// features `feats` `[Σ merged patches, D]` of `grids` the frozen tower computed once),
/// and each new token runs one full forward (the KV cache has no M-RoPE continuation
/// yet), with the LM head on the last position only. Vision tokens are never chosen: fed
/// back, they would open an image run with no image.
pub fn greedy_with_images(
    lm: &LoadedModel,
    params: &ParamView,
    (vl, feats, grids): (&dyn VisionLanguage, &Tensor, &[Grid]),
    prompt: &[i64],
    max_new: usize,
    eos: &[i64],
) -> Result<(Vec<i64>, Finish)> {
    if prompt.is_empty() {
        return Err(Error::input("prompt is empty (it encodes to no tokens)"));
    }
    let _g = tch::no_grad_guard();
    let device = params.device();
    let max = lm.model.info().max_positions.max(0) as usize;
    let t = vl.tokens();
    let vision = [t.image_pad, t.vision_start, t.vision_end];
    let none = Default::default();
    let mut ids = prompt.to_vec();
    let mut out = Vec::new();
    while out.len() < max_new {
        if ids.len() >= max {
            return Ok((out, Finish::Context));
        }
        let next = crate::error::guard(|| {
            let n = ids.len() as i64;
            let pos = vl.mrope_positions(&ids, grids)?.unsqueeze(1).to_device(device);
            let input_ids = Tensor::from_slice(&ids).unsqueeze(0).to_device(device);
            let keep = Tensor::arange(n, (Kind::Int64, device)).eq(n - 1).unsqueeze(0);
            let input = ForwardInput { keep: Some(&keep), position_ids: Some(&pos), image_embeds: Some(feats), ..ForwardInput::new(&input_ids, &none) };
            next_token(&lm.model.forward(params, &input)?.logits, &vision)
        })?;
        ids.push(next);
        out.push(next);
        if eos.contains(&next) {
            return Ok((out, Finish::Eos));
        }
    }
    Ok((out, Finish::Length))
}

/// The argmax of the last scored position's logits (`[.., V]`), never one of `vision`.
fn next_token(logits: &Tensor, vision: &[i64]) -> Result<i64> {
    let vocab = logits.size().last().copied().unwrap_or(1);
    let last = logits.f_reshape([-1, vocab])?.f_get(-1)?.f_to_kind(Kind::Float)?;
    for &v in vision.iter().filter(|&&v| (0..vocab).contains(&v)) {
        let _ = last.f_get(v)?.f_fill_(f64::NEG_INFINITY)?;
    }
    Ok(last.f_argmax(-1, false)?.f_int64_value(&[])?)
}

/// The greedy answer to an example's prompt under the runtime's current weights, as many
/// tokens as its target. Text prompts decode with the KV cache ([`greedy`]). Prompts with
/// an image run one full forward per new token (the image's features are computed once):
/// the cache has no M-RoPE continuation yet. Vision tokens are never chosen there: fed
/// back, they would open an image run with no image.
pub fn answer(placed: &Placed, e: &Example) -> Result<String> {
    let lm = &placed.lm;
    if e.image.is_none() {
        let (ids, _) = greedy(lm, &ParamView::frozen(&lm.params), &e.ids[..e.answer_start], e.answer().len(), &[])?;
        return lm.tokenizer.decode(&ids);
    }
    let images = placed.images(&[e])?;
    let vision: Vec<i64> = match lm.model.family().vision_language() {
        Some(vl) => {
            let t = vl.tokens();
            vec![t.image_pad, t.vision_start, t.vision_end]
        }
        None => Vec::new(),
    };
    let mut ids = e.ids[..e.answer_start].to_vec();
    let mut out = Vec::with_capacity(e.answer().len());
    for _ in 0..e.answer().len() {
        // A placeholder last token makes the one scored position the one that predicts
        // the token after `ids` (causal attention: the placeholder changes nothing before it).
        let probe = Example { ids: [ids.as_slice(), &[0]].concat(), answer_start: ids.len(), image: e.image.clone() };
        let logits = placed.base_logits(&placed.collate_with(&[&probe], images.as_ref())?)?;
        let next = crate::error::guard(|| next_token(&logits, &vision))?;
        ids.push(next);
        out.push(next);
    }
    lm.tokenizer.decode(&out)
}
