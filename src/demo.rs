//! The embedded default: a synthetic knowledge world, a tiny GPT-2 that knows it, and its
//! trained MEND editor (`build-default`), and the demo that shows them (`demo`).
use std::path::{Path, PathBuf};

use serde::Serialize;
use tch::Device;
use tracing::info;

use crate::config::MendConfig;
use crate::data::easyedit::DatasetKind;
use crate::data::synthetic::{write_world, World, WorldConfig};
use crate::device::DevicePlan;
use crate::eval::Summary;
use crate::pretrain::{pretrain, PretrainConfig, PretrainReport};
use crate::run::{run_eval, run_train, Common, EvalOptions, MethodSpec, TrainOptions};
use crate::Result;

/// Sizes of one build of the default (the shipped one, or a quick one for tests).
#[derive(Debug, Clone, Serialize)]
pub struct BuildSpec {
    pub world: WorldConfig,
    pub pretrain: PretrainConfig,
    pub mend: MendConfig,
}

impl BuildSpec {
    /// What ships in `data/`.
    pub fn shipped(mend: MendConfig) -> Self {
        Self { world: WorldConfig { n_edit_train: 1000, ..WorldConfig::default() }, pretrain: PretrainConfig::default(), mend }
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct BuildReport {
    pub pretrain: PretrainReport,
    pub train_steps: usize,
    pub holdout: Summary,
    pub seconds: f64,
}

pub fn model_dir(root: &Path) -> PathBuf {
    root.join("model")
}
pub fn editor_dir(root: &Path) -> PathBuf {
    root.join("editor")
}
pub fn world_dir(root: &Path) -> PathBuf {
    root.join("world")
}

/// World -> tokenizer + pretrained model -> meta-trained editor -> held-out evaluation.
pub fn build_default(root: &Path, spec: &BuildSpec, device: Device) -> Result<BuildReport> {
    let start = std::time::Instant::now();
    let world = World::generate(&spec.world);
    write_world(&world_dir(root), &world)?;
    let probe: Vec<(String, String)> = world
        .facts
        .iter()
        .flat_map(|f| world.prompts(f).into_iter().map(move |p| (p, f.object.clone())))
        .collect();
    info!(facts = world.facts.len(), "pretraining the default model");
    let pre = pretrain(&world.corpus(), &probe, &spec.pretrain, &model_dir(root), device)?;
    info!(accuracy = pre.fact_accuracy, steps = pre.steps, "pretrained");
    let common = Common {
        model: model_dir(root),
        plan: DevicePlan::single(device),
        dtype: tch::Kind::Float,
        seed: 0,
        report: Some(root.join("runs").join("train.json")),
    };
    let (train, _) = run_train(&TrainOptions {
        common: common.clone(),
        data: world_dir(root).join("edits-train.json"),
        ds: DatasetKind::Counterfact,
        config: spec.mend.clone(),
        out: editor_dir(root),
        limit: None,
        resume: false,
        progress: false,
    })?;
    let (eval, _) = run_eval(
        &EvalOptions {
            common: Common { report: Some(root.join("runs").join("holdout.json")), ..common },
            method: MethodSpec::Mend { editor: editor_dir(root) },
            data: world_dir(root).join("edits-holdout.json"),
            ds: DatasetKind::Counterfact,
            limit: None,
            max_length: spec.pretrain.n_positions as usize,
        },
        |_, _| {},
    )?;
    Ok(BuildReport { pretrain: pre, train_steps: train.steps, holdout: eval.summary, seconds: start.elapsed().as_secs_f64() })
}
