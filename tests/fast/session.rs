//! The library API (`dualedit::edit::session`): edit then generate returns the new target,
//! reset restores the original scores exactly, saved models and editors round-trip,
//! typed errors for bad input, and greedy decoding with the KV cache equals recomputing
//! the full prefix on every family.
use crate::common;

use std::collections::HashSet;
use std::path::Path;

use common::{fixture, records, trained_editor, trained_editor_session};
use dualedit::data::Example;
use dualedit::model::{load_model, ForwardInput, KvCache, LoadedModel, ParamView};
use dualedit::placed::generate::Finish;
use dualedit::edit::session::{Session, SessionOptions};
use dualedit::Error;
use tch::{Device, Kind, Tensor};

/// Token ids the target adds after the prompt (its continuation, as edits score it).
fn target_ids(s: &Session, prompt: &str, target: &str) -> Vec<i64> {
    Example::new(&s.engine().lm.tokenizer, prompt, target).unwrap().answer().to_vec()
}

#[test]
fn edit_then_generate_returns_the_new_target_and_reset_restores_scores_exactly() {
    let (mut s, _dir) = trained_editor_session();
    let recs = records();
    let texts = ["The capital of France is Rome", "The Eiffel Tower is located in Paris", "The capital of Italy is Paris"];
    let scores_before: Vec<_> = texts.iter().map(|t| s.score(t).unwrap()).collect();
    let gen_before = s.generate(&recs[0].prompt, 4).unwrap();
    let want = target_ids(&s, &recs[0].prompt, &recs[0].target_new);
    assert_ne!(gen_before.tokens[..want.len()], want[..], "the unedited model already answers the target");

    let out = s.edit(&recs[..1]).unwrap();
    let m = &out.requests[0].metrics;
    assert!(m.edit_success && m.reliability == 1.0, "{m:?}");
    assert!(m.nll_post < m.nll_pre - 1.0, "{m:?}");
    assert_eq!(out.requests[0].answer_after.trim(), recs[0].target_new);
    // The answer before is the unedited model's, as many tokens as the target has.
    let before_answer = s.engine().lm.tokenizer.decode(&gen_before.tokens[..want.len()]).unwrap();
    assert_eq!(out.requests[0].answer_before, before_answer);
    assert_ne!(out.requests[0].answer_before.trim(), recs[0].target_new);
    assert_eq!(s.edits_total(), 1);

    // The edit is in the weights: generation now starts with the new target.
    let g = s.generate(&recs[0].prompt, want.len()).unwrap();
    assert_eq!(g.tokens, want, "generated {:?}", g.text);
    assert_eq!(g.text.trim(), recs[0].target_new);
    let edited = s.score(texts[0]).unwrap();
    assert!(edited.logprobs.last().unwrap() > scores_before[0].logprobs.last().unwrap());

    // A second edit on top of the first (originals are kept from before the first).
    s.edit(&recs[1..2]).unwrap();
    assert_eq!(s.edits_total(), 2);

    let restored = s.reset().unwrap();
    assert_eq!(restored, s.engine().edit_params.len());
    assert_eq!(s.edits_total(), 0);
    for (t, before) in texts.iter().zip(&scores_before) {
        let after = s.score(t).unwrap();
        assert_eq!(after.tokens, before.tokens);
        // Exactly: the loaded tensors are back, so every bit of every log-probability is.
        assert_eq!(after.logprobs, before.logprobs, "{t}");
        assert_eq!(after.mean_nll.to_bits(), before.mean_nll.to_bits());
    }
    assert_eq!(s.generate(&recs[0].prompt, 4).unwrap(), gen_before);
    // Reset with nothing edited is a no-op.
    assert_eq!(s.reset().unwrap(), 0);
}

#[test]
fn open_from_disk_edit_save_and_reload() {
    let (_, editor_dir) = trained_editor_session();
    let mut s = Session::open(&fixture("gpt2"), Some(editor_dir.path()), &SessionOptions::default()).unwrap();
    assert!(s.has_editor());
    let recs = records();
    s.edit(&recs[..1]).unwrap();
    let edited = s.score("The capital of France is Rome").unwrap();
    let out = tempfile::tempdir().unwrap();
    s.save(out.path()).unwrap();
    // The saved directory is a model like any other, and carries the edit.
    let reloaded = Session::open(out.path(), None, &SessionOptions::default()).unwrap();
    assert!(!reloaded.has_editor());
    let again = reloaded.score("The capital of France is Rome").unwrap();
    assert_eq!(again.logprobs, edited.logprobs);
    let want = target_ids(&s, &recs[0].prompt, &recs[0].target_new);
    assert_eq!(reloaded.generate(&recs[0].prompt, want.len()).unwrap().tokens, want);

    let mem = s.memory().unwrap();
    assert_eq!(mem.len(), 1);
    assert_eq!((mem[0].role, mem[0].device.as_str()), ("main", "cpu"));
    assert!(mem[0].sample.process_wide && mem[0].sample.current_allocated_bytes > 0);
}

