//! Pretraining a tiny GPT-2 from scratch on a text corpus (the embedded default's model):
//! a byte-level BPE tokenizer trained on the corpus, then next-token training with Adam.
//! The result is a plain Hugging Face directory.
use std::collections::HashSet;
use std::path::Path;

use serde::{Deserialize, Serialize};
use tch::{Device, Kind, Tensor};
use tokenizers::models::bpe::{BpeTrainerBuilder, BPE};
use tokenizers::normalizers::NormalizerWrapper;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::{AddedToken, TokenizerBuilder};
use tracing::info;

use crate::data::{Example, TokenBatch};
use crate::mend::losses;
use crate::mend::optim::Adam;
use crate::model::gpt2::{Gpt2, Gpt2Config};
use crate::model::{random_params, LoadedModel, Model, ParamStore, ParamView, Tokenizer};
use crate::rng::SplitMix64;
use crate::{Error, Result};

pub const EOS: &str = "<|endoftext|>";

/// Shape and schedule of the pretraining run.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct PretrainConfig {
    pub vocab_size: usize,
    pub n_embd: i64,
    pub n_layer: i64,
    pub n_head: i64,
    pub n_positions: i64,
    pub steps: usize,
    pub batch_size: usize,
    pub lr: f64,
    pub seed: u64,
    /// Stop early once the model gets this share of the probe facts right; `None` runs
    /// every step (what `dualedit pretrain` does: the user chose the step count).
    pub target_accuracy: Option<f64>,
}

impl Default for PretrainConfig {
    fn default() -> Self {
        Self {
            vocab_size: 768,
            n_embd: 128,
            n_layer: 4,
            n_head: 4,
            n_positions: 32,
            steps: 3000,
            batch_size: 32,
            lr: 3e-3,
            seed: 7,
            target_accuracy: Some(0.995),
        }
    }
}

impl PretrainConfig {
    /// `dualedit pretrain`'s model from scratch: wider than the embedded default's, with a
    /// larger vocabulary and context, trained for a fixed number of steps (no early stop).
    pub fn from_scratch() -> Self {
        Self { vocab_size: 4096, n_embd: 256, n_layer: 4, n_head: 4, n_positions: 64, steps: 4000, batch_size: 32, lr: 2e-3, target_accuracy: None, ..Default::default() }
    }

    /// Sizes a run can train with: one error naming the flag.
    pub fn check(&self) -> Result<()> {
        if !(self.lr.is_finite() && self.lr > 0.0) || self.batch_size == 0 || self.steps == 0 {
            return Err(Error::input(format!(
                "`lr` must be a positive number and `batch`, `steps` at least 1 (got {}, {}, {})",
                self.lr, self.batch_size, self.steps
            )));
        }
        if self.vocab_size < 257 {
            // The byte-level BPE trainer always keeps its 256 byte symbols plus end-of-text, and
            // would silently return a larger vocabulary than asked for.
            return Err(Error::input(format!("`vocab` must be at least 257 (256 byte-level symbols and end-of-text), got {}", self.vocab_size)));
        }
        Ok(())
    }
}

/// Trains a GPT-2-style byte-level BPE on `corpus` and writes `tokenizer.json` into `dir`.
pub fn train_tokenizer(corpus: &[String], vocab_size: usize, dir: &Path) -> Result<Tokenizer> {
    train_tokenizer_with(corpus, vocab_size, &[EOS], dir)
}

