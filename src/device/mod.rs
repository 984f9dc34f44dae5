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

/// Gives the calling thread libtorch's process-wide intra-op thread count, for OpenMP and
/// MKL alike. Both counts are per thread: `at::set_num_threads` sets the caller's, and a
/// new thread takes the process-wide one lazily, at its first `parallel_for` only. Until
/// then its matrix products run with MKL's own default (dynamic: as many threads as it
/// likes), which on two cores splits the same product differently from later calls, and
/// the last bits of a logit then depend on which thread asked and when. Every thread that
/// runs model operations calls this before the first one, so the same request gives the
/// same bits on any thread at any point of a process's life.
pub fn settle_threads() {
    tch::set_num_threads(tch::get_num_threads());
}

/// Keeps libtorch's scaled-dot-product attention on its flash and memory-efficient kernels
/// on Hopper and newer GPUs. A CUDA 13 libtorch (2.11) with cuDNN above 9.15 prefers cuDNN's
/// attention there for bf16 and f16, and cuDNN builds an execution plan for every new
/// sequence length: on an H200, 100-160 ms per new shape, which made a bf16 edit of a 135 M
/// model 8x its f32 edit and a first bf16 training step 13 s (docs/notebook/gpu.md). Edits
/// and training see a new length at almost every request. `TORCH_CUDNN_SDPA_DEPRIORITIZED=1`,
/// which libtorch reads once at its first attention, puts cuDNN last; a value the user set
/// (`0`: cuDNN first) is kept. Called at start-up, before other threads run.
pub fn prefer_flash_attention() {
    if std::env::var_os("TORCH_CUDNN_SDPA_DEPRIORITIZED").is_none() {
        std::env::set_var("TORCH_CUDNN_SDPA_DEPRIORITIZED", "1");
    }
}

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
        // Plain decimal only: `cpu:01` or `cpu:+1` is no name a user means (usize's parser
        // takes both).
        let index = |s: &str| (!s.is_empty() && s.bytes().all(|b| b.is_ascii_digit()) && (s == "0" || !s.starts_with('0'))).then(|| s.parse::<usize>().ok()).flatten();
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
    if name.trim() != name {
        return Err(err("has spaces around it; expected cpu, cpu:N (a logical CPU device), cuda or cuda:N".into()));
    }
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
///
/// `--sub-device a,b,c` names a chain: under the layer split the frozen blocks are
/// divided into contiguous ranges, main's first, then `a`'s, `b`'s, and the last device
/// (`c`, [`DevicePlan::sub`]) holds the blocks from [`DevicePlan::boundary`] up with the
/// final norm, the head and every edited block. The devices between main and the last
/// are [`DevicePlan::chain`].
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
    /// A chain's devices between main and the last sub-device (`--sub-device a,b,c`:
    /// `a`, `b`), in order, and under the layer split the first block on each; empty
    /// for two devices.
    pub chain: Chain,
}

/// A chain's devices between main and the last sub-device and, once the layer split is
/// placed, the first block on each (increasing, below the last device's boundary; main
/// holds the blocks below the first). At most [`MAX_CHAIN`], held inline so that a plan
/// stays `Copy`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Chain {
    len: usize,
    names: [DeviceName; MAX_CHAIN],
    at: [usize; MAX_CHAIN],
    placed: bool,
}

impl Chain {
    pub const EMPTY: Chain = Chain { len: 0, names: [DeviceName::Cpu(0); MAX_CHAIN], at: [0; MAX_CHAIN], placed: false };

    fn of(names: &[DeviceName]) -> Result<Self> {
        if names.len() > MAX_CHAIN {
            return Err(Error::input(format!("`sub_device`: a chain takes at most {} sub-devices", MAX_CHAIN + 1)));
        }
        let mut c = Self::EMPTY;
        c.names[..names.len()].copy_from_slice(names);
        c.len = names.len();
        Ok(c)
    }

    /// The devices in order.
    pub fn names(&self) -> &[DeviceName] {
        &self.names[..self.len]
    }

