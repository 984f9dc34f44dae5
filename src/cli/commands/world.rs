//! `dualedit world [--vl]`: write a synthetic world's files, training nothing.
use crate::cli::args::WorldArgs;
use crate::world::{text, visual};

pub fn run(a: WorldArgs) -> anyhow::Result<()> {
    if !a.vl {
        // The text world exactly as build-default writes it (its MEND config plays no part).
        let mut cfg = text::WorldConfig::shipped();
        cfg.seed = a.seed.unwrap_or(cfg.seed);
        let written = text::generate_and_write(&a.out, &cfg)?;
        println!("{}", serde_json::to_string_pretty(&written)?);
        return Ok(());
    }
    let mut cfg = visual::VisualWorldConfig::default();
    cfg.seed = a.seed.unwrap_or(cfg.seed);
    cfg.n_train_scenes = a.train_scenes.unwrap_or(cfg.n_train_scenes);
    cfg.n_holdout_scenes = a.holdout_scenes.unwrap_or(cfg.n_holdout_scenes);
    if let Some((w, h)) = a.image_size {
        let side = |v: i64| u32::try_from(v).map_err(|_| anyhow::anyhow!("--image-size {w}x{h}: a side is too large"));
        (cfg.width, cfg.height) = (side(w)?, side(h)?);
    }
    let world = visual::VisualWorld::generate(&cfg)?;
    let written = visual::write_visual_world(&a.out, &world)?;
    println!("{}", serde_json::to_string_pretty(&written)?);
    Ok(())
}
