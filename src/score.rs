//! Next-token log-probabilities of a text under a model (the `score` command).
use std::collections::HashSet;

use serde::Serialize;
use tch::{Kind, Tensor};

use crate::model::{ForwardInput, LoadedModel, ParamView};
use crate::{Error, Result};

#[derive(Debug, Clone, Serialize)]
pub struct Score {
    /// Token ids of the text, special tokens included.
    pub tokens: Vec<i64>,
    /// `log p(tokens[t] | tokens[..t])` for `t = 1..n`.
    pub logprobs: Vec<f64>,
    /// Mean negative log-probability over `logprobs`.
    pub mean_nll: f64,
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
    Ok(Score { tokens, logprobs, mean_nll })
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
