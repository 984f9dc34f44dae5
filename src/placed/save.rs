//! Saving a (edited) model as a Hugging Face folder, whole or not at all, in the source's
//! layout, and the checks of the folder it goes to.
use std::path::{Path, PathBuf};

use tracing::info;

use crate::model::LoadedModel;
use crate::{Error, Result};

/// Refuses to write a model into a folder that already holds one (the source model or any
/// other), which would replace it or leave a mix of two models' files.
pub fn check_new_model_dir(dir: &Path) -> Result<()> {
    for f in ["config.json", "model.safetensors", "model.safetensors.index.json"] {
        if dir.join(f).exists() {
            return Err(Error::file(dir, format!("already holds a model ({f}); choose a new or empty folder")));
        }
    }
    Ok(())
}

/// Whether a file name is a weight file or a weight index (what [`save_model`] writes
/// itself, in the source's layout, and never copies).
fn is_weight_file(name: &str) -> bool {
    const EXT: [&str; 9] = [".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf", ".onnx"];
    name.ends_with(".safetensors.index.json") || name.ends_with(".bin.index.json") || EXT.iter().any(|e| name.ends_with(e))
}

/// What a folder a save may go to holds.
enum SaveDir {
    /// Absent or empty.
    Fresh,
    /// Only what an interrupted save of an older dualedit left (`config.json`,
    /// `tokenizer.json`, hidden temporary files): no weights, so no model; removed when
    /// the new save is in place.
    Leftovers(Vec<PathBuf>),
}

/// Checks that an edited model may be saved to `dir`: it must be new or empty, or hold
/// only the leftovers of an interrupted save (no weights). A folder with weights
/// "already holds a model"; any other file is the user's and is never overwritten.
pub fn check_save_dir(dir: &Path) -> Result<()> {
    save_dir(dir).map(|_| ())
}

fn save_dir(dir: &Path) -> Result<SaveDir> {
    let entries = match std::fs::read_dir(dir) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(SaveDir::Fresh),
        Err(_) if dir.exists() && !dir.is_dir() => return Err(Error::file(dir, "exists and is not a folder; choose a new or empty folder")),
        Err(e) => return Err(Error::io(dir, e)),
    };
    let mut leftovers = Vec::new();
    let mut other = Vec::new();
    for e in entries {
        let e = e.map_err(|e| Error::io(dir, e))?;
        let name = e.file_name().to_string_lossy().into_owned();
        if is_weight_file(&name) {
            return Err(Error::file(dir, format!("already holds a model ({name}); choose a new or empty folder")));
        }
        let partial = name == "config.json" || name == "tokenizer.json" || (name.starts_with('.') && name.contains(".tmp."));
        if partial && e.file_type().map(|t| t.is_file()).unwrap_or(false) {
            leftovers.push(e.path());
        } else {
            other.push(name);
        }
    }
    if !other.is_empty() {
        other.sort();
        let shown: Vec<&str> = other.iter().take(3).map(String::as_str).collect();
        return Err(Error::file(dir, format!("is not empty (holds {}); choose a new or empty folder", shown.join(", "))));
    }
    Ok(if leftovers.is_empty() { SaveDir::Fresh } else { SaveDir::Leftovers(leftovers) })
}

/// Prefix of the temporary sibling folder a save of `name` is written into.
fn temp_prefix(name: &str) -> String {
    format!(".{name}.dualedit-save-")
}

/// Writes the (edited) model as a Hugging Face folder that `score` and transformers load:
/// every non-weight file of the source folder (configs, tokenizer files, preprocessor
/// and chat template, ...) copied, and the weights in the source's layout (tensor names,
/// shards and their index, dtype per tensor).
///
/// Whole or nothing: everything is written into a temporary sibling folder, flushed, and
/// renamed into place; a save that is interrupted leaves no `dir` (the next save removes
/// its temporary folder). `dir` must be new or empty ([`check_save_dir`]).
pub fn save_model(lm: &LoadedModel, dir: &Path) -> Result<()> {
    let state = save_dir(dir)?;
    let name = dir
        .file_name()
        .and_then(|n| n.to_str())
        .filter(|n| *n != "..")
        .ok_or_else(|| Error::file(dir, "cannot save a model here: name a folder"))?
        .to_string();
    let parent = dir.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
    std::fs::create_dir_all(parent).map_err(|e| Error::io(parent, e))?;
    crate::io::remove_stale_temp_dirs(parent, &temp_prefix(&name), "save");
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos()).unwrap_or(0);
    let tmp = parent.join(format!("{}{}-{nanos}", temp_prefix(&name), std::process::id()));
    std::fs::create_dir(&tmp).map_err(|e| Error::io(&tmp, e))?;
    let result = (|| -> Result<()> {
        write_model_files(lm, &tmp)?;
        crate::io::sync_dir(&tmp);
        if let SaveDir::Leftovers(files) = &state {
            for f in files {
                std::fs::remove_file(f).map_err(|e| Error::io(f, e))?;
            }
            tracing::warn!(dir = %dir.display(), files = files.len(), "removed what an interrupted save left (no weights)");
        }
        // Replaces an empty folder; refuses (ENOTEMPTY) if someone wrote into it meanwhile.
        std::fs::rename(&tmp, dir).map_err(|e| Error::file(dir, format!("cannot move the saved model into place: {e}")))?;
        crate::io::sync_dir(parent);
        Ok(())
    })();
    if result.is_err() {
        let _ = std::fs::remove_dir_all(&tmp);
    }
    result?;
    info!(dir = %dir.display(), "edited model saved");
    Ok(())
}