/// [`train_tokenizer`] with more special tokens (the vision-language model's chat and
/// image markers), ids 0.. in the order given; `specials[0]` should be [`EOS`], which is
/// also the padding token.
pub fn train_tokenizer_with(corpus: &[String], vocab_size: usize, specials: &[&str], dir: &Path) -> Result<Tokenizer> {
    let path = dir.join("tokenizer.json");
    let fail = |e: Box<dyn std::error::Error + Send + Sync>| Error::file(&path, format!("tokenizer training failed: {e}"));
    let mut trainer = BpeTrainerBuilder::new()
        .show_progress(false)
        .vocab_size(vocab_size)
        .min_frequency(0)
        .special_tokens(specials.iter().map(|t| AddedToken::from(*t, true)).collect())
        .initial_alphabet(ByteLevel::alphabet().into_iter().collect())
        .build();
    let mut tok = TokenizerBuilder::new()
        .with_model(BPE::default())
        .with_normalizer(None::<NormalizerWrapper>)
        .with_pre_tokenizer(Some(ByteLevel::default().add_prefix_space(false)))
        .with_post_processor(Some(ByteLevel::default()))
        .with_decoder(Some(ByteLevel::default()))
        .build()
        .map_err(fail)?;
    tok.train(&mut trainer, corpus.iter()).map_err(fail)?;
    std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
    let json = tok.to_string(false).map_err(fail)?;
    crate::io::write_atomic(&path, json.as_bytes())?;
    Tokenizer::from_file(&path)
}

fn hf_config(c: &PretrainConfig, vocab: usize, eos: i64) -> serde_json::Value {
    serde_json::json!({
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": vocab,
        "n_embd": c.n_embd,
        "n_layer": c.n_layer,
        "n_head": c.n_head,
        "n_positions": c.n_positions,
        "n_ctx": c.n_positions,
        "n_inner": null,
        "activation_function": "gelu_new",
        "layer_norm_epsilon": 1e-5,
        "initializer_range": 0.02,
        "bos_token_id": eos,
        "eos_token_id": eos,
        "tie_word_embeddings": true,
        "torch_dtype": "float32"
    })
}

/// Share of `(prompt, answer)` pairs whose whole answer is the model's top-1 continuation.
pub fn fact_accuracy(model: &Model, params: &ParamView, tok: &Tokenizer, facts: &[(String, String)]) -> Result<f64> {
    let _g = tch::no_grad_guard();
    let mut right = 0usize;
    for chunk in facts.chunks(64) {
        let ex: Vec<Example> = chunk.iter().map(|(p, a)| Example::new(tok, p, a)).collect::<Result<_>>()?;
        let refs: Vec<&Example> = ex.iter().collect();
        let b = TokenBatch::collate(&refs, tok.pad_id(), params.device());
        let none = HashSet::new();
        let logits = model.forward(params, &b.forward_input(&none))?.logits;
        let (_, exact) = losses::token_accuracy(&logits, &b.kept_targets(), &b.kept_rows(), b.batch_size());
        right += exact.iter().filter(|&&e| e).count();
    }
    Ok(right as f64 / facts.len().max(1) as f64)
}

#[derive(Debug, Clone, Serialize)]
pub struct PretrainReport {
    pub steps: usize,
    pub final_loss: f64,
    pub fact_accuracy: f64,
    pub parameters: i64,
    pub seconds: f64,
}

