//! Loading Hugging Face model directories as they are: `config.json`, one
//! `model.safetensors` or shards listed in `model.safetensors.index.json`, `tokenizer.json`.
use std::collections::{BTreeSet, HashMap};
use std::path::{Path, PathBuf};

use safetensors::SafeTensors;

use crate::io::kind_of;
use tch::{Device, Kind, Tensor};
use tracing::{debug, info};

use super::gpt2::Gpt2;
use super::llama::{Llama, LlamaConfig};
use super::qwen2_vl::{self, Qwen2Vl, VlFamily};
use super::vision::ChatTemplate;
use super::{Model, ParamStore, Tokenizer};
use crate::{Error, Result};

/// A model ready to run: architecture, weights on one device, tokenizer.
#[derive(Debug)]
pub struct LoadedModel {
    pub dir: PathBuf,
    pub model: Model,
    pub params: ParamStore,
    pub tokenizer: Tokenizer,
    /// The directory's `config.json` as written, kept so an edited model can be saved
    /// with the same configuration.
    pub config_json: serde_json::Value,
}

/// A weight dtype a run may ask for: the one option type the CLI's `--dtype`, Python's
/// `dtype=` and reports share.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Dtype {
    F32,
    Bf16,
    F16,
}

/// Every spelling [`Dtype::from_str`] reads (`"bfloat16"`, `"torch.float16"`, ...).
impl<'de> serde::Deserialize<'de> for Dtype {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> std::result::Result<Self, D::Error> {
        <String as serde::Deserialize>::deserialize(deserializer)?.parse().map_err(serde::de::Error::custom)
    }
}

impl Dtype {
    /// Every dtype, in the order messages list them.
    pub const ALL: [Dtype; 3] = [Dtype::F32, Dtype::Bf16, Dtype::F16];

    pub fn kind(self) -> Kind {
        match self {
            Dtype::F32 => Kind::Float,
            Dtype::Bf16 => Kind::BFloat16,
            Dtype::F16 => Kind::Half,
        }
    }
}

impl std::str::FromStr for Dtype {
    type Err = Error;

    /// `f32` / `bf16` / `f16`, the long spellings (`float32`, `bfloat16`, `float16`, `fp32`,
    /// `fp16`) and torch's (`torch.bfloat16`, `float`, `half`), as `config.json` and Python
    /// callers write them.
    fn from_str(s: &str) -> Result<Self> {
        match s.trim().trim_start_matches("torch.") {
            "f32" | "float32" | "fp32" | "float" => Ok(Dtype::F32),
            "bf16" | "bfloat16" => Ok(Dtype::Bf16),
            "f16" | "float16" | "fp16" | "half" => Ok(Dtype::F16),
            other => Err(Error::input(format!("unknown dtype {other:?} (expected f32, bf16 or f16)"))),
        }
    }
}

/// `f32` / `bf16` / `f16` (and the long spellings, [`Dtype`]'s) to a tch kind.
pub fn parse_dtype(s: &str) -> Result<Kind> {
    s.parse::<Dtype>().map(Dtype::kind)
}

/// The CLI's name of a weight dtype (`f32`, `bf16`, `f16`), as reports and plans write it.
pub fn dtype_name(k: Kind) -> &'static str {
    match k {
        Kind::BFloat16 => "bf16",
        Kind::Half => "f16",
        _ => "f32",
    }
}

/// Where the weights' dtype of a run or a plan came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum DtypeSource {
    /// `--dtype` (or Python's `dtype=`).
    Flag,
    /// `config.json`'s `dtype` (or the older `torch_dtype`): what the weights are.
    Config,
    /// Neither: f32.
    Default,
}

impl DtypeSource {
    /// For logs and plans: where the dtype came from.
    pub fn describe(self) -> &'static str {
        match self {
            DtypeSource::Flag => "`dtype`",
            DtypeSource::Config => "the checkpoint's config.json dtype",
            DtypeSource::Default => "default; config.json gives no dtype",
        }
    }
}

