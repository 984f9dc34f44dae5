//! When each phase of meta-training ran on which device: spans per micro-step, and how
//! much of the two devices' work overlapped (#23: "a timeline shows the overlap").
//!
//! The training thread runs its phases one after another; only the sub-device's worker
//! (the unedited locality logits, see [`super::worker`]) runs beside it, so overlap is the
//! time the worker's spans share with the training thread's. A span is attributed to the
//! device whose memory and compute the phase uses: `main` for the prefix below a layer
//! split's boundary, the editor and the optimiser; `sub` for the edited forwards (and the
//! capture under a layer split) when the run is split; everything is `main` on one device.
//! The backward goes through both (the edited forwards' backward on the sub-device, the
//! editor's on main) and is attributed to the sub-device when split.
//!
//! Spans of one thread nest (the prefix of a batch runs inside the capture or the edited
//! forwards that first need it): the summary gives each instant of a thread to its
//! innermost span, so a nested prefix on main is main's time, not overlap.
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::Instant;

use serde::Serialize;

/// One phase of one micro-step on one device, in seconds since the timeline started.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Span {
    /// Optimiser step (0-based) and micro-batch within it; the optimiser's own span has
    /// the step's last micro index + 1.
    pub step: usize,
    pub micro: usize,
    /// `main` or `sub`.
    pub device: &'static str,
    pub phase: &'static str,
    pub start_s: f64,
    pub end_s: f64,
    /// `train` (the training thread) or `worker` (the sub-device's worker).
    pub thread: &'static str,
    /// Nesting level within its thread (0: outermost).
    pub depth: usize,
}

/// Whether spans wait for the CUDA devices (`DUALEDIT_SYNC_SPANS=1`), read once.
fn sync_spans() -> bool {
    static SYNC: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *SYNC.get_or_init(|| std::env::var("DUALEDIT_SYNC_SPANS").is_ok_and(|v| v == "1"))
}

fn synchronize_cuda() {
    for i in 0..tch::Cuda::device_count() {
        tch::Cuda::synchronize(i);
    }
}

thread_local! {
    /// Open spans of this thread (for [`Span::depth`]).
    static DEPTH: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

/// Busy time per device, their overlap and the wall time the spans cover.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct TimelineSummary {
    /// Optimiser steps the spans cover.
    pub steps: usize,
    /// Seconds each device was busy (the union of its spans).
    pub busy_s: BTreeMap<String, f64>,
    /// Seconds both devices were busy at once.
    pub overlap_s: f64,
    /// From the first span's start to the last one's end.
    pub wall_s: f64,
    /// Per phase and device, seconds (`"sub/edited forwards"`), nested spans' time given to
    /// the innermost one.
    pub phase_s: BTreeMap<String, f64>,
    /// The above in one line.
    pub text: String,
}

/// A recorder of [`Span`]s, shared by the training thread and the sub-device's worker.
/// Records only while on ([`Timeline::set_on`]); a step's spans cost two clock reads each.
#[derive(Debug)]
pub struct Timeline {
    origin: Instant,
    on: AtomicBool,
    step: AtomicUsize,
    micro: AtomicUsize,
    spans: Mutex<Vec<Span>>,
}

impl Default for Timeline {
    fn default() -> Self {
        Self::new()
    }
}

impl Timeline {
    pub fn new() -> Self {
        Self { origin: Instant::now(), on: AtomicBool::new(false), step: AtomicUsize::new(0), micro: AtomicUsize::new(0), spans: Mutex::new(Vec::new()) }
    }

    /// Starts or stops recording.
    pub fn set_on(&self, on: bool) {
        self.on.store(on, Ordering::Relaxed);
    }

    /// The micro-step the next spans belong to.
    pub fn at(&self, step: usize, micro: usize) {
        self.step.store(step, Ordering::Relaxed);
        self.micro.store(micro, Ordering::Relaxed);
    }

    /// The current `(step, micro)`, for work handed to another thread.
    pub fn position(&self) -> (usize, usize) {
        (self.step.load(Ordering::Relaxed), self.micro.load(Ordering::Relaxed))
    }

    /// Runs `f` and records it as `phase` on `device`. CUDA runs asynchronously, so a
    /// span there times the launches, not the work, unless `DUALEDIT_SYNC_SPANS=1`, which
    /// waits for every CUDA device at each recorded span's start and end (slower: for
    /// profiling).
    pub fn span<T>(&self, device: &'static str, phase: &'static str, f: impl FnOnce() -> T) -> T {
        let depth = DEPTH.with(|d| {
            let v = d.get();
            d.set(v + 1);
            v
        });
        let sync = self.on.load(Ordering::Relaxed) && sync_spans();
        if sync {
            synchronize_cuda();
        }
        let start = Instant::now();
        let out = f();
        if sync {
            synchronize_cuda();
        }
        let end = Instant::now();
        DEPTH.with(|d| d.set(depth));
        self.push(self.position(), device, phase, (start, end), "train", depth);
        out
    }

    /// Records a span the sub-device's worker thread measured.
    pub fn record(&self, at: (usize, usize), device: &'static str, phase: &'static str, start: Instant, end: Instant) {
        self.push(at, device, phase, (start, end), "worker", 0);
    }

    fn push(&self, (step, micro): (usize, usize), device: &'static str, phase: &'static str, (start, end): (Instant, Instant), thread: &'static str, depth: usize) {
        if !self.on.load(Ordering::Relaxed) {
            return;
        }
        let s = |t: Instant| t.saturating_duration_since(self.origin).as_secs_f64();
        if let Ok(mut v) = self.spans.lock() {
            v.push(Span { step, micro, device, phase, start_s: s(start), end_s: s(end), thread, depth });
        }
    }

