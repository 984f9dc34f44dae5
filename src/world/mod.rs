//! The synthetic worlds the embedded defaults are built from: the text world (facts, a
//! corpus, CounterFact-shaped edits) and the visual world (scenes drawn in code, E-VQA
//! records). Pure data generation: nothing here needs libtorch or the model, so a world
//! can be written, read and tested on its own.
pub mod text;
pub mod visual;
