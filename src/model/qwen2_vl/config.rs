//! `config.json` of `Qwen2VLForConditionalGeneration` / `Qwen2_5_VLForConditionalGeneration`
//! in both layouts:
//!
//! - the released checkpoints' flat one: text fields at the top level, `rope_theta`,
//!   `rope_scaling: {type: "mrope", mrope_section}`, a `vision_config`;
//! - the nested one transformers 5 writes: `text_config` (with `rope_parameters`
//!   holding `rope_theta` and `mrope_section`), `vision_config`, token ids at the top.
use serde::Deserialize;
use serde_json::Value;

use crate::model::llama::LlamaConfig;
use crate::model::{check_sizes, MAX_LAYERS, MAX_WIDTH};
use crate::model::vision::VisionTokens;
use crate::{Error, Result};

/// Which of the two VL families a config describes; they differ only in the vision tower.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub enum VlFamily {
    /// Qwen2-VL: LayerNorm + GELU-MLP vision blocks, full attention per image.
    Qwen2Vl,
    /// Qwen2.5-VL: RMSNorm + SwiGLU vision blocks, window attention except in
    /// `fullatt_block_indexes`.
    Qwen25Vl,
}

impl VlFamily {
    pub fn from_architecture(arch: &str) -> Option<Self> {
        match arch {
            "Qwen2VLForConditionalGeneration" => Some(VlFamily::Qwen2Vl),
            "Qwen2_5_VLForConditionalGeneration" => Some(VlFamily::Qwen25Vl),
            _ => None,
        }
    }
}

/// Activation of the vision MLP, as `vision_config.hidden_act` spells it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum VisionAct {
    /// `x·σ(1.702x)` (Qwen2-VL's default).
    QuickGelu,
    /// The exact (erf) GELU.
    Gelu,
    /// GELU with the tanh approximation.
    GeluPytorchTanh,
    /// SiLU (Qwen2.5-VL's default).
    Silu,
}

impl VisionAct {
    pub fn apply(self, x: &tch::Tensor) -> tch::Tensor {
        match self {
            VisionAct::QuickGelu => x * (x * 1.702).sigmoid(),
            VisionAct::Gelu => x.gelu("none"),
            VisionAct::GeluPytorchTanh => x.gelu("tanh"),
            VisionAct::Silu => x.silu(),
        }
    }
}

fn d_in_channels() -> i64 {
    3
}
fn d_patch() -> i64 {
    14
}
fn d_temporal() -> i64 {
    2
}
fn d_merge() -> i64 {
    2
}
fn d_quick_gelu() -> VisionAct {
    VisionAct::QuickGelu
}
fn d_silu() -> VisionAct {
    VisionAct::Silu
}
fn d_window() -> i64 {
    112
}
fn d_fullatt() -> Vec<i64> {
    vec![7, 15, 23, 31]
}

/// The `vision_config` fields both towers name and default alike.
#[derive(Debug, Clone, Deserialize)]
struct PatchFieldsRaw {
    #[serde(default = "d_in_channels")]
    in_channels: i64,
    #[serde(default = "d_patch")]
    patch_size: i64,
    #[serde(default = "d_temporal")]
    temporal_patch_size: i64,
    #[serde(default = "d_merge")]
    spatial_merge_size: i64,
    #[serde(default)]
    rope_parameters: Option<Value>,
}

/// Qwen2-VL's `vision_config`.
#[derive(Debug, Clone, Deserialize)]
struct Qwen2VlVisionRaw {
    depth: i64,
    embed_dim: i64,
    /// Output width of the PatchMerger (the text model's hidden size).
    hidden_size: i64,
    mlp_ratio: f64,
    num_heads: i64,
    #[serde(default = "d_quick_gelu")]
    hidden_act: VisionAct,
    #[serde(flatten)]
    patches: PatchFieldsRaw,
}

