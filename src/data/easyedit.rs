//! Readers for EasyEdit-format knowledge-editing JSON files (zsRE, CounterFact and
//! "requests" files) into one record type, so training, evaluation and the CLI never
//! deal with the per-dataset key names.
//!
//! The files are parsed as a generic JSON tree first and then checked record by record,
//! rather than derived with serde, so that every error can name the record index and the
//! key at fault in one line (serde's derive errors only give a byte position).
//!
//! Record indices in messages and in [`LoadReport::skipped`] are 0-based positions in the
//! top-level array, matching Python's indexing of the same files.

use std::fmt;
use std::path::Path;
use std::str::FromStr;

use serde_json::{Map, Value};

use crate::error::{Error, Result};

/// Which EasyEdit file layout to expect; chosen by the caller because the layouts cannot be
/// told apart reliably from the content alone (and guessing would hide mistakes).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DatasetKind {
    /// zsRE as prepared for MEND: `src`, `alt`, `answers`, `pred`, `rephrase`, `loc`, `loc_ans`, `subject`.
    Zsre,
    /// CounterFact as distributed by EasyEdit: `prompt`, `target_new`, `ground_truth`,
    /// `rephrase_prompt`, `locality_prompt`, `locality_ground_truth`, `subject`.
    Counterfact,
    /// Edit requests: the CounterFact keys plus an optional `portability`, so any
    /// CounterFact file is also a valid requests file.
    Requests,
    /// EasyEdit's E-VQA (multimodal, [`crate::data::multimodal`]): `src`, `alt`,
    /// `rephrase`, `image`, `image_rephrase`, `loc`, `loc_ans`, `m_loc`, `m_loc_q`, `m_loc_a`.
    Vqa,
    /// EasyEdit's E-IC (image captions), the same layout as E-VQA.
    Caption,
}

impl DatasetKind {
    /// Every kind, in the order they are listed in messages.
    pub const ALL: [DatasetKind; 5] = [
        DatasetKind::Zsre,
        DatasetKind::Counterfact,
        DatasetKind::Requests,
        DatasetKind::Vqa,
        DatasetKind::Caption,
    ];

    /// Image + text records, read by [`crate::data::multimodal::load_mm`].
    pub fn is_multimodal(self) -> bool {
        matches!(self, DatasetKind::Vqa | DatasetKind::Caption)
    }

    /// The name used on the command line and in serialized configs.
    pub fn as_str(self) -> &'static str {
        match self {
            DatasetKind::Zsre => "zsre",
            DatasetKind::Counterfact => "counterfact",
            DatasetKind::Requests => "requests",
            DatasetKind::Vqa => "vqa",
            DatasetKind::Caption => "caption",
        }
    }
}

impl fmt::Display for DatasetKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// `--ds` of the commands that read a dataset (not edit requests): zsre, counterfact, vqa
/// or caption, listed by `--help`.
pub fn dataset_parser() -> impl clap::builder::TypedValueParser<Value = DatasetKind> {
    let names: Vec<&'static str> = DatasetKind::ALL.iter().filter(|k| **k != DatasetKind::Requests).map(|k| k.as_str()).collect();
    use clap::builder::TypedValueParser;
    clap::builder::PossibleValuesParser::new(names).try_map(|s| s.parse::<DatasetKind>())
}

impl FromStr for DatasetKind {
    type Err = Error;

    /// Case-insensitive, surrounding whitespace ignored, so `--kind ZsRE` works.
    fn from_str(s: &str) -> Result<Self> {
        let wanted = s.trim().to_ascii_lowercase();
        DatasetKind::ALL
            .into_iter()
            .find(|k| k.as_str() == wanted)
            .ok_or_else(|| {
                let names: Vec<&str> = DatasetKind::ALL.iter().map(|k| k.as_str()).collect();
                Error::input(format!(
                    "unknown dataset kind {s:?}; expected one of: {}",
                    names.join(", ")
                ))
            })
    }
}

/// One knowledge edit, whatever file it came from.
///
/// `prompt` and `target_new` are kept exactly as written (no trimming), because the
/// tokenizer's handling of leading spaces is the caller's decision. Optional fields that are
/// absent, `null` or empty/whitespace-only are `None`, so "no locality prompt" has one spelling.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct EditRecord {
    pub prompt: String,
    pub target_new: String,
    pub subject: Option<String>,
    pub ground_truth: Option<String>,
    pub rephrase: Option<String>,
    pub locality_prompt: Option<String>,
    pub locality_ground_truth: Option<String>,
    /// (prompt, expected answer) pairs probing whether the edit carries over to related facts.
    pub portability: Vec<(String, String)>,
}

