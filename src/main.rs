//! The `dualedit` command line: parsing and calling the library, nothing else.
use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Args, Parser, Subcommand, ValueEnum};

use dualedit::config::MendConfig;
use dualedit::data::examples::OverLong;
use dualedit::data::DatasetKind;
use dualedit::device::{DevicePlan, MaxMemory, OptimizerDevice, Placement, PlacementRequest};
use dualedit::planner::Phase;
use dualedit::edit::{LoadOptions, MethodSpec};
use dualedit::model::{load_model, parse_dtype, ParamView};
use dualedit::run::{self, Common, EditOptions, EvalOptions, TrainOptions};

#[derive(Parser)]
#[command(name = "dualedit", version, about = "MEND knowledge editing of causal LMs on one or two devices")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Print each next token's log-probability and the mean NLL of a text.
    Score(ScoreArgs),
    /// Meta-train a MEND editor on EasyEdit data.
    Train(TrainArgs),
    /// Apply edit requests with a trained editor and report their metrics.
    Edit(EditArgs),
    /// Edit each record of a dataset from the unedited model and report EasyEdit's metrics.
    Eval(EvalArgs),
    /// Run the same train or eval on the main device alone and split over main + sub,
    /// and write one side-by-side report.
    #[command(subcommand)]
    Compare(CompareCmd),
    /// Show the product on the embedded default: a few edits, held-out metrics, memory.
    Demo(DemoArgs),
    /// Pretrain a small GPT-2 from scratch on the facts of EasyEdit datasets.
    Pretrain(PretrainArgs),
    /// Rebuild the embedded default: synthetic world, tiny pretrained GPT-2, its editor.
    BuildDefault(BuildDefaultArgs),
    /// Write a synthetic world's files, training nothing: the text world (facts, corpus,
    /// CounterFact-shaped edits) or, with --vl, the visual world (PNG scenes, E-VQA records).
    World(WorldArgs),
    /// Serve edit / score / generate / reset / save as JSON over HTTP (loopback by default).
    Serve(ServeArgs),
    /// Estimate each device's peak memory for training and editing from config.json alone.
    Plan(PlanArgs),
}

/// Where a run puts its work: the same flags on every command.
#[derive(Args, Clone)]
struct DeviceArgs {
    /// Main device: frozen model, editor, optimiser (cpu, cuda, cuda:N).
    #[arg(long, default_value = "cpu")]
    device: String,
    /// Sub-device for the edited model's forward passes (default: the main device).
    #[arg(long)]
    sub_device: Option<String>,
    /// What lives where (as accelerate's device_map): replica (main: frozen model + editor;
    /// sub: a replica running the edited forwards), balanced (the frozen blocks divided
    /// between main and sub so their peaks balance), auto (the planner picks one that fits
    /// --max-memory). Default: replica; `plan` without it compares them all.
    #[arg(long, value_enum)]
    placement: Option<PlacementRequest>,
    /// Where the editor's Adam moments live and its update is computed (main, sub, cpu):
    /// off the main device, its gradients cross once per optimiser step (ZeRO-Offload).
    #[arg(long, value_enum)]
    optimizer_device: Option<OptimizerDevice>,
    /// Per-device memory caps, e.g. cuda:0=24GiB,cuda:1=24GiB: libtorch's CUDA caching
    /// allocator is capped there (as torch.cuda.set_per_process_memory_fraction), and the
    /// planner plans against the caps.
    #[arg(long, value_parser = parse_max_memory)]
    max_memory: Option<MaxMemory>,
}

fn parse_max_memory(s: &str) -> Result<MaxMemory, String> {
    s.parse().map_err(|e: dualedit::Error| e.to_string())
}

/// What the placement is resolved against: the model's config.json, the MEND config, the
/// weights' dtype, tokens per example and the phase whose peaks matter.
struct PlaceFor<'a> {
    model: &'a std::path::Path,
    config: &'a MendConfig,
    dtype: tch::Kind,
    tokens: i64,
    phase: Phase,
}

impl DeviceArgs {
    /// The main/sub plan with the default placement; both devices must exist here.
    fn plan(&self) -> anyhow::Result<DevicePlan> {
        if self.placement.is_some_and(|p| p != PlacementRequest::Replica) {
            anyhow::bail!("--placement {:?} needs the model and its config here; this command takes --placement replica only", self.placement);
        }
        let plan = DevicePlan::parse(&self.device, self.sub_device.as_deref())?;
        if let Some(caps) = &self.max_memory {
            dualedit::device::memory::apply_caps(caps)?;
        }
        Ok(plan.with_optimizer(self.optimizer_device.unwrap_or_default()))
    }

    /// The plan with `--placement` resolved by the planner against `--max-memory`.
    fn placed(&self, f: &PlaceFor) -> anyhow::Result<DevicePlan> {
        let base = DevicePlan::parse(&self.device, self.sub_device.as_deref())?;
        if let Some(caps) = &self.max_memory {
            dualedit::device::memory::apply_caps(caps)?;
        }
        let query = dualedit::planner::PlacementQuery {
            main: &self.device,
            sub: self.sub_device.as_deref(),
            request: self.placement.unwrap_or_default(),
            optimizer: self.optimizer_device,
            caps: self.max_memory.as_ref(),
            model: f.model,
            config: f.config,
            dtype: f.dtype,
            tokens: f.tokens,
            phase: f.phase,
        };
        let (plan, chosen) = dualedit::planner::resolve_placement(base, &query)?;
        if let Some(label) = chosen {
            eprintln!("placement: {label} (chosen by the planner)");
        }
        Ok(plan)
    }

    /// The one device of a command that runs everything in one place.
    fn single(&self, command: &str) -> anyhow::Result<tch::Device> {
        if self.sub_device.is_some() || self.placement.is_some() || self.optimizer_device.is_some() {
            anyhow::bail!("{command} runs on one device: use --device, not --sub-device, --placement or --optimizer-device");
        }
        if let Some(caps) = &self.max_memory {
            dualedit::device::memory::apply_caps(caps)?;
        }
        Ok(dualedit::device::parse_device(&self.device)?)
    }
}

