//! EasyEdit's MEND hyper-parameter files read as they are (`hparams/TRAINING/MEND/*.yaml`
//! for meta-training, `hparams/MEND/*.yaml` for editing): `--config F.yaml` and `dualedit
//! config --from-easyedit F`. Their keys map onto [`MendConfig`]'s (`inner_params` →
//! `edit_params`, `accumulate_bs` → `accumulate`, `max_iters` → `max_steps`, `cedit` →
//! `c_edit`, ...); keys naming what an option of a run gives here (the model, the device,
//! the archive) or what has no meaning here (logging, result folders) are listed in
//! [`FromEasyEdit::ignored`] with the option to use, never silently dropped; a value this
//! editor cannot be (another `mlp_class`, another algorithm) is an error naming the key.
//!
//! The YAML read is the subset those files use: a flat mapping of `key: scalar` lines and
//! `key:` followed by `- item` lines, `#` comments, quoted or plain scalars. Anything else
//! (nested mappings, flow collections, anchors, multi-line strings) is an error naming the
//! line, not a guess.
use std::collections::BTreeMap;

use super::{EditorMode, MendConfig};
use crate::{Error, Result};

/// A YAML scalar or list of scalars, as those files write them.
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    Null,
    Bool(bool),
    Number(f64),
    Str(String),
    List(Vec<Value>),
}

impl Value {
    fn describe(&self) -> String {
        match self {
            Value::Null => "null".into(),
            Value::Bool(b) => b.to_string(),
            Value::Number(n) => n.to_string(),
            Value::Str(s) => format!("{s:?}"),
            Value::List(l) => format!("a list of {}", l.len()),
        }
    }
}

/// The config and what of the file it does not carry.
#[derive(Debug, Clone)]
pub struct FromEasyEdit {
    pub config: MendConfig,
    /// `key (why)` for every key of the file that is not part of the config.
    pub ignored: Vec<String>,
}

/// Reads the flat YAML subset EasyEdit's hparams files use (see the module docs).
pub fn parse_yaml(text: &str) -> Result<BTreeMap<String, Value>> {
    let mut out = BTreeMap::new();
    let mut list_key: Option<String> = None;
    for (i, raw) in text.lines().enumerate() {
        let n = i + 1;
        let line = strip_comment(raw);
        if line.trim().is_empty() {
            continue;
        }
        let trimmed = line.trim_start();
        if let Some(item) = trimmed
            .strip_prefix("- ")
            .or_else(|| (trimmed == "-").then_some(""))
        {
            let Some(key) = &list_key else {
                return Err(Error::input(format!(
                    "line {n}: a list item outside a list (`key:` on the line before)"
                )));
            };
            let v = scalar(item.trim(), n)?;
            if let Some(Value::List(l)) = out.get_mut(key) {
                l.push(v);
            }
            continue;
        }
        if line.starts_with(char::is_whitespace) {
            return Err(Error::input(format!(
                "line {n}: nested mappings are not part of EasyEdit's hparams files: {}",
                raw.trim()
            )));
        }
        let Some((key, rest)) = line.split_once(':') else {
            return Err(Error::input(format!(
                "line {n}: expected `key: value`, got {:?}",
                raw.trim()
            )));
        };
        let key = key.trim().to_string();
        if key.is_empty() || key.contains(char::is_whitespace) {
            return Err(Error::input(format!("line {n}: {key:?} is not a key")));
        }
        if out.contains_key(&key) {
            return Err(Error::input(format!("line {n}: {key} appears twice")));
        }
        let rest = rest.trim();
        if rest.is_empty() {
            // `key:` then `- item` lines; none at all reads as YAML's null.
            out.insert(key.clone(), Value::List(Vec::new()));
            list_key = Some(key);
        } else {
            out.insert(key, scalar(rest, n)?);
            list_key = None;
        }
    }
    // A `key:` with no items is null in YAML.
    for v in out.values_mut() {
        if *v == Value::List(Vec::new()) {
            *v = Value::Null;
        }
    }
    Ok(out)
}

/// The line without a `#` comment (a `#` at its start or after whitespace, outside quotes).
fn strip_comment(line: &str) -> &str {
    let mut quote: Option<char> = None;
    let mut prev_space = true;
    for (i, c) in line.char_indices() {
        match quote {
            Some(q) if c == q => quote = None,
            Some(_) => {}
            None if c == '\'' || c == '"' => quote = Some(c),
            None if c == '#' && prev_space => return &line[..i],
            None => {}
        }
        prev_space = c.is_whitespace();
    }
    line
}

