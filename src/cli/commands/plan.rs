//! `dualedit plan`: with `--placement`, that placement's plan (items, formulas, each
//! device's peak per phase); without it, the table of every placement of the devices given
//! (on one device: its plan). Devices need not exist here; `--max-memory` is planned
//! against, not applied.
use crate::cli::args::{dataset, PlanArgs};
use crate::config::MendConfig;
use crate::device::{Placement, PlacementRequest};
use crate::model::parse_dtype;
use crate::planner::{choose, plan_model, Phase, PlacementTable, PlanOptions};

pub fn run(a: PlanArgs) -> anyhow::Result<()> {
    let config = MendConfig::from_file(&a.config)?;
    let tokens = a.max_length.unwrap_or(config.max_length) as i64;
    let d = &a.devices;
    let mut opts = PlanOptions::new(&d.device, d.sub_device.as_deref(), parse_dtype(&a.dtype)?, tokens, a.kept_tokens)?;
    opts.caps = d.max_memory.clone().unwrap_or_default();
    opts.optimizer = d.optimizer_device.unwrap_or_default();
    opts.image = a.image_size;
    opts.loc_tokens = a.loc_length;
    if let Some(ds) = &a.ds {
        match (dataset(ds)?.is_multimodal(), a.image_size) {
            (true, None) => anyhow::bail!("--ds {ds} plans images: give --image-size WIDTHxHEIGHT (e.g. 640x480 for a COCO photo)"),
            (false, Some(_)) => anyhow::bail!("--ds {ds} is text-only: --image-size plans the multimodal views (--ds vqa or caption)"),
            _ => {}
        }
    }
    if a.loc_length.is_some() && a.image_size.is_none() {
        anyhow::bail!("--loc-length is the text-only locality view of --ds vqa|caption: give --image-size");
    }
    if !a.model.is_dir() {
        return Err(crate::Error::file(&a.model, "model directory not found").into());
    }
    let (model, _) = crate::model::loader::read_config(&a.model)?;
    if a.image_size.is_some() && model.family().vision_language().is_some() {
        opts.image_processor = crate::model::qwen2_vl::ImageProcessorConfig::load(&a.model.join("preprocessor_config.json"))?;
    }
    let plan = match d.placement {
        Some(PlacementRequest::Auto) => choose(&model, &config, &opts, Phase::Train)?,
        Some(p) => plan_model(&model, &config, &opts.with_placement(p.fixed().unwrap_or(Placement::Replica), opts.optimizer)?)?,
        None if opts.split => {
            let table = PlacementTable::new(&model, &config, &opts)?;
            if a.json {
                println!("{}", serde_json::to_string(&table)?);
            } else {
                print!("{}", table.text());
                println!("(--placement NAME prints one placement's items and formulas)");
            }
            return Ok(());
        }
        None => plan_model(&model, &config, &opts)?,
    };
    if a.json {
        println!("{}", serde_json::to_string(&plan)?);
    } else {
        print!("{}", plan.table());
    }
    Ok(())
}
