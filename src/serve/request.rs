//! A request body parsed and validated into an [`Op`]: the JSON fields one by one (each
//! 400 names the field at fault), the images confined to the image root or decoded from
//! base64 into private temporary files, and the files the request names kept under the
//! client's names ([`ClientPaths`]) so that errors never show the server's own paths.
use std::path::{Path, PathBuf};

use serde_json::{Map, Value};
use tracing::info;

use super::failure::Failure;
use super::options::{ServeOptions, DEFAULT_MAX_NEW_TOKENS};
use crate::data::easyedit::{parse_records, DatasetKind, EditRecord};
use crate::data::multimodal::{ImageRoots, MmRecord, IMAGE_KEYS};
use crate::edit::session::{image_kind, read_image_requests, TempImage};
use crate::mend::guard::{GuardConfig, GuardOverrides};
use crate::Error;

/// A model request, parsed and validated by a worker.
pub(super) enum Op {
    /// Text edit requests, guarded by `guard` (`None`: committed as the editor makes them).
    Edit { records: Vec<EditRecord>, guard: Option<GuardConfig> },
    /// E-VQA requests, their images confined to the image root and checked to be regular
    /// files with a readable header. The uploads' temporary files live until the edit has run.
    EditImages { records: Vec<MmRecord>, guard: Option<GuardConfig>, _uploads: Vec<TempImage> },
    Score { text: String, image: Option<RequestImage> },
    Generate { prompt: String, max_new_tokens: usize, image: Option<RequestImage> },
    Reset,
    Save { dir: PathBuf },
}

/// The image of a `/score` or `/generate` request.
pub(super) enum RequestImage {
    /// A file under the image root, resolved and confined.
    File(PathBuf),
    /// A decoded `image_base64` upload, checked to be a PNG or JPEG, in a private
    /// temporary file (removed when the request is done).
    Upload(TempImage),
}

/// The files a request makes the server read or write, each with the name the client
/// gave it (`val/a.png`, ``record 0: field `m_loc_base64` ``). An error about one of these
/// files is the client's (400, or 422 for a save folder) and is reported under the
/// client's name; the server's own paths (image root, temporary directory, model) never
/// appear in a response.
#[derive(Debug, Default)]
pub(super) struct ClientPaths(Vec<(PathBuf, String)>);

impl ClientPaths {
    pub(super) fn add(&mut self, server: PathBuf, client: impl Into<String>) {
        self.0.push((server, client.into()));
    }

    /// The client's name of `path`: one of the request's files, or a file inside one of
    /// them (a save folder's `config.json`).
    pub(super) fn name_of(&self, path: &Path) -> Option<String> {
        self.0.iter().find_map(|(server, client)| {
            let rest = path.strip_prefix(server).ok()?;
            Some(if rest.as_os_str().is_empty() { client.clone() } else { format!("{client}/{}", rest.display()) })
        })
    }

    /// `msg` with each of the request's server paths replaced by the client's name.
    pub(super) fn redact(&self, msg: &str) -> String {
        let mut out = msg.to_string();
        let mut pairs: Vec<_> = self.0.iter().map(|(s, c)| (s.display().to_string(), c)).collect();
        // Longest first, so a file inside a folder is replaced before the folder.
        pairs.sort_by_key(|(s, _)| std::cmp::Reverse(s.len()));
        for (server, client) in pairs {
            if !server.is_empty() {
                out = out.replace(&server, client);
            }
        }
        out
    }
}

/// The body as a JSON object with only the `allowed` keys. Fields are then read one by
/// one, so that every 400 names the field at fault.
fn json_object(path: &str, body: &[u8], allowed: &[&str]) -> std::result::Result<Map<String, Value>, Failure> {
    let bad = |msg: String| Failure::bad(format!("{path}: {msg}"));
    let value: Value = serde_json::from_slice(body).map_err(|e| bad(format!("malformed JSON: {e}")))?;
    let Value::Object(obj) = value else {
        return Err(bad(format!("the body must be a JSON object with the fields {}", allowed.join(", "))));
    };
    if let Some(k) = obj.keys().find(|k| !allowed.contains(&k.as_str())) {
        return Err(bad(format!("unknown field `{k}` (expected: {})", allowed.join(", "))));
    }
    Ok(obj)
}

