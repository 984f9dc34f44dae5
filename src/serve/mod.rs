//! `dualedit serve`: a [`Session`]'s operations as JSON over HTTP, for programs that use
//! dualedit as their editing backend.
//!
//! | route            | body                                   | answer                                   |
//! |------------------|----------------------------------------|------------------------------------------|
//! | `POST /edit`     | `{"requests": [EasyEdit records]}`     | per-request metrics, summary             |
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
//! Errors are JSON `{"error": message, "kind": ...}`: 400 malformed JSON or a missing /
//! mistyped / unknown field (named), a bad `image_base64` or a named image that is not
//! there, 401 a missing or wrong bearer token, 403 a `/save` or an image path the server
//! does not allow (no save or image root, or a path that leaves it), 404 unknown route,
//! 405 wrong method, 413 body too large, 422 a well-formed request the model refuses (a
//! prompt longer than its context, an edit without an editor), 503 queue full or shutting
//! down, 500 anything else.
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
//! Threads: a few HTTP workers read, parse and validate requests and answer those that
//! need no model (health, memory, every 4xx); model requests go into one bounded queue
//! that the model thread (the caller of [`Server::run`], which owns the session) runs in
//! order and answers. Workers never wait on the model, so a full queue is answered 503 at
//! once instead of letting waits grow without bound; a request that waited longer than
//! the queue timeout is answered 503 without running.
pub mod signals;

use std::io::Read;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use crossbeam::channel::{bounded, Receiver, RecvTimeoutError, Sender, TrySendError};
use serde::Serialize;
use serde_json::{json, Map, Value};
use tiny_http::{Header, Method, Request, Response};
use tracing::{info, warn};

use crate::data::easyedit::{parse_records, DatasetKind, EditRecord};
use crate::data::multimodal::{confine_images, ImageRoots, MmRecord, IMAGE_KEYS};
use crate::device::DevicePlan;
use crate::edit::session::{device_memory, image_kind, read_image_requests, Session, TempImage};
use crate::{Error, Result};

/// The address `serve` listens on unless told otherwise: loopback only.
pub const DEFAULT_LISTEN: &str = "127.0.0.1:8470";

/// Limits and sizes of the service.
#[derive(Debug, Clone)]
pub struct ServeOptions {
    /// Model requests waiting beyond the one running; more are answered 503.
    pub queue: usize,
    /// HTTP worker threads (parsing, validation, health, memory).
    pub workers: usize,
    /// Largest request body accepted; larger ones are answered 413.
    pub max_body_bytes: usize,
    /// A model request that waited longer than this is answered 503 without running.
    pub queue_timeout: Duration,
    /// The existing directory `/save` writes into, at relative paths that stay inside it;
    /// `None` (the default) refuses `/save` with 403, since otherwise any client could
    /// write model folders wherever the process can.
    pub save_root: Option<PathBuf>,
    /// The existing directory that request image paths (`/score`'s `image`, E-VQA edit
    /// requests' images) are relative to and confined to; `None` (the default) refuses
    /// image paths with 403, so a client cannot make the server read arbitrary files.
    /// `image_base64` needs no root.
    pub image_root: Option<PathBuf>,
    /// When set, every request must carry `Authorization: Bearer <token>` (401 otherwise).
    pub token: Option<String>,
    /// Allows a non-loopback address without a token (refused otherwise).
    pub insecure_no_token: bool,
}

