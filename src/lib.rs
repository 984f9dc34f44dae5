//! dualedit: MEND-style knowledge editing of causal language models on tch (libtorch),
//! with the edited model's forward passes on a sub-device.
// `t += x` on a tch `Tensor` is the in-place `add_`, which autograd cannot take where `t`
// is saved for backward: the crate writes `t = t + x` on purpose.
#![allow(clippy::assign_op_pattern)]
pub mod bootstrap;
pub mod cli;
pub mod config;
pub mod convert;
pub mod data;
pub mod device;
pub mod edit;
pub mod error;
pub mod io;
pub mod model;
pub mod planner;
pub mod progress;
pub mod rng;
pub mod run;
pub mod serve;
pub mod world;

pub use error::{Error, Result};
pub mod mend;
pub mod placed;
