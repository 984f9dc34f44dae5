//! The batch mover: the one component that carries tensors between the main device and
//! the sub-device, and counts what it carried.
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde::Serialize;
use tch::{Device, Tensor};

use crate::data::TokenBatch;

/// Bytes, transfers and time moved in each direction.
#[derive(Debug, Clone, Default, Serialize, PartialEq)]
pub struct MoverStats {
    pub bytes_to_sub: u64,
    pub bytes_to_main: u64,
    pub transfers: u64,
    pub seconds: f64,
    /// Of `bytes_to_sub`: a layer split's hidden states entering the boundary block
    /// (`[B, T, D]` each), and how many times they crossed. With the prefix computed once
    /// per batch ([`crate::model::Model::prefix`]) that is once per distinct batch.
    pub boundary_bytes: u64,
    pub boundary_crossings: u64,
    /// A layer split over a chain of devices (`--sub-device a,b,c`): every crossing of
    /// the chain in order, the last (into the last device) included. Empty otherwise.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub crossings: Vec<CrossingStats>,
}

/// What one crossing of a chain carried: from the device holding the blocks below `at`
/// to the one holding block `at`. The prefix below the first edited block runs without
/// grad, so no gradient crosses back on a chain's crossing: the backward stays on the
/// last device, and only the factors and the edit's terms travel between it and main
/// (`bytes_to_main` / `bytes_to_sub`).
#[derive(Debug, Clone, Default, Serialize, PartialEq)]
pub struct CrossingStats {
    pub from: String,
    pub to: String,
    /// The first block on `to`.
    pub at: usize,
    /// Hidden states `[B, T, D]` entering block `at` (forward), and how many times.
    pub boundary_bytes: u64,
    pub boundary_crossings: u64,
    /// Everything else carried to `to` by this crossing: the blocks' weights once at setup
    /// (the last crossing's are in `bytes_to_sub`), the mask and rotary tables per batch.
    pub other_bytes: u64,
}

/// One crossing of a chain between main and the last device (the last crossing is the
/// [`Mover`] itself): carries to `to` and counts.
#[derive(Debug)]
struct HopCounter {
    from: String,
    to: String,
    device: Device,
    at: usize,
    bytes: AtomicU64,
    boundary_bytes: AtomicU64,
    boundary_crossings: AtomicU64,
}

#[derive(Debug)]
pub struct Mover {
    main: Device,
    sub: Device,
    /// Copy even between equal devices (a split plan on one device, used by tests to run
    /// the dual-device path on CPU).
    split: bool,
    bytes_to_sub: AtomicU64,
    bytes_to_main: AtomicU64,
    transfers: AtomicU64,
    time: Mutex<Duration>,
    boundary_bytes: AtomicU64,
    boundary_crossings: AtomicU64,
    /// A chain's crossings before the last ([`Mover::hop`]).
    hops: Vec<HopCounter>,
    /// The last crossing as named in the stats: `(from, to, at)` under a layer split.
    last: Option<(String, String, usize)>,
}

fn nbytes(t: &Tensor) -> u64 {
    (t.numel() * t.kind().elt_size_in_bytes()) as u64
}

impl Mover {
    pub fn new(plan: &super::DevicePlan) -> Self {
        let mut from = plan.main_name();
        let mut hops = Vec::with_capacity(plan.chain.len());
        for (d, at) in plan.chain.names().iter().zip(plan.chain.at()) {
            hops.push(HopCounter {
                from: std::mem::replace(&mut from, d.to_string()),
                to: d.to_string(),
                device: d.device(),
                at: *at,
                bytes: AtomicU64::new(0),
                boundary_bytes: AtomicU64::new(0),
                boundary_crossings: AtomicU64::new(0),
            });
        }
        let last = plan.boundary.map(|at| (from, plan.sub_name(), at));
        Self {
            hops,
            last,
            main: plan.main,
            sub: plan.sub,
            split: plan.split,
            bytes_to_sub: AtomicU64::new(0),
            bytes_to_main: AtomicU64::new(0),
            transfers: AtomicU64::new(0),
            time: Mutex::new(Duration::ZERO),
            boundary_bytes: AtomicU64::new(0),
            boundary_crossings: AtomicU64::new(0),
        }
    }

    pub fn main(&self) -> Device {
        self.main
    }

    pub fn sub(&self) -> Device {
        self.sub
    }

    /// The crossing into the chain's device `i` (0: the first after main), for
    /// `ParamStore::add_hop`.
    pub fn hop(self: &Arc<Self>, i: usize) -> Option<Arc<dyn crate::model::Crossing>> {
        (i < self.hops.len()).then(|| Arc::new(Hop { mover: self.clone(), i }) as Arc<dyn crate::model::Crossing>)
    }