impl Default for ServeOptions {
    fn default() -> Self {
        Self {
            queue: 64,
            workers: 4,
            max_body_bytes: 1 << 20,
            queue_timeout: Duration::from_secs(60),
            save_root: None,
            image_root: None,
            token: None,
            insecure_no_token: false,
        }
    }
}

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
            .map_err(|e| Error::input(format!("--listen {listen:?} is not an address like 127.0.0.1:8470: {e}")))?;
        if opts.queue == 0 || opts.workers == 0 || opts.max_body_bytes == 0 {
            return Err(Error::input("the queue bound, worker count and maximum body size must be at least 1"));
        }
        if let Some(t) = &opts.token {
            if t.is_empty() || !t.bytes().all(|b| b.is_ascii_graphic()) {
                return Err(Error::input(format!("the token (--token or {TOKEN_ENV}) must be non-empty printable ASCII without spaces")));
            }
        }
        if !addr.ip().is_loopback() {
            match (&opts.token, opts.insecure_no_token) {
                (None, false) => {
                    return Err(Error::input(format!(
                        "refusing to listen on {addr} without a token: anyone who can reach it could edit, read and save the model; \
                         give --token (or {TOKEN_ENV}), or --insecure-no-token to run open anyway"
                    )))
                }
                (None, true) => warn!(%addr, "listening beyond loopback without a token: anyone who can reach this address can use the model"),
                (Some(_), _) => warn!(%addr, "listening beyond loopback without TLS: the token and requests travel in clear text (use a TLS proxy or an SSH tunnel)"),
            }
        }
        if let Some(root) = &opts.save_root {
            if !root.is_dir() {
                return Err(Error::file(root, "--save-root must be an existing directory"));
            }
        }
        if let Some(root) = &opts.image_root {
            if !root.is_dir() {
                return Err(Error::file(root, "--image-root must be an existing directory"));
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
        let (tx, rx) = bounded::<Job>(self.opts.queue);
        let shared = Shared {
            opts: &self.opts,
            counters: Counters::default(),
            health: Health::of(&session, &self.opts),
            plan: session.engine().plan,
            edits_total: AtomicUsize::new(session.edits_total()),
            tx,
        };
        info!(addr = %self.addr, queue = self.opts.queue, workers = self.opts.workers, "serving on http://{}", self.addr);
        std::thread::scope(|scope| {
            let workers: Vec<_> = (0..self.opts.workers)
                .map(|_| scope.spawn(|| worker(&self.http, &shared, shutdown)))
                .collect();
            model_loop(&mut session, &rx, &shared, shutdown);
            info!("shutting down: the request in flight is finished, queued ones are answered 503");
            for w in workers {
                if w.join().is_err() {
                    warn!("an HTTP worker panicked");
                }
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

/// What workers and the model thread share.
struct Shared<'a> {
    opts: &'a ServeOptions,
    counters: Counters,
    health: Health,
    plan: DevicePlan,
    edits_total: AtomicUsize,
    tx: Sender<Job>,
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

/// A model request, parsed and validated by a worker.
enum Op {
    Edit(Vec<EditRecord>),
    /// E-VQA requests, their images confined to the image root and checked readable.
    /// The uploads' temporary files live until the edit has run.
    EditImages { records: Vec<MmRecord>, _uploads: Vec<TempImage> },
    Score { text: String, image: Option<RequestImage> },
    Generate { prompt: String, max_new_tokens: usize, image: Option<RequestImage> },
    Reset,
    Save { dir: PathBuf },
}

/// The image of a `/score` or `/generate` request.
enum RequestImage {
    /// A file under the image root, resolved and confined.
    File(PathBuf),
    /// A decoded `image_base64` upload, checked to be a PNG or JPEG.
    Bytes(Vec<u8>),
}

struct Job {
    op: Op,
    request: Request,
    enqueued: Instant,
}

/// Default of `/generate`'s `max_new_tokens`.
pub const DEFAULT_MAX_NEW_TOKENS: usize = 16;

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

fn worker(http: &tiny_http::Server, shared: &Shared, shutdown: &AtomicBool) {
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
        // A bug in request handling must not take a worker down with it; the dropped
        // request is answered 500 by tiny_http.
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| handle(request, shared)));
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

/// Routes one request: answers it here, or queues it for the model thread.
fn handle(mut request: Request, shared: &Shared) {
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
            respond(shared, request, 200, body)
        }
        "/memory" => match device_memory(&shared.plan) {
            Ok(devices) => respond(shared, request, 200, json!({ "devices": devices })),
            Err(e) => respond(shared, request, 500, error_body(e.to_string(), "internal")),
        },
        _ => {
            let op = match read_body(&mut request, shared.opts.max_body_bytes).and_then(|body| parse_op(&path, &body, shared.opts)) {
                Ok(op) => op,
                Err((status, body)) => return respond(shared, request, status, body),
            };
            match shared.tx.try_send(Job { op, request, enqueued: Instant::now() }) {
                Ok(()) => {}
                Err(TrySendError::Full(job)) => {
                    shared.counters.rejected_queue_full.fetch_add(1, Ordering::Relaxed);
                    let msg = format!("queue full: {} model requests are already waiting; retry later", shared.opts.queue);
                    respond(shared, job.request, 503, error_body(msg, "queue_full"))
                }
                Err(TrySendError::Disconnected(job)) => {
                    respond(shared, job.request, 503, error_body("server is shutting down", "shutting_down"))
                }
            }
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

/// The body as a JSON object with only the `allowed` keys. Fields are then read one by
/// one, so that every 400 names the field at fault.
fn json_object(path: &str, body: &[u8], allowed: &[&str]) -> std::result::Result<Map<String, Value>, Reply> {
    let bad = |msg: String| (400, error_body(format!("{path}: {msg}"), "bad_request"));
    let value: Value = serde_json::from_slice(body).map_err(|e| bad(format!("malformed JSON: {e}")))?;
    let Value::Object(obj) = value else {
        return Err(bad(format!("the body must be a JSON object with the fields {}", allowed.join(", "))));
    };
    if let Some(k) = obj.keys().find(|k| !allowed.contains(&k.as_str())) {
        return Err(bad(format!("unknown field `{k}` (expected: {})", allowed.join(", "))));
    }
    Ok(obj)
}

fn field<'a>(path: &str, obj: &'a Map<String, Value>, name: &str) -> std::result::Result<&'a Value, Reply> {
    obj.get(name).ok_or_else(|| (400, error_body(format!("{path}: missing field `{name}`"), "bad_request")))
}

fn string_field(path: &str, obj: &Map<String, Value>, name: &str) -> std::result::Result<String, Reply> {
    field(path, obj, name)?
        .as_str()
        .map(str::to_string)
        .ok_or_else(|| (400, error_body(format!("{path}: field `{name}` must be a string"), "bad_request")))
}

/// Parses and validates a model request's body (all 400s are decided here).
fn parse_op(path: &str, body: &[u8], opts: &ServeOptions) -> std::result::Result<Op, Reply> {
    let bad = |msg: String| (400, error_body(format!("{path}: {msg}"), "bad_request"));
    Ok(match path {
        "/edit" => {
            let obj = json_object(path, body, &["requests"])?;
            let requests = field(path, &obj, "requests")?;
            if !requests.is_array() {
                return Err(bad("field `requests` must be an array of edit records".into()));
            }
            if is_image_request(requests) {
                return image_edit(path, requests, opts);
            }
            let (records, report) =
                parse_records(&requests.to_string(), Path::new("requests"), DatasetKind::Requests).map_err(|e| bad(e.to_string()))?;
            if let Some((i, why)) = report.skipped.first() {
                return Err(bad(format!("record {i}: {why}")));
            }
            Op::Edit(records)
        }
        "/score" => {
            let obj = json_object(path, body, &["text", "image", "image_base64"])?;
            let text = string_field(path, &obj, "text")?;
            Op::Score { text, image: request_image(path, &obj, opts)? }
        }
        "/generate" => {
            let obj = json_object(path, body, &["prompt", "max_new_tokens", "image", "image_base64"])?;
            let image = request_image(path, &obj, opts)?;
            let max_new_tokens = match obj.get("max_new_tokens") {
                None => DEFAULT_MAX_NEW_TOKENS,
                Some(v) => v
                    .as_u64()
                    .map(|n| n.min(usize::MAX as u64) as usize)
                    .ok_or_else(|| bad("field `max_new_tokens` must be a non-negative integer".into()))?,
            };
            Op::Generate { prompt: string_field(path, &obj, "prompt")?, max_new_tokens, image }
        }
        "/reset" => Op::Reset,
        "/save" => {
            let Some(root) = opts.save_root.as_deref() else {
                let msg = "/save is disabled: start the server with --save-root DIR to allow saving models inside DIR";
                return Err((403, error_body(msg, "forbidden")));
            };
            let dir = string_field(path, &json_object(path, body, &["dir"])?, "dir")?;
            if dir.trim().is_empty() {
                return Err(bad("field `dir` is empty".into()));
            }
            let dir = crate::io::resolve_under(root, Path::new(&dir)).map_err(|e| match e {
                Error::Input(_) => (403, error_body(format!("{path}: {e}"), "forbidden")),
                // The root itself is unreadable (removed since the start, say): the server's fault.
                e => (500, error_body(format!("{path}: {e}"), "internal")),
            })?;
            Op::Save { dir }
        }
        other => return Err((404, error_body(format!("no route {other}"), "not_found"))),
    })
}

/// The optional image of a `/score` or `/generate` body: `image` (a path under the image
/// root) or `image_base64` (an upload), not both.
fn request_image(path: &str, obj: &Map<String, Value>, opts: &ServeOptions) -> std::result::Result<Option<RequestImage>, Reply> {
    Ok(match (obj.contains_key("image"), obj.contains_key("image_base64")) {
        (true, true) => return Err((400, error_body(format!("{path}: give `image` or `image_base64`, not both"), "bad_request"))),
        (true, false) => Some(RequestImage::File(image_path(path, &string_field(path, obj, "image")?, opts)?)),
        (false, true) => Some(RequestImage::Bytes(decode_image(path, "field `image_base64`", &string_field(path, obj, "image_base64")?)?)),
        (false, false) => None,
    })
}

/// Whether an `/edit` body's requests are E-VQA records (one of them names an `image`,
/// by path or upload) rather than EasyEdit text records. A ZsRE-style text record (`src`
/// without an image) stays a text request, and its error names the text fields it lacks.
fn is_image_request(requests: &Value) -> bool {
    requests.as_array().is_some_and(|a| a.iter().any(|r| r.get("image").is_some() || r.get("image_base64").is_some()))
}

fn forbidden(msg: String) -> Reply {
    (403, error_body(msg, "forbidden"))
}

/// The 403 for an image path without an image root.
fn no_image_root(path: &str) -> Reply {
    forbidden(format!("{path}: image paths are disabled: start the server with --image-root DIR to allow images inside DIR (or send `image_base64`)"))
}

/// A confinement error: 403 for a path that leaves the root, 500 when the root itself
/// cannot be read (removed since the start, say: the server's fault).
fn confinement_error(path: &str, e: Error) -> Reply {
    match e {
        Error::Input(m) => forbidden(format!("{path}: {m}")),
        e => (500, error_body(format!("{path}: {e}"), "internal")),
    }
}

/// `/score`'s `image`: resolved under the image root (403 without one, or out of it) and
/// required to be a file there (400, named as the client gave it).
fn image_path(path: &str, name: &str, opts: &ServeOptions) -> std::result::Result<PathBuf, Reply> {
    let Some(root) = opts.image_root.as_deref() else { return Err(no_image_root(path)) };
    let resolved = crate::io::resolve_under(root, Path::new(name)).map_err(|e| confinement_error(path, e))?;
    if !resolved.is_file() {
        return Err((400, error_body(format!("{path}: image {name:?} is not a file under the image root"), "bad_request")));
    }
    Ok(resolved)
}

/// An upload (`image_base64`, an E-VQA record's `*_base64`; `field` names it in errors,
/// e.g. ``record 1: field `m_loc_base64` ``):
/// standard base64 (whitespace ignored) of a PNG or JPEG file; anything else is 400. Its
/// size is bounded by the body limit.
fn decode_image(path: &str, field: &str, b64: &str) -> std::result::Result<Vec<u8>, Reply> {
    let bad = |msg: String| (400, error_body(format!("{path}: {field}: {msg}"), "bad_request"));
    let compact: String = b64.chars().filter(|c| !c.is_ascii_whitespace()).collect();
    if compact.is_empty() {
        return Err(bad("empty".into()));
    }
    let bytes = base64::decode(&compact).map_err(|e| bad(format!("not valid base64: {e}")))?;
    image_kind(&bytes).map_err(|e| bad(e.to_string()))?;
    Ok(bytes)
}

/// An `/edit` of E-VQA records. Each image is a name under the image root (confined:
/// 403 without a root or out of it) or a `*_base64` upload (400 unless a PNG or JPEG;
/// written to a private temporary file that lives until the edit has run), one or the
/// other; then every record is parsed and its images checked readable (400).
fn image_edit(path: &str, requests: &Value, opts: &ServeOptions) -> std::result::Result<Op, Reply> {
    let bad = |msg: String| (400, error_body(format!("{path}: {msg}"), "bad_request"));
    let mut requests = requests.clone();
    // Uploads out of the records first: confinement sees only the names clients gave.
    let mut uploads: Vec<(usize, &str, TempImage)> = Vec::new();
    let mut named = false;
    if let Value::Array(items) = &mut requests {
        for (i, item) in items.iter_mut().enumerate() {
            let Value::Object(obj) = item else { continue };
            for (key, _) in IMAGE_KEYS {
                let b64_key = format!("{key}_base64");
                match (obj.contains_key(key), obj.remove(&b64_key)) {
                    (true, Some(_)) => return Err(bad(format!("record {i}: give `{key}` or `{b64_key}`, not both"))),
                    (_, Some(Value::String(b64))) => {
                        let bytes = decode_image(path, &format!("record {i}: field `{b64_key}`"), &b64)?;
                        let tmp = TempImage::from_bytes(&bytes).map_err(|e| (500, error_body(format!("{path}: record {i}: {b64_key}: {e}"), "internal")))?;
                        uploads.push((i, key, tmp));
                    }
                    (_, Some(_)) => return Err(bad(format!("record {i}: field `{b64_key}` must be a string of base64"))),
                    (true, None) => named = true,
                    (false, None) => {}
                }
            }
        }
    }
    let roots = match opts.image_root.as_deref() {
        Some(root) => ImageRoots::new(root.to_path_buf(), None),
        None if named => return Err(no_image_root(path)),
        // Uploads only: every image path is an absolute temporary file, which the reader
        // takes as it is; the root is only joined to it.
        None => ImageRoots::new(std::env::temp_dir(), None),
    };
    confine_images(&mut requests, &roots).map_err(|e| confinement_error(path, e))?;
    if let Value::Array(items) = &mut requests {
        for (i, key, tmp) in &uploads {
            if let Some(Value::Object(obj)) = items.get_mut(*i) {
                let p = tmp.path().to_str().ok_or_else(|| (500, error_body(format!("{path}: the temporary directory's path is not UTF-8"), "internal")))?;
                obj.insert(key.to_string(), Value::String(p.to_string()));
            }
        }
    }
    let records = read_image_requests(&requests.to_string(), &roots).map_err(|e| bad(e.to_string()))?;
    Ok(Op::EditImages { records, _uploads: uploads.into_iter().map(|(_, _, t)| t).collect() })
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
        let (status, body) = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| run_op(session, job.op)))
            .unwrap_or_else(|_| (500, error_body("internal error while running the request", "internal")));
        shared.edits_total.store(session.edits_total(), Ordering::Relaxed);
        respond(shared, job.request, status, body);
    }
}

