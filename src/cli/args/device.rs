//! Where a run puts its work: the library's [`DeviceRequest`], flattened into the same
//! flags on every command.
use crate::device::{DevicePlan, DeviceRequest};
use crate::planner::PlaceFor;

/// The plan with `--placement` resolved by the planner against `--max-memory`; the
/// planner's choice, when it chose, is printed.
pub fn placed(devices: &DeviceRequest, f: &PlaceFor) -> anyhow::Result<DevicePlan> {
    let (plan, chosen) = crate::planner::place(devices, f)?;
    if let Some(label) = chosen {
        eprintln!("placement: {label} (chosen by the planner)");
    }
    Ok(plan)
}