#[derive(Args)]
struct PlanArgs {
    /// Model directory; only its config.json is read (no weights needed).
    #[arg(long)]
    model: PathBuf,
    /// MEND hyper-parameters (JSON, see configs/).
    #[arg(long)]
    config: PathBuf,
    /// The devices planned for (they need not exist on this machine).
    #[command(flatten)]
    devices: DeviceArgs,
    /// f32, bf16 or f16 for the model weights (editor maths is always f32).
    #[arg(long, default_value = "f32")]
    dtype: String,
    /// Tokens per example (default: the config's max_length, capped at the model's context).
    #[arg(long)]
    max_length: Option<usize>,
    /// Labelled positions per example (default: all but the first, an upper bound).
    #[arg(long)]
    kept_tokens: Option<i64>,
    /// Vision-language models: the image each example shows, WIDTHxHEIGHT pixels. Plans
    /// EasyEdit's five multimodal views (implies --ds vqa): --max-length is the text of the
    /// image views, to which the image's tokens are added; the vision tower's forward is
    /// planned once per distinct image.
    #[arg(long, value_parser = parse_image_size)]
    image_size: Option<(i64, i64)>,
    /// The data planned for: zsre or counterfact (text: edit_inner, edit_outer, loc) or
    /// vqa or caption (the five multimodal views; needs --image-size).
    #[arg(long)]
    ds: Option<String>,
    /// --ds vqa|caption: tokens of the text-only locality question (E-VQA's NQ `loc`
    /// view; default --max-length).
    #[arg(long)]
    loc_length: Option<i64>,
    /// Print exactly one JSON object on stdout.
    #[arg(long)]
    json: bool,
}

#[derive(Subcommand)]
enum CompareCmd {
    /// Compare meta-training runs (outputs under --out/single and --out/dual).
    Train(TrainArgs),
    /// Compare evaluation runs (reports under runs/ or beside --report).
    Eval(EvalArgs),
}

#[derive(Args)]
struct DemoArgs {
    #[command(flatten)]
    devices: DeviceArgs,
    /// Directory of the default (model/, editor/, world/); default: the shipped one.
    #[arg(long)]
    root: Option<PathBuf>,
    /// How many edits to show in words.
    #[arg(long, default_value_t = 3)]
    show: usize,
    /// The multimodal default (data/vl: a tiny Qwen2-VL on the visual world): one held-out
    /// image edit before and after, on the rephrase image and an unrelated image, and the
    /// five held-out metrics.
    #[arg(long)]
    multimodal: bool,
    /// With --multimodal: one JSON object instead of text.
    #[arg(long, requires = "multimodal")]
    json: bool,
}

#[derive(Args)]
struct ServeArgs {
    /// Hugging Face model directory.
    #[arg(long)]
    model: PathBuf,
    /// Trained editor directory (without one, /edit answers 422).
    #[arg(long)]
    editor: Option<PathBuf>,
    #[command(flatten)]
    devices: DeviceArgs,
    /// f32, bf16 or f16 for the model weights.
    #[arg(long, default_value = "f32")]
    dtype: String,
    /// Address to listen on; anything but loopback needs --token (or --insecure-no-token).
    #[arg(long, default_value = dualedit::serve::DEFAULT_LISTEN)]
    listen: String,
    /// Model requests that may wait; more are answered 503.
    #[arg(long, default_value_t = 64)]
    queue: usize,
    /// Largest request body in bytes (413 beyond).
    #[arg(long, default_value_t = 1 << 20)]
    max_body_bytes: usize,
    /// Seconds a model request may wait in the queue before it is answered 503.
    #[arg(long, default_value_t = 60)]
    queue_timeout: u64,
    /// Allow POST /save, writing only to relative paths inside this existing directory
    /// (without it, /save is refused with 403).
    #[arg(long)]
    save_root: Option<PathBuf>,
    /// Allow image paths in requests (/score's `image`, E-VQA /edit requests), read only
    /// at relative paths inside this existing directory (without it, they are refused
    /// with 403; /score's `image_base64` needs no root).
    #[arg(long)]
    image_root: Option<PathBuf>,
    /// Require `Authorization: Bearer TOKEN` on every request (401 otherwise). Default:
    /// $DUALEDIT_TOKEN, which is better than the flag (the process list shows flags).
    #[arg(long)]
    token: Option<String>,
    /// Listen beyond loopback without a token: anyone who can reach the address can edit,
    /// read and (with --save-root) save the model.
    #[arg(long)]
    insecure_no_token: bool,
    /// /edit's commit guard, as `edit`'s (a request may change it for itself).
    #[command(flatten)]
    guard: GuardFlags,
}

#[derive(Args)]
struct PretrainArgs {
    /// EasyEdit files whose facts make the corpus (repeat the flag for several).
    #[arg(long, required_unless_present = "vl")]
    data: Vec<PathBuf>,
    /// zsre, counterfact, vqa or caption (E-VQA / E-IC, with --image-root).
    #[arg(long, required_unless_present = "vl")]
    ds: Option<String>,
    /// Pretrain a tiny Qwen2-VL-shaped model (vision tower included) on a visual world's
    /// pretrain.json (`dualedit world --vl`) instead of a GPT-2 on text; its shape is the
    /// multimodal default's, and of the sizes below only --steps, --batch and --lr apply.
    #[arg(long, requires = "world", conflicts_with_all = ["data", "ds", "with_new_targets"])]
    vl: bool,
    /// The visual world folder (with --vl).
    #[arg(long, requires = "vl")]
    world: Option<PathBuf>,
    /// With --vl: the vision tower's learning rate as a share of --lr (default 1).
    #[arg(long, requires = "vl")]
    vision_lr_scale: Option<f64>,
    /// Output model directory.
    #[arg(long)]
    out: PathBuf,
    /// BPE vocabulary size (at least 257: the 256 byte-level symbols and end-of-text).
    #[arg(long, default_value_t = 4096)]
    vocab: usize,
    /// Width, layers and heads (default 256, 4, 4; with --vl the multimodal default's
    /// text decoder: 96, 2, 4).
    #[arg(long)]
    n_embd: Option<i64>,
    #[arg(long)]
    n_layer: Option<i64>,
    #[arg(long)]
    n_head: Option<i64>,
    #[arg(long, default_value_t = 64)]
    n_positions: i64,
    /// Default 4000 (text) or the multimodal default's 10000 (--vl).
    #[arg(long)]
    steps: Option<usize>,
    #[arg(long, default_value_t = 32)]
    batch: usize,
    /// Default 2e-3 (text) or 3e-4 (--vl).
    #[arg(long)]
    lr: Option<f64>,
    /// Where to train: cpu or cuda:N (the result is the same HF directory either way).
    #[command(flatten)]
    devices: DeviceArgs,
    /// Also put each record's new target in the corpus, alone on its line (never after its
    /// prompt), so the model can write the words edits ask for, as a pretrained LM can.
    #[arg(long)]
    with_new_targets: bool,
}

