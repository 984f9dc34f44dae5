//! `dualedit config --from-easyedit F`: an EasyEdit MEND hparams YAML as our config JSON
//! ([`crate::config::easyedit`]).
use crate::cli::args::ConfigArgs;

pub fn run(a: ConfigArgs) -> anyhow::Result<()> {
    let text = crate::io::read_text(&a.from_easyedit)?;
    let r = crate::config::easyedit::from_easyedit(&text)
        .map_err(|e| crate::Error::file(&a.from_easyedit, format!("EasyEdit hparams: {e}")))?;
    if !r.ignored.is_empty() {
        eprintln!("EasyEdit keys not used here: {}", crate::cli::flags_named(&r.ignored.join("; ")));
    }
    println!("{}", serde_json::to_string_pretty(&r.config)?);
    Ok(())
}
