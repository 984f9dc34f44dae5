//! The checkpoint's own chat template, rendered as transformers renders it.
//!
//! EasyEdit builds every image view of E-VQA / E-IC with
//! `processor.apply_chat_template(messages, add_generation_prompt=True)` on one user turn
//! `[{"type": "image"}, {"type": "text", "text": question}]`, then appends `" " + target`.
//! The template is the checkpoint's: a fine-tuned model may carry a different system
//! prompt or turn markers than Qwen2-VL's, and a prompt built with another template is
//! not the prompt the model (or EasyEdit) sees.
//!
//! Where it comes from, in transformers' order: `chat_template.jinja`, then
//! `chat_template.json` (`{"chat_template": "..."}`), then `tokenizer_config.json`'s
//! `chat_template` (a string, or a list of named templates: `default`). A checkpoint with
//! none gets its family's released template (Qwen2-VL's for the Qwen2-VL family), with
//! one warning per process.
//!
//! Rendering uses minijinja set up as transformers sets up Jinja2 for chat templates
//! (`trim_blocks`, `lstrip_blocks`, loop controls, `raise_exception`, `tojson`) plus
//! Python's string methods (`.strip()`, `.startswith()`, ...) through
//! `minijinja-contrib`'s `pycompat`, which HF templates call.
use std::path::{Path, PathBuf};

use minijinja::{context, Environment, Value};
use serde_json::Value as Json;

use crate::{Error, Result};


/// How messages name a family's built-in template, which has no file.
const BUILT_IN: &str = "<the model family's default chat template>";

/// The name the template is registered under in its environment.
const NAME: &str = "chat";

/// The instructions one rendering may run (minijinja's fuel): Qwen2-VL's template takes a
/// few hundred for one turn; a loop over a large range (nested, say) is stopped here
/// instead of running without bound.
const FUEL: u64 = 1_000_000;

/// The most bytes one rendered prompt may take.
const MAX_RENDERED_BYTES: usize = 1 << 20;

/// A compiled chat template and the special-token globals (`bos_token`, ...) of its
/// checkpoint.
pub struct ChatTemplate {
    env: Environment<'static>,
    /// The file the template came from; `None` for the built-in default.
    origin: Option<PathBuf>,
    /// The template's source text.
    text: String,
    /// What the template must render for the one image of a turn, exactly once (the
    /// family's, e.g. Qwen2-VL's `<|vision_start|><|image_pad|><|vision_end|>`): the
    /// prompt's ids are built by expanding its pad token to the image's patches.
    markers: &'static str,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate").field("origin", &self.origin).finish()
    }
}

impl ChatTemplate {
    /// The template of the checkpoint in `dir` (see the module docs for the order), or
    /// the family's `default` when it has none (families call this through
    /// [`crate::model::VisionLanguage::chat_template`]). A file that is there but
    /// unreadable (a directory, FIFO or device included), not the JSON it should be, not
    /// a valid template, or one whose image turn lacks the default's image markers (once)
    /// is an error naming it.
    pub fn load(dir: &Path, default: &'static ChatTemplate) -> Result<Self> {
        let tokenizer_config = read_json_if_present(&dir.join("tokenizer_config.json"))?;
        let jinja = dir.join("chat_template.jinja");
        let json = dir.join("chat_template.json");
        // Present in any form (a link, a folder, a FIFO): read, so that what is not a
        // template file is named rather than passed over for the default.
        let (text, origin) = if std::fs::symlink_metadata(&jinja).is_ok() {
            (crate::io::read_text(&jinja)?, jinja)
        } else if let Some(v) = read_json_if_present(&json)? {
            let t = template_field(&v).ok_or_else(|| Error::file(&json, "has no \"chat_template\" string"))?;
            (t, json)
        } else if let Some(t) = tokenizer_config.as_ref().and_then(template_field) {
            (t, dir.join("tokenizer_config.json"))
        } else {
            static WARN: std::sync::Once = std::sync::Once::new();
            WARN.call_once(|| {
                tracing::warn!(dir = %dir.display(), "the checkpoint has no chat template (chat_template.jinja / .json, tokenizer_config.json): the E-VQA prompts use the model family's default");
            });
            return Ok(default.clone_default());
        };
        let mut t = Self::compile(text, Some(origin), default.markers)?;
        if let Some(cfg) = &tokenizer_config {
            t.add_special_tokens(cfg);
        }
        t.check_image_markers()?;
        Ok(t)
    }

