//! Edit datasets: EasyEdit JSON readers, the synthetic knowledge and visual worlds, and collation
//! of tokenised examples into masked batches.
pub mod batch;
pub mod easyedit;
pub mod examples;
pub mod multimodal;
pub mod synthetic;
pub mod visual_world;

pub use batch::{EditExample, Example, ImageRef, PrefixKey, TokenBatch};
pub use easyedit::{load_records, DatasetKind, EditRecord};
