//! Key statistics for `mend-ls` (issue #36): the second moment of each edited layer's
//! keys (its input), `Σ k kᵀ` `[d_in, d_in]` over every token of a text corpus, and how
//! many tokens that is. MEMIT's "mom2" statistics, computed once per model.
//!
//! Why: the least-squares solve ([`crate::mend::ls`]) keeps what the edited layers do on
//! unrelated text by adding that text's `CᵀC` to its normal matrix. Before these
//! statistics a user had to pass a keep text on every run (`--ls-keep-text`), and the
//! solve re-read and re-ran it each time; without one, locality fell from 0.95 to 0.55
//! on 100 edits of the embedded default (docs/notebook.md, "Many edits, part 3"). Computed
//! once and stored with the editor (`key-stats.safetensors` beside `editor.json`, named
//! there as `key_stats`), `mend-ls` uses them whenever no keep text is given.
//!
//! Weighting: a keep text adds its keys' `CᵀC` as they are (each key counts as much as
//! one edit row, times the keep weight `μ`). Statistics over a large corpus would then
//! outweigh every edit by the corpus' size alone, so they stand for at most
//! [`WEIGHT_TOKENS`] tokens: the solve adds `μ · min(n, WEIGHT_TOKENS) / n · Σ k kᵀ`, the
//! mean `E[k kᵀ]` weighted by the ratio of counts, as MEMIT's `mom2_update_weight`
//! weights its mean. The world's corpus (about 7,000 tokens) is used as it is, so the
//! default editor's `μ` means what it meant with the corpus as the keep text.
use std::collections::HashMap;
use std::io::BufRead;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use tch::{Kind, Tensor};

use crate::data::Example;
use crate::mend::{checkpoint, Engine};
use crate::{Error, Result};

/// The file name [`KeyStats::write_for_editor`] writes into an editor's folder.
pub const KEY_STATS_FILE: &str = "key-stats.safetensors";

/// Tokens the statistics stand for at most in the solve (see the module's doc).
pub const WEIGHT_TOKENS: f64 = 20_000.0;

/// Lines tokenised and run per forward of the statistics pass.
const CHUNK_LINES: usize = 64;

/// The safetensors metadata key of [`StatsMeta`].
const META_KEY: &str = "dualedit-key-stats";

/// What the statistics were computed on, stored in the file's header.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct StatsMeta {
    /// The edited weights, in the engine's order (one `[d_in, d_in]` sum each).
    pub params: Vec<String>,
    /// Key tokens summed (the same for every weight: one key per token).
    pub tokens: f64,
    /// Lines of text read.
    pub lines: usize,
    /// The text file (informational).
    pub text: String,
    /// Sum of each edited weight of the model they were computed on: statistics of
    /// another checkpoint are refused as an editor of another model is.
    pub weight_sums: std::collections::BTreeMap<String, f64>,
}

/// `Σ k kᵀ` per edited weight (f64 `[d_in, d_in]`) and the tokens summed.
pub struct KeyStats {
    pub meta: StatsMeta,
    pub sums: Vec<Tensor>,
}

