//! MEND: the editor network, gradient capture, edit application and the engine that runs
//! them across the main device and the sub-device.
pub mod calibrate;
pub mod checkpoint;
pub mod editor;
pub mod guard;
pub mod ls;
pub mod stats;
pub mod stepwise;
pub mod losses;
pub mod optim;
pub mod engine;
pub mod train;

pub use editor::{Editor, Factors};
pub use engine::{EditShape, Engine};
