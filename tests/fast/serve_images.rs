//! The HTTP service with images (Qwen2-VL fixture): scoring, editing and generating with
//! images named under the image root or uploaded as base64, what is refused (paths out of
//! the root, non-regular files, client faults answered 4xx without server paths), and one
//! answer for concurrent image scores, and the guard's decisions in `/edit`. Runs one at a time with `serve`'s tests (its lock).
use std::io::Write;
use std::net::TcpStream;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use dualedit::edit::session::Session;
use dualedit::serve::{ServeOptions, Server};
use serde_json::{json, Value};

use crate::common::fixture;
use crate::serve::{http, http_text, serial, Running};

/// A `w × h` PNG filled from `seed`.
fn png(path: &Path, w: u32, h: u32, seed: u8) {
    let img = image::RgbImage::from_fn(w, h, |x, y| image::Rgb([(x as u8).wrapping_mul(seed), (y as u8).wrapping_add(seed), seed.wrapping_mul(7)]));
    img.save(path).unwrap();
}

/// The Qwen2-VL fixture with an untrained editor (a plain gradient step of size edit_lr).
fn vl_session() -> Session {
    use dualedit::device::DevicePlan;
    let opts = dualedit::edit::LoadOptions { plan: DevicePlan::single(tch::Device::Cpu), ..Default::default() };
    let engine = dualedit::edit::open_engine(&fixture("qwen2_vl"), &opts, &[]).unwrap();
    let cfg = dualedit::config::MendConfig { rank: 8, edit_lr: 1e-2, ..Default::default() };
    let editor = dualedit::mend::Editor::new(&cfg, engine.edit_params.clone(), tch::Device::Cpu, 0).unwrap();
    Session::from_parts(engine, Some(editor))
}

/// An image root under `top` with the three pictures of [`vqa_request`]`("a.png")`.
fn vqa_images(top: &Path) -> std::path::PathBuf {
    let root = top.join("images");
    std::fs::create_dir_all(&root).unwrap();
    png(&root.join("a.png"), 40, 30, 3);
    png(&root.join("r.png"), 224, 28, 11);
    png(&root.join("loc.png"), 50, 50, 9);
    root
}

/// One E-VQA edit request whose question image is `image` (the others are r.png, loc.png).
fn vqa_request(image: &str) -> Value {
    json!({
        "src": "What is in the picture?", "alt": "a cat", "rephrase": "What does the picture show?",
        "image": image, "image_rephrase": "r.png",
        "loc": "nq question: who wrote hamlet", "loc_ans": "shakespeare",
        "m_loc": "loc.png", "m_loc_q": "What colour is the bus?", "m_loc_a": "red"
    })
}

