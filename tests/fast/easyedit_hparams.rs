//! EasyEdit's MEND hparams YAMLs (issue #49, item 5), as the public repository has them
//! (`tests/fixtures/easyedit_hparams/`): `dualedit config --from-easyedit` prints our config
//! with their values, names what it leaves out, and `train --config F.yaml` meta-trains on
//! small stand-ins (the files' layer numbers moved to the stand-ins' last three blocks, the
//! run cut to one step: nothing else changed).
use crate::common::{self, dualedit};

use serde_json::Value;

fn yaml(name: &str) -> std::path::PathBuf {
    common::fixture("easyedit_hparams").join(name)
}

fn stderr(o: &std::process::Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

#[test]
fn config_from_easyedit_prints_ours_and_names_what_it_leaves_out() {
    for (file, first, accumulate) in [
        (
            "training-qwen2vl-7b.yaml",
            "model.layers.25.mlp.up_proj.weight",
            2,
        ),
        (
            "training-llama-7b.yaml",
            "model.layers.29.mlp.gate_proj.weight",
            10,
        ),
        (
            "training-gpt2-xl.yaml",
            "transformer.h.45.mlp.c_proj.weight",
            10,
        ),
        (
            "editing-gpt2-xl.yaml",
            "transformer.h.45.mlp.c_proj.weight",
            10,
        ),
        (
            "editing-llama-7b.yaml",
            "model.layers.29.mlp.gate_proj.weight",
            10,
        ),
    ] {
        let out = dualedit(&["config", "--from-easyedit", yaml(file).to_str().unwrap()]);
        assert!(out.status.success(), "{file}: {}", stderr(&out));
        let v: Value = serde_json::from_slice(&out.stdout)
            .unwrap_or_else(|e| panic!("{file}: not JSON ({e})"));
        assert_eq!(v["edit_params"][0], first, "{file}: {v}");
        assert_eq!(
            (
                v["rank"].as_i64(),
                v["mode"].as_str(),
                v["shared"].as_bool()
            ),
            (Some(1920), Some("combine"), Some(true)),
            "{file}"
        );
        assert_eq!(
            (
                v["lr"].as_f64(),
                v["edit_lr"].as_f64(),
                v["c_edit"].as_f64()
            ),
            (Some(1e-6), Some(1e-4), Some(0.1)),
            "{file}"
        );
        assert_eq!(v["accumulate"].as_u64(), Some(accumulate), "{file}");
        let err = stderr(&out);
        assert!(err.contains("model_name (--model)"), "{file}: {err}");
        // What it printed reads back as a config.
        let dir = tempfile::tempdir().unwrap();
        let json = dir.path().join("c.json");
        std::fs::write(&json, &out.stdout).unwrap();
        dualedit::config::MendConfig::from_file(&json).unwrap_or_else(|e| panic!("{file}: {e}"));
    }
}

#[test]
fn other_methods_and_unknown_shapes_are_refused_by_name() {
    let dir = tempfile::tempdir().unwrap();
    for (text, needle) in [
        ("alg_name: ROME\nlayers: [5]\n", "line 2"),
        ("alg_name: ROME\n", "ROME"),
        ("alg: MEND\nmlp_class: MLP\n", "mlp_class"),
        ("alg: MEND\nrank: -3\n", "rank"),
        ("model:\n  name: x\n", "line 2"),
    ] {
        let f = dir.path().join("h.yaml");
        std::fs::write(&f, text).unwrap();
        for args in [vec!["config", "--from-easyedit", f.to_str().unwrap()]] {
            let out = dualedit(&args);
            common::assert_clean_error(&out, &["h.yaml", needle]);
        }
    }
}

/// The yaml with its layer numbers replaced (in order) by `to` (a list line that then
/// repeats an earlier one dropped), and the run cut to one step.
fn stand_in(file: &str, to: &[usize], dir: &std::path::Path) -> std::path::PathBuf {
    let text = std::fs::read_to_string(yaml(file)).unwrap();
    let layer = |l: &str| -> Option<usize> { l.split('.').find_map(|p| p.parse().ok()) };
    let mut theirs: Vec<usize> = text
        .lines()
        .filter(|l| l.starts_with("- "))
        .filter_map(layer)
        .collect();
    theirs.dedup();
    let mut out = String::new();
    for line in text.lines() {
        let line = match (line.starts_with("- "), layer(line)) {
            (true, Some(n)) => {
                let i = theirs.iter().position(|&t| t == n).unwrap();
                line.replace(&format!(".{n}."), &format!(".{}.", to[i]))
            }
            _ if line.starts_with("max_iters:") => "max_iters: 1".into(),
            _ if line.starts_with("rank:") => "rank: 8".into(),
            _ => line.to_string(),
        };
        if line.starts_with("- ") && out.lines().any(|l| l == line) {
            continue;
        }
        out.push_str(&line);
        out.push('\n');
    }
    let p = dir.join(file);
    std::fs::write(&p, out).unwrap();
    p
}

#[test]
fn easyedit_yamls_train_on_small_stand_ins() {
    let dir = tempfile::tempdir().unwrap();
    // The multimodal one trains on the visual world's records.
    let world = dir.path().join("world");
    let out = dualedit(&["world", "--vl", "--out", world.to_str().unwrap(), "--image-size", "84x84", "--train-scenes", "3", "--holdout-scenes", "2"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let text = common::root().join("data/world/edits-train.json").display().to_string();
    let (vqa, root) = (world.join("vqa-train.json").display().to_string(), world.display().to_string());
    let text_data = ["--data", text.as_str(), "--ds", "counterfact", "--truncate"];
    let vl_data = ["--data", vqa.as_str(), "--ds", "vqa", "--image-root", root.as_str()];
    // The Qwen2-VL stand-in has two blocks: the yaml's three map onto 0, 1, 1 (deduplicated).
    for (file, model, layers, data) in [
        ("training-gpt2-xl.yaml", "gpt2", [0, 1, 2], &text_data[..]),
        ("training-llama-7b.yaml", "llama", [0, 1, 2], &text_data[..]),
        ("training-qwen2vl-7b.yaml", "qwen2_vl", [0, 1, 1], &vl_data[..]),
    ] {
        let cfg = stand_in(file, &layers, dir.path());
        let out_dir = dir.path().join(format!("ed-{model}"));
        let (m, c, o) = (common::fixture(model).display().to_string(), cfg.display().to_string(), out_dir.display().to_string());
        let out = dualedit(&[&["train", "--model", m.as_str(), "--limit", "12", "--config", c.as_str(), "--out", o.as_str()][..], data].concat());
        assert!(out.status.success(), "{file} on {model}: {}", stderr(&out));
        let saved: Value = common::json_file(&out_dir.join("editor.json"));
        assert!(saved.to_string().contains(&format!(".{}.mlp.", layers[2])), "{file}: {saved}");
        // The keys it leaves out are named once, with the flags that give them.
        let err = stderr(&out);
        assert_eq!(err.matches("EasyEdit keys not used").count(), 1, "{err}");
        assert!(err.contains("device (--device / --sub-device)") || err.contains("model_name (--model)"), "{err}");
    }
}
