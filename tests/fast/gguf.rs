//! `dualedit convert --gguf`: the tiny GGUF fixtures (tests/fixtures/gguf, from
//! `scripts/make_gguf_fixtures.py`: llama, qwen2, gpt2 with byte-level BPE vocabularies and a
//! llama with a SentencePiece one, every tensor type the importer
//! reads) converted and compared with what transformers 5 makes of the same files (weights,
//! config, token ids, the chat template, log-probabilities); the converted folder loaded and
//! scored by dualedit; and hostile files (each header number made to lie) refused with one
//! error naming the file and, where there is one, the tensor.
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use crate::common::{assert_clean_error, dualedit, fixture, json_file};
use dualedit::convert::convert_gguf;
use dualedit::model::{load_model, ParamView, Tokenizer};
use tch::{Device, Kind};

const KINDS: [&str; 4] = ["llama", "qwen2", "gpt2", "llama-spm"];

fn gguf(kind: &str) -> PathBuf {
    fixture("gguf").join(format!("{kind}.gguf"))
}

/// Every f32 tensor of a safetensors file, by name: (shape, values).
fn read_f32(path: &Path) -> BTreeMap<String, (Vec<usize>, Vec<f32>)> {
    let bytes = std::fs::read(path).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    st.tensors()
        .into_iter()
        .map(|(name, view)| {
            assert_eq!(view.dtype(), safetensors::Dtype::F32, "{name} in {}", path.display());
            let values = view.data().chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
            (name, (view.shape().to_vec(), values))
        })
        .collect()
}

#[test]
fn each_fixture_converts_to_what_transformers_loads() {
    for kind in KINDS {
        let tmp = tempfile::tempdir().unwrap();
        let out = tmp.path().join("model");
        let summary = convert_gguf(&gguf(kind), &out).unwrap_or_else(|e| panic!("{kind}: {e}"));
        let expected = json_file(&fixture("gguf").join(format!("{kind}.expected.json")));

        // Weights: the same names, shapes and values as transformers' state dict.
        let want = read_f32(&fixture("gguf").join(format!("{kind}.expected.safetensors")));
        let got = read_f32(&out.join("model.safetensors"));
        assert_eq!(got.keys().collect::<Vec<_>>(), want.keys().collect::<Vec<_>>(), "{kind}: tensor names");
        for (name, (shape, values)) in &want {
            let (gshape, gvalues) = &got[name];
            assert_eq!(gshape, shape, "{kind}: {name} shape");
            let worst = values.iter().zip(gvalues).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
            assert!(worst <= 1e-6, "{kind}: {name} differs from transformers' by {worst}");
        }
        assert_eq!(summary.tensors, want.len());

        // config.json: every size and id transformers' config has.
        let config = json_file(&out.join("config.json"));
        let want_cfg = &expected["config"];
        for key in [
            "model_type",
            "architectures",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "rms_norm_eps",
            "max_position_embeddings",
            "rope_parameters",
            "n_embd",
            "n_layer",
            "n_head",
            "n_positions",
            "layer_norm_epsilon",
            "activation_function",
            "vocab_size",
            "bos_token_id",
            "eos_token_id",
            "pad_token_id",
            "tie_word_embeddings",
        ] {
            if let Some(v) = want_cfg.get(key) {
                assert_eq!(config.get(key), Some(v), "{kind}: config.json {key}");
            }
        }
        assert_eq!(config["dtype"], "float32", "{kind}: transformers loads a GGUF as {}", expected["dtype"]);

        // Token ids of each text, and of the chat template rendered.
        let tok = Tokenizer::from_file(&out.join("tokenizer.json")).unwrap();
        for (text, ids) in expected["ids"].as_object().unwrap() {
            let want: Vec<i64> = serde_json::from_value(ids.clone()).unwrap();
            assert_eq!(tok.encode(text).unwrap(), want, "{kind}: ids of {text:?}");
        }
        if let Some(chat) = expected.get("chat") {
            let text = chat["text"].as_str().unwrap();
            let want: Vec<i64> = serde_json::from_value(chat["ids"].clone()).unwrap();
            assert_eq!(tok.encode(text).unwrap(), want, "{kind}: ids of the chat prompt");
            let template = std::fs::read_to_string(out.join("chat_template.jinja")).unwrap();
            assert!(template.contains("<|im_start|>"), "{kind}: chat_template.jinja");
            let tc = json_file(&out.join("tokenizer_config.json"));
            assert_eq!(tc["chat_template"].as_str(), Some(template.as_str()));
        }

        // dualedit loads the folder and scores the text as transformers does.
        let lm = load_model(&out, Device::Cpu, Kind::Float).unwrap_or_else(|e| panic!("{kind}: {e}"));
        let score = &expected["score"];
        let s = dualedit::edit::score::score_text(&lm, &ParamView::frozen(&lm.params), score["text"].as_str().unwrap()).unwrap();
        let want_ids: Vec<i64> = serde_json::from_value(score["ids"].clone()).unwrap();
        let want_lp: Vec<f64> = serde_json::from_value(score["logprobs"].clone()).unwrap();
        assert_eq!(s.tokens, want_ids, "{kind}: scored ids");
        for (a, b) in s.logprobs.iter().zip(&want_lp) {
            assert!((a - b).abs() < 2e-5, "{kind}: log-prob {a} vs transformers' {b}");
        }
    }
}

