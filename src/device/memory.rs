//! Memory accounting: current and peak bytes per device, sampled at phase boundaries and
//! (for a run) at a steady interval in between.
//!
//! * CUDA devices report the caching allocator's own statistics (what
//!   `torch.cuda.max_memory_allocated` and friends report). tch exposes none of them, so
//!   they come from the C++ shim `csrc/memstats.cpp` (compiled and linked by `build.rs`);
//!   the FFI calls below are the crate's only `unsafe` code.
//! * The CPU has no allocator statistics in libtorch, so it reports the process's resident
//!   set from `/proc/self/status` (`VmRSS` current, `VmHWM` peak) for both "allocated" and
//!   "reserved", marked `process_wide` because it also counts code, libraries and every
//!   other thread's memory.
//!
//! Asking for a CUDA device on a machine without an accelerator is an error
//! ([`Error::Device`] with "no accelerator available"), never a zero sample: a zero would
//! read as "this phase used no memory" in a report.
use std::collections::{BTreeMap, HashMap};
use std::ffi::{c_char, c_int, CStr};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use tch::Device;

use crate::{Error, Result};

mod ffi {
    use std::ffi::{c_char, c_int};

    // Implemented in csrc/memstats.cpp. Every function catches C++ exceptions and turns
    // them into return codes (1 ok, 0 no accelerator, -1 error with a NUL-terminated
    // message written into `err[..err_len]`), so no unwinding crosses into Rust.
    extern "C" {
        pub fn dualedit_accelerator_count() -> c_int;
        pub fn dualedit_accelerator_stats(
            device_index: c_int,
            out: *mut i64,
            err: *mut c_char,
            err_len: usize,
        ) -> c_int;
        pub fn dualedit_accelerator_reset_peak(device_index: c_int, err: *mut c_char, err_len: usize) -> c_int;
        pub fn dualedit_accelerator_empty_cache(err: *mut c_char, err_len: usize) -> c_int;
        pub fn dualedit_accelerator_total_bytes(device_index: c_int, out: *mut i64, err: *mut c_char, err_len: usize) -> c_int;
        // csrc/memcap.cpp (0: built without the CUDA allocator headers, or no CUDA).
        pub fn dualedit_cuda_cap_is_per_device() -> c_int;
        pub fn dualedit_cuda_set_memory_fraction(device_index: c_int, fraction: f64, err: *mut c_char, err_len: usize) -> c_int;
        pub fn dualedit_accelerator_set_global_fraction(fraction: f64, err: *mut c_char, err_len: usize) -> c_int;
    }
}

/// Size of the buffer the shim writes error messages into (longer ones are truncated).
const ERR_LEN: usize = 512;

/// Runs one shim call that reports errors through a message buffer.
/// `Ok(true)`: done; `Ok(false)`: no accelerator on this machine; `Err(msg)`: the shim's error.
fn shim_call(f: impl FnOnce(*mut c_char, usize) -> c_int) -> std::result::Result<bool, String> {
    let mut err = [0u8; ERR_LEN];
    match f(err.as_mut_ptr().cast::<c_char>(), err.len()) {
        1 => Ok(true),
        0 => Ok(false),
        _ => {
            let msg = CStr::from_bytes_until_nul(&err)
                .map(|s| s.to_string_lossy().into_owned())
                .unwrap_or_default();
            Err(if msg.is_empty() { "unknown error in the memory-statistics shim".into() } else { msg })
        }
    }
}

/// Number of accelerator (CUDA) devices libtorch sees; 0 on a CPU-only machine.
pub fn accelerator_count() -> usize {
    // SAFETY: no arguments; the shim catches every exception and returns a plain int.
    let n = unsafe { ffi::dualedit_accelerator_count() };
    usize::try_from(n).unwrap_or(0)
}

/// Releases the caching allocator's unused blocks back to the device, so that "reserved"
/// figures of the next phase start from what is really in use. A no-op without an
/// accelerator; a failure is only logged, since it changes no result.
pub fn empty_cache() {
    // SAFETY: `err`/`len` describe a live, writable buffer owned by `shim_call`.
    let r = shim_call(|err, len| unsafe { ffi::dualedit_accelerator_empty_cache(err, len) });
    if let Err(msg) = r {
        tracing::warn!(error = %msg, "emptying the accelerator cache failed");
    }
}

/// "cpu", "cuda:N", "mps", "vulkan": the names used in reports and error messages.
pub fn device_name(d: Device) -> String {
    match d {
        Device::Cpu => "cpu".into(),
        Device::Cuda(i) => format!("cuda:{i}"),
        Device::Mps => "mps".into(),
        Device::Vulkan => "vulkan".into(),
    }
}

/// Human-readable binary size: "1.23 GiB", "512.0 MiB", "12.0 KiB", "100 B".
pub fn format_bytes(b: u64) -> String {
    const KIB: f64 = 1024.0;
    const MIB: f64 = KIB * 1024.0;
    const GIB: f64 = MIB * 1024.0;
    let f = b as f64;
    if f >= GIB {
        format!("{:.2} GiB", f / GIB)
    } else if f >= MIB {
        format!("{:.1} MiB", f / MIB)
    } else if f >= KIB {
        format!("{:.1} KiB", f / KIB)
    } else {
        format!("{b} B")
    }
}

