//! `tokenizer.json` and `tokenizer_config.json` rebuilt from a GGUF's `tokenizer.ggml.*`
//! metadata, as transformers 5 builds its tokenizer from the file
//! (`integrations/gguf/gguf_tokenizer_mapping.py`) and then saves it, so that the token ids
//! are transformers' own.
//!
//! `tokenizer.ggml.model = "gpt2"` (byte-level BPE): the vocabulary (tokens written outside
//! the byte alphabet respelled through it), the file's merges, a ByteLevel pre-tokenizer
//! (or, for a `tokenizer.ggml.pre` transformers knows, its split regex then ByteLevel
//! without one), a ByteLevel decoder; the tokens the file marks control (type 3) are special
//! added tokens, the user-defined ones (type 4) plain added tokens; a TemplateProcessing
//! post-processor that adds BOS / EOS when the file's `add_bos_token` / `add_eos_token` say so.
//!
//! `tokenizer.ggml.model = "llama"` (SentencePiece BPE): the tokens as spelled, the file's
//! merges or, without them, the merges transformers derives from the scores
//! (`generate_merges`), a Metaspace pre-tokenizer (`▁` before the first word), byte
//! fallback, and BOS added unless the file says otherwise.
use std::collections::BTreeMap;

use serde_json::{json, Map, Value as Json};

use super::gguf::{Gguf, Value};
use crate::Result;

/// `integrations/gguf/gguf_tokenizer_mapping.py`'s split regexes, by `tokenizer.ggml.pre`.
const LLAMA3_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const QWEN2_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const TEKKEN_SPLIT: &str = r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const GPT4O_SPLIT: &str = r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+";

fn split_regex(pre: &str) -> Option<&'static str> {
    Some(match pre {
        "llama3" | "llama-v3" | "llama-bpe" | "falcon3" | "falcon-h1" | "pixtral" | "midm-2.0" | "lfm2" | "jina-v5-nano" | "dbrx" | "smaug-bpe" => {
            LLAMA3_SPLIT
        }
        "tekken" => TEKKEN_SPLIT,
        "qwen2" | "deepseek-r1-qwen" | "kormo" | "f2llmv2" | "megrez" => QWEN2_SPLIT,
        "gpt-4o" | "llama4" | "kanana2" | "talkie" | "minimax-m2" => GPT4O_SPLIT,
        _ => return None,
    })
}

/// GPT-2's `bytes_to_unicode`: each byte's printable stand-in (the printable Latin-1 bytes
/// themselves, the others from U+0100 on, in byte order).
pub fn byte_alphabet() -> [char; 256] {
    let mut table = ['\0'; 256];
    let mut next = 256u32;
    for b in 0..256u32 {
        let printable = (33..=126).contains(&b) || (161..=172).contains(&b) || (174..=255).contains(&b);
        table[b as usize] = if printable {
            char::from_u32(b).unwrap_or('\0')
        } else {
            next += 1;
            char::from_u32(next - 1).unwrap_or('\0')
        };
    }
    table
}

/// The files a tokenizer is written as.
pub struct TokenizerFiles {
    pub tokenizer_json: Json,
    pub tokenizer_config: Json,
    pub chat_template: Option<String>,
}

fn strings<'a>(g: &'a Gguf, key: &str) -> Result<Option<Vec<&'a str>>> {
    let Some(v) = g.get(key) else { return Ok(None) };
    let arr = v.as_array().ok_or_else(|| g.error(format!("{key} is not an array")))?;
    arr.iter().map(|s| s.as_str().ok_or_else(|| g.error(format!("{key} holds a non-string")))).collect::<Result<Vec<_>>>().map(Some)
}

/// The tokens of the file's vocabulary (`tokenizer.ggml.tokens`).
pub fn tokens(g: &Gguf) -> Result<Vec<&str>> {
    strings(g, "tokenizer.ggml.tokens")?.ok_or_else(|| g.error("no tokenizer.ggml.tokens: the file carries no tokenizer"))
}

