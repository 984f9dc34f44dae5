//! The HTTP service over real HTTP on 127.0.0.1 (ephemeral ports): the edit / generate /
//! reset / save flow, a burst of 200 concurrent mixed requests, a catalogue of bad
//! requests, the guard, and SIGINT/SIGTERM on the `dualedit serve` binary. Images:
//! `serve_images.rs`.
use crate::common;

use std::io::{BufReader, Read, Write};
use std::path::Path;
use std::net::{SocketAddr, TcpStream};
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Barrier};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use common::{fixture, records, trained_editor_session};
use dualedit::data::Example;
use dualedit::model::Tokenizer;
use dualedit::serve::{ServeOptions, ServeStats, Server};
use dualedit::edit::session::{Session, SessionOptions};
use serde_json::{json, Value};

/// The tests of this file run one at a time, as they did when the burst test (now in its
/// own process) shared their process: each runs a server, its model thread and its
/// clients, and several bound their time.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

pub(crate) fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

/// A server running on its own thread until `stop`.
pub(crate) struct Running {
    pub(crate) addr: SocketAddr,
    flag: Arc<AtomicBool>,
    thread: JoinHandle<ServeStats>,
}

impl Running {
    pub(crate) fn start(session: Session, opts: ServeOptions) -> Self {
        let server = Server::bind("127.0.0.1:0", opts).unwrap();
        let addr = server.local_addr();
        assert!(addr.ip().is_loopback() && addr.port() != 0);
        let flag = Arc::new(AtomicBool::new(false));
        let f = flag.clone();
        let thread = std::thread::spawn(move || server.run(session, &f).unwrap());
        Self { addr, flag, thread }
    }

    pub(crate) fn stop(self) -> ServeStats {
        self.flag.store(true, Ordering::SeqCst);
        self.thread.join().unwrap()
    }
}

/// One HTTP/1.1 request on a fresh connection: `(status, JSON body)`.
pub(crate) fn http(addr: SocketAddr, method: &str, path: &str, body: Option<&str>) -> (u16, Value) {
    let (st, v, _) = try_http(addr, method, path, body).unwrap_or_else(|e| panic!("{method} {path}: {e}"));
    (st, v)
}

/// `(status, body text)`: for exact comparisons of numbers. serde_json writes an f64 in
/// its shortest round-trip form, so equal bits give equal text, while its default parser
/// may be one ulp off.
pub(crate) fn http_text(addr: SocketAddr, method: &str, path: &str, body: Option<&str>) -> (u16, String) {
    let (st, _, text) = try_http(addr, method, path, body).unwrap_or_else(|e| panic!("{method} {path}: {e}"));
    (st, text)
}

/// What the server writes for `v` (its bodies are serialised through `serde_json::Value`).
fn as_body<T: serde::Serialize>(v: &T) -> String {
    serde_json::to_value(v).unwrap().to_string()
}

fn try_http(addr: SocketAddr, method: &str, path: &str, body: Option<&str>) -> std::io::Result<(u16, Value, String)> {
    try_http_with(addr, method, path, body, None).map(|(st, v, text, _)| (st, v, text))
}

/// [`try_http`] with an optional `Authorization` header value; also returns the response head.
fn try_http_with(addr: SocketAddr, method: &str, path: &str, body: Option<&str>, auth: Option<&str>) -> std::io::Result<(u16, Value, String, String)> {
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(10))?;
    s.set_read_timeout(Some(Duration::from_secs(30)))?;
    s.set_write_timeout(Some(Duration::from_secs(30)))?;
    let body = body.unwrap_or("");
    let auth = auth.map(|a| format!("Authorization: {a}\r\n")).unwrap_or_default();
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\n{auth}Content-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )?;
    let mut raw = Vec::new();
    s.read_to_end(&mut raw)?;
    let text = String::from_utf8_lossy(&raw);
    let (head, rest) = text
        .split_once("\r\n\r\n")
        .ok_or_else(|| std::io::Error::other(format!("no header end in {text:?}")))?;
    let status: u16 = head
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .ok_or_else(|| std::io::Error::other(format!("bad status line in {head:?}")))?;
    let chunked = head.to_ascii_lowercase().contains("transfer-encoding: chunked");
    let payload = if chunked { dechunk(rest) } else { rest.to_string() };
    let value = serde_json::from_str(&payload).map_err(|e| std::io::Error::other(format!("{e}: {payload:?}")))?;
    Ok((status, value, payload, head.to_string()))
}