/// One reading of a device's memory, in bytes.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Default)]
pub struct MemorySample {
    pub current_allocated_bytes: u64,
    pub peak_allocated_bytes: u64,
    pub current_reserved_bytes: u64,
    pub peak_reserved_bytes: u64,
    /// True for the CPU: the figures are the whole process's resident set, not tensors only.
    pub process_wide: bool,
}

/// Reads the current memory figures of `device` (peaks since the last [`reset_peak`]).
pub fn sample(device: Device) -> Result<MemorySample> {
    match device {
        Device::Cpu => cpu_sample(),
        Device::Cuda(i) => {
            let index = accelerator_index(device, i)?;
            let mut out = [0i64; 4];
            // SAFETY: `out` holds the 4 values the shim writes; `err`/`len` describe a live
            // buffer owned by `shim_call`.
            let r = shim_call(|err, len| unsafe {
                ffi::dualedit_accelerator_stats(index, out.as_mut_ptr(), err, len)
            });
            match r {
                Ok(true) => {
                    let [a, ap, r, rp] = out.map(|v| u64::try_from(v).unwrap_or(0));
                    Ok(MemorySample {
                        current_allocated_bytes: a,
                        peak_allocated_bytes: ap,
                        current_reserved_bytes: r,
                        peak_reserved_bytes: rp,
                        process_wide: false,
                    })
                }
                Ok(false) => Err(no_accelerator(device)),
                Err(msg) => Err(device_error(device, msg)),
            }
        }
        other => Err(unsupported(other)),
    }
}

/// Resets the peaks of `device` to its current figures, so the next sample's peak covers
/// only what happened since. On the CPU this writes "5" to `/proc/self/clear_refs`
/// (resets `VmHWM`); where that is not permitted the peak stays process-lifetime, which
/// is logged and not an error, since the figures stay correct, only coarser.
pub fn reset_peak(device: Device) -> Result<()> {
    match device {
        Device::Cpu => {
            if let Err(e) = std::fs::write("/proc/self/clear_refs", "5") {
                tracing::debug!(error = %e, "cannot reset the process peak RSS; CPU peaks stay process-lifetime");
            }
            Ok(())
        }
        Device::Cuda(i) => {
            let index = accelerator_index(device, i)?;
            // SAFETY: `err`/`len` describe a live, writable buffer owned by `shim_call`.
            match shim_call(|err, len| unsafe { ffi::dualedit_accelerator_reset_peak(index, err, len) }) {
                Ok(true) => Ok(()),
                Ok(false) => Err(no_accelerator(device)),
                Err(msg) => Err(device_error(device, msg)),
            }
        }
        other => Err(unsupported(other)),
    }
}

/// The machine's memory (`MemTotal` of `/proc/meminfo`): what the CPU devices share, the
/// planner's capacity for them when `--max-memory` names none. `None` where it cannot be
/// read (not Linux).
pub fn host_total_bytes() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemTotal:"))?;
    let kib: u64 = line.trim_start_matches("MemTotal:").trim().trim_end_matches("kB").trim().parse().ok()?;
    (kib > 0).then_some(kib * 1024)
}

/// Total bytes of a CUDA device as its allocator sees it (`cudaMemGetInfo`'s total).
pub fn total_bytes(device: Device) -> Result<u64> {
    match device {
        Device::Cuda(i) => {
            let index = accelerator_index(device, i)?;
            let mut out = 0i64;
            // SAFETY: `out` is a live i64 the shim writes; `err`/`len` as in `shim_call`.
            match shim_call(|err, len| unsafe { ffi::dualedit_accelerator_total_bytes(index, &mut out, err, len) }) {
                Ok(true) => Ok(u64::try_from(out).unwrap_or(0)),
                Ok(false) => Err(no_accelerator(device)),
                Err(msg) => Err(device_error(device, msg)),
            }
        }
        other => Err(device_error(other, "total memory is known for cuda devices only")),
    }
}

/// Caps what libtorch's CUDA caching allocator may hold on `device` at `bytes`, as
/// `torch.cuda.set_per_process_memory_fraction(bytes / total, device)` does: beyond it
/// an allocation fails with CUDA's out-of-memory error, so a large card reproduces a
/// smaller card's OOM. The CPU cannot be capped (the planner still plans against a CPU
/// cap); that is logged, not an error.
pub fn set_memory_cap(device: Device, bytes: u64) -> Result<()> {
    let Device::Cuda(i) = device else {
        tracing::warn!(device = %device_name(device), "`max_memory` is not enforced on the CPU; the planner still plans against it");
        return Ok(());
    };
    let index = accelerator_index(device, i)?;
    // The allocator of a device exists once the device is used: allocate once first.
    let _ = crate::error::guard(|| Ok(tch::Tensor::f_zeros([1], (tch::Kind::Float, device))?))?;
    let total = total_bytes(device)?;
    if bytes > total {
        return Err(device_error(device, format!("`max_memory` cap {} is more than the device has ({})", format_bytes(bytes), format_bytes(total))));
    }
    let fraction = bytes as f64 / total as f64;
    // SAFETY: `err`/`len` describe a live, writable buffer owned by `shim_call`.
    match shim_call(|err, len| unsafe { ffi::dualedit_cuda_set_memory_fraction(index, fraction, err, len) }) {
        Ok(true) => {
            tracing::info!(device = %device_name(device), cap = %format_bytes(bytes), fraction, "CUDA caching allocator capped");
            Ok(())
        }
        Ok(false) => set_global_fraction(device, fraction),
        Err(msg) => Err(device_error(device, msg)),
    }
}