#[test]
fn a_killed_conversions_temporary_folder_is_removed() {
    let tmp = tempfile::tempdir().unwrap();
    // No process has this id (Linux's pid_max is at most 2^22).
    let stale = tmp.path().join(".model.dualedit-convert-999999999-1");
    std::fs::create_dir(&stale).unwrap();
    std::fs::write(stale.join("model.safetensors"), b"half").unwrap();
    convert_gguf(&gguf("gpt2"), &tmp.path().join("model")).unwrap();
    assert!(!stale.exists());
    let names: Vec<String> = std::fs::read_dir(tmp.path()).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
    assert_eq!(names, ["model"]);
}

#[test]
fn version_2_reads_as_version_3() {
    let tmp = tempfile::tempdir().unwrap();
    let mut bytes = std::fs::read(gguf("qwen2")).unwrap();
    bytes[4..8].copy_from_slice(&2u32.to_le_bytes());
    let v2 = tmp.path().join("v2.gguf");
    std::fs::write(&v2, &bytes).unwrap();
    let s = convert_gguf(&v2, &tmp.path().join("a")).unwrap();
    assert_eq!(s.gguf_version, 2);
    convert_gguf(&gguf("qwen2"), &tmp.path().join("b")).unwrap();
    let read = |d: &str| std::fs::read(tmp.path().join(d).join("model.safetensors")).unwrap();
    assert!(read("a") == read("b"));
}

