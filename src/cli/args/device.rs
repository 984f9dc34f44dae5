//! `DeviceArgs`: where a run puts its work, the same flags on every command.
use clap::Args;

use crate::device::{DevicePlan, DeviceRequest, MaxMemory, OptimizerDevice, PlacementRequest};
use crate::planner::PlaceFor;

/// Where a run puts its work: the same flags on every command.
#[derive(Args, Clone)]
pub struct DeviceArgs {
    /// Main device: frozen model, editor, optimiser (cpu, cuda, cuda:N).
    #[arg(long, default_value = "cpu")]
    pub device: String,
    /// Sub-device for the edited model's forward passes (default: the main device), or a
    /// chain of them (cuda:1,cuda:2,cuda:3; on a CPU cpu:1,cpu:2,cpu:3): the layer split
    /// then puts contiguous block ranges on main and on each, the edited blocks and the head
    /// on the last.
    #[arg(long)]
    pub sub_device: Option<String>,
    /// What lives where (as accelerate's device_map): replica (main: frozen model + editor;
    /// sub: a replica running the edited forwards), balanced (the frozen blocks divided
    /// between main and the sub-device(s) so that the largest peak is smallest), auto (the
    /// planner picks one that fits --max-memory). Default: replica (balanced with a chain,
    /// which runs no replica); `plan` without it compares them all.
    #[arg(long, value_enum)]
    pub placement: Option<PlacementRequest>,
    /// Where the editor's Adam moments live and its update is computed (main, sub, cpu):
    /// off the main device, its gradients cross once per optimiser step (ZeRO-Offload).
    #[arg(long, value_enum)]
    pub optimizer_device: Option<OptimizerDevice>,
    /// Per-device memory caps, e.g. cuda:0=24GiB,cuda:1=24GiB (one per device of a chain): libtorch's CUDA caching
    /// allocator is capped there (as torch.cuda.set_per_process_memory_fraction), and the
    /// planner plans against the caps.
    #[arg(long, value_parser = parse_max_memory)]
    pub max_memory: Option<MaxMemory>,
}

pub fn parse_max_memory(s: &str) -> Result<MaxMemory, String> {
    s.parse().map_err(|e: crate::Error| e.to_string())
}

impl DeviceArgs {
    /// The flags as the library takes them.
    pub fn request(&self) -> DeviceRequest {
        DeviceRequest {
            main: self.device.clone(),
            sub: self.sub_device.clone(),
            placement: self.placement,
            optimizer: self.optimizer_device,
            caps: self.max_memory.clone(),
        }
    }

    /// The main/sub plan with the default placement; both devices must exist here.
    pub fn plan(&self) -> anyhow::Result<DevicePlan> {
        Ok(self.request().plan()?)
    }

    /// The plan with `--placement` resolved by the planner against `--max-memory`.
    pub fn placed(&self, f: &PlaceFor) -> anyhow::Result<DevicePlan> {
        let (plan, chosen) = crate::planner::place(&self.request(), f)?;
        if let Some(label) = chosen {
            eprintln!("placement: {label} (chosen by the planner)");
        }
        Ok(plan)
    }

    /// The one device of a command that runs everything in one place.
    pub fn single(&self, command: &str) -> anyhow::Result<tch::Device> {
        Ok(self.request().single(command)?)
    }
}
