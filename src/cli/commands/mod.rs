//! One file per command: its flags (`cli::args`) into one library call, then the output
//! (`cli::render`). Nothing here computes what the library could.
pub mod build_default;
pub mod compare;
pub mod config;
pub mod convert;
pub mod demo;
pub mod edit;
pub mod eval;
pub mod plan;
pub mod pretrain;
pub mod report;
pub mod score;
pub mod serve;
pub mod stats;
pub mod train;
pub mod world;

use super::Command;

impl Command {
    /// Runs the command.
    pub fn run(self) -> anyhow::Result<()> {
        match self {
            Command::Score(a) => score::run(a),
            Command::Train(a) => train::run(a),
            Command::Edit(a) => edit::run(a),
            Command::Eval(a) => eval::run(a),
            Command::Compare(c) => compare::run(c),
            Command::Demo(a) => demo::run(a),
            Command::Pretrain(a) => pretrain::run(a),
            Command::BuildDefault(a) => build_default::run(a),
            Command::World(a) => world::run(a),
            Command::Serve(a) => serve::run(a),
            Command::Plan(a) => plan::run(a),
            Command::Stats(a) => stats::run(a),
            Command::Report(c) => report::run(c),
            Command::Convert(a) => convert::run(a),
            Command::Config(a) => config::run(a),
        }
    }
}
