//! `dualedit stats`: the key statistics `mend-ls` solves against, computed once per model
//! over a text file and stored with the editor ([`crate::mend::stats`]).
use crate::cli::args::StatsArgs;
use crate::edit::{self, LoadOptions};
use crate::mend::stats::KeyStats;
use crate::planner::{Phase, PlaceFor};

pub fn run(a: StatsArgs) -> anyhow::Result<()> {
    let config = crate::mend::checkpoint::trained_config(&a.editor)?;
    let place = PlaceFor { model: &a.model, config: &config, dtype: tch::Kind::Float, tokens: config.max_length as i64, phase: Phase::Edit };
    let opts = LoadOptions { plan: crate::cli::args::placed(&a.devices, &place)?, dtype: tch::Kind::Float };
    let start = std::time::Instant::now();
    let engine = edit::open_engine(&a.model, &opts, &edit::editor_params(&a.editor)?)?;
    let mut stats = KeyStats::compute(&engine, &a.text, a.max_tokens, !a.json)?;
    let path = stats.write_for_editor(&a.editor)?;
    let seconds = start.elapsed().as_secs_f64();
    if a.json {
        let v = serde_json::json!({
            "file": path.display().to_string(),
            "params": stats.meta.params,
            "tokens": stats.meta.tokens,
            "lines": stats.meta.lines,
            "seconds": seconds,
        });
        println!("{v}");
    } else {
        println!(
            "key statistics of {} weights over {} tokens ({} lines) written to {} ({seconds:.1} s); mend-ls uses them by default",
            stats.meta.params.len(),
            stats.meta.tokens,
            stats.meta.lines,
            path.display()
        );
    }
    Ok(())
}
