//! Memory timeline charts: rendered from synthetic timelines, decoded back as PNGs, and
//! written beside every run report.
use std::collections::BTreeMap;
use std::path::Path;

use dualedit::run::chart::{render_timeline_png, render_timeline_png_without_text, HEIGHT, WIDTH};
use dualedit::device::memory::{MemorySample, MemoryTracker, PhaseSample};
use dualedit::device::MoverStats;
use dualedit::run::report::{DeviceInfo, RunReport};
use tch::Device;

const MIB: u64 = 1024 * 1024;

fn sample(current_mib: u64, peak_mib: u64, process_wide: bool) -> MemorySample {
    MemorySample {
        current_allocated_bytes: current_mib * MIB,
        peak_allocated_bytes: peak_mib * MIB,
        current_reserved_bytes: current_mib * MIB,
        peak_reserved_bytes: peak_mib * MIB,
        process_wide,
    }
}

/// A dual-device training run as the tracker records it: main and sub on two GPUs.
fn synthetic_timeline() -> Vec<PhaseSample> {
    let phases = [
        ("load", 0.0, (13_000, 13_100), (12_900, 12_950)),
        ("editor", 800.0, (14_000, 14_050), (12_900, 12_950)),
        ("edited_forward", 2_100.0, (14_600, 15_200), (13_400, 16_800)),
        ("backward", 2_900.0, (15_100, 16_300), (13_000, 17_100)),
        ("optimizer_step", 3_300.0, (15_000, 15_900), (12_950, 13_000)),
        ("edited_forward", 5_200.0, (14_700, 15_300), (13_400, 16_900)),
        ("backward", 6_000.0, (15_100, 16_400), (13_000, 17_100)),
        ("optimizer_step", 6_400.0, (15_000, 15_900), (12_950, 13_000)),
    ];
    let mut out = Vec::new();
    for (phase, ms, main, sub) in phases {
        for (role, device, (cur, peak)) in [("main", "cuda:0", main), ("sub", "cuda:1", sub)] {
            out.push(PhaseSample {
                phase: phase.into(),
                role: role.into(),
                device: device.into(),
                elapsed_ms: ms,
                sample: sample(cur, peak, false),
            });
        }
    }
    out
}

/// Decodes a PNG and counts pixels that are clearly coloured (not white or grey).
fn decode(path: &Path) -> (u32, u32, usize) {
    let img = image::open(path).unwrap_or_else(|e| panic!("{} does not decode: {e}", path.display())).to_rgb8();
    let coloured = img
        .pixels()
        .filter(|p| {
            let [r, g, b] = p.0;
            let (mx, mn) = (r.max(g).max(b), r.min(g).min(b));
            mx - mn > 60
        })
        .count();
    (img.width(), img.height(), coloured)
}

#[test]
fn synthetic_timeline_renders_to_a_png() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("run.timeline.png");
    let info = render_timeline_png(&synthetic_timeline(), &path).unwrap();
    assert_eq!(info.path, path);
    // Main and sub are on different devices: one line each; 8 distinct phase boundaries.
    assert_eq!(info.series, vec![("main (cuda:0)".to_string(), 8), ("sub (cuda:1)".to_string(), 8)]);
    assert_eq!(info.phase_marks, 8);
    let (w, h, coloured) = decode(&path);
    assert_eq!((w, h), (WIDTH, HEIGHT));
    assert!(coloured > 2_000, "the lines should be drawn in colour ({coloured} coloured pixels)");
    // The temporary file was renamed away.
    let names: Vec<_> = std::fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().file_name()).collect();
    assert_eq!(names, vec![std::ffi::OsString::from("run.timeline.png")]);
    // Keep a copy to look at when asked to.
    if let Some(keep) = std::env::var_os("DUALEDIT_KEEP_CHART") {
        std::fs::copy(&path, keep).unwrap();
    }
}

#[test]
fn chart_without_a_font_still_renders() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("plain.png");
    let info = render_timeline_png_without_text(&synthetic_timeline(), &path).unwrap();
    assert!(!info.labelled);
    let (w, h, coloured) = decode(&path);
    assert_eq!((w, h), (WIDTH, HEIGHT));
    assert!(coloured > 2_000);
}

#[test]
fn roles_on_one_device_share_a_line_and_single_samples_work() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("single.png");
    // One mark only: a zero-width time range must still draw.
    let samples: Vec<PhaseSample> = ["main", "sub"]
        .iter()
        .map(|role| PhaseSample {
            phase: "load".into(),
            role: (*role).into(),
            device: "cpu".into(),
            elapsed_ms: 0.0,
            sample: sample(700, 720, true),
        })
        .collect();
    let info = render_timeline_png(&samples, &path).unwrap();
    assert_eq!(info.series, vec![("main+sub (cpu, process RSS)".to_string(), 1)]);
    assert!(decode(&path).0 > 0);
    // Nothing to draw is an error (the report hook turns it into a warning).
    assert!(render_timeline_png(&[], &dir.path().join("empty.png")).is_err());
    assert!(!dir.path().join("empty.png").exists());
}

fn report() -> RunReport<BTreeMap<String, f64>> {
    RunReport {
        format: dualedit::run::report::REPORT_FORMAT,
        command: "train".into(),
        model: "m".into(),
        devices: DeviceInfo::from(&dualedit::device::DevicePlan::single(tch::Device::Cpu)),
        dtype: "f32".into(),
        seed: 0,
        data: None,
        metrics: BTreeMap::new(),
        seconds: BTreeMap::new(),
        memory: BTreeMap::new(),
        moved: MoverStats::default(),
        timeline_file: None,
    }
}

#[test]
fn run_report_writes_the_chart_beside_it() {
    let dir = tempfile::tempdir().unwrap();
    let mut tracker = MemoryTracker::new(&[("main", Device::Cpu), ("sub", Device::Cpu)]);
    tracker.mark("load").unwrap();
    let t = tch::Tensor::ones([8 * 1024 * 1024], (tch::Kind::Float, Device::Cpu));
    tracker.mark("edit").unwrap();
    drop(t);
    tracker.mark("eval").unwrap();
    let path = report().write(&dir.path().join("edit-1.json"), &tracker).unwrap();
    assert!(path.exists());
    assert!(dir.path().join("edit-1.timeline.json").exists());
    let (w, h, _) = decode(&dir.path().join("edit-1.timeline.png"));
    assert!(w > 0 && h > 0);

    // A chart that cannot be drawn (no samples) is a warning: the report is still written.
    let empty = MemoryTracker::new(&[("main", Device::Cpu)]);
    let path = report().write(&dir.path().join("empty.json"), &empty).unwrap();
    assert!(path.exists());
    assert!(!dir.path().join("empty.timeline.png").exists());
}
