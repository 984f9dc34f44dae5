//! EasyEdit records -> tokenised edit examples (inner / outer / locality), as EasyEdit
//! builds its MEND batches, with the target scored as the continuation of the prompt.
//!
//! A record longer than the maximum length (the model's context or the configured
//! `max_length`) is handled by an [`OverLong`] policy: real datasets have a few such
//! records (zsRE's first record is 38 GPT-2 tokens against the default's 32), and one of
//! them must not abort a run over thousands. EasyEdit truncates; dualedit skips them by
//! default (a truncated prompt is another question), cuts the prompt from the left with
//! `--truncate`, and keeps the old error with `--strict`.
use std::path::{Path, PathBuf};

use serde::Serialize;

use super::batch::{EditExample, Example};
use super::easyedit::EditRecord;
use crate::model::Tokenizer;
use crate::{Error, Result};

/// What to do with a record whose prompt + answer is longer than the maximum length.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum OverLong {
    /// Leave the record out, count it in the run report and name it in one warning.
    #[default]
    Skip,
    /// Cut the prompt from the left (keeping a leading BOS) until prompt + answer fits;
    /// a record whose answer alone does not fit is skipped.
    Truncate,
    /// Stop with an error naming the file and the record.
    Strict,
}

/// A record left out of a run: its 0-based index in the file and why.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct SkippedRecord {
    pub record: usize,
    pub reason: String,
}

fn is_zero(n: &usize) -> bool {
    *n == 0
}

/// How many records are shown by name in warnings and reports.
pub const SHOWN_SKIPPED: usize = 5;

/// What a run made of its data file: written into every run report (`data`), so that
/// records that were left out or cut are visible after the fact, not only in a warning.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct DataCounts {
    pub file: PathBuf,
    /// Records in the file.
    pub records: usize,
    /// Records the run used.
    pub used: usize,
    /// Skipped because their prompt or target is empty.
    pub skipped_empty: usize,
    /// Skipped because prompt + answer is longer than `max_length` (policy `skip`, or an
    /// answer too long to fit even with the whole prompt cut under `truncate`).
    pub skipped_too_long: usize,
    /// Multimodal data: skipped because an image is missing or unreadable.
    pub skipped_image: usize,
    /// Records whose prompts were cut from the left to fit (policy `truncate`).
    pub truncated: usize,
    /// Multimodal data: records used whose `rephrase` is empty, so their rephrase
    /// accuracy is not measured (treated as absent, not scored as a question).
    #[serde(skip_serializing_if = "is_zero")]
    pub no_rephrase: usize,
    /// Validation examples dropped because the same example is in the training split
    /// (duplicated records), so validation never measures what was trained on.
    #[serde(skip_serializing_if = "is_zero")]
    pub val_duplicates_dropped: usize,
    /// Longest example in tokens (prompt + answer), as applied.
    pub max_length: usize,
    pub over_long: OverLong,
    /// The first few skipped records, empty and over-long alike, in file order.
    pub first_skipped: Vec<SkippedRecord>,
}

/// Examples of the records that fit, with what was left out.
#[derive(Debug, Clone, Default)]
pub struct Prepared {
    pub examples: Vec<EditExample>,
    /// For each example, the position of its record in the `records` given to
    /// [`prepare_with`] (to keep records and examples aligned).
    pub kept: Vec<usize>,
    /// Over-long records left out: (index in the file, reason).
    pub skipped: Vec<(usize, String)>,
    /// Indices in the file of the records whose prompts were cut.
    pub truncated: Vec<usize>,
}

/// Tokenises every record, refusing any example longer than `max_len` tokens (the model's
/// context or the configured maximum) with the record's index and the file.
pub fn prepare(tok: &Tokenizer, records: &[EditRecord], max_len: usize, path: &Path) -> Result<Vec<EditExample>> {
    let index: Vec<usize> = (0..records.len()).collect();
    Ok(prepare_with(tok, records, &index, max_len, OverLong::Strict, path)?.examples)
}