/// Issue #22 / #25: `/score` takes an image by path under `--image-root` or as base64, and
/// `/edit` takes E-VQA requests; image paths follow `/save`'s rule (403 without a root, for
/// an absolute path, `..` or a link out of it), and a bad upload is 400.
#[test]
fn images_by_root_or_base64_score_and_edit_and_never_leave_the_root() {
    let _serial = serial();
    let top = tempfile::tempdir().unwrap();
    let (root, outside) = (top.path().join("images"), top.path().join("outside"));
    std::fs::create_dir_all(root.join("val")).unwrap();
    std::fs::create_dir_all(&outside).unwrap();
    png(&root.join("val/a.png"), 40, 30, 3);
    png(&root.join("r.png"), 224, 28, 11);
    png(&root.join("loc.png"), 50, 50, 9);
    png(&outside.join("secret.png"), 40, 30, 3);
    std::os::unix::fs::symlink(outside.join("secret.png"), root.join("link.png")).unwrap();
    let bytes = std::fs::read(root.join("val/a.png")).unwrap();
    let b64 = base64::encode(&bytes);
    let text = "What is in the picture? a cat";
    let score = |a, body: Value| http(a, "POST", "/score", Some(&body.to_string()));
    let edit = |a, reqs: Value| http(a, "POST", "/edit", Some(&json!({ "requests": reqs }).to_string()));

    // Without --image-root: paths are refused, uploads work.
    let server = Running::start(vl_session(), ServeOptions::default());
    let (st, v) = score(server.addr, json!({ "text": text, "image": "val/a.png" }));
    assert_eq!((st, v["kind"].as_str()), (403, Some("forbidden")), "{v}");
    assert!(v["error"].as_str().unwrap().contains("without `image_root`"), "{v}");
    let (st, v) = edit(server.addr, json!([vqa_request("val/a.png")]));
    assert_eq!((st, v["kind"].as_str()), (403, Some("forbidden")), "{v}");
    let (st, uploaded) = score(server.addr, json!({ "text": text, "image_base64": b64 }));
    assert_eq!(st, 200, "{uploaded}");
    assert!(uploaded["image_tokens"].as_u64().unwrap() > 0);
    let stats = server.stop();
    assert_eq!((stats.client_errors, stats.model_requests), (2, 1), "{stats:?}");

    assert!(Server::bind("127.0.0.1:0", ServeOptions { image_root: Some(top.path().join("none")), ..ServeOptions::default() }).is_err());
    let server = Running::start(vl_session(), ServeOptions { image_root: Some(root.clone()), ..ServeOptions::default() });
    let a = server.addr;
    let (st, by_path) = score(a, json!({ "text": text, "image": "val/a.png" }));
    assert_eq!(st, 200, "{by_path}");
    assert_eq!(by_path["logprobs"], uploaded["logprobs"], "the same image by path and by upload");
    let (_, plain) = score(a, json!({ "text": text }));
    assert_eq!(plain["image_tokens"], 0);

    let absolute = outside.join("secret.png").display().to_string();
    for (bad, needle) in [(absolute.as_str(), "absolute"), ("../outside/secret.png", "\"..\""), ("val/../../outside/secret.png", "\"..\""), ("link.png", "symbolic link")] {
        let (st, v) = score(a, json!({ "text": text, "image": bad }));
        assert_eq!((st, v["kind"].as_str()), (403, Some("forbidden")), "{bad}: {v}");
        assert!(v["error"].as_str().unwrap().contains(needle), "{bad}: {v}");
        let (st, v) = edit(a, json!([vqa_request(bad)]));
        assert_eq!((st, v["kind"].as_str()), (403, Some("forbidden")), "edit {bad}: {v}");
    }
    for (body, needle) in [
        (json!({ "text": text, "image": "val/missing.png" }), "not a file"),
        (json!({ "text": text, "image": "val" }), "not a file"),
        (json!({ "text": text, "image_base64": "!!not base64!!" }), "base64"),
        (json!({ "text": text, "image_base64": base64::encode(b"plain text, not an image") }), "PNG or JPEG"),
        (json!({ "text": text, "image_base64": base64::encode(&bytes[..40]) }), "cannot be read"),
        (json!({ "text": text, "image_base64": "" }), "empty"),
        (json!({ "text": text, "image_base64": 7 }), "must be a string"),
        (json!({ "text": text, "image": "val/a.png", "image_base64": b64 }), "not both"),
    ] {
        let (st, v) = score(a, body.clone());
        assert_eq!((st, v["kind"].as_str()), (400, Some("bad_request")), "{body}: {v}");
        assert!(v["error"].as_str().unwrap().contains(needle), "{needle}: {v}");
    }
    let (st, v) = edit(a, json!([vqa_request("val/missing.png")]));
    assert_eq!(st, 400, "{v}");
    assert!(v["error"].as_str().unwrap().contains("missing.png"), "{v}");
    let (_, h) = http(a, "GET", "/health", None);
    assert_eq!(h["edits_total"], 0, "no refused request edited");

    // An image edit: committed, counted, and it moves the image score; reset undoes it.
    let (st, out) = edit(a, json!([vqa_request("val/a.png")]));
    assert_eq!(st, 200, "{out}");
    assert_eq!(out["edits_total"], 1);
    assert_eq!(out["requests"][0]["prompt"], "What is in the picture?");
    let (_, after) = score(a, json!({ "text": text, "image": "val/a.png" }));
    assert_ne!(after["logprobs"], by_path["logprobs"]);
    let (st, _) = http(a, "POST", "/reset", None);
    assert_eq!(st, 200);
    let (_, reset) = score(a, json!({ "text": text, "image_base64": b64 }));
    assert_eq!(reset["logprobs"], by_path["logprobs"], "reset restores the image score exactly");
    server.stop();
}

