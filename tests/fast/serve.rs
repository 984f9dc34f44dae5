//! The HTTP service over real HTTP on 127.0.0.1 (ephemeral ports): the edit / generate /
//! reset / save flow, a burst of 200 concurrent mixed requests, a catalogue of bad
//! requests, and SIGINT/SIGTERM on the `dualedit serve` binary.
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

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

/// A server running on its own thread until `stop`.
struct Running {
    addr: SocketAddr,
    flag: Arc<AtomicBool>,
    thread: JoinHandle<ServeStats>,
}

impl Running {
    fn start(session: Session, opts: ServeOptions) -> Self {
        let server = Server::bind("127.0.0.1:0", opts).unwrap();
        let addr = server.local_addr();
        assert!(addr.ip().is_loopback() && addr.port() != 0);
        let flag = Arc::new(AtomicBool::new(false));
        let f = flag.clone();
        let thread = std::thread::spawn(move || server.run(session, &f).unwrap());
        Self { addr, flag, thread }
    }

    fn stop(self) -> ServeStats {
        self.flag.store(true, Ordering::SeqCst);
        self.thread.join().unwrap()
    }
}

/// One HTTP/1.1 request on a fresh connection: `(status, JSON body)`.
fn http(addr: SocketAddr, method: &str, path: &str, body: Option<&str>) -> (u16, Value) {
    let (st, v, _) = try_http(addr, method, path, body).unwrap_or_else(|e| panic!("{method} {path}: {e}"));
    (st, v)
}

