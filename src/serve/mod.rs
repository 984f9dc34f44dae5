//! `dualedit serve`: a [`Session`]'s operations as JSON over HTTP, for programs that use
//! dualedit as their editing backend.
//!
//! | route            | body                                   | answer                                   |
//! |------------------|----------------------------------------|------------------------------------------|
//! | `POST /edit`     | `{"requests": [EasyEdit records]}`     | the edit's result, as `edit --json`'s    |
//! | `POST /edit`     | `{"requests": [E-VQA records]}`        | the same, edits with images              |
//! | `POST /score`    | `{"text", "image"? \| "image_base64"?}` | `{"tokens", "logprobs", "mean_nll"}`     |
//! | `POST /generate` | `{"prompt", "max_new_tokens"?: 16, "image"? \| "image_base64"?}` | `{"text", "tokens", ...}` |
//!
//! An E-VQA record names each of its three images (`image`, `image_rephrase`, `m_loc`)
//! by a path under the image root or uploads it as base64 under the same name with
//! `_base64` (`image_base64`, `image_rephrase_base64`, `m_loc_base64`), one or the other.
//! | `POST /reset`    | none                                   | `{"restored_params", "edits_total"}`     |
//! | `POST /save`     | `{"dir"}`                              | `{"dir", "edits_total"}`                 |
//! | `GET /health`    |                                        | `{"status": "ok", ...}`                  |
//! | `GET /memory`    |                                        | per-device figures                       |
//!
//! `/edit` commits under the same guard as `dualedit edit` ([`ServeOptions::guard`], on by
//! default); its body may carry `"guard": false | true | {"min_agreement", "max_drop",
//! "max_kl", "refuse", "shrink"}` to change it for that request, and its answer lists the
//! guard's decisions (`guard`) and the settings they were made under (`guard_settings`).
//!
//! Errors are JSON `{"error": message, "kind": ...}`: 400 malformed JSON or a missing /
//! mistyped / unknown / out-of-range field (named), a bad upload or a named image that is
//! not a regular file there or does not decode (truncated, over 200:1, too many tokens
//! with the text), a NUL byte in a path, 401 a missing or wrong bearer token, 403 a
//! `/save` or an image path the server does not allow (no save or image root, or a path
//! that leaves it), 404 unknown route, 405 wrong method, 408 a body not sent within the
//! body timeout, 413 body too large, 422 a well-formed request the model refuses (a
//! prompt longer than its context, an edit without an editor), 503 queue full, too many
//! clients stalled mid-body, or shutting down, 500 a failure on the server's side. Which
//! is which is decided by `Failure`: an error about a file the request named is the
//! client's, anything else from the model's side is the server's. A message names only
//! what the client sent (its relative path, its field); a 500 says only its kind, and the
//! details (paths, libtorch messages) go to the log.
//!
//! Security: anyone who can reach the port can edit the model, read its scores and, with a
//! save root, write model folders. So by default the server listens on loopback only,
//! `/save` is refused unless a save root is given (and then writes only inside it, see
//! [`crate::io::resolve_under`]), images are read by path only under the image root by
//! the same rule (`image`, and E-VQA requests' `image` / `image_rephrase` / `m_loc`; a
//! `*_base64` upload is decoded and checked in memory, then written to a private
//! temporary file for the preprocessor and removed after the request), and with a token every request must carry
//! `Authorization: Bearer <token>`; a non-loopback address without a token is refused
//! unless [`ServeOptions::insecure_no_token`] says otherwise.
//!
//! Threads: two acceptors answer what needs no body (health, memory, 401/404/405) and pass
//! model routes' requests to a few workers through a bounded queue (503 when full), so
//! `/health` answers even while every worker waits on a slow client. Workers read, parse
//! and validate bodies (every other 4xx); model requests go into one bounded queue that
//! the model thread (the caller of [`Server::run`], which owns the session) runs in order
//! and answers. A body that does not arrive within the body timeout is answered 408 and
//! frees its worker (a thread of its own keeps the slow connection). Workers never wait on
//! the model, so a full queue is answered 503 at once instead of letting waits grow
//! without bound; a request that waited longer than the queue timeout is answered 503
//! without running.
mod failure;
mod options;
mod request;
pub mod signals;

