//! The integration tests that take seconds each: one test binary (one libtorch link)
//! for all of them, a module per subject. `./x test --test fast` runs them all,
//! `./x test --test fast vl::` one module, `./x test --test fast vl::score_image_json`
//! one test. The long trainings are in `tests/slow`.
//!
//! A new file here needs a `mod` line below (`tests/fast/architecture.rs` fails when one
//! is missing); a new top-level `tests/*.rs` would be one more binary linking libtorch.
#[path = "../common/mod.rs"]
mod common;

mod aggregate;
mod allocator;
mod architecture;
mod chart;
mod cli;
mod data;
mod defaults;
mod dual;
mod easyedit_hparams;
mod edit;
mod edit_method;
mod gguf;
mod gpu_check;
mod guard;
mod jpeg;
mod mend;
mod mm;
mod models;
mod placement;
mod recompute;
mod report_merge;
mod serve;
mod serve_images;
mod session;
mod vl;