/// Qwen2.5-VL's `vision_config`.
#[derive(Debug, Clone, Deserialize)]
struct Qwen25VlVisionRaw {
    depth: i64,
    /// The tower's own width.
    hidden_size: i64,
    intermediate_size: i64,
    num_heads: i64,
    /// Output width of the PatchMerger.
    out_hidden_size: i64,
    #[serde(default = "d_silu")]
    hidden_act: VisionAct,
    #[serde(default = "d_window")]
    window_size: i64,
    #[serde(default = "d_fullatt")]
    fullatt_block_indexes: Vec<i64>,
    #[serde(flatten)]
    patches: PatchFieldsRaw,
}

/// The vision tower's shape, family-independent.
#[derive(Debug, Clone, serde::Serialize)]
pub struct VisionConfig {
    pub family: VlFamily,
    pub depth: i64,
    /// Width of the tower's blocks (`embed_dim` / `hidden_size`).
    pub width: i64,
    pub num_heads: i64,
    /// Hidden width of each block's MLP.
    pub mlp_hidden: i64,
    /// Width of the merged image tokens (= the text model's hidden size).
    pub out_dim: i64,
    pub act: VisionAct,
    pub in_channels: i64,
    pub patch_size: i64,
    pub temporal_patch_size: i64,
    pub spatial_merge_size: i64,
    /// Qwen2.5-VL: window side in pixels; `None` for Qwen2-VL (full attention everywhere).
    pub window_size: Option<i64>,
    /// Qwen2.5-VL: the blocks that attend over the whole image.
    pub fullatt_block_indexes: Vec<i64>,
    /// Base of the 2-D rotary frequencies.
    pub rope_theta: f64,
}

impl VisionConfig {
    pub fn head_dim(&self) -> i64 {
        self.width / self.num_heads
    }
    /// Values per flattened patch: `C · temporal_patch · patch · patch` (1176 for 3·2·14·14).
    pub fn patch_dim(&self) -> i64 {
        self.in_channels * self.temporal_patch_size * self.patch_size * self.patch_size
    }
    /// Patches merged into one text token (`spatial_merge_size²`).
    pub fn merge_unit(&self) -> i64 {
        self.spatial_merge_size * self.spatial_merge_size
    }
}


/// Everything a VL `config.json` says that the forward uses.
#[derive(Debug, Clone)]
pub struct Qwen2VlConfig {
    pub family: VlFamily,
    /// The text decoder's fields, as the LLaMA/Qwen2 block reads them.
    pub text: LlamaConfig,
    pub vision: VisionConfig,
    /// Frequencies (of head_dim/2) taken from the temporal, height and width streams.
    pub mrope_section: [i64; 3],
    pub rope_theta: f64,
    pub tokens: VisionTokens,
}

fn get_i64(v: &Value, key: &str) -> Option<i64> {
    v.get(key).and_then(Value::as_i64)
}

/// Names of one vision-config field that configs write under two names: the one read,
/// and the other spelling. transformers keeps an unknown spelling as an extra attribute
/// and writes both (a released config's `in_chans` comes back as `in_chans` *and*
/// `in_channels`), and its `attribute_map` accepts `num_attention_heads` /
/// `num_hidden_layers` for `num_heads` / `depth`.
const VISION_ALIASES: &[(&str, &str)] = &[
    ("in_channels", "in_chans"),
    ("num_heads", "num_attention_heads"),
    ("depth", "num_hidden_layers"),
    ("patch_size", "spatial_patch_size"),
];

/// Qwen2.5-VL's tower width is `hidden_size`; a config that also writes `embed_dim`
/// (Qwen2-VL's name for it) must agree. (In Qwen2-VL the two are different fields.)
const QWEN25_VISION_ALIASES: &[(&str, &str)] = &[("hidden_size", "embed_dim")];

/// Folds each `(name, other)` pair of `obj` into `name`: either spelling alone is taken,
/// both are accepted when equal, and an error names both values when they differ.
fn merge_aliases(obj: &mut serde_json::Map<String, Value>, section: &str, pairs: &[(&str, &str)]) -> Result<()> {
    for &(name, other) in pairs {
        let Some(v) = obj.remove(other) else { continue };
        match obj.get(name) {
            None => {
                obj.insert(name.to_string(), v);
            }
            Some(w) if same_value(w, &v) => {}
            Some(w) => {
                return Err(Error::input(format!(
                    "{section}.{name} = {w} and {section}.{other} = {v} disagree (two names of one field; they must be equal or only one given)"
                )))
            }
        }
    }
    Ok(())
}