use std::io::Read;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use crossbeam::channel::{bounded, Receiver, RecvTimeoutError, Sender, TrySendError};
use serde::Serialize;
use serde_json::{json, Value};
use tiny_http::{Header, Method, Request, Response};
use tracing::{info, warn};

use crate::device::DevicePlan;
use crate::edit::session::{device_memory, Session};
use crate::mend::guard::GuardConfig;
use crate::{Error, Result};
use failure::Failure;
pub use options::{ServeOptions, DEFAULT_LISTEN, DEFAULT_MAX_NEW_TOKENS};
use request::{parse_op, ClientPaths, Op, RequestImage};


/// The environment variable `dualedit serve` reads its token from when `--token` is not
/// given (a flag is visible to every user of the machine in the process list).
pub const TOKEN_ENV: &str = "DUALEDIT_TOKEN";

/// Counts of what a server answered, returned when it stops.
#[derive(Debug, Clone, Default, Serialize, PartialEq, Eq)]
pub struct ServeStats {
    pub requests: u64,
    /// Requests the model thread ran.
    pub model_requests: u64,
    pub ok: u64,
    pub client_errors: u64,
    pub server_errors: u64,
    /// 503s because the queue was full.
    pub rejected_queue_full: u64,
}

#[derive(Default)]
struct Counters {
    requests: AtomicU64,
    model_requests: AtomicU64,
    ok: AtomicU64,
    client_errors: AtomicU64,
    server_errors: AtomicU64,
    rejected_queue_full: AtomicU64,
}

impl Counters {
    fn count(&self, status: u16) {
        let c = match status {
            200..=299 => &self.ok,
            400..=499 => &self.client_errors,
            _ => &self.server_errors,
        };
        c.fetch_add(1, Ordering::Relaxed);
    }

    fn snapshot(&self) -> ServeStats {
        let g = |a: &AtomicU64| a.load(Ordering::Relaxed);
        ServeStats {
            requests: g(&self.requests),
            model_requests: g(&self.model_requests),
            ok: g(&self.ok),
            client_errors: g(&self.client_errors),
            server_errors: g(&self.server_errors),
            rejected_queue_full: g(&self.rejected_queue_full),
        }
    }
}

/// A bound HTTP listener, not yet serving (bind first to learn the port of `:0`).
pub struct Server {
    http: tiny_http::Server,
    addr: SocketAddr,
    opts: ServeOptions,
}