/// The weights' dtype for every command (train, edit, eval, serve, score, plan) and the
/// Python `Session`: `flag` when given, else what the checkpoint says it is (`config.json`'s
/// `dtype`, or `torch_dtype` from older transformers; Qwen2-VL-7B says `bfloat16`), else f32.
/// One rule, so `plan` and the run it plans agree (running a bf16 checkpoint in f32 would
/// double its weights' memory).
pub fn model_dtype(model_dir: &Path, flag: Option<Dtype>) -> Result<(Kind, DtypeSource)> {
    if let Some(f) = flag {
        return Ok((f.kind(), DtypeSource::Flag));
    }
    let path = model_dir.join("config.json");
    let v = read_json(&path)?;
    match v.get("dtype").or_else(|| v.get("torch_dtype")).and_then(|d| d.as_str()) {
        Some(d) => {
            let k = parse_dtype(d).map_err(|_| Error::file(&path, format!("dtype {d:?} is not one dualedit runs (float32, bfloat16, float16); give `dtype`")))?;
            Ok((k, DtypeSource::Config))
        }
        None => Ok((Kind::Float, DtypeSource::Default)),
    }
}

/// A JSON file of a checkpoint (`config.json`), read as every user's file is
/// ([`crate::io::read_text`]: a regular file, bounded).
pub fn read_json(path: &Path) -> Result<serde_json::Value> {
    let text = crate::io::read_text(path)?;
    serde_json::from_str(&text).map_err(|e| Error::file(path, format!("malformed JSON: {e}")))
}

/// Builds a family from its `config.json` (parsed) and the architecture name.
type Build = fn(&str, &serde_json::Value) -> Result<Model>;

fn build<C: serde::de::DeserializeOwned, F: super::Family + 'static>(
    json: &serde_json::Value,
    new: impl FnOnce(C) -> Result<F>,
) -> Result<Model> {
    let cfg = serde_json::from_value::<C>(json.clone()).map_err(|e| Error::input(e.to_string()))?;
    Ok(Model::new(new(cfg)?))
}

/// Every supported architecture (`architectures[0]` of `config.json`) and its family.
pub const FAMILIES: &[(&str, Build)] = &[
    ("GPT2LMHeadModel", |_, j| build(j, Gpt2::new)),
    ("LlamaForCausalLM", |a, j| build(j, |c: LlamaConfig| Llama::new(c, a))),
    ("Qwen2ForCausalLM", |a, j| build(j, |c: LlamaConfig| Llama::new(c, a))),
    ("MistralForCausalLM", |a, j| build(j, |c: LlamaConfig| Llama::new(c, a))),
    ("Qwen2VLForConditionalGeneration", |a, j| Ok(Model::new(Qwen2Vl::from_json(j, a)?))),
    ("Qwen2_5_VLForConditionalGeneration", |a, j| Ok(Model::new(Qwen2Vl::from_json(j, a)?))),
];

/// Builds the architecture named by `architectures[0]` in `config.json`.
pub fn read_config(dir: &Path) -> Result<(Model, serde_json::Value)> {
    let path = dir.join("config.json");
    let json = read_json(&path)?;
    let model = model_from_config(&json).map_err(|e| Error::file(&path, e.to_string()))?;
    Ok((model, json))
}

/// The model a `config.json` value describes (errors are plain messages; [`read_config`]
/// names the file).
pub fn model_from_config(json: &serde_json::Value) -> Result<Model> {
    // transformers 4.5x saving a VL model loaded from a flat config writes `architectures`
    // into `text_config` only (its config forwards attributes the text config has).
    fn first(v: Option<&serde_json::Value>) -> Option<&str> {
        v.and_then(|v| v.get("architectures")).and_then(|a| a.get(0)).and_then(|a| a.as_str())
    }
    let arch = first(Some(json))
        .or_else(|| first(json.get("text_config")))
        .ok_or_else(|| Error::input("no \"architectures\" entry naming the model class"))?
        .to_string();
    let Some((_, build)) = FAMILIES.iter().find(|(name, _)| *name == arch) else {
        let known: Vec<&str> = FAMILIES.iter().map(|(n, _)| *n).collect();
        return Err(Error::input(format!("unknown architecture {arch:?} (supported: {})", known.join(", "))));
    };
    build(&arch, json).map_err(|e| Error::input(format!("invalid {arch} config: {e}")))
}

