//! `dualedit report merge`: many run reports in one table (`run::report_merge`).
use crate::cli::args::ReportCmd;
use crate::run::report_merge;

pub fn run(c: ReportCmd) -> anyhow::Result<()> {
    let ReportCmd::Merge { reports, json } = c;
    let merged = report_merge::merge(&reports)?;
    if json {
        println!("{}", serde_json::to_string(&merged)?);
    } else {
        print!("{}", report_merge::table(&merged));
    }
    Ok(())
}
