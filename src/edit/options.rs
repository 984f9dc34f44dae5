//! The edit method as a user chooses it, one option type for every interface: the CLI
//! flattens it into flags (`--method`, `--editor`, `--ft-lr`, `--ls-*`), the Python
//! package takes its fields as keyword arguments, JSON takes it as an object. It is
//! validated once, here, and its errors name its fields.
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::MethodSpec;
use crate::config::MendConfig;
use crate::mend::ls::LsChoice;
use crate::{Error, Result};

/// The fine-tuning baseline's step size when none is given.
pub const DEFAULT_FT_LR: f64 = 1e-3;

/// An edit method by name: [`MethodName::as_str`] is its one spelling, which the library,
/// the CLI (`--method`), serve's JSON and Python all read and write.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MethodName {
    /// One request: `mend`; several, or one after another: `mend-ls` with the editor for
    /// many edits ([`MethodSpec::Auto`]).
    Auto,
    Mend,
    MendLs,
    Ft,
    Unedited,
}

impl std::str::FromStr for MethodName {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        let s = s.trim();
        Self::ALL.into_iter().find(|m| m.as_str() == s || m.aliases().contains(&s)).ok_or_else(|| {
            let names: Vec<String> = Self::ALL.iter().map(|m| format!("{:?}", m.as_str())).collect();
            Error::input(format!("method must be one of {}, got {s:?}", names.join(", ")))
        })
    }
}

impl Serialize for MethodName {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> std::result::Result<S::Ok, S::Error> {
        serializer.serialize_str(self.as_str())
    }
}

impl<'de> Deserialize<'de> for MethodName {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> std::result::Result<Self, D::Error> {
        String::deserialize(deserializer)?.parse().map_err(serde::de::Error::custom)
    }
}

impl MethodName {
    /// Every method, in the order `--help` lists them.
    pub const ALL: [Self; 5] = [Self::Auto, Self::Mend, Self::MendLs, Self::Ft, Self::Unedited];

    /// The name as the interfaces spell it.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Auto => "auto",
            Self::Mend => "mend",
            Self::MendLs => "mend-ls",
            Self::Ft => "ft",
            Self::Unedited => "unedited",
        }
    }

    /// Other spellings read as this method.
    pub fn aliases(self) -> &'static [&'static str] {
        match self {
            Self::MendLs => &["mend_ls"],
            Self::Unedited => &["none"],
            _ => &[],
        }
    }

    fn uses_editor(self) -> bool {
        matches!(self, Self::Auto | Self::Mend | Self::MendLs)
    }

    fn solves(self) -> bool {
        matches!(self, Self::Auto | Self::MendLs)
    }
}

/// How to edit: the method, its editor and its settings.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MethodOptions {
    /// `None`: `auto` with an editor, `unedited` without.
    #[serde(default)]
    pub method: Option<MethodName>,
    /// The trained editor's directory (`auto`, `mend`, `mend-ls`).
    #[serde(default)]
    pub editor: Option<PathBuf>,
    /// The fine-tuning baseline's step size (`ft`).
    #[serde(default = "default_ft_lr")]
    pub ft_lr: f64,
    /// `mend-ls`'s ridge λ, the unrelated keys' weight and its re-solve rounds (the
    /// editor's when not given), and a text whose keys the solve keeps.
    #[serde(default)]
    pub ls_lambda: Option<f64>,
    #[serde(default)]
    pub ls_keep_weight: Option<f64>,
    #[serde(default)]
    pub ls_rounds: Option<usize>,
    #[serde(default)]
    pub ls_keep_text: Option<PathBuf>,
}

fn default_ft_lr() -> f64 {
    DEFAULT_FT_LR
}

impl Default for MethodOptions {
    fn default() -> Self {
        Self { method: None, editor: None, ft_lr: DEFAULT_FT_LR, ls_lambda: None, ls_keep_weight: None, ls_rounds: None, ls_keep_text: None }
    }
}

impl MethodOptions {
    /// The method named, or the default for the editor given.
    pub fn name(&self) -> MethodName {
        self.method.unwrap_or(if self.editor.is_some() { MethodName::Auto } else { MethodName::Unedited })
    }

