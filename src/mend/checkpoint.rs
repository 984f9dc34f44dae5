//! Editor checkpoints: `editor.safetensors` (weights, normalisation statistics and, in
//! its header metadata, the JSON below) plus `editor.json`, a readable copy of that JSON.
//! Both are written atomically; the safetensors header is what loading trusts.
//!
//! `train_state.safetensors` beside them holds what `--resume` needs on top: the Adam
//! moments and the loop counters.
use std::collections::{BTreeMap, HashMap};
use std::path::Path;

use serde::{Deserialize, Serialize};
use tch::{Device, Kind, Tensor};

use super::calibrate::Calibration;
use super::{Editor, Engine};
use crate::placed::EditedParam;
use crate::config::{MendConfig, SelectBy};
use crate::io::{read_safetensors, write_json_atomic, write_safetensors};
use crate::{Error, Result};

pub const EDITOR_FILE: &str = "editor.safetensors";
pub const EDITOR_JSON: &str = "editor.json";
pub const STATE_FILE: &str = "train_state.safetensors";

/// `out` when it holds a training state to resume from (for error messages).
pub fn saved_state(out: &std::path::Path) -> Option<&std::path::Path> {
    out.join(STATE_FILE).exists().then_some(out)
}
const FORMAT: &str = "dualedit-mend-editor/1";
const META_KEY: &str = "dualedit";

/// What an editor was trained for, checked when it is loaded against a model.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct ModelFingerprint {
    pub architecture: String,
    pub vocab_size: i64,
    pub hidden_size: i64,
    pub n_layers: i64,
    /// Sum of each edited weight (f64): tells two checkpoints of one architecture apart.
    pub weight_sums: BTreeMap<String, f64>,
}