impl Server {
    /// Binds `listen` (`host:port`; port 0 picks a free one). A non-loopback address is
    /// refused without a token unless `opts.insecure_no_token`; the save root must be an
    /// existing directory; a token must be printable ASCII without spaces (it travels in a
    /// header). All of it is checked before the port is taken.
    pub fn bind(listen: &str, opts: ServeOptions) -> Result<Self> {
        let addr: SocketAddr = listen
            .parse()
            .map_err(|e| Error::input(format!("`listen` {listen:?} is not an address like 127.0.0.1:8470: {e}")))?;
        if opts.queue == 0 || opts.workers == 0 || opts.max_body_bytes == 0 {
            return Err(Error::input("the queue bound, worker count and maximum body size must be at least 1"));
        }
        if let Some(g) = &opts.guard {
            g.validate()?;
        }
        if let Some(t) = &opts.token {
            if t.is_empty() || !t.bytes().all(|b| b.is_ascii_graphic()) {
                return Err(Error::input(format!("the token (`token` or {TOKEN_ENV}) must be non-empty printable ASCII without spaces")));
            }
        }
        if !addr.ip().is_loopback() {
            match (&opts.token, opts.insecure_no_token) {
                (None, false) => {
                    return Err(Error::input(format!(
                        "refusing to listen on {addr} without a token: anyone who can reach it could edit, read and save the model; \
                         give `token` (or {TOKEN_ENV}), or `insecure_no_token`=true to run open anyway"
                    )))
                }
                (None, true) => warn!(%addr, "listening beyond loopback without a token: anyone who can reach this address can use the model"),
                (Some(_), _) => warn!(%addr, "listening beyond loopback without TLS: the token and requests travel in clear text (use a TLS proxy or an SSH tunnel)"),
            }
        }
        if let Some(root) = &opts.save_root {
            if !root.is_dir() {
                return Err(Error::file(root, "`save_root` must be an existing directory"));
            }
        }
        if let Some(root) = &opts.image_root {
            if !root.is_dir() {
                return Err(Error::file(root, "`image_root` must be an existing directory"));
            }
        }
        let http = tiny_http::Server::http(addr).map_err(|e| Error::input(format!("cannot listen on {addr}: {e}")))?;
        let addr = http.server_addr().to_ip().ok_or_else(|| Error::input(format!("{addr} is not an IP listener")))?;
        Ok(Self { http, addr, opts })
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Serves until `shutdown` becomes true (a signal handler sets it), then finishes the
    /// model request in flight, answers those still queued with 503, and returns. The
    /// calling thread becomes the model thread: the session never leaves it.
    pub fn run(self, mut session: Session, shutdown: &AtomicBool) -> Result<ServeStats> {
        crate::device::settle_threads();
        let (tx, rx) = bounded::<Job>(self.opts.queue);
        session.guard = self.opts.guard.clone();
        let shared = Shared {
            opts: &self.opts,
            counters: Counters::default(),
            health: Health::of(&session, &self.opts),
            plan: session.engine().plan,
            edits_total: AtomicUsize::new(session.edits_total()),
            body_readers: Default::default(),
            tx,
            hidden: hidden_paths(&session, &self.opts),
        };
        info!(addr = %self.addr, queue = self.opts.queue, workers = self.opts.workers, guard = ?self.opts.guard, "serving on http://{}", self.addr);
        // Requests accepted but not yet taken by a worker: at most `queue`, more are 503.
        let (to_workers, from_acceptors) = bounded::<Request>(self.opts.queue);
        std::thread::scope(|scope| {
            let acceptors: Vec<_> = (0..ACCEPTORS).map(|_| scope.spawn(|| acceptor(&self.http, &shared, &to_workers, shutdown))).collect();
            let workers: Vec<_> = (0..self.opts.workers).map(|_| scope.spawn(|| worker(&from_acceptors, &shared, shutdown))).collect();
            model_loop(&mut session, &rx, &shared, shutdown);
            info!("shutting down: the request in flight is finished, queued ones are answered 503");
            for w in acceptors.into_iter().chain(workers) {
                if w.join().is_err() {
                    warn!("an HTTP thread panicked");
                }
            }
            while let Ok(request) = from_acceptors.try_recv() {
                respond(&shared, request, 503, error_body("server is shutting down", "shutting_down"));
            }
            while let Ok(job) = rx.try_recv() {
                respond(&shared, job.request, 503, error_body("server is shutting down", "shutting_down"));
            }
        });
        let stats = shared.counters.snapshot();
        info!(?stats, "stopped");
        Ok(stats)
    }
}

/// Threads that accept requests and answer those that need no body (see [`acceptor`]).
const ACCEPTORS: usize = 2;

/// What workers and the model thread share.
struct Shared<'a> {
    opts: &'a ServeOptions,
    counters: Counters,
    health: Health,
    plan: DevicePlan,
    edits_total: AtomicUsize,
    /// Body reader threads running ([`body_within`]), shared with them.
    body_readers: std::sync::Arc<AtomicUsize>,
    tx: Sender<Job>,
    /// The server's own folders, as they may appear in a library message, with what a
    /// client is told instead (see [`Shared::scrub`]).
    hidden: Vec<(String, &'static str)>,
}

impl Shared<'_> {
    /// `msg` without the server's folders (image and save roots, the temporary directory):
    /// a client error names what the client sent, never where it is on the server.
    fn scrub(&self, msg: &str) -> String {
        let mut out = msg.to_string();
        for (server, shown) in &self.hidden {
            out = out.replace(server.as_str(), shown);
        }
        out
    }
}