/// Status of a session error: 422 for input the model refuses, 500 for the rest.
fn status_of(e: &Error) -> (u16, &'static str) {
    match e {
        Error::Input(_) => (422, "invalid_input"),
        Error::OutOfMemory(_) => (500, "out_of_memory"),
        _ => (500, "internal"),
    }
}

fn reply<T: Serialize>(r: Result<T>) -> Reply {
    match r {
        Ok(v) => (200, serde_json::to_value(v).unwrap_or_default()),
        Err(e) => {
            let (status, kind) = status_of(&e);
            (status, error_body(e.to_string(), kind))
        }
    }
}

fn run_op(session: &mut Session, op: Op) -> Reply {
    let (status, mut body) = run_session_op(session, op);
    if body["kind"] == "out_of_memory" {
        // What was in use when it ran out, to size the next attempt.
        body["memory"] = session.memory().map(|m| json!(m)).unwrap_or(Value::Null);
    }
    (status, body)
}

fn run_session_op(session: &mut Session, op: Op) -> Reply {
    match op {
        Op::Edit(records) => reply(session.edit(&records)),
        Op::EditImages { records, _uploads } => reply(session.edit_images(&records)),
        Op::Score { text, image: None } => reply(session.score(&text)),
        Op::Score { text, image: Some(RequestImage::File(p)) } => reply(session.score_image(&text, Some(&p))),
        Op::Score { text, image: Some(RequestImage::Bytes(b)) } => reply(session.score_image_bytes(&text, &b)),
        Op::Generate { prompt, max_new_tokens, image: None } => reply(session.generate(&prompt, max_new_tokens)),
        Op::Generate { prompt, max_new_tokens, image: Some(RequestImage::File(p)) } => reply(session.generate_image(&prompt, Some(&p), max_new_tokens)),
        Op::Generate { prompt, max_new_tokens, image: Some(RequestImage::Bytes(b)) } => reply(session.generate_image_bytes(&prompt, &b, max_new_tokens)),
        Op::Reset => reply(session.reset().map(|n| json!({ "restored_params": n, "edits_total": session.edits_total() }))),
        Op::Save { dir } => match session.save(&dir) {
            Ok(()) => (200, json!({ "dir": dir.display().to_string(), "edits_total": session.edits_total() })),
            // The directory is the caller's choice: failing to write it is theirs to fix.
            Err(e @ (Error::Io { .. } | Error::File { .. })) => (422, error_body(e.to_string(), "invalid_input")),
            Err(e) => reply::<()>(Err(e)),
        },
    }
}
