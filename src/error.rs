//! The library's error type: one variant per kind of thing a caller can get wrong,
//! each carrying the file or value it concerns, so the CLI can print one clear line.
use std::path::{Path, PathBuf};

#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A file could not be read or written. (The I/O error is part of the message, not a
    /// `source`, so that `{:#}` chains print it once.)
    #[error("{}: {err}", path.display())]
    Io { path: PathBuf, err: std::io::Error },

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

    /// A broken internal invariant (a bug, not bad input and not a libtorch failure): a
    /// worker that stopped, a view or capture that should exist and does not.
    #[error("internal error: {0}")]
    Internal(String),
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
        Error::Io { path: path.as_ref().to_path_buf(), err: source }
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
            let first = panic_summary(&msg);
            if msg.contains("out of memory") || msg.contains("can't allocate") {
                Err(Error::OutOfMemory(first))
            } else {
                Err(Error::Torch(first))
            }
        }
    }
}

/// The libtorch message inside a tch panic, without the unwrap wrapper and the C++
/// backtrace. tch panics with "called Result::unwrap() on an Err value: Torch(...)", the
/// libtorch message inside escaped as by `{:?}` and followed by its backtrace.
fn panic_summary(msg: &str) -> String {
    let inner = msg.split_once("Torch(\"").map(|(_, rest)| rest).unwrap_or(msg);
    let end = [inner.find("\\n"), inner.find('\n'), inner.find("\")")].into_iter().flatten().min().unwrap_or(inner.len());
    inner[..end].trim().to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn panic_summary_keeps_the_libtorch_message_only() {
        let tch = r#"called `Result::unwrap()` on an `Err` value: Torch("CUDA error: out of memory\nSearch for `cudaErrorMemoryAllocation' in https://docs\nframe #0: c10::Error")"#;
        assert_eq!(panic_summary(tch), "CUDA error: out of memory");
        assert_eq!(panic_summary("plain message\nsecond line"), "plain message");
        let e = guard(|| -> Result<()> { panic!("{}", tch) }).unwrap_err();
        assert!(matches!(&e, Error::OutOfMemory(m) if m == "CUDA error: out of memory"), "{e}");
    }
}