/// The folders [`Shared::scrub`] hides, as given and canonical, longest first.
fn hidden_paths(session: &Session, opts: &ServeOptions) -> Vec<(String, &'static str)> {
    let mut out = Vec::new();
    let mut add = |p: &Path, shown: &'static str| {
        for q in [Some(p.to_path_buf()), p.canonicalize().ok()].into_iter().flatten() {
            let q = q.display().to_string();
            if q.len() > 1 {
                out.push((q, shown));
            }
        }
    };
    if let Some(r) = &opts.image_root {
        add(r, "<image root>");
    }
    if let Some(r) = &opts.save_root {
        add(r, "<save root>");
    }
    add(&std::env::temp_dir(), "<tmp>");
    add(session.model_dir(), "<model>");
    if let Some(d) = session.editor_dir() {
        add(d, "<editor>");
    }
    out.sort_by_key(|(s, _)| std::cmp::Reverse(s.len()));
    out
}

/// The static part of `/health`, computed once.
#[derive(Serialize)]
struct Health {
    model: String,
    architecture: String,
    editor: Option<String>,
    max_positions: usize,
    devices: Vec<String>,
    queue_capacity: usize,
}

impl Health {
    fn of(s: &Session, opts: &ServeOptions) -> Self {
        let plan = s.engine().plan;
        let mut devices = vec![crate::device::memory::device_name(plan.main)];
        if plan.split {
            devices.push(crate::device::memory::device_name(plan.sub));
        }
        Self {
            model: s.model_dir().display().to_string(),
            architecture: s.info().architecture,
            editor: s.editor_dir().map(|d| d.display().to_string()),
            max_positions: s.max_positions(),
            devices,
            queue_capacity: opts.queue,
        }
    }
}

impl Failure {
    /// Classifies a library error of a request whose files are `paths`: an error about one
    /// of the request's files is the client's (`file_status`: 400 for images, 422 for a
    /// save folder the server cannot write), input the model refuses is 422, running out
    /// of memory is 500 `out_of_memory` (its message names no path), and anything else
    /// (the model's own files, libtorch) is 500 `internal`.
    /// Library messages pass through [`ClientPaths::redact`] and [`Shared::scrub`]: they
    /// may name the server's own paths.
    fn of(e: Error, paths: &ClientPaths, file_status: u16, shared: &Shared) -> Self {
        let file_kind = if file_status == 400 { "bad_request" } else { "invalid_input" };
        let clean = |m: &str| shared.scrub(&paths.redact(m));
        match &e {
            Error::File { path, msg } => match paths.name_of(path) {
                Some(name) => Failure::Client { status: file_status, kind: file_kind, msg: format!("{name}: {}", clean(msg)) },
                None => Failure::internal(e.to_string()),
            },
            Error::Io { path, err } => match paths.name_of(path) {
                Some(name) => Failure::Client { status: file_status, kind: file_kind, msg: format!("{name}: {}", clean(&err.to_string())) },
                None => Failure::internal(e.to_string()),
            },
            Error::Input(m) => Failure::Client { status: 422, kind: "invalid_input", msg: clean(m) },
            Error::OutOfMemory(m) => Failure::Internal { kind: "out_of_memory", public: format!("out of memory: {m}"), detail: e.to_string() },
            Error::Device { .. } | Error::Torch(_) | Error::Internal(_) => Failure::internal(e.to_string()),
        }
    }

    /// The response; an internal failure is logged with its details first.
    fn reply(self) -> Reply {
        match self {
            Failure::Client { status, kind, msg } => (status, error_body(msg, kind)),
            Failure::Internal { kind, public, detail } => {
                tracing::error!(kind, "{detail}");
                (500, error_body(public, kind))
            }
        }
    }
}

