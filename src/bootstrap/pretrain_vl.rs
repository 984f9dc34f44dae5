//! Pretraining a tiny Qwen2-VL-shaped model from scratch on a visual world's
//! `pretrain.json` (the multimodal default's model, issue #22).
//!
//! Every (image, question, answer) triple becomes the example the editing path builds:
//! the image through Qwen2-VL's preprocessing, the question through the chat template
//! (the family's default chat template, via [`VlPrompt::image_example`]) and `" " + answer`
//! labelled; the NQ text facts are plain `question answer` examples, as the records' `loc`
//! view asks them. Unlike editing, the vision tower trains too: its features are computed
//! with autograd ([`StepImages::compute_trainable`]). The tokenizer is a byte-level BPE
//! trained on the corpus plus Qwen2-VL's special tokens; Adam and the cosine schedule are
//! the text pretraining's ([`crate::bootstrap::pretrain`]). The result is a Hugging Face directory
//! (config.json as `Qwen2VLForConditionalGeneration`, model.safetensors, tokenizer.json,
//! preprocessor_config.json, chat_template.jinja) that `load_model` and `score --image` read.
use std::collections::HashSet;
use std::path::Path;

use serde::{Deserialize, Serialize};
use tch::{Device, Kind, Tensor};
use tracing::info;

use crate::data::multimodal::{ImageFile, StepImages, VlPrompt};
use crate::world::visual::PretrainCorpus;
use crate::data::Example;
use crate::mend::losses;
use crate::mend::optim::Adam;
use crate::model::vision::{ChatTemplate, ImageProcessorConfig};
use crate::model::{random_params, Model, ParamView, Tokenizer, VisionLanguage};
use crate::bootstrap::pretrain::{optimiser_step, write_model, Shuffled, EOS};
use crate::{Error, Result};

/// Qwen2-VL's special tokens, ids 0.. in this order (end-of-text first: it pads).
pub const SPECIALS: [&str; 7] =
    [EOS, "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"];

/// Shape and schedule of a VL pretraining run.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct VlPretrainConfig {
    pub vocab_size: usize,
    /// Text decoder width, layers, heads (key/value heads: half of them).
    pub hidden: i64,
    pub layers: i64,
    pub heads: i64,
    /// Vision tower width and depth (two heads, MLP ratio 2).
    pub vision_width: i64,
    pub vision_depth: i64,
    pub steps: usize,
    pub batch_size: usize,
    pub lr: f64,
    /// The vision tower's learning rate as a share of `lr` (1: the same rate). An earlier
    /// world and recipe needed the tower slowed (at 3e-3 its features collapsed to one
    /// vector for every image); at 3e-4 on the cell-grid world the full rate learns.
    pub vision_lr_scale: f64,
    pub seed: u64,
    /// Stop once the probe accuracy (original renders, rephrase renders and text facts,
    /// each) reaches this; `None` runs every step.
    pub target_accuracy: Option<f64>,
    /// Probe (and log) every this many steps.
    pub probe_every: usize,
}

impl Default for VlPretrainConfig {
    fn default() -> Self {
        Self {
            vocab_size: 512,
            hidden: 96,
            layers: 2,
            heads: 4,
            vision_width: 48,
            vision_depth: 2,
            steps: 10000,
            batch_size: 32,
            lr: 3e-4,
            vision_lr_scale: 1.0,
            seed: 7,
            target_accuracy: Some(0.99),
            probe_every: 250,
        }
    }
}

/// Fact accuracy (whole answer top-1) after pretraining.
#[derive(Debug, Clone, Default, Serialize)]
pub struct VlAccuracy {
    /// Canonical question on the original render.
    pub original: f64,
    /// Canonical question on the rephrase render (another picture of the same scene).
    pub rephrase_image: f64,
    /// The NQ-style text facts.
    pub text: f64,
    /// The canonical questions of `original`, each shown another scene's picture: what the
    /// model gets right without reading the image it is shown (the answer prior, and
    /// answers the two scenes share). Far below `original` when the model reads pictures.
    pub other_image: f64,
}

