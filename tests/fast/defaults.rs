//! Issue #49: one default method everywhere (the CLI's `--method auto`: one request with
//! mend, several or one after another with mend-ls and the editor for many edits), the
//! commit guard's refusals carried per request in every interface's result, and `plan`
//! with one GPU and the CPU (host memory is a capacity). The Python package's side is in
//! `python/tests/test_dualedit.py`.
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::Child;
use std::time::Duration;

use serde_json::Value;

use crate::common;

/// The first `n` records of the many-edits fixture, written to a file in `dir`.
fn requests(dir: &Path, n: usize) -> (PathBuf, Value) {
    let all = common::json_file(&common::fixture("many/fresh-100.json"));
    let some = Value::Array(all.as_array().unwrap()[..n].to_vec());
    let path = dir.join(format!("first-{n}.json"));
    std::fs::write(&path, some.to_string()).unwrap();
    (path, some)
}

/// `dualedit edit` on the shipped model and editor, no `--method`: (exit ok, stdout JSON
/// or null, the report).
fn cli_edit(dir: &Path, requests: &Path, extra: &[&str]) -> (bool, Value, Value) {
    let report = dir.join("report.json");
    let _ = std::fs::remove_file(&report);
    let editor = common::shipped("editor");
    let out = common::edit_json(&common::shipped("model"), requests, &report, &[&["--editor", editor.to_str().unwrap()][..], extra].concat());
    let stdout = serde_json::from_slice(&out.stdout).unwrap_or(Value::Null);
    (out.status.success(), stdout, common::json_file(&report))
}

/// The guard that refuses any edit: every locality prompt must keep its answer and its
/// distribution (KL ≤ 1e-9), nothing scaled back.
const REFUSING: [&str; 5] = ["--guard-refuse", "--guard-min-agreement", "1", "--guard-max-kl", "1e-9"];

#[test]
fn the_cli_default_is_auto_and_a_refusal_is_named_per_request() {
    let dir = tempfile::tempdir().unwrap();
    let (one, _) = requests(dir.path(), 1);
    let (three, _) = requests(dir.path(), 3);
    for (file, extra, method) in [(&one, &[][..], "mend"), (&three, &[][..], "mend-ls"), (&one, &["--sequential"][..], "mend-ls"), (&three, &["--sequential"][..], "mend-ls")] {
        let (ok, v, _) = cli_edit(dir.path(), file, extra);
        assert!(ok, "{extra:?}");
        assert_eq!(v["method"], method, "{} {extra:?}: {v}", file.display());
        for r in v["requests"].as_array().unwrap() {
            assert_eq!(r["refused"], false, "{r}");
            assert!(r["refused_reason"].is_null(), "{r}");
        }
    }
    // Every edit refused: the run fails after writing its report, whose requests each say
    // so with the guard's reason.
    for extra in [&REFUSING[..], &[&REFUSING[..], &["--sequential"]].concat()[..]] {
        let (ok, _, report) = cli_edit(dir.path(), &three, extra);
        assert!(!ok, "{extra:?}: a run whose every edit was refused exits non-zero");
        let m = &report["metrics"];
        assert_eq!(m["refused"], 3, "{extra:?}: {m}");
        for r in m["requests"].as_array().unwrap() {
            assert_eq!(r["refused"], true, "{extra:?}: {r}");
            let why = r["refused_reason"].as_str().unwrap_or_else(|| panic!("{extra:?}: no reason in {r}"));
            assert!(why.contains("refused"), "{extra:?}: {why:?}");
        }
    }
}

/// `dualedit serve` on the shipped model and editor, no `--method`.
fn spawn_serve(args: &[&str]) -> (Child, SocketAddr) {
    let editor = common::shipped("editor");
    let (child, addr, mut err, log) = common::spawn_serve(&common::shipped("model"), &[&["--editor", editor.to_str().unwrap()][..], args].concat(), &[]);
    assert!(!log.contains("several edits with plain mend"), "{log}");
    // Keep draining the log so the server never blocks on a full pipe.
    std::thread::spawn(move || {
        let mut sink = String::new();
        let _ = err.read_to_string(&mut sink);
    });
    (child, addr)
}

