//! `dualedit edit`: apply edit requests with a trained editor and report their metrics.
use crate::cli::args::EditArgs;
use crate::planner::Phase;
use crate::run::{self, EditOptions};

pub fn run(a: EditArgs) -> anyhow::Result<()> {
    // Flags first: a bad threshold is named before any file is read.
    let guard = a.guard.config()?;
    let opts = EditOptions {
        common: a.common.resolve(&a.method.planning_config()?, a.method.max_length, Phase::Edit)?,
        method: a.method.resolve(a.sequential || crate::edit::request_count(&a.requests) != Some(1))?,
        requests: a.requests,
        ds: a.ds,
        sequential: a.sequential,
        save: a.save,
        max_length: a.method.max_length,
        guard,
        stepwise: a.stepwise.then(crate::mend::stepwise::Stepwise::default),
    };
    let (out, path) = run::run_edit(&opts)?;
    if a.json {
        let mut v = serde_json::to_value(&out)?;
        v["data"] = serde_json::to_value(&out.data)?;
        v["report"] = serde_json::Value::from(path.display().to_string());
        println!("{v}");
    } else {
        crate::cli::render::edited(&out, &path);
    }
    Ok(())
}