fn field<'a>(path: &str, obj: &'a Map<String, Value>, name: &str) -> std::result::Result<&'a Value, Failure> {
    obj.get(name).ok_or_else(|| Failure::bad(format!("{path}: missing field `{name}`")))
}

fn string_field(path: &str, obj: &Map<String, Value>, name: &str) -> std::result::Result<String, Failure> {
    field(path, obj, name)?.as_str().map(str::to_string).ok_or_else(|| Failure::bad(format!("{path}: field `{name}` must be a string")))
}

/// The guard of one `/edit`: the server's (`--no-guard` / `--guard-*`), changed by the
/// body's optional `guard` field: `false` commits this request unguarded, `true` or an
/// object of [`GuardOverrides`] (`min_agreement`, `max_drop`, `max_kl`, `refuse`,
/// `shrink`) guards it with those changes to the server's settings (to the defaults when
/// the server runs without a guard). Out-of-range values are 400 naming the key.
fn edit_guard(path: &str, obj: &Map<String, Value>, opts: &ServeOptions) -> std::result::Result<Option<GuardConfig>, Failure> {
    let bad = |msg: String| Failure::bad(format!("{path}: field `guard`: {msg}"));
    let base = opts.guard.clone().unwrap_or_default();
    match obj.get("guard") {
        None => Ok(opts.guard.clone()),
        Some(Value::Bool(false)) => Ok(None),
        Some(Value::Bool(true)) => Ok(Some(base)),
        Some(v @ Value::Object(_)) => {
            let o: GuardOverrides = serde_json::from_value(v.clone()).map_err(|e| bad(e.to_string()))?;
            o.apply(&base).map(Some).map_err(|e| bad(e.to_string()))
        }
        Some(_) => Err(bad("must be true, false or an object with min_agreement, max_drop, max_kl, refuse, shrink".into())),
    }
}

/// Parses and validates a model request's body (all 400s are decided here), with the
/// files it names under the client's names.
pub(super) fn parse_op(path: &str, body: &[u8], opts: &ServeOptions) -> std::result::Result<(Op, ClientPaths), Failure> {
    let bad = |msg: String| Failure::bad(format!("{path}: {msg}"));
    let mut paths = ClientPaths::default();
    let op = match path {
        "/edit" => {
            let obj = json_object(path, body, &["requests", "guard"])?;
            let guard = edit_guard(path, &obj, opts)?;
            let requests = field(path, &obj, "requests")?;
            if !requests.is_array() {
                return Err(bad("field `requests` must be an array of edit records".into()));
            }
            if is_image_request(requests) {
                let (records, uploads) = image_edit(path, requests, opts, &mut paths)?;
                return Ok((Op::EditImages { records, guard, _uploads: uploads }, paths));
            }
            let (records, report) =
                parse_records(&requests.to_string(), Path::new("requests"), DatasetKind::Requests).map_err(|e| bad(e.to_string()))?;
            if let Some((i, why)) = report.skipped.first() {
                return Err(bad(format!("record {i}: {why}")));
            }
            Op::Edit { records, guard }
        }
        "/score" => {
            let obj = json_object(path, body, &["text", "image", "image_base64"])?;
            let text = string_field(path, &obj, "text")?;
            Op::Score { text, image: request_image(path, &obj, opts, &mut paths)? }
        }
        "/generate" => {
            let obj = json_object(path, body, &["prompt", "max_new_tokens", "image", "image_base64"])?;
            let image = request_image(path, &obj, opts, &mut paths)?;
            let max_new_tokens = match obj.get("max_new_tokens") {
                None => DEFAULT_MAX_NEW_TOKENS,
                Some(v) => v
                    .as_u64()
                    .map(|n| n.min(usize::MAX as u64) as usize)
                    .ok_or_else(|| bad("field `max_new_tokens` must be a non-negative integer".into()))?,
            };
            Op::Generate { prompt: string_field(path, &obj, "prompt")?, max_new_tokens, image }
        }
        "/reset" => Op::Reset,
        "/save" => {
            let Some(root) = opts.save_root.as_deref() else {
                let msg = "/save is disabled: the server was started without `save_root`, the directory it may save models inside";
                return Err(Failure::Client { status: 403, kind: "forbidden", msg: msg.into() });
            };
            let dir = string_field(path, &json_object(path, body, &["dir"])?, "dir")?;
            if dir.trim().is_empty() {
                return Err(bad("field `dir` is empty".into()));
            }
            let resolved = confine(path, "field `dir`", &dir, root, "save root")?;
            // `.` (or a link to the root) would write the model's files among the root's
            // saved folders; `confine` resolved every link, so equality is the test.
            if root.canonicalize().is_ok_and(|r| r == resolved) {
                return Err(forbidden(format!("{path}: field `dir` {dir:?} names the save root itself; a save goes into a named folder under the root")));
            }
            paths.add(resolved.clone(), dir);
            Op::Save { dir: resolved }
        }
        other => return Err(Failure::Client { status: 404, kind: "not_found", msg: format!("no route {other}") }),
    };
    Ok((op, paths))
}

