//! Edit datasets: EasyEdit JSON readers (text and E-VQA / E-IC) and collation of tokenised
//! examples into masked batches. The synthetic worlds live in [`crate::world`].
pub mod batch;
pub mod easyedit;
pub mod examples;
pub mod multimodal;

pub use batch::{add_answer_neighbours, EditExample, Example, ImageRef, PrefixKey, TokenBatch};
pub use easyedit::{load_records, DatasetKind, EditRecord};