/// Whether this build caps each CUDA device on its own (built with complete CUDA runtime
/// headers) rather than every device with one fraction.
pub fn per_device_caps() -> bool {
    // SAFETY: takes no arguments and only returns a constant.
    unsafe { ffi::dualedit_cuda_cap_is_per_device() == 1 }
}

/// The fraction set through the allocator's settings (one for every device), if any.
static GLOBAL_FRACTION: std::sync::Mutex<Option<f64>> = std::sync::Mutex::new(None);

/// Without the per-device setter (a build without the CUDA runtime headers), the
/// allocator's `per_process_memory_fraction` setting, which applies to every device: caps
/// that need different fractions on different devices are refused.
fn set_global_fraction(device: Device, fraction: f64) -> Result<()> {
    let mut set = GLOBAL_FRACTION.lock().map_err(|_| device_error(device, "memory cap state poisoned"))?;
    if let Some(f) = *set {
        if (f - fraction).abs() > 0.01 * f {
            return Err(device_error(
                device,
                format!("this build caps every device with one fraction of its memory (built without the CUDA runtime headers for a per-device cap): {f:.3} was set, this device needs {fraction:.3}"),
            ));
        }
        return Ok(());
    }
    // SAFETY: `err`/`len` describe a live, writable buffer owned by `shim_call`.
    match shim_call(|err, len| unsafe { ffi::dualedit_accelerator_set_global_fraction(fraction, err, len) }) {
        Ok(true) => {
            *set = Some(fraction);
            tracing::info!(device = %device_name(device), fraction, "CUDA caching allocator capped (one fraction for every device)");
            Ok(())
        }
        Ok(false) => Err(no_accelerator(device)),
        Err(msg) => Err(device_error(device, msg)),
    }
}

/// The caps `--max-memory` gave this process ([`apply_caps`]), for the out-of-memory
/// diagnosis, which asks the planner what fits them.
static APPLIED_CAPS: std::sync::Mutex<Option<super::MaxMemory>> = std::sync::Mutex::new(None);

/// The caps applied by [`apply_caps`] (empty when none were).
pub fn applied_caps() -> super::MaxMemory {
    APPLIED_CAPS.lock().ok().and_then(|c| c.clone()).unwrap_or_default()
}

/// Applies every cap of `--max-memory` ([`set_memory_cap`]).
pub fn apply_caps(caps: &super::MaxMemory) -> Result<()> {
    if let Ok(mut c) = APPLIED_CAPS.lock() {
        *c = Some(caps.clone());
    }
    for (dev, bytes) in caps.iter() {
        set_memory_cap(dev.device(), bytes)?;
    }
    Ok(())
}

fn device_error(device: Device, msg: impl Into<String>) -> Error {
    Error::Device { name: device_name(device), msg: msg.into() }
}

fn no_accelerator(device: Device) -> Error {
    device_error(device, "no accelerator available")
}

fn unsupported(device: Device) -> Error {
    device_error(device, "memory statistics are available for cpu and cuda devices only")
}

/// Checks `i` against the devices present, so a wrong index gets a clear message rather
/// than whatever the runtime throws.
fn accelerator_index(device: Device, i: usize) -> Result<c_int> {
    match accelerator_count() {
        0 => Err(no_accelerator(device)),
        n if i >= n => Err(device_error(device, format!("only {n} accelerator device(s) present"))),
        _ => Ok(i as c_int),
    }
}

const PROC_STATUS: &str = "/proc/self/status";

fn cpu_sample() -> Result<MemorySample> {
    if !cfg!(target_os = "linux") {
        return Err(device_error(Device::Cpu, "process memory statistics need Linux (/proc/self/status)"));
    }
    let text = std::fs::read_to_string(PROC_STATUS).map_err(|e| Error::io(PROC_STATUS, e))?;
    let current = status_kib(&text, "VmRSS")? * 1024;
    // The kernel reports VmHWM >= VmRSS; the max only guards against odd kernels.
    let peak = (status_kib(&text, "VmHWM")? * 1024).max(current);
    Ok(MemorySample {
        current_allocated_bytes: current,
        peak_allocated_bytes: peak,
        current_reserved_bytes: current,
        peak_reserved_bytes: peak,
        process_wide: true,
    })
}

/// Parses a `Key:   1234 kB` line of /proc/self/status.
fn status_kib(text: &str, key: &str) -> Result<u64> {
    text.lines()
        .find_map(|l| l.strip_prefix(key)?.strip_prefix(':'))
        .and_then(|rest| rest.trim().strip_suffix("kB")?.trim().parse().ok())
        .ok_or_else(|| Error::file(PROC_STATUS, format!("no readable {key} line")))
}