struct Job {
    op: Op,
    /// The request's files under the client's names, for its errors.
    paths: ClientPaths,
    request: Request,
    enqueued: Instant,
}


/// A response before it is written: status and JSON body.
type Reply = (u16, Value);

fn error_body(msg: impl Into<String>, kind: &str) -> Value {
    json!({ "error": msg.into(), "kind": kind })
}

fn json_header() -> Header {
    Header::from_bytes(&b"Content-Type"[..], &b"application/json"[..]).expect("static header is valid")
}

fn respond(shared: &Shared, request: Request, status: u16, body: Value) {
    shared.counters.count(status);
    let mut response = Response::from_string(body.to_string()).with_status_code(status).with_header(json_header());
    if status == 405 {
        let allow = allowed_method(request.url()).unwrap_or("GET");
        if let Ok(h) = Header::from_bytes(&b"Allow"[..], allow.as_bytes()) {
            response.add_header(h);
        }
    }
    if status == 401 {
        if let Ok(h) = Header::from_bytes(&b"WWW-Authenticate"[..], &br#"Bearer realm="dualedit""#[..]) {
            response.add_header(h);
        }
    }
    // The client may have gone; nothing to do about it here.
    let _ = request.respond(response);
}

const MODEL_ROUTES: [&str; 5] = ["/edit", "/score", "/generate", "/reset", "/save"];
const READ_ROUTES: [&str; 2] = ["/health", "/memory"];

fn route_path(url: &str) -> &str {
    url.split(['?', '#']).next().unwrap_or(url)
}

/// The method a known route takes, `None` for an unknown route.
fn allowed_method(url: &str) -> Option<&'static str> {
    let path = route_path(url);
    if MODEL_ROUTES.contains(&path) {
        Some("POST")
    } else if READ_ROUTES.contains(&path) {
        Some("GET")
    } else {
        None
    }
}

/// Accepts requests and answers at once everything that needs neither the body nor the
/// model (401, 404, 405, `/health`, `/memory`); a model route's request goes to the
/// workers that read and check bodies, or is answered 503 when `queue` requests already
/// wait for one. An
/// acceptor never reads a body or opens a file, so `/health` answers while every worker
/// is stuck on a slow client.
fn acceptor(http: &tiny_http::Server, shared: &Shared, to_workers: &Sender<Request>, shutdown: &AtomicBool) {
    while !shutdown.load(Ordering::SeqCst) {
        let request = match http.recv_timeout(Duration::from_millis(100)) {
            Ok(Some(r)) => r,
            Ok(None) => continue,
            Err(e) => {
                warn!(error = %e, "accepting a connection failed");
                std::thread::sleep(Duration::from_millis(100));
                continue;
            }
        };
        shared.counters.requests.fetch_add(1, Ordering::Relaxed);
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| route(request, shared, to_workers)));
        if r.is_err() {
            shared.counters.count(500);
            warn!("routing a request panicked");
        }
    }
}

/// Reads, parses and checks model requests' bodies and queues them for the model thread.
fn worker(from_acceptors: &Receiver<Request>, shared: &Shared, shutdown: &AtomicBool) {
    while !shutdown.load(Ordering::SeqCst) {
        let request = match from_acceptors.recv_timeout(Duration::from_millis(100)) {
            Ok(r) => r,
            Err(RecvTimeoutError::Timeout) => continue,
            Err(RecvTimeoutError::Disconnected) => return,
        };
        // A bug in request handling must not take a worker down with it; the dropped
        // request is answered 500 by tiny_http.
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| handle_model_request(request, shared)));
        if r.is_err() {
            shared.counters.count(500);
            warn!("handling a request panicked");
        }
    }
}