#[derive(Args)]
struct BuildDefaultArgs {
    /// Output directory (the shipped default lives in data/).
    #[arg(long, default_value = "data")]
    out: PathBuf,
    /// MEND hyper-parameters for the editor.
    #[arg(long, default_value = "configs/world.json")]
    config: PathBuf,
    /// MEND hyper-parameters (and `mend-ls` settings) of the editor for many edits
    /// (written to OUT/editor-many).
    #[arg(long, default_value = "configs/world-many.json")]
    many_config: PathBuf,
    /// Pretraining steps (upper bound; training stops once the model knows its facts).
    #[arg(long)]
    pretrain_steps: Option<usize>,
    /// MEND hyper-parameters for the multimodal default's editor (written to OUT/vl).
    #[arg(long, default_value = "configs/vl-world.json")]
    vl_config: PathBuf,
    /// Build only the text default (`text`), only the multimodal one (`vl`), or only the
    /// text default's editor for many edits (`many`: OUT/editor-many, from the model and
    /// world already in OUT).
    #[arg(long, value_parser = ["text", "vl", "many"])]
    only: Option<String>,
}

#[derive(Args)]
struct WorldArgs {
    /// Output directory. The visual world refuses a non-empty folder that holds no
    /// visual world; EasyEdit's image and rephrase-image roots are both this folder.
    #[arg(long)]
    out: PathBuf,
    /// The visual world: scenes drawn in code, vqa-train.json / vqa-holdout.json (E-VQA
    /// format), pretrain.json, scenes.json, images/ and images_rephrase/.
    #[arg(long)]
    vl: bool,
    /// Seed (default: the shipped world's).
    #[arg(long)]
    seed: Option<u64>,
    /// Visual world: scenes whose records train the editor.
    #[arg(long, requires = "vl")]
    train_scenes: Option<usize>,
    /// Visual world: scenes whose records are held out.
    #[arg(long, requires = "vl")]
    holdout_scenes: Option<usize>,
    /// Visual world: image size WIDTHxHEIGHT, each side an odd multiple of 28 (Qwen2-VL's
    /// merged-token cell) from 84 to 420 (default 84x84).
    #[arg(long, requires = "vl", value_parser = parse_image_size)]
    image_size: Option<(i64, i64)>,
}

#[derive(Args)]
struct ScoreArgs {
    /// Hugging Face model directory (config.json, *.safetensors, tokenizer.json).
    #[arg(long)]
    model: PathBuf,
    /// Text to score.
    #[arg(long)]
    text: String,
    /// An image (PNG or JPEG) shown before the text; vision-language models only.
    #[arg(long)]
    image: Option<PathBuf>,
    #[command(flatten)]
    devices: DeviceArgs,
    /// f32, bf16 or f16.
    #[arg(long, default_value = "f32")]
    dtype: String,
    /// Print exactly one JSON object on stdout.
    #[arg(long)]
    json: bool,
}

/// Model and placement flags shared by train, edit and eval.
#[derive(Args, Clone)]
struct CommonArgs {
    /// Hugging Face model directory.
    #[arg(long)]
    model: PathBuf,
    #[command(flatten)]
    devices: DeviceArgs,
    /// f32, bf16 or f16 for the model weights (editor maths is always f32).
    #[arg(long, default_value = "f32")]
    dtype: String,
    #[arg(long, default_value_t = 0)]
    seed: i64,
    /// Where to write the run report (JSON).
    #[arg(long)]
    report: Option<PathBuf>,
    /// Cut the prompts of records longer than the maximum length from the left until they
    /// fit, instead of skipping those records.
    #[arg(long, conflicts_with = "strict")]
    truncate: bool,
    /// Stop at the first record longer than the maximum length (or, with --ds vqa|caption,
    /// whose image is missing or unreadable), instead of skipping it.
    #[arg(long)]
    strict: bool,
    /// --ds vqa|caption: the folder `image` and `m_loc` are relative to (COCO).
    #[arg(long)]
    image_root: Option<PathBuf>,
    /// --ds vqa|caption: the folder `image_rephrase` is relative to (default: --image-root).
    #[arg(long, requires = "image_root")]
    rephrase_image_root: Option<PathBuf>,
}

impl CommonArgs {
    /// `config`, `tokens` and `phase`: what the placement is planned for.
    fn resolve(&self, config: &MendConfig, tokens: usize, phase: Phase) -> anyhow::Result<Common> {
        let dtype = parse_dtype(&self.dtype)?;
        let place = PlaceFor { model: &self.model, config, dtype, tokens: tokens as i64, phase };
        Ok(Common {
            model: self.model.clone(),
            plan: self.devices.placed(&place)?,
            dtype,
            seed: self.seed,
            report: self.report.clone(),
            over_long: match (self.truncate, self.strict) {
                (true, _) => OverLong::Truncate,
                (_, true) => OverLong::Strict,
                _ => OverLong::Skip,
            },
            image_roots: self.image_root.clone().map(|r| dualedit::data::multimodal::ImageRoots::new(r, self.rephrase_image_root.clone())),
        })
    }
}

#[derive(Args)]
struct TrainArgs {
    #[command(flatten)]
    common: CommonArgs,
    /// EasyEdit-format training file.
    #[arg(long)]
    data: PathBuf,
    /// zsre, counterfact, vqa or caption (E-VQA / E-IC, with --image-root).
    #[arg(long)]
    ds: String,
    /// MEND hyper-parameters (JSON, see configs/).
    #[arg(long)]
    config: PathBuf,
    /// Directory for the editor checkpoint, training state and report.
    #[arg(long)]
    out: PathBuf,
    #[arg(long)]
    max_steps: Option<usize>,
    /// Use only the first N records of the file.
    #[arg(long, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..))]
    limit: Option<usize>,
    /// Continue from the training state in --out.
    #[arg(long)]
    resume: bool,
    /// Recompute the edited forwards' blocks in the backward instead of keeping their
    /// activations (less memory, one more forward of the edited blocks; same losses).
    #[arg(long)]
    recompute: bool,
}

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
enum MethodArg {
    Mend,
    /// MEND's per-edit updates combined by least squares over their keys (MALMEN-style).
    MendLs,
    Ft,
    Unedited,
}