impl KeyStats {
    /// Streams `text` (one text a line; empty lines skipped; each line cut to the model's
    /// context) through the engine's current weights in chunks of 64 lines and sums every
    /// token's key of every edited weight, up to `max_tokens` tokens. Progress on stderr
    /// (`show`). A file that is not a regular UTF-8 text file, or has no line with two
    /// tokens, is an error naming it.
    pub fn compute(engine: &Engine, text: &Path, max_tokens: usize, show: bool) -> Result<Self> {
        let _g = tch::no_grad_guard();
        let meta = std::fs::metadata(text).map_err(|e| Error::io(text, e))?;
        if !meta.is_file() {
            return Err(Error::file(text, "--text must name a regular file of text lines (not a directory, FIFO or device)"));
        }
        if max_tokens == 0 {
            return Err(Error::input("--max-tokens must be at least 1"));
        }
        let file = std::fs::File::open(text).map_err(|e| Error::io(text, e))?;
        let progress = crate::progress::Progress::new("key statistics", meta.len() as usize, show);
        let max = engine.lm.model.info().max_positions.max(2) as usize;
        let mut sums: Option<Vec<Tensor>> = None;
        let (mut tokens, mut lines, mut read) = (0usize, 0usize, 0u64);
        let mut chunk: Vec<Example> = Vec::with_capacity(CHUNK_LINES);
        let flush = |chunk: &mut Vec<Example>, sums: &mut Option<Vec<Tensor>>| -> Result<()> {
            if chunk.is_empty() {
                return Ok(());
            }
            let refs: Vec<&Example> = chunk.iter().collect();
            let xs = engine.layer_inputs(&engine.collate(&refs)?)?;
            *sums = Some(crate::error::guard(|| {
                let g: Vec<Tensor> = xs.iter().map(|x| {
                    let x = x.to_kind(Kind::Double);
                    x.tr().matmul(&x)
                }).collect();
                Ok(match sums.take() {
                    Some(acc) => acc.into_iter().zip(g).map(|(a, b)| a + b).collect(),
                    None => g,
                })
            })?);
            chunk.clear();
            Ok(())
        };
        for line in std::io::BufReader::new(file).lines() {
            let line = line.map_err(|e| Error::file(text, format!("cannot be read as UTF-8 text: {e}")))?;
            read += line.len() as u64 + 1;
            let line = line.trim();
            if line.is_empty() {
                continue;
            }
            let cut = &line[..floor_char_boundary(line, crate::mend::ls::MAX_KEEP_LINE_CHARS)];
            let mut ids = engine.lm.tokenizer.encode(cut)?;
            // Every token is a key: the last one is an input too (as in `unrelated_grams`).
            ids.truncate((max - 1).min(max_tokens - tokens));
            ids.push(ids.last().copied().unwrap_or(0));
            if ids.len() < 2 {
                continue;
            }
            tokens += ids.len();
            lines += 1;
            chunk.push(Example { ids, answer_start: 1, image: None });
            if chunk.len() == CHUNK_LINES {
                flush(&mut chunk, &mut sums)?;
                progress.set_position(read);
                progress.set_message(format!("{tokens} tokens"));
            }
            if tokens >= max_tokens {
                tracing::info!(file = %text.display(), tokens, "key statistics: --max-tokens reached; the rest of the text is not read");
                break;
            }
        }
        flush(&mut chunk, &mut sums)?;
        progress.finish_and_clear();
        let sums = sums.ok_or_else(|| Error::file(text, "has no line of at least one token to take keys from"))?;
        tracing::debug!(tokens, lines, "key statistics summed");
        let weight_sums = checkpoint::ModelFingerprint::of(engine)?.weight_sums;
        let meta = StatsMeta {
            params: engine.edit_params.iter().map(|p| p.name.clone()).collect(),
            tokens: tokens as f64,
            lines,
            text: text.display().to_string(),
            weight_sums,
        };
        Ok(Self { meta, sums })
    }

    /// Writes the statistics to `path`, whole or nothing (a temporary file renamed), in
    /// f32 (summed in f64; the solve is f32).
    pub fn save(&self, path: &Path) -> Result<()> {
        let sums = crate::error::guard(|| Ok(self.sums.iter().map(|s| s.to_kind(Kind::Float)).collect::<Vec<_>>()))?;
        let tensors: Vec<(String, Tensor)> = self.meta.params.iter().cloned().zip(sums).collect();
        let text = serde_json::to_string(&self.meta).map_err(|e| Error::Internal(e.to_string()))?;
        crate::io::write_safetensors(path, &tensors, HashMap::from([(META_KEY.to_string(), text)]))
    }

