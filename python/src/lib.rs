//! `dualedit._native`: the Python extension behind `import dualedit`.
//!
//! A thin layer over the library's public API ([`dualedit::edit::session::Session`], the runs in
//! [`dualedit::run`], the planner, `compare`): records and reports cross as JSON text (the
//! same serde shapes as the CLI's `--json`, parsed by `dualedit/__init__.py`), tensors cross
//! as `torch.Tensor` through pyo3-tch. Every call that runs the model releases the GIL;
//! the long ones (train, evaluate, compare) run on a worker thread while the calling thread
//! polls for Ctrl-C and reports progress. Errors become the exception classes of
//! `dualedit._errors`, with the library's one-line messages.
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;

use pyo3::prelude::*;
use pyo3::types::PyDict;
use pyo3_tch::PyTensor;
use tch::{Device, Kind, Tensor};

use std::collections::BTreeMap;

use serde::Deserialize;

use dualedit::config::MendConfig;
use dualedit::data::easyedit::{parse_records, DatasetKind};
use dualedit::data::multimodal::ImageRoots;
use dualedit::device::DeviceRequest;
use dualedit::edit::{MethodOptions, MethodSpec};
use dualedit::mend::guard::GuardConfig;
use dualedit::model::Dtype;
use dualedit::planner::{Phase, PlanRequest};
use dualedit::run::options::{load_options, GroupOptions, GuardOptions, RunOptions};
use dualedit::run::{self, EvalOptions, TrainOptions};
use dualedit::edit::session::{read_image_requests, Session as Inner};
use dualedit::Error;

mod long_runs;
use long_runs::{call_progress, stop_if_cancelled, stop_training, supervised};

// ---------------------------------------------------------------------------------------
// Errors

/// The exception class of `dualedit._errors` for `e`, raised with the library's message.
fn py_err(e: Error) -> PyErr {
    let class = match &e {
        Error::Io { err, .. } if err.kind() == std::io::ErrorKind::NotFound => "NotFoundError",
        Error::Io { .. } => "IoError",
        // "model directory not found" and the like: a folder the caller named is missing.
        Error::File { path, msg } if !path.exists() && ["not found", "does not exist", "no such"].iter().any(|w| msg.to_lowercase().contains(w)) => {
            "NotFoundError"
        }
        Error::File { .. } => "FileError",
        Error::Input(_) => "InputError",
        Error::Device { .. } => "DeviceError",
        Error::OutOfMemory(_) => "OutOfMemoryError",
        Error::Torch(_) => "TorchError",
        Error::Internal(_) => "InternalError",
    };
    raise(class, e.to_string())
}

/// An exception of class `class` (from `dualedit._errors`) carrying `msg`.
fn raise(class: &str, msg: String) -> PyErr {
    Python::with_gil(|py| {
        match py.import("dualedit._errors").and_then(|m| m.getattr(class)).and_then(|c| c.call1((msg.clone(),))) {
            Ok(v) => PyErr::from_value(v),
            Err(_) => pyo3::exceptions::PyRuntimeError::new_err(msg),
        }
    })
}

fn input_err(msg: impl Into<String>) -> PyErr {
    raise("InputError", msg.into())
}

trait OrPy<T> {
    fn py(self) -> PyResult<T>;
}

impl<T> OrPy<T> for dualedit::Result<T> {
    fn py(self) -> PyResult<T> {
        self.map_err(py_err)
    }
}

fn json<T: serde::Serialize>(v: &T) -> PyResult<String> {
    serde_json::to_string(v).map_err(|e| input_err(format!("cannot serialise the result: {e}")))
}

// ---------------------------------------------------------------------------------------
// Options shared by the session and the runs

/// Keyword arguments as JSON (the Python wrappers drop the ones given as `None`) read into
/// `T`, the library's option types flattened; a keyword none of them has is one error
/// naming it. `unknown`: the keywords none of its parts took (a `flatten` catch-all).
fn kwargs<T: serde::de::DeserializeOwned>(what: &str, options: &str, unknown: impl Fn(&T) -> &BTreeMap<String, serde_json::Value>) -> PyResult<T> {
    kwargs_of(what, options, &RunOptions::fields(), unknown)
}

