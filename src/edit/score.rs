//! Next-token log-probabilities of a text under a model (the `score` command).
use std::collections::HashSet;
use std::path::Path;

use serde::Serialize;
use tch::{Kind, Tensor};

use crate::model::vision::{image, Grid};
use crate::model::{ForwardInput, LoadedModel, ParamView, VisionLanguage};
use crate::{Error, Result};

#[derive(Debug, Clone, Serialize)]
pub struct Score {
    /// Token ids of the text, special tokens included.
    pub tokens: Vec<i64>,
    /// `log p(tokens[t] | tokens[..t])` for `t = 1..n`.
    pub logprobs: Vec<f64>,
    /// Mean negative log-probability over `logprobs`.
    pub mean_nll: f64,
    /// The `<|image_pad|>` tokens of the image(s) before the text (one per merged patch;
    /// the `<|vision_start|>` / `<|vision_end|>` markers around each image are not
    /// counted); 0 without an image. With an image every text
    /// token has something before it, so `logprobs[t]` is `log p(tokens[t] | image,
    /// tokens[..t])` for all `t = 0..n`.
    pub image_tokens: usize,
}

/// Scores `text` with the model's weights as seen through `params`.
pub fn score_text(lm: &LoadedModel, params: &ParamView, text: &str) -> Result<Score> {
    if text.trim().is_empty() {
        return Err(Error::input("text is empty"));
    }
    let tokens = lm.tokenizer.encode(text)?;
    if tokens.len() < 2 {
        return Err(Error::input(format!(
            "text {text:?} is {} token(s) long; at least 2 are needed to score a next token",
            tokens.len()
        )));
    }
    check_length(lm, tokens.len())?;
    let logprobs = crate::error::guard(|| {
        let _guard = tch::no_grad_guard();
        let ids = Tensor::from_slice(&tokens).unsqueeze(0).to_device(params.device());
        let none = HashSet::new();
        let out = lm.model.forward(params, &ForwardInput::new(&ids, &none))?;
        let logp = out.logits.get(0).to_kind(Kind::Float).log_softmax(-1, Kind::Float);
        let n = tokens.len() as i64;
        let next = ids.get(0).narrow(0, 1, n - 1).unsqueeze(1);
        let lp = logp.narrow(0, 0, n - 1).gather(1, &next, false).squeeze_dim(1).to_device(tch::Device::Cpu);
        Ok(Vec::<f64>::try_from(lp.to_kind(Kind::Double))?)
    })?;
    let mean_nll = -logprobs.iter().sum::<f64>() / logprobs.len() as f64;
    Ok(Score { tokens, logprobs, mean_nll, image_tokens: 0 })
}

/// Scores `text` shown after `images` (in order, each as `<|vision_start|>`, one
/// `<|image_pad|>` per merged patch, `<|vision_end|>`) under a vision-language model.
/// Without images this is [`score_text`]. The images are preprocessed as the model's
/// `preprocessor_config.json` says (its defaults when the file is missing), their
/// features computed once by the frozen vision tower, and the LM head applied only at
/// the positions that predict a text token.
pub fn score_with_images(lm: &LoadedModel, params: &ParamView, text: &str, images: &[&Path]) -> Result<Score> {
    if images.is_empty() {
        return score_text(lm, params, text);
    }
    if text.trim().is_empty() {
        return Err(Error::input("text is empty"));
    }
    let tokens = lm.tokenizer.encode(text)?;
    if tokens.is_empty() {
        return Err(Error::input(format!("text {text:?} encodes to no tokens")));
    }
    let ImagePrompt { vl, mut ids, feats, grids } = image_prompt(lm, params, images, tokens.len())?;
    let image_tokens = ids.iter().filter(|&&t| t == vl.tokens().image_pad).count();
    ids.extend_from_slice(&tokens);
    let logprobs = crate::error::guard(|| {
        let _guard = tch::no_grad_guard();
        let device = params.device();
        let pos = vl.mrope_positions(&ids, &grids)?.unsqueeze(1).to_device(device);
        let t = ids.len() as i64;
        let n = tokens.len() as i64;
        let input_ids = Tensor::from_slice(&ids).unsqueeze(0).to_device(device);
        // Positions image_tokens-1 .. t-2 predict the text tokens.
        let keep = Tensor::arange(t, (Kind::Int64, device)).ge(t - n - 1).logical_and(&Tensor::arange(t, (Kind::Int64, device)).lt(t - 1)).unsqueeze(0);
        let none = HashSet::new();
        let input = ForwardInput { keep: Some(&keep), position_ids: Some(&pos), image_embeds: Some(&feats), ..ForwardInput::new(&input_ids, &none) };
        let out = lm.model.forward(params, &input)?;
        let logp = out.logits.to_kind(Kind::Float).log_softmax(-1, Kind::Float);
        let next = Tensor::from_slice(&tokens).to_device(device).unsqueeze(1);
        let lp = logp.gather(1, &next, false).squeeze_dim(1).to_device(tch::Device::Cpu);
        Ok(Vec::<f64>::try_from(lp.to_kind(Kind::Double))?)
    })?;
    let mean_nll = -logprobs.iter().sum::<f64>() / logprobs.len() as f64;
    Ok(Score { tokens, logprobs, mean_nll, image_tokens })
}