/// Pretrains a tiny GPT-2 on `corpus` and writes config.json, model.safetensors and
/// tokenizer.json into `dir`. `probe` facts measure (and stop) training. `progress` draws
/// a progress bar on a terminal: a CPU run of the zsRE benchmark takes 25–45 minutes.
pub fn pretrain(
    corpus: &[String],
    probe: &[(String, String)],
    cfg: &PretrainConfig,
    dir: &Path,
    device: Device,
    progress: bool,
) -> Result<PretrainReport> {
    let start = std::time::Instant::now();
    let tok = train_tokenizer(corpus, cfg.vocab_size, dir)?;
    let eos = tok.pad_id();
    let vocab = tok.vocab_size();
    let config = hf_config(cfg, vocab, eos);
    let model = Model::new(Gpt2::new(serde_json::from_value::<Gpt2Config>(config.clone()).map_err(|e| Error::Internal(e.to_string()))?)?);
    let store = random_params(&model, device, Kind::Float, cfg.seed as i64);
    // The shipped text default (`data/model`) was pretrained from LayerNorm biases at 1, an
    // init defect `random_params` no longer has; kept here (it draws no random numbers) so
    // that `build-default` still reproduces that model byte for byte.
    tch::no_grad(|| {
        for (name, t) in store.iter().filter(|(n, _)| n.contains("ln_") && n.ends_with(".bias")) {
            let _ = t.shallow_clone().fill_(1.0);
            tracing::trace!(name, "LayerNorm bias at 1 (the shipped default's init)");
        }
    });
    let params: Vec<Tensor> = store.iter().map(|(_, t)| t.set_requires_grad(true)).collect();
    let mut adam = Adam::new(vec![(cfg.lr, params)]);
    let mut examples = Vec::with_capacity(corpus.len());
    for s in corpus {
        let ids = tok.encode(s)?;
        // Lines longer than the context cannot be trained on whole; they are rare.
        if ids.len() <= cfg.n_positions as usize && ids.len() >= 2 {
            examples.push(Example { ids, answer_start: 0, image: None });
        }
    }
    if examples.len() < corpus.len() {
        tracing::warn!(skipped = corpus.len() - examples.len(), "corpus lines longer than n_positions skipped");
    }
    if examples.is_empty() {
        return Err(Error::input("empty pretraining corpus"));
    }
    let mut order = Shuffled::new(examples.len(), cfg.seed, 77);
    let mut loss_v = f64::NAN;
    let mut acc = 0.0;
    let mut steps = 0;
    let none = HashSet::new();
    let bar = crate::progress::Progress::new("pretrain", cfg.steps, progress);
    while steps < cfg.steps {
        // Cosine decay to 10 % keeps the last steps from bouncing off memorised facts.
        adam.groups[0].lr = cfg.lr * crate::config::LrSchedule::Cosine.factor(steps, cfg.steps);
        let batch: Vec<&Example> = order.next_batch(cfg.batch_size).into_iter().map(|i| &examples[i]).collect();
        let b = TokenBatch::collate(&batch, eos, device);
        let loss = crate::error::guard(|| {
            let logits = model.forward(&ParamView::frozen(&store), &b.forward_input(&none))?.logits;
            let loss = losses::nll(&logits, &b.kept_targets());
            loss.f_backward()?;
            Ok(loss.double_value(&[]))
        })?;
        optimiser_step(&mut adam);
        loss_v = loss;
        steps += 1;
        bar.set_position(steps as u64);
        if steps % 250 == 0 || steps == cfg.steps {
            acc = fact_accuracy(&model, &ParamView::frozen(&store), &tok, probe)?;
            info!(steps, loss = loss_v, fact_accuracy = acc, "pretraining");
            bar.set_message(format!("loss {loss_v:.3}  fact accuracy {acc:.3}"));
            if cfg.target_accuracy.is_some_and(|t| acc >= t) {
                break;
            }
        }
    }
    bar.finish_and_clear();
    write_model(dir, &config, &store)?;
    Ok(PretrainReport {
        steps,
        final_loss: loss_v,
        fact_accuracy: acc,
        parameters: model.info().n_params,
        seconds: start.elapsed().as_secs_f64(),
    })
}

/// The order in which pretraining draws its examples: all of them, reshuffled from the
/// RNG stream (`seed`, `stream`) at each pass, `size` at a time (a batch may straddle
/// two passes). Both pretraining loops draw through it, so a seed fixes the batch order.
pub(crate) struct Shuffled {
    rng: SplitMix64,
    order: Vec<usize>,
    cursor: usize,
}

impl Shuffled {
    pub(crate) fn new(n: usize, seed: u64, stream: u64) -> Self {
        Self { rng: SplitMix64::new(seed, stream), order: (0..n).collect(), cursor: n }
    }

    /// The indices of the next `size` examples.
    pub(crate) fn next_batch(&mut self, size: usize) -> Vec<usize> {
        let mut batch = Vec::with_capacity(size);
        while batch.len() < size {
            if self.cursor == self.order.len() {
                self.rng.shuffle(&mut self.order);
                self.cursor = 0;
            }
            batch.push(self.order[self.cursor]);
            self.cursor += 1;
        }
        batch
    }
}

