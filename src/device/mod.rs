//! Where tensors live: device names, the main/sub device plan, memory accounting.
pub mod memory;

use tch::Device;

use crate::{Error, Result};

/// Parses `cpu`, `cuda` or `cuda:N`, and checks the device exists on this machine.
pub fn parse_device(name: &str) -> Result<Device> {
    let err = |msg: String| Error::Device { name: name.to_string(), msg };
    let device = match name.trim() {
        "cpu" => return Ok(Device::Cpu),
        "cuda" => Device::Cuda(0),
        s => match s.strip_prefix("cuda:").map(str::parse::<usize>) {
            Some(Ok(i)) => Device::Cuda(i),
            _ => return Err(err("expected cpu, cuda or cuda:N".into())),
        },
    };
    let count = tch::Cuda::device_count() as usize;
    if let Device::Cuda(i) = device {
        if count == 0 {
            return Err(err("CUDA is not available on this machine (no GPU seen by libtorch)".into()));
        }
        if i >= count {
            return Err(err(format!("this machine has {count} CUDA device(s)")));
        }
    }
    Ok(device)
}
