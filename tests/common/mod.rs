//! Shared by the test binaries (`tests/fast`, `tests/slow`): the checkout's paths, the
//! built binary, a few edit requests, an editor meta-trained in-process on the tiny GPT-2
//! fixture (seconds on a CPU), and running one test alone in its own process.
#![allow(dead_code)]
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use dualedit::config::MendConfig;
use dualedit::data::easyedit::{parse_records, DatasetKind, EditRecord};
use dualedit::data::examples::prepare;
use dualedit::device::DevicePlan;
use dualedit::mend::optim::Adam;
use dualedit::mend::{checkpoint, Editor, Engine};
use dualedit::model::load_model;
use dualedit::edit::session::Session;
use dualedit::mend::train::{meta_loss, EditBatches, StepLosses};
use tch::{Device, Kind};

/// One intra-op thread: the fixtures are tiny, and several tests (and the server's model
/// thread) running libtorch ops at once on a few cores otherwise oversubscribe them badly.
pub fn init() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| tch::set_num_threads(1));
}

pub fn fixture(name: &str) -> PathBuf {
    root().join("tests/fixtures").join(name)
}

/// The checkout's root (`CARGO_MANIFEST_DIR`): configs, scripts, `data/`, `docs/`.
pub fn root() -> PathBuf {
    init();
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// The embedded default (tiny model, its editor, its world's edit records), or one part of
/// it (`shipped("model")`); `shipped("")` is the folder itself.
pub fn shipped(part: &str) -> PathBuf {
    init();
    let root = dualedit::bootstrap::demo::shipped_root();
    if part.is_empty() {
        root
    } else {
        root.join(part)
    }
}

/// The built `dualedit` binary as a command, for a test to add arguments and environment.
pub fn dualedit_cmd() -> Command {
    Command::new(env!("CARGO_BIN_EXE_dualedit"))
}

/// `dualedit ARGS`, run to the end.
pub fn dualedit(args: &[&str]) -> Output {
    dualedit_cmd().args(args).output().unwrap()
}

/// A JSON file a command wrote (panics naming the file when it is missing or bad).
pub fn json_file(p: &Path) -> serde_json::Value {
    let text = std::fs::read_to_string(p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

/// A test's name as the harness lists it (`vl::score_image_json`): `module_path` is the
/// caller's `module_path!()`, whose first segment (the test binary's crate) the harness
/// leaves out.
pub fn test_name(module_path: &str, test: &str) -> String {
    match module_path.split_once("::") {
        Some((_, module)) => format!("{module}::{test}"),
        None => test.to_string(),
    }
}

/// Environment variable set in the child process of [`alone`].
const ALONE_ENV: &str = "DUALEDIT_TEST_ALONE";

/// For a test that measures the whole process (its resident set): other tests of the same
/// binary run in parallel threads and would disturb it. Called first in such a test: in
/// the test binary's own run it re-runs this one test in a fresh child process of the same
/// binary, checks that it passed and returns `false` (the caller returns); in that child
/// it returns `true` (the caller goes on with its body).
pub fn alone(module_path: &str, test: &str) -> bool {
    let name = test_name(module_path, test);
    if std::env::var(ALONE_ENV).is_ok_and(|v| v == name) {
        return true;
    }
    let exe = std::env::current_exe().unwrap();
    let out = Command::new(exe).args([name.as_str(), "--exact", "--nocapture", "--test-threads=1"]).env(ALONE_ENV, &name).output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    eprintln!("{stderr}");
    assert!(out.status.success(), "{name} failed in its own process:\n{stdout}\n{stderr}");
    assert!(stdout.contains("1 passed"), "{name} did not run in its own process:\n{stdout}");
    false
}

pub const RECORDS: &str = r#"[
  {"prompt": "The capital of France is", "target_new": "Rome", "rephrase_prompt": "France has its capital in",
   "locality_prompt": "The Eiffel Tower is located in", "locality_ground_truth": "Paris"},
  {"prompt": "The capital of Italy is", "target_new": "Paris", "rephrase_prompt": "Italy's capital city is",
   "locality_prompt": "The city of Rome is in", "locality_ground_truth": "Italy"},
  {"prompt": "The Eiffel Tower is in", "target_new": "London", "rephrase_prompt": "The tower of Eiffel is in",
   "locality_prompt": "The capital of France is", "locality_ground_truth": "Paris"}
]"#;

/// Five CounterFact-style records, enough for a training run with a validation split.
pub const TRAIN_RECORDS: &str = r#"[
  {"prompt": "The capital of France is", "target_new": "Rome", "ground_truth": "Paris", "rephrase_prompt": "France has its capital in",
   "locality_prompt": "The Eiffel Tower is located in", "locality_ground_truth": "Paris"},
  {"prompt": "The capital of Italy is", "target_new": "Paris", "ground_truth": "Rome", "rephrase_prompt": "Italy's capital city is",
   "locality_prompt": "The city of Rome is in", "locality_ground_truth": "Italy"},
  {"prompt": "The Eiffel Tower is in", "target_new": "London", "ground_truth": "Paris", "rephrase_prompt": "The tower of Eiffel is in",
   "locality_prompt": "The capital of France is", "locality_ground_truth": "Paris"},
  {"prompt": "Rome is the capital of", "target_new": "France", "ground_truth": "Italy", "rephrase_prompt": "Rome is the capital city of",
   "locality_prompt": "Paris is the capital of", "locality_ground_truth": "France"},
  {"prompt": "Paris is a city in", "target_new": "Spain", "ground_truth": "France", "rephrase_prompt": "The city of Paris lies in",
   "locality_prompt": "Rome is a city in", "locality_ground_truth": "Italy"}
]"#;

/// A meta-training step's loss parts by name (what two ways of computing one step compare).
pub fn loss_parts(p: &StepLosses) -> [(&'static str, f64); 5] {
    [("loss", p.loss), ("edit_nll", p.edit_nll), ("loc_kl", p.loc_kl), ("edit_acc", p.edit_acc), ("loc_acc", p.loc_acc)]
}

pub fn records() -> Vec<EditRecord> {
    parse_records(RECORDS, Path::new("inline.json"), DatasetKind::Requests).unwrap().0
}

pub const TRAIN_STEPS: usize = 60;

/// An engine on the GPT-2 fixture and an editor meta-trained on [`RECORDS`].
pub fn trained_editor() -> (Engine, Editor) {
    let lm = load_model(&fixture("gpt2"), Device::Cpu, Kind::Float).unwrap();
    let engine = Engine::new(lm, DevicePlan::single(Device::Cpu), &[]).unwrap();
    let ex = prepare(&engine.lm.tokenizer, &records(), 64, Path::new("inline.json")).unwrap();
    let cfg = MendConfig { rank: 32, lr: 1e-3, edit_lr: 1e-2, lr_lr: 1e-2, ..MendConfig::default() };
    let mut editor = Editor::new(&cfg, engine.edit_params.clone(), Device::Cpu, 0).unwrap();
    let (net, lrs) = editor.trainables();
    let mut adam = Adam::new(vec![(cfg.lr, net), (cfg.lr_lr, lrs)]);
    let pad = engine.lm.tokenizer.pad_id();
    for step in 0..TRAIN_STEPS {
        let b = EditBatches::new(&[&ex[step % ex.len()]], pad, Device::Cpu);
        let (loss, _) = meta_loss(&engine, &mut editor, &b, true).unwrap();
        loss.backward();
        adam.step();
        adam.zero_grad();
    }
    (engine, editor)
}

/// A session with the trained editor, and the editor saved in a temporary directory
/// (for `Session::open` and the `serve` binary).
pub fn trained_editor_session() -> (Session, tempfile::TempDir) {
    let (engine, editor) = trained_editor();
    let dir = tempfile::tempdir().unwrap();
    checkpoint::save_editor(dir.path(), &editor, &engine, TRAIN_STEPS).unwrap();
    (Session::from_parts(engine, Some(editor)), dir)
}

/// Two editors with the same initial weights: the same seed, which `Editor::new` draws
/// under `rng::torch_seeded`'s lock, so tests running in parallel threads cannot change it.
pub fn twin_editors(cfg: &MendConfig, params: &[dualedit::placed::EditedParam]) -> (Editor, Editor) {
    let new = || Editor::new(cfg, params.to_vec(), Device::Cpu, 0).unwrap();
    (new(), new())
}

/// Environment variable that turns a missing shared-data folder from a skip into a failure,
/// so CI (which has the data) cannot pass by silently skipping the real-data tests.
pub const REQUIRE_SHARED_ENV: &str = "DUALEDIT_REQUIRE_SHARED";

/// Locate the read-only shared datasets (`../shared/data` next to the crate) for tests and
/// benchmarks that use real files.
///
/// The data is kept outside the repository, so it may be absent on a fresh checkout:
/// returns `Some(dir)` if the folder exists; otherwise prints
/// `SKIP: ../shared/data not found (...)` to stderr and returns `None` so the caller can
/// return early — unless `DUALEDIT_REQUIRE_SHARED=1`, in which case it panics.
pub fn shared_data_dir() -> Option<PathBuf> {
    let dir = root()
        .join("..")
        .join("shared")
        .join("data");
    if dir.is_dir() {
        return Some(dir.canonicalize().unwrap_or(dir));
    }
    if std::env::var(REQUIRE_SHARED_ENV).is_ok_and(|v| v.trim() == "1") {
        panic!(
            "../shared/data not found (looked in {}) and {REQUIRE_SHARED_ENV}=1 requires it",
            dir.display()
        );
    }
    eprintln!(
        "SKIP: ../shared/data not found (looked in {}); set {REQUIRE_SHARED_ENV}=1 to make this a failure",
        dir.display()
    );
    None
}

/// Copies a fixture directory into a temp dir so a test can break it.
pub fn broken_copy(name: &str) -> tempfile::TempDir {
    let tmp = tempfile::tempdir().unwrap();
    for entry in std::fs::read_dir(fixture(name)).unwrap() {
        let p = entry.unwrap().path();
        std::fs::copy(&p, tmp.path().join(p.file_name().unwrap())).unwrap();
    }
    tmp
}

/// The run failed with exactly one line on stderr, no panic, mentioning every needle.
pub fn assert_clean_error(out: &std::process::Output, needles: &[&str]) {
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "expected failure, got success; stderr: {err}");
    assert!(!err.contains("panicked") && !err.contains("RUST_BACKTRACE"), "panic instead of an error: {err}");
    assert_eq!(err.trim().lines().count(), 1, "expected one line, got: {err}");
    for n in needles {
        assert!(err.contains(n), "error {err:?} should mention {n:?}");
    }
}

/// `dualedit edit --model M --requests R --report P --json` with `extra` flags: its output.
pub fn edit_json(model: &Path, requests: &Path, report: &Path, extra: &[&str]) -> Output {
    dualedit_cmd()
        .args(["edit", "--model"])
        .arg(model)
        .arg("--requests")
        .arg(requests)
        .arg("--report")
        .arg(report)
        .arg("--json")
        .args(extra)
        .output()
        .unwrap()
}

/// `dualedit serve --model M --listen 127.0.0.1:0` with `args` and `env`, read until it
/// prints its address: the child, the address, its stderr (keep draining it, or the server
/// blocks on a full pipe) and the log lines before the address.
pub fn spawn_serve(model: &Path, args: &[&str], env: &[(&str, &str)]) -> (std::process::Child, std::net::SocketAddr, std::io::BufReader<std::process::ChildStderr>, String) {
    use std::io::BufRead;
    let mut child = dualedit_cmd()
        .args(["serve", "--model"])
        .arg(model)
        .args(["--listen", "127.0.0.1:0"])
        .args(args)
        .envs(env.iter().copied())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut err = std::io::BufReader::new(child.stderr.take().unwrap());
    let (mut line, mut log) = (String::new(), String::new());
    let addr = loop {
        line.clear();
        assert!(err.read_line(&mut line).unwrap() > 0, "serve exited before listening:\n{log}");
        log.push_str(&line);
        if let Some(rest) = line.split("http://").nth(1) {
            break rest.split_whitespace().next().unwrap().parse().unwrap();
        }
    };
    (child, addr, err, log)
}
