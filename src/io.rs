//! Files that must never be left half-written, and safetensors in and out of tch.
use std::collections::{BTreeMap, HashMap};
use std::io::Write;
use std::path::{Component, Path, PathBuf};

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

/// The most bytes of a text file a user names (records, training data, a config, a
/// report, a chat template) that are read: a larger one is refused from its size.
pub const MAX_TEXT_BYTES: u64 = 1 << 30;

/// Opens a file a user named for reading, refusing before any read what would hang or
/// never end: the file is opened non-blocking (a FIFO or a device then cannot block in
/// `open`), and anything that is not a regular file (FIFO, socket, device, directory) is
/// an error naming it and what it is. Every read of a user's file starts here
/// ([`read_regular_capped`], [`read_text`]; streaming readers and maps call it directly).
pub fn open_regular(path: &Path) -> Result<(std::fs::File, std::fs::Metadata)> {
    use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_NOCTTY)
        .open(path)
        .map_err(|e| match e.kind() {
            std::io::ErrorKind::NotFound => Error::file(path, "file not found"),
            _ => Error::io(path, e),
        })?;
    let meta = file.metadata().map_err(|e| Error::io(path, e))?;
    if !meta.is_file() {
        let t = meta.file_type();
        let what = if t.is_dir() {
            "a directory"
        } else if t.is_fifo() {
            "a FIFO (named pipe)"
        } else if t.is_char_device() || t.is_block_device() {
            "a device"
        } else if t.is_socket() {
            "a socket"
        } else {
            "not a regular file"
        };
        return Err(Error::file(path, format!("is {what}, not a regular file")));
    }
    Ok((file, meta))
}

/// Reads a text file a user wrote (data, config, report) through [`read_regular_capped`]
/// with [`MAX_TEXT_BYTES`]: a directory, FIFO or device, a missing file, a file too large
/// and one that is not UTF-8 are each named as such, and a leading UTF-8 byte-order mark
/// (as some editors save) is dropped.
pub fn read_text(path: &Path) -> Result<String> {
    read_text_capped(path, MAX_TEXT_BYTES)
}

/// [`read_text`] with a bound of its own.
pub fn read_text_capped(path: &Path, max_bytes: u64) -> Result<String> {
    let bytes = read_regular_capped(path, max_bytes)?;
    let text = String::from_utf8(bytes).map_err(|e| Error::file(path, format!("is not UTF-8 text (invalid byte at offset {})", e.utf8_error().valid_up_to())))?;
    Ok(match text.strip_prefix('\u{feff}') {
        Some(rest) => rest.to_string(),
        None => text,
    })
}

/// Reads a file a user named (an image, say) whole, refusing before any read what would
/// hang or never end ([`open_regular`]); a regular file longer than `max_bytes` is refused
/// from its size, and the read itself stops at `max_bytes + 1` bytes (a file that grows
/// while being read cannot make it unbounded).
pub fn read_regular_capped(path: &Path, max_bytes: u64) -> Result<Vec<u8>> {
    use std::io::Read;
    let (file, meta) = open_regular(path)?;
    if meta.len() > max_bytes {
        return Err(Error::file(path, format!("is {} bytes, more than the {max_bytes} bytes allowed", meta.len())));
    }
    let mut bytes = Vec::with_capacity(meta.len() as usize);
    file.take(max_bytes + 1).read_to_end(&mut bytes).map_err(|e| Error::io(path, e))?;
    if bytes.len() as u64 > max_bytes {
        return Err(Error::file(path, format!("grew past the {max_bytes} bytes allowed while being read")));
    }
    Ok(bytes)
}

/// Writes `bytes` to `path` atomically.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    replace_atomically(path, |tmp| std::fs::File::create(tmp)?.write_all(bytes))
}

pub fn write_json_atomic(path: &Path, value: &impl serde::Serialize) -> Result<()> {
    let text = serde_json::to_string_pretty(value).map_err(|e| Error::file(path, e.to_string()))?;
    write_atomic(path, text.as_bytes())
}

