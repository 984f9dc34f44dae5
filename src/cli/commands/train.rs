//! `dualedit train`: meta-train a MEND editor.
use crate::cli::args::TrainArgs;
use crate::config::MendConfig;
use crate::planner::Phase;
use crate::run::{self, TrainOptions};

/// The run `train` (and `compare train`) makes of its flags.
pub fn options(a: TrainArgs) -> anyhow::Result<TrainOptions> {
    let ds = a.ds;
    run::check_report_path(a.common.report.as_deref(), &[&a.config])?;
    let mut config = MendConfig::from_file(&a.config)?;
    if let Some(n) = a.max_steps {
        config.max_steps = n;
    }
    if a.recompute {
        config.recompute = true;
    }
    Ok(TrainOptions {
        common: a.common.resolve(&config, config.max_length, Phase::Train)?,
        data: a.data,
        ds,
        config,
        out: a.out,
        limit: a.limit,
        resume: a.resume,
        init: a.init,
        progress: true,
    })
}

pub fn run(a: TrainArgs) -> anyhow::Result<()> {
    let opts = options(a)?;
    let (rep, path) = run::run_train(&opts)?;
    crate::cli::render::trained(&rep, opts.config.select_by, &path);
    Ok(())
}
