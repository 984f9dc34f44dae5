//! The library's error type: one variant per kind of thing a caller can get wrong,
//! each carrying the file or value it concerns, so the CLI can print one clear line.
use std::path::{Path, PathBuf};

#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A file could not be read or written.
    #[error("{}: {source}", path.display())]
    Io { path: PathBuf, source: std::io::Error },

    /// A file was read but its content is wrong (malformed JSON, missing key, bad shape, ...).
    #[error("{}: {msg}", path.display())]
    File { path: PathBuf, msg: String },

    /// A value given by the caller (flag, argument, request field) is invalid.
    #[error("{0}")]
    Input(String),

    /// A device name that does not parse or is not available on this machine.
    #[error("device {name:?}: {msg}")]
    Device { name: String, msg: String },

    /// An allocation failed on a device.
    #[error("out of memory: {0}")]
    OutOfMemory(String),

    /// Any other libtorch error.
    #[error("libtorch: {0}")]
    Torch(String),
}

impl From<tch::TchError> for Error {
    fn from(e: tch::TchError) -> Self {
        let msg = e.to_string();
        // libtorch's messages carry a C++ backtrace after the first line; keep the first line.
        let first = msg.lines().next().unwrap_or("").to_string();
        if msg.contains("out of memory") || msg.contains("DefaultCPUAllocator: can't allocate") {
            Error::OutOfMemory(first)
        } else {
            Error::Torch(first)
        }
    }
}

impl Error {
    pub fn io(path: impl AsRef<Path>, source: std::io::Error) -> Self {
        Error::Io { path: path.as_ref().to_path_buf(), source }
    }
    pub fn file(path: impl AsRef<Path>, msg: impl Into<String>) -> Self {
        Error::File { path: path.as_ref().to_path_buf(), msg: msg.into() }
    }
    pub fn input(msg: impl Into<String>) -> Self {
        Error::Input(msg.into())
    }
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

thread_local! {
    static IN_GUARD: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Runs `f`, turning a panic raised inside it into an [`Error`].
///
/// tch's tensor operations panic on libtorch errors (an allocation failure, a device
/// error); the fallible `f_*` variants exist but make model code unreadable. Shapes are
/// validated when a model is loaded, so what can still fail inside a forward pass is
/// the device: this guard turns those panics into `Error::OutOfMemory` / `Error::Torch`
/// and keeps the default panic hook from printing a backtrace for them.
pub fn guard<T>(f: impl FnOnce() -> Result<T>) -> Result<T> {
    static HOOK: std::sync::Once = std::sync::Once::new();
    HOOK.call_once(|| {
        let default = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            if !IN_GUARD.with(|g| g.get()) {
                default(info)
            }
        }));
    });
    let outer = IN_GUARD.with(|g| g.replace(true));
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f));
    IN_GUARD.with(|g| g.set(outer));
    match result {
        Ok(r) => r,
        Err(payload) => {
            let msg = payload
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| payload.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_else(|| "unknown panic".into());
            let first = msg.lines().next().unwrap_or("").to_string();
            if msg.contains("out of memory") || msg.contains("can't allocate") {
                Err(Error::OutOfMemory(first))
            } else {
                Err(Error::Torch(first))
            }
        }
    }
}