#[derive(Args)]
struct MethodArgs {
    /// Trained editor directory (for --method mend).
    #[arg(long)]
    editor: Option<PathBuf>,
    #[arg(long, value_enum, default_value = "mend")]
    method: MethodArg,
    /// --method mend-ls: ridge weight of the least-squares solve, relative to the mean
    /// squared norm of the edits' keys (default: the editor's `ls` settings in its
    /// editor.json, else 0.01).
    #[arg(long)]
    ls_lambda: Option<f64>,
    /// --method mend-ls: a text file whose lines' keys (layer inputs) the solve keeps,
    /// MEMIT-style (the edit should not change what the edited layers do there).
    #[arg(long, value_name = "FILE")]
    ls_keep_text: Option<PathBuf>,
    /// --method mend-ls: the weight of each kept key against each edit key (default: the
    /// editor's, else 0.01).
    #[arg(long)]
    ls_keep_weight: Option<f64>,
    /// --method mend-ls: re-solve rounds that push the edits whose prompts do not yet
    /// answer their targets (default: the editor's, else 0; data/editor-many: 3).
    #[arg(long)]
    ls_rounds: Option<usize>,
    /// Step size of the fine-tuning baseline (--method ft).
    #[arg(long, default_value_t = 1e-3)]
    ft_lr: f64,
    /// Maximum tokens of any prompt + answer.
    #[arg(long, default_value_t = 512)]
    max_length: usize,
}

impl MethodArgs {
    /// The MEND config the placement is planned with: the trained editor's (from its
    /// editor.json), MEND's defaults for the baselines.
    fn planning_config(&self) -> anyhow::Result<MendConfig> {
        let Some(dir) = self.editor.as_ref().filter(|_| matches!(self.method, MethodArg::Mend | MethodArg::MendLs)) else {
            return Ok(MendConfig::default());
        };
        let path = dir.join(dualedit::mend::checkpoint::EDITOR_JSON);
        let text = std::fs::read_to_string(&path).map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
        let meta: dualedit::mend::checkpoint::EditorMeta =
            serde_json::from_str(&text).map_err(|e| anyhow::anyhow!("{}: invalid editor description: {e}", path.display()))?;
        let mut cfg = meta.config;
        cfg.edit_params = meta.params.into_iter().map(|p| p.name).collect();
        Ok(cfg)
    }

    fn resolve(&self) -> anyhow::Result<MethodSpec> {
        if self.editor.is_some() && !matches!(self.method, MethodArg::Mend | MethodArg::MendLs) {
            anyhow::bail!("--editor is only used with --method mend or mend-ls");
        }
        if self.ls_keep_text.is_some() && self.method != MethodArg::MendLs {
            anyhow::bail!("--ls-keep-text is only used with --method mend-ls");
        }
        let ls_given = self.ls_lambda.is_some() || self.ls_keep_weight.is_some() || self.ls_rounds.is_some();
        if ls_given && self.method != MethodArg::MendLs {
            anyhow::bail!("--ls-lambda, --ls-keep-weight and --ls-rounds are only used with --method mend-ls");
        }
        if let Some(w) = self.ls_keep_weight.filter(|w| !(w.is_finite() && *w >= 0.0)) {
            anyhow::bail!("--ls-keep-weight must be a number >= 0, got {w}");
        }
        if let Some(l) = self.ls_lambda.filter(|l| !(l.is_finite() && *l > 0.0)) {
            anyhow::bail!("--ls-lambda must be a positive number, got {l}");
        }
        if let Some(r) = self.ls_rounds.filter(|r| *r > dualedit::config::MAX_LS_ROUNDS) {
            anyhow::bail!("--ls-rounds must be at most {}, got {r}", dualedit::config::MAX_LS_ROUNDS);
        }
        if !(self.ft_lr.is_finite() && self.ft_lr > 0.0) {
            anyhow::bail!("--ft-lr must be a positive number, got {}", self.ft_lr);
        }
        Ok(match self.method {
            MethodArg::Mend => MethodSpec::Mend {
                editor: self.editor.clone().ok_or_else(|| anyhow::anyhow!("--method mend needs --editor DIR"))?,
            },
            MethodArg::MendLs => MethodSpec::MendLs {
                editor: self.editor.clone().ok_or_else(|| anyhow::anyhow!("--method mend-ls needs --editor DIR"))?,
                ls: dualedit::mend::ls::LsChoice { lambda: self.ls_lambda, cov_weight: self.ls_keep_weight, rounds: self.ls_rounds },
                unrelated: self.ls_keep_text.clone(),
            },
            MethodArg::Ft => MethodSpec::FineTune { lr: self.ft_lr },
            MethodArg::Unedited => MethodSpec::Unedited,
        })
    }
}

#[derive(Args)]
struct EditArgs {
    #[command(flatten)]
    common: CommonArgs,
    #[command(flatten)]
    method: MethodArgs,
    /// EasyEdit-style request records (prompt, target_new, optional rephrase_prompt, locality_*, portability).
    #[arg(long)]
    requests: PathBuf,
    /// Apply the requests one after another instead of as one batch.
    #[arg(long)]
    sequential: bool,
    /// Write the edited model as a Hugging Face directory.
    #[arg(long)]
    save: Option<PathBuf>,
    /// Print exactly one JSON object on stdout.
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    guard: GuardArgs,
}

/// The commit guard and stepwise flags of `edit` and of `eval --edits-per-batch / --sequential`.
#[derive(Args)]
struct GuardArgs {
    #[command(flatten)]
    flags: GuardFlags,
    /// With --sequential: make each request in up to 8 committed steps of a centred,
    /// clipped, capped edit at 1/4 scale (experimental; see src/mend/stepwise.rs).
    #[arg(long, requires = "sequential")]
    stepwise: bool,
}

/// The commit guard's flags, shared by `edit`, `eval` and `serve` (same defaults).
#[derive(Args)]
struct GuardFlags {
    /// Commit every edit as the editor makes it: no guard on the locality prompts.
    #[arg(long, conflicts_with_all = ["guard_min_agreement", "guard_max_drop", "guard_max_kl", "guard_refuse", "guard_shrink"])]
    no_guard: bool,
    /// Guard: the least top-1 agreement of the locality prompts with the unedited model, in [0, 1].
    #[arg(long, default_value_t = 0.9)]
    guard_min_agreement: f64,
    /// Guard: the most one edit may lower that agreement, in [0, 1].
    #[arg(long, default_value_t = 0.05)]
    guard_max_drop: f64,
    /// Guard: the largest KL(unedited || edited) per locality position, in nats (>= 0).
    #[arg(long, default_value_t = 1.0)]
    guard_max_kl: f64,
    /// Guard: refuse an edit that fails instead of scaling it back.
    #[arg(long)]
    guard_refuse: bool,
    /// Guard: shrink each edit to the smallest scale (1, 1/2, 1/4, ...) that still makes it.
    #[arg(long)]
    guard_shrink: bool,
}