/// One role's memory at one phase boundary.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct PhaseSample {
    pub phase: String,
    pub role: String,
    pub device: String,
    /// Milliseconds since the tracker was created.
    pub elapsed_ms: f64,
    pub sample: MemorySample,
}

/// A role's figures over a whole run: peaks are maxima over the timeline, current is the
/// last sample.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct RoleSummary {
    pub device: String,
    pub peak_allocated_bytes: u64,
    pub peak_reserved_bytes: u64,
    pub current_allocated_bytes: u64,
    pub process_wide: bool,
}

/// The phase name of samples the sampler thread takes between phase marks
/// ([`MemoryTracker::sampled`]); charts draw no boundary for them.
pub const SAMPLED_PHASE: &str = "sampled";

/// The phase of the sample [`MemoryTracker::finish`] takes as a run's report is written.
pub const END_PHASE: &str = "end";

/// How often the sampler reads the devices at first ([`MemoryTracker::sampled`]).
pub const SAMPLE_INTERVAL: Duration = Duration::from_millis(250);

/// Sampled entries per role kept before the sampler thins them out: every second one is
/// dropped and the interval doubles, so a run of any length keeps an even, bounded picture
/// (a 12-minute run at 250 ms would otherwise hold 2 880 samples per role, a day 345 600).
pub const MAX_SAMPLED_PER_ROLE: usize = 2000;

/// What the tracker and its sampler thread share.
#[derive(Debug)]
struct Shared {
    timeline: Mutex<Vec<PhaseSample>>,
    stop: Mutex<bool>,
    wake: Condvar,
}

/// Records memory samples at named phase boundaries (load, edit, forward, ...) for a set
/// of roles ("main", "editor", ...), each living on a device. Roles sharing a device are
/// sampled once per mark, so they report the same figures for the same instant.
///
/// A tracker made with [`MemoryTracker::sampled`] also reads the devices from a thread at
/// a steady interval (phase [`SAMPLED_PHASE`]), so its timeline covers the whole run, not
/// only the instants a phase ended: a long step or evaluation between two marks would
/// otherwise be a straight line on the chart, and the chart would end at the last mark.
#[derive(Debug)]
pub struct MemoryTracker {
    roles: Vec<(String, Device)>,
    start: Instant,
    shared: Arc<Shared>,
    sampler: Option<JoinHandle<()>>,
}

/// One entry per role, devices read once each. Either every role is recorded or, on an
/// error, none.
/// Inserts one instant's entries (all with the same `elapsed_ms`) keeping the timeline in
/// time order: the sampler thread and the phase marks each take their time before they
/// read the devices and lock the timeline, so either may arrive second with the earlier time.
fn insert_in_time_order(tl: &mut Vec<PhaseSample>, entries: Vec<PhaseSample>) {
    let Some(ms) = entries.first().map(|e| e.elapsed_ms) else { return };
    let at = tl.partition_point(|p| p.elapsed_ms <= ms);
    tl.splice(at..at, entries);
}

fn read_roles(roles: &[(String, Device)], phase: &str, elapsed_ms: f64) -> Result<Vec<PhaseSample>> {
    let mut by_device: HashMap<Device, MemorySample> = HashMap::new();
    let mut entries = Vec::with_capacity(roles.len());
    for (role, device) in roles {
        let s = match by_device.get(device) {
            Some(s) => *s,
            None => {
                let s = sample(*device)?;
                by_device.insert(*device, s);
                s
            }
        };
        entries.push(PhaseSample { phase: phase.to_string(), role: role.clone(), device: device_name(*device), elapsed_ms, sample: s });
    }
    Ok(entries)
}

impl MemoryTracker {
    /// A tracker that samples at phase marks only.
    ///
    /// Its figures cover its own run: the caching allocator's unused blocks are released
    /// and the devices' peaks reset first. Without that, the second run in one process
    /// (`compare`'s dual side after its single side) reported the first run's peak as its
    /// own: on an H200 the layer split's main-device peak read exactly the single run's.
    /// Accelerators only: the CPU's peak is the process's resident set, which tests running
    /// side by side in one process share. A failed reset is logged; the peaks are then
    /// process-lifetime, as before.
    pub fn new(roles: &[(&str, Device)]) -> Self {
        let t = Self {
            roles: roles.iter().map(|&(r, d)| (r.to_string(), d)).collect(),
            start: Instant::now(),
            shared: Arc::new(Shared { timeline: Mutex::new(Vec::new()), stop: Mutex::new(false), wake: Condvar::new() }),
            sampler: None,
        };
        let mut accelerators: Vec<Device> = t.roles.iter().map(|(_, d)| *d).filter(|d| *d != Device::Cpu).collect();
        accelerators.dedup();
        if !accelerators.is_empty() {
            empty_cache();
        }
        for d in accelerators {
            if let Err(e) = reset_peak(d) {
                tracing::warn!(error = %e, device = %device_name(d), "could not reset the device's peak memory; its peak covers the whole process");
            }
        }
        t
    }

