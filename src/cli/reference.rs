//! The flag reference (`docs/cli.md`), rendered from the clap definitions themselves so it
//! cannot drift from them: `tests/fast/cli.rs` fails when the committed file differs from
//! [`markdown`] (`DUALEDIT_WRITE_DOCS=1 ./x test --test fast cli::` rewrites it).
use clap::CommandFactory;

use super::Cli;

/// Every command's `--help` (long form), one section per command, in `dualedit --help`'s
/// order; subcommands (`compare train`, `compare eval`) after their parent.
pub fn markdown() -> String {
    let mut cmd = Cli::command();
    // Propagates the binary name into each subcommand's usage line.
    cmd.build();
    let mut out = String::from(
        "# dualedit command-line reference\n\n\
         Generated from the clap definitions in `src/cli/args/` by `dualedit::cli::reference::markdown`;\n\
         do not edit by hand (`DUALEDIT_WRITE_DOCS=1 ./x test --test fast cli::` rewrites it, and that test\n\
         fails while this file is stale).\n",
    );
    section(&mut out, &mut cmd, "dualedit");
    out
}

fn section(out: &mut String, cmd: &mut clap::Command, path: &str) {
    out.push_str(&format!("\n## `{path}`\n\n```text\n"));
    let help = cmd.render_long_help().to_string();
    // Trailing spaces vary with clap's wrapping; a reference does not need them.
    for line in help.lines() {
        out.push_str(line.trim_end());
        out.push('\n');
    }
    out.push_str("```\n");
    let names: Vec<String> = cmd.get_subcommands().filter(|s| !s.is_hide_set()).map(|s| s.get_name().to_string()).collect();
    for name in names {
        if name == "help" {
            continue;
        }
        if let Some(sub) = cmd.find_subcommand_mut(&name) {
            section(out, sub, &format!("{path} {name}"));
        }
    }
}