/// Resolves `relative`, a path a remote client named (a folder for `serve`'s `/save`, an
/// image for a multimodal request), to a path inside `root`, refusing every way out of it:
/// an absolute path, any `..` component, and a symbolic link (anywhere along the path)
/// whose target lies outside the root or does not exist. The trailing components may not
/// exist yet (a folder to create); those that do are resolved through their links.
///
/// The answer is the resolved path, under `root`'s canonical form. The check holds when it
/// is made: a link planted inside the root between the check and the use is not caught,
/// which is the right trade where clients can name paths but not create links.
pub fn resolve_under(root: &Path, relative: &Path) -> Result<PathBuf> {
    let base = root.canonicalize().map_err(|e| Error::io(root, e))?;
    let outside = |why: String| Error::input(format!("{}: {why}; paths are relative to {} and stay inside it", relative.display(), root.display()));
    if relative.as_os_str().is_empty() {
        return Err(outside("empty path".into()));
    }
    let mut resolved = base.clone();
    for c in relative.components() {
        match c {
            Component::CurDir => {}
            Component::ParentDir => return Err(outside("\"..\" is refused".into())),
            Component::RootDir | Component::Prefix(_) => return Err(outside("absolute paths are refused".into())),
            Component::Normal(name) => {
                let next = resolved.join(name);
                match std::fs::symlink_metadata(&next) {
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => resolved = next,
                    Err(e) => return Err(Error::io(&next, e)),
                    Ok(_) => {
                        // Resolves every link up to here; a dangling link is refused, as
                        // writing through it would create its target wherever it points.
                        let real = next
                            .canonicalize()
                            .map_err(|e| outside(format!("{} is a link that cannot be resolved ({e})", next.display())))?;
                        if !real.starts_with(&base) {
                            return Err(outside(format!("{} is a symbolic link to {}, outside the root", next.display(), real.display())));
                        }
                        resolved = real;
                    }
                }
            }
        }
    }
    Ok(resolved)
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

/// The first tensor whose bytes could not be read while a file was being written:
/// the safetensors writer cannot be told, so the views record it and the writer's caller
/// fails the save (the temp file is discarded, the old file stays).
type CopyFailure = std::sync::Arc<std::sync::Mutex<Option<String>>>;

/// A tensor as the safetensors writer sees it: its bytes are produced only when the
/// writer reaches it, so saving an editor and its optimiser state costs one tensor of
/// extra host memory, not a second copy of everything.
struct LazyBytes {
    name: String,
    tensor: Tensor,
    /// The kind stored: the tensor is converted to it only when its bytes are written.
    kind: Kind,
    dtype: Dtype,
    shape: Vec<usize>,
    failed: CopyFailure,
}

impl LazyBytes {
    /// Host bytes of the tensor in the stored kind (a device copy or conversion can fail:
    /// a device error, a tensor without plain storage).
    fn bytes(&self) -> std::result::Result<Vec<u8>, tch::TchError> {
        let t = self.tensor.f_to_device(Device::Cpu)?.f_to_kind(self.kind)?.f_contiguous()?;
        let mut bytes = vec![0u8; safetensors::View::data_len(self)];
        t.f_copy_data_u8(&mut bytes, t.numel())?;
        Ok(bytes)
    }
}

impl safetensors::View for LazyBytes {
    fn dtype(&self) -> Dtype {
        self.dtype
    }
    fn shape(&self) -> &[usize] {
        &self.shape
    }
    fn data(&self) -> std::borrow::Cow<'_, [u8]> {
        match self.bytes() {
            Ok(b) => std::borrow::Cow::Owned(b),
            Err(e) => {
                let mut failed = self.failed.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
                failed.get_or_insert_with(|| format!("tensor {:?} could not be copied for saving: {e}", self.name));
                std::borrow::Cow::Owned(vec![0u8; self.data_len()])
            }
        }
    }
    fn data_len(&self) -> usize {
        self.tensor.numel() * self.kind.elt_size_in_bytes()
    }
}

/// One tensor of a safetensors file being written: a tensor stored in `kind` (converted
/// when written), or bytes copied as they are (a buffer of a dtype tch has no kind for).
pub enum Stored {
    Tensor(Tensor, Kind),
    Raw { dtype: Dtype, shape: Vec<usize>, bytes: Vec<u8> },
}

