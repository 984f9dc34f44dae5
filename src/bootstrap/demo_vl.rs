//! The multimodal default (issue #22): a synthetic visual world, a tiny Qwen2-VL-shaped
//! model pretrained on it, and its MEND editor (`build-default` writes them into
//! `data/vl/`), and the demo that shows an image edit (`demo --multimodal`).
use std::path::{Path, PathBuf};

use serde::Serialize;
use tch::Device;
use tracing::info;

use crate::config::MendConfig;
use crate::data::easyedit::DatasetKind;
use crate::data::multimodal::ImageRoots;
use crate::world::visual::{write_visual_world, VisualWorld, VisualWorldConfig};
use crate::bootstrap::demo::{editor_dir, model_dir, world_dir};
use crate::device::DevicePlan;
use crate::edit::MethodSpec;
use crate::edit::eval::{EasyEditNames, Summary};
use crate::bootstrap::pretrain_vl::{pretrain_vl, VlPretrainConfig, VlPretrainReport};
use crate::run::Common;
use crate::Result;

/// The folder of the multimodal default inside the default's root (`data/vl`).
pub fn vl_root(root: &Path) -> PathBuf {
    root.join("vl")
}

/// Sizes of one build of the multimodal default (the shipped one, or a quick one for tests).
#[derive(Debug, Clone, Serialize)]
pub struct VlBuildSpec {
    pub world: VisualWorldConfig,
    pub pretrain: VlPretrainConfig,
    pub mend: MendConfig,
}