/// What a load left out, so callers can report it instead of it vanishing silently.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LoadReport {
    /// (record index, reason) for every record skipped because its prompt or target is empty.
    pub skipped: Vec<(usize, String)>,
}

/// Read and parse an EasyEdit JSON file. See [`parse_records`] for the rules.
pub fn load_records(path: &Path, kind: DatasetKind) -> Result<(Vec<EditRecord>, LoadReport)> {
    let text = crate::io::read_text(path)?;
    parse_records(&text, path, kind)
}

/// Parse the text of an EasyEdit JSON file; `path` is used only in messages.
///
/// The top level must be a non-empty array of objects. Records whose prompt or target is
/// empty or whitespace-only are skipped (the zsRE MEND split has two with an empty `alt`)
/// and listed in the report, because an edit with nothing to write is unusable but not a
/// sign of a broken file. Any other problem (missing required key, wrong type) is an error
/// naming the record and key, since it means the file is not the format asked for.
/// Unknown keys (e.g. CounterFact's `case_id`) are ignored.
pub fn parse_records(
    text: &str,
    path: &Path,
    kind: DatasetKind,
) -> Result<(Vec<EditRecord>, LoadReport)> {
    if kind.is_multimodal() {
        return Err(Error::file(path, format!("{kind} records carry images: read them with data::multimodal::load_mm (and `image_root`)")));
    }
    let root: Value = serde_json::from_str(text)
        .map_err(|e| Error::file(path, format!("malformed JSON: {e}")))?;
    let items = match root {
        Value::Array(items) => items,
        other => {
            return Err(Error::file(
                path,
                format!(
                    "top level must be a JSON array of {kind} records, got {}",
                    type_name(&other)
                ),
            ))
        }
    };
    if items.is_empty() {
        return Err(Error::file(
            path,
            "no records (the top-level array is empty)",
        ));
    }

    let total = items.len();
    let mut records = Vec::with_capacity(total);
    let mut report = LoadReport::default();
    for (index, item) in items.iter().enumerate() {
        let rec = Rec::new(item, index).map_err(|msg| Error::file(path, msg))?;
        let parsed = match kind {
            DatasetKind::Zsre => parse_zsre(&rec),
            // The requests format is CounterFact's plus `portability`; a CounterFact file that
            // happens to carry portability probes keeps them rather than dropping them silently.
            DatasetKind::Counterfact | DatasetKind::Requests => parse_counterfact(&rec),
            DatasetKind::Vqa | DatasetKind::Caption => return Err(Error::file(path, "multimodal records are read by data::multimodal")),
        }
        .map_err(|msg| Error::file(path, msg))?;
        match parsed {
            Parsed::Record(r) => records.push(r),
            Parsed::Skip(reason) => report.skipped.push((index, reason)),
        }
    }

    if records.is_empty() {
        let (first_index, first_reason) = &report.skipped[0];
        return Err(Error::file(
            path,
            format!(
                "no usable records: all {total} record(s) were skipped (first: record {first_index}: {first_reason})"
            ),
        ));
    }
    if !report.skipped.is_empty() {
        let shown: Vec<String> = report.skipped.iter().take(5).map(|(i, why)| format!("record {i}: {why}")).collect();
        let more = if report.skipped.len() > 5 { ", …" } else { "" };
        tracing::warn!(
            file = %path.display(),
            "skipped {} of {total} records ({}{more})",
            report.skipped.len(),
            shown.join("; ")
        );
    }
    Ok((records, report))
}

/// Split off the last `holdout` records for evaluation; the rest are for training.
///
/// Positional rather than shuffled so the split is reproducible from the file alone and
/// does not depend on a seed or RNG implementation. A `holdout` larger than the number of
/// records holds out everything.
pub fn split_holdout(
    mut records: Vec<EditRecord>,
    holdout: usize,
) -> (Vec<EditRecord>, Vec<EditRecord>) {
    let at = records.len().saturating_sub(holdout);
    let held_out = records.split_off(at);
    (records, held_out)
}

// ---------------------------------------------------------------------------------------
// Per-record parsing. Errors are plain strings already prefixed with "record N: " and are
// turned into `Error::file` by the caller, which knows the path.

