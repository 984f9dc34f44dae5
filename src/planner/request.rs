//! What `plan` is asked, one type for every interface: the CLI flattens it into `plan`'s
//! flags, the Python package's `plan` takes its fields as keyword arguments, JSON as keys.
//! It is checked here, once, and its errors name its fields (`image_size`, the flag
//! `--image-size`, the keyword `image_size=`).
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use super::data::{data_shape, DEFAULT_PERCENTILE};
use super::types::PlanOptions;
use super::verdict::{self, Headroom, PlanQuestion};
use crate::config::MendConfig;
use crate::data::easyedit::{dataset_parser, DatasetKind};
use crate::device::{DeviceRequest, OptimizerDevice};
use crate::model::vision::{parse_image_size, ImageProcessorConfig};
use crate::model::Dtype;
use crate::{Error, Result};

/// A `plan` question: the model's config.json, a MEND configuration and the devices.
#[derive(Debug, Clone, Serialize, Deserialize, clap::Args)]
pub struct PlanRequest {
    /// Model directory; only its config.json is read (no weights needed).
    #[arg(long)]
    pub model: PathBuf,
    /// MEND hyper-parameters: JSON (see configs/), or an EasyEdit MEND hparams YAML as it is
    /// (`dualedit config --from-easyedit` shows what it becomes).
    #[arg(long)]
    pub config: PathBuf,
    /// The devices planned for (they need not exist on this machine).
    #[command(flatten)]
    #[serde(flatten)]
    pub devices: DeviceRequest,
    /// The weights' dtype planned for, f32, bf16 or f16 (the editor's maths is f32 in any
    /// case); by default what a run takes: config.json's `torch_dtype`, else f32.
    #[arg(long, value_enum)]
    #[serde(default)]
    pub dtype: Option<Dtype>,
    /// With --max-memory: the share of each cap kept free for the planner's own error and
    /// the allocator's fragmentation (a placement fits when its peak is at most cap x (1 -
    /// margin) - reserve). Default 10%.
    #[arg(long)]
    #[serde(default)]
    pub margin: Option<String>,
    /// With --max-memory: bytes kept free on each CUDA device for its context (cuBLAS,
    /// kernels) before any tensor. Default 512MiB.
    #[arg(long)]
    #[serde(default)]
    pub reserve: Option<String>,
    /// Card sizes to try, e.g. 16GiB,24GiB,40GiB,80GiB: the smallest on which the run fits on
    /// one card and on two (with the placement and each device's peak), by the same rule as
    /// --max-memory.
    #[arg(long)]
    #[serde(default)]
    pub fit: Option<String>,
    /// The user's records (with --ds): tokens per example, labelled positions and image
    /// sizes are taken from them (at --percentile) instead of upper bounds; flags given
    /// explicitly still win. Tokenised with --model's tokenizer.json.
    #[arg(long)]
    #[serde(default)]
    pub data: Option<PathBuf>,
    /// --data --ds vqa|caption: where the records' images are.
    #[arg(long)]
    #[serde(default)]
    pub image_root: Option<PathBuf>,
    /// --data: the percentile of the records planned for; 100 (the default) is the longest
    /// record, which with a batch of one sets a step's peak.
    #[arg(long, default_value_t = DEFAULT_PERCENTILE)]
    #[serde(default = "default_percentile")]
    pub percentile: f64,
    /// Tokens per example (default: the config's max_length, capped at the model's context).
    #[arg(long)]
    #[serde(default)]
    pub max_length: Option<usize>,
    /// Labelled positions per example (default: all but the first, an upper bound).
    #[arg(long)]
    #[serde(default)]
    pub kept_tokens: Option<i64>,
    /// Vision-language models: the image each example shows, WIDTHxHEIGHT pixels. Plans
    /// EasyEdit's five multimodal views (implies --ds vqa): --max-length is the text of the
    /// image views, to which the image's tokens are added; the vision tower's forward is
    /// planned once per distinct image.
    #[arg(long, value_parser = parse_image_size)]
    #[serde(default)]
    pub image_size: Option<(i64, i64)>,
    /// The data planned for: zsre or counterfact (text: edit_inner, edit_outer, loc) or
    /// vqa or caption (the five multimodal views; needs --image-size).
    #[arg(long, value_parser = dataset_parser())]
    #[serde(default)]
    pub ds: Option<DatasetKind>,
    /// --ds vqa|caption: tokens of the text-only locality question (E-VQA's NQ `loc`
    /// view; default --max-length).
    #[arg(long)]
    #[serde(default)]
    pub loc_length: Option<i64>,
}

