//! A plan's peaks judged against the devices' caps less the headroom: the one test
//! `--placement auto`, `plan`'s verdicts and `--fit` share.
use serde::Serialize;

use crate::device::memory::format_bytes;
use crate::device::MaxMemory;

use super::types::{Headroom, MemoryPlan, Phase};

/// One device of a placement against its cap.
#[derive(Debug, Clone, Serialize)]
pub struct DeviceVerdict {
    pub device: String,
    pub peak_bytes: u64,
    /// `--max-memory`'s cap, if one was given for this device.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cap_bytes: Option<u64>,
    /// What the plan may use of it ([`Headroom::usable`]).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usable_bytes: Option<u64>,
    /// True without a cap.
    pub fits: bool,
}

/// One placement against the caps.
#[derive(Debug, Clone, Serialize)]
pub struct PlacementVerdict {
    pub placement: crate::device::Placement,
    pub optimizer_device: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub boundary: Option<i64>,
    /// `balanced (blocks from 10 on the sub-device)`, as `--placement auto` reports it.
    pub label: String,
    pub fits: bool,
    pub devices: Vec<DeviceVerdict>,
}

/// Every device's peak in `phase` against its cap less the headroom.
pub fn judge(plan: &MemoryPlan, caps: &MaxMemory, headroom: &Headroom, phase: Phase) -> PlacementVerdict {
    let peaks = plan.totals.iter().filter(|t| t.phase == phase).map(|t| (t.device.clone(), t.peak_bytes));
    let sh = &plan.shape;
    judge_peaks(sh.placement, &sh.optimizer_device, sh.boundary, plan.placement_label(), peaks, caps, headroom)
}

pub(super) fn judge_peaks(
    placement: crate::device::Placement,
    optimizer: &str,
    boundary: Option<i64>,
    label: String,
    peaks: impl Iterator<Item = (String, u64)>,
    caps: &MaxMemory,
    headroom: &Headroom,
) -> PlacementVerdict {
    let devices: Vec<DeviceVerdict> = peaks
        .filter(|(_, b)| *b > 0)
        .map(|(device, peak)| {
            let cap = caps.get(&device);
            let usable = cap.map(|c| headroom.usable(&device, c));
            DeviceVerdict { fits: usable.is_none_or(|u| peak <= u), device, peak_bytes: peak, cap_bytes: cap, usable_bytes: usable }
        })
        .collect();
    PlacementVerdict { placement, optimizer_device: optimizer.to_string(), boundary, label, fits: devices.iter().all(|d| d.fits), devices }
}

/// `None` when every device of `plan` fits; else which do not (for errors).
pub fn over(plan: &MemoryPlan, caps: &MaxMemory, headroom: &Headroom, phase: Phase) -> Option<String> {
    let v = judge(plan, caps, headroom, phase);
    let over: Vec<String> = v
        .devices
        .iter()
        .filter(|d| !d.fits)
        .map(|d| {
            format!(
                "{} needs {} > {} usable of cap {}",
                d.device,
                format_bytes(d.peak_bytes),
                format_bytes(d.usable_bytes.unwrap_or(0)),
                format_bytes(d.cap_bytes.unwrap_or(0))
            )
        })
        .collect();
    (!over.is_empty()).then(|| over.join(", "))
}