    /// The method these options ask for, checked: a setting given to a method that does
    /// not use it, or out of its range, is one error naming the field. `many`: the run
    /// edits several requests or one after another, or cannot know (a server, a library
    /// session), which `auto` makes with `mend-ls` ([`MethodSpec::Auto`]).
    pub fn resolve(&self, many: bool) -> Result<MethodSpec> {
        let method = self.name();
        if self.editor.is_some() && !method.uses_editor() {
            return Err(Error::input(format!("editor is only used with method \"auto\", \"mend\" or \"mend-ls\", not {:?}", method.as_str())));
        }
        if self.ls_keep_text.is_some() && !method.solves() {
            return Err(Error::input("ls_keep_text is only used with method \"mend-ls\" (or \"auto\")"));
        }
        if (self.ls_lambda.is_some() || self.ls_keep_weight.is_some() || self.ls_rounds.is_some()) && !method.solves() {
            return Err(Error::input("ls_lambda, ls_keep_weight and ls_rounds are only used with method \"mend-ls\" (or \"auto\")"));
        }
        let ls = LsChoice { lambda: self.ls_lambda, cov_weight: self.ls_keep_weight, rounds: self.ls_rounds };
        ls.check()?;
        // ft_lr has a default, so it is checked whichever method runs.
        MethodSpec::FineTune { lr: self.ft_lr }.check()?;
        let editor = || {
            self.editor.clone().ok_or_else(|| {
                Error::input(format!("method {:?} needs an editor (a trained editor's directory; the embedded default's is data/editor)", method.as_str()))
            })
        };
        Ok(match method {
            MethodName::Auto => MethodSpec::Auto { editor: editor()?, ls, unrelated: self.ls_keep_text.clone(), many },
            MethodName::Mend => MethodSpec::Mend { editor: editor()? },
            MethodName::MendLs => MethodSpec::MendLs { editor: editor()?, ls, unrelated: self.ls_keep_text.clone() },
            MethodName::Ft => MethodSpec::FineTune { lr: self.ft_lr },
            MethodName::Unedited => MethodSpec::Unedited,
        })
    }

    /// The MEND config a placement is planned with: the trained editor's (its
    /// editor.json), MEND's defaults for the baselines.
    pub fn planning_config(&self) -> Result<MendConfig> {
        match self.editor_dir() {
            Some(dir) => crate::mend::checkpoint::trained_config(dir),
            None => Ok(MendConfig::default()),
        }
    }

    /// The editor's directory, when the method uses one.
    pub fn editor_dir(&self) -> Option<&Path> {
        self.editor.as_deref().filter(|_| self.name().uses_editor())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn options_are_checked_once_and_errors_name_fields() {
        let o: MethodOptions = serde_json::from_value(serde_json::json!({"method": "mend_ls", "editor": "e", "ls_rounds": 2})).unwrap();
        assert!(matches!(o.resolve(true).unwrap(), MethodSpec::MendLs { ls: LsChoice { rounds: Some(2), .. }, .. }));
        assert!(serde_json::from_value::<MethodOptions>(serde_json::json!({"metod": "mend"})).is_err(), "unknown fields are refused");
        let name = |o: MethodOptions| o.resolve(false).unwrap_err().to_string();
        assert!(name(MethodOptions { method: Some(MethodName::Ft), ls_lambda: Some(1.0), ..Default::default() }).contains("ls_lambda"));
        assert!(name(MethodOptions { method: Some(MethodName::Ft), ft_lr: f64::NAN, ..Default::default() }).contains("ft_lr"));
        assert!(name(MethodOptions { method: Some(MethodName::Mend), ..Default::default() }).contains("needs an editor"));
        assert!(name(MethodOptions { editor: Some("e".into()), ls_keep_weight: Some(-1.0), ..Default::default() }).contains("ls_keep_weight"));
        assert!(name(MethodOptions { method: Some(MethodName::Unedited), editor: Some("e".into()), ..Default::default() }).contains("editor"));
        assert_eq!(MethodOptions::default().name(), MethodName::Unedited);
        assert_eq!("none".parse::<MethodName>().unwrap(), MethodName::Unedited);
    }

    #[test]
    fn every_method_name_is_spelled_once_and_read_back_the_same_everywhere() {
        for m in MethodName::ALL {
            let json = serde_json::to_value(m).unwrap();
            assert_eq!(json, m.as_str());
            assert_eq!(serde_json::from_value::<MethodName>(json).unwrap(), m);
            assert_eq!(m.as_str().parse::<MethodName>().unwrap(), m);
            for alias in m.aliases() {
                assert_eq!(serde_json::from_value::<MethodName>(serde_json::json!(alias)).unwrap(), m);
            }
        }
        let err = serde_json::from_value::<MethodOptions>(serde_json::json!({"method": "rome"})).unwrap_err().to_string();
        assert!(err.contains("\"rome\"") && err.contains("\"mend-ls\""), "{err}");
    }
}
