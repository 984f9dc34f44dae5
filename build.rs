//! Link settings that torch-sys leaves to the final crate.
//!
//! * rpath to the libtorch lib dir, so `dualedit` runs without LD_LIBRARY_PATH;
//! * `libtorch_cuda` kept as a DT_NEEDED entry even though no symbol of it is referenced
//!   directly (the default `--as-needed` would drop it, and then libtorch never registers
//!   its CUDA backend: `tch::Cuda::is_available()` would be false on a GPU machine);
//! * the memory-statistics shim (`csrc/memstats.cpp`), compiled against the same headers.
use std::path::PathBuf;

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-changed=csrc/memstats.cpp");
    // Set by torch-sys (`links = "tch"`, `cargo:libtorch_lib=...`).
    let lib_dir = match std::env::var("DEP_TCH_LIBTORCH_LIB") {
        Ok(dir) => PathBuf::from(dir),
        Err(_) => panic!("torch-sys did not report its libtorch lib dir (DEP_TCH_LIBTORCH_LIB)"),
    };
    println!("cargo:rustc-link-arg=-Wl,-rpath,{}", lib_dir.display());
    if lib_dir.join("libtorch_cuda.so").exists() {
        println!("cargo:rustc-link-arg=-Wl,--push-state,--no-as-needed,-ltorch_cuda,--pop-state");
    }

    // Headers live beside lib/ in both the PyPI wheel and the libtorch zip.
    let root = lib_dir.parent().expect("libtorch lib dir has a parent");
    let include = root.join("include");
    cc::Build::new()
        .cpp(true)
        .pic(true)
        .warnings(false)
        .include(&include)
        .include(include.join("torch/csrc/api/include"))
        .flag("-std=c++17")
        .flag("-D_GLIBCXX_USE_CXX11_ABI=1")
        .file("csrc/memstats.cpp")
        .compile("dualedit_memstats");
}