    pub fn spans(&self) -> Vec<Span> {
        let mut v = self.spans.lock().map(|v| v.clone()).unwrap_or_default();
        v.sort_by(|a, b| a.start_s.total_cmp(&b.start_s));
        v
    }

    pub fn summary(&self) -> TimelineSummary {
        summarise(&self.spans())
    }
}

/// Total length of the union of intervals.
fn union_len(mut iv: Vec<(f64, f64)>) -> f64 {
    iv.sort_by(|a, b| a.0.total_cmp(&b.0));
    let mut total = 0.0;
    let mut cur: Option<(f64, f64)> = None;
    for (s, e) in iv {
        match cur {
            Some((cs, ce)) if s <= ce => cur = Some((cs, ce.max(e))),
            Some((cs, ce)) => {
                total += ce - cs;
                cur = Some((s, e));
            }
            None => cur = Some((s, e)),
        }
    }
    total + cur.map_or(0.0, |(s, e)| e - s)
}

/// Each thread's time cut at every span boundary, each piece given to the innermost span
/// of that thread covering it: `(start, end, device, phase)`.
fn exclusive(spans: &[Span]) -> Vec<(f64, f64, &'static str, &'static str)> {
    let mut out = Vec::new();
    let threads: std::collections::BTreeSet<&str> = spans.iter().map(|s| s.thread).collect();
    for th in threads {
        let mine: Vec<&Span> = spans.iter().filter(|s| s.thread == th).collect();
        let mut cuts: Vec<f64> = mine.iter().flat_map(|s| [s.start_s, s.end_s]).collect();
        cuts.sort_by(f64::total_cmp);
        cuts.dedup();
        for w in cuts.windows(2) {
            let (a, b) = (w[0], w[1]);
            let inner = mine.iter().filter(|s| s.start_s <= a && s.end_s >= b).max_by_key(|s| s.depth);
            if let Some(s) = inner {
                out.push((a, b, s.device, s.phase));
            }
        }
    }
    out
}

/// Busy time per device (the union of its time, nested spans given to the innermost),
/// overlap (the sum of the devices' busy time minus the union of all) and wall time.
pub fn summarise(spans: &[Span]) -> TimelineSummary {
    let pieces = exclusive(spans);
    let mut by_dev: BTreeMap<String, Vec<(f64, f64)>> = BTreeMap::new();
    let mut phase_s: BTreeMap<String, f64> = BTreeMap::new();
    for &(a, b, device, phase) in &pieces {
        by_dev.entry(device.to_string()).or_default().push((a, b));
        *phase_s.entry(format!("{device}/{phase}")).or_default() += b - a;
    }
    let busy_s: BTreeMap<String, f64> = by_dev.iter().map(|(d, iv)| (d.clone(), union_len(iv.clone()))).collect();
    let all = union_len(pieces.iter().map(|p| (p.0, p.1)).collect());
    let overlap_s = (busy_s.values().sum::<f64>() - all).max(0.0);
    let wall_s = match (spans.iter().map(|s| s.start_s).reduce(f64::min), spans.iter().map(|s| s.end_s).reduce(f64::max)) {
        (Some(a), Some(b)) => b - a,
        _ => 0.0,
    };
    let steps = spans.iter().map(|s| s.step).collect::<std::collections::BTreeSet<_>>().len();
    let busy = busy_s.iter().map(|(d, b)| format!("{d} busy {b:.3} s")).collect::<Vec<_>>().join(", ");
    let text = format!("{steps} step(s): wall {wall_s:.3} s, {busy}, overlap {overlap_s:.3} s");
    TimelineSummary { steps, busy_s, overlap_s, wall_s, phase_s, text }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn span(device: &'static str, a: f64, b: f64) -> Span {
        let thread = if device == "sub" { "worker" } else { "train" };
        Span { step: 0, micro: 0, device, phase: "p", start_s: a, end_s: b, thread, depth: 0 }
    }

    #[test]
    fn overlap_is_the_time_both_devices_are_busy() {
        // main 0–1 and 2–3, sub 0.5–2.5: each device busy 2 s, together 1 s (0.5–1, 2–2.5).
        let s = summarise(&[span("main", 0.0, 1.0), span("main", 2.0, 3.0), span("sub", 0.5, 2.5)]);
        assert!((s.busy_s["main"] - 2.0).abs() < 1e-12 && (s.busy_s["sub"] - 2.0).abs() < 1e-12);
        assert!((s.overlap_s - 1.0).abs() < 1e-12, "{s:?}");
        assert!((s.wall_s - 3.0).abs() < 1e-12);
        // Sequential spans: no overlap, and nested spans of one device count once.
        let nested = Span { depth: 1, ..span("main", 0.2, 0.4) };
        let s = summarise(&[span("main", 0.0, 1.0), nested, span("sub", 1.0, 2.0)]);
        assert!(s.overlap_s.abs() < 1e-12 && (s.busy_s["main"] - 1.0).abs() < 1e-12, "{s:?}");
        // A main-device prefix nested in a sub-device phase of the same thread is main's
        // time, not overlap: sub 0–1 with main 0.2–0.5 inside gives main 0.3, sub 0.7.
        let outer = Span { thread: "train", ..span("sub", 0.0, 1.0) };
        let inner = Span { depth: 1, phase: "prefix", ..span("main", 0.2, 0.5) };
        let s = summarise(&[outer, inner]);
        assert!((s.busy_s["main"] - 0.3).abs() < 1e-12 && (s.busy_s["sub"] - 0.7).abs() < 1e-12 && s.overlap_s.abs() < 1e-12, "{s:?}");
        assert!((s.phase_s["main/prefix"] - 0.3).abs() < 1e-12);
    }
}