/// Why a request is not authorised, or `None` when it is (or no token is required).
fn unauthorised(request: &Request, token: Option<&str>) -> Option<&'static str> {
    let token = token?;
    let given = request.headers().iter().find(|h| h.field.equiv("Authorization")).map(|h| h.value.as_str());
    let Some(given) = given else { return Some("this server needs `Authorization: Bearer <token>`") };
    // The scheme is case-insensitive (RFC 7235); the token is compared exactly.
    let bearer = given.get(..7).filter(|s| s.eq_ignore_ascii_case("bearer ")).map(|_| given[7..].trim());
    match bearer {
        Some(b) if same_token(b.as_bytes(), token.as_bytes()) => None,
        Some(_) => Some("wrong bearer token"),
        None => Some("the Authorization header must be `Bearer <token>`"),
    }
}

/// Whether `given` equals `expected`, in a time that depends on `expected`'s length only,
/// never on where the two first differ: a byte-by-byte comparison that stops early would
/// let a client find the token one byte at a time from response times.
fn same_token(given: &[u8], expected: &[u8]) -> bool {
    let mut diff = u8::from(given.len() != expected.len());
    for (i, e) in expected.iter().enumerate() {
        diff |= given.get(i).copied().unwrap_or(0) ^ e;
        // Keeps the optimiser from turning the loop into an early exit.
        diff = std::hint::black_box(diff);
    }
    diff == 0
}

/// Routes one request: answers it here, or passes a model route's request to a worker.
fn route(request: Request, shared: &Shared, to_workers: &Sender<Request>) {
    // Before anything else, so that a client without the token learns nothing, not even
    // which routes exist.
    if let Some(why) = unauthorised(&request, shared.opts.token.as_deref()) {
        return respond(shared, request, 401, error_body(why, "unauthorized"));
    }
    let path = route_path(request.url()).to_string();
    let Some(allowed) = allowed_method(&path) else {
        return respond(shared, request, 404, error_body(format!("no route {path}; routes: POST {}, GET {}", MODEL_ROUTES.join(" "), READ_ROUTES.join(" ")), "not_found"));
    };
    let method_ok = matches!((request.method(), allowed), (Method::Post, "POST") | (Method::Get, "GET"));
    if !method_ok {
        let msg = format!("{path} takes {allowed}, not {}", request.method());
        return respond(shared, request, 405, error_body(msg, "method_not_allowed"));
    }
    match path.as_str() {
        "/health" => {
            let mut body = serde_json::to_value(&shared.health).unwrap_or_default();
            body["status"] = json!("ok");
            body["edits_total"] = json!(shared.edits_total.load(Ordering::Relaxed));
            body["queue_waiting"] = json!(shared.tx.len());
            body["workers_waiting"] = json!(to_workers.len());
            body["body_readers"] = json!(shared.body_readers.load(Ordering::Relaxed));
            respond(shared, request, 200, body)
        }
        "/memory" => match device_memory(&shared.plan) {
            Ok(devices) => respond(shared, request, 200, json!({ "devices": devices })),
            Err(e) => {
                let (status, body) = Failure::of(e, &ClientPaths::default(), 500, shared).reply();
                respond(shared, request, status, body)
            }
        },
        _ => match to_workers.try_send(request) {
            Ok(()) => {}
            Err(TrySendError::Full(request)) => {
                shared.counters.rejected_queue_full.fetch_add(1, Ordering::Relaxed);
                let msg = format!("queue full: {} requests are already waiting for a worker to read them; retry later", shared.opts.queue);
                respond(shared, request, 503, error_body(msg, "queue_full"))
            }
            Err(TrySendError::Disconnected(request)) => respond(shared, request, 503, error_body("server is shutting down", "shutting_down")),
        },
    }
}

/// Reader threads that may wait on clients that stalled mid-body at once; beyond them a
/// model request is answered 503 before its body is read.
pub const MAX_BODY_READERS: usize = 64;

