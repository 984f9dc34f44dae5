//! `dualedit serve`: a session's operations as JSON over HTTP until SIGINT / SIGTERM.
use crate::cli::args::ServeArgs;
use crate::edit::{MethodName, MethodOptions};
use crate::config::MendConfig;
use crate::planner::Phase;
use crate::serve::{signals, ServeOptions, Server};

pub fn run(a: ServeArgs) -> anyhow::Result<()> {
    let opts = ServeOptions {
        queue: a.queue,
        max_body_bytes: a.max_body_bytes,
        queue_timeout: std::time::Duration::from_secs(a.queue_timeout),
        body_timeout: std::time::Duration::from_secs(a.body_timeout),
        save_root: a.save_root,
        image_root: a.image_root,
        token: signals::token(a.token),
        insecure_no_token: a.insecure_no_token,
        guard: a.guard.config()?,
        ..Default::default()
    };
    // The address and token are checked (an open listener refused) before anything is read.
    let server = Server::bind(&a.listen, opts)?;
    let config = match &a.editor {
        Some(dir) => crate::mend::checkpoint::trained_config(dir)?,
        None => MendConfig::default(),
    };
    let session_opts = crate::run::options::load_options(&a.model, &a.devices, a.dtype, &config, config.max_length, Phase::Edit)?;
    // `--method auto` (the default, as `edit`'s and the Python package's): requests of
    // several edits (or after earlier ones) go to mend-ls with the editor for many edits,
    // when the editor names one; one request to mend. A server edits any number: `many`.
    let method = MethodOptions { method: Some(a.method), editor: a.editor.clone(), ..MethodOptions::default() };
    let session = match (&a.editor, a.method) {
        (None, MethodName::Auto) => crate::edit::session::Session::open(&a.model, None, &session_opts)?,
        _ => crate::edit::session::Session::open_method(&a.model, &method.resolve(true)?, &session_opts)?,
    };
    // First SIGINT/SIGTERM: finish the request in flight, then exit. A second one: now.
    let stop = signals::stop_on_signals()?;
    eprintln!("dualedit serving {} on http://{} (Ctrl-C to stop)", a.model.display(), server.local_addr());
    let stats = server.run(session, &stop)?;
    eprintln!("stopped after {} requests ({} ran on the model)", stats.requests, stats.model_requests);
    Ok(())
}