fn dechunk(mut s: &str) -> String {
    let mut out = String::new();
    while let Some((len, rest)) = s.split_once("\r\n") {
        let n = usize::from_str_radix(len.trim(), 16).unwrap_or(0);
        if n == 0 {
            break;
        }
        out.push_str(&rest[..n]);
        s = &rest[n + 2..];
    }
    out
}

fn tokenizer() -> Tokenizer {
    Tokenizer::from_file(&fixture("gpt2").join("tokenizer.json")).unwrap()
}

fn ids(v: &Value) -> Vec<i64> {
    v.as_array().unwrap().iter().map(|t| t.as_i64().unwrap()).collect()
}

#[test]
fn edit_generate_save_reset_over_http() {
    let _serial = serial();
    let (session, _editor) = trained_editor_session();
    let dir = tempfile::tempdir().unwrap();
    let server = Running::start(session, ServeOptions { save_root: Some(dir.path().to_path_buf()), ..ServeOptions::default() });
    let a = server.addr;
    let (st, health) = http(a, "GET", "/health", None);
    assert_eq!(st, 200);
    assert_eq!(health["status"], "ok");
    assert_eq!(health["architecture"], "GPT2LMHeadModel");
    assert_eq!(health["edits_total"], 0);

    let rec = &records()[0];
    let text = json!({ "text": "The capital of France is Rome" }).to_string();
    let (st, before) = http_text(a, "POST", "/score", Some(&text));
    assert_eq!(st, 200, "{before}");
    let parsed: Value = serde_json::from_str(&before).unwrap();
    assert_eq!(parsed["logprobs"].as_array().unwrap().len() + 1, parsed["tokens"].as_array().unwrap().len());

    let edit = json!({ "requests": [{ "prompt": rec.prompt, "target_new": rec.target_new, "rephrase_prompt": rec.rephrase }] });
    let (st, out) = http(a, "POST", "/edit", Some(&edit.to_string()));
    assert_eq!(st, 200, "{out}");
    assert_eq!(out["requests"][0]["edit_success"], true, "{out}");
    assert_eq!(out["requests"][0]["answer_after"].as_str().unwrap().trim(), rec.target_new);
    assert!(out["requests"][0]["answer_before"].as_str().is_some_and(|a| a.trim() != rec.target_new), "{out}");
    assert_eq!(out["edits_total"], 1);

    // Generation now starts with the new target's tokens.
    let want = Example::new(&tokenizer(), &rec.prompt, &rec.target_new).unwrap().answer().to_vec();
    let gen = json!({ "prompt": rec.prompt, "max_new_tokens": want.len() }).to_string();
    let (st, g) = http(a, "POST", "/generate", Some(&gen));
    assert_eq!(st, 200, "{g}");
    assert_eq!(ids(&g["tokens"]), want, "{g}");
    assert_eq!(g["text"].as_str().unwrap().trim(), rec.target_new);
    let (_, edited) = http_text(a, "POST", "/score", Some(&text));
    assert_ne!(edited, before);

    let (st, saved) = http(a, "POST", "/save", Some(r#"{"dir": "edited"}"#));
    assert_eq!(st, 200, "{saved}");
    assert!(dir.path().join("edited/model.safetensors").is_file());

    let (st, reset) = http(a, "POST", "/reset", None);
    assert_eq!(st, 200, "{reset}");
    assert_eq!(reset["edits_total"], 0);
    assert_eq!(reset["restored_params"], 6);
    let (_, after) = http_text(a, "POST", "/score", Some(&text));
    // The same bits as before the edit (compared as text: see `http_text`).
    assert_eq!(after, before);

    let (st, mem) = http(a, "GET", "/memory", None);
    assert_eq!(st, 200);
    let dev = &mem["devices"][0];
    assert_eq!((dev["role"].as_str(), dev["device"].as_str()), (Some("main"), Some("cpu")));
    assert!(dev["current_allocated_bytes"].as_u64().unwrap() > 0 && dev["process_wide"] == true);
    let (_, health) = http(a, "GET", "/health", None);
    assert_eq!(health["edits_total"], 0);

    // The saved directory carries the edit.
    let reloaded = Session::open(&dir.path().join("edited"), None, &SessionOptions::default()).unwrap();
    assert_eq!(as_body(&reloaded.score("The capital of France is Rome").unwrap()), edited);

    let stats = server.stop();
    assert_eq!(stats.server_errors, 0, "{stats:?}");
    assert_eq!(stats.model_requests, 7, "{stats:?}");
}

fn rss() -> u64 {
    dualedit::device::memory::sample(tch::Device::Cpu).unwrap().current_allocated_bytes
}

/// What one request of the burst sends and what a correct answer is.
#[derive(Clone, Copy, Debug)]
enum Kind {
    Score,
    Generate,
    Health,
    Memory,
    NotFound,
    EditWithoutEditor,
}

const KINDS: [Kind; 6] = [Kind::Score, Kind::Generate, Kind::Health, Kind::Memory, Kind::NotFound, Kind::EditWithoutEditor];

/// Bodies of the correct answers (text: see `http_text`).
struct Expected {
    score: String,
    generate: String,
}

/// 200 requests at once (one thread each, released together); returns the status counts.
fn burst(a: SocketAddr, expected: &Arc<Expected>) -> std::collections::BTreeMap<u16, usize> {
    let n = 200;
    let barrier = Arc::new(Barrier::new(n));
    let threads: Vec<_> = (0..n)
        .map(|i| {
            let (barrier, expected) = (barrier.clone(), expected.clone());
            std::thread::spawn(move || {
                let kind = KINDS[i % KINDS.len()];
                barrier.wait();
                let (method, path, req) = match kind {
                    Kind::Score => ("POST", "/score", Some(r#"{"text": "The capital of France is Paris"}"#)),
                    Kind::Generate => ("POST", "/generate", Some(r#"{"prompt": "Once upon a time", "max_new_tokens": 8}"#)),
                    Kind::Health => ("GET", "/health", None),
                    Kind::Memory => ("GET", "/memory", None),
                    Kind::NotFound => ("GET", "/nope", None),
                    Kind::EditWithoutEditor => ("POST", "/edit", Some(r#"{"requests": [{"prompt": "a b", "target_new": "c"}]}"#)),
                };
                let (st, body, text) = try_http(a, method, path, req).unwrap_or_else(|e| panic!("{kind:?}: {e}"));
                let model = matches!(kind, Kind::Score | Kind::Generate | Kind::EditWithoutEditor);
                if st == 503 {
                    assert!(model, "{kind:?} answered 503");
                    assert_eq!(body["kind"], "queue_full", "{body}");
                    assert!(body["error"].as_str().unwrap().contains("queue full"), "{body}");
                    return st;
                }
                match kind {
                    Kind::Score => assert_eq!((st, &text), (200, &expected.score)),
                    Kind::Generate => assert_eq!((st, &text), (200, &expected.generate)),
                    Kind::Health => assert_eq!((st, body["status"].as_str()), (200, Some("ok"))),
                    Kind::Memory => assert!(st == 200 && body["devices"][0]["current_allocated_bytes"].as_u64().unwrap() > 0),
                    Kind::NotFound => assert_eq!((st, body["kind"].as_str()), (404, Some("not_found"))),
                    Kind::EditWithoutEditor => {
                        assert_eq!(st, 422, "{body}");
                        assert!(body["error"].as_str().unwrap().contains("no editor"), "{body}");
                    }
                }
                st
            })
        })
        .collect();
    let mut counts = std::collections::BTreeMap::new();
    for t in threads {
        *counts.entry(t.join().expect("a client thread failed its checks")).or_insert(0) += 1;
    }
    counts
}

/// Runs in its own process ([`common::alone`]): it reads the process's resident set, which
/// the other tests of this binary (loading models, training editors) would disturb.
#[test]
fn burst_of_200_concurrent_mixed_requests() {
    if !common::alone(module_path!(), "burst_of_200_concurrent_mixed_requests") {
        return;
    }
    let start = Instant::now();
    let session = Session::open(&fixture("gpt2"), None, &SessionOptions::default()).unwrap();
    let expected = Arc::new(Expected {
        score: as_body(&session.score("The capital of France is Paris").unwrap()),
        generate: as_body(&session.generate("Once upon a time", 8).unwrap()),
    });
    // A small queue so that the bound is actually reached.
    let opts = ServeOptions { queue: 4, ..ServeOptions::default() };
    let server = Running::start(session, opts);
    let warm = burst(server.addr, &expected);
    // Two measured bursts: a leak grows the resident set in each, while the allocator's
    // one-off growth (a new thread's arena, touched once) shows in one at most (a single
    // burst measured 0.2-17 MB over runs on a loaded 2-core machine).
    let rss_0 = rss();
    let first = burst(server.addr, &expected);
    let rss_1 = rss();
    let counts = burst(server.addr, &expected);
    let rss_2 = rss();
    let ok_model = counts.get(&200).copied().unwrap_or(0);
    eprintln!("warm-up {warm:?}; bursts {first:?}, {counts:?}; rss {rss_0} -> {rss_1} -> {rss_2}");
    assert_eq!(counts.values().sum::<usize>(), 200);
    assert!(ok_model > 0);
    // 200 clients at once against a queue of 4: the bound is reached, and answered 503.
    let full: usize = [&warm, &first, &counts].iter().map(|c| c.get(&503).copied().unwrap_or(0)).sum();
    assert!(counts.get(&503).copied().unwrap_or(0) > 0, "the queue bound was never reached");
    // Memory is flat: no per-request growth survives a burst.
    let grew = (rss_1 as i64 - rss_0 as i64).min(rss_2 as i64 - rss_1 as i64);
    assert!(grew < 16 << 20, "process RSS grew by {} MiB in each of two bursts of 200 requests", grew >> 20);
    // Still serving, with the same answers.
    assert_eq!(http_text(server.addr, "POST", "/score", Some(r#"{"text": "The capital of France is Paris"}"#)), (200, expected.score.clone()));
    let stats = server.stop();
    assert_eq!(stats.requests, 601);
    assert_eq!(stats.rejected_queue_full as usize, full, "{stats:?}");
    assert_eq!(stats.server_errors, stats.rejected_queue_full, "{stats:?}");
    assert!(start.elapsed() < Duration::from_secs(60), "took {:?}", start.elapsed());
}

#[test]
fn bad_requests_get_the_right_4xx_and_leave_the_session_intact() {
    let _serial = serial();
    let session = Session::open(&fixture("gpt2"), None, &SessionOptions::default()).unwrap();
    let reference = as_body(&session.score("The capital of France is Paris").unwrap());
    let root = tempfile::tempdir().unwrap();
    let opts = ServeOptions { max_body_bytes: 4096, save_root: Some(root.path().to_path_buf()), ..ServeOptions::default() };
    let server = Running::start(session, opts);
    let a = server.addr;
    let long = "word ".repeat(200);
    let valid_edit = r#"{"requests": [{"prompt": "The capital of France is", "target_new": "Rome"}]}"#;
    let cases: Vec<(&str, &str, Option<String>, u16, &str)> = vec![
        ("POST", "/score", Some("{not json".into()), 400, "malformed JSON"),
        ("POST", "/score", Some("".into()), 400, "malformed JSON"),
        ("POST", "/score", Some("[1, 2]".into()), 400, "must be a JSON object"),
        ("POST", "/score", Some("{}".into()), 400, "missing field `text`"),
        ("POST", "/score", Some(r#"{"txt": "a b"}"#.into()), 400, "unknown field `txt`"),
        ("POST", "/score", Some(r#"{"text": 5}"#.into()), 400, "field `text` must be a string"),
        ("POST", "/generate", Some(r#"{"max_new_tokens": 3}"#.into()), 400, "missing field `prompt`"),
        ("POST", "/generate", Some(r#"{"prompt": "a", "max_new_tokens": -1}"#.into()), 400, "field `max_new_tokens` must be a non-negative integer"),
        ("POST", "/edit", Some("{}".into()), 400, "missing field `requests`"),
        ("POST", "/edit", Some(r#"{"requests": {"prompt": "a"}}"#.into()), 400, "field `requests` must be an array"),
        ("POST", "/edit", Some(r#"{"requests": []}"#.into()), 400, "no records"),
        ("POST", "/edit", Some(r#"{"requests": [{"prompt": "a b"}]}"#.into()), 400, "target_new"),
        ("POST", "/edit", Some(r#"{"requests": [{"prompt": "", "target_new": "x"}]}"#.into()), 400, "record 0"),
        ("POST", "/save", Some("{}".into()), 400, "missing field `dir`"),
        ("POST", "/save", Some(r#"{"dir": " "}"#.into()), 400, "empty"),
        ("GET", "/nope", None, 404, "no route /nope"),
        ("POST", "/", Some("{}".into()), 404, "no route /"),
        ("GET", "/score", None, 405, "takes POST"),
        ("POST", "/health", Some("{}".into()), 405, "takes GET"),
        ("DELETE", "/edit", None, 405, "takes POST"),
        ("POST", "/score", Some(format!(r#"{{"text": "{}"}}"#, "x".repeat(5000))), 413, "larger than the limit"),
        ("POST", "/generate", Some(json!({ "prompt": long }).to_string()), 422, "longer than the model's context"),
        ("POST", "/score", Some(json!({ "text": long }).to_string()), 422, "longer than the model's context"),
        ("POST", "/edit", Some(json!({ "requests": [{ "prompt": long, "target_new": "x" }] }).to_string()), 422, "no editor"),
        ("POST", "/edit", Some(valid_edit.into()), 422, "no editor"),
        ("POST", "/score", Some(r#"{"text": "   "}"#.into()), 422, "empty"),
        ("POST", "/generate", Some(r#"{"prompt": ""}"#.into()), 422, "empty"),
    ];
    for (method, path, body, status, needle) in &cases {
        let (st, v) = http(a, method, path, body.as_deref());
        let err = v["error"].as_str().unwrap_or_else(|| panic!("{method} {path}: no error message in {v}"));
        assert_eq!(st, *status, "{method} {path} {body:?}: {v}");
        assert!(err.contains(needle), "{method} {path} {body:?}: {err:?} lacks {needle:?}");
        assert!(v["kind"].is_string(), "{v}");
    }
    // Nothing above touched the model.
    assert_eq!(http_text(a, "POST", "/score", Some(r#"{"text": "The capital of France is Paris"}"#)), (200, reference));
    assert_eq!(http(a, "GET", "/health", None).1["status"], "ok");
    let stats = server.stop();
    assert_eq!(stats.server_errors, 0, "{stats:?}");
    assert_eq!(stats.client_errors as usize, cases.len(), "{stats:?}");
}

/// Without `--save-root`, `/save` is refused (403) whatever it names, and nothing is written.
#[test]
fn save_is_refused_without_a_save_root() {
    let _serial = serial();
    let dir = tempfile::tempdir().unwrap();
    let session = Session::open(&fixture("gpt2"), None, &SessionOptions::default()).unwrap();
    let server = Running::start(session, ServeOptions::default());
    for target in [dir.path().join("abs").display().to_string(), "relative".to_string()] {
        let (st, v) = http(server.addr, "POST", "/save", Some(&json!({ "dir": target }).to_string()));
        assert_eq!((st, v["kind"].as_str()), (403, Some("forbidden")), "{target}: {v}");
        assert!(v["error"].as_str().unwrap().contains("without `save_root`"), "{v}");
    }
    assert!(!dir.path().join("abs").exists() && !Path::new("relative").exists());
    let stats = server.stop();
    assert_eq!((stats.client_errors, stats.model_requests), (2, 0), "{stats:?}");
}

/// With a save root, `/save` writes only inside it: absolute paths, `..` and symbolic
/// links out of the root are refused (403) without writing anything.
#[test]
fn save_root_confines_saves() {
    let _serial = serial();
    let top = tempfile::tempdir().unwrap();
    let root = top.path().join("root");
    std::fs::create_dir(&root).unwrap();
    let outside = top.path().join("outside");
    std::fs::create_dir(&outside).unwrap();
    std::os::unix::fs::symlink(&outside, root.join("link-out")).unwrap();
    std::os::unix::fs::symlink(outside.join("not-yet"), root.join("dangling")).unwrap();
    let session = Session::open(&fixture("gpt2"), None, &SessionOptions::default()).unwrap();
    let server = Running::start(session, ServeOptions { save_root: Some(root.clone()), ..ServeOptions::default() });
    let absolute = outside.join("abs").display().to_string();
    for (bad, needle) in [
        (absolute.as_str(), "absolute"),
        ("../x", "\"..\""),
        ("a/../../x", "\"..\""),
        ("a/..", "\"..\""),
        ("link-out", "symbolic link"),
        ("link-out/m", "symbolic link"),
        ("dangling", "cannot be resolved"),
        (".", "names the save root itself"),
        ("./", "names the save root itself"),
        ("m/..", "\"..\""),
    ] {
        let (st, v) = http(server.addr, "POST", "/save", Some(&json!({ "dir": bad }).to_string()));
        assert_eq!((st, v["kind"].as_str()), (403, Some("forbidden")), "{bad}: {v}");
        assert!(v["error"].as_str().unwrap().contains(needle), "{bad}: {v}");
    }
    assert_eq!(std::fs::read_dir(&outside).unwrap().count(), 0, "nothing was written outside the root");
    let (st, v) = http(server.addr, "POST", "/save", Some(r#"{"dir": "m/edited"}"#));
    assert_eq!(st, 200, "{v}");
    assert!(root.join("m/edited/config.json").is_file());
    server.stop();
}

/// A request that declares a body of 99,999,999,999 bytes is answered 413 without reading
/// it (tiny_http 0.12.0 then drained it through an allocation of that size and the
/// server aborted; vendor/tiny_http/PATCHED.md), to a model route or one the acceptor
/// answers, whether the client closes or keeps the connection open; a 50 MB header is
/// refused (400 or a closed connection) without being read whole. After each, `/health`
/// answers at once.
#[test]
fn a_huge_declared_body_or_header_leaves_the_server_up() {
    let _serial = serial();
    let session = Session::open(&fixture("gpt2"), None, &SessionOptions::default()).unwrap();
    let server = Running::start(session, ServeOptions::default());
    let a = server.addr;
    let health_at_once = |what: &str| {
        let t = Instant::now();
        let (st, v) = http(a, "GET", "/health", None);
        assert_eq!((st, v["status"].as_str()), (200, Some("ok")), "after {what}: {v}");
        assert!(t.elapsed() < Duration::from_secs(2), "after {what}: /health took {:?}", t.elapsed());
    };
    let raw = |head: &str| {
        let mut s = TcpStream::connect(a).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        s.write_all(head.as_bytes()).unwrap();
        s
    };
    let status_line = |s: &mut TcpStream| {
        let mut line = Vec::new();
        let mut byte = [0u8; 1];
        while s.read(&mut byte).unwrap_or(0) == 1 && byte[0] != b'\n' {
            line.push(byte[0]);
        }
        String::from_utf8_lossy(&line).trim().to_string()
    };
    let mut held = Vec::new();
    for (path, method, expected) in [("/score", "POST", "413"), ("/nope", "POST", "404"), ("/health", "GET", "200"), ("/score", "GET", "405")] {
        for close in [true, false] {
            let connection = if close { "Connection: close\r\n" } else { "" };
            let mut s = raw(&format!("{method} {path} HTTP/1.1\r\nHost: {a}\r\n{connection}Content-Type: application/json\r\nContent-Length: 99999999999\r\n\r\n{{"));
            let line = status_line(&mut s);
            assert!(line.starts_with(&format!("HTTP/1.1 {expected}")), "{method} {path}: {line:?}");
            health_at_once(&format!("{method} {path} with Content-Length: 99999999999"));
            if !close {
                // The client keeps its connection open (and sends nothing more).
                held.push(s);
            }
        }
    }
    // The 413 names the limit, and a kept-alive connection whose body was not read is
    // closed after its answer, never read as the next request.
    let mut s = raw(&format!("POST /score HTTP/1.1\r\nHost: {a}\r\nContent-Length: 99999999999\r\n\r\nGET /health HTTP/1.1\r\nHost: {a}\r\n\r\n"));
    let mut reply = String::new();
    let _ = s.read_to_string(&mut reply);
    assert!(reply.starts_with("HTTP/1.1 413") && reply.contains("larger than the limit of 1048576 bytes"), "{reply}");
    assert_eq!(reply.matches("HTTP/1.1").count(), 1, "the body was read as a request: {reply}");
    // A 50 MB header: refused before it is read whole (the write may fail once the server
    // has closed the connection).
    let mut s = TcpStream::connect(a).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    s.set_write_timeout(Some(Duration::from_secs(10))).unwrap();
    let t = Instant::now();
    let sent = s.write_all(format!("GET /health HTTP/1.1\r\nHost: {a}\r\nX-Big: ").as_bytes()).and_then(|()| {
        let chunk = vec![b'a'; 1 << 20];
        (0..50).try_for_each(|_| s.write_all(&chunk))
    });
    let line = status_line(&mut s);
    assert!(sent.is_err() || line.starts_with("HTTP/1.1 400"), "a 50 MB header was read: {line:?}");
    assert!(t.elapsed() < Duration::from_secs(10), "took {:?}", t.elapsed());
    health_at_once("a 50 MB header");
    drop(held);
    health_at_once("the held connections closed");
    server.stop();
}

/// With a token, every request (known route or not) needs `Authorization: Bearer <token>`:
/// 401 with `WWW-Authenticate` otherwise, and nothing runs on the model.
#[test]
fn a_token_is_required_on_every_request() {
    let _serial = serial();
    let session = Session::open(&fixture("gpt2"), None, &SessionOptions::default()).unwrap();
    let token = "s3cret-token_1";
    let server = Running::start(session, ServeOptions { token: Some(token.into()), ..ServeOptions::default() });
    let a = server.addr;
    let score = r#"{"text": "The capital of France is Paris"}"#;
    let requests = [("GET", "/health", None), ("GET", "/memory", None), ("POST", "/score", Some(score)), ("POST", "/reset", None), ("GET", "/nope", None)];
    let wrong = [None, Some("Bearer wrong"), Some("Bearer s3cret-token_"), Some("Bearer s3cret-token_12"), Some("Basic czNjcmV0"), Some(token), Some("Bearer")];
    let mut refused = 0;
    for (method, path, body) in requests {
        for auth in wrong {
            let (st, v, _, head) = try_http_with(a, method, path, body, auth).unwrap();
            assert_eq!((st, v["kind"].as_str()), (401, Some("unauthorized")), "{method} {path} {auth:?}: {v}");
            assert!(head.to_ascii_lowercase().contains("www-authenticate: bearer"), "{head}");
            refused += 1;
        }
    }
    let bearer = format!("Bearer {token}");
    let (st, v, _, _) = try_http_with(a, "POST", "/score", Some(score), Some(&bearer)).unwrap();
    assert_eq!(st, 200, "{v}");
    // The scheme is case-insensitive.
    let (st, v, _, _) = try_http_with(a, "GET", "/health", None, Some(&format!("bearer {token}"))).unwrap();
    assert_eq!((st, v["status"].as_str()), (200, Some("ok")), "{v}");
    let (st, _, _, _) = try_http_with(a, "GET", "/nope", None, Some(&bearer)).unwrap();
    assert_eq!(st, 404);
    let stats = server.stop();
    assert_eq!(stats.client_errors, refused + 1, "{stats:?}");
    assert_eq!(stats.model_requests, 1, "only the authorised /score ran: {stats:?}");
}

/// A non-loopback address needs a token or an explicit `insecure_no_token`; a token must
/// be something a header can carry; a save root must exist.
#[test]
fn bind_refuses_unsafe_settings() {
    let _serial = serial();
    let err = Server::bind("0.0.0.0:0", ServeOptions::default()).err().expect("refused").to_string();
    assert!(err.contains("without a token") && err.contains("`token`") && err.contains("`insecure_no_token`=true"), "{err}");
    assert_eq!(dualedit::cli::flags_named("`insecure_no_token`=true"), "--insecure-no-token");
    assert!(Server::bind("0.0.0.0:0", ServeOptions { insecure_no_token: true, ..ServeOptions::default() }).is_ok());
    assert!(Server::bind("0.0.0.0:0", ServeOptions { token: Some("t0k".into()), ..ServeOptions::default() }).is_ok());
    for bad in ["", "has space", "tab\there", "naïve"] {
        let err = Server::bind("127.0.0.1:0", ServeOptions { token: Some(bad.into()), ..ServeOptions::default() }).err().expect("refused").to_string();
        assert!(err.contains("printable ASCII"), "{bad:?}: {err}");
    }
    let missing = tempfile::tempdir().unwrap().path().join("gone");
    let err = Server::bind("127.0.0.1:0", ServeOptions { save_root: Some(missing.clone()), ..ServeOptions::default() }).err().expect("refused").to_string();
    assert!(err.contains("gone") && err.contains("existing directory"), "{err}");
}

/// A client that stalls mid-body holds its worker only for the body timeout: then the
/// worker is free (the next request is answered 200 by the one worker), the stalled
/// connection is kept by a reader thread of its own (counted in `/health`) and answered
/// 408 once the client sends the rest.
#[test]
fn a_stalled_body_is_answered_408_and_frees_its_worker() {
    let _serial = serial();
    let session = Session::open(&fixture("gpt2"), None, &SessionOptions::default()).unwrap();
    let opts = ServeOptions { workers: 1, queue: 2, body_timeout: Duration::from_millis(700), ..ServeOptions::default() };
    let server = Running::start(session, opts);
    let a = server.addr;
    // Headers, then a body larger than tiny_http reads ahead (1 KiB), of which one byte.
    let body = format!("{{\"text\": \"{}\"}}", "a ".repeat(2000));
    let mut stalled = TcpStream::connect(a).unwrap();
    write!(stalled, "POST /score HTTP/1.1\r\nHost: {a}\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{{", body.len()).unwrap();
    std::thread::sleep(Duration::from_millis(1500));
    let t = Instant::now();
    let (st, v) = http(a, "POST", "/score", Some(r#"{"text": "The capital of France is Paris"}"#));
    assert_eq!(st, 200, "the one worker is free again: {v}");
    assert!(t.elapsed() < Duration::from_secs(5), "took {:?}", t.elapsed());
    let (_, h) = http(a, "GET", "/health", None);
    assert_eq!(h["body_readers"], 1, "{h}");
    // The rest of the body: the stalled client is answered 408, naming the timeout.
    stalled.write_all(&body.as_bytes()[1..]).unwrap();
    stalled.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut reply = String::new();
    let _ = stalled.read_to_string(&mut reply);
    assert!(reply.starts_with("HTTP/1.1 408"), "{reply}");
    assert!(reply.contains("\"kind\":\"timeout\"") && reply.contains("did not arrive within 0.7 s"), "{reply}");
    let deadline = Instant::now() + Duration::from_secs(5);
    while http(a, "GET", "/health", None).1["body_readers"] != 0 {
        assert!(Instant::now() < deadline, "the reader thread ends once it has answered");
        std::thread::sleep(Duration::from_millis(50));
    }
    let stats = server.stop();
    assert!(stats.requests >= 3, "{stats:?}");
}

/// `dualedit serve` on port 0; returns the child and the address it printed.
fn spawn_binary() -> (std::process::Child, SocketAddr, BufReader<std::process::ChildStderr>) {
    spawn_binary_with(&[], &[])
}

fn spawn_binary_with(args: &[&str], env: &[(&str, &str)]) -> (std::process::Child, SocketAddr, BufReader<std::process::ChildStderr>) {
    let (child, addr, err, _) = common::spawn_serve(&fixture("gpt2"), args, env);
    (child, addr, err)
}

#[test]
fn sigint_and_sigterm_finish_in_flight_requests_and_exit_cleanly() {
    let _serial = serial();
    for signal in ["-INT", "-TERM"] {
        let (mut child, addr, mut stderr) = spawn_binary();
        assert_eq!(http(addr, "GET", "/health", None).0, 200);
        // Traffic that is still arriving when the signal does.
        let stop = Arc::new(AtomicBool::new(false));
        let clients: Vec<_> = (0..4)
            .map(|_| {
                let stop = stop.clone();
                std::thread::spawn(move || {
                    let mut answered = Vec::new();
                    while !stop.load(Ordering::SeqCst) {
                        match try_http(addr, "POST", "/generate", Some(r#"{"prompt": "Once upon a time", "max_new_tokens": 30}"#)) {
                            Ok((st, v, _)) => answered.push((st, v)),
                            Err(_) => break, // the listener is gone
                        }
                    }
                    answered
                })
            })
            .collect();
        std::thread::sleep(Duration::from_millis(300));
        let status = Command::new("kill").arg(signal).arg(child.id().to_string()).status().unwrap();
        assert!(status.success());
        let t0 = Instant::now();
        let exit = loop {
            if let Some(s) = child.try_wait().unwrap() {
                break s;
            }
            assert!(t0.elapsed() < Duration::from_secs(20), "serve did not exit after SIG{signal}");
            std::thread::sleep(Duration::from_millis(20));
        };
        stop.store(true, Ordering::SeqCst);
        assert!(exit.success(), "{signal}: exit status {exit:?}");
        let mut rest = String::new();
        stderr.read_to_string(&mut rest).unwrap();
        assert!(rest.contains("stopped after"), "{rest}");
        let mut n = 0;
        for c in clients {
            for (st, v) in c.join().unwrap() {
                // Every request that got an answer got a whole, correct one: 200 with the
                // generation, or 503 for one queued when the shutdown began.
                assert!(st == 200 && v["tokens"].is_array() || st == 503 && v["kind"] == "shutting_down", "{st}: {v}");
                n += 1;
            }
        }
        assert!(n > 0, "no request was answered before SIG{signal}");
    }
}

/// The binary: `DUALEDIT_TOKEN` turns authentication on (a `--token` flag wins over it),
/// and a non-loopback `--listen` without a token stops before loading anything.
#[test]
fn the_binary_takes_its_token_from_the_environment_and_refuses_open_listeners() {
    let _serial = serial();
    for (args, env, token) in [(&[][..], &[("DUALEDIT_TOKEN", "from-env")][..], "from-env"), (&["--token", "from-flag"][..], &[("DUALEDIT_TOKEN", "from-env")][..], "from-flag")] {
        let (mut child, addr, _stderr) = spawn_binary_with(args, env);
        let (st, _, _, _) = try_http_with(addr, "GET", "/health", None, None).unwrap();
        assert_eq!(st, 401);
        let (st, _, _, _) = try_http_with(addr, "GET", "/health", None, Some(&format!("Bearer {token}"))).unwrap();
        assert_eq!(st, 200, "{args:?}");
        child.kill().unwrap();
        child.wait().unwrap();
    }
    let out = common::dualedit_cmd()
        .args(["serve", "--model", "/nonexistent/model", "--listen", "0.0.0.0:0"])
        .env_remove("DUALEDIT_TOKEN")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("without a token") && err.trim().lines().count() == 1, "{err}");
}