/// [`kwargs`] whose flattened part is not `RunOptions` but has the fields `flattened`.
fn kwargs_of<T: serde::de::DeserializeOwned>(
    what: &str,
    options: &str,
    flattened: &[String],
    unknown: impl Fn(&T) -> &BTreeMap<String, serde_json::Value>,
) -> PyResult<T> {
    let t: T = serde_json::from_str(options).map_err(|e| input_err(format!("{what}: {e}")))?;
    // A flattened type with a flattened part of its own (`RunOptions`, `PlanRequest`: the
    // device request) leaves that part's keys here too.
    if let Some(k) = unknown(&t).keys().find(|k| !flattened.contains(k)) {
        return Err(input_err(format!("{what}: unexpected keyword argument {k:?}")));
    }
    Ok(t)
}

fn default_max_length() -> usize {
    512
}

/// `dualedit.Session(...)`'s keywords: the CLI's `edit` flags as the library's types.
#[derive(Deserialize)]
struct SessionKwargs {
    model: PathBuf,
    #[serde(flatten)]
    devices: DeviceRequest,
    #[serde(default)]
    dtype: Option<Dtype>,
    #[serde(flatten)]
    method: MethodOptions,
    #[serde(default = "default_max_length")]
    max_length: usize,
    #[serde(flatten)]
    guard: GuardOptions,
    #[serde(flatten)]
    unknown: BTreeMap<String, serde_json::Value>,
}

/// `dualedit.train(...)`'s keywords: `dualedit train`'s flags.
#[derive(Deserialize)]
struct TrainKwargs {
    #[serde(flatten)]
    run: RunOptions,
    data: PathBuf,
    ds: DatasetKind,
    config: PathBuf,
    out: PathBuf,
    #[serde(default)]
    max_steps: Option<usize>,
    #[serde(default)]
    limit: Option<usize>,
    #[serde(default)]
    resume: bool,
    #[serde(default)]
    init: Option<PathBuf>,
    #[serde(default)]
    recompute: bool,
    #[serde(default)]
    progress: bool,
    #[serde(default)]
    compare: bool,
    #[serde(flatten)]
    unknown: BTreeMap<String, serde_json::Value>,
}

/// `dualedit.evaluate(...)`'s keywords: `dualedit eval`'s flags.
#[derive(Deserialize)]
struct EvalKwargs {
    #[serde(flatten)]
    run: RunOptions,
    data: PathBuf,
    ds: DatasetKind,
    #[serde(flatten)]
    method: MethodOptions,
    #[serde(default)]
    limit: Option<usize>,
    #[serde(default = "default_max_length")]
    max_length: usize,
    #[serde(flatten)]
    groups: GroupOptions,
    #[serde(flatten)]
    guard: GuardOptions,
    #[serde(default)]
    compare: bool,
    #[serde(flatten)]
    unknown: BTreeMap<String, serde_json::Value>,
}

/// A dataset to read (not edit requests).
fn dataset(ds: DatasetKind) -> PyResult<DatasetKind> {
    match ds {
        DatasetKind::Requests => Err(input_err("ds must be zsre, counterfact, vqa or caption")),
        k => Ok(k),
    }
}

// ---------------------------------------------------------------------------------------
// Session

/// The session moved onto the thread that runs a call while the caller's thread waits
/// without the GIL. `Session` is not `Sync`: only one call at a time ever touches it,
/// which the `&mut self` of every method guarantees.
struct SendPtr<T>(T);
// SAFETY: the wrapped reference is used by exactly one thread at a time (the caller blocks
// in `allow_threads` until the closure returns); libtorch tensors may move between threads.
unsafe impl<T> Send for SendPtr<T> {}

