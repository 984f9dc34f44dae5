//! The service's limits and sizes, and the defaults of its requests.
use std::path::PathBuf;
use std::time::Duration;

use crate::mend::guard::GuardConfig;

/// The address `serve` listens on unless told otherwise: loopback only.
pub const DEFAULT_LISTEN: &str = "127.0.0.1:8470";

/// Limits and sizes of the service.
#[derive(Debug, Clone)]
pub struct ServeOptions {
    /// Model requests waiting beyond the one running; more are answered 503.
    pub queue: usize,
    /// HTTP worker threads that read, parse and validate model requests' bodies (health
    /// and memory are answered by two acceptor threads that never read a body).
    pub workers: usize,
    /// Largest request body accepted; larger ones are answered 413.
    pub max_body_bytes: usize,
    /// A model request that waited longer than this is answered 503 without running.
    pub queue_timeout: Duration,
    /// How long a worker waits for a request's body. A client that stalls mid-body is
    /// answered 408 and its connection is left to a reader thread of its own (at most
    /// [`MAX_BODY_READERS`]), so slow clients hold no worker beyond this.
    pub body_timeout: Duration,
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
    /// The commit guard of every `/edit` ([`crate::mend::guard`]), as `edit` applies it:
    /// on by default with `edit`'s defaults; `None` (`--no-guard`) commits edits as the
    /// editor makes them. A request may change it for itself (its body's `guard`). It
    /// replaces the session's own [`Session::guard`] while the server runs.
    pub guard: Option<GuardConfig>,
}

impl Default for ServeOptions {
    fn default() -> Self {
        Self {
            queue: 64,
            workers: 4,
            max_body_bytes: 1 << 20,
            queue_timeout: Duration::from_secs(60),
            body_timeout: Duration::from_secs(30),
            save_root: None,
            image_root: None,
            token: None,
            insecure_no_token: false,
            guard: Some(GuardConfig::default()),
        }
    }
}

/// Default of `/generate`'s `max_new_tokens`.
pub const DEFAULT_MAX_NEW_TOKENS: usize = 16;
