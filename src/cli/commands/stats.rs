//! `dualedit stats`: the key statistics `mend-ls` solves against, computed once per model
//! over a text file (or a data file's locality views) and stored with the editor ([`crate::mend::stats`]).
use crate::cli::args::StatsArgs;
use crate::data::examples::OverLong;
use crate::data::multimodal::ImageRoots;
use crate::edit;
use crate::mend::stats::KeyStats;
use crate::planner::Phase;

pub fn run(a: StatsArgs) -> anyhow::Result<()> {
    let config = crate::mend::checkpoint::trained_config(&a.editor)?;
    // The statistics are of the f32 weights, whatever the checkpoint's dtype.
    let opts = crate::run::options::load_options(&a.model, &a.devices, Some(crate::model::Dtype::F32), &config, config.max_length, Phase::Edit)?;
    let start = std::time::Instant::now();
    let engine = edit::open_engine(&a.model, &opts, &edit::editor_params(&a.editor)?)?;
    let mut stats = match (&a.text, &a.data, a.ds) {
        (Some(text), _, _) => KeyStats::compute(&engine, text, a.max_tokens, !a.json)?,
        (None, Some(data), Some(ds)) => {
            let roots = a.image_root.clone().map(|r| ImageRoots::new(r, a.rephrase_image_root.clone()));
            let (_, examples, _) = crate::run::load_examples(&engine, data, ds, None, config.max_length, OverLong::Skip, roots.as_ref())?;
            KeyStats::compute_views(&engine, &examples, data, ds, a.max_tokens, !a.json)?
        }
        _ => anyhow::bail!("give --text FILE, or --data FILE with --ds"),
    };
    let path = stats.write_for_editor(&a.editor)?;
    let seconds = start.elapsed().as_secs_f64();
    if a.json {
        let v = serde_json::json!({
            "file": path.display().to_string(),
            "params": stats.meta.params,
            "tokens": stats.meta.tokens,
            "lines": stats.meta.lines,
            "ds": stats.meta.ds,
            "seconds": seconds,
        });
        println!("{v}");
    } else {
        println!(
            "key statistics of {} weights over {} tokens ({} {}) written to {} ({seconds:.1} s); mend-ls uses them by default",
            stats.meta.params.len(),
            stats.meta.tokens,
            stats.meta.lines,
            if stats.meta.ds.is_some() { "examples" } else { "lines" },
            path.display()
        );
    }
    Ok(())
}