/// Issue #22: an E-VQA `/edit` takes each of its three images as an upload
/// (`image_base64`, `image_rephrase_base64`, `m_loc_base64`) as well as a path under
/// `--image-root`, with the same result; uploads alone need no root, a path still does.
/// `/generate` shows an image by path or upload, and greedy decoding is the same either way.
#[test]
fn image_edits_and_generation_take_uploads_as_well_as_paths() {
    let _serial = serial();
    let top = tempfile::tempdir().unwrap();
    let root = top.path().join("images");
    std::fs::create_dir_all(root.join("val")).unwrap();
    png(&root.join("val/a.png"), 40, 30, 3);
    png(&root.join("r.png"), 224, 28, 11);
    png(&root.join("loc.png"), 50, 50, 9);
    let b64 = |p: &str| base64::encode(std::fs::read(root.join(p)).unwrap());
    let uploaded = || {
        let mut r = vqa_request("unused");
        let o = r.as_object_mut().unwrap();
        for (key, file) in [("image", "val/a.png"), ("image_rephrase", "r.png"), ("m_loc", "loc.png")] {
            o.remove(key);
            o.insert(format!("{key}_base64"), json!(b64(file)));
        }
        r
    };
    let text = "What is in the picture? a cat";
    let score = |a, body: Value| http(a, "POST", "/score", Some(&body.to_string()));
    let edit = |a, reqs: Value| http(a, "POST", "/edit", Some(&json!({ "requests": reqs }).to_string()));
    let generate = |a, body: Value| http(a, "POST", "/generate", Some(&body.to_string()));
    let temp_images = || {
        let prefix = format!("dualedit-image-{}-", std::process::id());
        std::fs::read_dir(std::env::temp_dir()).unwrap().filter(|e| e.as_ref().unwrap().file_name().to_string_lossy().starts_with(&prefix)).count()
    };

    // By path under the root: the reference edit and generation.
    let server = Running::start(vl_session(), ServeOptions { image_root: Some(root.clone()), ..ServeOptions::default() });
    let a = server.addr;
    let (st, g_path) = generate(a, json!({ "prompt": "What is in the picture?", "max_new_tokens": 4, "image": "val/a.png" }));
    assert_eq!(st, 200, "{g_path}");
    assert_eq!(g_path["tokens"].as_array().unwrap().len(), 4);
    let (_, g_b64) = generate(a, json!({ "prompt": "What is in the picture?", "max_new_tokens": 4, "image_base64": b64("val/a.png") }));
    assert_eq!(g_b64["tokens"], g_path["tokens"], "the same image by path and by upload");
    // Greedy: two tokens are the first two of four.
    let (_, g2) = generate(a, json!({ "prompt": "What is in the picture?", "max_new_tokens": 2, "image": "val/a.png" }));
    assert_eq!(g2["tokens"].as_array().unwrap()[..], g_path["tokens"].as_array().unwrap()[..2]);
    let (_, g_text) = generate(a, json!({ "prompt": "What is in the picture?", "max_new_tokens": 4 }));
    assert_eq!(g_text["prompt_tokens"], g_path["prompt_tokens"], "prompt_tokens counts the text");
    // A mix of a path and uploads is fine with a root.
    let (_, before) = score(a, json!({ "text": text, "image": "val/a.png" }));
    let (st, by_path) = edit(a, json!([vqa_request("val/a.png")]));
    assert_eq!(st, 200, "{by_path}");
    let (_, after_path) = score(a, json!({ "text": text, "image": "val/a.png" }));
    assert_ne!(after_path["logprobs"], before["logprobs"]);
    http(a, "POST", "/reset", None);
    let mut mixed = uploaded();
    mixed.as_object_mut().unwrap().remove("image_base64");
    mixed["image"] = json!("val/a.png");
    let (st, v) = edit(a, json!([mixed.clone()]));
    assert_eq!(st, 200, "{v}");
    let (_, after_mixed) = score(a, json!({ "text": text, "image": "val/a.png" }));
    assert_eq!(after_mixed["logprobs"], after_path["logprobs"], "the same edit with uploads");
    server.stop();

    // Uploads only: no root needed, and the same edit as by path.
    let server = Running::start(vl_session(), ServeOptions::default());
    let a = server.addr;
    let (st, out) = edit(a, json!([uploaded()]));
    assert_eq!(st, 200, "{out}");
    assert_eq!((out["edits_total"].as_u64(), &out["requests"][0]["prompt"]), (Some(1), &json!("What is in the picture?")));
    let (_, after) = score(a, json!({ "text": text, "image_base64": b64("val/a.png") }));
    assert_eq!(after["logprobs"], after_path["logprobs"], "uploads edit as paths do");
    assert_eq!(temp_images(), 0, "uploads' temporary files are removed after the request");
    // Only src, alt and an image, as EasyEdit allows: edited, the absent views' metrics absent.
    http(a, "POST", "/reset", None);
    let (st, bare) = edit(a, json!([{ "src": "What is in the picture?", "alt": "a cat", "image_base64": b64("val/a.png") }]));
    assert_eq!(st, 200, "{bare}");
    let r0 = &bare["requests"][0];
    assert!(r0["reliability"].is_number() && r0["locality"].is_null() && r0.get("image_locality").is_none(), "{bare}");
    let (_, after_bare) = score(a, json!({ "text": text, "image_base64": b64("val/a.png") }));
    assert_eq!(after_bare["logprobs"], after_path["logprobs"], "the same edit without the other views");
    // Paths still need the root, for /edit and /generate alike.
    let (st, v) = edit(a, json!([mixed]));
    assert_eq!((st, v["kind"].as_str()), (403, Some("forbidden")), "{v}");
    let (st, v) = generate(a, json!({ "prompt": "What", "image": "val/a.png" }));
    assert_eq!((st, v["kind"].as_str()), (403, Some("forbidden")), "{v}");
    // Bad uploads are 400 naming the record and the field.
    let mut both = uploaded();
    both["image"] = json!("val/a.png");
    let mut bad_b64 = uploaded();
    bad_b64["m_loc_base64"] = json!("!!not base64!!");
    let mut not_image = uploaded();
    not_image["image_rephrase_base64"] = json!(base64::encode(b"plain text"));
    let mut not_string = uploaded();
    not_string["m_loc_base64"] = json!(7);
    for (reqs, needles) in [
        (json!([both]), vec!["record 0", "not both"]),
        (json!([uploaded(), bad_b64]), vec!["record 1", "m_loc_base64", "base64"]),
        (json!([not_image]), vec!["image_rephrase_base64", "PNG or JPEG"]),
        (json!([not_string]), vec!["m_loc_base64", "must be a string"]),
    ] {
        let (st, v) = edit(a, reqs.clone());
        assert_eq!((st, v["kind"].as_str()), (400, Some("bad_request")), "{reqs}: {v}");
        for n in needles {
            assert!(v["error"].as_str().unwrap().contains(n), "{n}: {v}");
        }
    }
    let (st, v) = generate(a, json!({ "prompt": "What", "image_base64": "!!" }));
    assert_eq!((st, v["kind"].as_str()), (400, Some("bad_request")), "{v}");
    let (_, h) = http(a, "GET", "/health", None);
    assert_eq!(h["edits_total"], 1, "no refused request edited");
    server.stop();
    assert_eq!(temp_images(), 0);
}