    /// A tracker that also samples every [`SAMPLE_INTERVAL`] (thinned out past
    /// [`MAX_SAMPLED_PER_ROLE`]) from a thread, until it is dropped. A sampler that cannot
    /// start or read a device is logged and stops; the phase marks go on.
    /// `DUALEDIT_SAMPLE_MS` changes the interval (tests of sub-second runs use it).
    pub fn sampled(roles: &[(&str, Device)]) -> Self {
        let ms = std::env::var("DUALEDIT_SAMPLE_MS").ok().and_then(|v| v.parse::<u64>().ok()).filter(|&ms| ms > 0);
        Self::sampled_every(roles, ms.map_or(SAMPLE_INTERVAL, Duration::from_millis))
    }

    /// [`MemoryTracker::sampled`] with another first interval.
    pub fn sampled_every(roles: &[(&str, Device)], interval: Duration) -> Self {
        let mut t = Self::new(roles);
        let (shared, roles, start) = (t.shared.clone(), t.roles.clone(), t.start);
        let spawned = std::thread::Builder::new().name("dualedit-memory".into()).spawn(move || {
            let mut every = interval;
            let mut taken = 0usize;
            loop {
                {
                    let Ok(stop) = shared.stop.lock() else { return };
                    let Ok((stop, _)) = shared.wake.wait_timeout_while(stop, every, |s| !*s) else { return };
                    if *stop {
                        return;
                    }
                }
                let entries = match read_roles(&roles, SAMPLED_PHASE, start.elapsed().as_secs_f64() * 1e3) {
                    Ok(e) => e,
                    Err(e) => {
                        tracing::warn!(error = %e, "memory sampler stopped; the timeline keeps the phase marks only");
                        return;
                    }
                };
                let Ok(mut tl) = shared.timeline.lock() else { return };
                insert_in_time_order(&mut tl, entries);
                taken += 1;
                if taken > MAX_SAMPLED_PER_ROLE {
                    // Keep every second sampled instant (all roles of an instant together).
                    let mut nth = 0usize;
                    let mut last_ms = f64::NAN;
                    tl.retain(|p| {
                        if p.phase != SAMPLED_PHASE {
                            return true;
                        }
                        if p.elapsed_ms != last_ms {
                            last_ms = p.elapsed_ms;
                            nth += 1;
                        }
                        nth % 2 == 0
                    });
                    taken /= 2;
                    every *= 2;
                }
            }
        });
        match spawned {
            Ok(h) => t.sampler = Some(h),
            Err(e) => tracing::warn!(error = %e, "memory sampler not started; the timeline has the phase marks only"),
        }
        t
    }

    /// Samples every role's device and appends one entry per role. Either all roles are
    /// recorded for `phase` or, on an error, none are.
    pub fn mark(&mut self, phase: &str) -> Result<()> {
        self.record(phase)
    }

    /// The last sample of a run ([`END_PHASE`]), taken as its report is written, so the
    /// timeline and its chart reach the end of the run.
    pub fn finish(&self) -> Result<()> {
        self.record(END_PHASE)
    }

    fn record(&self, phase: &str) -> Result<()> {
        let elapsed_ms = self.start.elapsed().as_secs_f64() * 1e3;
        let entries = read_roles(&self.roles, phase, elapsed_ms)?;
        for e in &entries {
            let s = &e.sample;
            tracing::debug!(
                role = e.role.as_str(),
                phase,
                device = %e.device,
                allocated = %format_bytes(s.current_allocated_bytes),
                peak_allocated = %format_bytes(s.peak_allocated_bytes),
                reserved = %format_bytes(s.current_reserved_bytes),
                process_wide = s.process_wide,
                "memory"
            );
        }
        let mut tl = self.shared.timeline.lock().map_err(|_| Error::Torch("memory timeline lock poisoned".into()))?;
        insert_in_time_order(&mut tl, entries);
        Ok(())
    }

    /// Resets the peaks of every distinct device, so the next mark's peaks cover only the
    /// phase in between.
    pub fn reset_peaks(&self) -> Result<()> {
        let mut done: Vec<Device> = Vec::new();
        for (_, device) in &self.roles {
            if !done.contains(device) {
                reset_peak(*device)?;
                done.push(*device);
            }
        }
        Ok(())
    }

    /// Every sample so far, in time order (phase marks and the sampler's).
    pub fn timeline(&self) -> Vec<PhaseSample> {
        self.shared.timeline.lock().map(|t| t.clone()).unwrap_or_default()
    }

    /// Per role (roles never sampled are left out): peaks are maxima over the timeline,
    /// current is the latest sample.
    pub fn summary(&self) -> BTreeMap<String, RoleSummary> {
        let mut out: BTreeMap<String, RoleSummary> = BTreeMap::new();
        for p in &self.timeline() {
            let s = &p.sample;
            out.entry(p.role.clone())
                .and_modify(|r| {
                    r.peak_allocated_bytes = r.peak_allocated_bytes.max(s.peak_allocated_bytes);
                    r.peak_reserved_bytes = r.peak_reserved_bytes.max(s.peak_reserved_bytes);
                    r.current_allocated_bytes = s.current_allocated_bytes;
                })
                .or_insert(RoleSummary {
                    device: p.device.clone(),
                    peak_allocated_bytes: s.peak_allocated_bytes,
                    peak_reserved_bytes: s.peak_reserved_bytes,
                    current_allocated_bytes: s.current_allocated_bytes,
                    process_wide: s.process_wide,
                });
        }
        out
    }

