//! dualedit: MEND-style knowledge editing of causal language models on tch (libtorch),
//! with the edited model's forward passes on a sub-device.
pub mod config;
pub mod data;
pub mod device;
pub mod error;
pub mod model;
pub mod score;

pub use error::{Error, Result};
