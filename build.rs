//! Link settings that torch-sys leaves to the final crate.
//!
//! * rpath to the libtorch lib dir, so `dualedit` runs without LD_LIBRARY_PATH;
//! * `libtorch_cuda` kept as a DT_NEEDED entry even though no symbol of it is referenced
//!   directly (the default `--as-needed` would drop it, and then libtorch never registers
//!   its CUDA backend: `tch::Cuda::is_available()` would be false on a GPU machine);
//! * the memory-statistics shim (`csrc/memstats.cpp`), compiled against the same headers;
//! * the CUDA allocator cap (`csrc/memcap.cpp`, `--max-memory`), compiled with
//!   `DUALEDIT_CUDA_ALLOCATOR` only when libtorch has CUDA and the CUDA runtime headers are
//!   found (`$CUDA_HOME/include`, `/usr/local/cuda/include`, or the `nvidia/cu*/include` of
//!   the PyPI wheel beside torch, which `./x` completes with the header-only
//!   `nvidia-cuda-crt`); otherwise it reports "not available" and `--max-memory` falls back
//!   to one fraction for every device.
use std::path::PathBuf;

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-changed=csrc/memstats.cpp");
    println!("cargo:rerun-if-changed=csrc/memcap.cpp");
    println!("cargo:rerun-if-env-changed=CUDA_HOME");
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
    // One C++ setup for both shims: libtorch's headers, C++17, the wheel's ABI.
    let torch_cpp = |file: &str| {
        let mut b = cc::Build::new();
        b.cpp(true)
            .pic(true)
            .warnings(false)
            .include(&include)
            .include(include.join("torch/csrc/api/include"))
            .flag("-std=c++17")
            .flag("-D_GLIBCXX_USE_CXX11_ABI=1")
            .file(file);
        b
    };
    torch_cpp("csrc/memstats.cpp").compile("dualedit_memstats");

    let mut cap = torch_cpp("csrc/memcap.cpp");
    let cuda_libs = lib_dir.join("libtorch_cuda.so").exists() && lib_dir.join("libc10_cuda.so").exists();
    // Tests check that a CUDA libtorch gets the per-device cap (`memory::per_device_caps`).
    println!("cargo:rustc-env=DUALEDIT_LIBTORCH_CUDA={}", u8::from(cuda_libs));
    if let Some(cuda_include) = cuda_libs.then(|| cuda_headers(root)).flatten() {
        cap.include(cuda_include).define("DUALEDIT_CUDA_ALLOCATOR", None);
        println!("cargo:rustc-link-search=native={}", lib_dir.display());
        println!("cargo:rustc-link-lib=dylib=c10_cuda");
    }
    cap.compile("dualedit_memcap");
}

/// A directory holding the CUDA runtime headers that `c10/cuda` headers include.
fn cuda_headers(torch_root: &std::path::Path) -> Option<PathBuf> {
    let mut candidates: Vec<PathBuf> = Vec::new();
    if let Ok(home) = std::env::var("CUDA_HOME") {
        candidates.push(PathBuf::from(home).join("include"));
    }
    candidates.push(PathBuf::from("/usr/local/cuda/include"));
    // The PyPI wheel: site-packages/torch is torch_root, its CUDA runtime is in
    // site-packages/nvidia/<cu13 | cuda_runtime>/include.
    if let Some(site) = torch_root.parent() {
        // A package installed later adds a folder here (and its include/ inside it).
        println!("cargo:rerun-if-changed={}", site.join("nvidia").display());
        if let Ok(entries) = std::fs::read_dir(site.join("nvidia")) {
            let mut dirs: Vec<PathBuf> = entries.filter_map(|e| e.ok().map(|e| e.path().join("include"))).filter(|d| d.is_dir()).collect();
            dirs.sort();
            // `./x` adds crt/ to these later on machines set up before it did: rebuild then.
            for d in &dirs {
                println!("cargo:rerun-if-changed={}", d.display());
            }
            candidates.extend(dirs);
        }
    }
    // The runtime wheel's include folder lacks crt/ (cuda_runtime.h includes
    // crt/host_config.h): only complete headers compile.
    candidates.into_iter().find(|d| d.join("cuda_runtime_api.h").exists() && d.join("crt/host_config.h").exists())
}