/// The optional image of a `/score` or `/generate` body: `image` (a path under the image
/// root) or `image_base64` (an upload), not both.
fn request_image(path: &str, obj: &Map<String, Value>, opts: &ServeOptions, paths: &mut ClientPaths) -> std::result::Result<Option<RequestImage>, Failure> {
    Ok(match (obj.contains_key("image"), obj.contains_key("image_base64")) {
        (true, true) => return Err(Failure::bad(format!("{path}: give `image` or `image_base64`, not both"))),
        (true, false) => {
            let name = string_field(path, obj, "image")?;
            let resolved = image_path(path, "field `image`", &name, opts)?;
            paths.add(resolved.clone(), name);
            Some(RequestImage::File(resolved))
        }
        (false, true) => {
            let what = "field `image_base64`";
            let bytes = decode_image(path, what, &string_field(path, obj, "image_base64")?)?;
            let tmp = TempImage::from_bytes(&bytes).map_err(|e| Failure::internal(format!("{path}: {what}: {e}")))?;
            paths.add(tmp.path().to_path_buf(), what);
            Some(RequestImage::Upload(tmp))
        }
        (false, false) => None,
    })
}

/// Whether an `/edit` body's requests are E-VQA records (one of them names an `image`,
/// by path or upload) rather than EasyEdit text records. A ZsRE-style text record (`src`
/// without an image) stays a text request, and its error names the text fields it lacks.
fn is_image_request(requests: &Value) -> bool {
    requests.as_array().is_some_and(|a| a.iter().any(|r| r.get("image").is_some() || r.get("image_base64").is_some()))
}

fn forbidden(msg: String) -> Failure {
    Failure::Client { status: 403, kind: "forbidden", msg }
}

/// The 403 for an image path without an image root.
fn no_image_root(path: &str) -> Failure {
    forbidden(format!("{path}: image paths are disabled: the server was started without `image_root`, the directory it may read images inside (or send `image_base64`)"))
}

/// `name` (a client's relative path, `what` names its field) resolved under `root` with
/// [`crate::io::resolve_under`]: a NUL byte is 400; an absolute path, `..` or a symbolic
/// link that leads out of the root (or cannot be resolved) is 403. The response names only
/// `name` and the rule; the root, the link's target and any I/O error stay in the log.
fn confine(path: &str, what: &str, name: &str, root: &Path, root_name: &str) -> std::result::Result<PathBuf, Failure> {
    use std::path::Component;
    if name.contains('\0') {
        return Err(Failure::bad(format!("{path}: {what}: the path contains a NUL byte")));
    }
    if name.is_empty() {
        return Err(Failure::bad(format!("{path}: {what}: the path is empty")));
    }
    let rule = format!("paths are relative to the {root_name} and stay inside it");
    for c in Path::new(name).components() {
        match c {
            Component::RootDir | Component::Prefix(_) => return Err(forbidden(format!("{path}: {what} {name:?}: absolute paths are refused; {rule}"))),
            Component::ParentDir => return Err(forbidden(format!("{path}: {what} {name:?}: \"..\" is refused; {rule}"))),
            _ => {}
        }
    }
    crate::io::resolve_under(root, Path::new(name)).map_err(|e| match e {
        Error::Input(detail) => {
            info!(request = path, "refused a path: {detail}");
            forbidden(format!("{path}: {what} {name:?}: a symbolic link on this path leads out of the {root_name} or cannot be resolved; {rule}"))
        }
        e => Failure::internal(format!("{path}: resolving {name:?} under the {root_name}: {e}")),
    })
}