/// The files of a save (see [`save_model`]) written into `out`.
fn write_model_files(lm: &LoadedModel, out: &Path) -> Result<()> {
    let src = &lm.dir;
    let entries = std::fs::read_dir(src).map_err(|e| Error::io(src, e))?;
    for e in entries {
        let e = e.map_err(|e| Error::io(src, e))?;
        let name = e.file_name().to_string_lossy().into_owned();
        // Hidden files are temporary files or VCS metadata, not part of the model.
        if name.starts_with('.') || is_weight_file(&name) {
            continue;
        }
        let path = e.path();
        if path.is_file() {
            crate::io::copy_synced(&path, &out.join(&name))?;
        } else {
            tracing::debug!(path = %path.display(), "not copied: not a file");
        }
    }
    if !out.join("tokenizer.json").exists() {
        crate::io::copy_synced(lm.tokenizer.path(), &out.join("tokenizer.json"))?;
    }
    if !out.join("config.json").exists() {
        crate::io::write_json_atomic(&out.join("config.json"), &lm.config_json)?;
    }
    // The source's shards, in the source's tensor names and dtypes.
    let index_path = src.join("model.safetensors.index.json");
    let files = crate::model::loader::weight_files(src)?;
    let family = lm.model.family();
    let mut written = std::collections::HashSet::new();
    let mut total = 0u64;
    for file in &files {
        let (f, _) = crate::io::open_regular(file)?;
        // SAFETY: read-only map, used only while this iteration copies headers and the
        // bytes of tensors the model does not hold.
        let mmap = unsafe { memmap2::Mmap::map(&f) }.map_err(|e| Error::io(file, e))?;
        let bad = |e: safetensors::SafeTensorError| Error::file(file, format!("not a valid safetensors file: {e}"));
        let (_, header) = safetensors::SafeTensors::read_metadata(&mmap).map_err(bad)?;
        let st = safetensors::SafeTensors::deserialize(&mmap).map_err(bad)?;
        let mut tensors = Vec::new();
        for (tname, view) in st.tensors() {
            let canonical = family.canonical_name(&tname);
            let shape: Vec<i64> = view.shape().iter().map(|&d| d as i64).collect();
            let held = lm.params.get(&canonical).filter(|t| t.size() == shape);
            let stored = match (held, crate::io::kind_of(view.dtype())) {
                (Some(t), Some(kind)) => {
                    written.insert(canonical);
                    crate::io::Stored::Tensor(t.shallow_clone(), kind)
                }
                _ => crate::io::Stored::Raw { dtype: view.dtype(), shape: view.shape().to_vec(), bytes: view.data().to_vec() },
            };
            tensors.push((tname, stored));
        }
        let meta = header.metadata().clone().unwrap_or_default();
        let file_name = file.file_name().ok_or_else(|| Error::file(file, "weights file has no name"))?;
        total += crate::io::write_safetensors_stored(&out.join(file_name), tensors, meta)?;
    }
    let mut missing: Vec<&String> = lm.params.names().filter(|n| !written.contains(*n)).collect();
    if !missing.is_empty() {
        missing.sort();
        tracing::debug!(tensors = ?missing, "not stored: the source stores no tensor of these names (tied weights)");
    }
    if index_path.exists() {
        let text = crate::io::read_text(&index_path)?;
        let mut index: serde_json::Value =
            serde_json::from_str(&text).map_err(|e| Error::file(&index_path, format!("malformed JSON: {e}")))?;
        if let Some(obj) = index.as_object_mut() {
            let meta = obj.entry("metadata").or_insert_with(|| serde_json::json!({}));
            if let Some(m) = meta.as_object_mut() {
                m.insert("total_size".into(), serde_json::Value::from(total));
            }
        }
        crate::io::write_json_atomic(&out.join("model.safetensors.index.json"), &index)?;
    }
    Ok(())
}
