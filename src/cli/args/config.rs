use std::path::PathBuf;

use clap::Args;

#[derive(Args)]
pub struct ConfigArgs {
    /// An EasyEdit MEND hparams YAML (`hparams/TRAINING/MEND/*.yaml` or `hparams/MEND/*.yaml`)
    /// to print as dualedit's config JSON; what it holds that a config does not (the model,
    /// the device, logging) is listed on stderr with the flag that gives it. `--config`
    /// reads such a file directly too.
    #[arg(long, value_name = "FILE")]
    pub from_easyedit: PathBuf,
}