enum Parsed {
    Record(EditRecord),
    Skip(String),
}

/// One record's object plus its index, so every accessor can phrase its own error.
struct Rec<'a> {
    obj: &'a Map<String, Value>,
    index: usize,
}

impl<'a> Rec<'a> {
    fn new(item: &'a Value, index: usize) -> std::result::Result<Self, String> {
        match item {
            Value::Object(obj) => Ok(Rec { obj, index }),
            other => Err(format!(
                "record {index}: expected a JSON object, got {}",
                type_name(other)
            )),
        }
    }

    fn err(&self, msg: impl fmt::Display) -> String {
        format!("record {}: {msg}", self.index)
    }

    /// A key that must be present and a string (possibly empty: emptiness is the skip rule's job).
    fn required_str(&self, key: &str) -> std::result::Result<&'a str, String> {
        match self.obj.get(key) {
            None => Err(self.err(format_args!("missing key {key:?}"))),
            Some(Value::String(s)) => Ok(s),
            Some(other) => Err(self.err(format_args!(
                "key {key:?} must be a string, got {}",
                type_name(other)
            ))),
        }
    }

    /// A key that may be absent or null; present values must be strings. Blank becomes None.
    fn optional_str(&self, key: &str) -> std::result::Result<Option<String>, String> {
        match self.obj.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::String(s)) => Ok(non_blank(s)),
            Some(other) => Err(self.err(format_args!(
                "key {key:?} must be a string or null, got {}",
                type_name(other)
            ))),
        }
    }
}

fn non_blank(s: &str) -> Option<String> {
    if s.trim().is_empty() {
        None
    } else {
        Some(s.to_string())
    }
}

/// Apply the skip rule to the two required fields; `prompt_key`/`target_key` are the
/// file's own key names so the reason points at what to fix in the file.
fn skip_reason(prompt: &str, prompt_key: &str, target: &str, target_key: &str) -> Option<String> {
    match (prompt.trim().is_empty(), target.trim().is_empty()) {
        (true, true) => Some(format!(
            "empty {prompt_key:?} (prompt) and {target_key:?} (target)"
        )),
        (true, false) => Some(format!("empty {prompt_key:?} (prompt)")),
        (false, true) => Some(format!("empty {target_key:?} (target)")),
        (false, false) => None,
    }
}

/// zsRE as EasyEdit builds its edits: prompt = src, target_new = alt,
/// ground_truth = answers[0] (falling back to pred), rephrase, loc / loc_ans, subject.
fn parse_zsre(rec: &Rec<'_>) -> std::result::Result<Parsed, String> {
    let prompt = rec.required_str("src")?;
    let target = rec.required_str("alt")?;
    // Type-check every field before applying the skip rule, so a skipped record cannot
    // hide a file that is not zsRE at all.
    let answers_first = match rec.obj.get("answers") {
        None | Some(Value::Null) => None,
        Some(Value::Array(items)) => match items.first() {
            None | Some(Value::Null) => None,
            Some(Value::String(s)) => non_blank(s),
            Some(other) => {
                return Err(rec.err(format_args!(
                    "key \"answers\" must be a list of strings, but its first element is {}",
                    type_name(other)
                )))
            }
        },
        Some(other) => {
            return Err(rec.err(format_args!(
                "key \"answers\" must be a list of strings, got {}",
                type_name(other)
            )))
        }
    };
    let pred = rec.optional_str("pred")?;
    let record = EditRecord {
        prompt: prompt.to_string(),
        target_new: target.to_string(),
        subject: rec.optional_str("subject")?,
        ground_truth: answers_first.or(pred),
        rephrase: rec.optional_str("rephrase")?,
        locality_prompt: rec.optional_str("loc")?,
        locality_ground_truth: rec.optional_str("loc_ans")?,
        portability: Vec::new(),
    };
    Ok(match skip_reason(prompt, "src", target, "alt") {
        Some(reason) => Parsed::Skip(reason),
        None => Parsed::Record(record),
    })
}

