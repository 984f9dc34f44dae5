//! Qwen2-VL and Qwen2.5-VL against transformers (references from scripts/make_vl_fixtures.py):
//! image preprocessing against `Qwen2VLImageProcessor` (PIL backend), image-token counts,
//! and log-probabilities through the vision tower and the M-RoPE text decoder, for both
//! config.json layouts and both tensor-name layouts.
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use dualedit::model::qwen2_vl::{image, ImageProcessorConfig};
use dualedit::model::{load_model, ParamView};
use serde_json::Value;
use tch::{Device, Kind, Tensor};

mod common;
use common::{assert_clean_error, broken_copy, fixture};

fn json(path: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

fn reference_pixels() -> HashMap<String, Tensor> {
    Tensor::read_safetensors(fixture("vl_images").join("pixels.safetensors")).unwrap().into_iter().collect()
}

/// The processor's settings the fixtures were made with (the same in both model dirs,
/// written in the two file layouts).
fn processor(model: &str) -> ImageProcessorConfig {
    ImageProcessorConfig::load(&fixture(model).join("preprocessor_config.json")).unwrap()
}

/// Max abs difference of normalised pixel values, and of the 8-bit levels behind them
/// (one level is 1/255/std ≈ 0.0146 to 0.0152 after normalisation).
fn pixel_diff(ours: &Tensor, theirs: &Tensor) -> (f64, f64) {
    let d = (ours - theirs).abs().max().double_value(&[]);
    (d, d * 0.26130258 * 255.0)
}

#[test]
fn pixels_and_token_counts_match_the_processor() {
    let r = json(&fixture("vl_images").join("reference.json"));
    let pixels = reference_pixels();
    for model in ["qwen2_vl", "qwen2_5_vl"] {
        let proc = processor(model);
        assert_eq!((proc.min_pixels, proc.max_pixels), (3136, 12544), "{model}: both preprocessor layouts read");
        for (name, meta) in r["images"].as_object().unwrap() {
            let img = image::prepare(&fixture("vl_images").join(name), &proc).unwrap();
            let grid: Vec<i64> = meta["grid_thw"].as_array().unwrap().iter().map(|v| v.as_i64().unwrap()).collect();
            assert_eq!(img.grid.to_vec(), grid, "{name}: image_grid_thw");
            assert_eq!(img.n_tokens(2), meta["image_tokens"].as_i64().unwrap(), "{name}: image tokens");
            let theirs = &pixels[name];
            assert_eq!(img.pixel_values.size(), theirs.size(), "{name}: pixel_values shape");
            let (d, levels) = pixel_diff(&img.pixel_values, theirs);
            if name.ends_with(".png") {
                // PNG decoding, compositing, Pillow's bicubic and the f32 normalisation are
                // reproduced exactly.
                assert_eq!(d, 0.0, "{name}: max abs pixel diff {d}");
            } else {
                // JPEG: the image crate's decoder vs libjpeg-turbo (IDCT / chroma upsampling
                // rounding) differ by a few 8-bit levels in places.
                assert!(levels <= 4.0, "{name}: max abs pixel diff {d} ({levels:.2} levels)");
            }
            eprintln!("{model} {name}: grid {grid:?}, max abs pixel diff {d:e} ({levels:.2} 8-bit levels)");
        }
    }
}

/// Every reference case: token ids exactly, log-probabilities of the text tokens ≤ 1e-4.
/// Cases whose images are JPEG use the processor's own pixel values (decoders differ);
/// PNG cases go from the file through dualedit's preprocessing.
fn check_model(name: &str) {
    let dir = fixture(name);
    let r = json(&dir.join("reference.json"));
    let lm = load_model(&dir, Device::Cpu, Kind::Float).unwrap();
    let vl = lm.model.family().vision_language().expect("loads as a vision-language model");
    let params = ParamView::frozen(&lm.params);
    let proc = processor(name);
    let pixels = reference_pixels();
    let (mut worst, mut jpeg_worst) = (0f64, 0f64);
    for case in r["cases"].as_array().unwrap() {
        let images: Vec<String> = case["images"].as_array().unwrap().iter().map(|v| v.as_str().unwrap().to_string()).collect();
        let text = case["text"].as_str().unwrap();
        let want_ids: Vec<i64> = case["input_ids"].as_array().unwrap().iter().map(|v| v.as_i64().unwrap()).collect();
        let want_lp: Vec<f64> = case["logprobs"].as_array().unwrap().iter().map(|v| v.as_f64().unwrap() as f32 as f64).collect();
        let paths: Vec<PathBuf> = images.iter().map(|i| fixture("vl_images").join(i)).collect();
        let all_png = images.iter().all(|i| i.ends_with(".png"));
        let got = if all_png {
            let refs: Vec<&Path> = paths.iter().map(|p| p.as_path()).collect();
            dualedit::edit::score::score_with_images(&lm, &params, text, &refs).unwrap()
        } else {
            // Same computation from the processor's pixel values.
            let prepared: Vec<_> = paths.iter().map(|p| image::prepare(p, &proc).unwrap()).collect();
            let grids: Vec<_> = prepared.iter().map(|p| p.grid).collect();
            let px = Tensor::cat(&images.iter().map(|i| &pixels[i]).collect::<Vec<_>>(), 0);
            let feats = vl.image_features(&params, &px, &grids).unwrap();
            let mut ids: Vec<i64> = grids.iter().flat_map(|g| vl.image_prompt(g)).collect();
            ids.extend(lm.tokenizer.encode(text).unwrap());
            let pos = vl.mrope_positions(&ids, &grids).unwrap().unsqueeze(1);
            let t = Tensor::from_slice(&ids).unsqueeze(0);
            let none = Default::default();
            let input = dualedit::model::ForwardInput {
                position_ids: Some(&pos),
                image_embeds: Some(&feats),
                ..dualedit::model::ForwardInput::new(&t, &none)
            };
            let _g = tch::no_grad_guard();
            let logits = lm.model.forward(&params, &input).unwrap().logits.get(0).log_softmax(-1, Kind::Float);
            let n = ids.len() as i64;
            let lp = logits.narrow(0, 0, n - 1).gather(1, &t.get(0).narrow(0, 1, n - 1).unsqueeze(1), false).squeeze_dim(1);
            let lp: Vec<f64> = Vec::try_from(lp.to_kind(Kind::Double)).unwrap();
            let text_n = ids.len() - grids.iter().map(|g| vl.image_prompt(g).len()).sum::<usize>();
            assert_eq!(ids, want_ids, "{name} {images:?}: token ids");
            dualedit::edit::score::Score {
                tokens: ids[ids.len() - text_n..].to_vec(),
                logprobs: lp[lp.len() - text_n..].to_vec(),
                mean_nll: 0.0,
                image_tokens: ids.len() - text_n,
            }
        };
        // The text's ids are the tail of the reference sequence; the image prefix is its head.
        assert_eq!(got.image_tokens + got.tokens.len(), want_ids.len(), "{name} {images:?}: sequence length");
        assert_eq!(got.tokens[..], want_ids[got.image_tokens..], "{name} {images:?}: text token ids");
        let expected = &want_lp[want_lp.len() - got.logprobs.len()..];
        for (a, b) in got.logprobs.iter().zip(expected) {
            worst = worst.max((a - b).abs());
        }
        let d = got.logprobs.iter().zip(expected).map(|(a, b)| (a - b).abs()).fold(0.0, f64::max);
        assert!(d <= 1e-4, "{name} {images:?}: max abs log-prob diff {d}");
        if !all_png {
            // The whole pipeline from the JPEG file: the decoder's few-level pixel
            // differences move these random-weight log-probs by more than 1e-4, not by much.
            let refs: Vec<&Path> = paths.iter().map(|p| p.as_path()).collect();
            let s = dualedit::edit::score::score_with_images(&lm, &params, text, &refs).unwrap();
            let d = s.logprobs.iter().zip(expected).map(|(a, b)| (a - b).abs()).fold(0.0, f64::max);
            jpeg_worst = jpeg_worst.max(d);
            assert!(d <= 0.2, "{name} {images:?}: from the JPEG file, max abs log-prob diff {d}");
        }
    }
    eprintln!("{name}: max abs log-prob diff over all cases {worst:e} (JPEG cases from the file: {jpeg_worst:e})");
}

#[test]
fn qwen2_vl_nested_config_new_names_untied_matches_transformers() {
    check_model("qwen2_vl");
}

#[test]
fn qwen2_5_vl_flat_config_released_names_tied_window_attention_matches_transformers() {
    check_model("qwen2_5_vl");
}

/// bf16 weights score close to f32 (through the vision tower too).
#[test]
fn bf16_scores_close_to_f32() {
    let dir = fixture("qwen2_vl");
    let img = fixture("vl_images").join("rgb.png");
    let s = |kind| {
        let lm = load_model(&dir, Device::Cpu, kind).unwrap();
        dualedit::edit::score::score_with_images(&lm, &ParamView::frozen(&lm.params), "The capital of France is Paris.", &[&img]).unwrap()
    };
    let (a, b) = (s(Kind::Float), s(Kind::BFloat16));
    let rel = (a.mean_nll - b.mean_nll).abs() / a.mean_nll;
    assert!(rel < 0.05, "bf16 mean NLL {} vs f32 {} (rel {rel})", b.mean_nll, a.mean_nll);
}

// ---- the CLI ----

fn dualedit(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_dualedit")).args(args).output().unwrap()
}

#[test]
fn score_image_json() {
    let dir = fixture("qwen2_5_vl");
    let r = json(&dir.join("reference.json"));
    let case = &r["cases"][0];
    let img = fixture("vl_images").join(case["images"][0].as_str().unwrap());
    let out = dualedit(&["score", "--model", dir.to_str().unwrap(), "--image", img.to_str().unwrap(), "--text", case["text"].as_str().unwrap(), "--json"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: Value = serde_json::from_slice(&out.stdout).expect("stdout is one JSON object");
    assert_eq!(v["image_tokens"].as_u64().unwrap(), 8, "6 image pads + start + end");
    let lps = v["logprobs"].as_array().unwrap();
    assert_eq!(lps.len(), v["tokens"].as_array().unwrap().len(), "every text token is scored after the image");
    let want = case["logprobs"].as_array().unwrap();
    for (a, b) in lps.iter().zip(&want[want.len() - lps.len()..]) {
        assert!((a.as_f64().unwrap() - b.as_f64().unwrap()).abs() < 1e-4);
    }
    // Text alone through a VL model.
    let out = dualedit(&["score", "--model", dir.to_str().unwrap(), "--text", "The Eiffel Tower is located in the city of", "--json"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["image_tokens"].as_u64().unwrap(), 0);
    let text_case = r["cases"].as_array().unwrap().iter().find(|c| c["images"].as_array().unwrap().is_empty()).unwrap();
    for (a, b) in v["logprobs"].as_array().unwrap().iter().zip(text_case["logprobs"].as_array().unwrap()) {
        assert!((a.as_f64().unwrap() - b.as_f64().unwrap()).abs() < 1e-4);
    }
}

#[test]
fn bad_images_and_configs_give_one_clear_error() {
    let model = fixture("qwen2_vl");
    let score = |dir: &Path, img: &Path| {
        dualedit(&["score", "--model", dir.to_str().unwrap(), "--image", img.to_str().unwrap(), "--text", "The capital of France is"])
    };
    let tmp = tempfile::tempdir().unwrap();
    // Missing, empty, truncated, not an image.
    let missing = tmp.path().join("missing.png");
    assert_clean_error(&score(&model, &missing), &["missing.png", "not found"]);
    let empty = tmp.path().join("empty.png");
    std::fs::write(&empty, b"").unwrap();
    assert_clean_error(&score(&model, &empty), &["empty.png", "empty"]);
    for (name, src) in [("cut.png", "rgb.png"), ("cut.jpg", "photo.jpg")] {
        let bytes = std::fs::read(fixture("vl_images").join(src)).unwrap();
        let cut = tmp.path().join(name);
        std::fs::write(&cut, &bytes[..bytes.len() / 2]).unwrap();
        assert_clean_error(&score(&model, &cut), &[name, "truncated or corrupt"]);
    }
    let text = tmp.path().join("notes.png");
    std::fs::write(&text, "just some text, not pixels").unwrap();
    assert_clean_error(&score(&model, &text), &["notes.png", "not a PNG or JPEG"]);
    assert_clean_error(&score(&model, tmp.path()), &["directory"]);

    // An image whose tokens do not fit the context.
    let small = broken_copy("qwen2_vl");
    let cfg = small.path().join("config.json");
    let mut v = json(&cfg);
    v["text_config"]["max_position_embeddings"] = Value::from(16);
    std::fs::write(&cfg, v.to_string()).unwrap();
    let big = fixture("vl_images").join("big.png");
    assert_clean_error(&score(small.path(), &big), &["big.png", "14 tokens", "context of 16"]);

    // A VL config without vision_config.
    let novision = broken_copy("qwen2_5_vl");
    let cfg = novision.path().join("config.json");
    let mut v = json(&cfg);
    v.as_object_mut().unwrap().remove("vision_config");
    std::fs::write(&cfg, v.to_string()).unwrap();
    let rgb = fixture("vl_images").join("rgb.png");
    assert_clean_error(&score(novision.path(), &rgb), &["config.json", "vision_config"]);

    // An unknown vision activation.
    let mut v = json(&fixture("qwen2_5_vl").join("config.json"));
    v["vision_config"]["hidden_act"] = Value::from("swishy");
    std::fs::write(&cfg, v.to_string()).unwrap();
    assert_clean_error(&score(novision.path(), &rgb), &["config.json", "swishy"]);

    // Malformed preprocessor_config.json.
    let badproc = broken_copy("qwen2_vl");
    std::fs::write(badproc.path().join("preprocessor_config.json"), "{ \"min_pixels\": ").unwrap();
    assert_clean_error(&score(badproc.path(), &rgb), &["preprocessor_config.json", "malformed"]);
    std::fs::write(badproc.path().join("preprocessor_config.json"), r#"{"patch_size": 16}"#).unwrap();
    assert_clean_error(&score(badproc.path(), &rgb), &["preprocessor_config.json", "patch_size 16"]);

    // A text-only model given an image.
    assert_clean_error(&score(&fixture("qwen2"), &rgb), &["text-only", "Qwen2ForCausalLM"]);
}

/// Without preprocessor_config.json the processor's defaults apply (and are logged):
/// min_pixels 56², so the 75 × 40 image becomes 56 × 84 as with the fixture's settings.
#[test]
fn missing_preprocessor_config_uses_the_defaults() {
    let dir = broken_copy("qwen2_vl");
    std::fs::remove_file(dir.path().join("preprocessor_config.json")).unwrap();
    let rgb = fixture("vl_images").join("rgb.png");
    let out = dualedit(&["score", "--model", dir.path().to_str().unwrap(), "--image", rgb.to_str().unwrap(), "--text", "The capital of France is Paris.", "--json"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("preprocessor_config.json") && err.contains("defaults"), "the defaults are announced: {err}");
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["image_tokens"].as_u64().unwrap(), 8);
    let want = &json(&fixture("qwen2_vl").join("reference.json"))["cases"][0]["logprobs"];
    let want = want.as_array().unwrap();
    let got = v["logprobs"].as_array().unwrap();
    for (a, b) in got.iter().zip(&want[want.len() - got.len()..]) {
        assert!((a.as_f64().unwrap() - b.as_f64().unwrap()).abs() < 1e-4);
    }
}

/// `plan --image-size` on Qwen2-VL-7B-Instruct's released config.json: the parameter count
/// of the released checkpoint (8.29 B, vision tower included), 1024 patches and 256 + 2
/// tokens for a 448 × 448 image; a text-only model refuses the flag.
#[test]
fn plan_with_an_image_size() {
    let dir = fixture("qwen2_vl_7b_instruct");
    let cfg = Path::new(env!("CARGO_MANIFEST_DIR")).join("configs/qwen2-7b.json");
    let out = dualedit(&["plan", "--model", dir.to_str().unwrap(), "--config", cfg.to_str().unwrap(), "--dtype", "bf16", "--device", "cuda:0", "--image-size", "448x448", "--json"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    let shape = &v["shape"];
    assert_eq!(shape["n_params"].as_i64().unwrap(), 8_291_375_616);
    assert_eq!(shape["image"]["patches"].as_i64().unwrap(), 1024);
    assert_eq!(shape["image"]["tokens"].as_i64().unwrap(), 258);
    assert_eq!(shape["tokens_per_example"].as_i64().unwrap(), 128 + 258);
    let items = v["items"].as_array().unwrap();
    let vision = items.iter().find(|i| i["item"].as_str().unwrap().starts_with("vision tower forward")).unwrap();
    assert!(vision["bytes"].as_u64().unwrap() > 32 << 20, "attention scores alone are 16·1024²·2 bytes");
    // The same plan without the image has fewer tokens and no vision items.
    let out = dualedit(&["plan", "--model", dir.to_str().unwrap(), "--config", cfg.to_str().unwrap(), "--dtype", "bf16", "--json"]);
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["shape"]["tokens_per_example"].as_i64().unwrap(), 128);
    assert!(v["items"].as_array().unwrap().iter().all(|i| !i["item"].as_str().unwrap().contains("vision")));
    let qwen2 = fixture("qwen2");
    let tiny = Path::new(env!("CARGO_MANIFEST_DIR")).join("configs/tiny.json");
    let out = dualedit(&["plan", "--model", qwen2.to_str().unwrap(), "--config", tiny.to_str().unwrap(), "--image-size", "448x448"]);
    assert_clean_error(&out, &["text-only", "--image-size"]);
    let out = dualedit(&["plan", "--model", dir.to_str().unwrap(), "--config", cfg.to_str().unwrap(), "--image-size", "448by448"]);
    assert!(!out.status.success() && String::from_utf8_lossy(&out.stderr).contains("WIDTHxHEIGHT"));
}

/// `plan --ds vqa` (#22) plans EasyEdit's five views as they are, on Qwen2-VL-7B's config
/// with a 640 × 480 COCO photo (393 tokens): four views show the image (128 text tokens +
/// 393), `loc` is the NQ question alone (`--loc-length`), only answer tokens are labelled,
/// and the edited forward is one batch of the four scored views padded to the longest.
#[test]
fn plan_ds_vqa_plans_the_five_views() {
    let dir = fixture("qwen2_vl_7b_instruct");
    let cfg = Path::new(env!("CARGO_MANIFEST_DIR")).join("configs/qwen2vl-7b.json");
    let plan = |extra: &[&str]| {
        let mut args = vec!["plan", "--model", dir.to_str().unwrap(), "--config", cfg.to_str().unwrap(), "--dtype", "bf16", "--device", "cuda:0"];
        args.extend_from_slice(extra);
        let out = dualedit(&args);
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        out
    };
    let json = |extra: &[&str]| -> Value { serde_json::from_slice(&plan(&[extra, &["--json"]].concat()).stdout).unwrap() };
    let v = json(&["--ds", "vqa", "--image-size", "640x480", "--loc-length", "32"]);
    let shape = &v["shape"];
    assert_eq!(shape["image"]["tokens"].as_i64().unwrap(), 393);
    let views: Vec<(String, i64, i64, i64, i64, bool)> = shape["views"]
        .as_array()
        .unwrap()
        .iter()
        .map(|w| (w["name"].as_str().unwrap().to_string(), w["rows"].as_i64().unwrap(), w["tokens"].as_i64().unwrap(), w["image_tokens"].as_i64().unwrap(), w["kept"].as_i64().unwrap(), w["edited"].as_bool().unwrap()))
        .collect();
    let img = |name: &str, edited| (name.to_string(), 1, 128 + 393, 393, 127, edited);
    assert_eq!(views, vec![img("edit_inner", false), img("edit_outer", true), img("edit_outer_image", true), ("loc".into(), 1, 32, 0, 31, true), img("loc_image", true)]);
    // Padded to the longest: the short loc row costs an image row's tokens.
    assert_eq!(shape["edited_forward_tokens"].as_i64().unwrap(), 4 * 521);
    let item = |v: &Value, prefix: &str| -> u64 {
        let items = v["items"].as_array().unwrap();
        items.iter().find(|i| i["phase"] == "train" && i["item"].as_str().unwrap().starts_with(prefix)).unwrap_or_else(|| panic!("no {prefix}"))["bytes"].as_u64().unwrap()
    };
    // Against the text plan (edit_outer + loc of 128 tokens): the same bytes per token.
    let text = json(&["--ds", "zsre"]);
    assert_eq!(text["shape"]["edited_forward_tokens"].as_i64().unwrap(), 2 * 128);
    let acts = "edited forwards: activations kept";
    assert_eq!(item(&v, acts) * 256, item(&text, acts) * 2084);
    // Logits at labelled positions: 3 image views × 127 + loc 31 edited, loc 31 + loc_image 127 unedited.
    assert_eq!(item(&v, "logits at labelled positions"), (3 * 127 + 31 + 31 + 127) * 152_064 * 2);
    // Three distinct images per example through the tower; 7 image rows gathered into batches.
    assert_eq!(shape["image"]["images_per_example"].as_i64().unwrap(), 3);
    assert_eq!(item(&v, "image features gathered"), 7 * 391 * 3584 * 2);
    // Text and the placements table show the views.
    let out = String::from_utf8(plan(&["--ds", "caption", "--image-size", "640x480", "--sub-device", "cuda:1"]).stdout).unwrap();
    assert!(out.contains("edit_outer_image") && out.contains("loc_image") && out.contains("balanced"), "{out}");
    // --ds vqa needs the image; a text dataset refuses one.
    let bad = |extra: &[&str]| {
        let mut args = vec!["plan", "--model", dir.to_str().unwrap(), "--config", cfg.to_str().unwrap()];
        args.extend_from_slice(extra);
        dualedit(&args)
    };
    assert_clean_error(&bad(&["--ds", "vqa"]), &["--ds vqa", "--image-size"]);
    assert_clean_error(&bad(&["--ds", "zsre", "--image-size", "640x480"]), &["text-only", "--image-size"]);
    assert_clean_error(&bad(&["--loc-length", "32"]), &["--loc-length", "--image-size"]);
}

/// The library: `Session::score_image` with and without an image.
#[test]
fn session_scores_with_an_optional_image() {
    use dualedit::edit::session::{Session, SessionOptions};
    let dir = fixture("qwen2_vl");
    let session = Session::open(&dir, None, &SessionOptions::default()).unwrap();
    let img = fixture("vl_images").join("gray.png");
    let r = json(&dir.join("reference.json"));
    let case = r["cases"].as_array().unwrap().iter().find(|c| c["images"] == serde_json::json!(["gray.png"])).unwrap();
    let s = session.score_image(case["text"].as_str().unwrap(), Some(&img)).unwrap();
    assert_eq!(s.image_tokens, 6);
    let want = case["logprobs"].as_array().unwrap();
    for (a, b) in s.logprobs.iter().zip(&want[want.len() - s.logprobs.len()..]) {
        assert!((a - b.as_f64().unwrap()).abs() < 1e-4);
    }
    let text = "The capital of France is Paris.";
    let (a, b) = (session.score_image(text, None).unwrap(), session.score(text).unwrap());
    assert_eq!((a.tokens, a.logprobs, a.image_tokens), (b.tokens, b.logprobs, 0));
}

/// Shapes handed in through the library are checked: pixel rows, grids, image features
/// that do not match the `<|image_pad|>` tokens, M-RoPE ids of the wrong shape.
#[test]
fn library_inputs_of_the_wrong_shape_are_errors() {
    let lm = load_model(&fixture("qwen2_vl"), Device::Cpu, Kind::Float).unwrap();
    let vl = lm.model.family().vision_language().unwrap();
    let p = ParamView::frozen(&lm.params);
    let err = |r: Result<Tensor, dualedit::Error>| r.expect_err("an error").to_string();
    let px = Tensor::zeros([16, 1176], (Kind::Float, Device::Cpu));
    assert!(err(vl.image_features(&p, &px.narrow(1, 0, 100), &[[1, 4, 4]])).contains("1176"));
    assert!(err(vl.image_features(&p, &px, &[[1, 4, 6]])).contains("24 patches"));
    assert!(err(vl.image_features(&p, &px, &[[1, 4, 3]])).contains("multiples of 2"));
    let feats = vl.image_features(&p, &px, &[[1, 4, 4]]).unwrap();
    assert_eq!(feats.size(), vec![4, 64]);
    let ids: Vec<i64> = vl.image_prompt(&[1, 4, 4]).into_iter().chain([10, 11, 12]).collect();
    assert!(vl.mrope_positions(&ids, &[[1, 4, 6]]).unwrap_err().to_string().contains("6 merged patches"));
    assert!(vl.mrope_positions(&ids, &[]).unwrap_err().to_string().contains("more image runs"));
    let t = Tensor::from_slice(&ids).unsqueeze(0);
    let pos = vl.mrope_positions(&ids, &[[1, 4, 4]]).unwrap();
    // Image positions: start 1, rows 1..=2, columns 1..=2; text continues at 1 + 2.
    assert_eq!(Vec::<i64>::try_from(pos.get(1)).unwrap(), vec![0, 1, 1, 2, 2, 3, 4, 5, 6]);
    assert_eq!(Vec::<i64>::try_from(pos.get(2)).unwrap(), vec![0, 1, 2, 1, 2, 3, 4, 5, 6]);
    let none = Default::default();
    let pos = pos.unsqueeze(1);
    let run = |embeds: Option<&Tensor>, pos: Option<&Tensor>| {
        let input = dualedit::model::ForwardInput { image_embeds: embeds, position_ids: pos, ..dualedit::model::ForwardInput::new(&t, &none) };
        lm.model.forward(&p, &input).map(|o| o.logits)
    };
    assert!(run(Some(&feats), Some(&pos)).is_ok());
    assert!(err(run(Some(&feats.narrow(0, 0, 3)), Some(&pos))).contains("4 <|image_pad|> tokens"));
    assert!(err(run(None, Some(&pos))).contains("no image features"));
    assert!(err(run(Some(&feats), Some(&pos.squeeze_dim(1)))).contains("[3, 1, 9]"));
}