/// One loaded model (and editor): edits, scores, generations, resets and saves.
#[pyclass(module = "dualedit._native", name = "Session", unsendable)]
struct PySession {
    inner: Inner,
    /// Tokens of any prompt + answer, as the CLI's `--max-length`.
    max_length: usize,
    guard: Option<GuardConfig>,
}

impl PySession {
    /// The guard of one `edit` call: the session's (`None`), none (`Some(false)`), or the
    /// session's settings, its defaults if it runs unguarded (`Some(true)`).
    fn call_guard(&self, guard: Option<bool>) -> Option<GuardConfig> {
        match guard {
            Some(false) => None,
            Some(true) => Some(self.guard.clone().unwrap_or_default()),
            None => self.guard.clone(),
        }
    }

    /// Runs `f` on the session with the GIL released.
    fn run<T: Send>(&mut self, py: Python<'_>, f: impl FnOnce(&mut Inner) -> dualedit::Result<T> + Send) -> PyResult<T> {
        let inner = SendPtr(&mut self.inner);
        py.allow_threads(move || {
            let inner = inner;
            dualedit::device::settle_threads();
            dualedit::error::guard(|| f(inner.0))
        })
        .py()
    }

    fn run_ref<T: Send>(&self, py: Python<'_>, f: impl FnOnce(&Inner) -> dualedit::Result<T> + Send) -> PyResult<T> {
        let inner = SendPtr(&self.inner);
        py.allow_threads(move || {
            let inner = inner;
            dualedit::device::settle_threads();
            dualedit::error::guard(|| f(inner.0))
        })
        .py()
    }
}

/// The JSON of an edit: the session's `EditOutcome` (the keys `dualedit edit --json` and
/// `serve`'s `/edit` answer with), plus `seconds.edit`, the span the CLI's run report calls
/// `seconds.edit`: the library's `Session::edit_examples` call (the records already
/// tokenised).
fn edit_report((out, edit_s): (dualedit::edit::session::EditOutcome, f64)) -> PyResult<String> {
    let mut v = serde_json::to_value(&out).map_err(|e| input_err(e.to_string()))?;
    v["seconds"] = serde_json::json!({ "edit": edit_s });
    Ok(v.to_string())
}

/// Tokenises text requests as `Session::edit` does (strict: a request that does not fit
/// `max_length` or the model's context is an error naming it).
fn text_examples(s: &Inner, records: &[dualedit::data::EditRecord], max_length: usize) -> dualedit::Result<Vec<dualedit::data::EditExample>> {
    let max_len = max_length.min(s.max_positions());
    dualedit::data::examples::prepare(&s.engine().lm.tokenizer, records, max_len, Path::new("requests")).map_err(|e| Error::input(e.to_string()))
}

/// The five views of each E-VQA record with its images, as `Session::edit_images`
/// prepares them; with the records as text (`src` -> `alt`).
fn image_examples(
    s: &Inner,
    records: &[dualedit::data::multimodal::MmRecord],
    max_length: usize,
) -> dualedit::Result<(Vec<dualedit::data::EditRecord>, Vec<dualedit::data::EditExample>)> {
    s.image_examples(records, max_length)
}

/// EasyEdit's `pre` figures: each request measured on the current weights, unedited.
fn measure_unedited(s: &Inner, examples: &[dualedit::data::EditExample]) -> dualedit::Result<String> {
    let refs: Vec<&dualedit::data::EditExample> = examples.iter().collect();
    let m = dualedit::edit::measured_edit(s.engine(), &mut dualedit::edit::Unedited, &refs, &[])?;
    serde_json::to_string(&m.metrics).map_err(|e| Error::input(e.to_string()))
}

