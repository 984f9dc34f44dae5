//! Tokenised, right-padded batches whose labels mark the positions that are scored.
use std::collections::HashSet;

use tch::{Device, Tensor};

use crate::model::{Boundary, ForwardInput, Tokenizer};
use crate::Result;

/// One prompt + answer, tokenised as one text.
#[derive(Debug, Clone)]
pub struct Example {
    pub ids: Vec<i64>,
    /// Index of the first answer token in `ids`.
    pub answer_start: usize,
    /// The image shown at the example's `<|image_pad|>` run (vision-language models).
    pub image: Option<ImageRef>,
}

/// An image of an example: its file and the grid `[t, h, w]` (in patches) it is cut into,
/// which fixes how many `<|image_pad|>` tokens it takes. Its pixels and features are read
/// when a batch is built ([`super::multimodal::StepImages`]), not kept with the example.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ImageRef {
    pub path: std::path::PathBuf,
    pub grid: [i64; 3],
}

impl Example {
    pub fn new(tok: &Tokenizer, prompt: &str, answer: &str) -> Result<Self> {
        let (ids, answer_start) = tok.encode_continuation(prompt, answer)?;
        Ok(Self { ids, answer_start, image: None })
    }

    pub fn answer(&self) -> &[i64] {
        &self.ids[self.answer_start..]
    }
}

/// The three batches MEND needs for one edit, as EasyEdit builds them.
#[derive(Debug, Clone)]
pub struct EditExample {
    /// Prompt + new target: the example the editor sees.
    pub inner: Example,
    /// Rephrased prompt + new target: where the edit must generalise (falls back to the
    /// prompt itself when a record has no rephrase, so training still has an outer example).
    pub outer: Example,
    /// Whether `outer` is a real rephrase: generalisation is only measured when it is.
    pub rephrased: bool,
    /// An unrelated prompt + its answer: what the edit must leave alone.
    pub loc: Option<Example>,
    /// Questions whose answers should follow from the edit (EasyEdit's portability).
    pub portability: Vec<Example>,
    /// Multimodal only: the edit prompt shown with the rephrase image (EasyEdit's
    /// `edit_outer_image`), scored like `outer`.
    pub outer_image: Option<Example>,
    /// Multimodal only: an unrelated image and question (EasyEdit's `loc_image`), kept
    /// like `loc`.
    pub loc_image: Option<Example>,
    /// Meta-training only: more locality prompts scored with `loc` in the same loss
    /// (`loc_neighbours`, [`add_answer_neighbours`]); empty elsewhere.
    pub neighbours: Vec<Example>,
}

/// Gives each example of `examples` (a training split) as `neighbours` the locality
/// prompts of up to `k` others whose locality answer (its token ids) is the same as its
/// own: the next ones with that answer, in file order, wrapping round. On CounterFact a
/// record's locality answer is its old answer, so these are prompts about other subjects
/// that the unedited model answers as the edited fact did, the neighbours an edit most
/// often breaks. Text prompts only; returns how many were given.
pub fn add_answer_neighbours(examples: &mut [EditExample], k: usize) -> usize {
    let mut groups: std::collections::HashMap<&[i64], Vec<usize>> = std::collections::HashMap::new();
    for (i, e) in examples.iter().enumerate() {
        if let Some(l) = e.loc.as_ref().filter(|l| l.image.is_none()) {
            groups.entry(l.answer()).or_default().push(i);
        }
    }
    let mut given: Vec<(usize, Vec<Example>)> = Vec::new();
    for members in groups.values() {
        let n = members.len();
        for (pos, &i) in members.iter().enumerate() {
            let picked = (1..n).take(k).filter_map(|d| examples[members[(pos + d) % n]].loc.clone()).collect();
            given.push((i, picked));
        }
    }
    let mut total = 0;
    for (i, picked) in given {
        total += picked.len();
        examples[i].neighbours = picked;
    }
    total
}

/// Token ids `[B, T]`, padding mask `[B, T]`, and `targets[b, t]`: the token position `t`
/// must predict, or -100 where nothing is scored. Targets are already shifted, so the
/// scored positions are exactly those whose logits the LM head needs to compute.
#[derive(Debug)]
pub struct TokenBatch {
    pub input_ids: Tensor,
    pub attention_mask: Tensor,
    pub targets: Tensor,
    /// `targets != -100`, bool `[B, T]`.
    pub keep: Tensor,
    /// Whether any row is padded (an all-ones mask lets attention take its causal fast path).
    pub padded: bool,
    /// M-RoPE position ids `[3, B, T]` when a row shows an image (vision-language models).
    pub position_ids: Option<Tensor>,
    /// Image features `[N, D]` for the batch's `<|image_pad|>` tokens, in row-major order:
    /// an input like the ids, computed once per image by the frozen tower.
    pub image_embeds: Option<Tensor>,
    /// The batch's layer-split boundary activations once computed (see
    /// [`TokenBatch::prefix`]): a batch lives for one micro-step or one evaluated edit, and
    /// every forward of it in that time starts from them.
    pub prefix: PrefixCache,
}