fn default_percentile() -> f64 {
    DEFAULT_PERCENTILE
}

impl PlanRequest {
    /// Its fields (the flags' ids), the device request's included: what a reader of keyword
    /// arguments checks unknown keys against (serde's `flatten` cannot refuse them).
    pub fn fields() -> Vec<String> {
        let cmd = <Self as clap::Args>::augment_args(clap::Command::new("fields"));
        cmd.get_arguments().map(|a| a.get_id().to_string()).collect()
    }

    /// `plan`'s answer (text, or with `json` one JSON object) and, when no placement fits
    /// the caps, the one line it exits non-zero with.
    pub fn answer(&self, json: bool) -> Result<(String, Option<String>)> {
        let config = MendConfig::from_file(&self.config)?;
        let tokens = self.max_length.unwrap_or(config.max_length) as i64;
        let d = &self.devices;
        if !self.model.is_dir() {
            return Err(Error::file(&self.model, "model directory not found"));
        }
        if self.ds == Some(DatasetKind::Requests) {
            return Err(Error::input("`ds` must be zsre, counterfact, vqa or caption"));
        }
        if let Some((w, h)) = self.image_size.filter(|&(w, h)| w < 1 || h < 1) {
            return Err(Error::input(format!("`image_size` {w}x{h}: both sides must be at least 1 pixel")));
        }
        let (dtype, dtype_source) = verdict::planned_dtype(&self.model, self.dtype)?;
        let mut opts = PlanOptions::new(&d.device, d.sub_device.as_deref(), dtype, tokens, self.kept_tokens)?;
        opts.headroom = Headroom::parse(self.margin.as_deref(), self.reserve.as_deref())?;
        opts.caps = d.max_memory.clone().unwrap_or_default();
        opts.optimizer = d.optimizer_device.unwrap_or_default();
        if opts.optimizer == OptimizerDevice::Sub && !opts.split {
            // As `train` refuses it: planning the moments "on sub" of a one-device run would
            // plan them on main without a word.
            return Err(Error::input(
                "`optimizer_device`=sub needs a `sub_device` other than `device` (this plan has one device): leave `optimizer_device` out or give a sub-device",
            ));
        }
        opts.image = self.image_size;
        opts.loc_tokens = self.loc_length;
        if let Some(ds) = self.ds {
            match (ds.is_multimodal(), self.image_size) {
                (true, None) if self.data.is_none() => {
                    return Err(Error::input(format!(
                        "`ds`={ds} plans images: give `image_size`=WIDTHxHEIGHT (e.g. 640x480 for a COCO photo), or `data`"
                    )))
                }
                (false, Some(_)) => {
                    return Err(Error::input(format!("`ds`={ds} is text-only: `image_size` plans the multimodal views (`ds` vqa or caption)")))
                }
                _ => {}
            }
        }
        if self.loc_length.is_some() && self.image_size.is_none() {
            return Err(Error::input("`loc_length` is the text-only locality view of `ds` vqa or caption: give `image_size`"));
        }
        let (model, _) = crate::model::loader::read_config(&self.model)?;
        let data = match (&self.data, self.ds) {
            (Some(file), Some(ds)) => {
                let d = data_shape(&self.model, &model, file, ds, self.image_root.as_deref(), self.percentile)?;
                opts.tokens = self.max_length.map_or(d.text_tokens.at_percentile, |t| t as i64);
                opts.kept = self.kept_tokens.or(Some(d.labelled.at_percentile));
                opts.image = self.image_size.or(d.image_at_percentile);
                opts.loc_tokens = self.loc_length.or(d.loc_tokens.map(|l| l.at_percentile));
                Some(d)
            }
            (Some(_), None) => return Err(Error::input("`data`: give `ds` (zsre, counterfact, vqa or caption) to read it")),
            (None, _) => None,
        };
        if opts.image.is_some() && model.family().vision_language().is_some() {
            opts.image_processor = ImageProcessorConfig::load(&self.model.join("preprocessor_config.json"))?;
        }
        let question = PlanQuestion {
            placement: d.placement,
            dtype_source,
            fit: self.fit.as_deref().map(verdict::parse_sizes).transpose()?,
            // `fit` with a CPU sub-device: one card and the host's memory.
            fit_host: (d.sub_device.is_some() && opts.chain.is_empty() && opts.sub.starts_with("cpu")).then(|| opts.sub.clone()),
            data,
            json,
        };
        verdict::answer(&model, &config, &opts, &question)
    }
}