    /// Reads statistics written by [`KeyStats::save`] for `engine`'s model: the same edited
    /// weights with `[d_in, d_in]` sums, else an error naming the file. Statistics of
    /// another checkpoint of the same shapes load with a warning (as an editor does).
    pub fn load(path: &Path, engine: &Engine) -> Result<Self> {
        let (mut tensors, raw) = crate::io::read_safetensors(path)?;
        let text = raw.get(META_KEY).ok_or_else(|| Error::file(path, "not a key statistics file (no dualedit-key-stats metadata)"))?;
        let meta: StatsMeta = serde_json::from_str(text).map_err(|e| Error::file(path, format!("invalid key statistics metadata: {e}")))?;
        let ours: Vec<&String> = engine.edit_params.iter().map(|p| &p.name).collect();
        if meta.params.iter().collect::<Vec<_>>() != ours {
            return Err(Error::file(path, format!("key statistics of the weights {:?}, this editor edits {ours:?}", meta.params)));
        }
        if !(meta.tokens.is_finite() && meta.tokens >= 1.0) {
            return Err(Error::file(path, format!("key statistics over {} tokens", meta.tokens)));
        }
        let mut sums = Vec::with_capacity(ours.len());
        for p in &engine.edit_params {
            let (d_in, _) = p.in_out();
            let t = tensors.remove(&p.name).ok_or_else(|| Error::file(path, format!("no statistics for {}", p.name)))?;
            if t.size() != [d_in, d_in] {
                return Err(Error::file(path, format!("{}: statistics of shape {:?}, the weight's keys are {d_in} wide", p.name, t.size())));
            }
            sums.push(t.to_kind(Kind::Double));
        }
        let now = checkpoint::ModelFingerprint::of(engine)?.weight_sums;
        for (name, sum) in &meta.weight_sums {
            let n = now.get(name).copied().unwrap_or(f64::NAN);
            if (n - sum).abs() > 1e-3 * (1.0 + sum.abs()) {
                tracing::warn!(file = %path.display(), param = %name, "key statistics were computed on another checkpoint than this model (an edited model?)");
            }
        }
        Ok(Self { meta, sums })
    }

    /// What the solve adds per edited weight before the keep weight: `Σ k kᵀ` scaled to
    /// at most [`WEIGHT_TOKENS`] tokens (f32 `[d_in, d_in]`).
    pub fn grams(&self) -> Result<Vec<Tensor>> {
        let scale = (WEIGHT_TOKENS / self.meta.tokens).min(1.0);
        crate::error::guard(|| Ok(self.sums.iter().map(|s| (s * scale).to_kind(Kind::Float)).collect()))
    }

    /// Writes the statistics into the editor folder `dir` ([`KEY_STATS_FILE`]) and names
    /// them in its `editor.json` (`key_stats`): the file first, then the description, each
    /// replaced atomically, so a failure leaves the editor as it was (at worst an unnamed
    /// statistics file beside it).
    pub fn write_for_editor(&self, dir: &Path) -> Result<PathBuf> {
        let mut meta = checkpoint::read_editor_json(dir)?;
        let path = dir.join(KEY_STATS_FILE);
        self.save(&path)?;
        meta.key_stats = Some(KEY_STATS_FILE.to_string());
        crate::io::write_json_atomic(&dir.join(checkpoint::EDITOR_JSON), &meta)?;
        Ok(path)
    }
}

/// The key statistics an editor folder names in its `editor.json` (`key_stats`), if any.
pub fn editor_stats_path(dir: &Path) -> Result<Option<PathBuf>> {
    let meta = checkpoint::read_editor_json(dir)?;
    Ok(meta.key_stats.map(|f| dir.join(f)))
}

/// The largest char boundary of `s` at or below `at`.
fn floor_char_boundary(s: &str, at: usize) -> usize {
    if at >= s.len() {
        return s.len();
    }
    let mut end = at;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    end
}
