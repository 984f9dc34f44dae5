//! Placements: where the frozen model's blocks, the editor's optimiser state and the
//! edited forwards live, and per-device memory caps.
//!
//! The names follow `accelerate`'s `device_map` / `max_memory`: `balanced` divides the
//! frozen blocks between the devices so that their peaks come out about equal, `auto` lets
//! the planner pick what fits the given capacities, and `--max-memory cuda:0=24GiB` caps a
//! device as accelerate's `max_memory={0: "24GiB"}` does. Results never depend on the
//! placement: it moves memory, not arithmetic.
use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::DeviceName;
use crate::{Error, Result};

/// A concrete placement of the run's resident state.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
pub enum Placement {
    /// The main device holds the whole frozen model and the editor; the sub-device holds a
    /// read-only replica and runs every edited forward (the card's layout). On one device:
    /// everything there.
    Replica,
    /// Layer split: the embedding and blocks `[0, k)` on the main device, blocks `[k, L)`,
    /// the final norm and the head on the sub-device (no replica), `k` chosen so the two
    /// peaks balance (at most the first edited block). The boundary activations `[B, T, D]`
    /// cross the mover; capture, the editor's factors and the edited forwards run where the
    /// edited blocks are.
    Balanced,
}

impl Placement {
    pub const ALL: [Placement; 2] = [Placement::Replica, Placement::Balanced];

    pub fn name(self) -> &'static str {
        match self {
            Placement::Replica => "replica",
            Placement::Balanced => "balanced",
        }
    }
}

impl std::fmt::Display for Placement {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// What the command line asks for: a placement, or `auto` (the planner picks one that fits
/// the capacities; see `planner::choose`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
pub enum PlacementRequest {
    /// The planner's choice: the first placement, in the order replica, balanced, whose
    /// every device fits its capacity (`--max-memory`, else the device's size when known).
    Auto,
    #[default]
    Replica,
    Balanced,
}

impl PlacementRequest {
    /// The placement asked for, `None` for `auto`.
    pub fn fixed(self) -> Option<Placement> {
        match self {
            PlacementRequest::Auto => None,
            PlacementRequest::Replica => Some(Placement::Replica),
            PlacementRequest::Balanced => Some(Placement::Balanced),
        }
    }
}

/// Where the editor's Adam moments live and the optimiser step runs (ZeRO-Offload's
/// optimiser offload): the editor's gradients cross there once per optimiser step, the
/// update comes back, the parameters stay where the editor is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
pub enum OptimizerDevice {
    /// Beside the editor on the main device (no crossing).
    #[default]
    Main,
    /// The sub-device.
    Sub,
    /// Host memory.
    Cpu,
}

/// Per-device memory caps in bytes, as `--max-memory cuda:0=24GiB,cuda:1=24GiB` gives them.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct MaxMemory(pub BTreeMap<String, u64>);

/// From the text `--max-memory` takes (`"cuda:0=24GiB,cpu=64GiB"`), as Python's and
/// JSON's `max_memory`.
impl<'de> Deserialize<'de> for MaxMemory {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> std::result::Result<Self, D::Error> {
        String::deserialize(deserializer)?.parse().map_err(serde::de::Error::custom)
    }
}

impl MaxMemory {
    /// The cap of a device (normalised name, `cuda:0`), if one was given.
    pub fn get(&self, device: &str) -> Option<u64> {
        self.0.get(device).copied()
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// `(device, bytes)` for every capped device.
    pub fn iter(&self) -> impl Iterator<Item = (DeviceName, u64)> + '_ {
        self.0.iter().filter_map(|(d, b)| d.parse::<DeviceName>().ok().map(|d| (d, *b)))
    }
}

impl std::str::FromStr for MaxMemory {
    type Err = Error;

    /// `DEVICE=SIZE[,DEVICE=SIZE...]`, sizes as `24GiB`, `24GB`, `512MiB`, `1.5GiB` or plain
    /// bytes; each device at most once.
    fn from_str(s: &str) -> Result<Self> {
        let bad = |msg: String| Error::input(format!("`max_memory` {s:?}: {msg}"));
        let mut out = BTreeMap::new();
        for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let (dev, size) = part.split_once('=').ok_or_else(|| bad(format!("{part:?} is not DEVICE=SIZE (e.g. cuda:0=24GiB)")))?;
            let dev: DeviceName = dev.trim().parse().map_err(|e: Error| bad(e.to_string()))?;
            let bytes = parse_size(size.trim()).map_err(|m| bad(format!("{part:?}: {m}")))?;
            if out.insert(dev.to_string(), bytes).is_some() {
                return Err(bad(format!("{dev} is given twice")));
            }
        }
        if out.is_empty() {
            return Err(bad("no DEVICE=SIZE given".into()));
        }
        Ok(MaxMemory(out))
    }
}

/// Bytes of `24GiB`, `24GB`, `24G` (binary), `1.5GiB`, `512MiB`, `4096` (bytes).
pub fn parse_size(s: &str) -> std::result::Result<u64, String> {
    let split = s.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(s.len());
    let (num, unit) = s.split_at(split);
    let value: f64 = num.parse().map_err(|_| format!("{s:?} is not a size (a number with an optional unit: 24GiB, 500MB)"))?;
    let scale: f64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1.0,
        "kib" | "k" => 1024.0,
        "mib" | "m" => 1024.0f64.powi(2),
        "gib" | "g" => 1024.0f64.powi(3),
        "tib" | "t" => 1024.0f64.powi(4),
        "kb" => 1e3,
        "mb" => 1e6,
        "gb" => 1e9,
        "tb" => 1e12,
        other => return Err(format!("unknown unit {other:?} (B, KiB, MiB, GiB, TiB, KB, MB, GB, TB)")),
    };
    let bytes = value * scale;
    if !(bytes.is_finite() && bytes >= 1.0 && bytes < 2f64.powi(63)) {
        return Err(format!("{s:?} is not a positive size"));
    }
    Ok(bytes as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_and_caps_parse_as_accelerate_writes_them() {
        assert_eq!(parse_size("24GiB"), Ok(24 << 30));
        assert_eq!(parse_size("24GB"), Ok(24_000_000_000));
        assert_eq!(parse_size("1.5GiB"), Ok(3 << 29));
        assert_eq!(parse_size("512MiB"), Ok(512 << 20));
        assert_eq!(parse_size("4096"), Ok(4096));
        for bad in ["", "GiB", "-1GiB", "0", "12XB", "1e400GiB"] {
            assert!(parse_size(bad).is_err(), "{bad:?}");
        }
        // `cuda` and `cuda:0` are the same device.
        let e = "cuda:0=24GiB, cuda=1GB".parse::<MaxMemory>().unwrap_err().to_string();
        assert!(e.contains("given twice"), "{e}");
        let m: MaxMemory = "cuda:0=24GiB,cuda:1=20GiB,cpu=64GB".parse().unwrap();
        assert_eq!(m.get("cuda:0"), Some(24 << 30));
        assert_eq!(m.get("cuda:1"), Some(20 << 30));
        assert_eq!(m.get("cpu"), Some(64_000_000_000));
        for bad in ["", "cuda:0", "gpu0=1GiB", "cuda:0=lots", "cuda:0=1GiB,cuda:0=2GiB"] {
            let e = bad.parse::<MaxMemory>().unwrap_err().to_string();
            assert!(e.contains("`max_memory`"), "{bad:?}: {e}");
        }
    }

}