/// Which engine and side a cached [`Boundary`] belongs to: the block it enters, the
/// identity of the engine's crossing (its layer split's, else its mover; one per engine),
/// so a batch used with two engines never reads the other's activations, and whether it
/// is the replica placement's copy on the sub-device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PrefixKey {
    pub at: usize,
    pub crossing: usize,
    pub sub: bool,
}

/// The cached [`Boundary`]s of a batch with the keys they were computed under (one per
/// side: the replica placement keeps the main device's and the sub-device's copy).
#[derive(Debug, Default)]
pub struct PrefixCache(std::cell::RefCell<Vec<(PrefixKey, Boundary)>>);

impl PrefixCache {
    /// The cached boundary for `key`, or the one `compute` makes (then cached, replacing
    /// one of another engine).
    pub fn get_or(&self, key: PrefixKey, compute: impl FnOnce() -> Result<Boundary>) -> Result<Boundary> {
        if let Some(b) = self.get(key) {
            return Ok(b);
        }
        let b = compute()?;
        self.set(key, b.shallow_clone());
        Ok(b)
    }

    /// Caches `b` for `key` (a boundary cut from a larger batch's, see [`Boundary::narrow`]),
    /// dropping those of other engines.
    pub fn set(&self, key: PrefixKey, b: Boundary) {
        let mut v = self.0.borrow_mut();
        v.retain(|(k, _)| k.crossing == key.crossing && k.at == key.at && k.sub != key.sub);
        v.push((key, b));
    }

    /// The cached boundary, if one is cached under `key`.
    pub fn get(&self, key: PrefixKey) -> Option<Boundary> {
        self.0.borrow().iter().find(|(k, _)| *k == key).map(|(_, b)| b.shallow_clone())
    }
}

pub const IGNORE: i64 = -100;

impl TokenBatch {
    /// Right-pads `examples` and scores the answer tokens of each.
    ///
    /// The last token of an example is only ever a target: no scored position reads it
    /// (attention is causal), so it is left out of the input, which saves one row of every
    /// matmul and never changes a scored logit.
    pub fn collate(examples: &[&Example], pad_id: i64, device: Device) -> Self {
        let input_len = |e: &Example| e.ids.len().saturating_sub(1).max(1).min(e.ids.len());
        let t = examples.iter().map(|e| input_len(e)).max().unwrap_or(1).max(1);
        let b = examples.len();
        let mut ids = vec![pad_id; b * t];
        let mut mask = vec![0i64; b * t];
        let mut targets = vec![IGNORE; b * t];
        for (i, e) in examples.iter().enumerate() {
            let (row, n) = (i * t, input_len(e));
            ids[row..row + n].copy_from_slice(&e.ids[..n]);
            mask[row..row + n].fill(1);
            for pos in e.answer_start.max(1)..e.ids.len() {
                targets[row + pos - 1] = e.ids[pos];
            }
        }
        let shape = [b as i64, t as i64];
        let mk = |v: &[i64]| Tensor::from_slice(v).reshape(shape).to_device(device);
        let padded = mask.contains(&0);
        let targets = mk(&targets);
        Self {
            input_ids: mk(&ids),
            attention_mask: mk(&mask),
            keep: targets.ne(IGNORE),
            targets,
            padded,
            position_ids: None,
            image_embeds: None,
            prefix: PrefixCache::default(),
        }
    }

    /// The forward input for this batch: logits only where a target is scored.
    pub fn forward_input<'a>(&'a self, capture: &'a HashSet<String>) -> ForwardInput<'a> {
        ForwardInput {
            input_ids: &self.input_ids,
            attention_mask: self.padded.then_some(&self.attention_mask),
            keep: Some(&self.keep),
            capture,
            position_ids: self.position_ids.as_ref(),
            image_embeds: self.image_embeds.as_ref(),
            entry: None,
            full_last_block: false,
        }
    }

    /// Targets of the kept positions, `[N]`, in the row-major order the forward returns them.
    pub fn kept_targets(&self) -> Tensor {
        self.targets.masked_select(&self.keep)
    }

    /// Batch row of each kept position, `[N]`.
    pub fn kept_rows(&self) -> Tensor {
        self.keep.nonzero().select(1, 0)
    }

    pub fn batch_size(&self) -> i64 {
        self.input_ids.size()[0]
    }

