use clap::Args;

use crate::planner::PlanRequest;

#[derive(Args)]
pub struct PlanArgs {
    #[command(flatten)]
    pub request: PlanRequest,
    /// Print exactly one JSON object on stdout.
    #[arg(long)]
    pub json: bool,
}