/// An image named by a client (`what`: its field), resolved under the image root (403
/// without one, or out of it) and required to be a regular file there (400): a FIFO or a
/// device would block the reader that opens it, a directory is no image.
fn image_path(path: &str, what: &str, name: &str, opts: &ServeOptions) -> std::result::Result<PathBuf, Failure> {
    let Some(root) = opts.image_root.as_deref() else { return Err(no_image_root(path)) };
    let resolved = confine(path, what, name, root, "image root")?;
    // `resolve_under` resolved every link: this is the file itself.
    match std::fs::metadata(&resolved) {
        Ok(m) if m.is_file() => Ok(resolved),
        Ok(_) => Err(Failure::bad(format!("{path}: {what}: image {name:?} is not a file under the image root: only a regular file is read, not a directory, FIFO or device"))),
        Err(_) => Err(Failure::bad(format!("{path}: {what}: image {name:?} is not a file under the image root"))),
    }
}

/// An upload (`image_base64`, an E-VQA record's `*_base64`; `field` names it in errors,
/// e.g. ``record 1: field `m_loc_base64` ``):
/// standard base64 (whitespace ignored) of a PNG or JPEG file; anything else is 400. Its
/// size is bounded by the body limit.
fn decode_image(path: &str, field: &str, b64: &str) -> std::result::Result<Vec<u8>, Failure> {
    let bad = |msg: String| Failure::bad(format!("{path}: {field}: {msg}"));
    let compact: String = b64.chars().filter(|c| !c.is_ascii_whitespace()).collect();
    if compact.is_empty() {
        return Err(bad("empty".into()));
    }
    let bytes = base64::decode(&compact).map_err(|e| bad(format!("not valid base64: {e}")))?;
    image_kind(&bytes).map_err(|e| bad(e.to_string()))?;
    Ok(bytes)
}

/// An `/edit` of E-VQA records. Each image is a name under the image root (confined:
/// 403 without a root or out of it; 400 unless a regular file) or a `*_base64` upload (400
/// unless a PNG or JPEG; written to a private temporary file that lives until the edit
/// has run), one or the other; then every record is parsed and its images' headers read
/// (400). Every file is added to `paths` under the client's name.
fn image_edit(path: &str, requests: &Value, opts: &ServeOptions, paths: &mut ClientPaths) -> std::result::Result<(Vec<MmRecord>, Vec<TempImage>), Failure> {
    let bad = |msg: String| Failure::bad(format!("{path}: {msg}"));
    let mut requests = requests.clone();
    let mut uploads = Vec::new();
    if let Value::Array(items) = &mut requests {
        for (i, item) in items.iter_mut().enumerate() {
            let Value::Object(obj) = item else { continue };
            for (key, _) in IMAGE_KEYS {
                let b64_key = format!("{key}_base64");
                let resolved = match (obj.remove(key), obj.remove(&b64_key)) {
                    (Some(_), Some(_)) => return Err(bad(format!("record {i}: give `{key}` or `{b64_key}`, not both"))),
                    (None, Some(Value::String(b64))) => {
                        let what = format!("record {i}: field `{b64_key}`");
                        let bytes = decode_image(path, &what, &b64)?;
                        let tmp = TempImage::from_bytes(&bytes).map_err(|e| Failure::internal(format!("{path}: {what}: {e}")))?;
                        let p = tmp.path().to_path_buf();
                        paths.add(p.clone(), what);
                        uploads.push(tmp);
                        p
                    }
                    (None, Some(_)) => return Err(bad(format!("record {i}: field `{b64_key}` must be a string of base64"))),
                    (Some(Value::String(name)), None) => {
                        let what = format!("record {i}: field `{key}`");
                        let p = image_path(path, &what, &name, opts)?;
                        paths.add(p.clone(), format!("{what} {name:?}"));
                        p
                    }
                    // A missing or non-string key: left for the reader to name.
                    (Some(v), None) => {
                        obj.insert(key.to_string(), v);
                        continue;
                    }
                    (None, None) => continue,
                };
                let p = resolved.to_str().ok_or_else(|| bad(format!("record {i}: field `{key}`: the path is not UTF-8")))?.to_string();
                obj.insert(key.to_string(), Value::String(p));
            }
        }
    }
    // Every image path is absolute now, which the reader takes as it is (the root is only
    // joined to it); it must still be a directory.
    let roots = ImageRoots::new(opts.image_root.clone().unwrap_or_else(std::env::temp_dir), None);
    let records = read_image_requests(&requests.to_string(), &roots).map_err(|e| bad(paths.redact(&e.to_string())))?;
    Ok((records, uploads))
}
