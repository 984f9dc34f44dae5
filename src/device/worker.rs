//! A worker thread for work that does not depend on the edit, so it overlaps with the
//! other device's work (the unedited model's locality logits, from the sub-device's
//! replica, while the main device captures gradients and runs the editor).
//!
//! The worker owns shallow clones of the frozen weights (same storage, no copy): tch
//! tensors are `Send` but not `Sync`, so each thread holds its own handles. Grad mode is
//! per thread in libtorch; the worker runs everything under `no_grad`.
//!
//! Under a layer split the worker runs the blocks from the boundary up (on the
//! sub-device) from boundary activations the main device computed, and leaves the logits
//! on the sub-device, where the losses are.
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Instant;

use crossbeam::channel::{bounded, Receiver, Sender};
use tch::Tensor;

use super::timeline::Timeline;
use crate::data::TokenBatch;
use crate::model::{Boundary, ForwardInput, Model, ParamStore, ParamView};
use crate::{Error, Result};

/// A batch, its boundary activations under a layer split, the micro-step it belongs to
/// (for the timeline), whether the last block runs at every position
/// ([`ForwardInput::full_last_block`]) and where to answer.
type Job = (TokenBatch, Option<Boundary>, (usize, usize), bool, Sender<Result<Tensor>>);

pub struct Worker {
    jobs: Option<Sender<Job>>,
    handle: Option<JoinHandle<()>>,
}

impl Worker {
    /// Starts a worker computing unedited logits of `model` with `params` (a replica on
    /// the sub-device, or a layer-split store), recording each job on `timeline` as the
    /// sub-device's "unedited forwards".
    pub fn spawn(model: Model, params: ParamStore, name: &str, timeline: Arc<Timeline>) -> Result<Self> {
        let (tx, rx) = bounded::<Job>(4);
        let handle = std::thread::Builder::new()
            .name(format!("dualedit-{name}"))
            .spawn(move || {
                super::settle_threads();
                let _g = tch::no_grad_guard();
                let none = Default::default();
                for (batch, entry, at, full_last_block, reply) in rx {
                    let start = Instant::now();
                    let view = ParamView::frozen(&params);
                    let input = ForwardInput { entry: entry.as_ref(), full_last_block, ..batch.forward_input(&none) };
                    let out = match &entry {
                        Some(_) => model.forward_to_head_side(&view, &input),
                        None => model.forward(&view, &input),
                    }
                    .map(|o| o.logits);
                    timeline.record(at, "sub", "unedited forwards", start, Instant::now());
                    let _ = reply.send(out);
                }
            })
            .map_err(|e| Error::Internal(format!("cannot start the {name} worker thread: {e}")))?;
        Ok(Self { jobs: Some(tx), handle: Some(handle) })
    }

    /// Queues a batch (with its boundary activations under a layer split) of micro-step
    /// `at`; the answer arrives on the returned channel.
    pub fn submit(&self, batch: TokenBatch, entry: Option<Boundary>, at: (usize, usize), full_last_block: bool) -> Result<Receiver<Result<Tensor>>> {
        let (tx, rx) = bounded(1);
        self.jobs
            .as_ref()
            .ok_or_else(|| Error::Internal("worker stopped".into()))?
            .send((batch, entry, at, full_last_block, tx))
            .map_err(|_| Error::Internal("worker thread has stopped".into()))?;
        Ok(rx)
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        // Closing the channel ends the worker's loop.
        self.jobs.take();
        if let Some(h) = self.handle.take() {
            let _ = h.join();
        }
    }
}

/// Waits for a submitted job's answer.
pub fn wait(rx: Receiver<Result<Tensor>>) -> Result<Tensor> {
    rx.recv().map_err(|_| Error::Internal("worker thread ended without an answer".into()))?
}
