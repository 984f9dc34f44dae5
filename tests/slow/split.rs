//! Issue #49 item 6: whether single and split runs differ by more than the order of a few
//! sums. On the CPU both sides run the same kernels, so any difference at all would be a
//! difference between the paths; there is none: forty meta-training steps (with their
//! validations) of the multimodal default on `cpu + cpu:1` give bit-identical losses and
//! accuracies to the single-device run, with the replica, the layer split and the
//! optimiser on the sub-device. A drift between the two sides where they run on different
//! hardware (a GPU and the CPU, or two GPUs' kernels) is therefore rounding, not the path.
use crate::common;

#[test]
fn single_and_split_are_bit_identical_on_the_cpu_over_forty_steps() {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = common::json_file(&common::root().join("configs/vl-world.json"));
    for (k, v) in [("max_steps", 40), ("val_every", 10), ("val_records", 4)] {
        cfg[k] = v.into();
    }
    let cfg_path = dir.path().join("cfg.json");
    std::fs::write(&cfg_path, cfg.to_string()).unwrap();
    let vl = common::shipped("vl");
    for extra in [&["--placement", "replica"][..], &["--placement", "balanced", "--optimizer-device", "sub"][..]] {
        let out = dir.path().join(extra[1]);
        // One thread, so that these two trainings leave the cores to the other slow tests
        // (both sides run alike either way).
        let o = common::dualedit_cmd().env("OMP_NUM_THREADS", "1").args(
            [
                &[
                    "compare", "train", "--model", vl.join("model").to_str().unwrap(), "--data", vl.join("world/vqa-train.json").to_str().unwrap(),
                    "--ds", "vqa", "--image-root", vl.join("world").to_str().unwrap(), "--config", cfg_path.to_str().unwrap(),
                    "--out", out.to_str().unwrap(), "--device", "cpu", "--sub-device", "cpu:1",
                ][..],
                extra,
            ]
            .concat(),
        ).output().unwrap();
        assert!(o.status.success(), "{extra:?}: {}", String::from_utf8_lossy(&o.stderr));
        let cmp = common::json_file(&out.join("compare.json"));
        let single = cmp["single"]["metrics"].as_object().unwrap();
        assert!(single.keys().filter(|k| k.starts_with("loss.step")).count() >= 40, "{extra:?}: {cmp}");
        for (k, a) in single {
            assert_eq!(Some(a), cmp["dual"]["metrics"].get(k), "{extra:?} {k}: single and split differ");
        }
    }
}
