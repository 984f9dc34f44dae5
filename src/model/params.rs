//! Parameters as an explicit argument of the forward pass.
//!
//! MEND needs the edited model f(x; θ + Δ) as a differentiable function of Δ. Instead of
//! patching a module tree (Python's `higher`), the forward reads every weight through a
//! [`ParamView`]: the frozen store plus an override map holding only the edited tensors.
//! Untouched weights are never copied.
use std::collections::HashMap;

use tch::{Device, Kind, Tensor};

use crate::{Error, Result};

/// Edited tensors by parameter name (for example `W + Δ` for each edited weight).
pub type Overrides = HashMap<String, Tensor>;

/// The frozen weights of one model on one device, by Hugging Face parameter name.
#[derive(Debug)]
pub struct ParamStore {
    tensors: HashMap<String, Tensor>,
    device: Device,
    kind: Kind,
}

impl ParamStore {
    pub fn new(tensors: HashMap<String, Tensor>, device: Device, kind: Kind) -> Self {
        Self { tensors, device, kind }
    }

    pub fn device(&self) -> Device {
        self.device
    }

    pub fn kind(&self) -> Kind {
        self.kind
    }

    pub fn get(&self, name: &str) -> Option<&Tensor> {
        self.tensors.get(name)
    }

    pub fn names(&self) -> impl Iterator<Item = &String> {
        self.tensors.keys()
    }

    pub fn iter(&self) -> impl Iterator<Item = (&String, &Tensor)> {
        self.tensors.iter()
    }

    /// Total bytes held by the store's tensors.
    pub fn nbytes(&self) -> u64 {
        self.tensors.values().map(|t| (t.numel() * t.kind().elt_size_in_bytes()) as u64).sum()
    }

    /// A copy of every tensor on `device` (the sub-device's read-only replica).
    pub fn replicate(&self, device: Device) -> Result<ParamStore> {
        crate::error::guard(|| {
            let tensors = self
                .tensors
                .iter()
                .map(|(n, t)| (n.clone(), t.to_device(device)))
                .collect();
            Ok(ParamStore { tensors, device, kind: self.kind })
        })
    }

    /// New handles to the same tensors (no copy), for another thread to own.
    pub fn shallow_clone(&self) -> ParamStore {
        let tensors = self.tensors.iter().map(|(n, t)| (n.clone(), t.shallow_clone())).collect();
        ParamStore { tensors, device: self.device, kind: self.kind }
    }

    /// Replaces one tensor in place (used when an edit is committed to the weights).
    pub fn set(&mut self, name: &str, value: Tensor) -> Result<()> {
        let slot = self
            .tensors
            .get_mut(name)
            .ok_or_else(|| Error::input(format!("unknown parameter {name:?}")))?;
        if slot.size() != value.size() {
            return Err(Error::input(format!(
                "parameter {name:?}: new value has shape {:?}, expected {:?}",
                value.size(),
                slot.size()
            )));
        }
        *slot = value.to_device(self.device).to_kind(self.kind).detach();
        Ok(())
    }
}

/// What a forward pass reads its weights from: the store, with some names overridden.
#[derive(Clone, Copy)]
pub struct ParamView<'a> {
    store: &'a ParamStore,
    overrides: Option<&'a Overrides>,
}

impl<'a> ParamView<'a> {
    pub fn new(store: &'a ParamStore, overrides: Option<&'a Overrides>) -> Self {
        Self { store, overrides }
    }

    pub fn frozen(store: &'a ParamStore) -> Self {
        Self { store, overrides: None }
    }

    pub fn device(&self) -> Device {
        self.store.device
    }

    /// The tensor for `name`: the override if there is one, else the frozen weight.
    ///
    /// Names are checked against the architecture when the model is loaded, so a miss
    /// here is a programming error, reported as an error rather than a panic anyway.
    pub fn get(&self, name: &str) -> Result<&'a Tensor> {
        if let Some(t) = self.overrides.and_then(|o| o.get(name)) {
            return Ok(t);
        }
        self.store
            .get(name)
            .ok_or_else(|| Error::Torch(format!("parameter {name:?} is not loaded")))
    }
}
