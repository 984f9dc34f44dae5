//! Run reports: one JSON file per train / edit / eval run with its metrics, time per
//! phase, per-device memory and bytes moved, plus the memory timeline beside it.
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::Serialize;

use crate::device::memory::{MemoryTracker, PhaseSample, RoleSummary};
use crate::device::{DevicePlan, MoverStats};
use crate::io::write_json_atomic;
use crate::Result;

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

#[derive(Debug, Clone, Serialize)]
pub struct RunReport<M: Serialize> {
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

impl<M: Serialize> RunReport<M> {
    /// Writes the report to `path`, the tracker's timeline to `<path stem>.timeline.json`
    /// and its chart to `<path stem>.timeline.png` (a chart that cannot be drawn is a
    /// logged warning, never a failed run).
    pub fn write(mut self, path: &Path, tracker: &MemoryTracker) -> Result<PathBuf> {
        let stem = path.file_stem().and_then(|s| s.to_str()).unwrap_or("report");
        let timeline = path.with_file_name(format!("{stem}.timeline.json"));
        // A run's timeline closes with a sample as the run ends (a tracker that never
        // sampled has no run to close).
        if !tracker.timeline().is_empty() {
            if let Err(e) = tracker.finish() {
                tracing::warn!(error = %e, "no last memory sample; the timeline ends at the last phase");
            }
        }
        let samples = tracker.timeline();
        write_json_atomic(&timeline, &Timeline { samples: &samples })?;
        let chart = path.with_file_name(format!("{stem}.timeline.png"));
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