#[pymethods]
impl PySession {
    /// `options`: the keyword arguments of `dualedit.Session` as JSON ([`SessionKwargs`]).
    #[new]
    fn new(py: Python<'_>, options: &str) -> PyResult<Self> {
        let k: SessionKwargs = kwargs("Session", options, |k: &SessionKwargs| &k.unknown)?;
        if k.max_length == 0 {
            return Err(input_err("max_length must be at least 1"));
        }
        let guard = k.guard.config().py()?;
        // A session edits any number of requests: `auto` opens the editor for many edits.
        let spec = k.method.resolve(true).py()?;
        let opts = load_options(&k.model, &k.devices, k.dtype, &k.method.planning_config().py()?, k.max_length, Phase::Edit).py()?;
        let unedited = k.method.method.is_none() && k.method.editor.is_none();
        let inner = py
            .allow_threads(|| dualedit::error::guard(|| match &spec {
                // Without an editor the session scores and generates; edit() refuses.
                MethodSpec::Unedited if unedited => Inner::open(&k.model, None, &opts),
                s => Inner::open_method(&k.model, s, &opts),
            }))
            .py()?;
        Ok(Self { inner, max_length: k.max_length, guard })
    }

    /// Applies EasyEdit request records (a JSON array, the `--requests` file's format) as
    /// one batch edit, or one after another with `sequential`; returns the report as JSON.
    /// `method`: `auto` (as the session was opened), `mend` or `mend-ls` for this call.
    #[pyo3(signature = (requests, sequential=false, guard=None, stepwise=false, method=None))]
    fn edit(&mut self, py: Python<'_>, requests: &str, sequential: bool, guard: Option<bool>, stepwise: bool, method: Option<&str>) -> PyResult<String> {
        if stepwise && !sequential {
            return Err(input_err("stepwise edits need sequential=True"));
        }
        let call = dualedit::edit::CallMethod::parse(method.unwrap_or("auto")).py()?;
        // The caller's records, not a file: a bad one is an input error (ValueError).
        let (records, load) = parse_records(requests, Path::new("requests"), DatasetKind::Requests).map_err(|e| input_err(e.to_string()))?;
        if let Some((i, why)) = load.skipped.first() {
            return Err(input_err(format!("requests: record {i}: {why}")));
        }
        let guard_cfg = self.call_guard(guard);
        let max_length = self.max_length;
        let out = self.run(py, move |s| {
            let examples = text_examples(s, &records, max_length)?;
            s.guard = guard_cfg;
            s.stepwise = stepwise.then(dualedit::mend::stepwise::Stepwise::default);
            s.call_method = call;
            let t = std::time::Instant::now();
            let out = s.edit_examples(&records, &examples, sequential);
            s.call_method = dualedit::edit::CallMethod::Auto;
            Ok((out?, t.elapsed().as_secs_f64()))
        })?;
        edit_report(out)
    }

    /// Applies E-VQA records (a JSON array; `image`, `image_rephrase` and `m_loc` named
    /// relative to `image_root` / `rephrase_image_root`, or absolute) as one batch edit
    /// with images, or one after another with `sequential`; returns the report as JSON.
    #[pyo3(signature = (records, image_root, rephrase_image_root=None, sequential=false, guard=None))]
    fn edit_images(
        &mut self,
        py: Python<'_>,
        records: &str,
        image_root: PathBuf,
        rephrase_image_root: Option<PathBuf>,
        sequential: bool,
        guard: Option<bool>,
    ) -> PyResult<String> {
        let roots = ImageRoots::new(image_root, rephrase_image_root);
        let records = read_image_requests(records, &roots).map_err(|e| input_err(e.to_string()))?;
        if records.is_empty() {
            return Err(input_err("no edit requests"));
        }
        let guard_cfg = self.call_guard(guard);
        let max_length = self.max_length;
        let out = self.run(py, move |s| {
            let (text, examples) = image_examples(s, &records, max_length)?;
            s.guard = guard_cfg;
            s.stepwise = None;
            let t = std::time::Instant::now();
            Ok((s.edit_examples(&text, &examples, sequential)?, t.elapsed().as_secs_f64()))
        })?;
        edit_report(out)
    }