/// Builds the tokenizer files from the file's metadata.
pub fn build(g: &Gguf) -> Result<TokenizerFiles> {
    let model = g.get("tokenizer.ggml.model").and_then(Value::as_str).ok_or_else(|| g.error("no tokenizer.ggml.model (string)"))?;
    let byte_level = match model {
        "gpt2" => true,
        "llama" => false,
        other => {
            return Err(g.error(format!(
                "tokenizer model {other:?} is not supported (byte-level BPE \"gpt2\" and SentencePiece BPE \"llama\" are)"
            )))
        }
    };
    let tokens = tokens(g)?;
    let file_merges = strings(g, "tokenizer.ggml.merges")?;
    // Decoded only once its length is known to be the vocabulary's.
    let per_token = |key: &str| -> Result<Option<Vec<f64>>> {
        let Some(v) = g.get(key) else { return Ok(None) };
        match (v.count(), v.numbers()) {
            (Some(n), Some(values)) if n == tokens.len() => Ok(Some(values)),
            (Some(n), Some(_)) => Err(g.error(format!("{key} has {n} entries for {} tokens", tokens.len()))),
            _ => Err(g.error(format!("{key} is not an array of numbers"))),
        }
    };
    let types: Vec<i64> = per_token("tokenizer.ggml.token_type")?.unwrap_or_default().into_iter().map(|t| t as i64).collect();
    let id = |key: &str| -> Result<Option<usize>> {
        match g.get(&format!("tokenizer.ggml.{key}")) {
            None => Ok(None),
            Some(v) => match v.as_i64() {
                Some(i) if i >= 0 && (i as usize) < tokens.len() => Ok(Some(i as usize)),
                _ => Err(g.error(format!("tokenizer.ggml.{key} {v:?} is not a token id (the vocabulary has {})", tokens.len()))),
            },
        }
    };
    let flag = |key: &str| g.get(&format!("tokenizer.ggml.{key}")).and_then(Value::as_bool);

    // The vocabulary. Byte-level: a token already spelled in the byte alphabet is kept, any
    // other is respelled from its UTF-8 bytes (transformers' `byte_level_tokenizer`).
    // SentencePiece: as the file spells it. A later token with the same spelling wins, as in
    // the Python dict.
    let alphabet = byte_alphabet();
    let in_alphabet = |t: &str| !byte_level || t.chars().all(|c| alphabet.contains(&c));
    let mut vocab = Map::new();
    for (i, t) in tokens.iter().enumerate() {
        let spelled = if in_alphabet(t) { t.to_string() } else { t.bytes().map(|b| alphabet[b as usize]).collect() };
        vocab.insert(spelled, json!(i));
    }
    let merges: Vec<Json> = match file_merges {
        Some(m) => m
            .iter()
            .map(|m| m.split_once(' ').map(|(a, b)| json!([a, b])).ok_or_else(|| g.error(format!("merge {m:?} is not two tokens"))))
            .collect::<Result<_>>()?,
        None if byte_level => return Err(g.error("no tokenizer.ggml.merges: a byte-level BPE needs them")),
        None => {
            let scores = per_token("tokenizer.ggml.scores")?
                .ok_or_else(|| g.error("no tokenizer.ggml.merges, and no tokenizer.ggml.scores to derive them from"))?;
            generate_merges(&tokens, &scores).into_iter().map(|(a, b)| json!([a, b])).collect()
        }
    };

    // Added tokens, by id: control tokens (3) are special (in a byte-level vocabulary one
    // spelled outside the byte alphabet is a llama.cpp mislabel transformers skips);
    // user-defined ones (4) are plain added tokens.
    let mut added: BTreeMap<usize, (&str, bool)> = BTreeMap::new();
    for (i, (t, ty)) in tokens.iter().zip(&types).enumerate() {
        match ty {
            3 if in_alphabet(t) => {
                added.insert(i, (t, true));
            }
            4 if vocab.contains_key(*t) => {
                added.insert(i, (t, false));
            }
            _ => {}
        }
    }
    let names = [("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"), ("unk_token", "unknown_token_id"), ("pad_token", "padding_token_id")];
    let mut special = Map::new();
    for (name, key) in names {
        if let Some(i) = id(key)? {
            special.insert(name.to_string(), json!(tokens[i]));
            // transformers adds the named special tokens as special added tokens.
            added.entry(i).or_insert((tokens[i], true)).1 = true;
        }
    }
    let added_tokens: Vec<Json> = added
        .iter()
        .map(|(i, (t, sp))| json!({"id": i, "content": t, "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": sp}))
        .collect();

    let pre = g.get("tokenizer.ggml.pre").and_then(Value::as_str).unwrap_or("");
    let pre_tokenizer = match split_regex(pre) {
        // transformers' LlamaTokenizer: a "▁" before the first word, none elsewhere.
        _ if !byte_level => json!({"type": "Metaspace", "replacement": "\u{2581}", "prepend_scheme": "first", "split": false}),
        Some(re) => json!({"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": re}, "behavior": "Isolated", "invert": false},
            {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": false}
        ]}),
        None => json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true}),
    };

    // A SentencePiece vocabulary that does not say adds BOS (llama.cpp's default).
    let add_bos = flag("add_bos_token").unwrap_or(!byte_level);
    let bos = id("bos_token_id")?.filter(|_| add_bos);
    let eos = id("eos_token_id")?.filter(|_| flag("add_eos_token") == Some(true));
    let post_processor = template(&tokens, bos, eos);

    let (decoder, model) = if byte_level {
        (
            json!({"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true}),
            json!({
                "type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": "", "end_of_word_suffix": "",
                "fuse_unk": false, "byte_fallback": false, "ignore_merges": false, "vocab": vocab, "merges": merges
            }),
        )
    } else {
        (
            json!({"type": "Sequence", "decoders": [
                {"type": "Replace", "pattern": {"String": "\u{2581}"}, "content": " "},
                {"type": "ByteFallback"},
                {"type": "Fuse"},
                {"type": "Strip", "content": " ", "start": 1, "stop": 0}
            ]}),
            json!({
                "type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null, "end_of_word_suffix": null,
                "fuse_unk": true, "byte_fallback": true, "ignore_merges": false, "vocab": vocab, "merges": merges
            }),
        )
    };
    let tokenizer_json = json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added_tokens,
        "normalizer": null,
        "pre_tokenizer": pre_tokenizer,
        "post_processor": post_processor,
        "decoder": decoder,
        "model": model
    });

    let chat_template = match g.get("tokenizer.chat_template") {
        None => None,
        Some(v) => Some(v.as_str().ok_or_else(|| g.error("tokenizer.chat_template is not a string"))?.to_string()),
    };
    let mut config = Map::new();
    config.insert("backend".into(), json!("tokenizers"));
    config.insert("tokenizer_class".into(), json!("TokenizersBackend"));
    if flag("add_bos_token").is_some() || !byte_level {
        config.insert("add_bos_token".into(), json!(add_bos));
    }
    if let Some(b) = flag("add_eos_token") {
        config.insert("add_eos_token".into(), json!(b));
    }
    for (name, _) in names {
        config.insert(name.into(), special.get(name).cloned().unwrap_or(Json::Null));
    }
    config.insert("model_max_length".into(), json!(1_000_000_000_000_000_019_884_624_838_656f64));
    if let Some(t) = &chat_template {
        config.insert("chat_template".into(), json!(t));
    }
    Ok(TokenizerFiles { tokenizer_json, tokenizer_config: Json::Object(config), chat_template })
}

