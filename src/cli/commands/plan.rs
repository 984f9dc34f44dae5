//! `dualedit plan`: with `--placement`, that placement's plan (items, formulas, each
//! device's peak per phase); without it, the table of every placement of the devices given
//! (on one device: its plan). Devices need not exist here; `--max-memory` is planned
//! against, not applied.
use crate::cli::args::PlanArgs;
use crate::config::MendConfig;
use crate::planner::{verdict, PlanOptions};

pub fn run(a: PlanArgs) -> anyhow::Result<()> {
    let (out, nothing_fits) = answer(&a)?;
    // The planner names options by their fields; here they are this command's flags.
    print!("{}", crate::cli::flags_named(&out));
    if let Some(line) = nothing_fits {
        anyhow::bail!(line);
    }
    Ok(())
}

/// The answer `plan` prints (text, or the `--json` object) and, when no placement fits the
/// caps, the one line it exits non-zero with. The Python package's `plan` calls this too,
/// so both give the same object.
pub fn answer(a: &PlanArgs) -> anyhow::Result<(String, Option<String>)> {
    let config = MendConfig::from_file(&a.config)?;
    let tokens = a.max_length.unwrap_or(config.max_length) as i64;
    let d = &a.devices;
    if !a.model.is_dir() {
        return Err(crate::Error::file(&a.model, "model directory not found").into());
    }
    let (dtype, dtype_source) = verdict::planned_dtype(&a.model, a.dtype)?;
    let mut opts = PlanOptions::new(&d.device, d.sub_device.as_deref(), dtype, tokens, a.kept_tokens)?;
    opts.headroom = verdict::Headroom::parse(a.margin.as_deref(), a.reserve.as_deref())?;
    opts.caps = d.max_memory.clone().unwrap_or_default();
    opts.optimizer = d.optimizer_device.unwrap_or_default();
    if opts.optimizer == crate::device::OptimizerDevice::Sub && !opts.split {
        // As `train` refuses it: planning the moments "on sub" of a one-device run would
        // plan them on main without a word.
        anyhow::bail!("--optimizer-device sub needs a --sub-device other than --device (this plan has one device): drop the flag or give a sub-device");
    }
    opts.image = a.image_size;
    opts.loc_tokens = a.loc_length;
    if let Some(ds) = a.ds {
        match (ds.is_multimodal(), a.image_size) {
            (true, None) if a.data.is_none() => anyhow::bail!("--ds {ds} plans images: give --image-size WIDTHxHEIGHT (e.g. 640x480 for a COCO photo), or --data"),
            (false, Some(_)) => anyhow::bail!("--ds {ds} is text-only: --image-size plans the multimodal views (--ds vqa or caption)"),
            _ => {}
        }
    }
    if a.loc_length.is_some() && a.image_size.is_none() {
        anyhow::bail!("--loc-length is the text-only locality view of --ds vqa|caption: give --image-size");
    }
    let (model, _) = crate::model::loader::read_config(&a.model)?;
    let data = match (&a.data, a.ds) {
        (Some(file), Some(ds)) => {
            let d = crate::planner::data::data_shape(&a.model, &model, file, ds, a.image_root.as_deref(), a.percentile)?;
            opts.tokens = a.max_length.map_or(d.text_tokens.at_percentile, |t| t as i64);
            opts.kept = a.kept_tokens.or(Some(d.labelled.at_percentile));
            opts.image = a.image_size.or(d.image_at_percentile);
            opts.loc_tokens = a.loc_length.or(d.loc_tokens.map(|l| l.at_percentile));
            Some(d)
        }
        (Some(_), None) => anyhow::bail!("plan --data: give --ds (zsre, counterfact, vqa or caption) to read it"),
        (None, _) => None,
    };
    if opts.image.is_some() && model.family().vision_language().is_some() {
        opts.image_processor = crate::model::vision::ImageProcessorConfig::load(&a.model.join("preprocessor_config.json"))?;
    }
    let question = verdict::PlanQuestion {
        placement: d.placement,
        dtype_source,
        fit: a.fit.as_deref().map(verdict::parse_sizes).transpose()?,
        // `--fit` with `--sub-device cpu`: one card and the host's memory.
        fit_host: (d.sub_device.is_some() && opts.chain.is_empty() && opts.sub.starts_with("cpu")).then(|| opts.sub.clone()),
        data,
        json: a.json,
    };
    Ok(verdict::answer(&model, &config, &opts, &question)?)
}
