//! The `dualedit` command line: parsing and calling the library, nothing else.
use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Args, Parser, Subcommand};

use dualedit::model::{load_model, parse_dtype, ParamView};

#[derive(Parser)]
#[command(name = "dualedit", version, about = "MEND knowledge editing on one or two devices")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Print each next token's log-probability and the mean NLL of a text.
    Score(ScoreArgs),
}

#[derive(Args)]
struct ScoreArgs {
    /// Hugging Face model directory (config.json, *.safetensors, tokenizer.json).
    #[arg(long)]
    model: PathBuf,
    /// Text to score.
    #[arg(long)]
    text: String,
    /// cpu, cuda or cuda:N.
    #[arg(long, default_value = "cpu")]
    device: String,
    /// f32, bf16 or f16.
    #[arg(long, default_value = "f32")]
    dtype: String,
    /// Print exactly one JSON object on stdout.
    #[arg(long)]
    json: bool,
}

fn score(args: ScoreArgs) -> anyhow::Result<()> {
    let device = dualedit::device::parse_device(&args.device)?;
    let kind = parse_dtype(&args.dtype)?;
    let lm = load_model(&args.model, device, kind)?;
    let s = dualedit::score::score_text(&lm, &ParamView::frozen(&lm.params), &args.text)?;
    if args.json {
        println!("{}", serde_json::to_string(&s)?);
    } else {
        let pieces: Vec<String> = s.tokens.iter().map(|&t| lm.tokenizer.decode(&[t]).unwrap_or_default()).collect();
        println!("{:>6}  {:>10}  token", "pos", "logprob");
        for (i, lp) in s.logprobs.iter().enumerate() {
            println!("{:>6}  {:>10.4}  {:?}", i + 1, lp, pieces[i + 1]);
        }
        println!("mean NLL {:.4} over {} tokens", s.mean_nll, s.logprobs.len());
    }
    Ok(())
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Score(a) => score(a),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
