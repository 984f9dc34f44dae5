//! `dualedit convert --gguf FILE --out DIR`: a GGUF checkpoint (llama.cpp's single-file
//! format, quantised or not) imported as the Hugging Face folder transformers would give
//! after `from_pretrained(dir, gguf_file=...)` and `save_pretrained`: `config.json`,
//! `generation_config.json`, `model.safetensors` (every weight dequantised to `f32`, under
//! Hugging Face's names, with llama.cpp's layout changes undone), `tokenizer.json`,
//! `tokenizer_config.json` and `chat_template.jinja`. `score`, `edit`, `train` and
//! transformers load the folder like any other.
//!
//! - [`gguf`]: the file's header read and checked over a memory map.
//! - [`dequant`]: the tensor types and their block formats.
//! - [`arch`]: per architecture (llama, qwen2, gpt2), names, layouts and `config.json`.
//! - [`tokenizer`]: `tokenizer.json` from `tokenizer.ggml.*`.
//!
//! The folder is written whole or not at all: into a temporary sibling folder, flushed, then
//! renamed into place. The weights stream into `model.safetensors` one tensor at a time, so
//! the memory a conversion takes is one tensor's `f32` values, not the model's.
pub mod arch;
pub mod dequant;
pub mod gguf;
pub mod tokenizer;

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use arch::{Arch, Layout};
use gguf::{Gguf, TensorInfo, Value};

use crate::{Error, Result};

/// What a conversion wrote.
#[derive(Debug, serde::Serialize)]
pub struct ConvertSummary {
    pub out: PathBuf,
    pub architecture: String,
    pub gguf_version: u32,
    /// Tensors written, and their values.
    pub tensors: usize,
    pub parameters: u64,
    /// The file's tensors by ggml type.
    pub types: BTreeMap<String, usize>,
    /// GGUF tensors transformers does not load either (`rope_freqs.weight`), not written.
    pub skipped: Vec<String>,
    pub vocab_size: i64,
    pub tie_word_embeddings: bool,
}

/// One weight to write: where it comes from and what it becomes.
struct Planned<'a> {
    name: String,
    info: &'a TensorInfo,
    layout: Layout,
    /// The Hugging Face shape (torch order).
    shape: Vec<usize>,
}

/// Converts the GGUF file `gguf` into a new Hugging Face folder `out` (which must not exist,
/// or be empty).
pub fn convert_gguf(gguf: &Path, out: &Path) -> Result<ConvertSummary> {
    check_out(out)?;
    let g = Gguf::open(gguf)?;
    let arch = Arch::from_gguf(&g)?;
    let tok = tokenizer::build(&g)?;
    let vocab_size = match g.get(&format!("{}.vocab_size", arch.key())) {
        Some(v) => v.as_i64().ok_or_else(|| g.error(format!("{}.vocab_size is not an integer", arch.key())))?,
        None => tokenizer::tokens(&g)?.len() as i64,
    };
    let count = |key: &str| g.get(&format!("{}.{key}", arch.key())).and_then(Value::as_i64).filter(|&v| v > 0).map(|v| v as usize);
    let heads = count("attention.head_count").ok_or_else(|| g.error(format!("{}.attention.head_count is missing", arch.key())))?;
    let kv_heads = count("attention.head_count_kv").unwrap_or(heads);
    let tied = !g.tensors.iter().any(|t| t.name == "output.weight");
    let config = arch.config(&g, tied, vocab_size, "float32")?;

    // Plan every tensor first, so that a file that cannot be converted fails before
    // anything is written.
    let mut planned = Vec::new();
    let mut skipped = Vec::new();
    let mut types = BTreeMap::new();
    let mut seen = std::collections::HashSet::new();
    for t in &g.tensors {
        *types.entry(t.ty.name().to_string()).or_insert(0) += 1;
        let Some((name, layout)) = arch.hf_name(&t.name, heads, kv_heads) else {
            tracing::warn!(tensor = %t.name, "not converted: transformers does not load this tensor either");
            skipped.push(t.name.clone());
            continue;
        };
        let bad = |msg: String| g.error(format!("tensor {:?}: {msg}", t.name));
        if !seen.insert(name.clone()) {
            return Err(bad(format!("a second tensor for {name}")));
        }
        let mut shape = t.shape();
        let embedding = name == "model.embed_tokens.weight" || name == "transformer.wte.weight";
        if embedding && shape.first().map(|&rows| rows as i64) != Some(vocab_size) {
            return Err(bad(format!("shape {shape:?} is not one row per token of the vocabulary of {vocab_size}")));
        }
        match layout {
            Layout::Same => {}
            Layout::Transpose => {
                if shape.len() != 2 {
                    return Err(bad(format!("a Conv1D weight must have 2 dimensions, not shape {shape:?}")));
                }
                shape.swap(0, 1);
            }
            Layout::Unpermute { heads } => {
                if shape.len() > 2 || shape[0] % (2 * heads) != 0 {
                    return Err(bad(format!("shape {shape:?} does not split into {heads} rotary heads of an even size")));
                }
            }
        }
        planned.push(Planned { name, info: t, layout, shape });
    }
    if planned.is_empty() {
        return Err(g.error("no tensor of the file is a weight of the model"));
    }
    let parameters = planned.iter().map(|p| p.info.elements() as u64).sum();
    let generation = generation_config(&config);

    write_dir(out, |dir| {
        let views = planned.iter().map(|p| (p.name.clone(), WeightView { g: &g, p })).collect::<Vec<_>>();
        let mut meta = std::collections::HashMap::new();
        meta.insert("format".to_string(), "pt".to_string());
        let st = dir.join("model.safetensors");
        safetensors::tensor::serialize_to_file(views, Some(meta), &st).map_err(|e| Error::file(&st, format!("cannot write the weights: {e}")))?;
        sync_file(&st)?;
        crate::io::write_json_atomic(&dir.join("config.json"), &config)?;
        crate::io::write_json_atomic(&dir.join("generation_config.json"), &generation)?;
        crate::io::write_json_atomic(&dir.join("tokenizer.json"), &tok.tokenizer_json)?;
        crate::io::write_json_atomic(&dir.join("tokenizer_config.json"), &tok.tokenizer_config)?;
        if let Some(t) = &tok.chat_template {
            crate::io::write_atomic(&dir.join("chat_template.jinja"), t.as_bytes())?;
        }
        Ok(())
    })?;
    Ok(ConvertSummary {
        out: out.to_path_buf(),
        architecture: arch.architecture().to_string(),
        gguf_version: g.version,
        tensors: planned.len(),
        parameters,
        types,
        skipped,
        vocab_size,
        tie_word_embeddings: tied,
    })
}