impl GuardFlags {
    /// The guard (`None` with --no-guard), its thresholds checked before anything loads.
    fn config(&self) -> anyhow::Result<Option<dualedit::mend::guard::GuardConfig>> {
        if self.no_guard {
            return Ok(None);
        }
        let c = dualedit::mend::guard::GuardConfig {
            min_agreement: self.guard_min_agreement,
            max_drop: self.guard_max_drop,
            max_kl: self.guard_max_kl,
            scale_back: !self.guard_refuse,
            shrink: self.guard_shrink,
            ..Default::default()
        };
        c.validate()?;
        Ok(Some(c))
    }
}

impl GuardArgs {
    fn config(&self) -> anyhow::Result<Option<dualedit::mend::guard::GuardConfig>> {
        self.flags.config()
    }

    fn stepwise(&self) -> Option<dualedit::mend::stepwise::Stepwise> {
        self.stepwise.then(dualedit::mend::stepwise::Stepwise::default)
    }
}

#[derive(Args)]
struct EvalArgs {
    #[command(flatten)]
    common: CommonArgs,
    #[command(flatten)]
    method: MethodArgs,
    /// EasyEdit-format dataset.
    #[arg(long)]
    data: PathBuf,
    /// zsre, counterfact, vqa or caption (E-VQA / E-IC, with --image-root).
    #[arg(long)]
    ds: String,
    /// Evaluate only the first N records.
    #[arg(long, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..))]
    limit: Option<usize>,
    /// Print exactly one JSON object on stdout.
    #[arg(long)]
    json: bool,
    /// Capacity: edit the records in groups of N, each group in one batch edit from the
    /// unedited model, and measure all N after it.
    #[arg(long, value_name = "N", conflicts_with = "sequential", value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..))]
    edits_per_batch: Option<usize>,
    /// Capacity: edit the records in groups of N, one after another (each committed, the
    /// guard as configured), and measure all N after the group's last edit.
    #[arg(long, value_name = "N", value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..))]
    sequential: Option<usize>,
    /// Capacity: a text file whose lines are the unrelated texts whose NLL drift is
    /// reported (lines naming an edited subject are skipped; default: the locality prompts).
    #[arg(long, value_name = "FILE")]
    drift_text: Option<PathBuf>,
    #[command(flatten)]
    guard: GuardArgs,
}

fn score(args: ScoreArgs) -> anyhow::Result<()> {
    let device = args.devices.single("score")?;
    let kind = parse_dtype(&args.dtype)?;
    let lm = load_model(&args.model, device, kind)?;
    let images: Vec<&std::path::Path> = args.image.iter().map(|p| p.as_path()).collect();
    let s = dualedit::score::score_with_images(&lm, &ParamView::frozen(&lm.params), &args.text, &images)?;
    if args.json {
        println!("{}", serde_json::to_string(&s)?);
    } else {
        if s.image_tokens > 0 {
            println!("image: {} tokens before the text", s.image_tokens);
        }
        // Without an image the first token has nothing before it and is not scored.
        let first = s.tokens.len() - s.logprobs.len();
        println!("{:>6}  {:>10}  token", "pos", "logprob");
        for (i, lp) in s.logprobs.iter().enumerate() {
            let piece = lm.tokenizer.decode(&[s.tokens[i + first]]).unwrap_or_default();
            println!("{:>6}  {:>10.4}  {:?}", i + first, lp, piece);
        }
        println!("mean NLL {:.4} over {} tokens", s.mean_nll, s.logprobs.len());
    }
    Ok(())
}

fn dataset(ds: &str) -> anyhow::Result<DatasetKind> {
    match ds.parse::<DatasetKind>()? {
        DatasetKind::Requests => anyhow::bail!("--ds must be zsre, counterfact, vqa or caption"),
        k => Ok(k),
    }
}

fn train_options(a: TrainArgs) -> anyhow::Result<TrainOptions> {
    let ds = dataset(&a.ds)?;
    dualedit::run::check_report_path(a.common.report.as_deref(), &[&a.config])?;
    let mut config = MendConfig::from_file(&a.config)?;
    if let Some(n) = a.max_steps {
        config.max_steps = n;
    }
    if a.recompute {
        config.recompute = true;
    }
    Ok(TrainOptions {
        common: a.common.resolve(&config, config.max_length, Phase::Train)?,
        data: a.data,
        ds,
        config,
        out: a.out,
        limit: a.limit,
        resume: a.resume,
        progress: true,
    })
}

fn train(a: TrainArgs) -> anyhow::Result<()> {
    let opts = train_options(a)?;
    let (rep, path) = run::run_train(&opts)?;
    let (what, best) = match opts.config.select_by {
        dualedit::config::SelectBy::Loss => ("loss", rep.best_val_loss),
        dualedit::config::SelectBy::Accuracy => ("edit_acc + loc_acc", -rep.best_val_loss),
    };
    println!(
        "trained {} steps ({} skipped), best validation {what} {best:.4}, {:.3} s/step; editor in {}",
        rep.steps,
        rep.skipped_steps,
        rep.seconds_per_step,
        rep.editor_dir.display()
    );
    println!("report: {}", path.display());
    Ok(())
}

fn print_summary(s: &dualedit::eval::Summary) {
    println!("{:<16} {:>8}", "metric", "value");
    for (k, v) in [
        ("reliability", s.reliability),
        ("edit_success", s.edit_success),
        ("nll_pre", s.nll_pre),
        ("nll_post", s.nll_post),
        ("edit_seconds", s.edit_seconds),
    ] {
        println!("{k:<16} {v:>8.4}");
    }
    match s.generalization {
        Some(g) => println!("{:<16} {:>8.4}", "generalization", g),
        None => println!("{:<16} {:>8}", "generalization", "- (no rephrases)"),
    }
    match s.locality {
        Some(l) => println!("{:<16} {:>8.4}", "locality", l),
        None => println!("{:<16} {:>8}", "locality", "- (no locality prompts)"),
    }
    if let Some(p) = s.portability {
        println!("{:<16} {:>8.4}", "portability", p);
    }
    println!("{:<16} {:>8}", "n", s.n);
}