/// The released chat template of a vision-language `architecture`'s family (`None` for a
/// text family): for a program that words image prompts before it has a model, as
/// pretraining a VL model does when it trains the tokenizer on them.
pub fn default_chat_template(architecture: &str) -> Option<&'static ChatTemplate> {
    VlFamily::from_architecture(architecture).map(|_| qwen2_vl::default_chat_template())
}

/// The safetensors files of a model directory: the index's shards, or `model.safetensors`.
pub fn weight_files(dir: &Path) -> Result<Vec<PathBuf>> {
    let index = dir.join("model.safetensors.index.json");
    if index.exists() {
        let json = read_json(&index)?;
        let map = json
            .get("weight_map")
            .and_then(|m| m.as_object())
            .ok_or_else(|| Error::file(&index, "no \"weight_map\" object"))?;
        let files: BTreeSet<&str> = map.values().filter_map(|v| v.as_str()).collect();
        if files.is_empty() {
            return Err(Error::file(&index, "\"weight_map\" lists no files"));
        }
        return Ok(files.into_iter().map(|f| dir.join(f)).collect());
    }
    let single = dir.join("model.safetensors");
    if single.exists() {
        return Ok(vec![single]);
    }
    Err(Error::file(dir, "no model.safetensors or model.safetensors.index.json (only safetensors weights are supported)"))
}

/// Block index of a per-block tensor name (`transformer.h.7.…`, `model.layers.7.…`).
fn block_index(name: &str) -> Option<i64> {
    let mut parts = name.split('.');
    while let Some(p) = parts.next() {
        if p == "h" || p == "layers" {
            return parts.next()?.parse().ok();
        }
    }
    None
}

/// Reads every tensor the architecture needs from `files`, converted to `kind` on the
/// device `place` names for it.
/// Checks presence and shape of each expected parameter; unknown extra tensors (buffers such
/// as GPT-2's `attn.bias`, a tied `lm_head.weight`) are ignored.
pub fn read_weights(model: &Model, files: &[PathBuf], place: &dyn Fn(&str) -> Device, kind: Kind) -> Result<HashMap<String, Tensor>> {
    let expected: HashMap<String, Vec<i64>> = model.expected_params().into_iter().collect();
    let n_layers = model.info().n_layers;
    let mut out = HashMap::with_capacity(expected.len());
    for path in files {
        // A regular file (a FIFO or device cannot be mapped; a directory is named).
        let (file, _) = crate::io::open_regular(path)?;
        // SAFETY: the map is read-only and lives only while this loop iteration copies
        // the tensors out; a file changed underneath would at worst give wrong values.
        let mmap = unsafe { memmap2::Mmap::map(&file) }.map_err(|e| Error::io(path, e))?;
        let st = SafeTensors::deserialize(&mmap)
            .map_err(|e| Error::file(path, format!("not a valid safetensors file (truncated or corrupt?): {e}")))?;
        for (name, view) in st.tensors() {
            let name = model.family().canonical_name(&name);
            let Some(shape) = expected.get(&name) else {
                if let Some(i) = block_index(&name).filter(|&i| i >= n_layers) {
                    return Err(Error::file(
                        path,
                        format!("tensor {name:?} belongs to block {i}, but config.json describes {n_layers} blocks"),
                    ));
                }
                debug!(tensor = %name, file = %path.display(), "ignoring tensor the architecture does not use");
                continue;
            };
            let actual: Vec<i64> = view.shape().iter().map(|&d| d as i64).collect();
            if &actual != shape {
                return Err(Error::file(
                    path,
                    format!("tensor {name:?} has shape {actual:?}, but config.json implies {shape:?}"),
                ));
            }
            let src_kind = kind_of(view.dtype())
                .ok_or_else(|| Error::file(path, format!("tensor {name:?} has unsupported dtype {:?}", view.dtype())))?;
            let t = crate::error::guard(|| {
                Ok(Tensor::f_from_data_size(view.data(), &actual, src_kind)?.to_kind(kind).to_device(place(&name)))
            })?;
            // A NaN or infinite weight makes every output NaN; say so here, not as NaN metrics.
            if crate::error::guard(|| Ok(t.f_isfinite()?.f_all()?.f_int64_value(&[])?))? == 0 {
                return Err(Error::file(path, format!("tensor {name:?} contains NaN or infinite values")));
            }
            out.insert(name, t);
        }
    }
    let mut missing: Vec<&String> = expected.keys().filter(|n| !out.contains_key(*n)).collect();
    if !missing.is_empty() {
        missing.sort();
        let shown: Vec<&str> = missing.iter().take(5).map(|s| s.as_str()).collect();
        let where_ = files.first().map(|f| f.as_path()).unwrap_or(Path::new("."));
        return Err(Error::file(
            where_,
            format!("{} expected tensor(s) missing, e.g. {}", missing.len(), shown.join(", ")),
        ));
    }
    Ok(out)
}