    /// The text examples this batch was collated from ([`TokenBatch::collate`] drops each
    /// example's last token from the input, which is the target at its last position), so
    /// that what a batch asked for can be remembered and collated again with others.
    /// `None` when the batch shows images (their features are not kept per example).
    pub fn examples(&self) -> Option<Vec<Example>> {
        if self.shows_images() {
            return None;
        }
        let cpu = |t: &Tensor| Vec::<Vec<i64>>::try_from(t.to_kind(tch::Kind::Int64).to_device(Device::Cpu)).ok();
        let (ids, mask, targets) = (cpu(&self.input_ids)?, cpu(&self.attention_mask)?, cpu(&self.targets)?);
        ids.iter()
            .zip(&mask)
            .zip(&targets)
            .map(|((ids, mask), targets)| {
                let n = mask.iter().filter(|&&m| m != 0).count();
                let first = targets.iter().position(|&t| t != IGNORE)?;
                let mut full = ids[..n].to_vec();
                full.push(*targets.get(n.checked_sub(1)?)?);
                Some(Example { ids: full, answer_start: first + 1, image: None })
            })
            .collect()
    }

    /// Whether a row shows an image (vision-language models).
    pub fn shows_images(&self) -> bool {
        self.image_embeds.is_some() || self.position_ids.is_some()
    }

    /// The batch of this one's rows `rows` (in that order, repeats allowed), without the
    /// cached boundary ([`crate::placed::Placed::share_boundary_rows`] gives it its slice).
    /// `None` when the batch shows images (their features are not kept per row).
    pub fn rows(&self, rows: &[i64]) -> Option<Self> {
        if self.shows_images() {
            return None;
        }
        let idx = Tensor::from_slice(rows).to_device(self.input_ids.device());
        let pick = |t: &Tensor| t.index_select(0, &idx);
        Some(Self {
            input_ids: pick(&self.input_ids),
            attention_mask: pick(&self.attention_mask),
            targets: pick(&self.targets),
            keep: pick(&self.keep),
            padded: self.padded,
            position_ids: None,
            image_embeds: None,
            prefix: PrefixCache::default(),
        })
    }

    pub fn to_device(&self, device: Device) -> Self {
        Self {
            input_ids: self.input_ids.to_device(device),
            attention_mask: self.attention_mask.to_device(device),
            targets: self.targets.to_device(device),
            keep: self.keep.to_device(device),
            padded: self.padded,
            position_ids: self.position_ids.as_ref().map(|t| t.to_device(device)),
            image_embeds: self.image_embeds.as_ref().map(|t| t.to_device(device)),
            prefix: PrefixCache::default(),
        }
    }

    /// New handles to the same tensors (for another thread), without the cached boundary.
    pub fn shallow_clone(&self) -> Self {
        let c = |t: &Tensor| t.shallow_clone();
        Self {
            input_ids: c(&self.input_ids),
            attention_mask: c(&self.attention_mask),
            targets: c(&self.targets),
            keep: c(&self.keep),
            padded: self.padded,
            position_ids: self.position_ids.as_ref().map(c),
            image_embeds: self.image_embeds.as_ref().map(c),
            prefix: PrefixCache::default(),
        }
    }

    /// Bytes the batch occupies (what the mover transfers).
    pub fn nbytes(&self) -> u64 {
        [Some(&self.input_ids), Some(&self.attention_mask), Some(&self.targets), self.position_ids.as_ref(), self.image_embeds.as_ref()]
            .into_iter()
            .flatten()
            .map(|t| (t.numel() * t.kind().elt_size_in_bytes()) as u64)
            .sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn example(loc: Option<(&[i64], usize)>) -> EditExample {
        let ex = |ids: &[i64], answer_start| Example { ids: ids.to_vec(), answer_start, image: None };
        EditExample {
            inner: ex(&[1, 2], 1),
            outer: ex(&[1, 2], 1),
            rephrased: false,
            loc: loc.map(|(ids, a)| ex(ids, a)),
            portability: Vec::new(),
            outer_image: None,
            loc_image: None,
            neighbours: Vec::new(),
        }
    }

    /// Neighbours share the answer's token ids (not the prompt's), never the example itself,
    /// at most `k`, the next ones in file order wrapping round.
    #[test]
    fn neighbours_are_the_next_prompts_with_the_same_answer() {
        let mut ex = vec![
            example(Some((&[10, 7], 1))),
            example(Some((&[11, 8], 1))),
            example(Some((&[12, 13, 7], 1))), // answer [13, 7]: not [7]
            example(Some((&[14, 7], 1))),
            example(None),
            example(Some((&[15, 7], 1))),
        ];
        assert_eq!(add_answer_neighbours(&mut ex, 2), 6);
        let firsts = |e: &EditExample| e.neighbours.iter().map(|n| n.ids[0]).collect::<Vec<_>>();
        assert_eq!(firsts(&ex[0]), [14, 15]);
        assert_eq!(firsts(&ex[3]), [15, 10]);
        assert_eq!(firsts(&ex[5]), [10, 14]);
        assert!(ex[1].neighbours.is_empty() && ex[2].neighbours.is_empty() && ex[4].neighbours.is_empty());
        assert_eq!(add_answer_neighbours(&mut ex, 10), 6, "three with one answer: two each at most");
    }
}
