//! Qwen2-VL and Qwen2.5-VL against transformers (references from scripts/make_vl_fixtures.py):
//! image preprocessing against `Qwen2VLImageProcessor` (PIL backend), image-token counts,
//! and log-probabilities through the vision tower and the M-RoPE text decoder, for both
//! config.json layouts and both tensor-name layouts.
use std::collections::HashMap;
use std::path::{Path, PathBuf};

use dualedit::model::vision::{image, ImageProcessorConfig};
use dualedit::model::{load_model, ParamView};
use serde_json::Value;
use tch::{Device, Kind, Tensor};

use crate::common;
use common::{assert_clean_error, broken_copy, dualedit, fixture};

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
            let img = image::prepare(&fixture("vl_images").join(name), &proc).unwrap_or_else(|e| panic!("{name}: {e}"));
            let grid: Vec<i64> = meta["grid_thw"].as_array().unwrap().iter().map(|v| v.as_i64().unwrap()).collect();
            assert_eq!(img.grid.to_vec(), grid, "{name}: image_grid_thw");
            assert_eq!(img.n_tokens(2), meta["image_tokens"].as_i64().unwrap(), "{name}: image tokens");
            let theirs = &pixels[name];
            assert_eq!(img.pixel_values.size(), theirs.size(), "{name}: pixel_values shape");
            let (d, levels) = pixel_diff(&img.pixel_values, theirs);
            // Decoding (PNG in every mode; JPEG with libjpeg-turbo's arithmetic, CMYK and EXIF
            // files included, and a JPEG named .png by content), compositing, Pillow 13's
            // bicubic (pass order included) and the f32 normalisation are reproduced exactly.
            assert_eq!(d, 0.0, "{name} ({} {}): max abs pixel diff {d} ({levels:.2} levels)", meta["format"], meta["mode"]);
        }
    }
}