    /// [`Self::summary`] as a user reads it: without a sub-device (`split` false) main and
    /// sub are one device, shown once as `main = sub`.
    pub fn summary_shown(&self, split: bool) -> Vec<(String, RoleSummary)> {
        self.summary()
            .into_iter()
            .filter(|(role, _)| split || role == "main")
            .map(|(role, m)| (if split { role } else { "main = sub".to_string() }, m))
            .collect()
    }

    #[cfg(test)]
    fn push(&self, p: PhaseSample) {
        self.shared.timeline.lock().unwrap().push(p);
    }
}

impl Drop for MemoryTracker {
    fn drop(&mut self) {
        if let Ok(mut stop) = self.shared.stop.lock() {
            *stop = true;
        }
        self.shared.wake.notify_all();
        if let Some(h) = self.sampler.take() {
            let _ = h.join();
        }
    }
}

/// Tunes the host allocator for large tensors; call once at start-up, before the first
/// tensor is made.
///
/// * **Blocks under 32 MiB are reused, larger ones go back to the OS.** A block above the
///   mmap threshold is unmapped on free, so each new one is faulted in and zeroed afresh.
///   A 32 MiB threshold (glibc's largest) keeps an edit's weights, Grams and activations
///   (2–30 MiB) in the heap, a 256 MiB trim threshold and 64 MiB top pad stop it shrinking
///   and regrowing between them, and the largest tensors (vocabulary-wide logits, the
///   model's weights) still leave the resident set when freed. 100 edits in a row on
///   SmolLM2-135M: 0.73–0.83 → 0.49 s an edit on 2 cores, peak RSS 1.57 → 1.67 GB
///   (docs/notebook/many-edits.md, part 16; `tests/fast/allocator.rs`).
/// * **Large tensors get transparent huge pages.** `THP_MEM_ALLOC_ENABLE=1`, which
///   libtorch's CPU allocator reads once, makes it `madvise(MADV_HUGEPAGE)` blocks of 2 MiB
///   or more: fewer page faults for those still faulted in (docs/notebook/mend-step.md). A
///   value the user already set is left alone; the kernel decides whether huge pages are used.
///
/// Set `DUALEDIT_GLIBC_MALLOC=1` to keep glibc's defaults (or what `GLIBC_TUNABLES` sets).
pub fn tune_host_allocator() {
    #[cfg(target_os = "linux")]
    if std::env::var_os("THP_MEM_ALLOC_ENABLE").is_none() {
        // Only this thread runs yet (start-up), so nothing reads the environment meanwhile.
        std::env::set_var("THP_MEM_ALLOC_ENABLE", "1");
    }
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        if std::env::var_os("DUALEDIT_GLIBC_MALLOC").is_some() {
            return;
        }
        for (param, value, name) in [
            (libc::M_MMAP_THRESHOLD, MMAP_THRESHOLD, "M_MMAP_THRESHOLD"),
            (libc::M_TRIM_THRESHOLD, TRIM_THRESHOLD, "M_TRIM_THRESHOLD"),
            (libc::M_TOP_PAD, TOP_PAD, "M_TOP_PAD"),
        ] {
            // SAFETY: mallopt only changes allocator parameters; called once at start-up
            // before other threads allocate.
            if unsafe { libc::mallopt(param, value) } != 1 {
                tracing::debug!("mallopt({name}) refused");
            }
        }
    }
}