/// `(status, body text)`: for exact comparisons of numbers. serde_json writes an f64 in
/// its shortest round-trip form, so equal bits give equal text, while its default parser
/// may be one ulp off.
fn http_text(addr: SocketAddr, method: &str, path: &str, body: Option<&str>) -> (u16, String) {
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
    let rss_before = rss();
    let counts = burst(server.addr, &expected);
    let rss_after = rss();
    let ok_model = counts.get(&200).copied().unwrap_or(0);
    eprintln!("warm-up {warm:?}; burst {counts:?}; rss {rss_before} -> {rss_after}");
    assert_eq!(counts.values().sum::<usize>(), 200);
    assert!(ok_model > 0);
    // 200 clients at once against a queue of 4: the bound is reached, and answered 503.
    let full = warm.get(&503).copied().unwrap_or(0) + counts.get(&503).copied().unwrap_or(0);
    assert!(counts.get(&503).copied().unwrap_or(0) > 0, "the queue bound was never reached");
    // Memory is flat: no per-request growth survives the burst.
    let grew = rss_after as i64 - rss_before as i64;
    assert!(grew < 16 << 20, "process RSS grew by {} MiB over 200 requests", grew >> 20);
    // Still serving, with the same answers.
    assert_eq!(http_text(server.addr, "POST", "/score", Some(r#"{"text": "The capital of France is Paris"}"#)), (200, expected.score.clone()));
    let stats = server.stop();
    assert_eq!(stats.requests, 401);
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
        assert!(v["error"].as_str().unwrap().contains("--save-root"), "{v}");
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
    assert!(err.contains("without a token") && err.contains("--token") && err.contains("--insecure-no-token"), "{err}");
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

/// A `w × h` PNG filled from `seed`.
fn png(path: &Path, w: u32, h: u32, seed: u8) {
    let img = image::RgbImage::from_fn(w, h, |x, y| image::Rgb([(x as u8).wrapping_mul(seed), (y as u8).wrapping_add(seed), seed.wrapping_mul(7)]));
    img.save(path).unwrap();
}

/// The Qwen2-VL fixture with an untrained editor (a plain gradient step of size edit_lr).
fn vl_session() -> Session {
    use dualedit::device::DevicePlan;
    let opts = dualedit::edit::LoadOptions { plan: DevicePlan::single(tch::Device::Cpu), ..Default::default() };
    let engine = dualedit::edit::open_engine(&fixture("qwen2_vl"), &opts, &[]).unwrap();
    let cfg = dualedit::config::MendConfig { rank: 8, edit_lr: 1e-2, ..Default::default() };
    let editor = dualedit::mend::Editor::new(&cfg, engine.edit_params.clone(), tch::Device::Cpu, 0).unwrap();
    Session::from_parts(engine, Some(editor))
}

/// An image root under `top` with the three pictures of [`vqa_request`]`("a.png")`.
fn vqa_images(top: &Path) -> std::path::PathBuf {
    let root = top.join("images");
    std::fs::create_dir_all(&root).unwrap();
    png(&root.join("a.png"), 40, 30, 3);
    png(&root.join("r.png"), 224, 28, 11);
    png(&root.join("loc.png"), 50, 50, 9);
    root
}

/// One E-VQA edit request whose question image is `image` (the others are r.png, loc.png).
fn vqa_request(image: &str) -> Value {
    json!({
        "src": "What is in the picture?", "alt": "a cat", "rephrase": "What does the picture show?",
        "image": image, "image_rephrase": "r.png",
        "loc": "nq question: who wrote hamlet", "loc_ans": "shakespeare",
        "m_loc": "loc.png", "m_loc_q": "What colour is the bus?", "m_loc_a": "red"
    })
}

/// Issue #22 / #25: `/score` takes an image by path under `--image-root` or as base64, and
/// `/edit` takes E-VQA requests; image paths follow `/save`'s rule (403 without a root, for
/// an absolute path, `..` or a link out of it), and a bad upload is 400.
#[test]
fn images_by_root_or_base64_score_and_edit_and_never_leave_the_root() {
    let _serial = serial();
    let top = tempfile::tempdir().unwrap();
    let (root, outside) = (top.path().join("images"), top.path().join("outside"));
    std::fs::create_dir_all(root.join("val")).unwrap();
    std::fs::create_dir_all(&outside).unwrap();
    png(&root.join("val/a.png"), 40, 30, 3);
    png(&root.join("r.png"), 224, 28, 11);
    png(&root.join("loc.png"), 50, 50, 9);
    png(&outside.join("secret.png"), 40, 30, 3);
    std::os::unix::fs::symlink(outside.join("secret.png"), root.join("link.png")).unwrap();
    let bytes = std::fs::read(root.join("val/a.png")).unwrap();
    let b64 = base64::encode(&bytes);
    let text = "What is in the picture? a cat";
    let score = |a, body: Value| http(a, "POST", "/score", Some(&body.to_string()));
    let edit = |a, reqs: Value| http(a, "POST", "/edit", Some(&json!({ "requests": reqs }).to_string()));

    // Without --image-root: paths are refused, uploads work.
    let server = Running::start(vl_session(), ServeOptions::default());
    let (st, v) = score(server.addr, json!({ "text": text, "image": "val/a.png" }));
    assert_eq!((st, v["kind"].as_str()), (403, Some("forbidden")), "{v}");
    assert!(v["error"].as_str().unwrap().contains("--image-root"), "{v}");
    let (st, v) = edit(server.addr, json!([vqa_request("val/a.png")]));
    assert_eq!((st, v["kind"].as_str()), (403, Some("forbidden")), "{v}");
    let (st, uploaded) = score(server.addr, json!({ "text": text, "image_base64": b64 }));
    assert_eq!(st, 200, "{uploaded}");
    assert!(uploaded["image_tokens"].as_u64().unwrap() > 0);
    let stats = server.stop();
    assert_eq!((stats.client_errors, stats.model_requests), (2, 1), "{stats:?}");

    assert!(Server::bind("127.0.0.1:0", ServeOptions { image_root: Some(top.path().join("none")), ..ServeOptions::default() }).is_err());
    let server = Running::start(vl_session(), ServeOptions { image_root: Some(root.clone()), ..ServeOptions::default() });
    let a = server.addr;
    let (st, by_path) = score(a, json!({ "text": text, "image": "val/a.png" }));
    assert_eq!(st, 200, "{by_path}");
    assert_eq!(by_path["logprobs"], uploaded["logprobs"], "the same image by path and by upload");
    let (_, plain) = score(a, json!({ "text": text }));
    assert_eq!(plain["image_tokens"], 0);

    let absolute = outside.join("secret.png").display().to_string();
    for (bad, needle) in [(absolute.as_str(), "absolute"), ("../outside/secret.png", "\"..\""), ("val/../../outside/secret.png", "\"..\""), ("link.png", "symbolic link")] {
        let (st, v) = score(a, json!({ "text": text, "image": bad }));
        assert_eq!((st, v["kind"].as_str()), (403, Some("forbidden")), "{bad}: {v}");
        assert!(v["error"].as_str().unwrap().contains(needle), "{bad}: {v}");
        let (st, v) = edit(a, json!([vqa_request(bad)]));
        assert_eq!((st, v["kind"].as_str()), (403, Some("forbidden")), "edit {bad}: {v}");
    }
    for (body, needle) in [
        (json!({ "text": text, "image": "val/missing.png" }), "not a file"),
        (json!({ "text": text, "image": "val" }), "not a file"),
        (json!({ "text": text, "image_base64": "!!not base64!!" }), "base64"),
        (json!({ "text": text, "image_base64": base64::encode(b"plain text, not an image") }), "PNG or JPEG"),
        (json!({ "text": text, "image_base64": base64::encode(&bytes[..40]) }), "cannot be read"),
        (json!({ "text": text, "image_base64": "" }), "empty"),
        (json!({ "text": text, "image_base64": 7 }), "must be a string"),
        (json!({ "text": text, "image": "val/a.png", "image_base64": b64 }), "not both"),
    ] {
        let (st, v) = score(a, body.clone());
        assert_eq!((st, v["kind"].as_str()), (400, Some("bad_request")), "{body}: {v}");
        assert!(v["error"].as_str().unwrap().contains(needle), "{needle}: {v}");
    }
    let (st, v) = edit(a, json!([vqa_request("val/missing.png")]));
    assert_eq!(st, 400, "{v}");
    assert!(v["error"].as_str().unwrap().contains("missing.png"), "{v}");
    let (_, h) = http(a, "GET", "/health", None);
    assert_eq!(h["edits_total"], 0, "no refused request edited");

    // An image edit: committed, counted, and it moves the image score; reset undoes it.
    let (st, out) = edit(a, json!([vqa_request("val/a.png")]));
    assert_eq!(st, 200, "{out}");
    assert_eq!(out["edits_total"], 1);
    assert_eq!(out["requests"][0]["prompt"], "What is in the picture?");
    let (_, after) = score(a, json!({ "text": text, "image": "val/a.png" }));
    assert_ne!(after["logprobs"], by_path["logprobs"]);
    let (st, _) = http(a, "POST", "/reset", None);
    assert_eq!(st, 200);
    let (_, reset) = score(a, json!({ "text": text, "image_base64": b64 }));
    assert_eq!(reset["logprobs"], by_path["logprobs"], "reset restores the image score exactly");
    server.stop();
}

/// Issue #22: an E-VQA `/edit` takes each of its three images as an upload
/// (`image_base64`, `image_rephrase_base64`, `m_loc_base64`) as well as a path under
/// `--image-root`, with the same result; uploads alone need no root, a path still does.
/// `/generate` shows an image by path or upload, and greedy decoding is the same either way.
#[test]
fn image_edits_and_generation_take_uploads_as_well_as_paths() {
    let _serial = serial();
    let top = tempfile::tempdir().unwrap();
    let root = top.path().join("images");
    std::fs::create_dir_all(root.join("val")).unwrap();
    png(&root.join("val/a.png"), 40, 30, 3);
    png(&root.join("r.png"), 224, 28, 11);
    png(&root.join("loc.png"), 50, 50, 9);
    let b64 = |p: &str| base64::encode(std::fs::read(root.join(p)).unwrap());
    let uploaded = || {
        let mut r = vqa_request("unused");
        let o = r.as_object_mut().unwrap();
        for (key, file) in [("image", "val/a.png"), ("image_rephrase", "r.png"), ("m_loc", "loc.png")] {
            o.remove(key);
            o.insert(format!("{key}_base64"), json!(b64(file)));
        }
        r
    };
    let text = "What is in the picture? a cat";
    let score = |a, body: Value| http(a, "POST", "/score", Some(&body.to_string()));
    let edit = |a, reqs: Value| http(a, "POST", "/edit", Some(&json!({ "requests": reqs }).to_string()));
    let generate = |a, body: Value| http(a, "POST", "/generate", Some(&body.to_string()));
    let temp_images = || {
        let prefix = format!("dualedit-image-{}-", std::process::id());
        std::fs::read_dir(std::env::temp_dir()).unwrap().filter(|e| e.as_ref().unwrap().file_name().to_string_lossy().starts_with(&prefix)).count()
    };

    // By path under the root: the reference edit and generation.
    let server = Running::start(vl_session(), ServeOptions { image_root: Some(root.clone()), ..ServeOptions::default() });
    let a = server.addr;
    let (st, g_path) = generate(a, json!({ "prompt": "What is in the picture?", "max_new_tokens": 4, "image": "val/a.png" }));
    assert_eq!(st, 200, "{g_path}");
    assert_eq!(g_path["tokens"].as_array().unwrap().len(), 4);
    let (_, g_b64) = generate(a, json!({ "prompt": "What is in the picture?", "max_new_tokens": 4, "image_base64": b64("val/a.png") }));
    assert_eq!(g_b64["tokens"], g_path["tokens"], "the same image by path and by upload");
    // Greedy: two tokens are the first two of four.
    let (_, g2) = generate(a, json!({ "prompt": "What is in the picture?", "max_new_tokens": 2, "image": "val/a.png" }));
    assert_eq!(g2["tokens"].as_array().unwrap()[..], g_path["tokens"].as_array().unwrap()[..2]);
    let (_, g_text) = generate(a, json!({ "prompt": "What is in the picture?", "max_new_tokens": 4 }));
    assert_eq!(g_text["prompt_tokens"], g_path["prompt_tokens"], "prompt_tokens counts the text");
    // A mix of a path and uploads is fine with a root.
    let (_, before) = score(a, json!({ "text": text, "image": "val/a.png" }));
    let (st, by_path) = edit(a, json!([vqa_request("val/a.png")]));
    assert_eq!(st, 200, "{by_path}");
    let (_, after_path) = score(a, json!({ "text": text, "image": "val/a.png" }));
    assert_ne!(after_path["logprobs"], before["logprobs"]);
    http(a, "POST", "/reset", None);
    let mut mixed = uploaded();
    mixed.as_object_mut().unwrap().remove("image_base64");
    mixed["image"] = json!("val/a.png");
    let (st, v) = edit(a, json!([mixed.clone()]));
    assert_eq!(st, 200, "{v}");
    let (_, after_mixed) = score(a, json!({ "text": text, "image": "val/a.png" }));
    assert_eq!(after_mixed["logprobs"], after_path["logprobs"], "the same edit with uploads");
    server.stop();

    // Uploads only: no root needed, and the same edit as by path.
    let server = Running::start(vl_session(), ServeOptions::default());
    let a = server.addr;
    let (st, out) = edit(a, json!([uploaded()]));
    assert_eq!(st, 200, "{out}");
    assert_eq!((out["edits_total"].as_u64(), &out["requests"][0]["prompt"]), (Some(1), &json!("What is in the picture?")));
    let (_, after) = score(a, json!({ "text": text, "image_base64": b64("val/a.png") }));
    assert_eq!(after["logprobs"], after_path["logprobs"], "uploads edit as paths do");
    assert_eq!(temp_images(), 0, "uploads' temporary files are removed after the request");
    // Only src, alt and an image, as EasyEdit allows: edited, the absent views' metrics absent.
    http(a, "POST", "/reset", None);
    let (st, bare) = edit(a, json!([{ "src": "What is in the picture?", "alt": "a cat", "image_base64": b64("val/a.png") }]));
    assert_eq!(st, 200, "{bare}");
    let r0 = &bare["requests"][0];
    assert!(r0["reliability"].is_number() && r0["locality"].is_null() && r0.get("image_locality").is_none(), "{bare}");
    let (_, after_bare) = score(a, json!({ "text": text, "image_base64": b64("val/a.png") }));
    assert_eq!(after_bare["logprobs"], after_path["logprobs"], "the same edit without the other views");
    // Paths still need the root, for /edit and /generate alike.
    let (st, v) = edit(a, json!([mixed]));
    assert_eq!((st, v["kind"].as_str()), (403, Some("forbidden")), "{v}");
    let (st, v) = generate(a, json!({ "prompt": "What", "image": "val/a.png" }));
    assert_eq!((st, v["kind"].as_str()), (403, Some("forbidden")), "{v}");
    // Bad uploads are 400 naming the record and the field.
    let mut both = uploaded();
    both["image"] = json!("val/a.png");
    let mut bad_b64 = uploaded();
    bad_b64["m_loc_base64"] = json!("!!not base64!!");
    let mut not_image = uploaded();
    not_image["image_rephrase_base64"] = json!(base64::encode(b"plain text"));
    let mut not_string = uploaded();
    not_string["m_loc_base64"] = json!(7);
    for (reqs, needles) in [
        (json!([both]), vec!["record 0", "not both"]),
        (json!([uploaded(), bad_b64]), vec!["record 1", "m_loc_base64", "base64"]),
        (json!([not_image]), vec!["image_rephrase_base64", "PNG or JPEG"]),
        (json!([not_string]), vec!["m_loc_base64", "must be a string"]),
    ] {
        let (st, v) = edit(a, reqs.clone());
        assert_eq!((st, v["kind"].as_str()), (400, Some("bad_request")), "{reqs}: {v}");
        for n in needles {
            assert!(v["error"].as_str().unwrap().contains(n), "{n}: {v}");
        }
    }
    let (st, v) = generate(a, json!({ "prompt": "What", "image_base64": "!!" }));
    assert_eq!((st, v["kind"].as_str()), (400, Some("bad_request")), "{v}");
    let (_, h) = http(a, "GET", "/health", None);
    assert_eq!(h["edits_total"], 1, "no refused request edited");
    server.stop();
    assert_eq!(temp_images(), 0);
}

/// Issue #33.2: a FIFO (or any non-regular file) named as an image is refused (400) at
/// once instead of blocking the worker that opens it; and `/health` answers while every
/// worker is stuck on a client that never sends its body, the next model request being
/// answered 503 `queue_full` at once rather than waiting.
#[test]
fn non_regular_images_are_refused_and_health_answers_while_workers_are_stuck() {
    let _serial = serial();
    let top = tempfile::tempdir().unwrap();
    let root = top.path().join("images");
    std::fs::create_dir_all(&root).unwrap();
    png(&root.join("r.png"), 224, 28, 11);
    png(&root.join("loc.png"), 50, 50, 9);
    let fifo = root.join("fifo.png");
    let made = Command::new("mkfifo").arg(&fifo).status().unwrap();
    assert!(made.success());
    std::os::unix::fs::symlink(&fifo, root.join("to-fifo.png")).unwrap();
    let server = Running::start(vl_session(), ServeOptions { image_root: Some(root.clone()), workers: 2, queue: 2, ..ServeOptions::default() });
    let a = server.addr;
    let start = Instant::now();
    for name in ["fifo.png", "to-fifo.png"] {
        for _ in 0..6 {
            let (st, v) = http(a, "POST", "/edit", Some(&json!({ "requests": [vqa_request(name)] }).to_string()));
            assert_eq!((st, v["kind"].as_str()), (400, Some("bad_request")), "{name}: {v}");
            assert!(v["error"].as_str().unwrap().contains("only a regular file"), "{v}");
        }
        let (st, v) = http(a, "POST", "/score", Some(&json!({ "text": "a", "image": name }).to_string()));
        assert_eq!(st, 400, "{v}");
    }
    assert!(start.elapsed() < Duration::from_secs(20), "refusals took {:?}", start.elapsed());

    // Clients that send headers and never their body (larger than tiny_http reads ahead,
    // 1 KiB): each holds a worker (2), and two
    // more wait for one (queue 2); then model routes are answered 503, /health 200, at once.
    let stuck: Vec<TcpStream> = (0..4)
        .map(|_| {
            let mut s = TcpStream::connect(a).unwrap();
            write!(s, "POST /score HTTP/1.1\r\nHost: {a}\r\nContent-Type: application/json\r\nContent-Length: 200000\r\n\r\n{{").unwrap();
            // One at a time: tiny_http 0.12's connection pool can hand two connections
            // that arrive within microseconds to one thread, the second waiting for the
            // first to end (a limitation of the HTTP layer, not of the workers).
            std::thread::sleep(Duration::from_millis(150));
            s
        })
        .collect();
    std::thread::sleep(Duration::from_millis(500));
    let t = Instant::now();
    let (st, h) = http(a, "GET", "/health", None);
    assert_eq!((st, h["status"].as_str()), (200, Some("ok")), "{h}");
    let (st, v) = http(a, "POST", "/score", Some(r#"{"text": "a b"}"#));
    assert_eq!((st, v["kind"].as_str()), (503, Some("queue_full")), "{v}");
    assert!(t.elapsed() < Duration::from_secs(5), "answers took {:?} with stuck workers", t.elapsed());
    drop(stuck);
    // The workers come back once those clients go.
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let (st, v) = http(a, "POST", "/score", Some(r#"{"text": "What is in the picture?"}"#));
        if st == 200 {
            break;
        }
        assert!(st == 503 && Instant::now() < deadline, "{st}: {v}");
        std::thread::sleep(Duration::from_millis(200));
    }
    server.stop();
}

/// Issue #33.6: responses name only what the client sent. A 403 for a link out of the
/// root names neither the root nor the link's target; client-caused image failures (a
/// truncated upload, a NUL in a path, an aspect ratio over 200:1, text too long with an
/// image) are 400, not 500, and no body carries a server path.
#[test]
fn errors_name_only_the_clients_paths_and_client_faults_are_4xx() {
    let _serial = serial();
    let top = tempfile::tempdir().unwrap();
    let (root, outside) = (top.path().join("images"), top.path().join("outside"));
    std::fs::create_dir_all(&root).unwrap();
    std::fs::create_dir_all(&outside).unwrap();
    png(&root.join("a.png"), 40, 30, 3);
    png(&root.join("r.png"), 224, 28, 11);
    png(&root.join("loc.png"), 50, 50, 9);
    png(&root.join("wide.png"), 1000, 4, 5);
    png(&outside.join("secret.png"), 40, 30, 3);
    std::os::unix::fs::symlink(outside.join("secret.png"), root.join("link.png")).unwrap();
    std::os::unix::fs::symlink(outside.join("gone.png"), root.join("dangling.png")).unwrap();
    // A PNG whose header reads but whose pixel data stops short.
    let full = std::fs::read(root.join("a.png")).unwrap();
    std::fs::write(root.join("truncated.png"), &full[..full.len() - 30]).unwrap();
    let truncated_b64 = base64::encode(&full[..full.len() - 30]);
    let wide_b64 = base64::encode(std::fs::read(root.join("wide.png")).unwrap());
    let server = Running::start(vl_session(), ServeOptions { image_root: Some(root.clone()), ..ServeOptions::default() });
    let a = server.addr;
    let long = "word ".repeat(400);
    let server_paths = [top.path().display().to_string(), std::env::temp_dir().display().to_string(), fixture("qwen2_vl").display().to_string()];
    let check = |path: &str, body: Value, status: u16, needle: &str| {
        let (st, v) = http(a, "POST", path, Some(&body.to_string()));
        let err = v["error"].as_str().unwrap_or_default().to_string();
        assert_eq!(st, status, "{path} {body}: {v}");
        assert!(err.contains(needle), "{path}: {err:?} lacks {needle:?}");
        for p in &server_paths {
            assert!(!err.contains(p.as_str()), "{path}: {err:?} names the server path {p}");
        }
    };
    let edit = |r: Value| json!({ "requests": [r] });
    check("/score", json!({ "text": "a", "image": "link.png" }), 403, "link.png");
    check("/edit", edit(vqa_request("link.png")), 403, "symbolic link");
    check("/score", json!({ "text": "a", "image": "dangling.png" }), 403, "cannot be resolved");
    check("/score", json!({ "text": "a", "image": "a\u{0}.png" }), 400, "NUL");
    check("/edit", edit(vqa_request("a.png\u{0}")), 400, "NUL");
    check("/score", json!({ "text": "a", "image": "truncated.png" }), 400, "truncated.png");
    check("/score", json!({ "text": "a", "image_base64": truncated_b64 }), 400, "image_base64");
    check("/generate", json!({ "prompt": "a", "image_base64": truncated_b64 }), 400, "image_base64");
    check("/edit", edit(vqa_request("truncated.png")), 400, "truncated.png");
    check("/score", json!({ "text": "a", "image": "wide.png" }), 400, "200:1");
    check("/score", json!({ "text": "a", "image_base64": wide_b64 }), 400, "200:1");
    // An edit takes the image through the same preprocessing as a request the model refuses: 422.
    check("/edit", edit(vqa_request("wide.png")), 422, "200:1");
    check("/score", json!({ "text": long, "image": "a.png" }), 400, "context");
    check("/score", json!({ "text": "a", "image": "missing.png" }), 400, "missing.png");
    let (_, h) = http(a, "GET", "/health", None);
    assert_eq!(h["edits_total"], 0);
    let stats = server.stop();
    assert_eq!(stats.server_errors, 0, "{stats:?}");
}

/// Issue #34: `serve` guards commits as `edit` does (on by default), each `/edit` response
/// lists the guard's decisions and the settings it ran under, a request may change the
/// settings for itself (`guard`: false, true or an object), and out-of-range settings are
/// 400 naming the key. A refused edit leaves the unrelated image's score exactly as it was.
#[test]
fn serve_guards_edits_and_reports_its_decisions() {
    let _serial = serial();
    let top = tempfile::tempdir().unwrap();
    let root = vqa_images(top.path());
    let server = Running::start(vl_session(), ServeOptions { image_root: Some(root.clone()), ..ServeOptions::default() });
    let a = server.addr;
    let edit = |extra: Option<Value>| {
        let mut body = json!({ "requests": [vqa_request("a.png")] });
        if let Some(g) = extra {
            body["guard"] = g;
        }
        http(a, "POST", "/edit", Some(&body.to_string()))
    };
    let loc = json!({ "text": "What colour is the bus? red", "image": "loc.png" }).to_string();
    let (_, loc_before) = http_text(a, "POST", "/score", Some(&loc));

    for (g, needle) in [
        (json!({ "min_agreement": 1.5 }), "min_agreement"),
        (json!({ "max_drop": -0.1 }), "max_drop"),
        (json!({ "max_kl": -1 }), "max_kl"),
        (json!({ "bogus": 1 }), "bogus"),
        (json!("yes"), "must be true, false or an object"),
    ] {
        let (st, v) = edit(Some(g.clone()));
        assert_eq!((st, v["kind"].as_str()), (400, Some("bad_request")), "{g}: {v}");
        assert!(v["error"].as_str().unwrap().contains(needle), "{needle}: {v}");
    }
    // So strict that any change to the probes fails, and refusing: nothing is committed.
    let (st, v) = edit(Some(json!({ "min_agreement": 1.0, "max_drop": 0.0, "max_kl": 0.0, "refuse": true })));
    assert_eq!(st, 200, "{v}");
    assert_eq!(v["guard"][0]["decision"], "refused", "{v}");
    assert_eq!(v["guard_settings"]["max_kl"], 0.0, "{v}");
    assert_eq!(v["guard_settings"]["scale_back"], false, "{v}");
    assert_eq!(http_text(a, "POST", "/score", Some(&loc)).1, loc_before, "a refused edit leaves the unrelated image's score exactly");
    // The server's default guard: a decision is reported with its numbers.
    let (st, v) = edit(None);
    assert_eq!(st, 200, "{v}");
    assert_eq!(v["guard"].as_array().map(Vec::len), Some(1), "{v}");
    assert!(v["guard"][0]["before"]["agreement"].is_number(), "{v}");
    assert_eq!(v["guard_settings"]["min_agreement"], 0.9, "{v}");
    http(a, "POST", "/reset", None);
    // Unguarded on request: no decisions, and the edit is committed as made.
    let (st, v) = edit(Some(json!(false)));
    assert_eq!(st, 200, "{v}");
    assert_eq!((v["guard"].as_array().map(Vec::len), &v["guard_settings"]), (Some(0), &Value::Null), "{v}");
    assert_ne!(http_text(a, "POST", "/score", Some(&loc)).1, loc_before, "the unguarded edit moved the unrelated image's score");
    server.stop();

    // Without a guard on the server, `guard: true` still guards that request.
    let server = Running::start(vl_session(), ServeOptions { image_root: Some(root.clone()), guard: None, ..ServeOptions::default() });
    let a = server.addr;
    let (st, v) = http(a, "POST", "/edit", Some(&json!({ "requests": [vqa_request("a.png")] }).to_string()));
    assert_eq!((st, v["guard"].as_array().map(Vec::len)), (200, Some(0)), "{v}");
    let (st, v) = http(a, "POST", "/edit", Some(&json!({ "requests": [vqa_request("a.png")], "guard": true }).to_string()));
    assert_eq!((st, v["guard"].as_array().map(Vec::len)), (200, Some(1)), "{v}");
    server.stop();
    let bad = dualedit::mend::guard::GuardConfig { max_drop: f64::NAN, ..Default::default() };
    let err = Server::bind("127.0.0.1:0", ServeOptions { guard: Some(bad), ..ServeOptions::default() }).err().expect("refused").to_string();
    assert!(err.contains("--guard-max-drop") && err.contains("[0, 1]"), "{err}");
}

/// Issue #48: the same request gives the same bits on every worker and at every point of a
/// server's life. 24 identical `/score` requests with an image, sent at once, are one answer;
/// after an edit they are one (other) answer; after a reset the first one again. Before
/// `device::settle_threads`, the model thread's first products ran with MKL's own thread
/// count and differed from later ones by ~3e-6 on a 2-core machine (CI runs the fast tests
/// with `OMP_NUM_THREADS=2` too, so this cannot come back unseen).
#[test]
fn concurrent_image_scores_are_one_answer_before_and_after_an_edit_and_a_reset() {
    let _serial = serial();
    let top = tempfile::tempdir().unwrap();
    let root = vqa_images(top.path());
    let server = Running::start(vl_session(), ServeOptions { image_root: Some(root), ..ServeOptions::default() });
    let a = server.addr;
    let body = json!({ "text": "What is in the picture? a cat", "image": "a.png" }).to_string();
    let burst = || -> String {
        let answers: Vec<(u16, String)> =
            std::thread::scope(|s| (0..24).map(|_| s.spawn(|| http_text(a, "POST", "/score", Some(&body)))).collect::<Vec<_>>().into_iter().map(|h| h.join().unwrap()).collect());
        assert!(answers.iter().all(|(st, _)| *st == 200), "{:?}", answers.iter().map(|a| a.0).collect::<Vec<_>>());
        assert!(answers.iter().all(|(_, t)| *t == answers[0].1), "24 identical requests, more than one answer");
        answers[0].1.clone()
    };
    let before = burst();
    let (st, v) = http(a, "POST", "/edit", Some(&json!({ "requests": [vqa_request("a.png")], "guard": false }).to_string()));
    assert_eq!(st, 200, "{v}");
    let edited = burst();
    assert_ne!(edited, before, "the edit changes the image's score");
    let (st, v) = http(a, "POST", "/reset", Some("{}"));
    assert_eq!(st, 200, "{v}");
    assert_eq!(burst(), before, "a reset gives back exactly the first answer");
    server.stop();
}