fn edit(a: EditArgs) -> anyhow::Result<()> {
    // Flags first: a bad threshold is named before any file is read.
    let guard = a.guard.config()?;
    let opts = EditOptions {
        common: a.common.resolve(&a.method.planning_config()?, a.method.max_length, Phase::Edit)?,
        method: a.method.resolve()?,
        requests: a.requests,
        sequential: a.sequential,
        save: a.save,
        max_length: a.method.max_length,
        guard,
        stepwise: a.guard.stepwise(),
    };
    let (out, path) = run::run_edit(&opts)?;
    if a.json {
        let mut v = serde_json::to_value(&out)?;
        v["data"] = serde_json::to_value(&out.data)?;
        v["report"] = serde_json::Value::from(path.display().to_string());
        println!("{v}");
        return Ok(());
    }
    for (i, r) in out.requests.iter().enumerate() {
        println!(
            "[{i}] {:?} -> {:?}: now answers {:?} (reliability {:.2}, generalization {}, locality {})",
            r.prompt,
            r.target_new,
            r.answer_after,
            r.metrics.reliability,
            r.metrics.generalization.map_or("-".into(), |g| format!("{g:.2}")),
            r.metrics.locality.map_or("-".into(), |l| format!("{l:.2}"))
        );
    }
    let refused = out.guard.iter().filter(|g| g.decision == dualedit::mend::guard::Decision::Refused).count();
    let scaled = out.guard.iter().filter(|g| g.decision == dualedit::mend::guard::Decision::Scaled).count();
    if refused + scaled > 0 {
        println!("guard: {refused} edit(s) refused, {scaled} scaled back, of {} (see the report's \"guard\")", out.guard.len());
    }
    print_summary(&out.summary);
    if let Some(dir) = &out.saved {
        println!("edited model saved to {}", dir.display());
    }
    println!("report: {}", path.display());
    Ok(())
}

fn eval_options(a: &EvalArgs) -> anyhow::Result<EvalOptions> {
    // Flags first: a bad threshold is named before any file is read.
    let capacity = capacity_options(a)?;
    Ok(EvalOptions {
        common: a.common.resolve(&a.method.planning_config()?, a.method.max_length, Phase::Edit)?,
        method: a.method.resolve()?,
        data: a.data.clone(),
        ds: dataset(&a.ds)?,
        limit: a.limit,
        max_length: a.method.max_length,
        capacity,
    })
}

fn capacity_options(a: &EvalArgs) -> anyhow::Result<Option<run::CapacityOptions>> {
    use dualedit::capacity::Grouping;
    let grouping = match (a.edits_per_batch, a.sequential) {
        (Some(n), _) => Grouping::Batch(n),
        (None, Some(n)) => Grouping::Sequential(n),
        (None, None) => {
            if a.drift_text.is_some() || a.guard.stepwise || a.guard.flags.no_guard {
                anyhow::bail!("--drift-text, --stepwise and the guard flags of eval need --edits-per-batch N or --sequential N");
            }
            return Ok(None);
        }
    };
    Ok(Some(run::CapacityOptions { grouping, guard: a.guard.config()?, stepwise: a.guard.stepwise(), drift_text: a.drift_text.clone() }))
}

fn compare(c: CompareCmd) -> anyhow::Result<()> {
    let devices = match &c {
        CompareCmd::Train(a) => &a.common.devices,
        CompareCmd::Eval(a) => &a.common.devices,
    };
    let json = matches!(&c, CompareCmd::Eval(a) if a.json);
    if devices.sub_device.is_none() {
        anyhow::bail!("compare needs --sub-device (the dual side's sub-device)");
    }
    // The dual side is placed as --placement asks; the single side is main alone.
    let (cmp, out) = match c {
        CompareCmd::Train(a) => {
            let o = train_options(a)?;
            let dual = o.common.plan;
            (dualedit::compare::compare_train(&o, dual)?, o.out.clone())
        }
        CompareCmd::Eval(a) => {
            let o = eval_options(&a)?;
            let dual = o.common.plan;
            let out = a.common.report.as_ref().and_then(|p| p.parent().map(|p| p.to_path_buf())).unwrap_or_else(|| {
                dualedit::report::default_path("compare").with_extension("")
            });
            (dualedit::compare::compare_eval(&o, dual, &out)?, out)
        }
    };
    let report = out.join("compare.json");
    if json {
        let mut v = serde_json::to_value(&cmp)?;
        v["report"] = serde_json::Value::from(report.display().to_string());
        println!("{v}");
    } else {
        print!("{}", dualedit::compare::table(&cmp));
        println!("report: {}", report.display());
    }
    Ok(())
}

fn eval(a: EvalArgs) -> anyhow::Result<()> {
    let opts = eval_options(&a)?;
    let bar = if a.json { indicatif::ProgressBar::hidden() } else { indicatif::ProgressBar::new_spinner() };
    let (out, path) = run::run_eval(&opts, |i, m| {
        bar.set_message(format!("{} records edited (last: reliability {:.2})", i + 1, m.reliability));
        bar.tick();
    })?;
    bar.finish_and_clear();
    if a.json {
        let mut v = serde_json::to_value(&out.summary)?;
        v["method"] = serde_json::Value::from(out.method.clone());
        if let Some(c) = &out.capacity {
            v["capacity"] = serde_json::to_value(c)?;
        }
        v["data"] = serde_json::to_value(&out.data)?;
        v["report"] = serde_json::Value::from(path.display().to_string());
        println!("{v}");
    } else {
        println!("method {}", out.method);
        if let Some(c) = &out.capacity {
            let (mode, n) = match c.grouping {
                dualedit::capacity::Grouping::Batch(n) => ("in one batch", n),
                dualedit::capacity::Grouping::Sequential(n) => ("one after another", n),
            };
            println!("{} group(s) of up to {n} edits {mode}, measured after each group's last edit; {:.4} s per edit", c.groups, c.seconds_per_edit);
            if let Some(d) = &c.drift {
                println!("unrelated-text NLL ({} texts): {:.4} -> {:.4} ({:+.4})", d.texts, d.nll_before, d.nll_after, d.nll_after - d.nll_before);
            }
            if c.guard_accepted + c.guard_scaled + c.guard_refused > 0 {
                println!("guard: {} accepted, {} scaled back, {} refused", c.guard_accepted, c.guard_scaled, c.guard_refused);
            }
        }
        print_summary(&out.summary);
        println!("report: {}", path.display());
    }
    Ok(())
}

fn demo(a: DemoArgs) -> anyhow::Result<()> {
    let plan = a.devices.plan()?;
    let root = a.root.unwrap_or_else(dualedit::demo::shipped_root);
    if a.multimodal {
        let s = dualedit::demo_vl::run_demo_vl(&dualedit::demo_vl::vl_root(&root), plan, a.json, &mut std::io::stdout())?;
        if !a.json {
            println!("\ndone in {:.1} s", s.seconds);
        }
        return Ok(());
    }
    let s = dualedit::demo::run_demo(&root, plan, a.show, &mut std::io::stdout())?;
    println!("\ndone in {:.1} s", s.seconds);
    Ok(())
}