#[test]
fn bad_input_is_a_typed_error_and_leaves_the_session_intact() {
    let opts = SessionOptions::default();
    // Missing model directory.
    let err = Session::open(Path::new("/nonexistent/model"), None, &opts).unwrap_err();
    assert!(matches!(err, Error::File { .. }) && err.to_string().contains("/nonexistent/model"), "{err}");
    // Missing editor directory.
    let err = Session::open(&fixture("gpt2"), Some(Path::new("/nonexistent/editor")), &opts).unwrap_err();
    assert!(matches!(err, Error::File { .. }) && err.to_string().contains("editor"), "{err}");
    // An editor trained for another model.
    let (_, editor_dir) = trained_editor_session();
    let err = Session::open(&fixture("qwen2"), Some(editor_dir.path()), &opts).unwrap_err();
    assert!(matches!(err, Error::File { .. }) && err.to_string().contains("another model"), "{err}");
    // Unknown device / dtype.
    assert!(matches!(dualedit::device::DevicePlan::parse("tpu", None).unwrap_err(), Error::Device { .. }));
    assert!(matches!(dualedit::model::parse_dtype("f64").unwrap_err(), Error::Input(_)));

    let mut s = Session::open(&fixture("gpt2"), None, &opts).unwrap();
    let reference = s.score("The capital of France is Paris").unwrap();
    let err = s.edit(&records()[..1]).unwrap_err();
    assert!(matches!(err, Error::Input(_)) && err.to_string().contains("no editor"), "{err}");
    let long = "word ".repeat(200);
    let err = s.generate(&long, 3).unwrap_err();
    assert!(matches!(err, Error::Input(_)) && err.to_string().contains("longer than the model's context"), "{err}");
    let err = s.score(&long).unwrap_err();
    assert!(matches!(err, Error::Input(_)), "{err}");
    assert!(matches!(s.score("  ").unwrap_err(), Error::Input(_)));
    assert!(matches!(s.generate("", 3).unwrap_err(), Error::Input(_)));
    // A prompt that fits but whose continuation does not stops at the context.
    let tok = &s.engine().lm.tokenizer;
    let near = (1..).map(|n| "word ".repeat(n)).find(|p| tok.encode(p).unwrap().len() + 4 >= s.max_positions()).unwrap();
    let g = s.generate(&near, 1000).unwrap();
    assert_eq!(g.finish_reason, Finish::Context);
    assert_eq!(g.prompt_tokens + g.tokens.len(), s.max_positions());

    let (engine, editor) = trained_editor();
    let mut s2 = Session::from_parts(engine, Some(editor));
    assert!(matches!(s2.edit(&[]).unwrap_err(), Error::Input(_)));
    let mut over = records()[0].clone();
    over.prompt = long.clone();
    let err = s2.edit(&[over]).unwrap_err();
    assert!(matches!(err, Error::Input(_)) && err.to_string().contains("record 0"), "{err}");
    assert_eq!(s2.edits_total(), 0);
    // Nothing above changed the weights.
    assert_eq!(s.score("The capital of France is Paris").unwrap().logprobs, reference.logprobs);
}

/// Last-position logits of `ids` by a full forward (no cache).
fn full_last_logits(lm: &LoadedModel, ids: &[i64]) -> Tensor {
    let none = HashSet::new();
    let t = Tensor::from_slice(ids).unsqueeze(0);
    let out = lm.model.forward(&ParamView::frozen(&lm.params), &ForwardInput::new(&t, &none)).unwrap();
    out.logits.get(0).get(ids.len() as i64 - 1)
}