/// CounterFact and requests files share this layout (requests only add `portability`).
fn parse_counterfact(rec: &Rec<'_>) -> std::result::Result<Parsed, String> {
    let prompt = rec.required_str("prompt")?;
    let target = rec.required_str("target_new")?;
    let record = EditRecord {
        prompt: prompt.to_string(),
        target_new: target.to_string(),
        subject: rec.optional_str("subject")?,
        ground_truth: rec.optional_str("ground_truth")?,
        rephrase: rec.optional_str("rephrase_prompt")?,
        locality_prompt: rec.optional_str("locality_prompt")?,
        locality_ground_truth: rec.optional_str("locality_ground_truth")?,
        portability: parse_portability(rec)?,
    };
    Ok(match skip_reason(prompt, "prompt", target, "target_new") {
        Some(reason) => Parsed::Skip(reason),
        None => Parsed::Record(record),
    })
}

/// Accepts absent/null, `{"prompt": str|[str], "ground_truth": str|[str]}` (zipped; the two
/// must have the same length), or `[{"prompt": str, "ground_truth": str}, ...]`.
/// A pair with an empty prompt or answer is an error rather than dropped: unlike a whole
/// record, a half-written probe is more likely a mistake in the file than a known gap.
fn parse_portability(rec: &Rec<'_>) -> std::result::Result<Vec<(String, String)>, String> {
    const KEY: &str = "portability";
    let bad = |what: String| rec.err(format_args!("key {KEY:?}: {what}"));

    // A string or list of strings, as a list; `field` names it in messages.
    let strings =
        |v: Option<&Value>, field: &str, ctx: &str| -> std::result::Result<Vec<String>, String> {
            match v {
                None => Err(bad(format!("{ctx}missing key {field:?}"))),
                Some(Value::String(s)) => Ok(vec![s.clone()]),
                Some(Value::Array(items)) => items
                    .iter()
                    .enumerate()
                    .map(|(i, item)| match item {
                        Value::String(s) => Ok(s.clone()),
                        other => Err(bad(format!(
                            "{ctx}{field:?} element {i} must be a string, got {}",
                            type_name(other)
                        ))),
                    })
                    .collect(),
                Some(other) => Err(bad(format!(
                    "{ctx}{field:?} must be a string or a list of strings, got {}",
                    type_name(other)
                ))),
            }
        };

    let pairs: Vec<(String, String)> = match rec.obj.get(KEY) {
        None | Some(Value::Null) => return Ok(Vec::new()),
        Some(Value::Object(obj)) => {
            let prompts = strings(obj.get("prompt"), "prompt", "")?;
            let answers = strings(obj.get("ground_truth"), "ground_truth", "")?;
            if prompts.len() != answers.len() {
                return Err(bad(format!(
                    "{} prompt(s) but {} ground_truth value(s); they must pair up",
                    prompts.len(),
                    answers.len()
                )));
            }
            prompts.into_iter().zip(answers).collect()
        }
        Some(Value::Array(items)) => {
            let mut pairs = Vec::with_capacity(items.len());
            for (i, item) in items.iter().enumerate() {
                let ctx = format!("entry {i}: ");
                let obj = match item {
                    Value::Object(obj) => obj,
                    other => {
                        return Err(bad(format!(
                            "{ctx}expected an object, got {}",
                            type_name(other)
                        )))
                    }
                };
                let one = |field: &str| -> std::result::Result<String, String> {
                    match obj.get(field) {
                        Some(Value::String(s)) => Ok(s.clone()),
                        None => Err(bad(format!("{ctx}missing key {field:?}"))),
                        Some(other) => Err(bad(format!(
                            "{ctx}{field:?} must be a string, got {}",
                            type_name(other)
                        ))),
                    }
                };
                pairs.push((one("prompt")?, one("ground_truth")?));
            }
            pairs
        }
        Some(other) => {
            return Err(bad(format!(
                "must be an object {{\"prompt\", \"ground_truth\"}} or a list of them, got {}",
                type_name(other)
            )))
        }
    };

    for (i, (p, a)) in pairs.iter().enumerate() {
        if p.trim().is_empty() {
            return Err(bad(format!("pair {i} has an empty prompt")));
        }
        if a.trim().is_empty() {
            return Err(bad(format!("pair {i} has an empty ground_truth")));
        }
    }
    Ok(pairs)
}

