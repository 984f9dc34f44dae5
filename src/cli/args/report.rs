//! `dualedit report merge REPORTS... [--json]`.
use std::path::PathBuf;

use clap::Subcommand;

#[derive(Subcommand)]
pub enum ReportCmd {
    /// One table of many run reports (train / eval / edit reports, compare.json): one row
    /// each with command, model, devices, placement, key metrics, peaks and wall time.
    Merge {
        /// The report files (e.g. a Slurm job array's `runs/*.json`; the timelines beside
        /// them are passed over).
        #[arg(required = true)]
        reports: Vec<PathBuf>,
        /// Print exactly one JSON object on stdout instead of the table.
        #[arg(long)]
        json: bool,
    },
}
