//! `dualedit plan`: with `--placement`, that placement's plan (items, formulas, each
//! device's peak per phase); without it, the table of every placement of the devices given
//! (on one device: its plan). Devices need not exist here; `--max-memory` is planned
//! against, not applied.
use crate::cli::args::PlanArgs;

pub fn run(a: PlanArgs) -> anyhow::Result<()> {
    let (out, nothing_fits) = a.request.answer(a.json)?;
    // The planner names options by their fields; here they are this command's flags.
    print!("{}", crate::cli::flags_named(&out));
    if let Some(line) = nothing_fits {
        anyhow::bail!(line);
    }
    Ok(())
}
