//! The devices a command was asked to use (`--device`, `--sub-device`, `--placement`,
//! `--optimizer-device`, `--max-memory`), turned into a [`DevicePlan`] or one device. A
//! placement the planner must choose is resolved by `planner::place`.
use super::{memory, parse_device, DevicePlan, MaxMemory, OptimizerDevice, PlacementRequest};
use crate::{Error, Result};

/// What a command was asked to run on, as given.
#[derive(Debug, Clone, Default)]
pub struct DeviceRequest {
    /// Main device: frozen model, editor, optimiser.
    pub main: String,
    /// Sub-device for the edited forwards (`None`: the main device).
    pub sub: Option<String>,
    pub placement: Option<PlacementRequest>,
    pub optimizer: Option<OptimizerDevice>,
    /// Per-device caps; applied to libtorch's allocator when the plan is made.
    pub caps: Option<MaxMemory>,
}

impl DeviceRequest {
    /// Caps libtorch's allocators as `--max-memory` asks (nothing without it).
    pub fn apply_caps(&self) -> Result<()> {
        match &self.caps {
            Some(caps) => memory::apply_caps(caps),
            None => Ok(()),
        }
    }

    /// The main/sub plan with the default placement; both devices must exist here.
    pub fn plan(&self) -> Result<DevicePlan> {
        if self.placement.is_some_and(|p| p != PlacementRequest::Replica) {
            return Err(Error::input(format!(
                "--placement {:?} needs the model and its config here; this command takes --placement replica only",
                self.placement
            )));
        }
        let plan = DevicePlan::parse(&self.main, self.sub.as_deref())?;
        if !plan.chain.is_empty() {
            return Err(Error::input(format!(
                "--sub-device {}: a chain of devices runs the layer split, which needs the model's config; this command takes one sub-device",
                plan.sub_list()
            )));
        }
        self.apply_caps()?;
        Ok(plan.with_optimizer(self.optimizer.unwrap_or_default()))
    }

    /// The one device of a command that runs everything in one place.
    pub fn single(&self, command: &str) -> Result<tch::Device> {
        if self.sub.is_some() || self.placement.is_some() || self.optimizer.is_some() {
            return Err(Error::input(format!(
                "{command} runs on one device: use --device, not --sub-device, --placement or --optimizer-device"
            )));
        }
        self.apply_caps()?;
        parse_device(&self.main)
    }
}