/// transformers' `generate_merges` for a SentencePiece vocabulary without merges: every
/// split of a token into two tokens of the vocabulary (per token ordered by the halves'
/// ids), then all of them ordered by the token's score, then the halves' lengths in
/// characters, highest first (a stable sort, so ties keep that order).
fn generate_merges(tokens: &[&str], scores: &[f64]) -> Vec<(String, String)> {
    let mut id: std::collections::HashMap<&str, usize> = std::collections::HashMap::new();
    for (i, t) in tokens.iter().enumerate() {
        id.insert(t, i);
    }
    // The Python dict of scores: each token at its first position, with its last score.
    let mut order: Vec<&str> = Vec::new();
    let mut score: std::collections::HashMap<&str, f64> = std::collections::HashMap::new();
    for (t, &s) in tokens.iter().zip(scores) {
        if score.insert(t, s).is_none() {
            order.push(t);
        }
    }
    let mut merges: Vec<(&str, &str, f64)> = Vec::new();
    for t in order {
        let s = score[t];
        let mut local: Vec<(&str, &str, f64)> =
            t.char_indices().skip(1).map(|(at, _)| t.split_at(at)).filter(|(l, r)| id.contains_key(l) && id.contains_key(r)).map(|(l, r)| (l, r, s)).collect();
        local.sort_by_key(|(l, r, _)| (id[l], id[r]));
        merges.extend(local);
    }
    let key = |m: &(&str, &str, f64)| (m.2, m.0.chars().count(), m.1.chars().count());
    merges.sort_by(|a, b| {
        let (ka, kb) = (key(a), key(b));
        kb.0.partial_cmp(&ka.0).unwrap_or(std::cmp::Ordering::Equal).then(kb.1.cmp(&ka.1)).then(kb.2.cmp(&ka.2))
    });
    merges.into_iter().map(|(l, r, _)| (l.to_string(), r.to_string())).collect()
}

/// transformers' `update_post_processor`: `[bos] $A [eos]` (and `… $B:1 …` for pairs).
fn template(tokens: &[&str], bos: Option<usize>, eos: Option<usize>) -> Json {
    let special = |i: usize, type_id: u32| json!({"SpecialToken": {"id": tokens[i], "type_id": type_id}});
    let seq = |s: &str, type_id: u32| json!({"Sequence": {"id": s, "type_id": type_id}});
    let mut single = Vec::new();
    let mut pair = Vec::new();
    if let Some(b) = bos {
        single.push(special(b, 0));
        pair.push(special(b, 0));
    }
    single.push(seq("A", 0));
    pair.push(seq("A", 0));
    if let Some(e) = eos {
        single.push(special(e, 0));
        pair.push(special(e, 0));
    }
    if let Some(b) = bos {
        pair.push(special(b, 1));
    }
    pair.push(seq("B", 1));
    if let Some(e) = eos {
        pair.push(special(e, 1));
    }
    let mut specials = Map::new();
    for i in [bos, eos].into_iter().flatten() {
        specials.insert(tokens[i].to_string(), json!({"id": tokens[i], "ids": [i], "tokens": [tokens[i]]}));
    }
    json!({"type": "TemplateProcessing", "single": single, "pair": pair, "special_tokens": specials})
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_alphabet_is_gpt2s() {
        let a = byte_alphabet();
        assert_eq!(a[b' ' as usize], 'Ġ');
        assert_eq!(a[b'\n' as usize], 'Ċ');
        assert_eq!(a[b'A' as usize], 'A');
        assert_eq!(a[0], 'Ā');
        assert_eq!(a[173], 'Ń');
        let set: std::collections::HashSet<char> = a.iter().copied().collect();
        assert_eq!(set.len(), 256);
    }
}