fn scalar(s: &str, line: usize) -> Result<Value> {
    if let Some(inner) = s
        .strip_prefix('"')
        .and_then(|r| r.strip_suffix('"'))
        .or_else(|| s.strip_prefix('\'').and_then(|r| r.strip_suffix('\'')))
    {
        return Ok(Value::Str(inner.to_string()));
    }
    if s.starts_with(['[', '{', '&', '*', '|', '>', '!']) {
        return Err(Error::input(format!("line {line}: {s:?}: flow collections, anchors, tags and block strings are not part of EasyEdit's hparams files")));
    }
    Ok(match s {
        "null" | "Null" | "NULL" | "~" => Value::Null,
        "true" | "True" | "TRUE" => Value::Bool(true),
        "false" | "False" | "FALSE" => Value::Bool(false),
        _ => match s.parse::<f64>() {
            // YAML 1.1 (PyYAML) reads `1e-6` as a string; EasyEdit turns such strings into
            // floats (`construct_float_from_scientific_notation`): a number either way.
            Ok(x) if x.is_finite() => Value::Number(x),
            _ => Value::Str(s.to_string()),
        },
    })
}

/// Keys of the file that name what an option of a run gives here, with that option's field
/// (the CLI prints it as its flag: `` `model` `` as `--model`).
const BY_OPTION: &[(&str, &str)] = &[
    ("name", "`model`"),
    ("model_name", "`model`"),
    ("model_class", "`model` (the family is read from its config.json)"),
    ("tokenizer_class", "`model` (its tokenizer.json)"),
    ("tokenizer_name", "`model` (its tokenizer.json)"),
    ("device", "`device` / `sub_device`"),
    ("model_parallel", "`device` / `sub_device` / `placement`"),
    ("archive", "`editor` (edit, eval) or `resume` (train)"),
    ("results_dir", "`out`"),
    ("seed", "`seed`"),
    ("half", "`dtype`"),
    ("coco_image", "`image_root`"),
    ("rephrase_image", "`rephrase_image_root`"),
];

/// Keys with no meaning here (logging, saving cadence, other models' parts).
const NO_MEANING: &[&str] = &[
    "alg",
    "alg_name",
    "model_save_pt",
    "silent",
    "log_interval",
    "eval_log_interval",
    "final_eval",
    "eval_only",
    "debug",
    "save",
    "verbose",
    "val_batch_size",
    "early_stop_key",
    "qformer_checkpoint",
    "qformer_name_or_path",
    "state_dict_file",
    "exact_match",
    "freeze_qformer",
    "pretrained_ckpt",
    "max_epochs",
    "no_grad_layers",
    "cbase",
    "lr_scale",
    "n_edits",
];

