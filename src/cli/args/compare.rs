use clap::Subcommand;

use super::{EvalArgs, TrainArgs};

#[derive(Subcommand)]
pub enum CompareCmd {
    /// Compare meta-training runs (outputs under --out/single and --out/dual).
    Train(TrainArgs),
    /// Compare evaluation runs (reports under runs/ or beside --report).
    Eval(EvalArgs),
}
