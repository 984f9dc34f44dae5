//! Key statistics for `mend-ls` (issue #36): the second moment of each edited layer's
//! keys (its input), `Σ k kᵀ` `[d_in, d_in]` over every token of a text corpus, and how
//! many tokens that is. MEMIT's "mom2" statistics, computed once per model.
//!
//! Why: the least-squares solve ([`crate::mend::ls`]) keeps what the edited layers do on
//! unrelated text by adding that text's `CᵀC` to its normal matrix. Before these
//! statistics a user had to pass a keep text on every run (`--ls-keep-text`), and the
//! solve re-read and re-ran it each time; without one, locality fell from 0.95 to 0.55
//! on 100 edits of the embedded default (docs/notebook/many-edits.md, "Many edits, part 3").
//! Computed once and stored with the editor (`key-stats.safetensors` beside `editor.json`,
//! named there as `key_stats`), `mend-ls` uses them whenever no keep text is given.
//!
//! Weighting: a keep text adds its keys' `CᵀC` as they are (each key counts as much as
//! one edit row, times the keep weight `μ`). Statistics over a large corpus would then
//! outweigh every edit by the corpus' size alone, so they stand for at most
//! [`WEIGHT_TOKENS`] tokens: the solve adds `μ · min(n, WEIGHT_TOKENS) / n · Σ k kᵀ`, the
//! mean `E[k kᵀ]` weighted by the ratio of counts, as MEMIT's `mom2_update_weight`
//! weights its mean. The world's corpus (about 7,000 tokens) is used as it is, so the
//! default editor's `μ` means what it meant with the corpus as the keep text.
use std::collections::HashMap;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use tch::{Kind, Tensor};

use crate::data::{DatasetKind, EditExample, Example};
use crate::mend::{checkpoint, Engine};
use crate::{Error, Result};

/// Lines of `--ls-keep-text` used at most: the keys' Gram matrix converges long before
/// (each line adds its tokens' keys to one `[d_in, d_in]` sum), and a 200k-line file took
/// minutes to encode and run. Lines beyond are left out with a warning.
pub const MAX_KEEP_LINES: usize = 20_000;

/// Characters of one `--ls-keep-text` line read at most: a line is cut to the model's
/// context in tokens anyway, so a longer one is cut before it is tokenised (a 50 MB line
/// would otherwise be tokenised in full).
pub const MAX_KEEP_LINE_CHARS: usize = 64 * 1024;