/// Tokenises every record and applies `policy` to those longer than `max_len` tokens.
///
/// `file_index[i]` is the index in the file of `records[i]` (records with an empty target
/// were already dropped by the reader, so positions and file indices differ); messages
/// and [`Prepared::skipped`] use it. Under [`OverLong::Skip`] and [`OverLong::Truncate`]
/// the records left out are named in one warning; if every record is left out, the
/// result is an error, since a run on nothing would only fail later and less clearly.
pub fn prepare_with(
    tok: &Tokenizer,
    records: &[EditRecord],
    file_index: &[usize],
    max_len: usize,
    policy: OverLong,
    path: &Path,
) -> Result<Prepared> {
    if file_index.len() != records.len() {
        return Err(Error::input(format!("{} record indices for {} records", file_index.len(), records.len())));
    }
    // Special tokens the tokenizer puts before every text (LLaMA's BOS): kept when a
    // prompt is cut from the left, as the model never saw a text without them.
    let head = tok.encode("")?;
    let mut out = Prepared::default();
    for (pos, (r, &i)) in records.iter().zip(file_index).enumerate() {
        let fail = |e: Error| Error::file(path, format!("record {i}: {e}"));
        let mut cut = false;
        let mut fit = |what: &str, e: Example| -> Result<std::result::Result<Example, String>> {
            if e.ids.len() <= max_len {
                return Ok(Ok(e));
            }
            let why = format!("{what} is {} tokens, longer than the maximum of {max_len}", e.ids.len());
            match policy {
                OverLong::Strict => Err(fail(Error::input(why))),
                OverLong::Skip => Ok(Err(why)),
                OverLong::Truncate => match truncate_left(e, max_len, &head) {
                    Some(e) => {
                        cut = true;
                        Ok(Ok(e))
                    }
                    None => Ok(Err(format!("{why}, and its answer does not fit even with the whole prompt cut"))),
                },
            }
        };
        // A text longer in bytes than `max_len` tokens can be is refused (or, truncating, its
        // prompt cut) before it is tokenised: a 50 MB field is not encoded to be skipped.
        let sized = |what: &str, p: &'_ str, a: &str| -> Result<std::result::Result<String, String>> {
            match bounded(what, p, a, max_len, policy) {
                Ok(p) => Ok(Ok(p.to_string())),
                Err(why) if policy == OverLong::Strict => Err(fail(Error::input(why))),
                Err(why) => Ok(Err(why)),
            }
        };
        let example = (|| -> Result<std::result::Result<EditExample, String>> {
            let prompt = match sized("prompt + target", &r.prompt, &r.target_new)? {
                Ok(p) => p,
                Err(why) => return Ok(Err(why)),
            };
            let inner = match fit("prompt + target", Example::new(tok, &prompt, &r.target_new).map_err(fail)?)? {
                Ok(e) => e,
                Err(why) => return Ok(Err(why)),
            };
            let outer = match &r.rephrase {
                Some(rp) => match fit("rephrase + target", {
                    let rp = match sized("rephrase + target", rp, &r.target_new)? {
                        Ok(p) => p,
                        Err(why) => return Ok(Err(why)),
                    };
                    Example::new(tok, &rp, &r.target_new).map_err(fail)?
                })? {
                    Ok(e) => e,
                    Err(why) => return Ok(Err(why)),
                },
                None => inner.clone(),
            };
            let loc = match (&r.locality_prompt, &r.locality_ground_truth) {
                (Some(p), Some(a)) => match fit("locality prompt + answer", {
                    let p = match sized("locality prompt + answer", p, a)? {
                        Ok(p) => p,
                        Err(why) => return Ok(Err(why)),
                    };
                    Example::new(tok, &p, a).map_err(fail)?
                })? {
                    Ok(e) => Some(e),
                    Err(why) => return Ok(Err(why)),
                },
                _ => None,
            };
            let mut portability = Vec::with_capacity(r.portability.len());
            for (p, a) in &r.portability {
                let p = match sized("portability prompt + answer", p, a)? {
                    Ok(p) => p,
                    Err(why) => return Ok(Err(why)),
                };
                match fit("portability prompt + answer", Example::new(tok, &p, a).map_err(fail)?)? {
                    Ok(e) => portability.push(e),
                    Err(why) => return Ok(Err(why)),
                }
            }
            Ok(Ok(EditExample { inner, outer, rephrased: r.rephrase.is_some(), loc, portability, outer_image: None, loc_image: None, neighbours: Vec::new() }))
        })()?;
        match example {
            Ok(e) => {
                out.examples.push(e);
                out.kept.push(pos);
                if cut {
                    out.truncated.push(i);
                }
            }
            Err(why) => out.skipped.push((i, why)),
        }
    }
    if out.examples.is_empty() && !out.skipped.is_empty() {
        let (i, why) = &out.skipped[0];
        let hint = if policy == OverLong::Skip { "; `truncate` cuts prompts from the left instead" } else { "" };
        return Err(Error::file(
            path,
            format!("no record fits in {max_len} tokens: all {} were skipped (first: record {i}: {why}){hint}", out.skipped.len()),
        ));
    }
    if !out.skipped.is_empty() {
        tracing::warn!(
            file = %path.display(),
            "skipped {} of {} records longer than {max_len} tokens ({}){}",
            out.skipped.len(),
            records.len(),
            shown(&out.skipped),
            if policy == OverLong::Skip { "; `truncate`=true cuts their prompts from the left instead, `strict`=true makes this an error" } else { "" }
        );
    }
    if !out.truncated.is_empty() {
        let first: Vec<String> = out.truncated.iter().take(SHOWN_SKIPPED).map(|i| format!("record {i}")).collect();
        let more = if out.truncated.len() > SHOWN_SKIPPED { ", …" } else { "" };
        tracing::info!(file = %path.display(), "cut the prompts of {} records from the left to fit {max_len} tokens ({}{more})", out.truncated.len(), first.join(", "));
    }
    Ok(out)
}