impl ModelFingerprint {
    pub fn of(engine: &Engine) -> Result<Self> {
        let info = engine.lm.model.info();
        let mut weight_sums = BTreeMap::new();
        for p in &engine.edit_params {
            // Summed on the host: an f64 copy on the device (19 MB for a GPT-2 MLP weight)
            // made the save after an out-of-memory step run out of memory itself.
            weight_sums.insert(p.name.clone(), engine.weight(&p.name)?.to_device(tch::Device::Cpu).to_kind(Kind::Double).sum(Kind::Double).double_value(&[]));
        }
        Ok(Self {
            architecture: info.architecture,
            vocab_size: info.vocab_size,
            hidden_size: info.hidden_size,
            n_layers: info.n_layers,
            weight_sums,
        })
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct EditorMeta {
    pub format: String,
    pub config: MendConfig,
    pub params: Vec<EditedParam>,
    pub model: ModelFingerprint,
    /// The model directory it was trained with (informational).
    pub model_dir: String,
    pub stats_counts: BTreeMap<String, f64>,
    /// Optimiser steps taken when this editor was written.
    pub step: usize,
    pub dualedit_version: String,
    /// The key statistics `mend-ls` solves against, a file in the editor's folder
    /// ([`crate::mend::stats`]; written by `dualedit stats`, not by training).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key_stats: Option<String>,
    /// The editor for many edits at once or one after another, a folder relative to this
    /// one (`../editor-many` for the embedded default): what `--method auto` edits several
    /// requests with.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub many_editor: Option<String>,
    /// How plain MEND edits with this editor are scaled on the edit prompt
    /// ([`crate::mend::calibrate`]; set by hand or by a preparation, not by training).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub calibration: Option<Calibration>,
}

/// Reads `dir/editor.json` (the readable copy of an editor's description): what a caller
/// needs before the model is loaded (the edited weight names, the config it was trained
/// with), and the edit-time settings [`load_editor`] takes from it (`calibration`, `ls`).
/// The network itself is loaded from the safetensors header.
pub fn read_editor_json(dir: &Path) -> Result<EditorMeta> {
    if !dir.is_dir() {
        return Err(Error::file(dir, "editor directory not found"));
    }
    let path = dir.join(EDITOR_JSON);
    let text = crate::io::read_text(&path)?;
    serde_json::from_str(&text).map_err(|e| Error::file(&path, format!("invalid editor description: {e}")))
}

/// The MEND config an editor in `dir` was trained with, its `edit_params` the weights it
/// edits: what a placement for that editor is planned with.
pub fn trained_config(dir: &Path) -> Result<MendConfig> {
    let meta = read_editor_json(dir)?;
    let mut cfg = meta.config;
    cfg.edit_params = meta.params.into_iter().map(|p| p.name).collect();
    Ok(cfg)
}

fn meta_map(json: &impl Serialize) -> Result<HashMap<String, String>> {
    let text = serde_json::to_string(json).map_err(|e| Error::Internal(e.to_string()))?;
    Ok(HashMap::from([(META_KEY.to_string(), text)]))
}

/// Writes the editor into `dir` (created if needed).
pub fn save_editor(dir: &Path, editor: &Editor, engine: &Engine, step: usize) -> Result<EditorMeta> {
    let (stats, stats_counts) = editor.named_stats();
    let meta = EditorMeta {
        format: FORMAT.into(),
        config: editor.config.clone(),
        params: editor.params.clone(),
        model: ModelFingerprint::of(engine)?,
        model_dir: engine.lm.dir.display().to_string(),
        stats_counts,
        step,
        dualedit_version: env!("CARGO_PKG_VERSION").into(),
        key_stats: None,
        many_editor: None,
        calibration: editor.calibration,
    };
    let mut tensors = editor.named_tensors();
    tensors.extend(stats);
    write_json_atomic(&dir.join(EDITOR_JSON), &meta)?;
    write_safetensors(&dir.join(EDITOR_FILE), &tensors, meta_map(&meta)?)?;
    Ok(meta)
}

fn read_meta<T: for<'de> Deserialize<'de>>(path: &Path, meta: &HashMap<String, String>) -> Result<T> {
    let text = meta.get(META_KEY).ok_or_else(|| Error::file(path, "no dualedit metadata in the safetensors header"))?;
    serde_json::from_str(text).map_err(|e| Error::file(path, format!("invalid dualedit metadata: {e}")))
}

/// Loads an editor from `dir` for `engine`'s model, refusing one trained for another model.
pub fn load_editor(dir: &Path, engine: &Engine) -> Result<(Editor, EditorMeta)> {
    let (tensors, meta, path) = read_checked(dir, engine)?;
    let mut editor = editor_from(&meta.config, &meta, &tensors, &path, engine)?;
    // Edit-time settings live in editor.json only (the header is the trained network's):
    // the strength calibration, and the least-squares solve's settings (`ls`) that `mend-ls`
    // edits with, so that either can be tuned for an editor without retraining it.
    let json = read_editor_json(dir)?;
    let named = |e: Error| Error::file(dir.join(EDITOR_JSON), e.to_string());
    json.config.ls.validate().map_err(named)?;
    if let Some(cal) = &json.calibration {
        cal.validate().map_err(named)?;
    }
    editor.calibration = json.calibration;
    editor.config.ls = json.config.ls;
    Ok((editor, meta))
}

/// The editor in `dir` (network, learned edit rates, normalisation statistics) to go on
/// meta-training under `config` (`train --init`: another loss weighting or schedule from a
/// trained editor, with a fresh optimiser). `config` must give the network the same shape
/// (rank, hidden layers, mode, sharing) and edit the same weights.
pub fn init_editor(dir: &Path, engine: &Engine, config: &MendConfig) -> Result<Editor> {
    let (tensors, meta, path) = read_checked(dir, engine)?;
    editor_from(config, &meta, &tensors, &path, engine)
        .map_err(|e| Error::file(&path, format!("cannot start `init` from this editor under the training config: {e}")))
}

/// The tensors and description of the editor in `dir`, refused when it was trained for
/// another model or edits other weights than `engine`'s.
fn read_checked(dir: &Path, engine: &Engine) -> Result<(BTreeMap<String, Tensor>, EditorMeta, std::path::PathBuf)> {
    let path = dir.join(EDITOR_FILE);
    let (tensors, raw) = read_safetensors(&path)?;
    let meta: EditorMeta = read_meta(&path, &raw)?;
    if meta.format != FORMAT {
        return Err(Error::file(&path, format!("unknown editor format {:?} (expected {FORMAT})", meta.format)));
    }
    let fp = ModelFingerprint::of(engine)?;
    let mismatch = |what: String| {
        Error::file(&path, format!("editor was trained for another model ({}): {what}", meta.model_dir))
    };
    if fp.architecture != meta.model.architecture
        || fp.vocab_size != meta.model.vocab_size
        || fp.hidden_size != meta.model.hidden_size
        || fp.n_layers != meta.model.n_layers
    {
        return Err(mismatch(format!(
            "it expects {} (hidden {}, {} layers, vocab {}), the model is {} (hidden {}, {} layers, vocab {})",
            meta.model.architecture,
            meta.model.hidden_size,
            meta.model.n_layers,
            meta.model.vocab_size,
            fp.architecture,
            fp.hidden_size,
            fp.n_layers,
            fp.vocab_size
        )));
    }
    let names: Vec<&String> = meta.params.iter().map(|p| &p.name).collect();
    let ours: Vec<&String> = engine.edit_params.iter().map(|p| &p.name).collect();
    if names != ours || meta.params != engine.edit_params {
        return Err(mismatch(format!("it edits {names:?}, this run edits {ours:?}")));
    }
    // A model loaded in bf16/f16 has rounded weights: their sums drift by ~1e-3 relative.
    let tol = match engine.lm.params.kind() {
        tch::Kind::BFloat16 | tch::Kind::Half => 1e-2,
        _ => 1e-3,
    };
    for (name, sum) in &meta.model.weight_sums {
        let now = fp.weight_sums.get(name).copied().unwrap_or(f64::NAN);
        if (now - sum).abs() > tol * (1.0 + sum.abs()) {
            tracing::warn!(param = %name, trained = sum, now, "edited weight differs from the one the editor was trained on (an edited or different checkpoint?)");
        }
    }
    Ok((tensors, meta, path))
}

/// An editor for `config` holding the saved `tensors` of the checkpoint at `path`.
fn editor_from(config: &MendConfig, meta: &EditorMeta, tensors: &BTreeMap<String, Tensor>, path: &Path, engine: &Engine) -> Result<Editor> {
    // Seed 0: the random init is overwritten by the saved tensors below.
    let mut editor = Editor::new(config, meta.params.clone(), engine.plan.main, 0)?;
    editor.load_tensors(tensors, &meta.stats_counts).map_err(|e| Error::file(path, e.to_string()))?;
    editor.product_kind = Editor::products_for(engine.lm.params.kind(), editor.device());
    Ok(editor)
}

/// Loop counters saved with the optimiser state.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct TrainCounters {
    pub step: usize,
    pub adam_step: i64,
    pub best_val: f64,
    /// The criterion `best_val` was measured by (absent in states saved before it was
    /// recorded): a resumed run with another `select_by` cannot compare against it.
    #[serde(default)]
    pub best_val_by: Option<SelectBy>,
    pub stale_validations: usize,
    pub skipped_steps: usize,
    pub seed: i64,
}

/// Writes the full training state (editor + Adam moments + counters) for `--resume`.
pub fn save_state(dir: &Path, editor: &Editor, adam: &super::optim::Adam, counters: &TrainCounters) -> Result<()> {
    let (stats, stats_counts) = editor.named_stats();
    let mut tensors = editor.named_tensors();
    tensors.extend(stats);
    tensors.extend(adam.state());
    // The config is kept so that `--resume` can refuse to continue with another one.
    let meta = serde_json::json!({ "counters": counters, "stats_counts": stats_counts, "config": editor.config });
    write_safetensors(&dir.join(STATE_FILE), &tensors, meta_map(&meta)?)
}

/// The config keys a resumed run may change: how long it runs, how it selects and stops,
/// and memory-only settings. Any other key changes what the saved steps meant.
pub const RESUME_MAY_CHANGE: [&str; 6] = ["max_steps", "early_stop_patience", "select_by", "recompute", "max_bad_steps", "ls"];

/// The keys of `now` that differ from `saved` (outside [`RESUME_MAY_CHANGE`]), each as
/// `key (saved X, now Y)`.
fn config_changes(saved: &MendConfig, now: &MendConfig) -> Vec<String> {
    let (Ok(serde_json::Value::Object(a)), Ok(serde_json::Value::Object(b))) = (serde_json::to_value(saved), serde_json::to_value(now)) else {
        return Vec::new();
    };
    a.iter()
        .filter(|(k, _)| !RESUME_MAY_CHANGE.contains(&k.as_str()))
        .filter_map(|(k, v)| {
            let w = b.get(k).unwrap_or(&serde_json::Value::Null);
            (v != w).then(|| format!("{k} (saved {v}, now {w})"))
        })
        .collect()
}

/// Restores editor tensors and returns the saved tensors (for the optimiser) and counters.
pub fn load_state(dir: &Path, editor: &mut Editor) -> Result<(BTreeMap<String, Tensor>, TrainCounters)> {
    let path = dir.join(STATE_FILE);
    let (tensors, raw) = read_safetensors(&path)?;
    #[derive(Deserialize)]
    struct Meta {
        counters: TrainCounters,
        stats_counts: BTreeMap<String, f64>,
        /// Absent in states saved before it was recorded (then nothing is compared).
        #[serde(default)]
        config: Option<MendConfig>,
    }
    let meta: Meta = read_meta(&path, &raw)?;
    match &meta.config {
        Some(saved) => {
            let changed = config_changes(saved, &editor.config);
            if !changed.is_empty() {
                return Err(Error::file(
                    &path,
                    format!(
                        "`resume` continues the saved run, which had another config: {}; only {} may change. \
                         Use the saved values, or train into another `out`",
                        changed.join(", "),
                        RESUME_MAY_CHANGE.join(", ")
                    ),
                ));
            }
        }
        None => tracing::warn!(path = %path.display(), "the saved training state does not record its config: resuming without checking it"),
    }
    editor.load_tensors(&tensors, &meta.stats_counts).map_err(|e| {
        Error::file(&path, format!("{e}: the saved training state was made for another model or editor config (rank, n_hidden, mode, shared, edit_params), so `resume` cannot continue it"))
    })?;
    let tensors = tensors.into_iter().map(|(k, v)| (k, v.to_device(Device::Cpu))).collect();
    Ok((tensors, meta.counters))
}