    /// The first block on each device (empty until the layer split is placed).
    pub fn at(&self) -> &[usize] {
        if self.placed {
            &self.at[..self.len]
        } else {
            &[]
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn len(&self) -> usize {
        self.len
    }
}

/// The most devices a chain may have between main and the last sub-device (a node's eight
/// cards: main, six between, the last).
pub const MAX_CHAIN: usize = 6;

/// The memory tracker's names of a chain's devices between main and the last.
const CHAIN_ROLES: [&str; MAX_CHAIN] = ["chain1", "chain2", "chain3", "chain4", "chain5", "chain6"];

/// The devices `--sub-device` lists (`cuda:1,cuda:2,cuda:3`), checked: each device once,
/// and with more than one, not the main device. Existence is checked by `check`
/// ([`parse_device_name`], or [`str::parse`] for a planner that plans another machine).
pub fn parse_sub_list(main: DeviceName, list: &str, check: impl Fn(&str) -> Result<DeviceName>) -> Result<Vec<DeviceName>> {
    let bad = |msg: String| Error::input(format!("`sub_device` {list:?}: {msg}"));
    if list.trim() != list {
        return Err(bad("spaces around the value; expected cpu, cpu:N (a logical CPU device), cuda or cuda:N, or a list of them".into()));
    }
    let parts: Vec<&str> = list.split(',').map(str::trim).collect();
    if parts.iter().any(|p| p.is_empty()) {
        return Err(bad("an empty device name (give DEVICE or DEVICE,DEVICE,...)".into()));
    }
    let mut out: Vec<DeviceName> = Vec::with_capacity(parts.len());
    for p in parts {
        let d = check(p).map_err(|e| bad(e.to_string()))?;
        if out.contains(&d) {
            return Err(bad(format!("{d} is listed twice (each device holds one range of blocks)")));
        }
        out.push(d);
    }
    if out.len() > MAX_CHAIN + 1 {
        return Err(bad(format!("{} devices; a chain takes at most {} sub-devices (one node's cards)", out.len(), MAX_CHAIN + 1)));
    }
    if out.len() > 1 && out.contains(&main) {
        return Err(bad(format!("lists the main device {main} (`device`): a chain's sub-devices are the devices after it")));
    }
    Ok(out)
}

impl DevicePlan {
    /// Parses both names; `sub` defaults to `main` (a single-device run). Two different
    /// names are a split run, logical CPU devices (`cpu` + `cpu:1`) included.
    /// A list (`cuda:1,cuda:2,cuda:3`) is a chain: the last is the sub-device, the others
    /// [`DevicePlan::chain`] (a chain runs only the layer split, [`DevicePlan::balanced_chain`]).
    pub fn parse(main: &str, sub: Option<&str>) -> Result<Self> {
        let main_n = parse_device_name(main)?;
        let mut subs = match sub {
            Some(s) => parse_sub_list(main_n, s, parse_device_name)?,
            None => vec![main_n],
        };
        let sub_n = subs.pop().unwrap_or(main_n);
        let plan = Self { names: (main_n, sub_n), split: main_n != sub_n, chain: Chain::of(&subs)?, ..Self::single(main_n.device()) }.with_sub(sub_n.device());
        if !plan.chain.is_empty() {
            info!(main = %main_n, chain = ?plan.chain.names(), sub = %sub_n, "device chain");
        } else if plan.split {
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
        Self {
            main: device,
            sub: device,
            names: (name, name),
            split: false,
            placement: Placement::Replica,
            boundary: None,
            optimizer: OptimizerDevice::Main,
            chain: Chain::EMPTY,
        }
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
        self.balanced_chain(Vec::new(), boundary)
    }

    /// The layer split over a chain: main holds blocks below `chain_at[0]`, the chain's
    /// device `j` blocks `[chain_at[j], chain_at[j + 1])`, the last device blocks from
    /// `boundary` up (`chain_at` empty: [`DevicePlan::balanced`]). Each device holds at
    /// least one block, main excepted (it holds the embedding).
    pub fn balanced_chain(self, chain_at: Vec<usize>, boundary: usize) -> Result<Self> {
        if !self.split {
            return Err(Error::input(
                "`placement` balanced divides the model between two devices: give `sub_device` (a device other than `device`)",
            ));
        }
        if chain_at.len() != self.chain.len() {
            return Err(Error::Internal(format!("{} chain boundaries for {} devices between main and the last", chain_at.len(), self.chain.len())));
        }
        let mut all = chain_at.clone();
        all.push(boundary);
        if all.windows(2).any(|w| w[0] >= w[1]) {
            return Err(Error::input(format!("the chain's boundaries {all:?} must increase: each sub-device holds at least one block")));
        }
        let mut chain = self.chain;
        chain.at[..chain_at.len()].copy_from_slice(&chain_at);
        chain.placed = true;
        Ok(Self { placement: Placement::Balanced, boundary: Some(boundary), chain, ..self })
    }

    /// Every sub-device in order (the chain, then the last).
    pub fn sub_names(&self) -> Vec<DeviceName> {
        let mut v = self.chain.names().to_vec();
        v.push(self.names.1);
        v
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
    /// A chain's devices between main and the last are `chain1`, `chain2`, ... (at most
    /// [`MAX_CHAIN`] of them, which [`DevicePlan::parse`] checks).
    pub fn roles(&self) -> Vec<(&'static str, Device)> {
        let mut v = vec![("main", self.main)];
        v.extend(self.chain.names().iter().zip(CHAIN_ROLES).map(|(d, r)| (r, d.device())));
        v.push(("sub", self.sub));
        v
    }

    /// The sub-device names as `--sub-device` takes them (`cuda:1,cuda:2`).
    pub fn sub_list(&self) -> String {
        self.sub_names().iter().map(|d| d.to_string()).collect::<Vec<_>>().join(",")
    }
}