/// The non-empty lines of a `--ls-keep-text` file (trimmed), at most [`MAX_KEEP_LINES`]
/// of them, each cut to [`MAX_KEEP_LINE_CHARS`]; the rest is left out with a warning. A
/// file that is not a regular file (a FIFO would block), cannot be read, is not UTF-8 or
/// has no non-empty line is an error naming it.
pub fn read_keep_text(path: &std::path::Path) -> Result<Vec<String>> {
    let text = crate::io::read_text(path).map_err(|e| Error::file(path, format!("`ls_keep_text` must name a regular file of text lines: {e}")))?;
    let mut lines = Vec::new();
    let (mut total, mut cut) = (0usize, 0usize);
    for l in text.lines().map(str::trim).filter(|l| !l.is_empty()) {
        total += 1;
        if lines.len() == MAX_KEEP_LINES {
            continue;
        }
        let mut l = l.to_string();
        if l.len() > MAX_KEEP_LINE_CHARS {
            l.truncate(floor_char_boundary(&l, MAX_KEEP_LINE_CHARS));
            cut += 1;
        }
        lines.push(l);
    }
    if lines.is_empty() {
        return Err(Error::file(path, "the unrelated-keys text (`ls_keep_text`) has no non-empty line"));
    }
    if total > lines.len() {
        tracing::warn!(file = %path.display(), lines = total, used = lines.len(), "`ls_keep_text` has more lines than are used: the first {} are", lines.len());
    }
    if cut > 0 {
        tracing::warn!(file = %path.display(), lines = cut, "`ls_keep_text` lines longer than {MAX_KEEP_LINE_CHARS} bytes were cut (the model reads at most its context of each)");
    }
    Ok(lines)
}

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
    /// The text file, as given to `dualedit stats`: [`SummedText::find`] reads its lines
    /// again to leave out those that state an edited fact.
    pub text: String,
    /// FNV-1a 64 (hex) of the summed lines, each trimmed and ended by `\n`: whether the
    /// text found later is the one summed (absent in files of earlier versions).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub text_fnv: Option<String>,
    /// Whether `--max-tokens` cut the last summed line short.
    #[serde(default)]
    pub cut: bool,
    /// Set when `text` is a data file of this format, whose records' locality views were
    /// summed ([`KeyStats::compute_views`]; `lines` counts those views): there are no
    /// lines stating a fact to leave out.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ds: Option<DatasetKind>,
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
        /// The longest line read (a line is cut to the model's context anyway).
        const MAX_LINE_BYTES: u64 = 1 << 20;
        let _g = tch::no_grad_guard();
        let (file, meta) = crate::io::open_regular(text)
            .map_err(|e| Error::file(text, format!("`text` must name a regular file of text lines: {e}")))?;
        if max_tokens == 0 {
            return Err(Error::input("`max_tokens` must be at least 1"));
        }
        // Per mille of the work: the text read or `--max-tokens` summed, whichever ends it
        // first, so the estimate holds for a long file cut by the token budget too.
        let progress = crate::progress::Progress::new("key statistics (per mille)", 1000, show);
        let done = |read: u64, tokens: usize| (1000 * read / meta.len().max(1)).max(1000 * tokens as u64 / max_tokens.max(1) as u64).min(1000);
        let (mut fnv, mut cut) = (Fnv::default(), false);
        let mut sums: Option<Vec<Tensor>> = None;
        let (mut tokens, mut lines, mut read) = (0usize, 0usize, 0u64);
        let mut chunk: Vec<Example> = Vec::with_capacity(CHUNK_LINES);
        let flush = |chunk: &mut Vec<Example>, sums: &mut Option<Vec<Tensor>>| -> Result<()> {
            let refs: Vec<&Example> = chunk.iter().collect();
            add_keys(engine, &refs, sums)?;
            chunk.clear();
            Ok(())
        };
        let mut reader = std::io::BufReader::new(file);
        let mut raw = Vec::new();
        for number in 1.. {
            // One line at a time, each bounded: a file without line breaks is not read whole.
            raw.clear();
            let n = std::io::BufRead::read_until(&mut std::io::Read::take(&mut reader, MAX_LINE_BYTES + 1), b'\n', &mut raw)
                .map_err(|e| Error::io(text, e))?;
            if n == 0 {
                break;
            }
            if raw.len() as u64 > MAX_LINE_BYTES && raw.last() != Some(&b'\n') {
                return Err(Error::file(text, format!("line {number} is longer than {MAX_LINE_BYTES} bytes; `text` takes one text a line")));
            }
            let line = std::str::from_utf8(&raw).map_err(|e| Error::file(text, format!("line {number} cannot be read as UTF-8 text: {e}")))?;
            read += n as u64;
            let line = line.trim();
            if line.is_empty() {
                continue;
            }
            let Some((ids, budget_cut)) = line_ids(engine, line, max_tokens - tokens)? else { continue };
            cut = budget_cut;
            fnv.update(line);
            tokens += ids.len();
            lines += 1;
            chunk.push(Example { ids, answer_start: 1, image: None });
            if chunk.len() == CHUNK_LINES {
                flush(&mut chunk, &mut sums)?;
                progress.set_position(done(read, tokens));
                progress.set_message(format!("{lines} lines, {tokens} tokens"));
            }
            if tokens >= max_tokens {
                tracing::info!(file = %text.display(), tokens, "key statistics: `max_tokens` reached; the rest of the text is not read");
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
            text_fnv: Some(fnv.hex()),
            cut,
            weight_sums,
            ds: None,
        };
        Ok(Self { meta, sums })
    }

    /// The statistics over the locality views of a data file's records (`examples`, as
    /// [`crate::run::load_examples`] prepares them from `data`, a `ds` file): each
    /// record's unrelated prompt (`loc`) and, for E-VQA / E-IC, its unrelated image and
    /// question (`loc_image`), every token of each a key, up to `max_tokens` keys (whole
    /// examples: the last one may pass it). What an edit must leave alone, in the form the
    /// model meets it: a visual world's statistics need its images' tokens, which a text
    /// file cannot give (issue #47). A file without such a view is an error naming it.
    pub fn compute_views(engine: &Engine, examples: &[EditExample], data: &Path, ds: DatasetKind, max_tokens: usize, show: bool) -> Result<Self> {
        let _g = tch::no_grad_guard();
        if max_tokens == 0 {
            return Err(Error::input("`max_tokens` must be at least 1"));
        }
        let views: Vec<&Example> = examples.iter().flat_map(|e| e.loc.iter().chain(&e.loc_image)).collect();
        let progress = crate::progress::Progress::new("key statistics (examples)", views.len(), show);
        let (mut sums, mut tokens, mut used) = (None, 0usize, 0usize);
        for chunk in views.chunks(CHUNK_LINES) {
            tokens += add_keys(engine, chunk, &mut sums)?;
            used += chunk.len();
            progress.set_position(used as u64);
            if tokens >= max_tokens {
                tracing::info!(file = %data.display(), tokens, "key statistics: `max_tokens` reached; the rest of the records are not read");
                break;
            }
        }
        progress.finish_and_clear();
        let sums = sums.ok_or_else(|| Error::file(data, "has no record with a locality view (`loc`, or an image's `m_loc`) to take keys from"))?;
        let meta = StatsMeta {
            params: engine.edit_params.iter().map(|p| p.name.clone()).collect(),
            tokens: tokens as f64,
            lines: used,
            text: data.display().to_string(),
            text_fnv: None,
            cut: false,
            weight_sums: checkpoint::ModelFingerprint::of(engine)?.weight_sums,
            ds: Some(ds),
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
        let scale = weight_scale(self.meta.tokens);
        crate::error::guard(|| Ok(self.sums.iter().map(|s| (s * scale).to_kind(Kind::Float)).collect()))
    }

    /// Writes the statistics into the editor folder `dir` ([`KEY_STATS_FILE`]) and names
    /// them in its `editor.json` (`key_stats`): the file first, then the description, each
    /// replaced atomically, so a failure leaves the editor as it was (at worst an unnamed
    /// statistics file beside it).
    ///
    /// The text is recorded relative to the editor's folder when the two share a folder
    /// (`../world/corpus.txt` for the embedded default), so that the pair can move
    /// together and [`SummedText::find`] still finds it.
    pub fn write_for_editor(&mut self, dir: &Path) -> Result<PathBuf> {
        let mut meta = checkpoint::read_editor_json(dir)?;
        if let Some(rel) = relative_path(dir, Path::new(&self.meta.text)) {
            self.meta.text = rel.display().to_string();
        }
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

/// Adds `Σ k kᵀ` of every token of `examples` (one batch, images included) to `sums`, per
/// edited weight (f64 `[d_in, d_in]`); returns the keys added.
fn add_keys(engine: &Engine, examples: &[&Example], sums: &mut Option<Vec<Tensor>>) -> Result<usize> {
    if examples.is_empty() {
        return Ok(0);
    }
    let xs = engine.layer_inputs(&engine.collate(examples)?)?;
    let keys = xs.first().map_or(0, |x| x.size()[0] as usize);
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
    Ok(keys)
}

/// The factor of statistics over `tokens` tokens in the solve: they stand for at most
/// [`WEIGHT_TOKENS`] tokens (see the module's doc).
pub fn weight_scale(tokens: f64) -> f64 {
    (WEIGHT_TOKENS / tokens).min(1.0)
}

/// The statistics' tokens of one (trimmed, non-empty) text line: cut to
/// [`MAX_KEEP_LINE_CHARS`] characters, encoded, at most the model's context − 1 and
/// `budget` tokens, then the last token repeated, since in a batch the last token is a
/// target and every token must be an input (a key). `None` for a line without a token;
/// the flag says whether `budget` (not the context) cut it.
pub fn line_ids(engine: &Engine, line: &str, budget: usize) -> Result<Option<(Vec<i64>, bool)>> {
    let max = engine.lm.model.info().max_positions.max(2) as usize;
    let mut ids = engine.lm.tokenizer.encode(&line[..floor_char_boundary(line, MAX_KEEP_LINE_CHARS)])?;
    let keep = (max - 1).min(budget);
    let cut = ids.len() > keep && budget < max - 1;
    ids.truncate(keep);
    ids.push(ids.last().copied().unwrap_or(0));
    Ok((ids.len() >= 2).then_some((ids, cut)))
}

/// FNV-1a 64 over text lines, each followed by `\n`: a fingerprint of the summed text.
struct Fnv(u64);

impl Default for Fnv {
    fn default() -> Self {
        Self(0xcbf2_9ce4_8422_2325)
    }
}

impl Fnv {
    fn update(&mut self, line: &str) {
        for b in line.bytes().chain(std::iter::once(b'\n')) {
            self.0 = (self.0 ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
        }
    }
    fn hex(&self) -> String {
        format!("{:016x}", self.0)
    }
}

/// Texts larger than this are not read back for [`SummedText`]: in a corpus that large the
/// edited facts' own lines weigh nothing in the statistics.
const MAX_SUMMED_TEXT_BYTES: u64 = 64 << 20;

/// The lines the statistics summed, read back from their text, so that an edit can leave
/// out of the solve's statistics the lines that state the fact it rewrites
/// ([`crate::mend::ls::Fact`]): asked to keep those lines' keys as they were, the solve
/// keeps the old fact at its rephrasings' keys too (the world's corpus states every fact
/// in each of its relation's templates; docs/notebook/many-edits.md, "Many edits, part 7").
pub struct SummedText {
    /// The summed lines, trimmed, in order.
    pub lines: Vec<String>,
    /// Whether the last one was cut by `--max-tokens` (then it is never left out).
    pub cut_last: bool,
    /// Tokens summed ([`StatsMeta::tokens`]).
    pub tokens: f64,
}

impl SummedText {
    /// The text of `meta`, found relative to the editor's folder `dir` (as
    /// [`KeyStats::write_for_editor`] records it), as written, or relative to a folder
    /// above `dir`, whose summed lines still have the fingerprint the statistics
    /// recorded. `None` (logged) when there is none: statistics of an earlier version (no
    /// fingerprint), a text moved, changed or over 64 MiB.
    pub fn find(meta: &StatsMeta, dir: &Path) -> Option<Self> {
        if let Some(ds) = meta.ds {
            tracing::debug!(data = %meta.text, %ds, "key statistics of a data file's locality views: no lines to leave out");
            return None;
        }
        let Some(want) = meta.text_fnv.as_ref() else {
            tracing::info!(text = %meta.text, "the key statistics carry no fingerprint of their text (computed by an earlier version): mend-ls keeps the edited facts' own lines in them; run `dualedit stats` again to leave them out");
            return None;
        };
        let given = Path::new(&meta.text);
        let mut candidates = vec![dir.join(given), given.to_path_buf()];
        if given.is_relative() {
            candidates.extend(dir.ancestors().skip(1).map(|a| a.join(given)));
        }
        for path in candidates {
            let Ok(text) = crate::io::read_text_capped(&path, MAX_SUMMED_TEXT_BYTES) else { continue };
            // The summed lines are the first non-empty ones (a line without a token was
            // not summed: then the fingerprint differs and nothing is left out).
            let kept: Vec<String> = text.lines().map(str::trim).filter(|l| !l.is_empty()).take(meta.lines).map(String::from).collect();
            let mut fnv = Fnv::default();
            kept.iter().for_each(|l| fnv.update(l));
            if kept.len() == meta.lines && fnv.hex() == *want {
                tracing::debug!(file = %path.display(), lines = kept.len(), "the key statistics' text, for leaving out edited facts");
                return Some(Self { lines: kept, cut_last: meta.cut, tokens: meta.tokens });
            }
        }
        tracing::info!(text = %meta.text, "the key statistics' text is not found as it was summed: mend-ls keeps the edited facts' own lines in its statistics");
        None
    }
}

/// `target` relative to the folder `from` (`../world/corpus.txt`), when both exist and
/// share a folder below the file system's root; else `None`.
fn relative_path(from: &Path, target: &Path) -> Option<PathBuf> {
    let (from, target) = (from.canonicalize().ok()?, target.canonicalize().ok()?);
    let common = from.components().zip(target.components()).take_while(|(a, b)| a == b).count();
    if common <= 1 {
        return None;
    }
    let mut rel: PathBuf = from.components().skip(common).map(|_| "..").collect();
    rel.extend(target.components().skip(common));
    Some(rel)
}

/// The largest char boundary of `s` at or below `at`.
pub(crate) fn floor_char_boundary(s: &str, at: usize) -> usize {
    if at >= s.len() {
        return s.len();
    }
    let mut end = at;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    end
}
