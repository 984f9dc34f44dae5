use std::path::PathBuf;

use clap::Args;

use crate::device::DeviceRequest;

#[derive(Args)]
pub struct ServeArgs {
    /// Hugging Face model directory.
    #[arg(long)]
    pub model: PathBuf,
    /// Trained editor directory (without one, /edit answers 422).
    #[arg(long)]
    pub editor: Option<PathBuf>,
    /// The edit method, as `edit`'s: `auto` (the default everywhere) makes a request of
    /// one edit on a fresh session with mend, several (or edits after earlier ones) with
    /// mend-ls and the editor for many edits the editor names; `mend`, `mend-ls`, `ft`.
    #[arg(long, value_enum, default_value = crate::edit::DEFAULT_METHOD)]
    pub method: crate::edit::MethodName,
    #[command(flatten)]
    pub devices: DeviceRequest,
    /// f32, bf16 or f16 for the model weights. Default: the checkpoint's config.json
    /// `dtype`, else f32 (as `plan`).
    #[arg(long, value_enum)]
    pub dtype: Option<crate::model::Dtype>,
    /// Address to listen on; anything but loopback needs --token (or --insecure-no-token).
    #[arg(long, default_value = crate::serve::DEFAULT_LISTEN)]
    pub listen: String,
    /// Model requests that may wait; more are answered 503.
    #[arg(long, default_value_t = 64)]
    pub queue: usize,
    /// Largest request body in bytes (413 beyond).
    #[arg(long, default_value_t = 1 << 20)]
    pub max_body_bytes: usize,
    /// Seconds a model request may wait in the queue before it is answered 503.
    #[arg(long, default_value_t = 60)]
    pub queue_timeout: u64,
    /// Seconds a worker waits for a request's body before answering 408 (a client that
    /// stalls mid-body then holds a thread of its own, not a worker).
    #[arg(long, default_value_t = 30)]
    pub body_timeout: u64,
    /// Allow POST /save, writing only to relative paths inside this existing directory
    /// (without it, /save is refused with 403).
    #[arg(long)]
    pub save_root: Option<PathBuf>,
    /// Allow image paths in requests (/score's `image`, E-VQA /edit requests), read only
    /// at relative paths inside this existing directory (without it, they are refused
    /// with 403; /score's `image_base64` needs no root).
    #[arg(long)]
    pub image_root: Option<PathBuf>,
    /// Require `Authorization: Bearer TOKEN` on every request (401 otherwise). Default:
    /// $DUALEDIT_TOKEN, which is better than the flag (the process list shows flags).
    #[arg(long)]
    pub token: Option<String>,
    /// Listen beyond loopback without a token: anyone who can reach the address can edit,
    /// read and (with --save-root) save the model.
    #[arg(long)]
    pub insecure_no_token: bool,
    /// /edit's commit guard, as `edit`'s (a request may change it for itself).
    #[command(flatten)]
    pub guard: crate::run::options::GuardOptions,
}