/// JSON equality with numbers compared by value (`3` and `3.0` agree).
fn same_value(a: &Value, b: &Value) -> bool {
    match (a.as_f64(), b.as_f64()) {
        (Some(x), Some(y)) => x == y,
        _ => a == b,
    }
}

/// Fields of the text model that a nested config may also carry at its top level (old
/// transformers kept them there; hand-edited configs do): they must agree with
/// `text_config`, which is what transformers reads.
const TEXT_DUPLICATES: &[&str] = &[
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "max_position_embeddings",
    "rms_norm_eps",
    "rope_theta",
];

impl Qwen2VlConfig {
    /// Parses either layout. Errors are plain messages; the caller names the file.
    pub fn from_json(json: &Value, family: VlFamily) -> Result<Self> {
        // Nested layout: the text fields live in text_config; the flat one has them at the top.
        let nested = json.get("text_config").filter(|t| t.is_object());
        if let Some(n) = nested {
            check_text_duplicates(json, n)?;
        }
        let (text, mrope_section, theta) = text_config(json, nested)?;
        let vision = VisionConfig::from_json(json, family)?;
        if vision.out_dim != text.hidden_size {
            return Err(Error::input(format!(
                "vision_config output width {} differs from the text hidden_size {}",
                vision.out_dim, text.hidden_size
            )));
        }
        let tokens = VisionTokens::from_json(json, nested, text.vocab_size)?;
        Ok(Self { family, text, vision, mrope_section, rope_theta: theta, tokens })
    }
}

/// The fields a nested config also carries at its top level must agree with `text_config`.
fn check_text_duplicates(json: &Value, nested: &Value) -> Result<()> {
    for key in TEXT_DUPLICATES {
        if let (Some(a), Some(b)) = (json.get(*key), nested.get(*key)) {
            if !a.is_null() && !b.is_null() && !same_value(a, b) {
                return Err(Error::input(format!("{key} = {a} at the top level and text_config.{key} = {b} disagree")));
            }
        }
    }
    Ok(())
}

/// The text decoder's config (from `text_config` when `nested`, else the top level), its
/// M-RoPE sections checked against the head dim, and the rotary base.
fn text_config(json: &Value, nested: Option<&Value>) -> Result<(LlamaConfig, [i64; 3], f64)> {
    let mut text_json = nested.cloned().unwrap_or_else(|| json.clone());
    let (section, theta) = mrope_fields(&text_json)?;
    if let Some(obj) = text_json.as_object_mut() {
        obj.remove("rope_scaling");
        obj.remove("rope_parameters");
        obj.remove("rope_theta");
        if obj.get("use_sliding_window").and_then(Value::as_bool) == Some(true) {
            return Err(Error::input("use_sliding_window = true is not supported"));
        }
    }
    let mut text: LlamaConfig = serde_json::from_value(text_json).map_err(|e| Error::input(format!("invalid text config: {e}")))?;
    let theta = theta.unwrap_or(1_000_000.0);
    text.rope_theta = Some(theta);
    // transformers ties the head when either level says so.
    let tie_top = json.get("tie_word_embeddings").and_then(Value::as_bool);
    text.tie_word_embeddings = match (nested.is_some(), tie_top) {
        (true, Some(t)) => t || text.tie_word_embeddings,
        (_, Some(t)) => t,
        (_, None) => text.tie_word_embeddings,
    };
    let head_dim = text.head_dim.unwrap_or(text.hidden_size / text.num_attention_heads.max(1));
    let section = section.unwrap_or_else(|| vec![16, 24, 24]);
    let mrope_section: [i64; 3] = section
        .clone()
        .try_into()
        .map_err(|_| Error::input(format!("mrope_section {section:?} must have 3 entries (temporal, height, width)")))?;
    if mrope_section.iter().any(|&s| s < 0) || mrope_section.iter().sum::<i64>() * 2 != head_dim {
        return Err(Error::input(format!(
            "mrope_section {section:?} must sum to head_dim / 2 = {} (head_dim {head_dim})",
            head_dim / 2
        )));
    }
    Ok((text, mrope_section, theta))
}