/// Blocks of this size or more are served from (and freed back to) mmap; see
/// [`tune_host_allocator`]. glibc refuses a larger value (`HEAP_MAX_SIZE / 2` on 64 bits).
#[cfg(all(target_os = "linux", target_env = "gnu"))]
const MMAP_THRESHOLD: i32 = 32 * 1024 * 1024;
/// Free memory at the heap's top beyond this goes back to the OS.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
const TRIM_THRESHOLD: i32 = 256 * 1024 * 1024;
/// Extra memory the heap takes each time it grows.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
const TOP_PAD: i32 = 64 * 1024 * 1024;

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;

    /// The CPU figures are process-wide, so tests that allocate or reset peaks run one at a time.
    static RSS: Mutex<()> = Mutex::new(());

    fn rss_lock() -> std::sync::MutexGuard<'static, ()> {
        RSS.lock().unwrap_or_else(|e| e.into_inner())
    }

    const MIB: u64 = 1024 * 1024;

    /// `./x` completes the wheel's CUDA headers (nvidia-cuda-crt), so a CUDA libtorch must
    /// get the per-device cap, not the one-fraction fallback.
    #[test]
    fn cuda_libtorch_caps_each_device() {
        if env!("DUALEDIT_LIBTORCH_CUDA") == "1" {
            assert!(
                per_device_caps(),
                "built against a CUDA libtorch without complete CUDA runtime headers, so `max_memory` falls back to one fraction for every device: \
                 ./x installs them (nvidia-cuda-crt) for a PyPI torch whose `cuda-toolkit` it can read; otherwise set CUDA_HOME to a CUDA toolkit of torch's version and rebuild"
            );
        } else {
            assert!(!per_device_caps());
        }
    }

    #[test]
    fn no_accelerator_is_reported_cleanly() {
        if accelerator_count() > 0 {
            return; // the checks below are for CPU-only machines
        }
        for r in [sample(Device::Cuda(0)).map(|_| ()), reset_peak(Device::Cuda(0))] {
            match r {
                Err(Error::Device { name, msg }) => {
                    assert_eq!(name, "cuda:0");
                    assert_eq!(msg, "no accelerator available");
                }
                other => panic!("expected a device error, got {other:?}"),
            }
        }
        // The raw shim answers "none" (0) rather than failing.
        let mut out = [0i64; 4];
        // SAFETY: as in `sample`: `out` holds 4 values, `err`/`len` a live buffer.
        let r = shim_call(|err, len| unsafe { ffi::dualedit_accelerator_stats(0, out.as_mut_ptr(), err, len) });
        assert_eq!(r, Ok(false));
        empty_cache(); // no-op, no panic
    }

    #[test]
    fn unsupported_devices_are_errors() {
        assert!(matches!(sample(Device::Mps), Err(Error::Device { .. })));
        assert!(matches!(reset_peak(Device::Vulkan), Err(Error::Device { .. })));
    }

    #[test]
    fn cpu_sample_is_process_rss() {
        let s = sample(Device::Cpu).unwrap();
        assert!(s.process_wide);
        assert!(s.current_allocated_bytes > 0);
        assert!(s.peak_allocated_bytes >= s.current_allocated_bytes);
        assert_eq!(s.current_reserved_bytes, s.current_allocated_bytes);
        assert_eq!(s.peak_reserved_bytes, s.peak_allocated_bytes);
    }

    #[test]
    fn big_cpu_tensor_raises_peak_and_reset_lowers_it() {
        let _g = rss_lock();
        let before = sample(Device::Cpu).unwrap();
        // 200 MiB of f32, written (ones) so the pages are resident.
        let t = tch::Tensor::ones([50 * 1024 * 1024], (tch::Kind::Float, Device::Cpu));
        assert_eq!(t.sum(tch::Kind::Double).double_value(&[]), (50 * 1024 * 1024) as f64);
        let during = sample(Device::Cpu).unwrap();
        assert!(during.current_allocated_bytes >= before.current_allocated_bytes + 150 * MIB);
        assert!(during.peak_allocated_bytes >= before.current_allocated_bytes + 150 * MIB);
        drop(t);

        reset_peak(Device::Cpu).unwrap();
        let after = sample(Device::Cpu).unwrap();
        assert!(after.peak_allocated_bytes >= after.current_allocated_bytes);
        // Where clear_refs is writable (Linux, own process) the 200 MiB peak is gone;
        // elsewhere reset_peak still succeeds and the peak stays process-lifetime.
        let resettable = std::fs::OpenOptions::new().write(true).open("/proc/self/clear_refs").is_ok();
        if resettable {
            assert!(after.peak_allocated_bytes < during.peak_allocated_bytes);
        }
    }

    #[test]
    fn tracker_records_roles_and_summarises_maxima() {
        let _g = rss_lock();
        let mut tr = MemoryTracker::new(&[("main", Device::Cpu), ("editor", Device::Cpu)]);
        tr.reset_peaks().unwrap();
        tr.mark("load").unwrap();
        let t = tch::Tensor::ones([16 * 1024 * 1024], (tch::Kind::Float, Device::Cpu)); // 64 MiB
        tr.mark("forward").unwrap();
        drop(t);
        tr.mark("step").unwrap();

        let tl = tr.timeline();
        assert_eq!(tl.len(), 6);
        assert_eq!(tl.iter().map(|p| p.phase.as_str()).collect::<Vec<_>>(), ["load", "load", "forward", "forward", "step", "step"]);
        // Roles on one device share one sample per mark.
        for pair in tl.chunks(2) {
            assert_eq!(pair[0].sample, pair[1].sample);
            assert_eq!(pair[0].elapsed_ms, pair[1].elapsed_ms);
            assert_eq!((pair[0].role.as_str(), pair[1].role.as_str()), ("main", "editor"));
        }
        assert!(tl.windows(2).all(|w| w[1].elapsed_ms >= w[0].elapsed_ms));

        let sum = tr.summary();
        assert_eq!(sum.keys().collect::<Vec<_>>(), ["editor", "main"]);
        let main = &sum["main"];
        assert_eq!(main.device, "cpu");
        assert!(main.process_wide);
        let max_peak = tl.iter().filter(|p| p.role == "main").map(|p| p.sample.peak_allocated_bytes).max().unwrap();
        assert_eq!(main.peak_allocated_bytes, max_peak);
        assert_eq!(main.current_allocated_bytes, tl[4].sample.current_allocated_bytes);
        assert!(main.peak_allocated_bytes >= tl[0].sample.current_allocated_bytes + 48 * MIB);
        assert!(serde_json::to_string(&sum).unwrap().contains("\"peak_reserved_bytes\""));
    }

    #[test]
    fn summary_of_synthetic_timeline() {
        let s = |cur, peak| MemorySample {
            current_allocated_bytes: cur,
            peak_allocated_bytes: peak,
            current_reserved_bytes: cur + 1,
            peak_reserved_bytes: peak + 1,
            process_wide: false,
        };
        let tr = MemoryTracker::new(&[("main", Device::Cuda(0))]);
        for (phase, cur, peak) in [("load", 10, 20), ("edit", 5, 50), ("step", 7, 8)] {
            tr.push(PhaseSample {
                phase: phase.into(),
                role: "main".into(),
                device: "cuda:0".into(),
                elapsed_ms: 0.0,
                sample: s(cur, peak),
            });
        }
        let main = &tr.summary()["main"];
        assert_eq!(
            *main,
            RoleSummary {
                device: "cuda:0".into(),
                peak_allocated_bytes: 50,
                peak_reserved_bytes: 51,
                current_allocated_bytes: 7,
                process_wide: false,
            }
        );
        assert!(MemoryTracker::new(&[("x", Device::Cpu)]).summary().is_empty());
    }

    #[test]
    fn the_sampler_covers_the_time_between_marks_in_order() {
        let mut tr = MemoryTracker::sampled_every(&[("main", Device::Cpu), ("sub", Device::Cpu)], Duration::from_millis(10));
        tr.mark("load").unwrap();
        std::thread::sleep(Duration::from_millis(200));
        tr.mark("eval").unwrap();
        let tl = tr.timeline();
        let sampled: Vec<_> = tl.iter().filter(|p| p.phase == SAMPLED_PHASE).collect();
        // About 20 instants in 200 ms; a loaded machine may take fewer.
        assert!(sampled.len() >= 2 * 3, "{} sampled entries", sampled.len());
        assert!(sampled.iter().all(|p| p.elapsed_ms > tl[0].elapsed_ms && p.elapsed_ms <= tl[tl.len() - 1].elapsed_ms));
        assert!(tl.windows(2).all(|w| w[1].elapsed_ms >= w[0].elapsed_ms));
        assert_eq!(tl.iter().filter(|p| p.phase != SAMPLED_PHASE).count(), 4);
        drop(tr); // joins the thread
    }

    #[test]
    fn an_instant_that_arrives_late_goes_in_its_time_place() {
        let at = |phase: &str, ms: f64| PhaseSample {
            phase: phase.into(),
            role: "main".into(),
            device: "cpu".into(),
            elapsed_ms: ms,
            sample: MemorySample::default(),
        };
        let mut tl = Vec::new();
        insert_in_time_order(&mut tl, vec![at("load", 1.0)]);
        insert_in_time_order(&mut tl, vec![at("eval", 5.0)]);
        // The sampler took its time (3 ms) before the eval mark but locked after it.
        insert_in_time_order(&mut tl, vec![at(SAMPLED_PHASE, 3.0), at(SAMPLED_PHASE, 3.0)]);
        insert_in_time_order(&mut tl, vec![at("end", 5.0)]);
        insert_in_time_order(&mut tl, vec![]);
        let got: Vec<(&str, f64)> = tl.iter().map(|p| (p.phase.as_str(), p.elapsed_ms)).collect();
        assert_eq!(got, [("load", 1.0), (SAMPLED_PHASE, 3.0), (SAMPLED_PHASE, 3.0), ("eval", 5.0), ("end", 5.0)]);
    }

    #[test]
    fn tracker_mark_fails_whole_on_missing_device() {
        if accelerator_count() > 0 {
            return;
        }
        let mut tr = MemoryTracker::new(&[("main", Device::Cpu), ("editor", Device::Cuda(0))]);
        assert!(tr.mark("load").is_err());
        assert!(tr.timeline().is_empty());
    }

    #[test]
    fn status_parsing() {
        let text = "Name:\tx\nVmHWM:\t    2048 kB\nVmRSS:\t    1024 kB\n";
        assert_eq!(status_kib(text, "VmRSS").unwrap(), 1024);
        assert_eq!(status_kib(text, "VmHWM").unwrap(), 2048);
        assert!(matches!(status_kib(text, "VmSwap"), Err(Error::File { .. })));
    }

    #[test]
    fn names_and_sizes() {
        assert_eq!(device_name(Device::Cpu), "cpu");
        assert_eq!(device_name(Device::Cuda(1)), "cuda:1");
        assert_eq!(format_bytes(100), "100 B");
        assert_eq!(format_bytes(0), "0 B");
        assert_eq!(format_bytes(1023), "1023 B");
        assert_eq!(format_bytes(12 * 1024), "12.0 KiB");
        assert_eq!(format_bytes(512 * MIB), "512.0 MiB");
        assert_eq!(format_bytes(1_320_702_444), "1.23 GiB");
        assert_eq!(format_bytes(1024 * MIB), "1.00 GiB");
    }
}