impl VlAccuracy {
    fn min(&self) -> f64 {
        self.original.min(self.rephrase_image).min(self.text)
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct VlPretrainReport {
    pub steps: usize,
    pub final_loss: f64,
    pub accuracy: VlAccuracy,
    pub parameters: i64,
    pub examples: usize,
    pub seconds: f64,
}

/// M-RoPE's base. Qwen2-VL gives the height and width streams the lowest frequencies
/// (`mrope_section` splits them in order: temporal, height, width); with a head width of
/// 24 and the usual 10 000 the width stream turns by under 0.01 rad across the whole image,
/// so no image token's place can be told from another's and questions about a place are
/// never learned (measured with transformers and here: docs/notebook/vision-language.md). At 10
/// the slowest frequency still turns by 0.12 rad per cell.
const ROPE_THETA: f64 = 10.0;

/// The `config.json` of the model (transformers 5's nested Qwen2-VL layout).
/// The class the pretrained model is saved as.
const ARCHITECTURE: &str = "Qwen2VLForConditionalGeneration";

fn hf_config(c: &VlPretrainConfig, vocab: usize, ids: &[i64; 7]) -> serde_json::Value {
    let head_dim = c.hidden / c.heads;
    // M-RoPE: head_dim/2 frequencies split over (temporal, height, width).
    let half = head_dim / 2;
    let section = [half - 2 * (half / 3), half / 3, half / 3];
    serde_json::json!({
        "architectures": [ARCHITECTURE],
        "model_type": "qwen2_vl",
        "dtype": "float32",
        "image_token_id": ids[5],
        "video_token_id": ids[6],
        "vision_start_token_id": ids[3],
        "vision_end_token_id": ids[4],
        "tie_word_embeddings": true,
        "text_config": {
            "model_type": "qwen2_vl_text",
            "vocab_size": vocab,
            "hidden_size": c.hidden,
            "intermediate_size": 2 * c.hidden,
            "num_hidden_layers": c.layers,
            "num_attention_heads": c.heads,
            "num_key_value_heads": (c.heads / 2).max(1),
            "hidden_act": "silu",
            "rms_norm_eps": 1e-6,
            "max_position_embeddings": 256,
            "bos_token_id": ids[0],
            "eos_token_id": ids[0],
            "use_sliding_window": false,
            "rope_parameters": {"rope_type": "default", "rope_theta": ROPE_THETA, "mrope_section": section},
        },
        "vision_config": {
            "model_type": "qwen2_vl_vision",
            "depth": c.vision_depth,
            "embed_dim": c.vision_width,
            "hidden_size": c.hidden,
            "num_heads": 2,
            "mlp_ratio": 2,
            "hidden_act": "quick_gelu",
            "in_channels": 3,
            "patch_size": 14,
            "temporal_patch_size": 2,
            "spatial_merge_size": 2,
        },
    })
}

/// transformers' Qwen2-VL processor settings, with pixel bounds that keep the world's
/// images (sides multiples of 28) at their size.
fn preprocessor_config(corpus: &PretrainCorpus) -> serde_json::Value {
    let [w, h] = corpus.image_size;
    let pixels = (w * h) as i64;
    serde_json::json!({
        "min_pixels": pixels.min(56 * 56),
        "max_pixels": pixels.max(56 * 56),
        "patch_size": 14, "temporal_patch_size": 2, "merge_size": 2,
        "image_mean": [0.48145466, 0.4578275, 0.40821073],
        "image_std": [0.26862954, 0.26130258, 0.27577711],
        "image_processor_type": "Qwen2VLImageProcessor",
        "processor_class": "Qwen2VLProcessor",
    })
}

/// The text the tokenizer is trained on: every prompt as the model sees it and every answer.
fn tokenizer_corpus(corpus: &PretrainCorpus, template: &ChatTemplate) -> Result<Vec<String>> {
    let mut seen = HashSet::new();
    let mut out = Vec::new();
    for (q, a) in corpus.vqa.iter().map(|t| (&t.question, &t.answer)).chain(corpus.text.iter().map(|t| (&t.question, &t.answer))) {
        if seen.insert((q.clone(), a.clone())) {
            out.push(format!("{} {a}", template.image_prompt(q)?));
            out.push(format!("Question: {q} Short answer: {a}"));
        }
    }
    Ok(out)
}

/// Tokenised pretraining data: image examples, text examples, and the probe sets.
struct Data {
    train: Vec<Example>,
    probe_original: Vec<Example>,
    probe_rephrase: Vec<Example>,
    probe_text: Vec<Example>,
    /// `probe_original` with each image swapped for the next distinct one of the probe.
    probe_other: Vec<Example>,
}

fn build_data(corpus: &PretrainCorpus, world: &Path, tok: &Tokenizer, vp: VlPrompt, probe_cap: usize) -> Result<Data> {
    let [w, h] = corpus.image_size;
    let mut train = Vec::with_capacity(corpus.vqa.len());
    let (mut probe_original, mut probe_rephrase) = (Vec::new(), Vec::new());
    use crate::world::visual::QuestionKind;
    // Each canonical phrasing's words around `{x}`.
    let canonical: Vec<(&str, &str)> = QuestionKind::ALL
        .iter()
        .filter_map(|k| k.templates().first().and_then(|t| t.split_once("{x}")))
        .collect();
    for t in &corpus.vqa {
        let img = ImageFile { path: world.join(&t.image), height: h as i64, width: w as i64 };
        let e = vp.image_example(tok, &img, &t.question, &t.answer)?;
        if canonical.iter().any(|(pre, post)| t.question.starts_with(pre) && t.question.ends_with(post)) {
            let rephrase = t.image.starts_with(crate::world::visual::Render::Rephrase.folder());
            if rephrase {
                probe_rephrase.push(e.clone());
            } else {
                probe_original.push(e.clone());
            }
        }
        train.push(e);
    }
    let text: Vec<Example> = corpus.text.iter().map(|f| Example::new(tok, &f.question, &f.answer)).collect::<Result<_>>()?;
    if train.is_empty() || text.is_empty() {
        return Err(Error::input("pretrain.json has no image triples or no text facts"));
    }
    // The text facts are few: repeat them to a tenth of the data so every batch sees some.
    let reps = (train.len() / (9 * text.len())).max(1);
    for _ in 0..reps {
        train.extend(text.iter().cloned());
    }
    // Evenly spread probe subsets, the same for every run.
    let thin = |v: Vec<Example>| -> Vec<Example> {
        let step = v.len().div_ceil(probe_cap).max(1);
        v.into_iter().step_by(step).collect()
    };
    let probe_original = thin(probe_original);
    let probe_other = with_other_images(&probe_original);
    Ok(Data { train, probe_original, probe_rephrase: thin(probe_rephrase), probe_text: text, probe_other })
}

/// `examples` with each image replaced by the next distinct image among them (all images
/// of a world have one size, so the token layout stays valid).
fn with_other_images(examples: &[Example]) -> Vec<Example> {
    let mut paths: Vec<&Path> = Vec::new();
    for p in examples.iter().filter_map(|e| e.image.as_ref().map(|i| i.path.as_path())) {
        if !paths.contains(&p) {
            paths.push(p);
        }
    }
    examples
        .iter()
        .map(|e| {
            let mut e = e.clone();
            if let Some(img) = e.image.as_mut() {
                if let Some(i) = paths.iter().position(|p| *p == img.path) {
                    img.path = paths[(i + 1) % paths.len()].to_path_buf();
                }
            }
            e
        })
        .collect()
}

/// Share of `examples` whose whole answer is the top-1 continuation.
pub fn vl_accuracy(model: &Model, vl: &dyn VisionLanguage, params: &ParamView, proc: &ImageProcessorConfig, pad: i64, examples: &[Example]) -> Result<f64> {
    let _g = tch::no_grad_guard();
    let none = HashSet::new();
    let mut right = 0usize;
    for chunk in examples.chunks(64) {
        let refs: Vec<&Example> = chunk.iter().collect();
        let b = match StepImages::compute(vl, params, proc, &refs)? {
            Some(imgs) => imgs.collate(&refs, pad, params.device())?,
            None => crate::data::TokenBatch::collate(&refs, pad, params.device()),
        };
        let logits = model.forward(params, &b.forward_input(&none))?.logits;
        let (_, exact) = losses::token_accuracy(&logits, &b.kept_targets(), &b.kept_rows(), b.batch_size());
        right += exact.iter().filter(|&&e| e).count();
    }
    Ok(right as f64 / examples.len().max(1) as f64)
}

/// Pretrains the model on `world/pretrain.json` and writes it into `out`. Deterministic
/// for a config on one machine (one thread; the seed fixes weights and batch order).
pub fn pretrain_vl(world: &Path, cfg: &VlPretrainConfig, out: &Path, device: Device, progress: bool) -> Result<VlPretrainReport> {
    let start = std::time::Instant::now();
    let path = world.join("pretrain.json");
    let corpus: PretrainCorpus =
        serde_json::from_str(&crate::io::read_text(&path)?).map_err(|e| Error::file(&path, format!("not a visual world's pretrain.json: {e}")))?;
    if cfg.hidden % cfg.heads != 0 || (cfg.hidden / cfg.heads) % 2 != 0 || cfg.vision_width % 8 != 0 {
        return Err(Error::input(format!(
            "hidden {} must split into {} heads of even width, and the vision width {} be a multiple of 8",
            cfg.hidden, cfg.heads, cfg.vision_width
        )));
    }
    if cfg.steps == 0 || cfg.batch_size == 0 || !(cfg.lr.is_finite() && cfg.lr > 0.0) {
        return Err(Error::input("pretraining needs steps >= 1, batch >= 1 and a positive learning rate"));
    }
    if !(cfg.vision_lr_scale.is_finite() && cfg.vision_lr_scale >= 0.0) {
        return Err(Error::input(format!("`vision_lr_scale` {}: must be a finite number >= 0 (0 freezes the vision tower)", cfg.vision_lr_scale)));
    }
    let template = crate::model::loader::default_chat_template(ARCHITECTURE).ok_or_else(|| Error::Internal(format!("{ARCHITECTURE} has no chat template")))?;
    let tok = crate::bootstrap::pretrain::train_tokenizer_with(&tokenizer_corpus(&corpus, template)?, cfg.vocab_size, &SPECIALS, out)?;
    let mut ids = [0i64; 7];
    for (slot, name) in ids.iter_mut().zip(SPECIALS) {
        *slot = tok.special_id(name).ok_or_else(|| Error::file(tok.path(), format!("trained tokenizer lacks {name}")))?;
    }
    let config = hf_config(cfg, tok.vocab_size(), &ids);
    crate::io::write_json_atomic(&out.join("preprocessor_config.json"), &preprocessor_config(&corpus))?;
    // The template the examples below are built with goes with the model, so editing it
    // (and transformers) builds the same prompts without falling back to a default.
    crate::io::write_atomic(&out.join("chat_template.jinja"), template.text().as_bytes())?;
    let model = crate::model::loader::model_from_config(&config)?;
    let vl = model.family().vision_language().ok_or_else(|| Error::Internal("a Qwen2-VL model without its image side".into()))?;
    let proc = vl.image_processor(out)?;
    let data = build_data(&corpus, world, &tok, VlPrompt { vl, proc: &proc, template }, 400)?;
    let store = random_params(&model, device, Kind::Float, cfg.seed as i64);
    let (vision, text): (Vec<_>, Vec<_>) = store.iter().partition(|(n, _)| n.starts_with("visual."));
    let grad = |v: Vec<(&String, &Tensor)>| -> Vec<Tensor> { v.into_iter().map(|(_, t)| t.set_requires_grad(true)).collect() };
    let mut adam = Adam::new(vec![(cfg.lr, grad(text)), (cfg.lr * cfg.vision_lr_scale, grad(vision))]);
    let pad = tok.pad_id();
    let mut order = Shuffled::new(data.train.len(), cfg.seed, 78);
    let (mut loss_v, mut steps, mut acc) = (f64::NAN, 0usize, VlAccuracy::default());
    let none = HashSet::new();
    let bar = crate::progress::Progress::new("pretrain", cfg.steps, progress);
    let probe = |acc: &mut VlAccuracy| -> Result<()> {
        let p = ParamView::frozen(&store);
        *acc = VlAccuracy {
            original: vl_accuracy(&model, vl, &p, &proc, pad, &data.probe_original)?,
            rephrase_image: vl_accuracy(&model, vl, &p, &proc, pad, &data.probe_rephrase)?,
            text: vl_accuracy(&model, vl, &p, &proc, pad, &data.probe_text)?,
            other_image: vl_accuracy(&model, vl, &p, &proc, pad, &data.probe_other)?,
        };
        Ok(())
    };
    while steps < cfg.steps {
        let factor = crate::config::LrSchedule::Cosine.factor(steps, cfg.steps);
        adam.groups[0].lr = cfg.lr * factor;
        adam.groups[1].lr = cfg.lr * cfg.vision_lr_scale * factor;
        let batch: Vec<&Example> = order.next_batch(cfg.batch_size).into_iter().map(|i| &data.train[i]).collect();
        let p = ParamView::frozen(&store);
        loss_v = crate::error::guard(|| {
            let b = match StepImages::compute_trainable(vl, &p, &proc, &batch)? {
                Some(imgs) => imgs.collate(&batch, pad, device)?,
                None => crate::data::TokenBatch::collate(&batch, pad, device),
            };
            let logits = model.forward(&p, &b.forward_input(&none))?.logits;
            let loss = losses::nll(&logits, &b.kept_targets());
            loss.f_backward()?;
            Ok(loss.double_value(&[]))
        })?;
        if tracing::enabled!(tracing::Level::DEBUG) && (steps % cfg.probe_every.max(1) == 0) {
            let norm = |prefix: &str| -> f64 {
                store.iter().filter(|(n, _)| n.starts_with(prefix)).map(|(_, t)| t.grad()).filter(|g| g.defined()).map(|g| g.square().sum(Kind::Float).double_value(&[])).sum::<f64>().sqrt()
            };
            tracing::debug!(steps, vision = norm("visual."), text = norm("model."), "gradient norms");
        }
        optimiser_step(&mut adam);
        steps += 1;
        bar.set_position(steps as u64);
        if steps % cfg.probe_every.max(1) == 0 || steps == cfg.steps {
            probe(&mut acc)?;
            info!(steps, loss = loss_v, original = acc.original, rephrase_image = acc.rephrase_image, text = acc.text, other_image = acc.other_image, "pretraining (VL)");
            bar.set_message(format!(
                "loss {loss_v:.3}  accuracy {:.3}/{:.3}/{:.3} (another scene's image: {:.3})",
                acc.original, acc.rephrase_image, acc.text, acc.other_image
            ));
            if cfg.target_accuracy.is_some_and(|t| acc.min() >= t) {
                break;
            }
        }
    }
    bar.finish_and_clear();
    write_model(out, &config, &store)?;
    Ok(VlPretrainReport {
        steps,
        final_loss: loss_v,
        accuracy: acc,
        parameters: model.info().n_params,
        examples: data.train.len(),
        seconds: start.elapsed().as_secs_f64(),
    })
}