    /// EasyEdit's `pre` metrics: text requests (a JSON array) measured on the current
    /// weights without editing them; a JSON array of per-request metrics.
    fn measure(&self, py: Python<'_>, requests: &str) -> PyResult<String> {
        // The caller's records, not a file: a bad one is an input error (ValueError).
        let (records, load) = parse_records(requests, Path::new("requests"), DatasetKind::Requests).map_err(|e| input_err(e.to_string()))?;
        if let Some((i, why)) = load.skipped.first() {
            return Err(input_err(format!("requests: record {i}: {why}")));
        }
        let max_length = self.max_length;
        self.run_ref(py, move |s| measure_unedited(s, &text_examples(s, &records, max_length)?))
    }

    /// [`PySession::measure`] for E-VQA records with images.
    #[pyo3(signature = (records, image_root, rephrase_image_root=None))]
    fn measure_images(&self, py: Python<'_>, records: &str, image_root: PathBuf, rephrase_image_root: Option<PathBuf>) -> PyResult<String> {
        let records = read_image_requests(records, &ImageRoots::new(image_root, rephrase_image_root)).map_err(|e| input_err(e.to_string()))?;
        let max_length = self.max_length;
        self.run_ref(py, move |s| measure_unedited(s, &image_examples(s, &records, max_length)?.1))
    }

    /// Next-token log-probabilities of `text` (after an image when given): the JSON of
    /// `dualedit score --json` and the log-probabilities as a float64 tensor `[n]`.
    #[pyo3(signature = (text, image=None))]
    fn score(&self, py: Python<'_>, text: &str, image: Option<PathBuf>) -> PyResult<(String, PyTensor)> {
        let s = self.run_ref(py, |s| s.score_image(text, image.as_deref()))?;
        let t = Tensor::from_slice(&s.logprobs).to_kind(Kind::Double).to_device(Device::Cpu);
        Ok((json(&s)?, PyTensor(t)))
    }

    /// Greedy continuation of `prompt` (after an image when given), as JSON.
    #[pyo3(signature = (prompt, max_new_tokens=16, image=None))]
    fn generate(&self, py: Python<'_>, prompt: &str, max_new_tokens: usize, image: Option<PathBuf>) -> PyResult<String> {
        let g = self.run_ref(py, |s| s.generate_image(prompt, image.as_deref(), max_new_tokens))?;
        json(&g)
    }

    /// Puts back the loaded weights; returns how many parameters were restored.
    fn reset(&mut self, py: Python<'_>) -> PyResult<usize> {
        self.run(py, |s| s.reset())
    }

    /// Writes the current (edited) model to `dir` as a Hugging Face directory.
    fn save(&self, py: Python<'_>, dir: PathBuf) -> PyResult<()> {
        self.run_ref(py, |s| s.save(&dir))
    }

    /// Memory figures of each device the session uses, as JSON.
    fn memory(&self) -> PyResult<String> {
        json(&self.inner.memory().py()?)
    }

    #[getter]
    fn edits_total(&self) -> usize {
        self.inner.edits_total()
    }

    #[getter]
    fn method(&self) -> &'static str {
        self.inner.method_name()
    }

    #[getter]
    fn model_dir(&self) -> PathBuf {
        self.inner.model_dir().to_path_buf()
    }

    #[getter]
    fn editor_dir(&self) -> Option<PathBuf> {
        self.inner.editor_dir().map(Path::to_path_buf)
    }

    #[getter]
    fn max_positions(&self) -> usize {
        self.inner.max_positions()
    }

    #[getter]
    fn devices(&self) -> Vec<(String, String)> {
        let plan = &self.inner.engine().plan;
        let roles = if plan.split { plan.roles() } else { vec![("main", plan.main)] };
        roles.into_iter().map(|(r, d)| (r.to_string(), dualedit::device::memory::device_name(d))).collect()
    }

    fn __repr__(&self) -> String {
        format!(
            "Session(model={:?}, editor={}, method={:?}, edits_total={})",
            self.inner.model_dir().display().to_string(),
            self.inner.editor_dir().map_or("None".to_string(), |d| format!("{:?}", d.display().to_string())),
            self.inner.method_name(),
            self.inner.edits_total()
        )
    }
}

