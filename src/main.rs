//! The `dualedit` command line: parse, set up logging, run the command (`dualedit::cli`).
use std::process::ExitCode;

use dualedit::cli::Cli;

/// Colour codes only for a terminal (a log file or a pipe would get `ESC[2m…` as text), and
/// never when `NO_COLOR` is set to anything but the empty string (https://no-color.org).
fn stderr_colour() -> bool {
    use std::io::IsTerminal;
    let no_color = std::env::var_os("NO_COLOR").is_some_and(|v| !v.is_empty());
    !no_color && std::io::stderr().is_terminal()
}

fn main() -> ExitCode {
    dualedit::device::memory::tune_host_allocator();
    dualedit::device::prefer_flash_attention();
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn,dualedit::run=info".into()))
        .with_writer(dualedit::cli::FlagLog)
        .with_ansi(stderr_colour())
        .init();
    let cli = Cli::parse_or_exit();
    dualedit::device::settle_threads();
    // tch panics on libtorch errors outside the guarded model code (a CUDA allocation while
    // loading, say): one line of error, never a backtrace.
    let result = match dualedit::error::guard(|| Ok(cli.command.run())) {
        Ok(r) => r,
        Err(e) => Err(e.into()),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            // The library names options by their fields; here they are this CLI's flags.
            eprintln!("error: {}", dualedit::cli::flags_named(&format!("{e:#}")));
            ExitCode::FAILURE
        }
    }
}
