//! Where tensors live: device names (logical CPU devices `cpu:N` included), the main/sub
//! device plan, the mover between them, memory accounting.
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

/// A device as the command line names it: `cpu` (= `cpu:0`), `cpu:N`, `cuda` (= `cuda:0`)
/// or `cuda:N`. The one parser of device names; [`parse_device`] adds the check that the
/// device exists here, which the planner (planning for another machine) leaves out.
///
/// `cpu:1`, `cpu:2`, ... are logical devices: the same host memory and cores as `cpu`, but
/// a run given `--device cpu --sub-device cpu:1` takes the real split path (the replica or
/// the layer split, the worker thread, the mover copying and counting every tensor that
/// crosses), so a pipeline can be tried, and its results checked against a single-device
/// run, before any GPU is rented.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum DeviceName {
    Cpu(usize),
    Cuda(usize),
}

impl DeviceName {
    /// The libtorch device (every logical CPU device is the CPU).
    pub fn device(self) -> Device {
        match self {
            DeviceName::Cpu(_) => Device::Cpu,
            DeviceName::Cuda(i) => Device::Cuda(i),
        }
    }

    /// The name of a libtorch device (`cpu`, `cuda:N`; other kinds are named as `cpu`,
    /// which no command accepts for them anyway).
    pub fn of(d: Device) -> Self {
        match d {
            Device::Cuda(i) => DeviceName::Cuda(i),
            _ => DeviceName::Cpu(0),
        }
    }
}

impl std::str::FromStr for DeviceName {
    type Err = Error;

    fn from_str(name: &str) -> Result<Self> {
        let index = |s: &str| s.parse::<usize>().ok();
        match name.trim() {
            "cpu" => Ok(DeviceName::Cpu(0)),
            "cuda" => Ok(DeviceName::Cuda(0)),
            s => match (s.strip_prefix("cpu:").map(index), s.strip_prefix("cuda:").map(index)) {
                (Some(Some(i)), _) => Ok(DeviceName::Cpu(i)),
                (_, Some(Some(i))) => Ok(DeviceName::Cuda(i)),
                _ => Err(Error::Device { name: name.to_string(), msg: "expected cpu, cpu:N (a logical CPU device), cuda or cuda:N".into() }),
            },
        }
    }
}

impl std::fmt::Display for DeviceName {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            DeviceName::Cpu(0) => write!(f, "cpu"),
            DeviceName::Cpu(i) => write!(f, "cpu:{i}"),
            DeviceName::Cuda(i) => write!(f, "cuda:{i}"),
        }
    }
}

/// Parses a device name ([`DeviceName`]) and checks the device exists on this machine.
pub fn parse_device(name: &str) -> Result<Device> {
    Ok(parse_device_name(name)?.device())
}

/// [`parse_device`] keeping the name (a logical `cpu:N` stays itself).
pub fn parse_device_name(name: &str) -> Result<DeviceName> {
    let err = |msg: String| Error::Device { name: name.to_string(), msg };
    let parsed = name.parse::<DeviceName>()?;
    if let DeviceName::Cuda(i) = parsed {
        let count = tch::Cuda::device_count() as usize;
        if count == 0 {
            return Err(err("CUDA is not available on this machine (no GPU seen by libtorch)".into()));
        }
        if i >= count {
            return Err(err(format!("this machine has {count} CUDA device(s)")));
        }
    }
    Ok(parsed)
}

/// The main device (frozen model, editor, optimiser) and the sub-device (replica of the
/// frozen weights, every forward pass of the edited model), and how the run is placed on
/// them ([`Placement`], where the optimiser state lives).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DevicePlan {
    pub main: Device,
    pub sub: Device,
    /// The devices as named (`cpu` and `cpu:1` are two names for one libtorch device).
    pub names: (DeviceName, DeviceName),
    /// Whether the sub-device holds its own replica and the mover copies between them.
    /// True whenever the names differ (`cpu` + `cpu:1` included); [`DevicePlan::split_on`]
    /// forces it.
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
    /// Parses both names; `sub` defaults to `main` (a single-device run). Two different
    /// names are a split run, logical CPU devices (`cpu` + `cpu:1`) included.
    pub fn parse(main: &str, sub: Option<&str>) -> Result<Self> {
        let main_n = parse_device_name(main)?;
        let sub_n = match sub {
            Some(s) => parse_device_name(s)?,
            None => main_n,
        };
        let plan = Self { names: (main_n, sub_n), split: main_n != sub_n, ..Self::single(main_n.device()) }.with_sub(sub_n.device());
        if plan.split {
            info!(main = %main_n, sub = %sub_n, "dual-device run");
        } else {
            info!(device = %main_n, "single-device run (main and sub are the same device)");
        }
        Ok(plan)
    }

    fn with_sub(self, sub: Device) -> Self {
        Self { sub, ..self }
    }

    pub fn single(device: Device) -> Self {
        let name = DeviceName::of(device);
        Self { main: device, sub: device, names: (name, name), split: false, placement: Placement::Replica, boundary: None, optimizer: OptimizerDevice::Main }
    }

    /// A split plan even if both devices are the same: the replica, the mover and the
    /// cross-device backward all run, which lets CPU-only tests exercise the dual path.
    /// A sub-device equal to main is named as the next logical device (`cpu` + `cpu:1`).
    pub fn split_on(main: Device, sub: Device) -> Self {
        let (m, mut s) = (DeviceName::of(main), DeviceName::of(sub));
        if let (DeviceName::Cpu(i), DeviceName::Cpu(j)) = (m, s) {
            if i == j {
                s = DeviceName::Cpu(i + 1);
            }
        }
        Self { split: true, names: (m, s), ..Self::single(main) }.with_sub(sub)
    }

    /// The main device's name as given (`cpu`, `cuda:0`).
    pub fn main_name(&self) -> String {
        self.names.0.to_string()
    }

    /// The sub-device's name as given (`cpu:1` stays `cpu:1`).
    pub fn sub_name(&self) -> String {
        self.names.1.to_string()
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