/// `dualedit train`: meta-trains an editor into `out`; returns the report as JSON.
/// `options`: the keyword arguments of `dualedit.train` as JSON ([`TrainKwargs`]).
#[pyfunction]
fn train(py: Python<'_>, options: &str) -> PyResult<String> {
    let k: TrainKwargs = kwargs("train", options, |k: &TrainKwargs| &k.unknown)?;
    let ds = dataset(k.ds)?;
    if k.limit == Some(0) {
        return Err(input_err("limit must be at least 1"));
    }
    run::check_report_path(k.run.report.as_deref(), &[&k.config]).py()?;
    let mut cfg = MendConfig::from_file(&k.config).py()?;
    if let Some(n) = k.max_steps {
        cfg.max_steps = n;
    }
    if k.recompute {
        cfg.recompute = true;
    }
    if k.compare && k.run.devices.sub_device.is_none() {
        return Err(input_err("compare needs sub_device (the dual side's sub-device)"));
    }
    let opts = TrainOptions {
        common: k.run.resolve(&cfg, cfg.max_length, Phase::Train).py()?,
        data: k.data,
        ds,
        config: cfg,
        out: k.out,
        limit: k.limit,
        resume: k.resume,
        init: k.init,
        // The library's own step bar (stderr); training has no per-step callback.
        progress: k.progress,
    };
    let mut none = |_: Python<'_>, _: ()| Ok(());
    if k.compare {
        // `dualedit compare train`: the dual side placed as asked, the single side main alone.
        let dual = opts.common.plan;
        let cmp = supervised(py, &mut none, &stop_training, |_, _| dualedit::run::compare::compare_train(&opts, dual));
        // A stop that came after the last step must not end the next training.
        dualedit::mend::train::STOP_REQUESTED.store(false, Ordering::SeqCst);
        let cmp = cmp?;
        let mut v = serde_json::to_value(&cmp).map_err(|e| input_err(e.to_string()))?;
        v["report"] = serde_json::Value::from(opts.out.join("compare.json").display().to_string());
        return Ok(v.to_string());
    }
    let trained = supervised(py, &mut none, &stop_training, |_, _| run::run_train(&opts));
    dualedit::mend::train::STOP_REQUESTED.store(false, Ordering::SeqCst);
    let (rep, path) = trained?;
    let mut v = serde_json::to_value(&rep).map_err(|e| input_err(e.to_string()))?;
    v["report"] = serde_json::Value::from(path.display().to_string());
    Ok(v.to_string())
}

