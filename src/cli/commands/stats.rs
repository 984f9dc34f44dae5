//! `dualedit stats`: the key statistics `mend-ls` solves against, computed once per model
//! over a text file and stored with the editor ([`crate::mend::stats`]).
use crate::cli::args::StatsArgs;
use crate::edit;
use crate::mend::stats::KeyStats;
use crate::planner::Phase;

pub fn run(a: StatsArgs) -> anyhow::Result<()> {
    let config = crate::mend::checkpoint::trained_config(&a.editor)?;
    // The statistics are of the f32 weights, whatever the checkpoint's dtype.
    let opts = crate::run::options::load_options(&a.model, &a.devices, Some(crate::model::Dtype::F32), &config, config.max_length, Phase::Edit)?;
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