/// Loads a Hugging Face model directory onto `device` in `kind`.
pub fn load_model(dir: &Path, device: Device, kind: Kind) -> Result<LoadedModel> {
    load_model_split(dir, device, kind, None, &[])
}

/// [`load_model`] for a layer split: with `sub_side = Some((sub, at))` the parameters of
/// blocks `at..` and of the final norm and head are read straight onto `sub`, and each of
/// a chain's `(device, first block)` ranges (increasing, below `at`) its blocks up to the
/// next range onto its device, so the main device never holds them, not even while
/// loading (the engine then only records the split). The rest goes to `device`.
pub fn load_model_split(dir: &Path, device: Device, kind: Kind, sub_side: Option<(Device, usize)>, chain: &[(Device, usize)]) -> Result<LoadedModel> {
    if dir.is_file() {
        return Err(Error::file(dir, "is a file; `model` is the model's directory"));
    }
    if !dir.is_dir() {
        return Err(Error::file(dir, "model directory not found"));
    }
    let (model, config_json) = read_config(dir)?;
    let tok_path = dir.join("tokenizer.json");
    let tokenizer = Tokenizer::from_file(&tok_path)?;
    let vocab = model.info().vocab_size;
    if tokenizer.vocab_size() as i64 > vocab {
        return Err(Error::file(
            &tok_path,
            format!("has {} tokens but config.json's vocab_size is {vocab}: the tokenizer does not belong to this model", tokenizer.vocab_size()),
        ));
    }
    let files = weight_files(dir)?;
    let on_sub: std::collections::HashSet<String> = match sub_side {
        Some((_, at)) => model.sub_side_params(at).0.into_iter().collect(),
        None => Default::default(),
    };
    let place = |name: &str| match sub_side {
        Some((sub, _)) if on_sub.contains(name) => sub,
        // A block below the last device's boundary: the last chain range that starts at or below it.
        _ => model.block_of(name).and_then(|b| chain.iter().rev().find(|(_, from)| *from <= b)).map_or(device, |(d, _)| *d),
    };
    let tensors = read_weights(&model, &files, &place, kind)?;
    let params = ParamStore::new(tensors, device, kind);
    let info = model.info();
    info!(dir = %dir.display(), arch = %info.architecture, params = info.n_params, ?device, ?kind, "model loaded");
    Ok(LoadedModel { dir: dir.to_path_buf(), model, params, tokenizer, config_json })
}

/// Random weights for `model` (N(0, 0.02²) matrices, unit norm weights, zero biases, the
/// norms' biases included, as transformers initialises them), as a freshly initialised
/// checkpoint would have: for benchmarks, planning and pretraining from scratch. Drawn
/// from libtorch's generator seeded with `seed` ([`crate::rng::torch_seeded`]).
pub fn random_params(model: &Model, device: Device, kind: Kind, seed: i64) -> ParamStore {
    let _g = tch::no_grad_guard();
    let tensors = crate::rng::torch_seeded(seed, || model
        .expected_params()
        .into_iter()
        .map(|(name, shape)| {
            let t = if shape.len() >= 2 {
                Tensor::randn(shape.as_slice(), (Kind::Float, device)) * 0.02
            } else if (name.contains("norm") || name.contains("ln_")) && name.ends_with(".weight") {
                Tensor::ones(shape.as_slice(), (Kind::Float, device))
            } else {
                Tensor::zeros(shape.as_slice(), (Kind::Float, device))
            };
            (name, t.to_kind(kind))
        })
        .collect());
    ParamStore::new(tensors, device, kind)
}