fn type_name(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p() -> &'static Path {
        Path::new("test.json")
    }

    fn parse(text: &str, kind: DatasetKind) -> Result<(Vec<EditRecord>, LoadReport)> {
        parse_records(text, p(), kind)
    }

    /// The error's full one-line message, as the CLI would print it.
    fn err_msg(text: &str, kind: DatasetKind) -> String {
        match parse(text, kind) {
            Ok(_) => panic!("expected an error for {text}"),
            Err(e) => {
                let msg = e.to_string();
                assert!(!msg.contains('\n'), "error should be one line: {msg}");
                assert!(
                    msg.starts_with("test.json: "),
                    "error should name the file: {msg}"
                );
                msg
            }
        }
    }

    const ZSRE: &str = r#"[
      {"subject": "UniFirst", "src": "What is the product made by UniFirst?", "pred": "uniform",
       "rephrase": "What will be the product of UniFirst?", "alt": "unmanned aircraft",
       "answers": ["uniform", "uniforms"], "loc": "nq question: who wrote hamlet",
       "loc_ans": "Shakespeare", "cond": "uniform >> unmanned aircraft || ..."},
      {"subject": "X", "src": "Q?", "pred": "from-pred", "rephrase": "", "alt": "A",
       "answers": [], "loc": "L", "loc_ans": "LA", "cond": ""}
    ]"#;

    const CF: &str = r#"[
      {"case_id": 2, "prompt": "Toko Yasuda, the", "target_new": "piano", "subject": "Toko Yasuda",
       "ground_truth": "guitar", "rephrase_prompt": "Toko Yasuda is incredible at",
       "locality_prompt": "John Lennon performs on the", "locality_ground_truth": "guitar"}
    ]"#;

    #[test]
    fn zsre_maps_keys_like_easyedit() {
        let (recs, report) = parse(ZSRE, DatasetKind::Zsre).unwrap();
        assert!(report.skipped.is_empty());
        assert_eq!(
            recs[0],
            EditRecord {
                prompt: "What is the product made by UniFirst?".into(),
                target_new: "unmanned aircraft".into(),
                subject: Some("UniFirst".into()),
                ground_truth: Some("uniform".into()),
                rephrase: Some("What will be the product of UniFirst?".into()),
                locality_prompt: Some("nq question: who wrote hamlet".into()),
                locality_ground_truth: Some("Shakespeare".into()),
                portability: vec![],
            }
        );
        // Empty answers fall back to pred; empty optional strings become None.
        assert_eq!(recs[1].ground_truth.as_deref(), Some("from-pred"));
        assert_eq!(recs[1].rephrase, None);
    }

    #[test]
    fn counterfact_maps_keys() {
        let (recs, report) = parse(CF, DatasetKind::Counterfact).unwrap();
        assert!(report.skipped.is_empty());
        assert_eq!(
            recs,
            vec![EditRecord {
                prompt: "Toko Yasuda, the".into(),
                target_new: "piano".into(),
                subject: Some("Toko Yasuda".into()),
                ground_truth: Some("guitar".into()),
                rephrase: Some("Toko Yasuda is incredible at".into()),
                locality_prompt: Some("John Lennon performs on the".into()),
                locality_ground_truth: Some("guitar".into()),
                portability: vec![],
            }]
        );
        // A CounterFact file is a valid requests file, with the same result.
        assert_eq!(parse(CF, DatasetKind::Requests).unwrap().0, recs);
    }

    #[test]
    fn requests_minimal_and_nulls() {
        let text = r#"[{"prompt": "The capital of France is", "target_new": " Lyon",
                        "subject": null, "ground_truth": "  ", "extra": 5}]"#;
        let (recs, _) = parse(text, DatasetKind::Requests).unwrap();
        assert_eq!(recs[0].prompt, "The capital of France is");
        assert_eq!(
            recs[0].target_new, " Lyon",
            "required strings are kept verbatim"
        );
        assert_eq!(recs[0].subject, None);
        assert_eq!(recs[0].ground_truth, None);
        assert_eq!(recs[0].rephrase, None);
        assert!(recs[0].portability.is_empty());
    }

    fn portability_of(json: &str) -> Result<Vec<(String, String)>> {
        let text = format!(r#"[{{"prompt": "p", "target_new": "t", "portability": {json}}}]"#);
        parse(&text, DatasetKind::Requests).map(|(mut r, _)| r.remove(0).portability)
    }

    fn pairs(v: &[(&str, &str)]) -> Vec<(String, String)> {
        v.iter()
            .map(|(a, b)| (a.to_string(), b.to_string()))
            .collect()
    }

    #[test]
    fn portability_forms() {
        assert_eq!(portability_of("null").unwrap(), vec![]);
        assert_eq!(
            portability_of(r#"{"prompt": "a?", "ground_truth": "A"}"#).unwrap(),
            pairs(&[("a?", "A")])
        );
        assert_eq!(
            portability_of(r#"{"prompt": ["a?", "b?"], "ground_truth": ["A", "B"]}"#).unwrap(),
            pairs(&[("a?", "A"), ("b?", "B")])
        );
        assert_eq!(
            portability_of(
                r#"[{"prompt": "a?", "ground_truth": "A"}, {"prompt": "b?", "ground_truth": "B"}]"#
            )
            .unwrap(),
            pairs(&[("a?", "A"), ("b?", "B")])
        );
        assert_eq!(portability_of("[]").unwrap(), vec![]);
    }

    #[test]
    fn portability_errors() {
        let cases = [
            (
                r#"{"prompt": ["a", "b"], "ground_truth": "A"}"#,
                "2 prompt(s) but 1 ground_truth",
            ),
            (r#"{"prompt": "a"}"#, r#"missing key "ground_truth""#),
            (
                r#"{"prompt": [1], "ground_truth": ["A"]}"#,
                r#""prompt" element 0 must be a string"#,
            ),
            (
                r#"[{"prompt": "a", "ground_truth": "A"}, "x"]"#,
                "entry 1: expected an object",
            ),
            (
                r#"[{"prompt": "a", "ground_truth": 3}]"#,
                r#"entry 0: "ground_truth" must be a string"#,
            ),
            (
                r#"[{"prompt": "", "ground_truth": "A"}]"#,
                "pair 0 has an empty prompt",
            ),
            ("7", "must be an object"),
        ];
        for (json, want) in cases {
            let msg = match portability_of(json) {
                Ok(v) => panic!("{json}: expected an error, got {v:?}"),
                Err(e) => e.to_string(),
            };
            assert!(
                msg.contains("record 0: key \"portability\""),
                "{json}: {msg}"
            );
            assert!(msg.contains(want), "{json}: {msg} should contain {want}");
        }
    }

    #[test]
    fn skip_rule() {
        let text = r#"[
          {"src": "Q0?", "alt": "A0", "answers": ["x"]},
          {"src": "Q1?", "alt": "", "answers": ["x"]},
          {"src": "  ", "alt": "A2", "answers": ["x"]},
          {"src": "Q3?", "alt": " \t", "answers": ["x"]}
        ]"#;
        let (recs, report) = parse(text, DatasetKind::Zsre).unwrap();
        assert_eq!(recs.len(), 1);
        assert_eq!(recs[0].prompt, "Q0?");
        let idx: Vec<usize> = report.skipped.iter().map(|(i, _)| *i).collect();
        assert_eq!(idx, vec![1, 2, 3]);
        assert!(
            report.skipped[0].1.contains("\"alt\""),
            "{:?}",
            report.skipped
        );
        assert!(
            report.skipped[1].1.contains("\"src\""),
            "{:?}",
            report.skipped
        );

        let cf = r#"[{"prompt": "p", "target_new": ""}, {"prompt": "p", "target_new": "t"}]"#;
        let (recs, report) = parse(cf, DatasetKind::Counterfact).unwrap();
        assert_eq!(recs.len(), 1);
        assert_eq!(
            report.skipped,
            vec![(0, "empty \"target_new\" (target)".to_string())]
        );
    }

    #[test]
    fn all_skipped_is_an_error() {
        let msg = err_msg(
            r#"[{"src": "Q", "alt": ""}, {"src": "", "alt": "A"}]"#,
            DatasetKind::Zsre,
        );
        assert!(msg.contains("no usable records"), "{msg}");
        assert!(msg.contains("record 0"), "{msg}");
    }

    #[test]
    fn file_level_errors() {
        let msg = err_msg(
            "[{\"prompt\": \"p\",\n  \"target_new\": }]",
            DatasetKind::Counterfact,
        );
        assert!(
            msg.contains("malformed JSON") && msg.contains("line 2 column"),
            "{msg}"
        );

        let msg = err_msg(r#"{"prompt": "p"}"#, DatasetKind::Counterfact);
        assert!(
            msg.contains("top level must be a JSON array") && msg.contains("an object"),
            "{msg}"
        );

        let msg = err_msg("  []  ", DatasetKind::Requests);
        assert!(msg.contains("no records"), "{msg}");
    }

    #[test]
    fn record_level_errors_name_index_and_key() {
        let ok = r#"{"prompt": "p", "target_new": "t"}"#;
        let cases = [
            (
                format!("[{ok}, {ok}, \"x\"]"),
                DatasetKind::Counterfact,
                "record 2: expected a JSON object, got a string",
            ),
            (
                format!("[{ok}, {{\"prompt\": \"p\"}}]"),
                DatasetKind::Counterfact,
                r#"record 1: missing key "target_new""#,
            ),
            (
                format!("[{ok}, {{\"target_new\": \"t\"}}]"),
                DatasetKind::Requests,
                r#"record 1: missing key "prompt""#,
            ),
            (
                format!("[{ok}, {ok}, {{\"prompt\": \"p\", \"target_new\": 3}}]"),
                DatasetKind::Counterfact,
                r#"record 2: key "target_new" must be a string, got a number"#,
            ),
            (
                r#"[{"prompt": "p", "target_new": "t", "locality_prompt": ["x"]}]"#.to_string(),
                DatasetKind::Requests,
                r#"record 0: key "locality_prompt" must be a string or null, got an array"#,
            ),
            (
                r#"[{"src": "q", "answers": ["a"]}]"#.to_string(),
                DatasetKind::Zsre,
                r#"record 0: missing key "alt""#,
            ),
            (
                r#"[{"src": "q", "alt": "a", "answers": "a"}]"#.to_string(),
                DatasetKind::Zsre,
                r#"record 0: key "answers" must be a list of strings, got a string"#,
            ),
            (
                r#"[{"src": "q", "alt": "a", "answers": [1]}]"#.to_string(),
                DatasetKind::Zsre,
                r#"record 0: key "answers" must be a list of strings"#,
            ),
            // Type errors are reported even on records the skip rule would drop.
            (
                r#"[{"src": "q", "alt": "", "loc": 4}]"#.to_string(),
                DatasetKind::Zsre,
                r#"record 0: key "loc" must be a string or null"#,
            ),
            // A zsRE file read as CounterFact fails loudly on the first record.
            (
                ZSRE.to_string(),
                DatasetKind::Counterfact,
                r#"record 0: missing key "prompt""#,
            ),
        ];
        for (text, kind, want) in cases {
            let msg = err_msg(&text, kind);
            assert!(msg.contains(want), "{msg:?} should contain {want:?}");
        }
    }

    #[test]
    fn missing_file_is_named() {
        let path = Path::new("/nonexistent/dir/edits.json");
        match load_records(path, DatasetKind::Requests) {
            Err(e @ Error::File { .. }) => {
                assert!(e.to_string().contains("/nonexistent/dir/edits.json: file not found"), "{e}")
            }
            other => panic!("expected a file error naming it, got {other:?}"),
        }
    }

    #[test]
    fn kind_from_str() {
        assert_eq!("zsre".parse::<DatasetKind>().unwrap(), DatasetKind::Zsre);
        assert_eq!(
            "CounterFact".parse::<DatasetKind>().unwrap(),
            DatasetKind::Counterfact
        );
        assert_eq!(
            " requests ".parse::<DatasetKind>().unwrap(),
            DatasetKind::Requests
        );
        for k in DatasetKind::ALL {
            assert_eq!(k.to_string().parse::<DatasetKind>().unwrap(), k);
            assert_eq!(serde_json::to_string(&k).unwrap(), format!("\"{k}\""));
        }
        let msg = "mquake".parse::<DatasetKind>().unwrap_err().to_string();
        assert!(msg.contains("\"mquake\""), "{msg}");
        assert!(msg.contains("zsre, counterfact, requests"), "{msg}");
    }

    #[test]
    fn split_holdout_takes_the_tail() {
        let recs: Vec<EditRecord> = (0..5)
            .map(|i| EditRecord {
                prompt: format!("p{i}"),
                target_new: "t".into(),
                subject: None,
                ground_truth: None,
                rephrase: None,
                locality_prompt: None,
                locality_ground_truth: None,
                portability: vec![],
            })
            .collect();
        let (train, held) = split_holdout(recs.clone(), 2);
        assert_eq!(train, recs[..3]);
        assert_eq!(held, recs[3..]);
        let (train, held) = split_holdout(recs.clone(), 0);
        assert_eq!((train.len(), held.len()), (5, 0));
        let (train, held) = split_holdout(recs, 9);
        assert_eq!((train.len(), held.len()), (0, 5));
    }
}