impl VlBuildSpec {
    /// What ships in `data/vl/`.
    pub fn shipped(mend: MendConfig) -> Self {
        Self { world: VisualWorldConfig::default(), pretrain: VlPretrainConfig::default(), mend }
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct VlBuildReport {
    pub pretrain: VlPretrainReport,
    pub train_steps: usize,
    pub holdout: Summary,
    pub seconds: f64,
}

/// Visual world -> pretrained VL model -> editor meta-trained on `vqa-train.json` (five
/// views) -> held-out evaluation on `vqa-holdout.json`, all under `root` (`data/vl`).
pub fn build_default_vl(root: &Path, spec: &VlBuildSpec, device: Device) -> Result<VlBuildReport> {
    let start = std::time::Instant::now();
    // One thread: the same bytes on every build (and the model is too small for two).
    tch::set_num_threads(1);
    let world = VisualWorld::generate(&spec.world)?;
    let written = write_visual_world(&world_dir(root), &world)?;
    info!(scenes = written.scenes, train = written.train_records, holdout = written.holdout_records, "visual world written");
    let pre = pretrain_vl(&world_dir(root), &spec.pretrain, &model_dir(root), device, true)?;
    info!(accuracy = ?pre.accuracy, steps = pre.steps, "pretrained the VL model");
    let common = Common { image_roots: Some(ImageRoots::new(world_dir(root), None)), ..Common::single(model_dir(root), device) };
    // A rebuild replaces the editor an earlier build wrote here (`run_train` refuses an
    // existing editor, which protects a user's `--out`; this folder is the build's own).
    for f in [crate::mend::checkpoint::EDITOR_FILE, crate::mend::checkpoint::STATE_FILE, crate::mend::checkpoint::EDITOR_JSON] {
        let path = editor_dir(root).join(f);
        if path.exists() {
            std::fs::remove_file(&path).map_err(|e| crate::Error::io(&path, e))?;
        }
    }
    let (roots, opts) = (common.image_roots.clone(), crate::bootstrap::demo::common_plan(&common));
    let (train_steps, holdout) =
        crate::bootstrap::demo::train_and_evaluate(root, common, ("vqa-train.json", "vqa-holdout.json"), DatasetKind::Vqa, &spec.mend, spec.mend.max_length)?;
    visual_key_stats(root, &opts, roots.as_ref())?;
    Ok(VlBuildReport { pretrain: pre, train_steps, holdout, seconds: start.elapsed().as_secs_f64() })
}

/// The editor's key statistics over its visual world (issue #47): the locality views of
/// `vqa-train.json`, each record's unrelated image and question and its NQ question, so
/// that several image edits go through `mend-ls` by default (`dualedit stats --data
/// data/vl/world/vqa-train.json --ds vqa --image-root data/vl/world`). `root` holds
/// `model/`, `world/` and `editor/`, as `data/vl` does.
pub fn visual_key_stats(root: &Path, opts: &crate::edit::LoadOptions, roots: Option<&ImageRoots>) -> Result<()> {
    let editor = editor_dir(root);
    let engine = crate::edit::open_engine(&model_dir(root), opts, &crate::edit::editor_params(&editor)?)?;
    let data = world_dir(root).join("vqa-train.json");
    // As `dualedit stats` prepares them: at the editor's maximum length, longer skipped.
    let max = crate::mend::checkpoint::trained_config(&editor)?.max_length;
    let (_, examples, _) = crate::run::load_examples(&engine, &data, DatasetKind::Vqa, None, max, Default::default(), roots)?;
    let mut stats = crate::mend::stats::KeyStats::compute_views(&engine, &examples, &data, DatasetKind::Vqa, usize::MAX, true)?;
    stats.write_for_editor(&editor)?;
    Ok(())
}

/// One shown edit: the question, the answers before and after, and on the other images.
#[derive(Debug, Clone, Serialize)]
pub struct ShownEdit {
    pub image: PathBuf,
    pub question: String,
    pub truth: Option<String>,
    pub target: String,
    pub before: String,
    pub after: String,
    /// The same question on the rephrase image (the scene redrawn), after the edit.
    pub rephrase_image: PathBuf,
    pub rephrase_image_after: String,
    /// Another scene's question and image, before and after the edit.
    pub unrelated_image: PathBuf,
    pub unrelated_question: String,
    pub unrelated_before: String,
    pub unrelated_after: String,
}

#[derive(Debug, Clone, Serialize)]
pub struct VlDemoSummary {
    pub model: String,
    pub parameters: i64,
    pub edit: ShownEdit,
    pub holdout: Summary,
    /// The five held-out metrics with EasyEdit's names.
    pub easyedit: Option<EasyEditNames>,
    pub seconds: f64,
}

/// Edits one held-out image's answer and shows it before and after, on the rephrase image
/// and on an unrelated image, then the held-out metrics (each edit from the unedited
/// model). Text goes to `out` unless `json`, which writes one JSON object instead.
pub fn run_demo_vl(root: &Path, plan: DevicePlan, json: bool, out: &mut impl std::io::Write) -> Result<VlDemoSummary> {
    use crate::edit::{evaluate, make_edit, LoadOptions};
    use crate::placed::generate::answer;
    use crate::run::load_examples;
    let start = std::time::Instant::now();
    tch::set_num_threads(1);
    let w = |out: &mut dyn std::io::Write, s: String| writeln!(out, "{s}").map_err(|e| crate::Error::io("<stdout>", e));
    let spec = MethodSpec::Mend { editor: editor_dir(root) };
    let (mut engine, mut method) = crate::edit::open(&model_dir(root), &LoadOptions { plan, ..LoadOptions::default() }, &spec)?;
    let info = engine.lm.model.info();
    let world = world_dir(root);
    let roots = ImageRoots::new(world.clone(), None);
    let holdout = world.join("vqa-holdout.json");
    let (records, examples, _) =
        load_examples(&engine, &holdout, DatasetKind::Vqa, None, info.max_positions as usize, Default::default(), Some(&roots))?;
    let (r, e) = records.iter().zip(&examples).next().ok_or_else(|| crate::Error::file(&holdout, "no held-out record to show"))?;
    let image_of = |x: &crate::data::Example| x.image.as_ref().map(|i| i.path.clone()).unwrap_or_default();
    let (outer_image, loc_image) = match (&e.outer_image, &e.loc_image) {
        (Some(o), Some(l)) => (o, l),
        _ => return Err(crate::Error::file(&holdout, "the first held-out record has no rephrase or locality image")),
    };
    let mload = crate::data::multimodal::load_mm(&holdout, DatasetKind::Vqa, &roots, false)?;
    let unrelated_question = mload.records.first().and_then(|m| m.m_loc.as_ref()).map(|m| m.question.clone()).unwrap_or_default();
    let clean = |s: String| s.trim().to_string();
    let before = clean(answer(&engine, &e.inner)?);
    let unrelated_before = clean(answer(&engine, loc_image)?);
    let overrides = make_edit(&engine, method.as_mut(), &engine.collate(&[&e.inner])?)?;
    let originals: Vec<(String, tch::Tensor)> =
        overrides.names().map(|n| Ok((n.clone(), engine.weight(n)?.shallow_clone()))).collect::<Result<_>>()?;
    engine.commit(&overrides)?;
    let shown = ShownEdit {
        image: image_of(&e.inner),
        question: r.prompt.clone(),
        truth: r.ground_truth.clone(),
        target: r.target_new.clone(),
        before,
        after: clean(answer(&engine, &e.inner)?),
        rephrase_image: image_of(outer_image),
        rephrase_image_after: clean(answer(&engine, outer_image)?),
        unrelated_image: image_of(loc_image),
        unrelated_question,
        unrelated_before,
        unrelated_after: clean(answer(&engine, loc_image)?),
    };
    // Back to the loaded weights: every held-out edit starts from the unedited model.
    let restore: crate::model::Overrides = originals.into_iter().collect();
    engine.commit(&restore)?;
    let metrics = evaluate(&engine, method.as_mut(), &examples, &[], |_, _| {})?;
    let s = Summary::of(&metrics);
    let summary = VlDemoSummary {
        model: info.architecture.clone(),
        parameters: info.n_params,
        edit: shown,
        easyedit: s.easyedit.clone(),
        holdout: s,
        seconds: start.elapsed().as_secs_f64(),
    };
    if json {
        let text = serde_json::to_string_pretty(&summary).map_err(|e| crate::Error::input(e.to_string()))?;
        w(out, text)?;
        return Ok(summary);
    }
    let rel = |p: &Path| p.strip_prefix(&world).unwrap_or(p).display().to_string();
    let d = &summary.edit;
    w(out, format!("dualedit demo --multimodal: {} with {} parameters, {} edited weights", summary.model, summary.parameters, engine.edit_params.len()))?;
    w(out, String::new())?;
    w(out, format!("edit: [{}] {:?} -> {:?} (true answer {:?})", rel(&d.image), d.question, d.target, d.truth.clone().unwrap_or_default()))?;
    w(out, format!("  before:          {}", d.before))?;
    w(out, format!("  after:           {}", d.after))?;
    w(out, format!("  rephrase image:  [{}] {}", rel(&d.rephrase_image), d.rephrase_image_after))?;
    w(out, format!(
        "  unrelated image: [{}] {:?} {}  (before the edit: {})",
        rel(&d.unrelated_image),
        d.unrelated_question,
        d.unrelated_after,
        d.unrelated_before
    ))?;
    let h = &summary.holdout;
    let f = |v: Option<f64>| v.map_or("-".to_string(), |v| format!("{v:.3}"));
    w(out, String::new())?;
    w(out, format!("held-out edits (each from the unedited model): n = {}", h.n))?;
    w(out, format!("  {:<22} {:>6.3}  (rewrite_acc)", "reliability", h.reliability))?;
    w(out, format!("  {:<22} {:>6}  (rephrase_acc)", "text generality", f(h.generalization)))?;
    w(out, format!("  {:<22} {:>6}  (rephrase_image_acc)", "image generality", f(h.image_generalization)))?;
    w(out, format!("  {:<22} {:>6}  (locality_acc)", "text locality", f(h.locality)))?;
    w(out, format!("  {:<22} {:>6}  (multimodal_locality_acc: top-10 lists unchanged, every position)", "image locality", f(h.image_locality)))?;
    w(out, format!("  {:<22} {:>6}  (top-1: the unrelated image's answer unchanged)", "", f(h.image_locality_top1)))?;
    w(out, format!("  {:<22} {:>6.1} ms", "time per edit", h.seconds_per_edit * 1e3))?;
    Ok(summary)
}