/// `mrope_section` and `rope_theta` of the text fields: rope_scaling {type: mrope} /
/// rope_parameters {rope_type: default, mrope_section} is M-RoPE, which this module applies
/// itself (the caller then hides them from the plain-RoPE checks). Each may be given in
/// several places, which must agree.
fn mrope_fields(text_json: &Value) -> Result<(Option<Vec<i64>>, Option<f64>)> {
    let rope = ["rope_scaling", "rope_parameters"].iter().filter_map(|k| text_json.get(*k).filter(|v| v.is_object()));
    let mut section: Option<Vec<i64>> = None;
    let mut theta = text_json.get("rope_theta").and_then(Value::as_f64);
    for r in rope {
        let kind = r.get("rope_type").or_else(|| r.get("type")).and_then(Value::as_str).unwrap_or("default");
        if kind != "mrope" && kind != "default" {
            return Err(Error::input(format!("rope scaling of type {kind:?} is not supported (expected mrope)")));
        }
        if let Some(s) = r.get("mrope_section") {
            let s: Vec<i64> = serde_json::from_value(s.clone()).map_err(|e| Error::input(format!("mrope_section is not a list of integers: {e}")))?;
            if let Some(prev) = section.as_ref().filter(|p| **p != s) {
                return Err(Error::input(format!(
                    "mrope_section is given twice and disagrees: {prev:?} (rope_scaling) and {s:?} (rope_parameters)"
                )));
            }
            section = Some(s);
        }
        if let Some(t) = r.get("rope_theta").and_then(Value::as_f64) {
            if let Some(prev) = theta.filter(|&p| p != t) {
                return Err(Error::input(format!("rope_theta = {prev} and rope_parameters.rope_theta = {t} disagree")));
            }
            theta = Some(t);
        }
    }
    Ok((section, theta))
}

impl VisionConfig {
    /// The tower of `family` from `json`'s `vision_config` (aliases merged), with its sizes
    /// checked.
    fn from_json(json: &Value, family: VlFamily) -> Result<Self> {
        let mut vc = json.get("vision_config").filter(|v| v.is_object()).cloned().ok_or_else(|| {
            Error::input("no \"vision_config\" object: a vision-language config needs the vision tower's description")
        })?;
        if let Some(obj) = vc.as_object_mut() {
            merge_aliases(obj, "vision_config", VISION_ALIASES)?;
            if family == VlFamily::Qwen25Vl {
                merge_aliases(obj, "vision_config", QWEN25_VISION_ALIASES)?;
            }
        }
        let bad = |e: serde_json::Error| Error::input(format!("invalid vision_config: {e}"));
        let (depth, width, num_heads, mlp_hidden, out_dim, act, patches, window_size, fullatt_block_indexes) = match family {
            VlFamily::Qwen2Vl => {
                let r: Qwen2VlVisionRaw = serde_json::from_value(vc).map_err(bad)?;
                let mlp_hidden = (r.embed_dim as f64 * r.mlp_ratio) as i64;
                (r.depth, r.embed_dim, r.num_heads, mlp_hidden, r.hidden_size, r.hidden_act, r.patches, None, Vec::new())
            }
            VlFamily::Qwen25Vl => {
                let r: Qwen25VlVisionRaw = serde_json::from_value(vc).map_err(bad)?;
                let (w, full) = (Some(r.window_size), r.fullatt_block_indexes);
                (r.depth, r.hidden_size, r.num_heads, r.intermediate_size, r.out_hidden_size, r.hidden_act, r.patches, w, full)
            }
        };
        let rope_theta = patches.rope_parameters.as_ref().and_then(|r| r.get("rope_theta")).and_then(Value::as_f64).unwrap_or(10_000.0);
        let v = VisionConfig {
            family,
            depth,
            width,
            num_heads,
            mlp_hidden,
            out_dim,
            act,
            in_channels: patches.in_channels,
            patch_size: patches.patch_size,
            temporal_patch_size: patches.temporal_patch_size,
            spatial_merge_size: patches.spatial_merge_size,
            window_size,
            fullatt_block_indexes,
            rope_theta,
        };
        v.check()?;
        Ok(v)
    }

