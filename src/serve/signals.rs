//! What `dualedit serve` needs from its process: the bearer token from the environment and
//! a stop flag raised by SIGINT / SIGTERM.
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use crate::{Error, Result};

/// The token a server requires: `flag` (`--token`), else `$DUALEDIT_TOKEN`. An empty
/// variable counts as unset, as for most tools' `*_TOKEN` variables.
pub fn token(flag: Option<String>) -> Option<String> {
    flag.or_else(|| std::env::var(super::TOKEN_ENV).ok().filter(|t| !t.is_empty()))
}

/// A flag the first SIGINT / SIGTERM raises (finish the request in flight, then return
/// from [`super::Server::run`]); a second signal exits the process at once (status 130).
pub fn stop_on_signals() -> Result<Arc<AtomicBool>> {
    let stop = Arc::new(AtomicBool::new(false));
    let flag = stop.clone();
    ctrlc::set_handler(move || {
        if flag.swap(true, Ordering::SeqCst) {
            std::process::exit(130);
        }
        eprintln!("stopping: finishing the request in flight (signal again to exit at once)");
    })
    .map_err(|e| Error::input(format!("cannot handle SIGINT/SIGTERM: {e}")))?;
    Ok(stop)
}
