//! The devices a command was asked to use (`--device`, `--sub-device`, `--placement`,
//! `--optimizer-device`, `--max-memory`), turned into a [`DevicePlan`] or one device. A
//! placement the planner must choose is resolved by `planner::place`.
use serde::{Deserialize, Serialize};

use super::{memory, parse_device, DevicePlan, MaxMemory, OptimizerDevice, PlacementRequest};
use crate::{Error, Result};

/// What a command was asked to run on, as given: the CLI flattens it into `--device`,
/// `--sub-device`, `--placement`, `--optimizer-device` and `--max-memory`; Python takes
/// the fields as keyword arguments, JSON as keys. One type, so the choices and the doc
/// below are the same everywhere.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, clap::Args)]
#[serde(default)]
pub struct DeviceRequest {
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

impl Default for DeviceRequest {
    fn default() -> Self {
        Self { device: "cpu".into(), sub_device: None, placement: None, optimizer_device: None, max_memory: None }
    }
}

fn parse_max_memory(s: &str) -> std::result::Result<MaxMemory, String> {
    s.parse().map_err(|e: Error| e.to_string())
}

impl DeviceRequest {
    /// Caps libtorch's allocators as `--max-memory` asks (nothing without it).
    pub fn apply_caps(&self) -> Result<()> {
        match &self.max_memory {
            Some(caps) => memory::apply_caps(caps),
            None => Ok(()),
        }
    }

    /// The main/sub plan with the default placement; both devices must exist here.
    pub fn plan(&self) -> Result<DevicePlan> {
        if self.placement.is_some_and(|p| p != PlacementRequest::Replica) {
            return Err(Error::input(format!(
                "`placement` {:?} needs the model and its config here; this command takes `placement` replica only",
                self.placement
            )));
        }
        let plan = DevicePlan::parse(&self.device, self.sub_device.as_deref())?;
        if !plan.chain.is_empty() {
            return Err(Error::input(format!(
                "`sub_device` {}: a chain of devices runs the layer split, which needs the model's config; this command takes one sub-device",
                plan.sub_list()
            )));
        }
        self.apply_caps()?;
        Ok(plan.with_optimizer(self.optimizer_device.unwrap_or_default()))
    }

    /// The one device of a command that runs everything in one place.
    pub fn single(&self, command: &str) -> Result<tch::Device> {
        if self.sub_device.is_some() || self.placement.is_some() || self.optimizer_device.is_some() {
            return Err(Error::input(format!(
                "{command} runs on one device: use `device`, not `sub_device`, `placement` or `optimizer_device`"
            )));
        }
        self.apply_caps()?;
        parse_device(&self.device)
    }
}