/// Issue #33.2: a FIFO (or any non-regular file) named as an image is refused (400) at
/// once instead of blocking the worker that opens it; and `/health` answers while every
/// worker is stuck on a client that never sends its body, the next model request being
/// answered 503 `queue_full` at once rather than waiting.
#[test]
fn non_regular_images_are_refused_and_health_answers_while_workers_are_stuck() {
    let _serial = serial();
    let top = tempfile::tempdir().unwrap();
    let root = top.path().join("images");
    std::fs::create_dir_all(&root).unwrap();
    png(&root.join("r.png"), 224, 28, 11);
    png(&root.join("loc.png"), 50, 50, 9);
    let fifo = root.join("fifo.png");
    let made = Command::new("mkfifo").arg(&fifo).status().unwrap();
    assert!(made.success());
    std::os::unix::fs::symlink(&fifo, root.join("to-fifo.png")).unwrap();
    let server = Running::start(vl_session(), ServeOptions { image_root: Some(root.clone()), workers: 2, queue: 2, ..ServeOptions::default() });
    let a = server.addr;
    let start = Instant::now();
    for name in ["fifo.png", "to-fifo.png"] {
        for _ in 0..6 {
            let (st, v) = http(a, "POST", "/edit", Some(&json!({ "requests": [vqa_request(name)] }).to_string()));
            assert_eq!((st, v["kind"].as_str()), (400, Some("bad_request")), "{name}: {v}");
            assert!(v["error"].as_str().unwrap().contains("only a regular file"), "{v}");
        }
        let (st, v) = http(a, "POST", "/score", Some(&json!({ "text": "a", "image": name }).to_string()));
        assert_eq!(st, 400, "{v}");
    }
    assert!(start.elapsed() < Duration::from_secs(20), "refusals took {:?}", start.elapsed());

    // Clients that send headers and never their body (larger than tiny_http reads ahead,
    // 1 KiB): each holds a worker (2), and two
    // more wait for one (queue 2); then model routes are answered 503, /health 200, at once.
    let stuck: Vec<TcpStream> = (0..4)
        .map(|_| {
            let mut s = TcpStream::connect(a).unwrap();
            write!(s, "POST /score HTTP/1.1\r\nHost: {a}\r\nContent-Type: application/json\r\nContent-Length: 200000\r\n\r\n{{").unwrap();
            // One at a time: tiny_http 0.12's connection pool can hand two connections
            // that arrive within microseconds to one thread, the second waiting for the
            // first to end (a limitation of the HTTP layer, not of the workers).
            std::thread::sleep(Duration::from_millis(150));
            s
        })
        .collect();
    std::thread::sleep(Duration::from_millis(500));
    let t = Instant::now();
    let (st, h) = http(a, "GET", "/health", None);
    assert_eq!((st, h["status"].as_str()), (200, Some("ok")), "{h}");
    let (st, v) = http(a, "POST", "/score", Some(r#"{"text": "a b"}"#));
    assert_eq!((st, v["kind"].as_str()), (503, Some("queue_full")), "{v}");
    assert!(t.elapsed() < Duration::from_secs(5), "answers took {:?} with stuck workers", t.elapsed());
    drop(stuck);
    // The workers come back once those clients go.
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let (st, v) = http(a, "POST", "/score", Some(r#"{"text": "What is in the picture?"}"#));
        if st == 200 {
            break;
        }
        assert!(st == 503 && Instant::now() < deadline, "{st}: {v}");
        std::thread::sleep(Duration::from_millis(200));
    }
    server.stop();
}

/// Issue #33.6: responses name only what the client sent. A 403 for a link out of the
/// root names neither the root nor the link's target; client-caused image failures (a
/// truncated upload, a NUL in a path, an aspect ratio over 200:1, text too long with an
/// image) are 400, not 500, and no body carries a server path.
#[test]
fn errors_name_only_the_clients_paths_and_client_faults_are_4xx() {
    let _serial = serial();
    let top = tempfile::tempdir().unwrap();
    let (root, outside) = (top.path().join("images"), top.path().join("outside"));
    std::fs::create_dir_all(&root).unwrap();
    std::fs::create_dir_all(&outside).unwrap();
    png(&root.join("a.png"), 40, 30, 3);
    png(&root.join("r.png"), 224, 28, 11);
    png(&root.join("loc.png"), 50, 50, 9);
    png(&root.join("wide.png"), 1000, 4, 5);
    png(&outside.join("secret.png"), 40, 30, 3);
    std::os::unix::fs::symlink(outside.join("secret.png"), root.join("link.png")).unwrap();
    std::os::unix::fs::symlink(outside.join("gone.png"), root.join("dangling.png")).unwrap();
    // A PNG whose header reads but whose pixel data stops short.
    let full = std::fs::read(root.join("a.png")).unwrap();
    std::fs::write(root.join("truncated.png"), &full[..full.len() - 30]).unwrap();
    let truncated_b64 = base64::encode(&full[..full.len() - 30]);
    let wide_b64 = base64::encode(std::fs::read(root.join("wide.png")).unwrap());
    let server = Running::start(vl_session(), ServeOptions { image_root: Some(root.clone()), ..ServeOptions::default() });
    let a = server.addr;
    let long = "word ".repeat(400);
    let server_paths = [top.path().display().to_string(), std::env::temp_dir().display().to_string(), fixture("qwen2_vl").display().to_string()];
    let check = |path: &str, body: Value, status: u16, needle: &str| {
        let (st, v) = http(a, "POST", path, Some(&body.to_string()));
        let err = v["error"].as_str().unwrap_or_default().to_string();
        assert_eq!(st, status, "{path} {body}: {v}");
        assert!(err.contains(needle), "{path}: {err:?} lacks {needle:?}");
        for p in &server_paths {
            assert!(!err.contains(p.as_str()), "{path}: {err:?} names the server path {p}");
        }
    };
    let edit = |r: Value| json!({ "requests": [r] });
    check("/score", json!({ "text": "a", "image": "link.png" }), 403, "link.png");
    check("/edit", edit(vqa_request("link.png")), 403, "symbolic link");
    check("/score", json!({ "text": "a", "image": "dangling.png" }), 403, "cannot be resolved");
    check("/score", json!({ "text": "a", "image": "a\u{0}.png" }), 400, "NUL");
    check("/edit", edit(vqa_request("a.png\u{0}")), 400, "NUL");
    check("/score", json!({ "text": "a", "image": "truncated.png" }), 400, "truncated.png");
    check("/score", json!({ "text": "a", "image_base64": truncated_b64 }), 400, "image_base64");
    check("/generate", json!({ "prompt": "a", "image_base64": truncated_b64 }), 400, "image_base64");
    check("/edit", edit(vqa_request("truncated.png")), 400, "truncated.png");
    check("/score", json!({ "text": "a", "image": "wide.png" }), 400, "200:1");
    check("/score", json!({ "text": "a", "image_base64": wide_b64 }), 400, "200:1");
    // An edit takes the image through the same preprocessing as a request the model refuses: 422.
    check("/edit", edit(vqa_request("wide.png")), 422, "200:1");
    check("/score", json!({ "text": long, "image": "a.png" }), 400, "context");
    check("/score", json!({ "text": "a", "image": "missing.png" }), 400, "missing.png");
    let (_, h) = http(a, "GET", "/health", None);
    assert_eq!(h["edits_total"], 0);
    let stats = server.stop();
    assert_eq!(stats.server_errors, 0, "{stats:?}");
}

/// Issue #48: the same request gives the same bits on every worker and at every point of a
/// server's life. 24 identical `/score` requests with an image, sent at once, are one answer;
/// after an edit they are one (other) answer; after a reset the first one again. Before
/// `device::settle_threads`, the model thread's first products ran with MKL's own thread
/// count and differed from later ones by ~3e-6 on a 2-core machine (CI runs the fast tests
/// with `OMP_NUM_THREADS=2` too, so this cannot come back unseen).
#[test]
fn concurrent_image_scores_are_one_answer_before_and_after_an_edit_and_a_reset() {
    let _serial = serial();
    let top = tempfile::tempdir().unwrap();
    let root = vqa_images(top.path());
    let server = Running::start(vl_session(), ServeOptions { image_root: Some(root), ..ServeOptions::default() });
    let a = server.addr;
    let body = json!({ "text": "What is in the picture? a cat", "image": "a.png" }).to_string();
    let burst = || -> String {
        let answers: Vec<(u16, String)> =
            std::thread::scope(|s| (0..24).map(|_| s.spawn(|| http_text(a, "POST", "/score", Some(&body)))).collect::<Vec<_>>().into_iter().map(|h| h.join().unwrap()).collect());
        assert!(answers.iter().all(|(st, _)| *st == 200), "{:?}", answers.iter().map(|a| a.0).collect::<Vec<_>>());
        assert!(answers.iter().all(|(_, t)| *t == answers[0].1), "24 identical requests, more than one answer");
        answers[0].1.clone()
    };
    let before = burst();
    let (st, v) = http(a, "POST", "/edit", Some(&json!({ "requests": [vqa_request("a.png")], "guard": false }).to_string()));
    assert_eq!(st, 200, "{v}");
    let edited = burst();
    assert_ne!(edited, before, "the edit changes the image's score");
    let (st, v) = http(a, "POST", "/reset", Some("{}"));
    assert_eq!(st, 200, "{v}");
    assert_eq!(burst(), before, "a reset gives back exactly the first answer");
    server.stop();
}

/// Issue #34: `serve` guards commits as `edit` does (on by default), each `/edit` response
/// lists the guard's decisions and the settings it ran under, a request may change the
/// settings for itself (`guard`: false, true or an object), and out-of-range settings are
/// 400 naming the key. A refused edit leaves the unrelated image's score exactly as it was.
#[test]
fn serve_guards_edits_and_reports_its_decisions() {
    let _serial = serial();
    let top = tempfile::tempdir().unwrap();
    let root = vqa_images(top.path());
    let server = Running::start(vl_session(), ServeOptions { image_root: Some(root.clone()), ..ServeOptions::default() });
    let a = server.addr;
    let edit = |extra: Option<Value>| {
        let mut body = json!({ "requests": [vqa_request("a.png")] });
        if let Some(g) = extra {
            body["guard"] = g;
        }
        http(a, "POST", "/edit", Some(&body.to_string()))
    };
    let loc = json!({ "text": "What colour is the bus? red", "image": "loc.png" }).to_string();
    let (_, loc_before) = http_text(a, "POST", "/score", Some(&loc));

    for (g, needle) in [
        (json!({ "min_agreement": 1.5 }), "min_agreement"),
        (json!({ "max_drop": -0.1 }), "max_drop"),
        (json!({ "max_kl": -1 }), "max_kl"),
        (json!({ "bogus": 1 }), "bogus"),
        (json!("yes"), "must be true, false or an object"),
    ] {
        let (st, v) = edit(Some(g.clone()));
        assert_eq!((st, v["kind"].as_str()), (400, Some("bad_request")), "{g}: {v}");
        assert!(v["error"].as_str().unwrap().contains(needle), "{needle}: {v}");
    }
    // So strict that any change to the probes fails, and refusing: nothing is committed.
    let (st, v) = edit(Some(json!({ "min_agreement": 1.0, "max_drop": 0.0, "max_kl": 0.0, "refuse": true })));
    assert_eq!(st, 200, "{v}");
    assert_eq!(v["guard"][0]["decision"], "refused", "{v}");
    assert_eq!(v["guard_settings"]["max_kl"], 0.0, "{v}");
    assert_eq!(v["guard_settings"]["scale_back"], false, "{v}");
    assert_eq!(http_text(a, "POST", "/score", Some(&loc)).1, loc_before, "a refused edit leaves the unrelated image's score exactly");
    // The server's default guard: a decision is reported with its numbers.
    let (st, v) = edit(None);
    assert_eq!(st, 200, "{v}");
    assert_eq!(v["guard"].as_array().map(Vec::len), Some(1), "{v}");
    assert!(v["guard"][0]["before"]["agreement"].is_number(), "{v}");
    assert_eq!(v["guard_settings"]["min_agreement"], 0.9, "{v}");
    http(a, "POST", "/reset", None);
    // Unguarded on request: no decisions, and the edit is committed as made.
    let (st, v) = edit(Some(json!(false)));
    assert_eq!(st, 200, "{v}");
    assert_eq!((v["guard"].as_array().map(Vec::len), &v["guard_settings"]), (Some(0), &Value::Null), "{v}");
    assert_ne!(http_text(a, "POST", "/score", Some(&loc)).1, loc_before, "the unguarded edit moved the unrelated image's score");
    server.stop();

    // Without a guard on the server, `guard: true` still guards that request.
    let server = Running::start(vl_session(), ServeOptions { image_root: Some(root.clone()), guard: None, ..ServeOptions::default() });
    let a = server.addr;
    let (st, v) = http(a, "POST", "/edit", Some(&json!({ "requests": [vqa_request("a.png")] }).to_string()));
    assert_eq!((st, v["guard"].as_array().map(Vec::len)), (200, Some(0)), "{v}");
    let (st, v) = http(a, "POST", "/edit", Some(&json!({ "requests": [vqa_request("a.png")], "guard": true }).to_string()));
    assert_eq!((st, v["guard"].as_array().map(Vec::len)), (200, Some(1)), "{v}");
    server.stop();
    let bad = dualedit::mend::guard::GuardConfig { max_drop: f64::NAN, ..Default::default() };
    let err = Server::bind("127.0.0.1:0", ServeOptions { guard: Some(bad), ..ServeOptions::default() }).err().expect("refused").to_string();
    assert!(err.contains("`max_drop`") && err.contains("[0, 1]"), "{err}");
}
