//! Where tensors live: device names, the main/sub device plan, the mover between them,
//! memory accounting.
pub mod memory;
pub mod mover;
pub mod oom;
pub mod placement;
pub mod request;
pub mod timeline;
pub mod worker;

use tch::Device;
use tracing::info;

pub use mover::{Mover, MoverStats};
pub use placement::{MaxMemory, OptimizerDevice, Placement, PlacementRequest};
pub use request::DeviceRequest;

use crate::{Error, Result};

/// A device as the command line names it: `cpu`, `cuda` (= `cuda:0`) or `cuda:N`. The one
/// parser of device names; [`parse_device`] adds the check that the device exists here,
/// which the planner (planning for another machine) leaves out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeviceName {
    Cpu,
    Cuda(usize),
}

impl std::str::FromStr for DeviceName {
    type Err = Error;

    fn from_str(name: &str) -> Result<Self> {
        match name.trim() {
            "cpu" => Ok(DeviceName::Cpu),
            "cuda" => Ok(DeviceName::Cuda(0)),
            s => match s.strip_prefix("cuda:").map(str::parse::<usize>) {
                Some(Ok(i)) => Ok(DeviceName::Cuda(i)),
                _ => Err(Error::Device { name: name.to_string(), msg: "expected cpu, cuda or cuda:N".into() }),
            },
        }
    }
}

impl std::fmt::Display for DeviceName {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            DeviceName::Cpu => write!(f, "cpu"),
            DeviceName::Cuda(i) => write!(f, "cuda:{i}"),
        }
    }
}

/// Parses `cpu`, `cuda` or `cuda:N`, and checks the device exists on this machine.
pub fn parse_device(name: &str) -> Result<Device> {
    let err = |msg: String| Error::Device { name: name.to_string(), msg };
    match name.parse::<DeviceName>()? {
        DeviceName::Cpu => Ok(Device::Cpu),
        DeviceName::Cuda(i) => {
            let count = tch::Cuda::device_count() as usize;
            if count == 0 {
                return Err(err("CUDA is not available on this machine (no GPU seen by libtorch)".into()));
            }
            if i >= count {
                return Err(err(format!("this machine has {count} CUDA device(s)")));
            }
            Ok(Device::Cuda(i))
        }
    }
}

/// The main device (frozen model, editor, optimiser) and the sub-device (replica of the
/// frozen weights, every forward pass of the edited model), and how the run is placed on
/// them ([`Placement`], where the optimiser state lives).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DevicePlan {
    pub main: Device,
    pub sub: Device,
    /// Whether the sub-device holds its own replica and the mover copies between them.
    /// True whenever the devices differ; [`DevicePlan::split_on`] forces it on one device.
    pub split: bool,
    /// Replica (the default) or layer split. A layer split implies `split`.
    pub placement: Placement,
    /// With [`Placement::Balanced`]: the first block on the sub-device (`k`; blocks
    /// `[0, k)` and the embedding stay on main). `None` otherwise.
    pub boundary: Option<usize>,
    /// Where the editor's Adam moments live and its update is computed.
    pub optimizer: OptimizerDevice,
}

impl DevicePlan {
    /// Parses both names; `sub` defaults to `main` (a single-device run).
    pub fn parse(main: &str, sub: Option<&str>) -> Result<Self> {
        let main_d = parse_device(main)?;
        let sub_d = match sub {
            Some(s) => parse_device(s)?,
            None => main_d,
        };
        let plan = Self { split: main_d != sub_d, ..Self::single(main_d) }.with_sub(sub_d);
        if plan.split {
            info!(main = %memory::device_name(plan.main), sub = %memory::device_name(plan.sub), "dual-device run");
        } else {
            info!(device = %memory::device_name(plan.main), "single-device run (main and sub are the same device)");
        }
        Ok(plan)
    }

    fn with_sub(self, sub: Device) -> Self {
        Self { sub, ..self }
    }

    pub fn single(device: Device) -> Self {
        Self { main: device, sub: device, split: false, placement: Placement::Replica, boundary: None, optimizer: OptimizerDevice::Main }
    }

    /// A split plan even if both devices are the same: the replica, the mover and the
    /// cross-device backward all run, which lets CPU-only tests exercise the dual path.
    pub fn split_on(main: Device, sub: Device) -> Self {
        Self { split: true, ..Self::single(main) }.with_sub(sub)
    }

    /// The layer split with blocks `[boundary, L)` on the sub-device (the embedding and
    /// blocks below it on main). Needs a split plan (two devices, or [`DevicePlan::split_on`]).
    pub fn balanced(self, boundary: usize) -> Result<Self> {
        if !self.split {
            return Err(Error::input(
                "--placement balanced divides the model between two devices: give --sub-device (a device other than --device)",
            ));
        }
        Ok(Self { placement: Placement::Balanced, boundary: Some(boundary), ..self })
    }

    /// The same plan with the optimiser state on `dev`.
    pub fn with_optimizer(self, dev: OptimizerDevice) -> Self {
        Self { optimizer: dev, ..self }
    }

    /// The device the optimiser's moments live on.
    pub fn optimizer_device(&self) -> Device {
        match self.optimizer {
            OptimizerDevice::Main => self.main,
            OptimizerDevice::Sub => self.sub,
            OptimizerDevice::Cpu => Device::Cpu,
        }
    }

    /// Roles for the memory tracker.
    pub fn roles(&self) -> Vec<(&'static str, Device)> {
        vec![("main", self.main), ("sub", self.sub)]
    }
}
