//! `tokenizer.json` through the Hugging Face `tokenizers` crate.
use std::path::{Path, PathBuf};

use crate::{Error, Result};

#[derive(Clone)]
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    path: PathBuf,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer").field("path", &self.path).finish()
    }
}

impl Tokenizer {
    pub fn from_file(path: &Path) -> Result<Self> {
        if !path.exists() {
            return Err(Error::file(path, "tokenizer file not found"));
        }
        // Read as every user's file is (a regular file, bounded), then parsed.
        let bytes = crate::io::read_regular_capped(path, crate::io::MAX_TEXT_BYTES)?;
        let inner = tokenizers::Tokenizer::from_bytes(&bytes)
            .map_err(|e| Error::file(path, format!("not a valid tokenizer.json: {e}")))?;
        Ok(Self { inner, path: path.to_path_buf() })
    }

    /// Token ids of `text`, with the special tokens the tokenizer adds (LLaMA's BOS).
    pub fn encode(&self, text: &str) -> Result<Vec<i64>> {
        let enc = self
            .inner
            .encode(text, true)
            .map_err(|e| Error::input(format!("cannot tokenise {text:?}: {e}")))?;
        Ok(enc.get_ids().iter().map(|&i| i as i64).collect())
    }

    /// Tokenises `prompt` followed by `target` as one text and says where the target
    /// starts. The target is scored as the continuation of the prompt (" Paris" after
    /// "The capital of France is"), not as a separately tokenised word: tokenising it
    /// alone gives different ids and misaligned labels.
    pub fn encode_continuation(&self, prompt: &str, target: &str) -> Result<(Vec<i64>, usize)> {
        let target = target.trim();
        if target.is_empty() {
            return Err(Error::input(format!("empty target for prompt {prompt:?}")));
        }
        let joiner = if prompt.is_empty() || prompt.ends_with(char::is_whitespace) { "" } else { " " };
        let full = self.encode(&format!("{prompt}{joiner}{target}"))?;
        let prompt_ids = self.encode(prompt)?;
        // Where BPE merges across the boundary, the target starts at the first difference.
        let common = prompt_ids.iter().zip(&full).take_while(|(a, b)| a == b).count();
        if common >= full.len() {
            return Err(Error::input(format!("target {target:?} adds no token after prompt {prompt:?}")));
        }
        Ok((full, common))
    }

    pub fn decode(&self, ids: &[i64]) -> Result<String> {
        let ids: Vec<u32> = ids.iter().map(|&i| i as u32).collect();
        self.inner.decode(&ids, true).map_err(|e| Error::input(format!("cannot decode {ids:?}: {e}")))
    }

    /// The padding id: the tokenizer's pad token, else its EOS-like token, else 0.
    /// Padded positions are masked, so the choice only has to be a valid id.
    pub fn pad_id(&self) -> i64 {
        ["<pad>", "<|endoftext|>", "</s>", "<eos>", "<unk>"]
            .iter()
            .find_map(|t| self.inner.token_to_id(t))
            .map(|i| i as i64)
            .unwrap_or(0)
    }

    /// The id of a whole token (a special token such as `<|image_pad|>`), if it has one.
    pub fn special_id(&self, token: &str) -> Option<i64> {
        self.inner.token_to_id(token).map(i64::from)
    }

    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// The first special token (`<|image_pad|>`, `<|im_end|>`, `<|endoftext|>`, ...) that
    /// `text` spells out, if any: encoded, it would be that token, not text.
    pub fn special_in(&self, text: &str) -> Option<String> {
        let decoder = self.inner.get_added_tokens_decoder();
        let mut specials: Vec<&str> = decoder.values().filter(|t| t.special && !t.content.is_empty()).map(|t| t.content.as_str()).collect();
        specials.sort_unstable();
        specials.into_iter().find(|s| text.contains(s)).map(String::from)
    }

    pub fn path(&self) -> &Path {
        &self.path
    }
}