/// The image part of a prompt that shows `images` before some text: the image runs' ids
/// (in order), the frozen tower's features `[Σ merged patches, D]` of all of them, and
/// their grids (for the M-RoPE positions).
pub struct ImagePrompt<'a> {
    pub vl: &'a dyn VisionLanguage,
    pub ids: Vec<i64>,
    pub feats: Tensor,
    pub grids: Vec<Grid>,
}

/// [`ImagePrompt`] of `images` for a prompt whose text is `text_len` tokens: each image
/// preprocessed as the model's `preprocessor_config.json` says and run through the
/// frozen vision tower once. A text-only model, an unreadable image, or images and text
/// longer than the model's context are errors naming what is wrong.
pub fn image_prompt<'a>(lm: &'a LoadedModel, params: &ParamView, images: &[&Path], text_len: usize) -> Result<ImagePrompt<'a>> {
    let Some(vl) = lm.model.family().vision_language() else {
        return Err(Error::input(format!(
            "{} is a text-only model ({}); images need a Qwen2-VL or Qwen2.5-VL model",
            lm.dir.display(),
            lm.model.info().architecture
        )));
    };
    let max = lm.model.info().max_positions;
    // Bounded before any image is resized: no image may take more than the context.
    let proc = vl.image_processor(&lm.dir)?.with_max_tokens(max - 2);
    let mut ids = Vec::new();
    let mut prepared = Vec::with_capacity(images.len());
    for path in images {
        let img = image::prepare(path, &proc)?;
        ids.extend(vl.image_prompt(&img.grid));
        if ids.len() as i64 + text_len as i64 > max {
            return Err(Error::file(
                path,
                format!(
                    "the image takes {} tokens ({}×{} pixels after resizing); with the text's {text_len} that is more than the model's context of {max}",
                    img.n_tokens(vl.merge_size()) + 2,
                    img.resized.1,
                    img.resized.0,
                ),
            ));
        }
        prepared.push(img);
    }
    let grids: Vec<Grid> = prepared.iter().map(|p| p.grid).collect();
    let feats = crate::error::guard(|| {
        let _guard = tch::no_grad_guard();
        let pixels = Tensor::cat(&prepared.iter().map(|p| &p.pixel_values).collect::<Vec<_>>(), 0);
        vl.image_features(params, &pixels, &grids)
    })?;
    let paths: Vec<&Path> = prepared.iter().map(|p| p.path.as_path()).collect();
    crate::model::vision::check_finite_features(&feats, &grids, vl.merge_size(), &paths)?;
    Ok(ImagePrompt { vl, ids, feats, grids })
}

/// Refuses sequences longer than the model's context (position table / RoPE range).
pub fn check_length(lm: &LoadedModel, n_tokens: usize) -> Result<()> {
    let max = lm.model.info().max_positions;
    if n_tokens as i64 > max {
        return Err(Error::input(format!(
            "{n_tokens} tokens is longer than the model's context of {max} ({})",
            lm.dir.join("config.json").display()
        )));
    }
    Ok(())
}