    fn carry(&self, t: &Tensor, to: Device, counter: &AtomicU64) -> Tensor {
        if !self.split {
            return t.shallow_clone();
        }
        let start = Instant::now();
        // Non-blocking only from/to CUDA; autograd records the copy, so gradients flow back.
        let non_blocking = matches!(to, Device::Cuda(_)) && matches!(t.device(), Device::Cuda(_));
        let out = t.to_device_(to, t.kind(), non_blocking, true);
        counter.fetch_add(nbytes(t), Ordering::Relaxed);
        self.transfers.fetch_add(1, Ordering::Relaxed);
        if let Ok(mut d) = self.time.lock() {
            *d += start.elapsed();
        }
        out
    }

    /// Puts a tensor (an edited weight, a batch tensor) on the sub-device.
    pub fn to_sub(&self, t: &Tensor) -> Tensor {
        self.carry(t, self.sub, &self.bytes_to_sub)
    }

    /// Brings a tensor (logits) back to the main device.
    pub fn to_main(&self, t: &Tensor) -> Tensor {
        self.carry(t, self.main, &self.bytes_to_main)
    }

    pub fn batch_to_sub(&self, b: &TokenBatch) -> TokenBatch {
        TokenBatch {
            input_ids: self.to_sub(&b.input_ids),
            attention_mask: self.to_sub(&b.attention_mask),
            targets: self.to_sub(&b.targets),
            keep: self.to_sub(&b.keep),
            padded: b.padded,
            position_ids: b.position_ids.as_ref().map(|t| self.to_sub(t)),
            image_embeds: b.image_embeds.as_ref().map(|t| self.to_sub(t)),
            prefix: Default::default(),
        }
    }

    pub fn stats(&self) -> MoverStats {
        MoverStats {
            bytes_to_sub: self.bytes_to_sub.load(Ordering::Relaxed),
            bytes_to_main: self.bytes_to_main.load(Ordering::Relaxed),
            transfers: self.transfers.load(Ordering::Relaxed),
            seconds: self.time.lock().map(|d| d.as_secs_f64()).unwrap_or(0.0),
            boundary_bytes: self.boundary_bytes.load(Ordering::Relaxed),
            boundary_crossings: self.boundary_crossings.load(Ordering::Relaxed),
            crossings: self.crossing_stats(),
        }
    }

    /// Every crossing of a chain, the last one included (empty without a chain).
    fn crossing_stats(&self) -> Vec<CrossingStats> {
        if self.hops.is_empty() {
            return Vec::new();
        }
        let mut out: Vec<CrossingStats> = self
            .hops
            .iter()
            .map(|h| {
                let boundary = h.boundary_bytes.load(Ordering::Relaxed);
                CrossingStats {
                    from: h.from.clone(),
                    to: h.to.clone(),
                    at: h.at,
                    boundary_bytes: boundary,
                    boundary_crossings: h.boundary_crossings.load(Ordering::Relaxed),
                    other_bytes: h.bytes.load(Ordering::Relaxed) - boundary,
                }
            })
            .collect();
        if let Some((from, to, at)) = &self.last {
            let boundary = self.boundary_bytes.load(Ordering::Relaxed);
            out.push(CrossingStats {
                from: from.clone(),
                to: to.clone(),
                at: *at,
                boundary_bytes: boundary,
                boundary_crossings: self.boundary_crossings.load(Ordering::Relaxed),
                other_bytes: self.bytes_to_sub.load(Ordering::Relaxed).saturating_sub(boundary),
            });
        }
        out
    }
}

/// A crossing of a chain before the last: carries to its device (always a copy: a chain
/// is a split, logical CPU devices included) and counts in its own [`CrossingStats`].
#[derive(Debug)]
struct Hop {
    mover: Arc<Mover>,
    i: usize,
}

impl crate::model::Crossing for Hop {
    fn to_sub(&self, t: &Tensor) -> Tensor {
        let h = &self.mover.hops[self.i];
        self.mover.carry(t, h.device, &h.bytes)
    }

    fn to_main(&self, t: &Tensor) -> Tensor {
        Mover::to_main(&self.mover, t)
    }

    fn boundary_to_sub(&self, t: &Tensor) -> Tensor {
        let h = &self.mover.hops[self.i];
        h.boundary_bytes.fetch_add(nbytes(t), Ordering::Relaxed);
        h.boundary_crossings.fetch_add(1, Ordering::Relaxed);
        self.to_sub(t)
    }
}

/// The mover carries a layer split's boundary activations (see
/// [`crate::model::LayerSplit`]), counted like everything else it carries.
impl crate::model::Crossing for Mover {
    fn to_sub(&self, t: &Tensor) -> Tensor {
        Mover::to_sub(self, t)
    }

    fn to_main(&self, t: &Tensor) -> Tensor {
        Mover::to_main(self, t)
    }

    fn boundary_to_sub(&self, t: &Tensor) -> Tensor {
        if self.split {
            self.boundary_bytes.fetch_add(nbytes(t), Ordering::Relaxed);
            self.boundary_crossings.fetch_add(1, Ordering::Relaxed);
        }
        Mover::to_sub(self, t)
    }
}