fn pretrain(a: PretrainArgs) -> anyhow::Result<()> {
    if a.vl {
        return pretrain_vl(a);
    }
    let ds = dataset(a.ds.as_deref().unwrap_or_default())?;
    let (steps, lr) = (a.steps.unwrap_or(4000), a.lr.unwrap_or(2e-3));
    if !(lr.is_finite() && lr > 0.0) || a.batch == 0 || steps == 0 {
        anyhow::bail!("--lr must be a positive number and --batch, --steps at least 1 (got {lr}, {}, {steps})", a.batch);
    }
    if a.vocab < 257 {
        // The byte-level BPE trainer always keeps its 256 byte symbols plus end-of-text, and
        // would silently return a larger vocabulary than asked for.
        anyhow::bail!("--vocab must be at least 257 (256 byte-level symbols and end-of-text), got {}", a.vocab);
    }
    dualedit::edit::check_new_model_dir(&a.out)?;
    let mut records = Vec::new();
    for f in &a.data {
        records.extend(dualedit::data::load_records(f, ds)?.0);
    }
    let (corpus, probe) = dualedit::pretrain::corpus_from_records(&records, a.with_new_targets);
    let probe: Vec<_> = probe.into_iter().take(1000).collect();
    let cfg = dualedit::pretrain::PretrainConfig {
        vocab_size: a.vocab,
        n_embd: a.n_embd.unwrap_or(256),
        n_layer: a.n_layer.unwrap_or(4),
        n_head: a.n_head.unwrap_or(4),
        n_positions: a.n_positions,
        steps,
        batch_size: a.batch,
        lr,
        target_accuracy: None,
        ..Default::default()
    };
    let device = a.devices.single("pretrain")?;
    let rep = dualedit::pretrain::pretrain(&corpus, &probe, &cfg, &a.out, device, true)?;
    println!("{}", serde_json::to_string_pretty(&rep)?);
    Ok(())
}

