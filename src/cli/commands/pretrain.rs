//! `dualedit pretrain [--vl]`: a small GPT-2 on the facts of EasyEdit datasets, or a tiny
//! Qwen2-VL on a visual world.
use crate::bootstrap::pretrain::{corpus_from_records, pretrain, PretrainConfig};
use crate::bootstrap::pretrain_vl::{pretrain_vl, VlPretrainConfig};
use crate::cli::args::PretrainArgs;

pub fn run(a: PretrainArgs) -> anyhow::Result<()> {
    if a.vl {
        return run_vl(a);
    }
    let ds = a.ds.ok_or_else(|| anyhow::anyhow!("pretrain needs --ds (zsre, counterfact, vqa or caption) or --vl"))?;
    let d = PretrainConfig::from_scratch();
    let cfg = PretrainConfig {
        vocab_size: a.vocab,
        n_embd: a.n_embd.unwrap_or(d.n_embd),
        n_layer: a.n_layer.unwrap_or(d.n_layer),
        n_head: a.n_head.unwrap_or(d.n_head),
        n_positions: a.n_positions,
        steps: a.steps.unwrap_or(d.steps),
        batch_size: a.batch,
        lr: a.lr.unwrap_or(d.lr),
        ..d
    };
    cfg.check()?;
    crate::placed::save::check_new_model_dir(&a.out)?;
    let mut records = Vec::new();
    for f in &a.data {
        records.extend(crate::data::load_records(f, ds)?.0);
    }
    let (corpus, probe) = corpus_from_records(&records, a.with_new_targets);
    let probe: Vec<_> = probe.into_iter().take(1000).collect();
    let device = a.devices.single("pretrain")?;
    let rep = pretrain(&corpus, &probe, &cfg, &a.out, device, true)?;
    println!("{}", serde_json::to_string_pretty(&rep)?);
    Ok(())
}

fn run_vl(a: PretrainArgs) -> anyhow::Result<()> {
    let world = a.world.as_deref().ok_or_else(|| anyhow::anyhow!("--vl needs --world DIR"))?;
    let d = VlPretrainConfig::default();
    let cfg = VlPretrainConfig {
        steps: a.steps.unwrap_or(d.steps),
        batch_size: a.batch,
        lr: a.lr.unwrap_or(d.lr),
        vision_lr_scale: a.vision_lr_scale.unwrap_or(d.vision_lr_scale),
        hidden: a.n_embd.unwrap_or(d.hidden),
        layers: a.n_layer.unwrap_or(d.layers),
        heads: a.n_head.unwrap_or(d.heads),
        target_accuracy: None,
        ..d
    };
    crate::placed::save::check_new_model_dir(&a.out)?;
    let device = a.devices.single("pretrain")?;
    tch::set_num_threads(1);
    let rep = pretrain_vl(world, &cfg, &a.out, device, true)?;
    println!("{}", serde_json::to_string_pretty(&rep)?);
    Ok(())
}
