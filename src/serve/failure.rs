//! How a request failed: the client's fault (4xx, its message names only what the
//! client sent) or the server's (500, details in the log). `Failure::of` (in `mod.rs`)
//! classifies a library error.

/// Who a failed request's fault is, which decides its status and what its body may say.
#[derive(Debug)]
pub(super) enum Failure {
    /// The request is wrong: a 4xx whose message names only what the client sent.
    Client { status: u16, kind: &'static str, msg: String },
    /// The server failed (a model or config file it cannot read, a libtorch error): 500,
    /// the body says only what kind of failure it was; the details go to the log.
    Internal { kind: &'static str, public: String, detail: String },
}

impl Failure {
    pub(super) fn bad(msg: impl Into<String>) -> Self {
        Failure::Client { status: 400, kind: "bad_request", msg: msg.into() }
    }

    pub(super) fn internal(detail: impl Into<String>) -> Self {
        Failure::Internal { kind: "internal", public: "internal error; the server's log has the details".into(), detail: detail.into() }
    }
}
