//! Edit datasets: EasyEdit JSON readers, the synthetic knowledge world, and collation
//! of tokenised examples into masked batches.
pub mod batch;
pub mod easyedit;
pub mod examples;
pub mod multimodal;
pub mod synthetic;

pub use batch::{EditExample, Example, ImageRef, TokenBatch};
pub use easyedit::{load_records, DatasetKind, EditRecord};
