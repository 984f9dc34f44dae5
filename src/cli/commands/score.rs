//! `dualedit score`: each next token's log-probability and the mean NLL of a text.
use crate::cli::args::ScoreArgs;
use crate::model::{load_model, ParamView};

pub fn run(args: ScoreArgs) -> anyhow::Result<()> {
    let device = args.devices.single("score")?;
    let kind = crate::run::options::weights_dtype(&args.model, args.dtype)?;
    let lm = load_model(&args.model, device, kind)?;
    let images: Vec<&std::path::Path> = args.image.iter().map(|p| p.as_path()).collect();
    let s = crate::edit::score::score_with_images(&lm, &ParamView::frozen(&lm.params), &args.text, &images)?;
    if args.json {
        println!("{}", serde_json::to_string(&s)?);
    } else {
        crate::cli::render::score(&s, &lm.tokenizer);
    }
    Ok(())
}