/// Greedy decoding with the cache and by full recomputation: same tokens, logits ≤ 1e-4.
fn cached_equals_full(name: &str) {
    let _g = tch::no_grad_guard();
    let lm = load_model(&fixture(name), Device::Cpu, Kind::Float).unwrap();
    let prompt = lm.tokenizer.encode("The capital of France is").unwrap();
    let steps = 24;
    let none = HashSet::new();
    let view = ParamView::frozen(&lm.params);

    let mut full = prompt.clone();
    let mut full_logits = Vec::new();
    for _ in 0..steps {
        let l = full_last_logits(&lm, &full);
        full.push(l.argmax(-1, false).int64_value(&[]));
        full_logits.push(l);
    }

    let mut cache = KvCache::new();
    let mut cached = prompt.clone();
    let mut feed = prompt.clone();
    let mut worst = 0f64;
    for reference in &full_logits {
        let t = Tensor::from_slice(&feed).unsqueeze(0);
        let out = lm.model.forward_cached(&view, &ForwardInput::new(&t, &none), &mut cache).unwrap();
        let l = out.logits.get(0).get(feed.len() as i64 - 1);
        worst = worst.max((&l - reference).abs().max().double_value(&[]));
        let next = l.argmax(-1, false).int64_value(&[]);
        cached.push(next);
        feed = vec![next];
    }
    assert_eq!(cached, full, "{name}: cached greedy tokens differ from full recomputation");
    assert!(worst < 1e-4, "{name}: cached logits differ by {worst}");
    assert_eq!(cache.len(), (prompt.len() + steps - 1) as i64);
    assert!(cache.nbytes() > 0);

    // Several new tokens after a cached prefix: each new query sees the whole prefix and
    // the new tokens before it (not SDPA's top-left causal triangle).
    let all = Tensor::from_slice(&full).unsqueeze(0);
    let reference = lm.model.forward(&view, &ForwardInput::new(&all, &none)).unwrap().logits;
    let mut cache = KvCache::new();
    let split = 5;
    let head = Tensor::from_slice(&full[..split]).unsqueeze(0);
    let tail = Tensor::from_slice(&full[split..]).unsqueeze(0);
    let a = lm.model.forward_cached(&view, &ForwardInput::new(&head, &none), &mut cache).unwrap().logits;
    let b = lm.model.forward_cached(&view, &ForwardInput::new(&tail, &none), &mut cache).unwrap().logits;
    let chunked = Tensor::cat(&[a, b], 1);
    let diff = (chunked - reference).abs().max().double_value(&[]);
    assert!(diff < 1e-4, "{name}: chunked cached forward differs by {diff}");
}

#[test]
fn kv_cache_greedy_equals_full_recompute_gpt2() {
    cached_equals_full("gpt2");
}

#[test]
fn kv_cache_greedy_equals_full_recompute_llama() {
    cached_equals_full("llama");
}

#[test]
fn kv_cache_greedy_equals_full_recompute_qwen2() {
    cached_equals_full("qwen2");
}

#[test]
fn session_generate_equals_full_recompute_greedy() {
    for name in ["gpt2", "llama", "qwen2"] {
        let s = Session::open(&fixture(name), None, &SessionOptions::default()).unwrap();
        let lm = &s.engine().lm;
        let eos: Vec<i64> = match &lm.config_json["eos_token_id"] {
            serde_json::Value::Number(n) => vec![n.as_i64().unwrap()],
            serde_json::Value::Array(a) => a.iter().filter_map(|v| v.as_i64()).collect(),
            _ => vec![],
        };
        for prompt in ["The capital of France is", "Once upon a time"] {
            let g = s.generate(prompt, 20).unwrap();
            let _g = tch::no_grad_guard();
            let mut ids = lm.tokenizer.encode(prompt).unwrap();
            let mut want = Vec::new();
            while want.len() < 20 {
                let next = full_last_logits(lm, &ids).argmax(-1, false).int64_value(&[]);
                ids.push(next);
                want.push(next);
                if eos.contains(&next) {
                    break;
                }
            }
            assert_eq!(g.tokens, want, "{name}: {prompt:?}");
            assert_eq!(g.finish_reason, if want.len() == 20 { Finish::Length } else { Finish::Eos });
            assert_eq!(g.text, lm.tokenizer.decode(&want).unwrap());
        }
    }
}