/// Every reference case from the image files through dualedit's preprocessing (PNG and
/// JPEG alike): token ids exactly, log-probabilities of the text tokens within 2e-5 of
/// transformers' (whose processor read the same files with Pillow), 1e-5 where an image is a
/// JPEG. The pixels are exact (above); what is left is f32 summation order in the towers.
fn check_model(name: &str) {
    let dir = fixture(name);
    let r = json(&dir.join("reference.json"));
    let lm = load_model(&dir, Device::Cpu, Kind::Float).unwrap();
    let params = ParamView::frozen(&lm.params);
    let img_ref = json(&fixture("vl_images").join("reference.json"));
    let (mut worst, mut jpeg_worst, mut jpeg_cases) = (0f64, 0f64, 0);
    for case in r["cases"].as_array().unwrap() {
        let images: Vec<String> = case["images"].as_array().unwrap().iter().map(|v| v.as_str().unwrap().to_string()).collect();
        let text = case["text"].as_str().unwrap();
        let want_ids: Vec<i64> = case["input_ids"].as_array().unwrap().iter().map(|v| v.as_i64().unwrap()).collect();
        let want_lp: Vec<f64> = case["logprobs"].as_array().unwrap().iter().map(|v| v.as_f64().unwrap() as f32 as f64).collect();
        let paths: Vec<PathBuf> = images.iter().map(|i| fixture("vl_images").join(i)).collect();
        let refs: Vec<&Path> = paths.iter().map(|p| p.as_path()).collect();
        let got = dualedit::edit::score::score_with_images(&lm, &params, text, &refs).unwrap();
        // The text's ids are the tail of the reference sequence; the image prefix is its
        // head: `image_tokens` image pads, and a start and an end marker per image.
        let pads = want_ids.iter().filter(|&&t| t == r["token_ids"]["<|image_pad|>"].as_i64().unwrap()).count();
        assert_eq!(got.image_tokens, pads, "{name} {images:?}: image_tokens counts the <|image_pad|> tokens");
        let prefix = got.image_tokens + 2 * images.len();
        assert_eq!(prefix + got.tokens.len(), want_ids.len(), "{name} {images:?}: sequence length");
        assert_eq!(got.tokens[..], want_ids[prefix..], "{name} {images:?}: text token ids");
        let expected = &want_lp[want_lp.len() - got.logprobs.len()..];
        for (a, b) in got.logprobs.iter().zip(expected) {
            worst = worst.max((a - b).abs());
        }
        let d = got.logprobs.iter().zip(expected).map(|(a, b)| (a - b).abs()).fold(0.0, f64::max);
        let jpeg = images.iter().any(|i| img_ref["images"][i.as_str()]["format"] == "JPEG");
        if jpeg {
            jpeg_worst = jpeg_worst.max(d);
            jpeg_cases += 1;
        }
        assert!(d <= if jpeg { 1e-5 } else { 2e-5 }, "{name} {images:?}: max abs log-prob diff {d}");
    }
    assert!(jpeg_cases >= 2, "{name}: the reference has {jpeg_cases} cases with a JPEG");
    eprintln!("{name}: max abs log-prob diff over all cases {worst:e}, the {jpeg_cases} with a JPEG {jpeg_worst:e}");
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


#[test]
fn score_image_json() {
    let dir = fixture("qwen2_5_vl");
    let r = json(&dir.join("reference.json"));
    let case = &r["cases"][0];
    let img = fixture("vl_images").join(case["images"][0].as_str().unwrap());
    let out = dualedit(&["score", "--model", dir.to_str().unwrap(), "--image", img.to_str().unwrap(), "--text", case["text"].as_str().unwrap(), "--json"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: Value = serde_json::from_slice(&out.stdout).expect("stdout is one JSON object");
    assert_eq!(v["image_tokens"].as_u64().unwrap(), 6, "the <|image_pad|> tokens (start and end markers not counted)");
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
    assert_eq!(v["image_tokens"].as_u64().unwrap(), 6);
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
    let cfg = common::root().join("configs/qwen2-7b.json");
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
    let tiny = common::root().join("configs/tiny.json");
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
    let cfg = common::root().join("configs/qwen2vl-7b.json");
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
    // Grouped by length (#35): the three image views in one forward, the short loc row alone,
    // so it no longer costs an image row's tokens.
    assert_eq!(shape["edited_forward_tokens"].as_i64().unwrap(), 3 * 521 + 32);
    let item = |v: &Value, prefix: &str| -> u64 {
        let items = v["items"].as_array().unwrap();
        items.iter().find(|i| i["phase"] == "train" && i["item"].as_str().unwrap().starts_with(prefix)).unwrap_or_else(|| panic!("no {prefix}"))["bytes"].as_u64().unwrap()
    };
    // Against the text plan (edit_outer + loc of 128 tokens): the same bytes per token.
    let text = json(&["--ds", "zsre"]);
    assert_eq!(text["shape"]["edited_forward_tokens"].as_i64().unwrap(), 2 * 128);
    let acts = "edited forwards: activations kept";
    assert_eq!(item(&v, acts) * 256, item(&text, acts) * (3 * 521 + 32));
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
    assert_eq!(s.image_tokens, 4, "4 image pads (the 2 markers are not counted)");
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

// ---- Pillow's resize, bit for bit (issue #31) ----

/// Pillow 13's bicubic on noise with a saturated block, up and down in either direction,
/// odd sizes, and sizes where Pillow runs the vertical pass first: every byte equal.
#[test]
fn bicubic_resize_equals_pillow_on_noise_in_both_pass_orders() {
    let cases = json(&fixture("vl_images").join("resize.json"));
    let t: HashMap<String, Tensor> =
        Tensor::read_safetensors(fixture("vl_images").join("resize.safetensors")).unwrap().into_iter().collect();
    let bytes = |t: &Tensor| Vec::<u8>::try_from(t.flatten(0, -1)).unwrap();
    let cases = cases["cases"].as_array().unwrap();
    assert!(cases.len() >= 10);
    for (i, c) in cases.iter().enumerate() {
        let [h, w, th, tw] = [0, 1, 2, 3].map(|k| c[k].as_u64().unwrap() as usize);
        let src = image::Rgb8 { height: h, width: w, data: bytes(&t[&format!("src{i}")]) };
        let got = image::resize_bicubic(&src, th, tw);
        let want = bytes(&t[&format!("out{i}")]);
        let differ = got.data.iter().zip(&want).filter(|(a, b)| a != b).count();
        assert_eq!((got.height, got.width), (th, tw));
        assert_eq!(differ, 0, "case {i}: {h}×{w} → {th}×{tw}: {differ} of {} bytes differ from Pillow", want.len());
    }
}

/// EXIF orientation is not applied (the processor and qwen_vl_utils do not call
/// `exif_transpose`): the 96 × 40 JPEG tagged "rotate 90°" keeps its stored shape.
#[test]
fn exif_orientation_is_ignored_as_the_processor_does() {
    let proc = processor("qwen2_vl");
    let img = image::prepare(&fixture("vl_images").join("exif_rotated.jpg"), &proc).unwrap();
    let meta = &json(&fixture("vl_images").join("reference.json"))["images"]["exif_rotated.jpg"];
    assert_eq!(meta["size"], serde_json::json!([40, 96]));
    assert_eq!(img.grid.to_vec(), vec![1, 4, 8], "wide as stored, not rotated to tall");
}

// ---- config.json as transformers writes it (issue #31, #33 item 9) ----

fn with_config(model: &str, edit: impl FnOnce(&mut Value)) -> tempfile::TempDir {
    let dir = broken_copy(model);
    let cfg = dir.path().join("config.json");
    let mut v = json(&cfg);
    edit(&mut v);
    std::fs::write(&cfg, v.to_string()).unwrap();
    dir
}

fn load_err(dir: &Path) -> String {
    match load_model(dir, Device::Cpu, Kind::Float) {
        Ok(_) => panic!("{} loaded", dir.display()),
        Err(e) => e.to_string(),
    }
}

#[test]
fn vision_config_aliases_agreeing_are_accepted_disagreeing_refused_with_both_values() {
    // Both spellings, equal: what transformers 5.23 / 5.24 write from a released config.
    for (model, extra) in [
        ("qwen2_vl", serde_json::json!({"in_chans": 3, "in_channels": 3, "spatial_patch_size": 14, "num_attention_heads": 2, "num_hidden_layers": 2})),
        ("qwen2_5_vl", serde_json::json!({"in_chans": 3, "in_channels": 3, "embed_dim": 32, "num_attention_heads": 2})),
    ] {
        let dir = with_config(model, |v| {
            for (k, x) in extra.as_object().unwrap() {
                v["vision_config"][k] = x.clone();
            }
        });
        load_model(dir.path(), Device::Cpu, Kind::Float).unwrap_or_else(|e| panic!("{model}: {e}"));
    }
    // Only the other spelling.
    let dir = with_config("qwen2_vl", |v| {
        let vc = v["vision_config"].as_object_mut().unwrap();
        vc.remove("in_channels");
        vc.insert("in_chans".into(), Value::from(3));
        let d = vc.remove("depth").unwrap();
        vc.insert("num_hidden_layers".into(), d);
    });
    load_model(dir.path(), Device::Cpu, Kind::Float).unwrap();
    // Disagreeing: one error naming config.json, the field and both values.
    for (model, k1, v1, k2, v2) in [
        ("qwen2_vl", "in_chans", 1, "in_channels", 3),
        ("qwen2_vl", "spatial_patch_size", 16, "patch_size", 14),
        ("qwen2_vl", "num_attention_heads", 4, "num_heads", 2),
        ("qwen2_5_vl", "embed_dim", 48, "hidden_size", 32),
    ] {
        let dir = with_config(model, |v| {
            v["vision_config"][k1] = Value::from(v1);
            v["vision_config"][k2] = Value::from(v2);
        });
        let e = load_err(dir.path());
        for needle in ["config.json", k1, k2, &v1.to_string(), &v2.to_string(), "disagree"] {
            assert!(e.contains(needle), "{model} {k1}/{k2}: {e:?} should name {needle:?}");
        }
    }
    // Unused keys are ignored (tokens_per_second, model_type, dtype, anything new).
    let dir = with_config("qwen2_5_vl", |v| {
        v["vision_config"]["tokens_per_second"] = Value::from(2);
        v["vision_config"]["some_future_key"] = serde_json::json!({"x": [1, 2]});
        v["some_top_level_key"] = Value::from("ignored");
    });
    load_model(dir.path(), Device::Cpu, Kind::Float).unwrap();
}

#[test]
fn text_duplicates_and_rope_duplicates_must_agree() {
    // Nested layout with a top-level copy that agrees: fine; that disagrees: refused.
    let dir = with_config("qwen2_vl", |v| v["vocab_size"] = Value::from(512));
    load_model(dir.path(), Device::Cpu, Kind::Float).unwrap();
    let dir = with_config("qwen2_vl", |v| v["hidden_size"] = Value::from(3584));
    let e = load_err(dir.path());
    assert!(e.contains("config.json") && e.contains("3584") && e.contains("64") && e.contains("hidden_size"), "{e}");
    // Flat layout: rope_theta at the top and in rope_scaling / rope_parameters.
    let dir = with_config("qwen2_5_vl", |v| v["rope_parameters"] = serde_json::json!({"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}));
    let e = load_err(dir.path());
    assert!(e.contains("config.json") && e.contains("rope_theta") && e.contains("10000") && e.contains("1000000"), "{e}");
    let dir = with_config("qwen2_5_vl", |v| v["rope_parameters"] = serde_json::json!({"rope_type": "default", "mrope_section": [4, 2, 2]}));
    let e = load_err(dir.path());
    assert!(e.contains("mrope_section") && e.contains("[2, 3, 3]") && e.contains("[4, 2, 2]"), "{e}");
}

#[test]
fn colliding_marker_token_ids_are_refused_at_load_naming_config_json() {
    for (key, other) in [("image_token_id", "vision_start_token_id"), ("vision_end_token_id", "image_token_id"), ("video_token_id", "image_token_id")] {
        let dir = with_config("qwen2_vl", |v| {
            let id = v[other].clone();
            v[key] = id;
        });
        let e = load_err(dir.path());
        assert!(e.contains("config.json") && e.contains(key) && e.contains(other) && e.contains("distinct"), "{key}={other}: {e}");
        // And the CLI: one clear line.
        let out = dualedit(&["score", "--model", dir.path().to_str().unwrap(), "--text", "The capital of France is"]);
        assert_clean_error(&out, &["config.json", key]);
    }
}

// ---- hostile images and settings (issue #33 items 1, 2, 5, 8, 10) ----

fn score_image(dir: &Path, img: &Path) -> std::process::Output {
    dualedit(&["score", "--model", dir.to_str().unwrap(), "--image", img.to_str().unwrap(), "--text", "The capital of France is", "--json"])
}

/// min_pixels = max_pixels = 10¹²: refused when preprocessor_config.json is read (no
/// image could fit), and a large max_pixels with a large image is refused from the grid
/// before the resize allocates, naming the image and the limit.
#[test]
fn huge_pixel_ranges_are_bounded_before_allocating() {
    let dir = broken_copy("qwen2_vl");
    let pp = dir.path().join("preprocessor_config.json");
    std::fs::write(&pp, r#"{"min_pixels": 1000000000000, "max_pixels": 1000000000000}"#).unwrap();
    let rgb = fixture("vl_images").join("rgb.png");
    assert_clean_error(&score_image(dir.path(), &rgb), &["preprocessor_config.json", "min_pixels", "tokens"]);
    // A valid-looking range whose smallest image (300 tokens) is more than the context
    // (256): refused from the grid, before the resize allocates.
    std::fs::write(&pp, r#"{"min_pixels": 235200, "max_pixels": 1000000000000}"#).unwrap();
    let t = std::time::Instant::now();
    assert_clean_error(&score_image(dir.path(), &rgb), &["rgb.png", "tokens", "preprocessor_config.json", "254"]);
    assert!(t.elapsed().as_secs() < 30);
    // The library bound, with a limit set by the caller: big.png at max_pixels 1e12 is
    // 308 × 392 pixels, 154 tokens.
    std::fs::write(&pp, r#"{"min_pixels": 3136, "max_pixels": 1000000000000}"#).unwrap();
    let big = fixture("vl_images").join("big.png");
    let proc = ImageProcessorConfig::load(&pp).unwrap().with_max_tokens(100);
    let e = image::prepare(&big, &proc).unwrap_err().to_string();
    assert!(e.contains("big.png") && e.contains("154 tokens") && e.contains("100"), "{e}");
}

/// A FIFO (nobody writing) named as an image is refused at once instead of blocking in
/// open(); so is a character device, and a read stops at the cap.
#[test]
fn non_regular_files_are_refused_without_blocking() {
    let tmp = tempfile::tempdir().unwrap();
    let fifo = tmp.path().join("pipe.png");
    let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
    let t = std::time::Instant::now();
    let e = image::open_checked(&fifo).unwrap_err().to_string();
    assert!(e.contains("pipe.png") && e.contains("not a regular file"), "{e}");
    let e = image::read_header(&fifo).unwrap_err().to_string();
    assert!(e.contains("not a regular file"), "{e}");
    assert_clean_error(&score_image(&fixture("qwen2_vl"), &fifo), &["pipe.png", "not a regular file"]);
    let e = image::open_checked(Path::new("/dev/zero")).unwrap_err().to_string();
    assert!(e.contains("/dev/zero") && e.contains("not a regular file"), "{e}");
    assert!(t.elapsed().as_secs() < 20, "took {:?}", t.elapsed());
    // The capped reader itself.
    let f = tmp.path().join("big.bin");
    std::fs::write(&f, vec![0u8; 1000]).unwrap();
    assert_eq!(dualedit::io::read_regular_capped(&f, 1000).unwrap().len(), 1000);
    let e = dualedit::io::read_regular_capped(&f, 999).unwrap_err().to_string();
    assert!(e.contains("big.bin") && e.contains("1000 bytes"), "{e}");
}

/// A 1-bit 20000 × 20000 PNG (a few dozen KB that decode to 400 M pixels) is refused from
/// its header: quickly, without the gigabytes.
#[test]
fn decompression_bombs_are_refused_from_the_header() {
    let tmp = tempfile::tempdir().unwrap();
    let bomb = tmp.path().join("bomb.png");
    let side = 20_000u32;
    let mut bytes = Vec::new();
    {
        let mut enc = png::Encoder::new(&mut bytes, side, side);
        enc.set_color(png::ColorType::Grayscale);
        enc.set_depth(png::BitDepth::One);
        enc.set_compression(png::Compression::Best);
        let mut w = enc.write_header().unwrap();
        let mut sw = w.stream_writer().unwrap();
        let row = vec![0u8; (side as usize + 7) / 8];
        for _ in 0..side {
            std::io::Write::write_all(&mut sw, &row).unwrap();
        }
        sw.finish().unwrap();
    }
    assert!(bytes.len() < 1 << 20, "the bomb is small: {} bytes", bytes.len());
    std::fs::write(&bomb, &bytes).unwrap();
    let t = std::time::Instant::now();
    let e = image::open_checked(&bomb).unwrap_err().to_string();
    assert!(e.contains("bomb.png") && e.contains("400000000 pixels") && e.contains("178956970"), "{e}");
    assert_clean_error(&score_image(&fixture("qwen2_vl"), &bomb), &["bomb.png", "178956970"]);
    assert!(t.elapsed().as_secs() < 20, "took {:?}", t.elapsed());
}

/// rescale_factor 1e308 or image_std [1e-320, 1, 1] would normalise pixels to ±inf/NaN:
/// refused when preprocessor_config.json is read; NaN weights in the vision tower make
/// non-finite features, an error naming the image.
#[test]
fn non_finite_preprocessing_and_features_are_errors() {
    let dir = broken_copy("qwen2_vl");
    let pp = dir.path().join("preprocessor_config.json");
    let rgb = fixture("vl_images").join("rgb.png");
    for (body, needle) in [
        (r#"{"rescale_factor": 1e308}"#, "rescale_factor"),
        (r#"{"image_std": [1e-320, 1, 1]}"#, "image_std"),
        (r#"{"image_mean": [1e308, 0, 0], "image_std": [1e-300, 1, 1]}"#, "image_std"),
    ] {
        std::fs::write(&pp, body).unwrap();
        let e = ImageProcessorConfig::load(&pp).unwrap_err().to_string();
        assert!(e.contains("preprocessor_config.json") && e.contains(needle) && e.contains("finite"), "{body}: {e}");
        assert_clean_error(&score_image(dir.path(), &rgb), &["preprocessor_config.json", needle]);
    }
    // A patch embedding of ±3e38 (finite, so the loader takes it) overflows to inf.
    let nan = broken_copy("qwen2_vl");
    let st = nan.path().join("model.safetensors");
    let tensors = Tensor::read_safetensors(&st).unwrap();
    let tensors: Vec<(String, Tensor)> = tensors
        .into_iter()
        .map(|(k, t)| if k.contains("visual.patch_embed") { (k, t.fill(3e38)) } else { (k, t) })
        .collect();
    Tensor::write_safetensors(&tensors, &st).unwrap();
    assert_clean_error(&score_image(nan.path(), &rgb), &["rgb.png", "non-finite"]);
}

/// The decoder is chosen by content: a JPEG named .png is read as the JPEG it is (as
/// Pillow does), and its pixels agree with the processor's as JPEGs do.
#[test]
fn the_decoder_is_chosen_by_content_not_by_name() {
    let named = fixture("vl_images").join("jpeg_named.png");
    let h = image::read_header(&named).unwrap();
    assert_eq!((h.format, h.width, h.height), (image::ImageKind::Jpeg, 52, 36));
    let out = score_image(&fixture("qwen2_vl"), &named);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    // And a PNG named .jpg.
    let tmp = tempfile::tempdir().unwrap();
    let png_as_jpg = tmp.path().join("really_a_png.jpg");
    std::fs::copy(fixture("vl_images").join("rgb.png"), &png_as_jpg).unwrap();
    let proc = processor("qwen2_vl");
    let a = image::prepare(&png_as_jpg, &proc).unwrap();
    let b = image::prepare(&fixture("vl_images").join("rgb.png"), &proc).unwrap();
    assert_eq!(a.pixel_values.size(), b.pixel_values.size());
    assert_eq!((a.pixel_values - b.pixel_values).abs().max().double_value(&[]), 0.0);
}

// ---- checkpoints written by several transformers versions (issue #31) ----

/// Text log-probs after `images`, each prepared with `proc` (the library path
/// `score_with_images` takes, with the processor settings given instead of read).
fn score_prepared(lm: &dualedit::model::LoadedModel, params: &ParamView, text: &str, images: &[PathBuf], proc: &ImageProcessorConfig) -> dualedit::edit::score::Score {
    let vl = lm.model.family().vision_language().unwrap();
    let prepared: Vec<_> = images.iter().map(|p| image::prepare(p, proc).unwrap()).collect();
    let grids: Vec<_> = prepared.iter().map(|p| p.grid).collect();
    let _g = tch::no_grad_guard();
    let px = Tensor::cat(&prepared.iter().map(|p| &p.pixel_values).collect::<Vec<_>>(), 0);
    let feats = vl.image_features(params, &px, &grids).unwrap();
    let mut ids: Vec<i64> = grids.iter().flat_map(|g| vl.image_prompt(g)).collect();
    let prefix = ids.len();
    let text_ids = lm.tokenizer.encode(text).unwrap();
    ids.extend(&text_ids);
    let pos = vl.mrope_positions(&ids, &grids).unwrap().unsqueeze(1);
    let t = Tensor::from_slice(&ids).unsqueeze(0);
    let none = Default::default();
    let input = dualedit::model::ForwardInput { position_ids: Some(&pos), image_embeds: Some(&feats), ..dualedit::model::ForwardInput::new(&t, &none) };
    let logits = lm.model.forward(params, &input).unwrap().logits.get(0).log_softmax(-1, Kind::Float);
    let n = ids.len() as i64;
    let lp = logits.narrow(0, 0, n - 1).gather(1, &t.get(0).narrow(0, 1, n - 1).unsqueeze(1), false).squeeze_dim(1);
    let lp: Vec<f64> = Vec::try_from(lp.to_kind(Kind::Double)).unwrap();
    dualedit::edit::score::Score {
        tokens: text_ids.clone(),
        logprobs: lp[prefix - 1..].to_vec(),
        mean_nll: 0.0,
        image_tokens: grids.iter().map(|g| g.iter().product::<i64>() as usize / 4).sum(),
    }
}

/// Every checkpoint under tests/fixtures/vl_versions (scripts/make_vl_version_fixtures.py:
/// transformers 4.57, 5.23, 5.24; Qwen2-VL and Qwen2.5-VL; the config, weights and
/// preprocessor_config.json as that version's save_pretrained writes them from a
/// released-style config, and the released flat layout) loads and scores each case from
/// the image files as that version does: log-probs ≤ 1e-4, token ids and image-pad
/// counts equal. transformers 4.x drops an image's alpha channel where 5.x composites it
/// onto white, so 4.x checkpoints are scored with [`image::AlphaMode::Drop`] (the default
/// path, transformers 5's, differs there by up to ~1 in log-prob on rgba.png).
#[test]
fn checkpoints_saved_by_each_transformers_version_load_and_score_as_transformers() {
    let root = fixture("vl_versions");
    let mut versions: Vec<PathBuf> = std::fs::read_dir(&root).unwrap().map(|e| e.unwrap().path()).collect();
    versions.sort();
    let names: Vec<String> = versions.iter().map(|v| v.file_name().unwrap().to_string_lossy().into_owned()).collect();
    assert!(names.len() >= 3 && names.iter().any(|n| n.starts_with("4.")), "versions: {names:?}");
    let mut checked = 0;
    for v in &versions {
        let mut dirs: Vec<PathBuf> = std::fs::read_dir(v).unwrap().map(|e| e.unwrap().path()).collect();
        dirs.sort();
        assert_eq!(dirs.len(), 4, "{}: both families in both layouts", v.display());
        for dir in dirs {
            let what = dir.strip_prefix(&root).unwrap().display().to_string();
            let r = json(&dir.join("reference.json"));
            let lm = load_model(&dir, Device::Cpu, Kind::Float).unwrap_or_else(|e| panic!("{what}: {e}"));
            let params = ParamView::frozen(&lm.params);
            let pad = r["token_ids"]["<|image_pad|>"].as_i64().unwrap();
            let mut worst = 0f64;
            for case in r["cases"].as_array().unwrap() {
                let images: Vec<PathBuf> =
                    case["images"].as_array().unwrap().iter().map(|i| fixture("vl_images").join(i.as_str().unwrap())).collect();
                let refs: Vec<&Path> = images.iter().map(|p| p.as_path()).collect();
                let text = case["text"].as_str().unwrap();
                let s = if what.starts_with("4.") && !images.is_empty() {
                    let proc = lm.model.family().vision_language().unwrap().image_processor(&dir).unwrap();
                    let dropped = score_prepared(&lm, &params, text, &images, &proc.clone().with_alpha(image::AlphaMode::Drop));
                    if case["images"] == serde_json::json!(["rgba.png"]) {
                        // The default (transformers 5's compositing) is measurably not 4.x's.
                        let onto_white = score_prepared(&lm, &params, text, &images, &proc);
                        let d = dropped.logprobs.iter().zip(&onto_white.logprobs).map(|(a, b)| (a - b).abs()).fold(0.0, f64::max);
                        assert!(d > 1e-2, "{what}: alpha dropped vs composited differ by only {d}");
                    }
                    dropped
                } else {
                    dualedit::edit::score::score_with_images(&lm, &params, text, &refs).unwrap_or_else(|e| panic!("{what}: {e}"))
                };
                let want_ids: Vec<i64> = case["input_ids"].as_array().unwrap().iter().map(|v| v.as_i64().unwrap()).collect();
                assert_eq!(s.image_tokens, want_ids.iter().filter(|&&t| t == pad).count(), "{what}: image tokens");
                assert_eq!(s.tokens[..], want_ids[want_ids.len() - s.tokens.len()..], "{what}: text ids");
                let want: Vec<f64> = case["logprobs"].as_array().unwrap().iter().map(|v| v.as_f64().unwrap()).collect();
                let d = s.logprobs.iter().zip(&want[want.len() - s.logprobs.len()..]).map(|(a, b)| (a - b).abs()).fold(0.0, f64::max);
                assert!(d <= 1e-4, "{what} {:?}: max abs log-prob diff {d}", case["images"]);
                worst = worst.max(d);
                checked += 1;
            }
            eprintln!("{what}: max abs log-prob diff {worst:e}");
        }
    }
    assert!(checked >= 3 * 4 * 4);
}

/// The multimodal default carries the chat template its pretraining built prompts with
/// (`pretrain --vl` writes it), so editing it uses that file, not a fallback with a warning.
#[test]
fn the_multimodal_default_ships_the_template_it_was_pretrained_with() {
    let dir = common::root().join("data/vl/model");
    let shipped = std::fs::read_to_string(dir.join("chat_template.jinja")).unwrap();
    assert_eq!(shipped, dualedit::model::qwen2_vl::DEFAULT_CHAT_TEMPLATE);
    let t = dualedit::model::vision::ChatTemplate::load(&dir, dualedit::model::qwen2_vl::default_chat_template()).unwrap();
    assert!(format!("{t:?}").contains("chat_template.jinja"), "{t:?}");
}

/// Issue #48: a chat template that loops without bound, renders without bound, or is not a file
/// (a folder, a FIFO, a device) is an error naming it, at once; never the default.
#[test]
fn chat_templates_that_never_end_or_are_no_files_are_named() {
    let dir = tempfile::tempdir().unwrap();
    let jinja = dir.path().join("chat_template.jinja");
    let t = std::time::Instant::now();
    std::fs::write(&jinja, "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}").unwrap();
    let err = dualedit::model::vision::ChatTemplate::load(dir.path(), dualedit::model::qwen2_vl::default_chat_template()).unwrap_err().to_string();
    assert!(err.contains("chat_template.jinja") && err.contains("instructions"), "{err}");
    std::fs::write(&jinja, "{% for i in range(100000) %}{{ 'x' * 1000 }}{% endfor %}").unwrap();
    let err = dualedit::model::vision::ChatTemplate::load(dir.path(), dualedit::model::qwen2_vl::default_chat_template()).unwrap_err().to_string();
    assert!(err.contains("chat_template.jinja") && (err.contains("bytes") || err.contains("instructions")), "{err}");
    assert!(t.elapsed() < std::time::Duration::from_secs(1), "took {:?}", t.elapsed());
    std::fs::remove_file(&jinja).unwrap();
    std::fs::create_dir(&jinja).unwrap();
    let err = dualedit::model::vision::ChatTemplate::load(dir.path(), dualedit::model::qwen2_vl::default_chat_template()).unwrap_err().to_string();
    assert!(err.contains("chat_template.jinja") && err.contains("directory"), "{err}");
    std::fs::remove_dir(&jinja).unwrap();
    let fifo = std::ffi::CString::new(jinja.to_str().unwrap()).unwrap();
    assert_eq!(unsafe { libc::mkfifo(fifo.as_ptr(), 0o600) }, 0);
    let err = dualedit::model::vision::ChatTemplate::load(dir.path(), dualedit::model::qwen2_vl::default_chat_template()).unwrap_err().to_string();
    assert!(err.contains("chat_template.jinja") && err.contains("FIFO"), "{err}");
    std::fs::remove_file(&jinja).unwrap();
    std::os::unix::fs::symlink("/dev/zero", &jinja).unwrap();
    let err = dualedit::model::vision::ChatTemplate::load(dir.path(), dualedit::model::qwen2_vl::default_chat_template()).unwrap_err().to_string();
    assert!(err.contains("chat_template.jinja") && err.contains("device"), "{err}");
}