/// transformers' `GenerationConfig.from_model_config`: the special token ids.
fn generation_config(config: &serde_json::Value) -> serde_json::Value {
    let mut g = serde_json::Map::new();
    g.insert("_from_model_config".into(), true.into());
    for key in ["bos_token_id", "eos_token_id", "pad_token_id"] {
        if let Some(v) = config.get(key).filter(|v| !v.is_null()) {
            g.insert(key.into(), v.clone());
        }
    }
    serde_json::Value::Object(g)
}

/// One weight as safetensors asks for it: dequantised and re-laid out only when its bytes
/// are written, so one tensor's values are in memory at a time.
struct WeightView<'a> {
    g: &'a Gguf,
    p: &'a Planned<'a>,
}

impl safetensors::View for WeightView<'_> {
    fn dtype(&self) -> safetensors::Dtype {
        safetensors::Dtype::F32
    }
    fn shape(&self) -> &[usize] {
        &self.p.shape
    }
    fn data(&self) -> Cow<'_, [u8]> {
        let values = weight_values(self.g, self.p);
        Cow::Owned(values.iter().flat_map(|v| v.to_le_bytes()).collect())
    }
    fn data_len(&self) -> usize {
        self.p.info.elements() * 4
    }
}

/// A planned tensor's values in Hugging Face's layout (the plan checked the shapes).
fn weight_values(g: &Gguf, p: &Planned) -> Vec<f32> {
    let mut values = vec![0f32; p.info.elements()];
    dequant::dequantize(p.info.ty, g.data(p.info), &mut values);
    let row = p.info.ne[0] as usize;
    match p.layout {
        Layout::Same => values,
        // A 1-D tensor (a bias) permutes single values.
        Layout::Unpermute { heads } => {
            let row_len = if p.info.ne.len() == 1 { 1 } else { row };
            arch::unpermute(&values, heads, row_len).unwrap_or(values)
        }
        Layout::Transpose => arch::transpose(&values, p.info.elements() / row.max(1), row),
    }
}

fn sync_file(path: &Path) -> Result<()> {
    std::fs::File::open(path).and_then(|f| f.sync_all()).map_err(|e| Error::io(path, e))
}

/// `out` must be new or an empty folder: a conversion never overwrites anything.
fn check_out(out: &Path) -> Result<()> {
    match std::fs::read_dir(out) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(_) if out.exists() && !out.is_dir() => Err(Error::file(out, "exists and is not a folder; choose a new folder")),
        Err(e) => Err(Error::io(out, e)),
        Ok(mut entries) => match entries.next() {
            None => Ok(()),
            Some(_) => Err(Error::file(out, "is not empty; choose a new or empty folder")),
        },
    }
}

/// Runs `write` on a new temporary sibling of `out`, flushes it and renames it to `out`;
/// on any failure the temporary folder is removed and `out` is left as it was.
fn write_dir(out: &Path, write: impl FnOnce(&Path) -> Result<()>) -> Result<()> {
    let name = out
        .file_name()
        .and_then(|n| n.to_str())
        .filter(|n| *n != "..")
        .ok_or_else(|| Error::file(out, "cannot write a model here: name a folder"))?;
    let parent = out.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
    std::fs::create_dir_all(parent).map_err(|e| Error::io(parent, e))?;
    let prefix = format!(".{name}.dualedit-convert-");
    crate::io::remove_stale_temp_dirs(parent, &prefix, "conversion");
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos()).unwrap_or(0);
    let tmp = parent.join(format!("{prefix}{}-{nanos}", std::process::id()));
    std::fs::create_dir(&tmp).map_err(|e| Error::io(&tmp, e))?;
    let result = write(&tmp).and_then(|()| {
        crate::io::sync_dir(&tmp);
        // Replaces an empty folder; refuses (ENOTEMPTY) if someone wrote into it meanwhile.
        std::fs::rename(&tmp, out).map_err(|e| Error::file(out, format!("cannot move the converted model into place: {e}")))?;
        crate::io::sync_dir(parent);
        Ok(())
    });
    if result.is_err() {
        let _ = std::fs::remove_dir_all(&tmp);
    }
    result
}
