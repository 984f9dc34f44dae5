//! Link settings for the extension module (`dualedit/_native*.so`).
//!
//! * rpath `$ORIGIN/../torch/lib`: the module sits in `site-packages/dualedit/`, beside the
//!   `torch` package whose libtorch it links (no second copy is shipped); `dualedit/__init__.py`
//!   also imports torch first, which loads those libraries into the process anyway.
//! * `libtorch_cuda` kept as DT_NEEDED (as the binary's build.rs does), so a CUDA torch
//!   registers its CUDA backend for the module too.
use std::path::PathBuf;

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    let lib_dir = match std::env::var("DEP_TCH_LIBTORCH_LIB") {
        Ok(dir) => PathBuf::from(dir),
        Err(_) => panic!("torch-sys did not report its libtorch lib dir (DEP_TCH_LIBTORCH_LIB); build with LIBTORCH_USE_PYTORCH=1"),
    };
    println!("cargo:rustc-link-arg=-Wl,-rpath,$ORIGIN/../torch/lib");
    if lib_dir.join("libtorch_cuda.so").exists() {
        println!("cargo:rustc-link-arg=-Wl,--push-state,--no-as-needed,-ltorch_cuda,--pop-state");
    }
}