/// Reads and checks a model route's body, then queues it for the model thread.
fn handle_model_request(request: Request, shared: &Shared) {
    let path = route_path(request.url()).to_string();
    let Some((request, body)) = body_within(request, shared) else { return };
    let parsed = body.and_then(|body| parse_op(&path, &body, shared.opts).map_err(|f| f.reply()));
    let (op, paths) = match parsed {
        Ok(op) => op,
        Err((status, body)) => return respond(shared, request, status, body),
    };
    match shared.tx.try_send(Job { op, paths, request, enqueued: Instant::now() }) {
        Ok(()) => {}
        Err(TrySendError::Full(job)) => {
            shared.counters.rejected_queue_full.fetch_add(1, Ordering::Relaxed);
            let msg = format!("queue full: {} model requests are already waiting; retry later", shared.opts.queue);
            respond(shared, job.request, 503, error_body(msg, "queue_full"))
        }
        Err(TrySendError::Disconnected(job)) => respond(shared, job.request, 503, error_body("server is shutting down", "shutting_down")),
    }
}

/// The request's body ([`read_body`]), read on a thread of its own for at most the body
/// timeout. A client that stalls longer is answered 408 (`None`: nothing more to do): its
/// reader thread keeps the connection until the client sends the rest or goes, then
/// answers it 408 itself, and the worker is free at once. When [`MAX_BODY_READERS`] such
/// threads already wait, the request is answered 503 without reading it.
fn body_within(request: Request, shared: &Shared) -> Option<(Request, std::result::Result<Vec<u8>, Reply>)> {
    let readers = &shared.body_readers;
    if readers.fetch_add(1, Ordering::SeqCst) >= MAX_BODY_READERS {
        readers.fetch_sub(1, Ordering::SeqCst);
        let msg = format!("{MAX_BODY_READERS} clients are already sending their bodies too slowly; retry later");
        respond(shared, request, 503, error_body(msg, "slow_clients"));
        return None;
    }
    let (tx, rx) = bounded(1);
    let (max, timeout, counter) = (shared.opts.max_body_bytes, shared.opts.body_timeout, readers.clone());
    let spawned = std::thread::Builder::new().name("body-reader".into()).spawn(move || {
        let mut request = request;
        let body = read_body(&mut request, max);
        if let Err(crossbeam::channel::SendError((request, _))) = tx.send((request, body)) {
            // The worker gave up on this client: answer it now that it has sent (or gone).
            let msg = format!("the request body did not arrive within {} s", timeout.as_secs_f64());
            let _ = request.respond(Response::from_string(error_body(msg, "timeout").to_string()).with_status_code(408).with_header(json_header()));
        }
        counter.fetch_sub(1, Ordering::SeqCst);
    });
    if let Err(e) = spawned {
        readers.fetch_sub(1, Ordering::SeqCst);
        warn!(error = %e, "cannot start a thread to read a request body");
        // The request went with the closure that could not run: tiny_http answers 500
        // when it is dropped.
        shared.counters.count(500);
        return None;
    }
    match rx.recv_timeout(timeout) {
        Ok(got) => Some(got),
        Err(_) => {
            shared.counters.count(408);
            warn!(seconds = timeout.as_secs_f64(), "a client did not send its request body in time: answered 408 when it sends or goes");
            None
        }
    }
}

/// The body, refused with 413 beyond `max` bytes (by its declared length when it has one,
/// without reading it).
fn read_body(request: &mut Request, max: usize) -> std::result::Result<Vec<u8>, Reply> {
    let too_large = || (413, error_body(format!("request body is larger than the limit of {max} bytes"), "too_large"));
    if request.body_length().is_some_and(|n| n > max) {
        return Err(too_large());
    }
    let mut body = Vec::new();
    request
        .as_reader()
        .take(max as u64 + 1)
        .read_to_end(&mut body)
        .map_err(|e| (400, error_body(format!("cannot read the request body: {e}"), "bad_request")))?;
    if body.len() > max {
        return Err(too_large());
    }
    Ok(body)
}