enum AnyView {
    Lazy(LazyBytes),
    Raw { dtype: Dtype, shape: Vec<usize>, bytes: Vec<u8> },
}

impl safetensors::View for AnyView {
    fn dtype(&self) -> Dtype {
        match self {
            AnyView::Lazy(l) => l.dtype(),
            AnyView::Raw { dtype, .. } => *dtype,
        }
    }
    fn shape(&self) -> &[usize] {
        match self {
            AnyView::Lazy(l) => l.shape(),
            AnyView::Raw { shape, .. } => shape,
        }
    }
    fn data(&self) -> std::borrow::Cow<'_, [u8]> {
        match self {
            AnyView::Lazy(l) => l.data(),
            AnyView::Raw { bytes, .. } => std::borrow::Cow::Borrowed(bytes),
        }
    }
    fn data_len(&self) -> usize {
        match self {
            AnyView::Lazy(l) => l.data_len(),
            AnyView::Raw { bytes, .. } => bytes.len(),
        }
    }
}

/// Writes `tensors` as one safetensors file, atomically, each stored as [`Stored`] says.
/// Returns the bytes of tensor data written (an index's `total_size`). A tensor whose
/// bytes cannot be read (a failed device copy) fails the whole write: no file with zeros
/// in its place is ever left.
pub fn write_safetensors_stored(path: &Path, tensors: Vec<(String, Stored)>, metadata: HashMap<String, String>) -> Result<u64> {
    let failed = CopyFailure::default();
    let mut total = 0u64;
    let views = tensors
        .into_iter()
        .map(|(name, s)| {
            let view = match s {
                Stored::Tensor(t, kind) => {
                    let shape = t.size().iter().map(|&d| d as usize).collect();
                    let tensor = t.detach();
                    AnyView::Lazy(LazyBytes { name: name.clone(), tensor, kind, dtype: dtype_of(kind)?, shape, failed: failed.clone() })
                }
                Stored::Raw { dtype, shape, bytes } => AnyView::Raw { dtype, shape, bytes },
            };
            total += safetensors::View::data_len(&view) as u64;
            Ok((name, view))
        })
        .collect::<Result<Vec<_>>>()?;
    let meta = (!metadata.is_empty()).then_some(metadata);
    replace_atomically(path, |tmp| {
        safetensors::tensor::serialize_to_file(views, meta, tmp).map_err(|e| std::io::Error::other(e.to_string()))?;
        match failed.lock().unwrap_or_else(std::sync::PoisonError::into_inner).take() {
            Some(why) => Err(std::io::Error::other(why)),
            None => Ok(()),
        }
    })?;
    Ok(total)
}

/// Copies the file `from` to `to` (following links: the content, not the link) and
/// flushes it to disk.
pub fn copy_synced(from: &Path, to: &Path) -> Result<()> {
    std::fs::copy(from, to).map_err(|e| Error::io(from, e))?;
    std::fs::File::open(to).and_then(|f| f.sync_all()).map_err(|e| Error::io(to, e))
}

/// Flushes a directory's entries (a rename into or out of it) to disk; best effort.
pub fn sync_dir(dir: &Path) {
    if let Ok(d) = std::fs::File::open(dir) {
        let _ = d.sync_all();
    }
}

/// Serialises named tensors (and string metadata) as safetensors, atomically, each in
/// its own kind.
pub fn write_safetensors(path: &Path, tensors: &[(String, Tensor)], metadata: HashMap<String, String>) -> Result<()> {
    let stored = tensors.iter().map(|(name, t)| (name.clone(), Stored::Tensor(t.shallow_clone(), t.kind()))).collect();
    write_safetensors_stored(path, stored, metadata).map(drop)
}

