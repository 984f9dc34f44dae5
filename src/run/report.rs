//! Run reports: one JSON file per train / edit / eval run with its metrics, time per
//! phase, per-device memory and bytes moved, plus the memory timeline beside it.
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::Serialize;

use crate::device::memory::{MemoryTracker, PhaseSample, RoleSummary};
use crate::device::{DevicePlan, MoverStats};
use crate::io::write_json_atomic;
use crate::{Error, Result};

#[derive(Debug, Clone, Serialize)]
pub struct DeviceInfo {
    pub main: String,
    pub sub: String,
    pub split: bool,
    /// `replica` or `balanced` (`--placement`).
    pub placement: crate::device::Placement,
    /// Layer split: the first block on the sub-device.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub boundary: Option<usize>,
    /// A chain (`--sub-device a,b,c`): the devices between main and `sub` with their
    /// first blocks.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub chain: Vec<(String, usize)>,
    /// Where the editor's Adam moments live (`--optimizer-device`).
    pub optimizer_device: String,
}

impl From<&DevicePlan> for DeviceInfo {
    fn from(p: &DevicePlan) -> Self {
        Self {
            main: p.main_name(),
            sub: p.sub_name(),
            split: p.split,
            placement: p.placement,
            boundary: p.boundary,
            chain: p.chain.names().iter().zip(p.chain.at()).map(|(d, a)| (d.to_string(), *a)).collect(),
            optimizer_device: match p.optimizer {
                crate::device::OptimizerDevice::Sub if p.split => p.sub_name(),
                crate::device::OptimizerDevice::Cpu => "cpu".into(),
                _ => p.main_name(),
            },
        }
    }
}

/// The format tag every run report carries (`format`), so that `report merge` can tell a
/// report of a newer dualedit from one it reads. Reports of builds before the tag have none.
pub const REPORT_FORMAT: &str = "dualedit-run-report/1";

#[derive(Debug, Clone, Serialize)]
pub struct RunReport<M: Serialize> {
    /// [`REPORT_FORMAT`].
    pub format: &'static str,
    pub command: String,
    pub model: String,
    pub devices: DeviceInfo,
    pub dtype: String,
    pub seed: i64,
    /// The data file: records read, used, skipped (empty, over-long) and truncated.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub data: Option<crate::data::examples::DataCounts>,
    pub metrics: M,
    /// Wall-clock seconds per phase.
    pub seconds: BTreeMap<String, f64>,
    /// `memory.<role>.{device, peak_allocated_bytes, peak_reserved_bytes, ...}`.
    pub memory: BTreeMap<String, RoleSummary>,
    pub moved: MoverStats,
    pub timeline_file: Option<PathBuf>,
}

/// Memory samples over time, written beside the report.
#[derive(Debug, Clone, Serialize)]
pub struct Timeline<'a> {
    pub samples: &'a [PhaseSample],
}

/// The timeline and chart written beside a report at `path`.
pub fn companions(path: &Path) -> (PathBuf, PathBuf) {
    let stem = path.file_stem().and_then(|s| s.to_str()).unwrap_or("report");
    (path.with_file_name(format!("{stem}.timeline.json")), path.with_file_name(format!("{stem}.timeline.png")))
}

/// The rule for what a report may replace (docs/usage.md, "What is never overwritten"):
/// the report, its timeline and its chart are each written only where no file (or an
/// empty one) is, or over a file dualedit wrote as that same thing: a run report (a JSON object with
/// `command`, `devices` and `memory`), a timeline (`{"samples": [...]}`), a chart (a PNG
/// beside such a timeline). Anything else (a model's weights or `config.json`, an
/// editor's `editor.json`, records, a config, an image, a folder, a link, a FIFO) is
/// refused, naming it, so a report never replaces an input of its run or a file it did
/// not write.
pub fn check_replaceable(path: &Path) -> Result<()> {
    let (timeline, chart) = companions(path);
    let refuse = |file: &Path, what: &str| {
        Error::file(
            file,
            format!("`report` {}: {what}; a report, its timeline and its chart replace only files dualedit wrote as such (choose another path)", path.display()),
        )
    };
    // What `file` is, if something is there: `None` when nothing is.
    let existing = |file: &Path| -> Result<Option<Vec<u8>>> {
        match std::fs::symlink_metadata(file) {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(Error::io(file, e)),
            Ok(m) if m.file_type().is_symlink() => Err(refuse(file, "is a symbolic link")),
            Ok(m) if !m.is_file() => Err(refuse(file, "exists and is not a regular file")),
            // An empty file holds nothing to lose (a temporary file made for the path).
            Ok(m) if m.len() == 0 => Ok(None),
            Ok(_) => crate::io::read_regular_capped(file, MAX_REPLACED_BYTES).map(Some).map_err(|_| refuse(file, "exists and is not a file dualedit wrote (too large or unreadable)")),
        }
    };
    let json = |bytes: &[u8]| serde_json::from_slice::<serde_json::Value>(bytes).ok();
    if let Some(bytes) = existing(path)? {
        let ours = json(&bytes).is_some_and(|v| v.get("command").is_some_and(|c| c.is_string()) && v.get("devices").is_some_and(|d| d.is_object()) && v.get("memory").is_some_and(|m| m.is_object()));
        if !ours {
            return Err(refuse(path, "exists and is not a dualedit run report"));
        }
    }
    let timeline_ours = match existing(&timeline)? {
        None => false,
        Some(bytes) => {
            let ours = json(&bytes).is_some_and(|v| v.as_object().is_some_and(|o| o.len() == 1 && o.get("samples").is_some_and(|s| s.is_array())));
            if !ours {
                return Err(refuse(&timeline, "exists and is not a dualedit memory timeline"));
            }
            true
        }
    };
    if let Some(bytes) = existing(&chart)? {
        if !(timeline_ours && bytes.starts_with(b"\x89PNG\r\n\x1a\n")) {
            return Err(refuse(&chart, "exists and is not a dualedit memory chart (a PNG beside its timeline)"));
        }
    }
    Ok(())
}

/// The largest existing file looked at to tell whether dualedit wrote it.
const MAX_REPLACED_BYTES: u64 = 256 << 20;

impl<M: Serialize> RunReport<M> {
    /// Writes the report to `path`, the tracker's timeline to `<path stem>.timeline.json`
    /// and its chart to `<path stem>.timeline.png` (a chart that cannot be drawn is a
    /// logged warning, never a failed run). What is at those paths is checked first
    /// ([`check_replaceable`]): nothing is written over a file dualedit did not write.
    pub fn write(mut self, path: &Path, tracker: &MemoryTracker) -> Result<PathBuf> {
        check_replaceable(path)?;
        let (timeline, chart) = companions(path);
        // A run's timeline closes with a sample as the run ends (a tracker that never
        // sampled has no run to close).
        if !tracker.timeline().is_empty() {
            if let Err(e) = tracker.finish() {
                tracing::warn!(error = %e, "no last memory sample; the timeline ends at the last phase");
            }
        }
        let samples = tracker.timeline();
        write_json_atomic(&timeline, &Timeline { samples: &samples })?;
        if let Err(e) = crate::run::chart::render_timeline_png(&samples, &chart) {
            tracing::warn!(chart = %chart.display(), error = %e, "memory timeline chart not written");
        }
        self.timeline_file = Some(timeline);
        write_json_atomic(path, &self)?;
        Ok(path.to_path_buf())
    }
}

/// `runs/<command>-<unix seconds>.json` under the current directory.
pub fn default_path(command: &str) -> PathBuf {
    let secs = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
    PathBuf::from("runs").join(format!("{command}-{secs}.json"))
}