fn pretrain_vl(a: PretrainArgs) -> anyhow::Result<()> {
    let world = a.world.as_deref().ok_or_else(|| anyhow::anyhow!("--vl needs --world DIR"))?;
    let d = dualedit::pretrain_vl::VlPretrainConfig::default();
    let cfg = dualedit::pretrain_vl::VlPretrainConfig {
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
    dualedit::edit::check_new_model_dir(&a.out)?;
    let device = a.devices.single("pretrain")?;
    tch::set_num_threads(1);
    let rep = dualedit::pretrain_vl::pretrain_vl(world, &cfg, &a.out, device, true)?;
    println!("{}", serde_json::to_string_pretty(&rep)?);
    Ok(())
}

fn build_default(a: BuildDefaultArgs) -> anyhow::Result<()> {
    if a.only.as_deref() == Some("many") {
        let common = dualedit::run::Common {
            model: dualedit::demo::model_dir(&a.out),
            plan: dualedit::device::DevicePlan::single(tch::Device::Cpu),
            dtype: tch::Kind::Float,
            seed: 0,
            report: None,
            over_long: Default::default(),
            image_roots: None,
        };
        let steps = dualedit::demo::train_many_editor(&a.out, common, &MendConfig::from_file(&a.many_config)?)?;
        println!("{}", serde_json::json!({"editor": dualedit::demo::many_editor_dir(&a.out), "train_steps": steps}));
        return Ok(());
    }
    if a.only.as_deref() != Some("vl") {
        let mut spec = dualedit::demo::BuildSpec::shipped(MendConfig::from_file(&a.config)?, Some(MendConfig::from_file(&a.many_config)?));
        if let Some(n) = a.pretrain_steps {
            spec.pretrain.steps = n;
        }
        let rep = dualedit::demo::build_default(&a.out, &spec, tch::Device::Cpu)?;
        println!("{}", serde_json::to_string_pretty(&rep)?);
    }
    if a.only.as_deref() != Some("text") {
        let mut spec = dualedit::demo_vl::VlBuildSpec::shipped(MendConfig::from_file(&a.vl_config)?);
        if let Some(n) = a.pretrain_steps {
            spec.pretrain.steps = n;
        }
        let rep = dualedit::demo_vl::build_default_vl(&dualedit::demo_vl::vl_root(&a.out), &spec, tch::Device::Cpu)?;
        println!("{}", serde_json::to_string_pretty(&rep)?);
    }
    Ok(())
}

fn world(a: WorldArgs) -> anyhow::Result<()> {
    use dualedit::data::{synthetic, visual_world};
    if !a.vl {
        // The text world exactly as build-default writes it (its MEND config plays no part).
        let mut cfg = dualedit::demo::BuildSpec::shipped(MendConfig::default(), None).world;
        cfg.seed = a.seed.unwrap_or(cfg.seed);
        let world = synthetic::World::generate(&cfg);
        synthetic::write_world(&a.out, &world)?;
        let (train, holdout) = world.edit_records();
        let summary = serde_json::json!({"dir": a.out, "facts": world.facts.len(), "train_edits": train.len(), "holdout_edits": holdout.len()});
        println!("{}", serde_json::to_string_pretty(&summary)?);
        return Ok(());
    }
    let mut cfg = visual_world::VisualWorldConfig::default();
    cfg.seed = a.seed.unwrap_or(cfg.seed);
    cfg.n_train_scenes = a.train_scenes.unwrap_or(cfg.n_train_scenes);
    cfg.n_holdout_scenes = a.holdout_scenes.unwrap_or(cfg.n_holdout_scenes);
    if let Some((w, h)) = a.image_size {
        let side = |v: i64| u32::try_from(v).map_err(|_| anyhow::anyhow!("--image-size {w}x{h}: a side is too large"));
        (cfg.width, cfg.height) = (side(w)?, side(h)?);
    }
    let world = visual_world::VisualWorld::generate(&cfg)?;
    let written = visual_world::write_visual_world(&a.out, &world)?;
    println!("{}", serde_json::to_string_pretty(&written)?);
    Ok(())
}

/// `448x448` (or `448×448`) to `(width, height)`.
fn parse_image_size(s: &str) -> Result<(i64, i64), String> {
    let bad = || format!("{s:?} is not an image size WIDTHxHEIGHT (e.g. 448x448)");
    let (w, h) = s.split_once(['x', 'X', '×']).ok_or_else(bad)?;
    let (w, h) = (w.trim().parse::<i64>().map_err(|_| bad())?, h.trim().parse::<i64>().map_err(|_| bad())?);
    if w < 1 || h < 1 {
        return Err(bad());
    }
    Ok((w, h))
}

/// `plan`: with `--placement`, that placement's plan (items, formulas, each device's peak
/// per phase); without it, the table of every placement of the devices given (on one
/// device: its plan). Devices need not exist here; `--max-memory` is planned against,
/// not applied.
fn plan(a: PlanArgs) -> anyhow::Result<()> {
    use dualedit::planner::{choose, plan_model, PlacementTable, PlanOptions};
    let config = MendConfig::from_file(&a.config)?;
    let tokens = a.max_length.unwrap_or(config.max_length) as i64;
    let d = &a.devices;
    let mut opts = PlanOptions::new(&d.device, d.sub_device.as_deref(), parse_dtype(&a.dtype)?, tokens, a.kept_tokens)?;
    opts.caps = d.max_memory.clone().unwrap_or_default();
    opts.optimizer = d.optimizer_device.unwrap_or_default();
    opts.image = a.image_size;
    opts.loc_tokens = a.loc_length;
    if let Some(ds) = &a.ds {
        match (dataset(ds)?.is_multimodal(), a.image_size) {
            (true, None) => anyhow::bail!("--ds {ds} plans images: give --image-size WIDTHxHEIGHT (e.g. 640x480 for a COCO photo)"),
            (false, Some(_)) => anyhow::bail!("--ds {ds} is text-only: --image-size plans the multimodal views (--ds vqa or caption)"),
            _ => {}
        }
    }
    if a.loc_length.is_some() && a.image_size.is_none() {
        anyhow::bail!("--loc-length is the text-only locality view of --ds vqa|caption: give --image-size");
    }
    if !a.model.is_dir() {
        return Err(dualedit::Error::file(&a.model, "model directory not found").into());
    }
    let (model, _) = dualedit::model::loader::read_config(&a.model)?;
    if a.image_size.is_some() && model.family().vision_language().is_some() {
        opts.image_processor = dualedit::model::qwen2_vl::ImageProcessorConfig::load(&a.model.join("preprocessor_config.json"))?;
    }
    let plan = match d.placement {
        Some(PlacementRequest::Auto) => choose(&model, &config, &opts, Phase::Train)?,
        Some(p) => plan_model(&model, &config, &opts.with_placement(p.fixed().unwrap_or(Placement::Replica), opts.optimizer)?)?,
        None if opts.split => {
            let table = PlacementTable::new(&model, &config, &opts)?;
            if a.json {
                println!("{}", serde_json::to_string(&table)?);
            } else {
                print!("{}", table.text());
                println!("(--placement NAME prints one placement's items and formulas)");
            }
            return Ok(());
        }
        None => plan_model(&model, &config, &opts)?,
    };
    if a.json {
        println!("{}", serde_json::to_string(&plan)?);
    } else {
        print!("{}", plan.table());
    }
    Ok(())
}

fn serve(a: ServeArgs) -> anyhow::Result<()> {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;
    let opts = dualedit::serve::ServeOptions {
        queue: a.queue,
        max_body_bytes: a.max_body_bytes,
        queue_timeout: std::time::Duration::from_secs(a.queue_timeout),
        save_root: a.save_root,
        image_root: a.image_root,
        // An empty variable counts as unset, as for most tools' *_TOKEN variables.
        token: a.token.or_else(|| std::env::var(dualedit::serve::TOKEN_ENV).ok().filter(|t| !t.is_empty())),
        insecure_no_token: a.insecure_no_token,
        guard: a.guard.config()?,
        ..Default::default()
    };
    let dtype = parse_dtype(&a.dtype)?;
    let method = MethodArgs { editor: a.editor.clone(), method: MethodArg::Mend, ls_lambda: None, ls_keep_text: None, ls_keep_weight: None, ls_rounds: None, ft_lr: 1e-3, max_length: 512 };
    let config = if a.editor.is_some() { method.planning_config()? } else { MendConfig::default() };
    let place = PlaceFor { model: &a.model, config: &config, dtype, tokens: config.max_length as i64, phase: Phase::Edit };
    let session_opts = LoadOptions { plan: a.devices.placed(&place)?, dtype };
    let server = dualedit::serve::Server::bind(&a.listen, opts)?;
    let session = dualedit::session::Session::open(&a.model, a.editor.as_deref(), &session_opts)?;
    let stop = Arc::new(AtomicBool::new(false));
    let flag = stop.clone();
    // First SIGINT/SIGTERM: finish the request in flight, then exit. A second one: now.
    ctrlc::set_handler(move || {
        if flag.swap(true, Ordering::SeqCst) {
            std::process::exit(130);
        }
        eprintln!("stopping: finishing the request in flight (signal again to exit at once)");
    })?;
    eprintln!("dualedit serving {} on http://{} (Ctrl-C to stop)", a.model.display(), server.local_addr());
    let stats = server.run(session, &stop)?;
    eprintln!("stopped after {} requests ({} ran on the model)", stats.requests, stats.model_requests);
    Ok(())
}

fn dispatch(command: Command) -> anyhow::Result<()> {
    match command {
        Command::Score(a) => score(a),
        Command::Train(a) => train(a),
        Command::Edit(a) => edit(a),
        Command::Eval(a) => eval(a),
        Command::Compare(c) => compare(c),
        Command::Demo(a) => demo(a),
        Command::Pretrain(a) => pretrain(a),
        Command::BuildDefault(a) => build_default(a),
        Command::World(a) => world(a),
        Command::Serve(a) => serve(a),
        Command::Plan(a) => plan(a),
    }
}

/// Colour codes only for a terminal (a log file or a pipe would get `ESC[2m…` as text), and
/// never when `NO_COLOR` is set to anything but the empty string (https://no-color.org).
fn stderr_colour() -> bool {
    use std::io::IsTerminal;
    let no_color = std::env::var_os("NO_COLOR").is_some_and(|v| !v.is_empty());
    !no_color && std::io::stderr().is_terminal()
}

fn main() -> ExitCode {
    dualedit::device::memory::tune_host_allocator();
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()))
        .with_writer(std::io::stderr)
        .with_ansi(stderr_colour())
        .init();
    let cli = Cli::parse();
    // tch panics on libtorch errors outside the guarded model code (a CUDA allocation while
    // loading, say): one line of error, never a backtrace.
    let result = match dualedit::error::guard(|| Ok(dispatch(cli.command))) {
        Ok(r) => r,
        Err(e) => Err(e.into()),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
