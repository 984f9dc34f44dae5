//! Long runs (train, evaluate, compare): the work on a worker thread, progress forwarded
//! to Python, Ctrl-C polled while the GIL is free.
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use pyo3::prelude::*;

use crate::{raise, OrPy};

/// Raised inside a run's progress callback when the caller pressed Ctrl-C; unwinds the
/// worker without the panic hook's message (`resume_unwind`).
struct Cancelled;

/// Runs `work` on a worker thread; this thread, without the GIL between polls, forwards
/// each progress event to `on_progress` and checks for Ctrl-C every 100 ms. On Ctrl-C the
/// `cancel` flag is raised, the worker stops at its next progress point, and the
/// `KeyboardInterrupt` is raised here once it has.
pub(crate) fn supervised<T: Send, E: Send>(
    py: Python<'_>,
    on_progress: &mut dyn FnMut(Python<'_>, E) -> PyResult<()>,
    on_cancel: &dyn Fn(),
    work: impl FnOnce(&AtomicBool, &crossbeam::channel::Sender<E>) -> dualedit::Result<T> + Send,
) -> PyResult<T> {
    let cancel = AtomicBool::new(false);
    let (tx, rx) = crossbeam::channel::unbounded::<E>();
    std::thread::scope(|scope| {
        let cancel = &cancel;
        let handle = scope.spawn(move || {
            dualedit::device::settle_threads();
            let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| work(cancel, &tx)));
            drop(tx);
            r
        });
        let mut interrupted: Option<PyErr> = None;
        loop {
            match py.allow_threads(|| rx.recv_timeout(Duration::from_millis(100))) {
                Ok(ev) => {
                    if interrupted.is_none() {
                        if let Err(e) = on_progress(py, ev) {
                            cancel.store(true, Ordering::SeqCst);
                            on_cancel();
                            interrupted = Some(e);
                        }
                    }
                }
                Err(crossbeam::channel::RecvTimeoutError::Timeout) => {}
                Err(crossbeam::channel::RecvTimeoutError::Disconnected) => break,
            }
            if interrupted.is_none() {
                if let Err(e) = py.check_signals() {
                    cancel.store(true, Ordering::SeqCst);
                    on_cancel();
                    interrupted = Some(e);
                }
            }
        }
        let result = py.allow_threads(|| handle.join());
        let result = match result {
            Ok(r) => r,
            Err(p) => Err(p),
        };
        match (result, interrupted) {
            (_, Some(e)) => Err(e),
            (Ok(r), None) => r.py(),
            (Err(payload), None) => {
                let msg = payload.downcast_ref::<String>().cloned().or_else(|| payload.downcast_ref::<&str>().map(|s| s.to_string()));
                Err(raise("TorchError", format!("internal error: {}", msg.unwrap_or_else(|| "panic".into()))))
            }
        }
    })
}

/// Ctrl-C during training: the loop ends after its current step, validated and saved
/// (resumable with `resume=True`); the `KeyboardInterrupt` is raised once it has.
pub(crate) fn stop_training() {
    dualedit::mend::train::STOP_REQUESTED.store(true, Ordering::SeqCst);
    eprintln!("stopping after the current training step: the editor and training state are saved (resume=True continues)");
}

/// A progress callback's check: unwinds the worker when the caller pressed Ctrl-C.
pub(crate) fn stop_if_cancelled(cancel: &AtomicBool) {
    if cancel.load(Ordering::SeqCst) {
        std::panic::resume_unwind(Box::new(Cancelled));
    }
}

/// Calls `progress(done, total, metrics_json)` when given (the Python side passes a tqdm
/// bar's or a plain printer's update); `total` is 0 when not known ahead.
pub(crate) fn call_progress(progress: Option<&Bound<'_, PyAny>>, done: usize, total: usize, info: &str) -> PyResult<()> {
    progress.map_or(Ok(()), |p| p.call1((done, total, info)).map(|_| ()))
}
