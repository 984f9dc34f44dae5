//! `dualedit eval`: edit each record of a dataset from the unedited model (or, with
//! `--edits-per-batch` / `--sequential`, groups of records) and report EasyEdit's metrics.
use crate::cli::args::{dataset, EvalArgs};
use crate::edit::capacity::Grouping;
use crate::planner::Phase;
use crate::run::{self, EvalOptions};

/// The run `eval` (and `compare eval`) makes of its flags.
pub fn options(a: &EvalArgs) -> anyhow::Result<EvalOptions> {
    Ok(EvalOptions {
        common: a.common.resolve(&a.method.planning_config()?, a.method.max_length, Phase::Edit)?,
        method: a.method.resolve()?,
        data: a.data.clone(),
        ds: dataset(&a.ds)?,
        limit: a.limit,
        max_length: a.method.max_length,
        capacity: capacity_options(a)?,
    })
}

fn capacity_options(a: &EvalArgs) -> anyhow::Result<Option<run::CapacityOptions>> {
    let grouping = match (a.edits_per_batch, a.sequential) {
        (Some(n), _) => Grouping::Batch(n),
        (None, Some(n)) => Grouping::Sequential(n),
        (None, None) => {
            if a.drift_text.is_some() || a.guard.stepwise || a.guard.no_guard {
                anyhow::bail!("--drift-text, --stepwise and the guard flags of eval need --edits-per-batch N or --sequential N");
            }
            return Ok(None);
        }
    };
    Ok(Some(run::CapacityOptions { grouping, guard: a.guard.config(), stepwise: a.guard.stepwise(), drift_text: a.drift_text.clone() }))
}

pub fn run(a: EvalArgs) -> anyhow::Result<()> {
    let opts = options(&a)?;
    let bar = if a.json { indicatif::ProgressBar::hidden() } else { indicatif::ProgressBar::new_spinner() };
    let (out, path) = run::run_eval(&opts, |i, m| {
        bar.set_message(format!("{} records edited (last: reliability {:.2})", i + 1, m.reliability));
        bar.tick();
    })?;
    bar.finish_and_clear();
    if a.json {
        let mut v = serde_json::to_value(&out.summary)?;
        v["method"] = serde_json::Value::from(out.method.clone());
        if let Some(c) = &out.capacity {
            v["capacity"] = serde_json::to_value(c)?;
        }
        v["data"] = serde_json::to_value(&out.data)?;
        v["report"] = serde_json::Value::from(path.display().to_string());
        println!("{v}");
    } else {
        crate::cli::render::evaluated(&out, &path);
    }
    Ok(())
}