#[test]
fn kv_cache_refuses_padding_and_overflow_and_stays_consistent() {
    let _g = tch::no_grad_guard();
    let lm = load_model(&fixture("llama"), Device::Cpu, Kind::Float).unwrap();
    let view = ParamView::frozen(&lm.params);
    let none = HashSet::new();
    let mut cache = KvCache::new();
    let ids = Tensor::from_slice(&[5i64, 6, 7]).unsqueeze(0);
    let mask = Tensor::from_slice(&[1i64, 1, 0]).unsqueeze(0);
    let padded = ForwardInput { attention_mask: Some(&mask), ..ForwardInput::new(&ids, &none) };
    assert!(matches!(lm.model.forward_cached(&view, &padded, &mut cache).err(), Some(Error::Input(_))));
    lm.model.forward_cached(&view, &ForwardInput::new(&ids, &none), &mut cache).unwrap();
    assert_eq!(cache.len(), 3);
    let too_long = Tensor::ones([1, 62], (Kind::Int64, Device::Cpu));
    let err = lm.model.forward_cached(&view, &ForwardInput::new(&too_long, &none), &mut cache).err().unwrap();
    assert!(err.to_string().contains("context"), "{err}");
    assert_eq!(cache.len(), 3);
    // A batch size that does not match the cache fails inside the forward: the error is
    // typed and the cache is rolled back to what it held.
    let two = Tensor::ones([2, 1], (Kind::Int64, Device::Cpu));
    assert!(lm.model.forward_cached(&view, &ForwardInput::new(&two, &none), &mut cache).is_err());
    assert_eq!(cache.len(), 3);
    let one = Tensor::from_slice(&[8i64]).unsqueeze(0);
    let got = lm.model.forward_cached(&view, &ForwardInput::new(&one, &none), &mut cache).unwrap().logits;
    let full = full_last_logits(&lm, &[5, 6, 7, 8]);
    assert!((got.get(0).get(0) - full).abs().max().double_value(&[]) < 1e-4);
}

/// An edit call is all or nothing: a failure after a commit (here injected after the
/// first of two sequential commits, and after a batch's commit, before its answers)
/// puts back every weight the call changed, bit for bit, leaves `edits_total` and what
/// `reset` restores as they were, and the session edits normally afterwards.
#[test]
fn a_failed_edit_call_leaves_the_weights_as_before_it() {
    use dualedit::config::MendConfig;
    use dualedit::device::DevicePlan;
    use dualedit::mend::{Editor, Engine};
    let lm = load_model(&fixture("gpt2"), Device::Cpu, Kind::Float).unwrap();
    let engine = Engine::new(lm, DevicePlan::single(Device::Cpu), &[]).unwrap();
    let cfg = MendConfig { rank: 8, edit_lr: 1e-2, ..MendConfig::default() };
    let editor = Editor::new(&cfg, engine.edit_params.clone(), Device::Cpu, 0).unwrap();
    let mut s = Session::from_parts(engine, Some(editor));
    let recs = records();
    let ex = dualedit::data::examples::prepare(&s.engine().lm.tokenizer, &recs[..2], 64, Path::new("inline.json")).unwrap();
    let probe = "The capital of France is Rome";
    let weights = |s: &Session| -> Vec<Tensor> { s.engine().edit_names().iter().map(|n| s.engine().weight(n).unwrap().copy()).collect() };
    let same = |a: &[Tensor], b: &[Tensor]| a.iter().zip(b).all(|(x, y)| x.equal(y));
    let loaded = (s.score(probe).unwrap().logprobs, weights(&s));

    // A first, successful edit: what a later failure must return to.
    s.edit_examples(&recs[..1], &ex[..1], false).unwrap();
    let first = (s.score(probe).unwrap().logprobs, weights(&s));
    assert_ne!(first.0, loaded.0, "the edit changed nothing");

    for sequential in [true, false] {
        s.inject_fault_after_commits(Some(1));
        let err = s.edit_examples(&recs[..2], &ex, sequential).unwrap_err().to_string();
        assert!(err.contains("injected fault after commit 1"), "{err}");
        assert_eq!(s.edits_total(), 1, "sequential {sequential}");
        assert!(same(&weights(&s), &first.1), "sequential {sequential}: weights differ from before the call");
        assert_eq!(s.score(probe).unwrap().logprobs, first.0);
    }
    // Without the fault the same call commits both requests.
    s.inject_fault_after_commits(None);
    let out = s.edit_examples(&recs[..2], &ex, true).unwrap();
    assert_eq!(out.edits_total, 3);
    assert!(!same(&weights(&s), &first.1));
    // reset still puts back the weights as loaded.
    s.reset().unwrap();
    assert!(same(&weights(&s), &loaded.1));
    assert_eq!(s.score(probe).unwrap().logprobs, loaded.0);

    // A failure on a fresh session: reset then has nothing to restore.
    s.inject_fault_after_commits(Some(1));
    assert!(s.edit_examples(&recs[..1], &ex[..1], false).is_err());
    assert!(same(&weights(&s), &loaded.1));
    assert_eq!(s.reset().unwrap(), 0, "a failed call leaves nothing for reset");
}
