//! Files that must never be left half-written, and safetensors in and out of tch.
use std::collections::{BTreeMap, HashMap};
use std::io::Write;
use std::path::Path;

use safetensors::{Dtype, SafeTensors};
use tch::{Device, Kind, Tensor};

use crate::{Error, Result};

/// Writes `path` atomically: `write` fills a temp file in the same directory, which is
/// fsynced and renamed over `path`. A reader (or a crash) sees the old file or the new
/// one, never a torn one.
fn replace_atomically(path: &Path, write: impl FnOnce(&Path) -> std::io::Result<()>) -> Result<()> {
    let dir = path.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
    let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("file");
    let tmp = dir.join(format!(".{name}.tmp.{}", std::process::id()));
    let result = (|| {
        write(&tmp)?;
        std::fs::File::open(&tmp)?.sync_all()?;
        std::fs::rename(&tmp, path)?;
        // Persist the rename itself.
        if let Ok(d) = std::fs::File::open(dir) {
            let _ = d.sync_all();
        }
        Ok::<_, std::io::Error>(())
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result.map_err(|e| Error::io(path, e))
}

/// Reads a text file a user wrote (data, config): a directory or a missing file is named
/// as such, and a leading UTF-8 byte-order mark (as some editors save) is dropped.
pub fn read_text(path: &Path) -> Result<String> {
    if path.is_dir() {
        return Err(Error::file(path, "is a directory, expected a file"));
    }
    let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
    Ok(match text.strip_prefix('\u{feff}') {
        Some(rest) => rest.to_string(),
        None => text,
    })
}

/// Writes `bytes` to `path` atomically.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    replace_atomically(path, |tmp| std::fs::File::create(tmp)?.write_all(bytes))
}

pub fn write_json_atomic(path: &Path, value: &impl serde::Serialize) -> Result<()> {
    let text = serde_json::to_string_pretty(value).map_err(|e| Error::file(path, e.to_string()))?;
    write_atomic(path, text.as_bytes())
}

fn dtype_of(kind: Kind) -> Result<Dtype> {
    Ok(match kind {
        Kind::Float => Dtype::F32,
        Kind::Half => Dtype::F16,
        Kind::BFloat16 => Dtype::BF16,
        Kind::Double => Dtype::F64,
        Kind::Int64 => Dtype::I64,
        other => return Err(Error::input(format!("cannot store tensors of kind {other:?}"))),
    })
}

pub(crate) fn kind_of(dtype: Dtype) -> Option<Kind> {
    Some(match dtype {
        Dtype::F32 => Kind::Float,
        Dtype::F16 => Kind::Half,
        Dtype::BF16 => Kind::BFloat16,
        Dtype::F64 => Kind::Double,
        Dtype::I64 => Kind::Int64,
        _ => return None,
    })
}

/// A tensor as the safetensors writer sees it: its bytes are produced only when the
/// writer reaches it, so saving an editor and its optimiser state costs one tensor of
/// extra host memory, not a second copy of everything.
struct LazyBytes {
    tensor: Tensor,
    dtype: Dtype,
    shape: Vec<usize>,
}

impl safetensors::View for LazyBytes {
    fn dtype(&self) -> Dtype {
        self.dtype
    }
    fn shape(&self) -> &[usize] {
        &self.shape
    }
    fn data(&self) -> std::borrow::Cow<'_, [u8]> {
        let t = self.tensor.to_device(Device::Cpu).contiguous();
        let mut bytes = vec![0u8; self.data_len()];
        // Kinds and sizes were checked when the view was built; a failed copy here would
        // be a device error, which the writer cannot report: leave zeros and log it.
        if let Err(e) = t.f_copy_data_u8(&mut bytes, t.numel()) {
            tracing::error!("copying a tensor for saving failed: {e}");
        }
        std::borrow::Cow::Owned(bytes)
    }
    fn data_len(&self) -> usize {
        self.tensor.numel() * self.tensor.kind().elt_size_in_bytes()
    }
}

/// Serialises named tensors (and string metadata) as safetensors, atomically.
pub fn write_safetensors(path: &Path, tensors: &[(String, Tensor)], metadata: HashMap<String, String>) -> Result<()> {
    let views = tensors
        .iter()
        .map(|(name, t)| {
            let shape = t.size().iter().map(|&d| d as usize).collect();
            Ok((name.clone(), LazyBytes { tensor: t.detach(), dtype: dtype_of(t.kind())?, shape }))
        })
        .collect::<Result<Vec<_>>>()?;
    let meta = (!metadata.is_empty()).then_some(metadata);
    replace_atomically(path, |tmp| {
        safetensors::tensor::serialize_to_file(views, meta, tmp).map_err(|e| std::io::Error::other(e.to_string()))
    })
}

/// Reads every tensor (on the CPU, in its stored kind) and the metadata of a safetensors file.
pub fn read_safetensors(path: &Path) -> Result<(BTreeMap<String, Tensor>, HashMap<String, String>)> {
    let bytes = std::fs::read(path).map_err(|e| match e.kind() {
        std::io::ErrorKind::NotFound => Error::file(path, "file not found"),
        _ => Error::io(path, e),
    })?;
    let bad = |e: safetensors::SafeTensorError| Error::file(path, format!("not a valid safetensors file (truncated or corrupt?): {e}"));
    let (_, header) = SafeTensors::read_metadata(&bytes).map_err(bad)?;
    let metadata = header.metadata().clone().unwrap_or_default();
    let st = SafeTensors::deserialize(&bytes).map_err(bad)?;
    let mut out = BTreeMap::new();
    for (name, view) in st.tensors() {
        let kind = kind_of(view.dtype())
            .ok_or_else(|| Error::file(path, format!("tensor {name:?} has unsupported dtype {:?}", view.dtype())))?;
        let shape: Vec<i64> = view.shape().iter().map(|&d| d as i64).collect();
        out.insert(name, Tensor::f_from_data_size(view.data(), &shape, kind)?);
    }
    Ok((out, metadata))
}