/// Bytes one token covers at most in any tokenizer dualedit loads (GPT-2's longest token
/// is 128 bytes; Qwen2's and LLaMA's are shorter): a text of more than `max_len` times this
/// many bytes has more than `max_len` tokens, whatever it says.
pub const MAX_TOKEN_BYTES: usize = 1024;

/// `prompt` when `prompt + answer` may fit in `max_len` tokens by its length in bytes;
/// otherwise why not, or under [`OverLong::Truncate`] the prompt's last bytes (enough for
/// `max_len` tokens, so truncation still cuts it from the left after tokenising). Checked
/// before tokenising, which for a 50 MB field costs seconds.
fn bounded<'t>(what: &str, prompt: &'t str, answer: &str, max_len: usize, policy: OverLong) -> std::result::Result<&'t str, String> {
    let bound = max_len.saturating_mul(MAX_TOKEN_BYTES);
    let bytes = prompt.len().saturating_add(answer.len());
    if bytes <= bound {
        return Ok(prompt);
    }
    if policy == OverLong::Truncate && answer.len() < bound {
        let mut start = prompt.len() - (bound - answer.len()).min(prompt.len());
        while !prompt.is_char_boundary(start) {
            start += 1;
        }
        return Ok(&prompt[start..]);
    }
    Err(format!("{what} is {bytes} bytes, longer than {max_len} tokens can be (refused before tokenising)"))
}

/// "record 0: why; record 7: why, …" for the first few of `skipped`.
pub fn shown(skipped: &[(usize, String)]) -> String {
    let first: Vec<String> = skipped.iter().take(SHOWN_SKIPPED).map(|(i, why)| format!("record {i}: {why}")).collect();
    let more = if skipped.len() > SHOWN_SKIPPED { "; …" } else { "" };
    format!("{}{more}", first.join("; "))
}

/// `e` with the first prompt tokens after `head` (the tokenizer's leading special tokens)
/// removed so that it is `max_len` tokens long; `None` when that would leave no prompt
/// token before the answer (the first answer token must be predicted from something).
fn truncate_left(e: Example, max_len: usize, head: &[i64]) -> Option<Example> {
    let keep_head = if e.ids.starts_with(head) { head.len() } else { 0 };
    let over = e.ids.len().checked_sub(max_len)?;
    if e.answer_start < keep_head + over + 1 {
        return None;
    }
    let mut ids = e.ids[..keep_head].to_vec();
    ids.extend_from_slice(&e.ids[keep_head + over..]);
    Some(Example { ids, answer_start: e.answer_start - over, image: e.image })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ex(n: usize, answer_start: usize) -> Example {
        Example { ids: (0..n as i64).collect(), answer_start, image: None }
    }

    #[test]
    fn truncation_cuts_the_prompt_from_the_left() {
        let e = truncate_left(ex(10, 7), 6, &[]).unwrap();
        assert_eq!(e.ids, vec![4, 5, 6, 7, 8, 9]);
        assert_eq!(e.answer_start, 3);
        assert_eq!(e.answer(), &[7, 8, 9]);
    }

    #[test]
    fn truncation_keeps_a_leading_bos() {
        let e = truncate_left(ex(10, 7), 6, &[0]).unwrap();
        assert_eq!(e.ids, vec![0, 5, 6, 7, 8, 9]);
        assert_eq!(e.answer(), &[7, 8, 9]);
    }

    #[test]
    fn truncation_needs_one_prompt_token_left() {
        // Answer of 5 tokens in 5 tokens: nothing to predict its first token from.
        assert!(truncate_left(ex(10, 5), 5, &[]).is_none());
        assert_eq!(truncate_left(ex(10, 5), 6, &[]).unwrap().ids, vec![4, 5, 6, 7, 8, 9]);
        // With a BOS kept, one real prompt token must remain after it.
        assert!(truncate_left(ex(10, 5), 6, &[0]).is_none());
    }
}

