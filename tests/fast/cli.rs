//! The built binary as scripts use it: `--json` gives exactly one JSON object on stdout for
//! every command that takes it, records longer than the maximum length are skipped (and
//! counted in the report), cut with `--truncate` or refused with `--strict`, and warnings
//! written to a pipe carry no colour codes.
use crate::common;

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Output;

use common::{fixture, TRAIN_RECORDS};
use serde_json::Value;

fn dualedit(args: &[&str]) -> Output {
    common::dualedit_cmd().args(args).env_remove("NO_COLOR").env("TERM", "xterm-256color").output().unwrap()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// Stdout as exactly one JSON object (serde_json refuses anything after the value).
fn one_object(what: &str, o: &Output) -> Value {
    assert!(o.status.success(), "{what}: {}", stderr(o));
    let text = String::from_utf8_lossy(&o.stdout);
    let v: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{what}: stdout is not one JSON value ({e}): {text:?}"));
    assert!(v.is_object(), "{what}: {v}");
    v
}


/// Subcommands (`compare` expanded into `compare train` / `compare eval`) whose help
/// lists `--json`, read from the binary itself so that a new one cannot go untested.
fn commands_with_json() -> BTreeSet<String> {
    let help = |args: &[&str]| String::from_utf8_lossy(&dualedit(&[args, &["--help"]].concat()).stdout).into_owned();
    let subcommands = |text: &str| -> Vec<String> {
        text.split("Commands:")
            .nth(1)
            .unwrap_or("")
            .lines()
            .skip(1) // the rest of the "Commands:" line
            .take_while(|l| !l.trim().is_empty())
            .filter_map(|l| l.split_whitespace().next().map(str::to_string))
            .filter(|c| c != "help")
            .collect()
    };
    let mut found = BTreeSet::new();
    let top = subcommands(&help(&[]));
    assert!(top.len() >= 10, "no subcommands found in --help: {top:?}");
    for c in top {
        let text = help(&[&c]);
        let nested = subcommands(&text);
        if nested.is_empty() {
            if text.contains("--json") {
                found.insert(c);
            }
        } else {
            for n in nested {
                if help(&[&c, &n]).contains("--json") {
                    found.insert(format!("{c} {n}"));
                }
            }
        }
    }
    found
}

#[test]
fn every_json_command_prints_one_json_object() {
    let dir = tempfile::tempdir().unwrap();
    let report = |name: &str| dir.path().join(name).display().to_string();
    let (edit_report, eval_report, compare_report) = (report("edit.json"), report("eval.json"), report("cmp/eval.json"));
    let [model, editor, holdout] = ["model", "editor", "world/edits-holdout.json"].map(|p| common::shipped(p).display().to_string());
    // Two edit requests from the world's held-out records.
    let records: Vec<Value> = serde_json::from_str(&std::fs::read_to_string(&holdout).unwrap()).unwrap();
    let requests = dir.path().join("requests.json");
    std::fs::write(&requests, Value::from(records[..2].to_vec()).to_string()).unwrap();
    let requests = requests.display().to_string();
    let eval = ["--model", &model, "--editor", &editor, "--data", &holdout, "--ds", "counterfact", "--limit", "2", "--json"];
    // `stats` writes into the editor's folder: a copy of the editor for many edits.
    let many = dir.path().join("editor-many");
    std::fs::create_dir(&many).unwrap();
    for f in ["editor.json", "editor.safetensors"] {
        std::fs::copy(common::shipped("editor-many").join(f), many.join(f)).unwrap();
    }
    let (many, corpus) = (many.display().to_string(), common::shipped("world/corpus.txt").display().to_string());
    let (gguf, converted) = (common::fixture("gguf/llama.gguf").display().to_string(), report("converted"));
    let runs: Vec<(&str, Vec<&str>, &str)> = vec![
        ("score", vec!["score", "--model", &model, "--text", "Vacorp was founded by", "--json"], "mean_nll"),
        ("convert", vec!["convert", "--gguf", &gguf, "--out", &converted, "--json"], "parameters"),
        ("demo", vec!["demo", "--multimodal", "--json"], "easyedit"),
        ("plan", vec!["plan", "--model", &model, "--config", "configs/world.json", "--json"], "totals"),
        ("edit", vec!["edit", "--model", &model, "--editor", &editor, "--requests", &requests, "--json", "--report", &edit_report], "requests"),
        ("eval", [&["eval"][..], &eval, &["--report", &eval_report]].concat(), "reliability"),
        ("stats", vec!["stats", "--model", &model, "--editor", &many, "--text", &corpus, "--max-tokens", "300", "--json"], "tokens"),
        // The eval report just written, merged.
        ("report merge", vec!["report", "merge", &eval_report, "--json"], "rows"),
        (
            "compare eval",
            [&["compare", "eval"][..], &eval, &["--device", "cpu", "--sub-device", "cpu:1", "--report", &compare_report]].concat(),
            "metrics_agree",
        ),
    ];
    let tested: BTreeSet<String> = runs.iter().map(|(name, _, _)| name.to_string()).collect();
    assert_eq!(commands_with_json(), tested, "a command takes --json but is not run here");
    for (name, args, key) in &runs {
        let v = one_object(name, &dualedit(args));
        assert!(v.get(*key).is_some(), "{name}: no `{key}` in {v}");
    }
}

/// A records file: two over-long records (0 and 3), one with an empty target (2, skipped
/// by the reader) and two that fit in 12 GPT-2 tokens.
fn over_long_records(dir: &Path) -> PathBuf {
    let long = "In the long and winding story that everyone in the old village by the river keeps telling to \
                every visitor who stops there for the night, the capital of France is";
    let text = serde_json::json!([
        { "prompt": long, "target_new": "Rome" },
        { "prompt": "The capital of France is", "target_new": "Rome" },
        { "prompt": "The capital of Spain is", "target_new": "" },
        { "prompt": long.replace("France", "Italy"), "target_new": "Paris" },
        { "prompt": "The capital of Italy is", "target_new": "Paris" }
    ]);
    let path = dir.join("long.json");
    std::fs::write(&path, text.to_string()).unwrap();
    path
}

fn no_colour(what: &str, err: &str) {
    assert!(!err.contains('\u{1b}'), "{what}: colour codes in a piped stderr: {err:?}");
}

#[test]
fn over_long_records_are_skipped_counted_truncated_or_refused() {
    let dir = tempfile::tempdir().unwrap();
    let data = over_long_records(dir.path());
    let (m, d) = (fixture("gpt2").display().to_string(), data.display().to_string());
    let report = |name: &str| dir.path().join(name).display().to_string();
    let eval = |extra: &[&str], name: &str| {
        let args = [&["eval", "--model", &m, "--method", "unedited", "--data", &d, "--ds", "counterfact", "--max-length", "12", "--json"][..], extra];
        let r = report(name);
        dualedit(&[&args.concat()[..], &["--report", &r]].concat())
    };

    // Default: skipped, named in one warning, counted in the output and the report.
    let out = eval(&[], "skip.json");
    let v = one_object("eval", &out);
    let err = stderr(&out);
    no_colour("eval", &err);
    let warnings: Vec<&str> = err.lines().filter(|l| l.contains("longer than 12 tokens")).collect();
    assert_eq!(warnings.len(), 1, "{err}");
    assert!(warnings[0].contains("WARN") && warnings[0].contains("long.json"), "{err}");
    assert!(warnings[0].contains("skipped 2 of 4") && warnings[0].contains("record 0:") && warnings[0].contains("record 3:"), "{err}");
    assert_eq!(v["n"], 2, "{v}");
    let data = &v["data"];
    assert_eq!((data["records"].as_u64(), data["used"].as_u64()), (Some(5), Some(2)), "{data}");
    assert_eq!((data["skipped_empty"].as_u64(), data["skipped_too_long"].as_u64(), data["truncated"].as_u64()), (Some(1), Some(2), Some(0)), "{data}");
    let first: Vec<u64> = data["first_skipped"].as_array().unwrap().iter().map(|s| s["record"].as_u64().unwrap()).collect();
    assert_eq!(first, [0, 2, 3], "{data}");
    let saved: Value = serde_json::from_str(&std::fs::read_to_string(report("skip.json")).unwrap()).unwrap();
    assert_eq!(&saved["data"], data, "the report carries the same counts");

    // --truncate: every record that can be cut is used.
    let v = one_object("eval --truncate", &eval(&["--truncate"], "truncate.json"));
    assert_eq!(v["n"], 4, "{v}");
    assert_eq!((v["data"]["truncated"].as_u64(), v["data"]["skipped_too_long"].as_u64()), (Some(2), Some(0)), "{v}");

    // --strict: today's error, naming the file and the record.
    let out = eval(&["--strict"], "strict.json");
    let err = stderr(&out);
    let errors: Vec<&str> = err.lines().filter(|l| l.starts_with("error:")).collect();
    assert!(!out.status.success() && errors.len() == 1, "{err}");
    assert!(errors[0].contains("long.json: record 0: prompt + target is") && errors[0].contains("longer than the maximum of 12"), "{err}");
    assert!(!Path::new(&report("strict.json")).exists());
    let out = eval(&["--strict", "--truncate"], "both.json");
    assert!(!out.status.success() && stderr(&out).contains("cannot be used with"), "{}", stderr(&out));

    // edit: the same records as requests.
    let out = dualedit(&["edit", "--model", &m, "--method", "ft", "--requests", &d, "--max-length", "12", "--json", "--report", &report("edit.json")]);
    let v = one_object("edit", &out);
    no_colour("edit", &stderr(&out));
    assert_eq!(v["requests"].as_array().unwrap().len(), 2, "{v}");
    assert_eq!(v["requests"][0]["prompt"], "The capital of France is", "records and results stay aligned: {v}");
    assert_eq!(v["data"]["skipped_too_long"], 2, "{v}");
    let saved: Value = serde_json::from_str(&std::fs::read_to_string(report("edit.json")).unwrap()).unwrap();
    assert_eq!(saved["data"]["skipped_too_long"], 2, "{saved}");

    // train: the five training records plus two over-long ones.
    let mut records: Vec<Value> = serde_json::from_str(TRAIN_RECORDS).unwrap();
    let long: Vec<Value> = serde_json::from_str(&std::fs::read_to_string(over_long_records(dir.path())).unwrap()).unwrap();
    records.insert(1, long[0].clone());
    records.push(long[3].clone());
    let train_data = dir.path().join("train.json");
    std::fs::write(&train_data, Value::from(records).to_string()).unwrap();
    let cfg = dir.path().join("cfg.json");
    std::fs::write(&cfg, r#"{"rank": 16, "accumulate": 1, "max_steps": 2, "val_every": 2, "val_records": 1, "max_length": 24}"#).unwrap();
    let train = |extra: &[&str], out: &str| {
        let base = ["train", "--model", &m, "--data", train_data.to_str().unwrap(), "--ds", "counterfact", "--config", cfg.to_str().unwrap()];
        let (o, r) = (report(out), report(&format!("{out}.json")));
        dualedit(&[&base[..], &["--out", &o, "--report", &r], extra].concat())
    };
    let out = train(&[], "ed");
    assert!(out.status.success(), "{}", stderr(&out));
    no_colour("train", &stderr(&out));
    let saved: Value = serde_json::from_str(&std::fs::read_to_string(report("ed.json")).unwrap()).unwrap();
    assert_eq!((saved["data"]["used"].as_u64(), saved["data"]["skipped_too_long"].as_u64()), (Some(5), Some(2)), "{}", saved["data"]);
    let first: Vec<u64> = saved["data"]["first_skipped"].as_array().unwrap().iter().map(|s| s["record"].as_u64().unwrap()).collect();
    assert_eq!(first, [1, 6], "{}", saved["data"]);
    let out = train(&["--strict"], "ed-strict");
    assert!(!out.status.success() && stderr(&out).contains("train.json: record 1: prompt + target"), "{}", stderr(&out));
}

/// The issue's case: the shared zsRE file with the embedded default's config (32 tokens)
/// stopped at record 0; now the run goes on without the records that do not fit.
#[test]
fn shared_zsre_trains_with_the_default_config() {
    let Some(shared) = common::shared_data_dir() else { return };
    let dir = tempfile::tempdir().unwrap();
    let zsre = shared.join("zsre/zsre_mend_train-1k.json").display().to_string();
    let model = common::shipped("model").display().to_string();
    let run = |extra: &[&str], out: &str| {
        let (o, r) = (dir.path().join(out).display().to_string(), dir.path().join(format!("{out}.json")).display().to_string());
        let base = ["train", "--model", &model, "--data", &zsre, "--ds", "zsre", "--config", "configs/world.json", "--max-steps", "1"];
        (dualedit(&[&base[..], &["--out", &o, "--report", &r], extra].concat()), r)
    };
    let (out, report) = run(&["--limit", "100", "--truncate"], "truncate");
    assert!(out.status.success(), "{}", stderr(&out));
    let saved: Value = serde_json::from_str(&std::fs::read_to_string(report).unwrap()).unwrap();
    let data = &saved["data"];
    assert!(data["truncated"].as_u64().unwrap() > 0 && data["used"].as_u64().unwrap() > 50, "{data}");
    let (out, _) = run(&["--limit", "100", "--strict"], "strict");
    assert!(!out.status.success() && stderr(&out).contains("record 0: prompt + target is 38 tokens"), "{}", stderr(&out));
}

/// `dualedit world --vl` writes the visual world's files (and the same bytes for the same
/// seed), refuses a folder of someone else's files, and rejects sizes off the 28 grid.
#[test]
fn world_writes_the_visual_world() {
    let dir = tempfile::tempdir().unwrap();
    let out = |name: &str| dir.path().join(name).display().to_string();
    let args = |o: &str| -> Vec<String> {
        ["world", "--vl", "--out", o, "--seed", "3", "--train-scenes", "4", "--holdout-scenes", "2", "--image-size", "140x84"].map(String::from).to_vec()
    };
    let run = |o: &str| {
        let a = args(o);
        dualedit(&a.iter().map(String::as_str).collect::<Vec<_>>())
    };
    let (a, b) = (out("a"), out("b"));
    let v = one_object("world --vl", &run(&a));
    assert_eq!(v["scenes"], 6, "{v}");
    assert_eq!(v["image_size"], serde_json::json!([140, 84]), "{v}");
    one_object("world --vl again", &run(&b));
    for name in ["scenes.json", "pretrain.json", "vqa-train.json", "vqa-holdout.json", "images/scene-0000.png", "images_rephrase/scene-0005.png"] {
        let (x, y) = (std::fs::read(dir.path().join("a").join(name)).unwrap(), std::fs::read(dir.path().join("b").join(name)).unwrap());
        assert!(x == y, "{name} differs between two builds of one seed");
    }
    let records: Vec<Value> = serde_json::from_str(&std::fs::read_to_string(dir.path().join("a/vqa-train.json")).unwrap()).unwrap();
    assert!(!records.is_empty());
    for r in &records {
        assert!(dir.path().join("a").join(r["image_rephrase"].as_str().unwrap()).is_file(), "{r}");
    }
    // Rebuilding over itself is fine; over someone's folder is not.
    one_object("world --vl over itself", &run(&a));
    std::fs::create_dir(dir.path().join("mine")).unwrap();
    std::fs::write(dir.path().join("mine/notes.txt"), "x").unwrap();
    let o = run(&out("mine"));
    assert!(!o.status.success() && stderr(&o).contains("refusing"), "{}", stderr(&o));
    let o = dualedit(&["world", "--vl", "--out", &out("c"), "--image-size", "100x112"]);
    assert!(!o.status.success() && stderr(&o).contains("multiple of 28"), "{}", stderr(&o));
    // Without --vl: the text world, as build-default writes it.
    one_object("world", &dualedit(&["world", "--out", &out("text")]));
    assert!(dir.path().join("text/edits-train.json").is_file());
}

/// docs/cli.md is the clap definitions rendered (`dualedit::cli::reference`): a flag added,
/// renamed or re-documented without regenerating it fails here.
#[test]
fn docs_cli_md_is_generated_from_the_flags() {
    let path = common::root().join("docs/cli.md");
    let now = dualedit::cli::reference::markdown();
    if std::env::var_os("DUALEDIT_WRITE_DOCS").is_some() {
        std::fs::write(&path, &now).unwrap();
    }
    let committed = std::fs::read_to_string(&path).unwrap_or_default();
    assert!(committed == now, "docs/cli.md is stale: regenerate it with DUALEDIT_WRITE_DOCS=1 ./x test --test cli");
    for command in ["score", "train", "edit", "eval", "compare train", "compare eval", "demo", "pretrain", "build-default", "world", "serve", "plan"] {
        assert!(now.contains(&format!("## `dualedit {command}`")), "docs/cli.md has no section for {command}");
    }
}

/// A FIFO with nobody writing (made here; removed with its folder).
fn fifo(path: &Path) -> PathBuf {
    let c = std::ffi::CString::new(path.to_str().unwrap()).unwrap();
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0, "mkfifo {}", path.display());
    path.to_path_buf()
}

/// Issue #48: a FIFO, a device or a folder where a command reads a file (records, data, a
/// config, reports to merge) ends the command at once with one error naming the file,
/// instead of waiting forever (a FIFO) or reading without end (`/dev/zero`).
#[test]
fn fifos_devices_and_folders_as_inputs_end_at_once_with_one_error() {
    let dir = tempfile::tempdir().unwrap();
    let root = common::root();
    let (model, editor) = (root.join("data/model"), root.join("data/editor"));
    let pipe = fifo(&dir.path().join("pipe.json"));
    let (data, cfg) = (root.join("data/world/edits-holdout.json"), root.join("configs/tiny.json"));
    let (m, e, d, c, p) = (s(&model), s(&editor), s(&data), s(&cfg), s(&pipe));
    let folder = dir.path().to_str().unwrap();
    let runs: Vec<(Vec<&str>, &str, &str)> = vec![
        (vec!["edit", "--model", m, "--editor", e, "--requests", p], p, "FIFO"),
        (vec!["edit", "--model", m, "--editor", e, "--requests", "/dev/zero"], "/dev/zero", "device"),
        (vec!["edit", "--model", m, "--editor", e, "--requests", folder], folder, "directory"),
        (vec!["eval", "--model", m, "--editor", e, "--data", p, "--ds", "counterfact"], p, "FIFO"),
        (vec!["train", "--model", m, "--data", p, "--ds", "counterfact", "--config", c, "--out", folder], p, "FIFO"),
        (vec!["train", "--model", m, "--data", d, "--ds", "counterfact", "--config", p, "--out", folder], p, "FIFO"),
        (vec!["plan", "--model", m, "--config", p], p, "FIFO"),
        (vec!["plan", "--model", m, "--config", c, "--data", p, "--ds", "counterfact"], p, "FIFO"),
        (vec!["report", "merge", p], p, "FIFO"),
        (vec!["report", "merge", "/dev/zero"], "/dev/zero", "device"),
    ];
    for (args, file, what) in runs {
        let t = std::time::Instant::now();
        let o = dualedit(&args);
        let took = t.elapsed();
        let err = stderr(&o);
        assert!(!o.status.success(), "{args:?}: {err}");
        assert!(err.contains(file) && err.contains(what), "{args:?}: {err}");
        assert_eq!(err.lines().filter(|l| l.contains("error")).count(), 1, "{args:?}: one error: {err}");
        // The process with libtorch's start; the read itself is refused before it begins.
        assert!(took < std::time::Duration::from_secs(5), "{args:?} took {took:?}");
    }
}

/// `plan --fit` refuses a size no card has and empty entries, naming the flag; `plan
/// --optimizer-device sub` needs a sub-device.
#[test]
fn plan_fit_refuses_sizes_that_cannot_be_meant() {
    let root = common::root();
    let (model, cfg) = (root.join("data/model"), root.join("configs/tiny.json"));
    for (fit, needle) in [("1KiB", "smaller than any card"), ("16GiB,,24GiB", "size 2 is empty"), ("16GiB,", "size 2 is empty")] {
        let o = dualedit(&["plan", "--model", s(&model), "--config", s(&cfg), "--fit", fit]);
        let err = stderr(&o);
        assert!(!o.status.success() && err.contains("--fit") && err.contains(needle), "{fit}: {err}");
    }
    let o = dualedit(&["plan", "--model", s(&model), "--config", s(&cfg), "--fit", "16GiB,24GiB"]);
    assert!(o.status.success(), "{}", stderr(&o));
    // The optimiser "on the sub-device" of a one-device plan, as `train` refuses it.
    let o = dualedit(&["plan", "--model", s(&model), "--config", s(&cfg), "--optimizer-device", "sub"]);
    assert!(!o.status.success() && stderr(&o).contains("--optimizer-device sub needs a --sub-device"), "{}", stderr(&o));
    let o = dualedit(&["plan", "--model", s(&model), "--config", s(&cfg), "--optimizer-device", "sub", "--sub-device", "cpu:1"]);
    assert!(o.status.success(), "{}", stderr(&o));
}

/// Every file of a folder, by name, with its bytes.
fn snapshot(dirs: &[&Path]) -> std::collections::BTreeMap<PathBuf, Vec<u8>> {
    let mut out = std::collections::BTreeMap::new();
    for d in dirs {
        for e in std::fs::read_dir(d).unwrap() {
            let p = e.unwrap().path();
            if p.is_file() {
                out.insert(p.clone(), std::fs::read(&p).unwrap());
            }
        }
    }
    out
}

/// Issue #48: `--report` never replaces an input of the run (the model's files, the
/// editor's, the requests) or a file dualedit did not write (a user's file named as the
/// report, or where its timeline or chart would go): refused before the run, naming the
/// file, every input byte-identical after. A report dualedit wrote is replaced.
#[test]
fn a_report_never_replaces_an_input_or_a_file_it_did_not_write() {
    let dir = tempfile::tempdir().unwrap();
    let root = common::root();
    let (model, editor) = (dir.path().join("model"), dir.path().join("editor"));
    for (from, to) in [(root.join("data/model"), &model), (root.join("data/editor"), &editor)] {
        std::fs::create_dir(to).unwrap();
        for e in std::fs::read_dir(&from).unwrap() {
            let p = e.unwrap().path();
            std::fs::copy(&p, to.join(p.file_name().unwrap())).unwrap();
        }
    }
    let requests = dir.path().join("requests.json");
    std::fs::write(&requests, r#"[{"prompt": "The capital of France is", "target_new": "Rome", "subject": "France"}]"#).unwrap();
    let user = dir.path().join("mine");
    std::fs::create_dir(&user).unwrap();
    std::fs::write(user.join("notes.json"), "my notes").unwrap();
    std::fs::write(user.join("r.timeline.json"), "my timeline").unwrap();
    std::fs::write(user.join("q.timeline.png"), "my picture").unwrap();
    let before = snapshot(&[&model, &editor, dir.path(), &user]);
    let edit = |report: &Path| dualedit(&["edit", "--model", s(&model), "--editor", s(&editor), "--requests", s(&requests), "--report", s(report)]);
    for (report, named) in [
        (model.join("model.safetensors"), model.join("model.safetensors")),
        (model.join("config.json"), model.join("config.json")),
        (model.join("tokenizer.json"), model.join("tokenizer.json")),
        (editor.join("editor.json"), editor.join("editor.json")),
        (requests.clone(), requests.clone()),
        (user.join("notes.json"), user.join("notes.json")),
        (user.join("r.json"), user.join("r.timeline.json")),
        (user.join("q.json"), user.join("q.timeline.png")),
        (model.clone(), model.clone()),
    ] {
        let o = edit(&report);
        let err = stderr(&o);
        assert!(!o.status.success(), "{}: {err}", report.display());
        assert!(err.contains("--report") && err.contains(s(&named)), "{}: {err}", report.display());
    }
    assert_eq!(snapshot(&[&model, &editor, dir.path(), &user]), before, "an input or a user's file changed");
    // A fresh path is written, then replaced by the next run (dualedit wrote it); the
    // inputs stay as they were.
    let ours = dir.path().join("runs/edit.json");
    for _ in 0..2 {
        let o = edit(&ours);
        assert!(o.status.success(), "{}", stderr(&o));
    }
    assert!(ours.is_file() && dir.path().join("runs/edit.timeline.json").is_file());
    let after = snapshot(&[&model, &editor, &user]);
    assert!(after.iter().all(|(p, b)| before.get(p) == Some(b)), "an input changed");
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// A copy of the embedded default's `data/editor` in `dir/editor` (`stats` writes into the
/// editor's folder).
fn default_editor_copy(dir: &Path) -> std::path::PathBuf {
    let editor = dir.join("editor");
    std::fs::create_dir(&editor).unwrap();
    for e in std::fs::read_dir(common::root().join("data/editor")).unwrap() {
        let p = e.unwrap().path();
        std::fs::copy(&p, editor.join(p.file_name().unwrap())).unwrap();
    }
    editor
}

/// Issue #48: `stats --text` streams its file, but a FIFO, a device or a line longer than
/// 1 MiB (a file without line breaks) ends it at once with one error naming the file; the
/// editor's folder is left as it was.
#[test]
fn stats_refuses_a_fifo_a_device_and_a_line_without_end() {
    let dir = tempfile::tempdir().unwrap();
    let root = common::root();
    let editor = default_editor_copy(dir.path());
    let before = snapshot(&[&editor]);
    let pipe = fifo(&dir.path().join("text.txt"));
    let long = dir.path().join("long.txt");
    std::fs::write(&long, "word ".repeat(300_000)).unwrap();
    for (text, needle) in [(pipe.as_path(), "FIFO"), (Path::new("/dev/zero"), "device"), (long.as_path(), "longer than")] {
        let t = std::time::Instant::now();
        let o = dualedit(&["stats", "--model", s(&root.join("data/model")), "--editor", s(&editor), "--text", s(text)]);
        let err = stderr(&o);
        assert!(!o.status.success() && err.contains(s(text)) && err.contains(needle), "{}: {err}", text.display());
        assert!(t.elapsed() < std::time::Duration::from_secs(10), "{}: took {:?}", text.display(), t.elapsed());
    }
    assert_eq!(snapshot(&[&editor]), before);
}

/// Issue #47: `stats --data` sums a data file's locality views. A file with no such view,
/// `--data` without `--ds`, or both `--text` and `--data` end with one error naming the
/// file or the flags; the editor's folder is left as it was.
#[test]
fn stats_from_data_refuses_a_file_without_locality_views() {
    let dir = tempfile::tempdir().unwrap();
    let root = common::root();
    let editor = default_editor_copy(dir.path());
    let before = snapshot(&[&editor]);
    let data = dir.path().join("no-loc.json");
    std::fs::write(&data, r#"[{"prompt": "The capital of France is", "target_new": "Rome", "ground_truth": "Paris"}]"#).unwrap();
    let model_dir = root.join("data/model");
    let (model, ed, file) = (s(&model_dir), s(&editor), s(&data));
    let o = dualedit(&["stats", "--model", model, "--editor", ed, "--data", file, "--ds", "counterfact"]);
    let err = stderr(&o);
    assert!(!o.status.success() && err.contains(file) && err.contains("locality view"), "{err}");
    for (args, needle) in [(vec!["--data", file], "--ds"), (vec!["--data", file, "--ds", "counterfact", "--text", file], "--text")] {
        let o = dualedit(&[&["stats", "--model", model, "--editor", ed][..], &args].concat());
        let err = stderr(&o);
        assert!(!o.status.success() && err.contains(needle), "{args:?}: {err}");
    }
    assert_eq!(snapshot(&[&editor]), before);
}

/// Issue #50: an option is one field of a library type. The CLI's flags and JSON fill the
/// same type; the library's errors name the field, which the CLI prints as its flag.
#[test]
fn options_are_library_fields_and_the_cli_prints_them_as_flags() {
    use clap::Parser;
    use dualedit::cli::{flags_named, Cli, Command};
    use dualedit::run::options::{GroupOptions, GuardOptions};
    assert_eq!(flags_named("`sub_device` cpu:1: bad; `guard_max_kl` must"), "--sub-device cpu:1: bad; --guard-max-kl must");
    assert_eq!(flags_named("or turn the guard off (`guard`=false)"), "or turn the guard off (--no-guard)");
    assert_eq!(flags_named("try `dtype`=bf16, `recompute`=true and `placement`=auto"), "try --dtype bf16, --recompute and --placement auto");
    // Backticked names no flag has (a record's keys) and a lone backtick stay as they are.
    assert_eq!(flags_named("record 3: `prompt` and `nope` are `"), "record 3: `prompt` and `nope` are `");
    let from_json: GuardOptions = serde_json::from_str(r#"{"guard_max_kl": 0.5, "guard_refuse": true}"#).unwrap();
    let parsed = Cli::try_parse_from(["dualedit", "edit", "--model", "m", "--requests", "r", "--guard-max-kl", "0.5", "--guard-refuse"]).unwrap();
    let Command::Edit(a) = parsed.command else { panic!("not edit") };
    assert_eq!(a.guard, from_json);
    let Command::Edit(off) = Cli::try_parse_from(["dualedit", "edit", "--model", "m", "--requests", "r", "--no-guard"]).unwrap().command else { panic!() };
    assert!(!off.guard.guard && off.guard.config().unwrap().is_none());
    let e = GuardOptions { guard_max_kl: Some(-1.0), ..Default::default() }.config().unwrap_err().to_string();
    assert!(e.contains("`guard_max_kl`") && e.contains("[0, ∞)"), "{e}");
    let e = GroupOptions { stepwise: true, ..Default::default() }.capacity(&GuardOptions::default()).unwrap_err().to_string();
    assert!(e.contains("`stepwise`"), "{e}");
    // The binary prints the same error with the flags.
    let o = dualedit(&["eval", "--model", "m", "--data", "d", "--ds", "zsre", "--guard-max-kl", "0.5"]);
    let err = stderr(&o);
    assert!(!o.status.success() && err.contains("--stepwise") && err.contains("--edits-per-batch") && !err.contains('`'), "{err}");
    // `plan`'s question is one library type too: its flags and its JSON read the same.
    let Command::Plan(p) = Cli::try_parse_from(["dualedit", "plan", "--model", "m", "--config", "c", "--sub-device", "cpu:1", "--image-size", "448x448", "--ds", "vqa"])
        .unwrap()
        .command
    else {
        panic!("not plan")
    };
    let from_json: dualedit::planner::PlanRequest =
        serde_json::from_str(r#"{"model": "m", "config": "c", "sub_device": "cpu:1", "image_size": [448, 448], "ds": "vqa"}"#).unwrap();
    assert_eq!(serde_json::to_value(&p.request).unwrap(), serde_json::to_value(&from_json).unwrap());
    let cfg = common::root().join("configs/world.json");
    let model = common::fixture("gpt2");
    let text_only = dualedit::planner::PlanRequest { ds: Some(dualedit::data::DatasetKind::Zsre), ..from_json.clone() };
    let text_only = dualedit::planner::PlanRequest { model: model.clone(), config: cfg.clone(), ..text_only };
    let e = text_only.answer(true).unwrap_err().to_string();
    assert!(e.contains("`ds`=zsre is text-only: `image_size`"), "{e}");
    let o = dualedit(&["plan", "--model", &model.display().to_string(), "--config", &cfg.display().to_string(), "--ds", "zsre", "--image-size", "4x4"]);
    let err = stderr(&o);
    assert!(!o.status.success() && err.contains("--ds zsre is text-only: --image-size plans"), "{err}");
}
