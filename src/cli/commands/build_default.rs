//! `dualedit build-default`: rebuild the embedded defaults (text, multimodal, the editor
//! for many edits).
use crate::bootstrap::{demo, demo_vl};
use crate::cli::args::BuildDefaultArgs;
use crate::config::MendConfig;

pub fn run(a: BuildDefaultArgs) -> anyhow::Result<()> {
    if a.only.as_deref() == Some("many") {
        let common = crate::run::Common::single(demo::model_dir(&a.out), tch::Device::Cpu);
        let steps = demo::train_many_editor(&a.out, common, &MendConfig::from_file(&a.many_config)?)?;
        println!("{}", serde_json::json!({"editor": demo::many_editor_dir(&a.out), "train_steps": steps}));
        return Ok(());
    }
    if a.only.as_deref() != Some("vl") {
        let mut spec = demo::BuildSpec::shipped(MendConfig::from_file(&a.config)?, Some(MendConfig::from_file(&a.many_config)?));
        if let Some(n) = a.pretrain_steps {
            spec.pretrain.steps = n;
        }
        let rep = demo::build_default(&a.out, &spec, tch::Device::Cpu)?;
        println!("{}", serde_json::to_string_pretty(&rep)?);
    }
    if a.only.as_deref() != Some("text") {
        let mut spec = demo_vl::VlBuildSpec::shipped(MendConfig::from_file(&a.vl_config)?);
        if let Some(n) = a.pretrain_steps {
            spec.pretrain.steps = n;
        }
        let rep = demo_vl::build_default_vl(&demo_vl::vl_root(&a.out), &spec, tch::Device::Cpu)?;
        println!("{}", serde_json::to_string_pretty(&rep)?);
    }
    Ok(())
}