    /// The template's image turn must show the image: its markers exactly once.
    fn check_image_markers(&self) -> Result<()> {
        let probe = self.image_prompt("What is in the image?")?;
        let markers = self.markers;
        let n = probe.matches(markers).count();
        if n != 1 {
            let at = self.origin.clone().unwrap_or_default();
            return Err(Error::file(
                at,
                format!("the chat template renders {markers} {n} times for a turn with one image, expected once (without it the image is not in the prompt): {probe:?}"),
            ));
        }
        Ok(())
    }

    fn clone_default(&self) -> Self {
        Self { env: self.env.clone(), origin: None, text: self.text.clone(), markers: self.markers }
    }

    /// Compiles `text` (from `origin`, for messages; `None` for a family's built-in
    /// default) in an environment set up as transformers' (see the module docs); an image
    /// turn must render `markers` once.
    pub fn compile(text: String, origin: Option<PathBuf>, markers: &'static str) -> Result<Self> {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.set_fuel(Some(FUEL));
        env.add_function("raise_exception", |msg: String| -> std::result::Result<Value, minijinja::Error> {
            Err(minijinja::Error::new(minijinja::ErrorKind::InvalidOperation, msg))
        });
        let at = origin.clone().unwrap_or_else(|| PathBuf::from(BUILT_IN));
        env.add_template_owned(NAME, text.clone()).map_err(|e| Error::file(&at, format!("invalid chat template: {e:#}")))?;
        Ok(Self { env, origin, text, markers })
    }

    /// `bos_token`, `eos_token`, `pad_token`, `unk_token` from `tokenizer_config.json`
    /// (a string or `{"content": ...}`), as transformers passes them to the template.
    fn add_special_tokens(&mut self, cfg: &Json) {
        for key in ["bos_token", "eos_token", "pad_token", "unk_token"] {
            let v = match cfg.get(key) {
                Some(Json::String(s)) => Some(s.clone()),
                Some(Json::Object(o)) => o.get("content").and_then(Json::as_str).map(String::from),
                _ => None,
            };
            if let Some(v) = v {
                self.env.add_global(key, v);
            }
        }
    }

    /// The file the template came from (`None`: the family's default).
    pub fn origin(&self) -> Option<&Path> {
        self.origin.as_deref()
    }

    /// The template's source text (what a checkpoint writes as `chat_template.jinja`).
    pub fn text(&self) -> &str {
        &self.text
    }

    /// `apply_chat_template([user: image, text], add_generation_prompt=True)`: the prompt
    /// of one user turn showing one image, then `text` (trimmed), ready for the answer.
    pub fn image_prompt(&self, text: &str) -> Result<String> {
        let messages = serde_json::json!([{
            "role": "user",
            "content": [{"type": "image"}, {"type": "text", "text": text.trim()}],
        }]);
        let at = || self.origin.clone().unwrap_or_else(|| PathBuf::from(BUILT_IN));
        let tmpl = self.env.get_template(NAME).map_err(|e| Error::file(at(), e.to_string()))?;
        let mut out = Capped(Vec::new());
        tmpl.render_captured_to(context! { messages => Value::from_serialize(&messages), add_generation_prompt => true }, &mut out)
            .map_err(|e| match e.kind() {
                minijinja::ErrorKind::OutOfFuel => Error::file(at(), format!("the chat template ran past {FUEL} instructions for one turn (a loop without bound?)")),
                minijinja::ErrorKind::WriteFailure => Error::file(at(), format!("the chat template rendered more than {MAX_RENDERED_BYTES} bytes for one turn")),
                _ => Error::file(at(), format!("rendering the chat template failed: {e:#}")),
            })?;
        String::from_utf8(out.0).map_err(|e| Error::file(at(), format!("the chat template rendered invalid UTF-8: {e}")))
    }
}

