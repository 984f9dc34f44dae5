//! `dualedit eval`: edit each record of a dataset from the unedited model (or, with
//! `--edits-per-batch` / `--sequential`, groups of records) and report EasyEdit's metrics.
use crate::cli::args::EvalArgs;
use crate::planner::Phase;
use crate::run::{self, EvalOptions};

/// The run `eval` (and `compare eval`) makes of its flags.
pub fn options(a: &EvalArgs) -> anyhow::Result<EvalOptions> {
    // Flags first: a bad threshold is named before any file is read.
    let capacity = a.groups.capacity(&a.guard)?;
    // Groups of several edits are what `--method auto` makes with mend-ls.
    let many = capacity.as_ref().is_some_and(|c| c.grouping.size() > 1);
    Ok(EvalOptions {
        common: a.common.resolve(&a.method.planning_config()?, a.method.max_length, Phase::Edit)?,
        method: a.method.resolve(many)?,
        data: a.data.clone(),
        ds: a.ds,
        limit: a.limit,
        max_length: a.method.max_length,
        capacity,
    })
}

pub fn run(a: EvalArgs) -> anyhow::Result<()> {
    let opts = options(&a)?;
    let bar = crate::progress::Progress::new("eval", 0, !a.json);
    let (out, path) = run::run_eval_counted(&opts, |i, n, m| {
        // Per record (`RUST_LOG=dualedit=debug`), so a mean can be taken apart; NaN: not measured.
        let nan = |v: Option<f64>| v.unwrap_or(f64::NAN);
        tracing::debug!(record = i, reliability = m.reliability, generalization = nan(m.generalization), locality = nan(m.locality), "record edited");
        bar.set_total(n);
        bar.set_message(format!("records edited (last: reliability {:.2})", m.reliability));
        bar.set_position(i as u64 + 1);
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