/// `dualedit eval`: edits each record from the unedited model (or in groups with
/// `edits_per_batch` / `sequential`) and measures it; returns the CLI's `--json` object.
/// `options`: the keyword arguments of `dualedit.evaluate` as JSON ([`EvalKwargs`]).
#[pyfunction]
#[pyo3(signature = (options, progress=None))]
fn evaluate(py: Python<'_>, options: &str, progress: Option<Bound<'_, PyAny>>) -> PyResult<String> {
    let k: EvalKwargs = kwargs("evaluate", options, |k: &EvalKwargs| &k.unknown)?;
    let ds = dataset(k.ds)?;
    if k.limit == Some(0) {
        return Err(input_err("limit must be at least 1"));
    }
    if k.max_length == 0 {
        return Err(input_err("max_length must be at least 1"));
    }
    let capacity = k.groups.capacity(&k.guard).py()?;
    let many = capacity.as_ref().is_some_and(|c| c.grouping.size() > 1);
    let spec = k.method.resolve(many).py()?;
    if k.compare && k.run.devices.sub_device.is_none() {
        return Err(input_err("compare needs sub_device (the dual side's sub-device)"));
    }
    let opts = EvalOptions {
        common: k.run.resolve(&k.method.planning_config().py()?, k.max_length, Phase::Edit).py()?,
        method: spec,
        data: k.data,
        ds,
        limit: k.limit,
        max_length: k.max_length,
        capacity,
    };
    if k.compare {
        // `dualedit compare eval`: both sides' reports beside `report` (default runs/compare-<time>/).
        let out = opts
            .common
            .report
            .as_ref()
            .and_then(|p| p.parent().map(Path::to_path_buf))
            .unwrap_or_else(|| dualedit::run::report::default_path("compare").with_extension(""));
        let dual = opts.common.plan;
        let mut none = |_: Python<'_>, _: ()| Ok(());
        let cmp = supervised(py, &mut none, &|| (), |_, _| dualedit::run::compare::compare_eval(&opts, dual, &out))?;
        let mut v = serde_json::to_value(&cmp).map_err(|e| input_err(e.to_string()))?;
        v["report"] = serde_json::Value::from(out.join("compare.json").display().to_string());
        return Ok(v.to_string());
    }
    // The total is the data set's record count (after `limit`), known once it is read.
    let progress = progress.as_ref();
    let mut on = |_: Python<'_>, (i, total, m): (usize, usize, String)| call_progress(progress, i + 1, total, &m);
    let (out, path) = supervised(py, &mut on, &|| (), |cancel, tx| {
        run::run_eval_counted(&opts, |i, total, m| {
            stop_if_cancelled(cancel);
            let _ = tx.send((i, total, serde_json::to_string(m).unwrap_or_default()));
        })
    })?;
    // The CLI's `eval --json` object.
    let mut v = serde_json::to_value(&out.summary).map_err(|e| input_err(e.to_string()))?;
    v["method"] = serde_json::Value::from(out.method.clone());
    if let Some(ls) = &out.ls {
        v["ls"] = serde_json::to_value(ls).map_err(|e| input_err(e.to_string()))?;
    }
    if let Some(c) = &out.capacity {
        v["capacity"] = serde_json::to_value(c).map_err(|e| input_err(e.to_string()))?;
    }
    v["records"] = serde_json::to_value(&out.records).map_err(|e| input_err(e.to_string()))?;
    v["data"] = serde_json::to_value(&out.data).map_err(|e| input_err(e.to_string()))?;
    v["report"] = serde_json::Value::from(path.display().to_string());
    Ok(v.to_string())
}

/// `dualedit.plan(...)`'s keywords: the library's `PlanRequest`, as `plan`'s flags.
#[derive(Deserialize)]
struct PlanKwargs {
    #[serde(flatten)]
    request: PlanRequest,
    #[serde(flatten)]
    unknown: BTreeMap<String, serde_json::Value>,
}

/// `dualedit plan`: each device's peak memory for training and editing, from config.json
/// alone (the devices need not exist here); the CLI's `--json` object.
#[pyfunction]
fn plan(py: Python<'_>, options: &str) -> PyResult<String> {
    let k: PlanKwargs = kwargs_of("plan", options, &PlanRequest::fields(), |k: &PlanKwargs| &k.unknown)?;
    py.allow_threads(|| k.request.answer(true)).map(|(out, _)| out).py()
}

/// Keeps the module's logs on stderr at `warn` (or `DUALEDIT_LOG`, an env-filter string).
fn init_logging() {
    let filter = tracing_subscriber::EnvFilter::try_from_env("DUALEDIT_LOG").unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    use std::io::IsTerminal;
    let ansi = std::io::stderr().is_terminal() && std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty());
    let _ = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).with_ansi(ansi).try_init();
}

#[pymodule]
#[pyo3(name = "_native")]
fn native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    // As the CLI starts: the host allocator tuned for libtorch's large tensors.
    dualedit::device::memory::tune_host_allocator();
    dualedit::device::prefer_flash_attention();
    init_logging();
    m.add_class::<PySession>()?;
    m.add_function(wrap_pyfunction!(train, m)?)?;
    m.add_function(wrap_pyfunction!(evaluate, m)?)?;
    m.add_function(wrap_pyfunction!(plan, m)?)?;
    let versions = PyDict::new(m.py());
    versions.set_item("dualedit", env!("CARGO_PKG_VERSION"))?;
    m.add("__versions__", versions)?;
    Ok(())
}
