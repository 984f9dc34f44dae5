//! The host allocator's settings ([`dualedit::device::memory::tune_host_allocator`]): they
//! are process-wide, so they are checked in a child process, this test binary re-run with
//! one ignored test selected.
#![cfg(all(target_os = "linux", target_env = "gnu"))]
use std::process::Command;

use tch::{Device, Kind, Tensor};

const CHILD: &str = "DUALEDIT_ALLOCATOR_CHILD";

/// An edit's tensors (2–30 MiB) must come from the heap, reused without faulting pages in
/// afresh; with the 2 MiB threshold before, an 8 MiB tensor was a new mmap each time and a
/// third of an edit in a row on SmolLM2-135M was the kernel zeroing pages. Tensors of 32 MiB
/// or more still leave the resident set when freed.
#[test]
fn tensors_under_32_mib_come_from_the_heap_and_larger_ones_are_unmapped_when_freed() {
    let exe = std::env::current_exe().expect("the test binary");
    let out = Command::new(exe)
        .args(["--exact", "allocator::child", "--ignored", "--nocapture", "--test-threads", "1"])
        .env(CHILD, "1")
        .env_remove("DUALEDIT_GLIBC_MALLOC")
        .env_remove("GLIBC_TUNABLES")
        .output()
        .expect("run the child");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success() && stdout.contains("allocator: ok"), "child failed:\n{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
}

#[test]
#[ignore = "run in a child process by the test above"]
fn child() {
    if std::env::var_os(CHILD).is_none() {
        return;
    }
    dualedit::device::memory::tune_host_allocator();
    // SAFETY: mallinfo2 only reads the allocator's counters.
    let mapped = || unsafe { libc::mallinfo2() }.hblks;
    let floats = |mib: i64| Tensor::ones([mib * 1024 * 1024 / 4], (Kind::Float, Device::Cpu));
    let before = mapped();
    let small = floats(8);
    assert_eq!(mapped(), before, "an 8 MiB tensor was served from mmap");
    let large = floats(40);
    assert_eq!(mapped(), before + 1, "a 40 MiB tensor was not served from mmap");
    drop(large);
    assert_eq!(mapped(), before, "a freed 40 MiB tensor stayed mapped");
    drop(small);
    println!("allocator: ok");
}