/// Reads an EasyEdit MEND hparams file's text as a [`MendConfig`] (validated).
pub fn from_easyedit(text: &str) -> Result<FromEasyEdit> {
    let map = parse_yaml(text)?;
    let alg = map.get("alg_name").or_else(|| map.get("alg"));
    match alg {
        Some(Value::Str(a)) if a.eq_ignore_ascii_case("mend") => {}
        Some(v) => {
            return Err(Error::input(format!(
                "alg_name is {}: dualedit reads MEND's hparams",
                v.describe()
            )))
        }
        None => {
            return Err(Error::input(
                "no alg_name (or alg): not an EasyEdit hparams file",
            ))
        }
    }
    let mut cfg = MendConfig::default();
    let mut ignored = Vec::new();
    let num = |k: &str, v: &Value| -> Result<f64> {
        match v {
            Value::Number(x) => Ok(*x),
            other => Err(Error::input(format!(
                "{k} must be a number, got {}",
                other.describe()
            ))),
        }
    };
    let count = |k: &str, v: &Value| -> Result<usize> {
        let x = num(k, v)?;
        if x < 0.0 || x.fract() != 0.0 || x > usize::MAX as f64 {
            return Err(Error::input(format!("{k} must be a whole number, got {x}")));
        }
        Ok(x as usize)
    };
    let flag = |k: &str, v: &Value| -> Result<bool> {
        match v {
            Value::Bool(b) => Ok(*b),
            other => Err(Error::input(format!(
                "{k} must be true or false, got {}",
                other.describe()
            ))),
        }
    };
    let mode_flags: Vec<(&str, bool)> = ["combine", "x_only", "delta_only", "one_sided"]
        .iter()
        .map(|k| {
            Ok((
                *k,
                map.get(*k)
                    .map(|v| flag(k, v))
                    .transpose()?
                    .unwrap_or(false),
            ))
        })
        .collect::<Result<_>>()?;
    let on = |k: &str| mode_flags.iter().any(|(n, b)| *n == k && *b);
    cfg.mode = if on("x_only") {
        EditorMode::XOnly
    } else if on("delta_only") {
        EditorMode::DeltaOnly
    } else if on("one_sided") {
        EditorMode::OneSided
    } else if on("combine") {
        EditorMode::Combine
    } else {
        EditorMode::Separate
    };
    for (k, v) in &map {
        match k.as_str() {
            "inner_params" => {
                let Value::List(items) = v else {
                    return Err(Error::input(format!(
                        "inner_params must be a list of weight names, got {}",
                        v.describe()
                    )));
                };
                cfg.edit_params = items
                    .iter()
                    .map(|i| match i {
                        Value::Str(s) => Ok(s.clone()),
                        other => Err(Error::input(format!(
                            "inner_params: {} is not a weight name",
                            other.describe()
                        ))),
                    })
                    .collect::<Result<_>>()?;
            }
            "rank" => cfg.rank = count(k, v)? as i64,
            "n_hidden" => cfg.n_hidden = count(k, v)? as i64,
            "shared" => cfg.shared = flag(k, v)?,
            "norm" => cfg.norm = flag(k, v)?,
            "cedit" => cfg.c_edit = num(k, v)?,
            "cloc" => cfg.c_loc = num(k, v)?,
            "iedit" => cfg.i_edit = num(k, v)?,
            "lr" => cfg.lr = num(k, v)?,
            "edit_lr" => cfg.edit_lr = num(k, v)?,
            "lr_lr" => cfg.lr_lr = num(k, v)?,
            "batch_size" => cfg.batch_size = count(k, v)?,
            "accumulate_bs" => cfg.accumulate = count(k, v)?,
            "grad_clip" => cfg.grad_clip = num(k, v)?,
            "max_iters" => cfg.max_steps = count(k, v)?,
            "val_interval" => cfg.val_every = count(k, v)?,
            "val_steps" => cfg.val_records = count(k, v)?,
            "early_stop_patience" => cfg.early_stop_patience = count(k, v)?,
            "max_length" => cfg.max_length = count(k, v)?,
            "combine" | "x_only" | "delta_only" | "one_sided" => {}
            // What this editor is, and only can be: checked, not carried.
            "mlp_class" => expect(k, v, &["IDMLP"], "the editor here is MEND's IDMLP")?,
            "init" => expect(
                k,
                v,
                &["id"],
                "the editor's layers start as MEND's identity init",
            )?,
            "act" => expect(k, v, &["relu"], "the editor's activation is ReLU")?,
            "opt" => expect(k, v, &["Adam"], "the editor is trained with Adam")?,
            "train_base" => {
                if flag(k, v)? {
                    return Err(Error::input("train_base: true (training the base model beside the editor) is not supported"));
                }
            }
            "dropout" => {
                if num(k, v)? != 0.0 {
                    ignored.push(format!(
                        "dropout = {} (the editor has no dropout)",
                        v.describe()
                    ));
                }
            }
            "hidden_dim" => {
                if *v != Value::Null {
                    ignored.push(format!("hidden_dim = {} (the editor's hidden width is its input's, rank-limited by `rank`)", v.describe()));
                }
            }
            _ => {
                if let Some((_, f)) = BY_OPTION.iter().find(|(n, _)| n == k) {
                    ignored.push(format!("{k} ({f})"));
                } else if NO_MEANING.contains(&k.as_str()) {
                    ignored.push(format!("{k} (no meaning here)"));
                } else {
                    ignored.push(format!("{k} (unknown to dualedit)"));
                }
            }
        }
    }
    cfg.validate()?;
    Ok(FromEasyEdit {
        config: cfg,
        ignored,
    })
}