fn post(addr: SocketAddr, path: &str, body: &str) -> (u16, Value) {
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(10)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(120))).unwrap();
    write!(s, "POST {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}", body.len()).unwrap();
    let mut raw = String::new();
    s.read_to_string(&mut raw).unwrap();
    let (head, rest) = raw.split_once("\r\n\r\n").unwrap();
    let status = head.split_whitespace().nth(1).unwrap().parse().unwrap();
    (status, serde_json::from_str(rest).unwrap_or_else(|e| panic!("{e}: {rest:?}")))
}

#[test]
fn serve_edits_with_the_cli_default_and_names_a_refusal_per_request() {
    let dir = tempfile::tempdir().unwrap();
    let (_, one) = requests(dir.path(), 1);
    let (_, three) = requests(dir.path(), 3);
    let (mut child, addr) = spawn_serve(&[]);
    let edit = |records: &Value, extra: &str| post(addr, "/edit", &format!("{{\"requests\": {records}{extra}}}"));
    // As the CLI: one request on a fresh session with mend, several with mend-ls.
    let (st, v) = edit(&one, "");
    assert_eq!((st, v["method"].as_str()), (200, Some("mend")), "{v}");
    assert_eq!(v["requests"][0]["refused"], false, "{v}");
    assert_eq!(post(addr, "/reset", "").0, 200);
    let (st, v) = edit(&three, "");
    assert_eq!((st, v["method"].as_str()), (200, Some("mend-ls")), "{v}");
    assert_eq!(post(addr, "/reset", "").0, 200);
    // A refused batch: each request carries the flag and the guard's reason.
    let (st, v) = edit(&three, r#", "guard": {"min_agreement": 1.0, "max_kl": 1e-9, "refuse": true}"#);
    assert_eq!(st, 200, "{v}");
    assert_eq!(v["refused"], 3, "{v}");
    for r in v["requests"].as_array().unwrap() {
        assert_eq!(r["refused"], true, "{r}");
        assert!(r["refused_reason"].as_str().is_some_and(|w| w.contains("refused")), "{r}");
    }
    child.kill().unwrap();
    let _ = child.wait();

    // `--method mend` is still there, as `edit`'s flag: several requests with plain mend.
    let (mut child, addr) = spawn_serve(&["--method", "mend"]);
    let (st, v) = post(addr, "/edit", &format!("{{\"requests\": {three}}}"));
    assert_eq!((st, v["method"].as_str()), (200, Some("mend")), "{v}");
    child.kill().unwrap();
    let _ = child.wait();
}

/// Three records whose locality prompts each name a subject the same call edits, the
/// third contradicting the first (same prompt, another target).
fn conflicting(dir: &Path) -> (PathBuf, Value) {
    let all = common::json_file(&common::fixture("many/fresh-100.json"));
    let (a, b) = (all[0].clone(), all[1].clone());
    let probe = |r: &mut Value, of: &Value| {
        r["locality_prompt"] = of["prompt"].clone();
        r["locality_ground_truth"] = of["ground_truth"].clone();
    };
    let (mut r0, mut r1, mut r2) = (a.clone(), b.clone(), a.clone());
    probe(&mut r0, &b);
    probe(&mut r1, &a);
    probe(&mut r2, &b);
    r2["target_new"] = b["target_new"].clone();
    assert_ne!(a["target_new"], b["target_new"]);
    let v = Value::Array(vec![r0, r1, r2]);
    let path = dir.join("conflicting.json");
    std::fs::write(&path, v.to_string()).unwrap();
    (path, v)
}

/// #47 item 4: a locality prompt naming a subject edited in the same call is a conflict,
/// reported and kept out of the guard's verdict (a guard that refuses any change to its
/// probes refuses three independent edits, and has nothing to refuse here), as is a
/// contradictory pair. #49 item 8: the CLI, `serve` and (in the Python tests) Python
/// answer with one result type: the same keys, each adding only what it alone knows.
#[test]
fn conflicts_stay_out_of_the_guard_and_every_interface_has_one_result_shape() {
    let dir = tempfile::tempdir().unwrap();
    let (file, records) = conflicting(dir.path());
    let a = records[0]["subject"].as_str().unwrap();
    let b = records[1]["subject"].as_str().unwrap();
    let expected = serde_json::json!([
        {"kind": "locality_of_edited_subject", "request": 0, "edited_by": 1, "subject": b},
        {"kind": "contradiction", "first": 0, "second": 2, "prompt": records[0]["prompt"].as_str().unwrap().trim()},
        {"kind": "locality_of_edited_subject", "request": 1, "edited_by": 0, "subject": a},
        {"kind": "locality_of_edited_subject", "request": 2, "edited_by": 1, "subject": b},
    ]);
    let (ok, cli, _) = cli_edit(dir.path(), &file, &REFUSING);
    assert!(ok, "every probe names an edited subject: the guard has nothing to refuse");
    assert_eq!((cli["refused"].as_u64(), cli["guard"].as_array().map(Vec::len)), (Some(0), Some(0)), "{cli}");
    assert_eq!(cli["conflicts"], expected);
    assert!(cli["seconds_per_edit"].as_f64().is_some() && cli["edit_seconds"].is_null(), "{cli}");

    let (mut child, addr) = spawn_serve(&[]);
    let (st, http) = post(addr, "/edit", &format!(r#"{{"requests": {records}, "guard": {{"min_agreement": 1.0, "max_kl": 1e-9, "refuse": true}}}}"#));
    child.kill().unwrap();
    let _ = child.wait();
    assert_eq!((st, &http["conflicts"]), (200, &expected), "{http}");
    let keys = |v: &Value, own: &[&str]| {
        let mut k: Vec<String> = v.as_object().unwrap().keys().filter(|k| !own.contains(&k.as_str())).cloned().collect();
        k.sort();
        k
    };
    assert_eq!(keys(&cli, &["saved", "report", "data"]), keys(&http, &["guard_settings"]));
    assert_eq!(keys(&cli["requests"][0], &[]), keys(&http["requests"][0], &[]));
    for k in ["method", "sequential", "n", "reliability", "requests", "edits_total", "guard", "refused", "conflicts"] {
        assert!(http.get(k).is_some(), "{k} missing from {http}");
    }
}

const GIB: f64 = (1u64 << 30) as f64;
/// The H200 side-by-side with EasyEdit (#51, `docs/gpu/gpu-versus-h200-2026-11-27-b.json`):
/// the Qwen2-VL-7B-shaped bf16 step at 448 × 448, the main device's CUDA allocator peak on
/// one GPU, on one GPU with Adam in host memory, and split over `cuda:0 + cpu` under
/// `--max-memory cuda:0=10GiB` with the optimiser on the CPU.
const MEASURED_SINGLE_BYTES: f64 = 23_811_520_512.0;
const MEASURED_OPT_CPU_BYTES: f64 = 21_019_229_184.0;
const MEASURED_CAPPED_MAIN_BYTES: f64 = 6_527_287_808.0;

/// `plan` of the Qwen2-VL-7B config as that run ran it, with `extra`.
fn plan_7b(extra: &[&str]) -> (bool, Value, String) {
    let out = common::dualedit_cmd()
        .current_dir(common::root())
        .args(["plan", "--model", "tests/fixtures/qwen2_vl_7b_instruct", "--config", "configs/qwen2vl-7b.json", "--image-size", "448x448"])
        .args(["--dtype", "bf16", "--max-length", "64", "--ds", "vqa", "--json"])
        .args(extra)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr).to_string();
    let v = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("{e}: {}\n{stderr}", String::from_utf8_lossy(&out.stdout)));
    (out.status.success(), v, stderr)
}

/// The planner's tolerance against the H200 measurements: it plans 4 % to 6 % over them.
fn assert_planned_near(planned: f64, measured: f64, what: &str) {
    let ratio = planned / measured;
    assert!((0.95..=1.20).contains(&ratio), "{what}: planned {:.2} GiB = {ratio:.3} x the measured {:.2} GB", planned / GIB, measured / 1e9);
}

fn peak_of(v: &Value, device: &str) -> f64 {
    v["devices"].as_array().unwrap().iter().find(|d| d["device"] == device).unwrap_or_else(|| panic!("no {device} in {v}"))["peak_bytes"].as_f64().unwrap()
}

#[test]
fn plan_with_one_gpu_and_the_cpu_balances_shares_and_fits() {
    let one = |extra: &[&str]| {
        let (ok, v, err) = plan_7b(&[&["--device", "cuda:0"], extra].concat());
        assert!(ok, "{err}");
        let train = v["totals"].as_array().unwrap().iter().find(|t| t["phase"] == "train" && t["device"] == "cuda:0");
        train.unwrap_or_else(|| panic!("no training total on cuda:0: {v}"))["peak_bytes"].as_f64().unwrap()
    };
    assert_planned_near(one(&[]), MEASURED_SINGLE_BYTES, "one GPU");
    assert_planned_near(one(&["--optimizer-device", "cpu"]), MEASURED_OPT_CPU_BYTES, "one GPU, Adam on the CPU");
    // The host's memory is the CPU's capacity: given here, so the answer does not depend
    // on this machine; then as the issue ran it (this machine's memory).
    for caps in ["cuda:0=10GiB,cpu=128GiB", "cuda:0=10GiB"] {
        let (ok, v, err) = plan_7b(&["--device", "cuda:0", "--sub-device", "cpu", "--placement", "balanced", "--optimizer-device", "sub", "--max-memory", caps]);
        assert!(ok && v["fits"] == true, "{caps}: {v}\n{err}");
        let placement = &v["placements"][0];
        assert_planned_near(peak_of(placement, "cuda:0"), MEASURED_CAPPED_MAIN_BYTES, caps);
        // The CPU is judged against its capacity too.
        let cpu = placement["devices"].as_array().unwrap().iter().find(|d| d["device"] == "cpu").unwrap();
        assert!(cpu["cap_bytes"].as_u64().is_some(), "{caps}: {cpu}");
    }
    // Host memory too small for the CPU's part: nothing fits, naming the CPU.
    let (ok, _, err) = plan_7b(&["--device", "cuda:0", "--sub-device", "cpu", "--placement", "balanced", "--max-memory", "cuda:0=24GiB,cpu=1GiB"]);
    assert!(!ok && err.contains("cpu needs"), "{err}");
}

#[test]
fn plan_fit_with_the_cpu_answers_for_one_gpu_and_host_memory() {
    let (ok, v, err) = plan_7b(&["--sub-device", "cpu", "--fit", "8GiB,16GiB,24GiB,40GiB", "--max-memory", "cpu=128GiB"]);
    assert!(ok, "{err}");
    let f = &v["fit"];
    assert!(f.get("two_cards").is_none(), "--sub-device cpu plans no second card: {f}");
    assert_eq!(v["planned"]["sub"], "cpu", "{v}");
    let host = &f["card_and_host"];
    assert_eq!(host["devices"], serde_json::json!(["cuda:0", "cpu"]), "{host}");
    assert_eq!(host["host_bytes"].as_f64(), Some(128.0 * GIB), "{host}");
    // 128 GiB of host memory takes every block below the edited ones and Adam: main keeps
    // its floor (the embedding, vision tower, image features, editor), on one 8 GiB card.
    assert_eq!(host["card_bytes"].as_f64(), Some(8.0 * GIB), "one 8 GiB card with the CPU: {host}");
    assert_planned_near(peak_of(&host["placement"], "cuda:0"), MEASURED_CAPPED_MAIN_BYTES, "card and host");
    // One card alone needs more than 24 GiB (the measured single run: 23.81 GB + headroom).
    assert!(f["one_card"]["card_bytes"].as_f64().is_none_or(|b| b > 24.0 * GIB), "{f}");
    // As the issue asked it (this machine's memory for the CPU): one card and the host.
    let (ok, v, err) = plan_7b(&["--fit", "24GiB", "--sub-device", "cpu"]);
    assert!(ok, "{err}");
    assert!(v["fit"].get("two_cards").is_none(), "{v}");
    assert_eq!(v["fit"]["card_and_host"]["devices"], serde_json::json!(["cuda:0", "cpu"]), "{v}");
    assert!(v["fit"]["card_and_host"]["host_bytes"].is_u64(), "{v}");
    // Without the CPU, two cards as before.
    let (ok, v, err) = plan_7b(&["--fit", "16GiB,24GiB,40GiB"]);
    assert!(ok, "{err}");
    assert!(v["fit"]["two_cards"]["card_bytes"].is_number() && v["fit"].get("card_and_host").is_none(), "{v}");
}

/// Item 2: a checkpoint whose config.json says bf16 is planned and run in bf16 unless
/// `--dtype` says otherwise (the run logs where its dtype came from at info level, the
/// plan prints it).
#[test]
fn plan_and_train_take_the_checkpoints_dtype_alike() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("llama-bf16");
    std::fs::create_dir(&model).unwrap();
    for e in std::fs::read_dir(common::fixture("llama")).unwrap() {
        let p = e.unwrap().path();
        std::fs::copy(&p, model.join(p.file_name().unwrap())).unwrap();
    }
    let mut cfg = common::json_file(&model.join("config.json"));
    cfg["dtype"] = "bfloat16".into();
    std::fs::write(model.join("config.json"), cfg.to_string()).unwrap();
    let config = dir.path().join("c.json");
    std::fs::write(&config, r#"{"rank": 8, "accumulate": 1, "max_steps": 1, "val_every": 1, "val_records": 1, "max_length": 32}"#).unwrap();
    let (m, c) = (model.to_str().unwrap(), config.to_str().unwrap());

    let plan = common::dualedit(&["plan", "--model", m, "--config", c, "--json"]);
    assert!(plan.status.success(), "{}", String::from_utf8_lossy(&plan.stderr));
    let v: Value = serde_json::from_slice(&plan.stdout).unwrap();
    assert_eq!(v["shape"]["dtype"], "bf16", "{}", v["shape"]);

    let data = common::root().join("data/world/edits-train.json");
    let train = |extra: &[&str], name: &str| -> Value {
        let (out, report) = (dir.path().join(name), dir.path().join(format!("{name}.json")));
        let o = common::dualedit(&[
            &["train", "--model", m, "--config", c, "--data", data.to_str().unwrap(), "--ds", "counterfact", "--limit", "6", "--truncate"][..],
            &["--out", out.to_str().unwrap(), "--report", report.to_str().unwrap()],
            extra,
        ]
        .concat());
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        common::json_file(&report)
    };
    assert_eq!(train(&[], "auto")["dtype"], "bf16");
    assert_eq!(train(&["--dtype", "f32"], "flag")["dtype"], "f32");
    // The plan's text says where its dtype came from.
    let plan = common::dualedit(&["plan", "--model", m, "--config", c]);
    let text = String::from_utf8_lossy(&plan.stdout);
    assert!(text.contains("in bf16 (the checkpoint's config.json dtype)"), "{text}");
}

/// Item 9: `train` says which records it validates on and carries the validation in its
/// progress line; a misspelt `edit_params` name gets the nearest real one.
#[test]
fn train_names_its_validation_split_and_a_typo_gets_a_suggestion() {
    let dir = tempfile::tempdir().unwrap();
    let model = common::fixture("llama");
    let data = common::root().join("data/world/edits-train.json");
    let run = |cfg: &str, name: &str| {
        let c = dir.path().join(format!("{name}.json"));
        std::fs::write(&c, cfg).unwrap();
        common::dualedit(&[
            "train", "--model", model.to_str().unwrap(), "--config", c.to_str().unwrap(), "--data", data.to_str().unwrap(), "--ds", "counterfact",
            "--limit", "10", "--truncate", "--out", dir.path().join(name).to_str().unwrap(),
        ])
    };
    let o = run(r#"{"rank": 8, "accumulate": 1, "max_steps": 2, "val_every": 1, "val_records": 4, "max_length": 32}"#, "ok");
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{err}");
    assert!(err.contains("meta-training on 8 records; validating on the last 2 of 10 (min(val_records = 4, records / 5))"), "{err}");
    let o = run(r#"{"rank": 8, "max_steps": 1, "edit_params": ["model.layers.2.mlp.upproj.weight"]}"#, "typo");
    common::assert_clean_error(&o, &["model.layers.2.mlp.upproj.weight", "did you mean \"model.layers.2.mlp.up_proj.weight\"?"]);
}