/// Reads every tensor (on the CPU, in its stored kind) and the metadata of a safetensors file.
pub fn read_safetensors(path: &Path) -> Result<(BTreeMap<String, Tensor>, HashMap<String, String>)> {
    // An editor or optimiser state: bounded by the file's own size, checked as a regular file.
    let bytes = read_regular_capped(path, u64::MAX / 2)?;
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn resolve_under_stays_inside_the_root() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("root");
        std::fs::create_dir_all(root.join("models")).unwrap();
        let base = root.canonicalize().unwrap();
        // Relative paths, existing or not, land inside.
        assert_eq!(resolve_under(&root, Path::new("models/a")).unwrap(), base.join("models/a"));
        assert_eq!(resolve_under(&root, Path::new("./new/b")).unwrap(), base.join("new/b"));
        // A link that stays inside is followed.
        std::os::unix::fs::symlink(root.join("models"), root.join("inside")).unwrap();
        assert_eq!(resolve_under(&root, Path::new("inside/c")).unwrap(), base.join("models/c"));
        let refused = |p: &str, needle: &str| {
            let err = resolve_under(&root, Path::new(p)).unwrap_err().to_string();
            assert!(err.contains(needle) && err.contains(&root.display().to_string()), "{p}: {err}");
        };
        refused("", "empty path");
        refused("/etc/x", "absolute paths are refused");
        refused("../x", "\"..\" is refused");
        refused("models/../../x", "\"..\" is refused");
        refused("models/..", "\"..\" is refused");
        // Links out of the root, directly or further down the path, and dangling ones.
        std::fs::create_dir(dir.path().join("elsewhere")).unwrap();
        std::os::unix::fs::symlink(dir.path().join("elsewhere"), root.join("out")).unwrap();
        refused("out", "outside the root");
        refused("out/deeper/x", "outside the root");
        std::os::unix::fs::symlink(dir.path().join("missing"), root.join("models/dangling")).unwrap();
        refused("models/dangling", "cannot be resolved");
        assert!(!dir.path().join("missing").exists());
        // A root that does not exist is named.
        let err = resolve_under(&dir.path().join("nope"), Path::new("a")).unwrap_err().to_string();
        assert!(err.contains("nope"), "{err}");
    }

    /// A tensor whose bytes cannot be read (here: sparse, no plain storage; on a GPU a
    /// failed device copy) fails the save with its name, and the file saved before stays.
    #[test]
    fn a_tensor_that_cannot_be_copied_fails_the_save_and_keeps_the_old_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("editor.safetensors");
        write_safetensors(&path, &[("w".into(), Tensor::ones([2, 3], (Kind::Float, Device::Cpu)))], HashMap::new()).unwrap();
        let before = std::fs::read(&path).unwrap();
        let sparse = Tensor::eye(4, (Kind::Float, Device::Cpu)).to_sparse(None, None::<i64>, None::<i64>);
        let err = write_safetensors(&path, &[("w".into(), Tensor::zeros([2, 3], (Kind::Float, Device::Cpu))), ("bad".into(), sparse)], HashMap::new())
            .unwrap_err()
            .to_string();
        assert!(err.contains("\"bad\"") && err.contains("editor.safetensors"), "{err}");
        assert_eq!(std::fs::read(&path).unwrap(), before);
        let left: Vec<_> = std::fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().file_name()).collect();
        assert_eq!(left.len(), 1, "{left:?}");
    }
}

/// Removes the temporary folders `{prefix}{pid}-...` in `parent` whose process is gone (an
/// interrupted `what`: a save, a conversion); those of a running process are left alone.
/// Whole-or-nothing writers put their folder together under such a name beside its target.
pub fn remove_stale_temp_dirs(parent: &Path, prefix: &str, what: &str) {
    let Ok(entries) = std::fs::read_dir(parent) else { return };
    for e in entries.flatten() {
        let file = e.file_name().to_string_lossy().into_owned();
        let Some(rest) = file.strip_prefix(prefix) else { continue };
        let pid = rest.split('-').next().and_then(|p| p.parse::<u32>().ok());
        let alive = pid.is_some_and(|p| p == std::process::id() || Path::new(&format!("/proc/{p}")).exists());
        if !alive {
            match std::fs::remove_dir_all(e.path()) {
                Ok(()) => tracing::info!(dir = %e.path().display(), "removed the temporary folder of an interrupted {what}"),
                Err(err) => tracing::warn!(dir = %e.path().display(), "cannot remove the temporary folder of an interrupted {what}: {err}"),
            }
        }
    }
}