fn model_loop(session: &mut Session, rx: &Receiver<Job>, shared: &Shared, shutdown: &AtomicBool) {
    while !shutdown.load(Ordering::SeqCst) {
        let job = match rx.recv_timeout(Duration::from_millis(50)) {
            Ok(j) => j,
            Err(RecvTimeoutError::Timeout) => continue,
            Err(RecvTimeoutError::Disconnected) => return,
        };
        if job.enqueued.elapsed() > shared.opts.queue_timeout {
            let msg = format!("timed out after waiting {:.0} s in the queue", job.enqueued.elapsed().as_secs_f64());
            respond(shared, job.request, 503, error_body(msg, "timeout"));
            continue;
        }
        shared.counters.model_requests.fetch_add(1, Ordering::Relaxed);
        let paths = job.paths;
        let (status, body) = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| run_op(session, job.op, &paths, shared)))
            .unwrap_or_else(|_| Failure::internal("a request panicked in the model thread").reply());
        shared.edits_total.store(session.edits_total(), Ordering::Relaxed);
        respond(shared, job.request, status, body);
    }
}

fn run_op(session: &mut Session, op: Op, paths: &ClientPaths, shared: &Shared) -> Reply {
    // A save folder the server cannot write is the caller's choice to fix (422); an image
    // that fails to decode is the client's (400).
    let file_status = if matches!(op, Op::Save { .. }) { 422 } else { 400 };
    match run_session_op(session, op, paths) {
        Ok(v) => (200, v),
        Err(e) => {
            let out_of_memory = matches!(e, Error::OutOfMemory(_));
            let (status, mut body) = Failure::of(e, paths, file_status, shared).reply();
            if out_of_memory {
                // What was in use when it ran out, to size the next attempt.
                body["memory"] = session.memory().map(|m| json!(m)).unwrap_or(Value::Null);
            }
            (status, body)
        }
    }
}

fn to_json<T: Serialize>(v: T) -> Result<Value> {
    serde_json::to_value(v).map_err(|e| Error::Torch(format!("cannot serialise the response: {e}")))
}

/// An edit under `guard` (the session's guard is set for this call only); the response
/// carries the settings it ran under as `guard_settings` (`null`: unguarded) next to the
/// guard's decisions (`guard`, one per committed edit, as `edit --json` reports them).
fn guarded_edit(session: &mut Session, guard: Option<GuardConfig>, f: impl FnOnce(&mut Session) -> Result<crate::edit::session::EditOutcome>) -> Result<Value> {
    let settings = to_json(&guard)?;
    let previous = std::mem::replace(&mut session.guard, guard);
    let out = f(session);
    session.guard = previous;
    let mut v = to_json(out?)?;
    v["guard_settings"] = settings;
    Ok(v)
}

fn run_session_op(session: &mut Session, op: Op, paths: &ClientPaths) -> Result<Value> {
    match op {
        Op::Edit { records, guard } => guarded_edit(session, guard, |s| s.edit(&records)),
        Op::EditImages { records, guard, _uploads } => guarded_edit(session, guard, |s| s.edit_images(&records)),
        Op::Score { text, image: None } => to_json(session.score(&text)?),
        Op::Score { text, image: Some(RequestImage::File(p)) } => to_json(session.score_image(&text, Some(&p))?),
        Op::Score { text, image: Some(RequestImage::Upload(t)) } => to_json(session.score_image(&text, Some(t.path()))?),
        Op::Generate { prompt, max_new_tokens, image: None } => to_json(session.generate(&prompt, max_new_tokens)?),
        Op::Generate { prompt, max_new_tokens, image: Some(RequestImage::File(p)) } => to_json(session.generate_image(&prompt, Some(&p), max_new_tokens)?),
        Op::Generate { prompt, max_new_tokens, image: Some(RequestImage::Upload(t)) } => {
            to_json(session.generate_image(&prompt, Some(t.path()), max_new_tokens)?)
        }
        Op::Reset => {
            let n = session.reset()?;
            Ok(json!({ "restored_params": n, "edits_total": session.edits_total() }))
        }
        Op::Save { dir } => {
            session.save(&dir)?;
            // The folder as the client named it, not where it is on the server.
            let name = paths.name_of(&dir).unwrap_or_default();
            Ok(json!({ "dir": name, "edits_total": session.edits_total() }))
        }
    }
}