#[test]
fn convert_command_writes_a_folder_and_never_overwrites() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("smol");
    let g = gguf("llama");
    let o = dualedit(&["convert", "--gguf", g.to_str().unwrap(), "--out", out.to_str().unwrap(), "--json"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let stdout = String::from_utf8(o.stdout).unwrap();
    let v: serde_json::Value = serde_json::from_str(stdout.trim()).unwrap();
    assert_eq!(v["architecture"], "LlamaForCausalLM");
    assert_eq!(v["tie_word_embeddings"], false);
    for f in ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"] {
        assert!(out.join(f).is_file(), "{f} missing");
    }
    let again = dualedit(&["convert", "--gguf", g.to_str().unwrap(), "--out", out.to_str().unwrap()]);
    assert_clean_error(&again, &["smol", "not empty"]);
    // The scored text through the CLI, as a user would.
    let o = dualedit(&["score", "--model", out.to_str().unwrap(), "--text", "The capital of France is Paris", "--json"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
}

/// Where the tensor-table entry of `name` starts its fields (just past the name).
fn entry(bytes: &[u8], name: &str) -> usize {
    let mut needle = (name.len() as u64).to_le_bytes().to_vec();
    needle.extend_from_slice(name.as_bytes());
    let at = bytes.windows(needle.len()).position(|w| w == needle).unwrap_or_else(|| panic!("{name} not in the header"));
    at + needle.len()
}

/// `(what, edit, needles)`: a broken copy of llama.gguf and what its one error must say.
type Case = (&'static str, Box<dyn Fn(&mut Vec<u8>)>, Vec<&'static str>);

fn hostile_cases() -> Vec<Case> {
    let put_u32 = |b: &mut Vec<u8>, at: usize, v: u32| b[at..at + 4].copy_from_slice(&v.to_le_bytes());
    let put_u64 = |b: &mut Vec<u8>, at: usize, v: u64| b[at..at + 8].copy_from_slice(&v.to_le_bytes());
    // blk.0.attn_q.weight: 2 dims, then the type (u32) and the data offset (u64).
    const Q: &str = "blk.0.attn_q.weight";
    vec![
        ("bad magic", Box::new(|b: &mut Vec<u8>| b[0..4].copy_from_slice(b"GGML")), vec!["not a GGUF file"]),
        ("empty", Box::new(|b: &mut Vec<u8>| b.truncate(2)), vec!["not a GGUF file"]),
        ("version 1", Box::new(move |b: &mut Vec<u8>| put_u32(b, 4, 1)), vec!["version 1"]),
        ("truncated header", Box::new(|b: &mut Vec<u8>| b.truncate(300)), vec!["truncated"]),
        ("truncated data", Box::new(|b: &mut Vec<u8>| b.truncate(b.len() - 100)), vec!["output.weight", "past the end"]),
        ("tensor count 2^40", Box::new(move |b: &mut Vec<u8>| put_u64(b, 8, 1 << 40)), vec!["1099511627776 tensors"]),
        ("metadata count 2^60", Box::new(move |b: &mut Vec<u8>| put_u64(b, 16, 1 << 60)), vec!["metadata entries"]),
        ("key length 2^62", Box::new(move |b: &mut Vec<u8>| put_u64(b, 24, 1 << 62)), vec!["string length 4611686018427387904"]),
        (
            "array count 2^50",
            Box::new(move |b: &mut Vec<u8>| {
                let at = entry(b, "tokenizer.ggml.tokens");
                put_u64(b, at + 8, 1 << 50)
            }),
            vec!["tokenizer.ggml.tokens", "array of 1125899906842624"],
        ),
        ("unknown tensor type", Box::new(move |b: &mut Vec<u8>| { let at = entry(b, Q); put_u32(b, at + 20, 99) }), vec![Q, "unknown tensor type 99"]),
        ("unsupported tensor type", Box::new(move |b: &mut Vec<u8>| { let at = entry(b, Q); put_u32(b, at + 20, 10) }), vec![Q, "Q2_K"]),
        ("5 dimensions", Box::new(move |b: &mut Vec<u8>| { let at = entry(b, Q); put_u32(b, at, 5) }), vec![Q, "5 dimensions"]),
        (
            "element count overflow",
            Box::new(move |b: &mut Vec<u8>| {
                let at = entry(b, Q);
                put_u64(b, at + 4, 1 << 40);
                put_u64(b, at + 12, 1 << 40)
            }),
            vec![Q, "more elements"],
        ),
        ("offset past the end", Box::new(move |b: &mut Vec<u8>| { let at = entry(b, Q); put_u64(b, at + 24, 1 << 50) }), vec![Q, "past the end"]),
        ("misaligned offset", Box::new(move |b: &mut Vec<u8>| { let at = entry(b, Q); put_u64(b, at + 24, 36) }), vec![Q, "alignment"]),
        ("overlapping tensors", Box::new(move |b: &mut Vec<u8>| { let at = entry(b, Q); put_u64(b, at + 24, 0) }), vec!["overlap"]),
        (
            "unknown architecture",
            Box::new(|b: &mut Vec<u8>| {
                let at = entry(b, "general.architecture");
                // type (u32 8), length (u64 5), "llama"
                b[at + 12..at + 17].copy_from_slice(b"llamb");
            }),
            vec!["\"llamb\" is not supported"],
        ),
    ]
}

#[test]
fn hostile_files_give_one_clear_error() {
    let tmp = tempfile::tempdir().unwrap();
    let original = std::fs::read(gguf("llama")).unwrap();
    for (i, (what, edit, needles)) in hostile_cases().into_iter().enumerate() {
        let mut bytes = original.clone();
        edit(&mut bytes);
        let path = tmp.path().join(format!("hostile-{i}.gguf"));
        std::fs::write(&path, &bytes).unwrap();
        let out = tmp.path().join(format!("out-{i}"));
        let err = match std::panic::catch_unwind(|| convert_gguf(&path, &out)) {
            Ok(Ok(_)) => panic!("{what}: converted"),
            Ok(Err(e)) => e.to_string(),
            Err(_) => panic!("{what}: panicked"),
        };
        assert!(err.contains(&format!("hostile-{i}.gguf")), "{what}: {err:?} does not name the file");
        for n in needles {
            assert!(err.contains(n), "{what}: {err:?} should mention {n:?}");
        }
        assert!(!out.exists(), "{what}: a folder was left");
    }
    // Nothing but the inputs: no temporary folder left behind.
    let left: Vec<String> = std::fs::read_dir(tmp.path()).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).filter(|n| !n.ends_with(".gguf")).collect();
    assert!(left.is_empty(), "left behind: {left:?}");
    // Through the CLI: one line on stderr.
    let o = dualedit(&["convert", "--gguf", tmp.path().join("hostile-9.gguf").to_str().unwrap(), "--out", tmp.path().join("x").to_str().unwrap()]);
    assert_clean_error(&o, &["hostile-9.gguf", "blk.0.attn_q.weight"]);
}