/// A pretraining step's update once the loss's backward has run: gradients clipped to a
/// global norm of 1, Adam, gradients cleared.
pub(crate) fn optimiser_step(adam: &mut Adam) {
    adam.clip(1.0);
    adam.step();
    adam.zero_grad();
}

/// Writes a pretrained model as a Hugging Face folder: `config.json` and
/// `model.safetensors` (every tensor of `store`, sorted by name, so the bytes depend only
/// on the weights).
pub(crate) fn write_model(dir: &Path, config: &serde_json::Value, store: &ParamStore) -> Result<()> {
    let mut tensors: Vec<(String, Tensor)> = store.iter().map(|(n, t)| (n.clone(), t.detach())).collect();
    tensors.sort_by(|a, b| a.0.cmp(&b.0));
    crate::io::write_json_atomic(&dir.join("config.json"), config)?;
    let meta = std::collections::HashMap::from([("format".to_string(), "pt".to_string())]);
    crate::io::write_safetensors(&dir.join("model.safetensors"), &tensors, meta)
}

/// Loads a pretrained directory back (for checks right after writing it).
pub fn reload(dir: &Path, device: Device) -> Result<LoadedModel> {
    crate::model::load_model(dir, device, Kind::Float)
}

/// A pretraining corpus from EasyEdit records: the true facts they state (prompt and
/// rephrase with the ground truth, the locality prompt with its answer), and the
/// `(prompt, ground truth)` pairs to probe what the model learned.
///
/// With `new_targets`, each record's new target also gets a line of its own (" architect."),
/// never after its prompt. A pretrained LM can already write the words an edit asks for
/// ("Python", "Virginia"); a tiny model learns words only from its corpus, and without
/// these lines most zsRE targets are byte-pair strings it has never produced, so an edit
/// would have to teach spelling as well as the fact.
pub fn corpus_from_records(records: &[crate::data::EditRecord], new_targets: bool) -> (Vec<String>, Vec<(String, String)>) {
    let mut corpus = Vec::new();
    let mut probe = Vec::new();
    let join = |p: &str, a: &str| format!("{} {}.", p.trim_end(), a.trim());
    for r in records {
        if let Some(gt) = &r.ground_truth {
            corpus.push(join(&r.prompt, gt));
            probe.push((r.prompt.clone(), gt.clone()));
            if let Some(rp) = &r.rephrase {
                corpus.push(join(rp, gt));
            }
        }
        if let (Some(lp), Some(la)) = (&r.locality_prompt, &r.locality_ground_truth) {
            corpus.push(join(lp, la));
        }
        // The loader has already refused records with an empty target.
        if new_targets {
            corpus.push(format!(" {}.", r.target_new.trim()));
        }
    }
    (corpus, probe)
}

#[cfg(test)]
mod tests {
    use super::corpus_from_records;
    use crate::data::EditRecord;

    #[test]
    fn new_targets_get_a_line_of_their_own() {
        let r = EditRecord {
            prompt: "What was Anton Grimus's career?".into(),
            target_new: " architect ".into(),
            subject: None,
            ground_truth: Some("composer".into()),
            rephrase: Some("What is Anton Grimus' career?".into()),
            locality_prompt: Some("nq question: who wrote hamlet".into()),
            locality_ground_truth: Some("Shakespeare".into()),
            portability: vec![],
        };
        let (plain, probe) = corpus_from_records(std::slice::from_ref(&r), false);
        assert_eq!(
            plain,
            ["What was Anton Grimus's career? composer.", "What is Anton Grimus' career? composer.", "nq question: who wrote hamlet Shakespeare."]
        );
        assert_eq!(probe, [(r.prompt.clone(), "composer".to_string())]);
        let (with, _) = corpus_from_records(std::slice::from_ref(&r), true);
        assert_eq!(with[..3], plain[..]);
        // Alone, with the leading space it has after a prompt (the same BPE tokens).
        assert_eq!(with[3], " architect.");
        assert!(!with.iter().any(|l| l.contains("career") && l.contains("architect")));
    }
}
