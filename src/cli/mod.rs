//! The `dualedit` command line: the flags of each command (`args/`), one file per command
//! that turns its flags into a library call (`commands/`), and the text a command prints
//! (`render`). `src/main.rs` parses, sets up logging and calls [`Command::run`].
pub mod args;
pub mod commands;
pub mod reference;
pub mod render;

use clap::{Parser, Subcommand};

use args::{
    BuildDefaultArgs, CompareCmd, ConfigArgs, ConvertArgs, DemoArgs, EditArgs, EvalArgs, PlanArgs, PretrainArgs, ReportCmd, ScoreArgs, ServeArgs,
    StatsArgs, TrainArgs, WorldArgs,
};

#[derive(Parser)]
#[command(name = "dualedit", version, about = "MEND knowledge editing of causal LMs on one or two devices")]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

impl Cli {
    /// The command line parsed. A usage error (an unknown flag, a value outside a flag's
    /// choices) is one line on stderr, clap's message with the choices it lists, and exit
    /// status 2: every error of the program is one line. Help and version print as clap
    /// prints them.
    pub fn parse_or_exit() -> Self {
        use clap::error::ErrorKind;
        match Self::try_parse() {
            Ok(cli) => cli,
            Err(e) if matches!(e.kind(), ErrorKind::DisplayHelp | ErrorKind::DisplayVersion | ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand) => e.exit(),
            Err(e) => {
                eprintln!("{}", one_line(&e.to_string()));
                std::process::exit(2)
            }
        }
    }
}

/// The command line's log: stderr, each line with the options it names as fields
/// (`` `resume` ``, as the library writes them for every interface) written as this CLI's
/// flags (`--resume`), as [`flags_named`] does for errors.
pub struct FlagLog;

impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for FlagLog {
    type Writer = FlagLine;

    fn make_writer(&'a self) -> FlagLine {
        FlagLine(Vec::new())
    }
}

/// One log event, buffered: tracing formats an event into one writer and drops it, so the
/// whole line is translated and written at once.
pub struct FlagLine(Vec<u8>);

impl std::io::Write for FlagLine {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Drop for FlagLine {
    fn drop(&mut self) {
        let line = flags_named(&String::from_utf8_lossy(&self.0));
        // A log line that cannot be written has nowhere else to go.
        let _ = std::io::Write::write_all(&mut std::io::stderr().lock(), line.as_bytes());
    }
}

/// `message` with each option the library names by its field (`` `sub_device` ``, the
/// Python keyword and JSON key) written as the flag of this command line that sets it
/// (`--sub-device`). The library's errors name fields so that every interface reads
/// them; the flag a field becomes is clap's, so the two cannot drift apart. A name in
/// backticks that no flag has (a JSON key of a record, say) is left as it is. A switch
/// that turns a field off (`guard` is set by `--no-guard`) is named as its value:
/// `` `guard`=false `` becomes `--no-guard`, `` `recompute`=true `` becomes `--recompute`.
/// Advice that gives a value (`` `dtype`=bf16 ``, as a Python keyword would be set) becomes
/// the flag and the value (`--dtype bf16`).
pub fn flags_named(message: &str) -> String {
    use std::sync::OnceLock;
    static FLAGS: OnceLock<std::collections::BTreeMap<String, String>> = OnceLock::new();
    let flags = FLAGS.get_or_init(|| {
        fn walk(cmd: &clap::Command, out: &mut std::collections::BTreeMap<String, String>) {
            for arg in cmd.get_arguments() {
                if let Some(long) = arg.get_long() {
                    let id = arg.get_id();
                    match arg.get_action() {
                        clap::ArgAction::SetFalse => {
                            out.entry(format!("{id}=false")).or_insert_with(|| format!("--{long}"));
                        }
                        clap::ArgAction::SetTrue => {
                            out.entry(format!("{id}=true")).or_insert_with(|| format!("--{long}"));
                            out.entry(id.to_string()).or_insert_with(|| format!("--{long}"));
                        }
                        _ => {
                            out.entry(id.to_string()).or_insert_with(|| format!("--{long}"));
                            out.entry(format!("{id}=")).or_insert_with(|| format!("--{long} "));
                        }
                    }
                }
            }
            for sub in cmd.get_subcommands() {
                walk(sub, out);
            }
        }
        let mut out = std::collections::BTreeMap::new();
        walk(&<Cli as clap::CommandFactory>::command(), &mut out);
        out
    });
    let mut out = String::with_capacity(message.len());
    let mut rest = message;
    while let Some(open) = rest.find('`') {
        out.push_str(&rest[..open]);
        let after = &rest[open + 1..];
        let Some(close) = after.find('`') else {
            out.push('`');
            rest = after;
            break;
        };
        let name = &after[..close];
        let mut next = &after[close + 1..];
        // `name`=false / =true (a switch), or `name`=VALUE (a flag and its value).
        let switch = ["=false", "=true", "="]
            .iter()
            .find_map(|v| Some((flags.get(&format!("{name}{v}"))?, next.strip_prefix(v)?)));
        match (switch, flags.get(name)) {
            (Some((flag, tail)), _) => {
                out.push_str(flag);
                next = tail;
            }
            (None, Some(flag)) => out.push_str(flag),
            (None, None) => out.push_str(&rest[open..open + close + 2]),
        }
        rest = next;
    }
    out.push_str(rest);
    out
}

/// clap's message without its usage block and hint, on one line.
fn one_line(message: &str) -> String {
    let kept: Vec<&str> = message
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with("Usage:") && !l.starts_with("For more information"))
        .collect();
    format!("{} (see --help)", kept.join(" "))
}

#[derive(Subcommand)]
pub enum Command {
    /// Print each next token's log-probability and the mean NLL of a text.
    Score(ScoreArgs),
    /// Meta-train a MEND editor on EasyEdit data.
    Train(TrainArgs),
    /// Apply edit requests with a trained editor and report their metrics.
    Edit(EditArgs),
    /// Edit each record of a dataset from the unedited model and report EasyEdit's metrics.
    Eval(EvalArgs),
    /// Run the same train or eval on the main device alone and split over main + sub,
    /// and write one side-by-side report.
    #[command(subcommand)]
    Compare(CompareCmd),
    /// Show the product on the embedded default: a few edits, held-out metrics, memory.
    Demo(DemoArgs),
    /// Pretrain a small GPT-2 from scratch on the facts of EasyEdit datasets.
    Pretrain(PretrainArgs),
    /// Rebuild the embedded default: synthetic world, tiny pretrained GPT-2, its editor.
    BuildDefault(BuildDefaultArgs),
    /// Write a synthetic world's files, training nothing: the text world (facts, corpus,
    /// CounterFact-shaped edits) or, with --vl, the visual world (PNG scenes, E-VQA records).
    World(WorldArgs),
    /// Serve edit / score / generate / reset / save as JSON over HTTP (loopback by default).
    Serve(ServeArgs),
    /// Compute the key statistics `mend-ls` solves against (each edited layer's Σ k kᵀ over
    /// a text file), once per model, into the editor's folder.
    Stats(StatsArgs),
    /// Estimate each device's peak memory for training and editing from config.json alone.
    Plan(PlanArgs),
    /// Work with run reports: `report merge` puts many in one table.
    #[command(subcommand)]
    Report(ReportCmd),
    /// Import a GGUF file (llama.cpp's format, quantised or not) as a Hugging Face model
    /// folder that score, edit, train and transformers load.
    Convert(ConvertArgs),
    /// Print an EasyEdit MEND hparams YAML as dualedit's config JSON.
    Config(ConfigArgs),
}