fn expect(key: &str, v: &Value, allowed: &[&str], why: &str) -> Result<()> {
    match v {
        Value::Str(s) if allowed.iter().any(|a| a.eq_ignore_ascii_case(s)) => Ok(()),
        other => Err(Error::input(format!(
            "{key}: {} is not supported ({why})",
            other.describe()
        ))),
    }
}

/// Whether a config path names an EasyEdit YAML (by its extension).
pub fn is_yaml(path: &std::path::Path) -> bool {
    path.extension()
        .is_some_and(|e| e.eq_ignore_ascii_case("yaml") || e.eq_ignore_ascii_case("yml"))
}

#[cfg(test)]
mod tests {
    use super::*;

    const QWEN2VL_7B: &str = "# Model\ndevice: 0\n\nname: hugging_cache/qwen2-vl-7b\nmodel_name: qwen2-vl-7b\ninner_params:\n- model.layers.25.mlp.up_proj.weight\n- model.layers.25.mlp.down_proj.weight\n\n# Method\nalg: MEND\nlr: 1e-6\nedit_lr: 1e-4\nlr_lr: 1e-4\nseed: 42\ncedit: 0.1\niedit: 0.1\ncloc: 1.0\ncbase: 1.0\ndropout: 0.0\ntrain_base: False\nno_grad_layers: null\none_sided: False\nn_hidden: 1\nhidden_dim: null\ninit: id\nnorm: True\ncombine: True\nx_only: False\ndelta_only: False\nact: relu\nrank: 1920\nmlp_class: IDMLP\nshared: True\narchive: null\nbatch_size: 1\n#max_epochs: 1\nmax_iters: 30000\nearly_stop_key: \"loss/total_edit_val\"\naccumulate_bs: 2\nval_steps: 500 # only for debug\nopt: Adam\ngrad_clip: 100.\n";

    #[test]
    fn qwen2vl_training_yaml_maps_onto_the_config() {
        let r = from_easyedit(QWEN2VL_7B).unwrap();
        let c = &r.config;
        assert_eq!(
            c.edit_params,
            [
                "model.layers.25.mlp.up_proj.weight",
                "model.layers.25.mlp.down_proj.weight"
            ]
        );
        assert_eq!(
            (c.rank, c.n_hidden, c.mode, c.shared, c.norm),
            (1920, 1, EditorMode::Combine, true, true)
        );
        assert_eq!(
            (c.lr, c.edit_lr, c.lr_lr, c.c_edit, c.c_loc, c.i_edit),
            (1e-6, 1e-4, 1e-4, 0.1, 1.0, 0.1)
        );
        assert_eq!(
            (c.accumulate, c.max_steps, c.val_records, c.grad_clip),
            (2, 30000, 500, 100.0)
        );
        assert!(
            r.ignored
                .iter()
                .any(|i| i == "device (`device` / `sub_device`)"),
            "{:?}",
            r.ignored
        );
        assert!(
            r.ignored.iter().any(|i| i == "name (`model`)"),
            "{:?}",
            r.ignored
        );
    }

    #[test]
    fn refusals_name_the_key_or_line() {
        let config = |t: &str| from_easyedit(t).map(|_| ());
        let yaml = |t: &str| parse_yaml(t).map(|_| ());
        let cases: [(&dyn Fn(&str) -> Result<()>, &str, &[&str]); 6] = [
            (&config, "alg_name: ROME\n", &["alg_name", "ROME"]),
            (&config, "alg: MEND\nmlp_class: MLP\n", &["mlp_class"]),
            (&yaml, "alg: MEND\nouter:\n  inner: 1\n", &["line 3"]),
            (&yaml, "a: [1, 2]\n", &["line 1"]),
            (&config, "alg: MEND\nrank: 0\n", &["rank"]),
            (&config, "alg: MEND\nrank: 1.5\n", &["rank"]),
        ];
        for (read, text, needles) in cases {
            let e = read(text).unwrap_err().to_string();
            assert!(needles.iter().all(|n| e.contains(n)), "{text:?}: {e}");
        }
    }

    #[test]
    fn comments_quotes_and_empty_lists() {
        let m = parse_yaml("a: 'x # y' # c\nb: \"q\"\nc:\nd: 1e-3\n").unwrap();
        assert_eq!(m["a"], Value::Str("x # y".into()));
        assert_eq!(m["b"], Value::Str("q".into()));
        assert_eq!(m["c"], Value::Null);
        assert_eq!(m["d"], Value::Number(1e-3));
    }
}