/// A rendering's output, refused past [`MAX_RENDERED_BYTES`].
struct Capped(Vec<u8>);

impl std::io::Write for Capped {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        if self.0.len() + buf.len() > MAX_RENDERED_BYTES {
            return Err(std::io::Error::other("rendered prompt too large"));
        }
        self.0.extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// The template text of a `chat_template.json` or `tokenizer_config.json`: a string, or
/// the `default` entry (else the first) of a list of `{name, template}`.
fn template_field(v: &Json) -> Option<String> {
    match v.get("chat_template")? {
        Json::String(s) => Some(s.clone()),
        Json::Array(list) => {
            let named = |n: &str| list.iter().find(|e| e.get("name").and_then(Json::as_str) == Some(n));
            named("default").or_else(|| list.first())?.get("template")?.as_str().map(String::from)
        }
        _ => None,
    }
}

fn read_json_if_present(path: &Path) -> Result<Option<Json>> {
    if std::fs::symlink_metadata(path).is_err() {
        return Ok(None);
    }
    let text = crate::io::read_text(path)?;
    serde_json::from_str(&text).map(Some).map_err(|e| Error::file(path, format!("malformed JSON: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::qwen2_vl::default_chat_template;

    #[test]
    fn a_checkpoints_template_wins_and_bad_ones_are_named() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(
            dir.path().join("tokenizer_config.json"),
            r#"{"bos_token": {"content": "<s>"}, "chat_template": "TOKCFG"}"#,
        )
        .unwrap();
        // A template that drops the image markers is named.
        let err = ChatTemplate::load(dir.path(), default_chat_template()).unwrap_err().to_string();
        assert!(err.contains("tokenizer_config.json") && err.contains("0 times"), "{err}");
        std::fs::write(
            dir.path().join("tokenizer_config.json"),
            r#"{"bos_token": {"content": "<s>"}, "chat_template": "TOKCFG<|vision_start|><|image_pad|><|vision_end|>"}"#,
        )
        .unwrap();
        assert_eq!(ChatTemplate::load(dir.path(), default_chat_template()).unwrap().image_prompt("q").unwrap(), "TOKCFG<|vision_start|><|image_pad|><|vision_end|>");
        std::fs::write(dir.path().join("chat_template.json"), r#"{"chat_template": "JSON {{ bos_token }}<|vision_start|><|image_pad|><|vision_end|>"}"#).unwrap();
        assert_eq!(ChatTemplate::load(dir.path(), default_chat_template()).unwrap().image_prompt("q").unwrap(), "JSON <s><|vision_start|><|image_pad|><|vision_end|>");
        let jinja = "{% for m in messages %}[{{ m.role | upper }}]{% for c in m.content %}{% if c.type == 'text' %}{{ c.text.strip() }}{% else %}<|vision_start|><|image_pad|><|vision_end|>{% endif %}{% endfor %}{% endfor %}{% if add_generation_prompt %}=>{% endif %}";
        std::fs::write(dir.path().join("chat_template.jinja"), jinja).unwrap();
        assert_eq!(ChatTemplate::load(dir.path(), default_chat_template()).unwrap().image_prompt("q").unwrap(), "[USER]<|vision_start|><|image_pad|><|vision_end|>q=>");
        std::fs::write(dir.path().join("chat_template.jinja"), "{% if x %}").unwrap();
        let err = ChatTemplate::load(dir.path(), default_chat_template()).unwrap_err().to_string();
        assert!(err.contains("chat_template.jinja") && err.contains("invalid chat template"), "{err}");
        std::fs::write(dir.path().join("chat_template.jinja"), "{{ raise_exception('no images here') }}").unwrap();
        let err = ChatTemplate::load(dir.path(), default_chat_template()).unwrap_err().to_string();
        assert!(err.contains("no images here"), "{err}");
    }

}