    /// Sizes in range, a head dim the 2-D rotary can split, a window made of whole merged
    /// patches, full-attention blocks that exist.
    fn check(&self) -> Result<()> {
        let v = self;
        check_sizes(&[
            ("vision_config.depth", v.depth, MAX_LAYERS),
            ("vision_config width", v.width, MAX_WIDTH),
            ("vision_config.num_heads", v.num_heads, MAX_LAYERS),
            ("vision_config MLP width", v.mlp_hidden, MAX_WIDTH),
            ("vision_config output width", v.out_dim, MAX_WIDTH),
            ("vision_config.in_channels", v.in_channels, 16),
            ("vision_config.patch_size", v.patch_size, 1024),
            ("vision_config.temporal_patch_size", v.temporal_patch_size, 64),
            ("vision_config.spatial_merge_size", v.spatial_merge_size, 64),
        ])?;
        if v.width % v.num_heads != 0 || v.head_dim() % 4 != 0 {
            return Err(Error::input(format!(
                "vision width {} / num_heads {} must give a head dim divisible by 4 (2-D rotary)",
                v.width, v.num_heads
            )));
        }
        if let Some(w) = v.window_size {
            let unit = v.spatial_merge_size * v.patch_size;
            if w < unit || w % unit != 0 {
                return Err(Error::input(format!(
                    "vision_config.window_size {w} must be a positive multiple of spatial_merge_size · patch_size = {unit}"
                )));
            }
        }
        if let Some(&b) = v.fullatt_block_indexes.iter().find(|&&b| b < 0 || b >= v.depth) {
            return Err(Error::input(format!("fullatt_block_indexes names block {b}, but depth is {}", v.depth)));
        }
        Ok(())
    }
}

impl VisionTokens {
    /// The image marker ids (top level or `text_config`, which must agree; Qwen2-VL's ids
    /// when absent), each inside the vocabulary of `vocab` and distinct from the others and
    /// from the video pad.
    fn from_json(json: &Value, nested: Option<&Value>, vocab: i64) -> Result<Self> {
        let top = |k: &str| -> Result<Option<i64>> {
            match (get_i64(json, k), nested.and_then(|n| get_i64(n, k))) {
                (Some(a), Some(b)) if a != b => {
                    Err(Error::input(format!("{k} = {a} at the top level and text_config.{k} = {b} disagree")))
                }
                (a, b) => Ok(a.or(b)),
            }
        };
        let tokens = VisionTokens {
            image_pad: top("image_token_id")?.unwrap_or(151655),
            vision_start: top("vision_start_token_id")?.unwrap_or(151652),
            vision_end: top("vision_end_token_id")?.unwrap_or(151653),
        };
        let mut named = vec![("image_token_id", tokens.image_pad), ("vision_start_token_id", tokens.vision_start), ("vision_end_token_id", tokens.vision_end)];
        // The video pad is never put in a prompt here, but an image pad equal to it would
        // make transformers read image tokens as video ones.
        if let Some(v) = top("video_token_id")? {
            named.push(("video_token_id", v));
        }
        for &(name, id) in &named {
            if !(0..vocab).contains(&id) {
                return Err(Error::input(format!("{name} = {id} is outside the vocabulary of {vocab}")));
            }
        }
        for (i, &(a, ia)) in named.iter().enumerate() {
            if let Some(&(b, _)) = named[i + 1..].iter().find(|(_, ib)| *ib == ia) {
                return Err(Error::input(format!(
                    "{a} and {b} are both {ia}: the image markers must be distinct tokens (a prompt would be malformed)"
                )));
            }
        }
        Ok(tokens)
    }
}
