//! `dualedit edit` end to end on the embedded default (`data/model`, `data/editor`, its
//! held-out edits): a batch of edits and sequential edits change the answers they ask
//! for, `--save` writes a model that carries them and leaves the source alone, and a
//! session's reset puts back the exact scores of the unedited model.
use crate::common;

use std::path::{Path, PathBuf};

use dualedit::edit::session::{Session, SessionOptions};

/// The first `n` held-out records of the embedded default as a request file.
fn requests(dir: &Path, n: usize) -> PathBuf {
    let text = std::fs::read_to_string(common::shipped("world/edits-holdout.json")).unwrap();
    let all: Vec<serde_json::Value> = serde_json::from_str(&text).unwrap();
    let path = dir.join(format!("first-{n}.json"));
    std::fs::write(&path, serde_json::to_string(&all[..n]).unwrap()).unwrap();
    path
}

/// Runs `dualedit edit` on `model` with `extra` flags and returns its one JSON object.
fn edit(dir: &Path, model: &Path, requests: &Path, extra: &[&str]) -> serde_json::Value {
    let report = tempfile::NamedTempFile::new_in(dir).unwrap().into_temp_path().keep().unwrap();
    let out = common::edit_json(model, requests, &report, extra);
    assert!(out.status.success(), "edit {extra:?} failed: {}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("stdout is not one JSON object ({e}): {}", String::from_utf8_lossy(&out.stdout)))
}

fn answers(v: &serde_json::Value) -> Vec<(String, String)> {
    v["requests"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| (r["answer_after"].as_str().unwrap().trim().to_string(), r["target_new"].as_str().unwrap().trim().to_string()))
        .collect()
}

#[test]
fn batch_and_sequential_mend_edits_change_the_answers() {
    let dir = tempfile::tempdir().unwrap();
    let (model, editor) = (common::shipped("model"), common::shipped("editor"));
    let editor = editor.to_str().unwrap();
    let two = requests(dir.path(), 2);
    let unedited = edit(dir.path(), &model, &two, &["--method", "unedited"]);
    for (answer, target) in answers(&unedited) {
        assert!(!answer.starts_with(&target), "the unedited model already answers {target:?}");
    }

    let batch = edit(dir.path(), &model, &two, &["--method", "mend", "--editor", editor]);
    assert_eq!(batch["sequential"], false);
    let rel = batch["reliability"].as_f64().unwrap();
    assert!(rel > unedited["reliability"].as_f64().unwrap() + 0.3, "batch reliability {rel}");
    assert!(answers(&batch).iter().any(|(a, t)| a.starts_with(t.as_str())), "{:?}", answers(&batch));

    let save = dir.path().join("edited");
    let seq = edit(dir.path(), &model, &two, &["--method", "mend", "--editor", editor, "--sequential", "--save", save.to_str().unwrap()]);
    assert_eq!(seq["sequential"], true);
    for (answer, target) in answers(&seq) {
        assert!(answer.starts_with(&target), "after sequential edits the model answers {answer:?}, not {target:?}");
    }
    assert!(seq["reliability"].as_f64().unwrap() >= 0.9, "{seq}");
    assert!(seq["locality"].as_f64().unwrap() >= 0.9, "{seq}");

    // The saved model carries both edits; the shipped one is untouched.
    for (answer, target) in answers(&edit(dir.path(), &save, &two, &["--method", "unedited"])) {
        assert!(answer.starts_with(&target), "the saved model answers {answer:?}, not {target:?}");
    }
    let again = edit(dir.path(), &model, &two, &["--method", "unedited"]);
    assert_eq!(answers(&again), answers(&unedited), "the shipped model changed");
}

#[test]
fn reset_restores_the_unedited_scores_exactly() {
    let root = common::shipped("");
    let text = std::fs::read_to_string(root.join("world/edits-holdout.json")).unwrap();
    let (records, _) =
        dualedit::data::easyedit::parse_records(&text, Path::new("edits-holdout.json"), dualedit::data::DatasetKind::Requests).unwrap();
    let mut s = Session::open(&root.join("model"), Some(&root.join("editor")), &SessionOptions::default()).unwrap();
    let probe = format!("{} {}", records[0].prompt, records[0].target_new);
    let before = s.score(&probe).unwrap();
    let out = s.edit(&records[..3]).unwrap();
    assert_eq!(out.edits_total, 3);
    let edited = s.score(&probe).unwrap();
    assert!(edited.mean_nll < before.mean_nll - 0.1, "edit did not raise the target: {} -> {}", before.mean_nll, edited.mean_nll);
    assert_eq!(s.reset().unwrap(), s.engine().edit_params.len());
    assert_eq!(s.score(&probe).unwrap().logprobs, before.logprobs);
}

/// `edit` scores the locality prompts of a call in batches (one forward each was most of a
/// 100-request edit's wall time): each request's locality is still what its own prompt,
/// scored alone before and after the edit, gives. 100 requests, so that the batches of 64
/// have a second one.
#[test]
fn batched_locality_is_each_prompt_scored_alone() {
    use tch::{Kind, Tensor};
    let root = common::shipped("");
    let mut records = Vec::new();
    for file in [root.join("world/edits-holdout.json"), common::fixture("many/fresh-50.json")] {
        let text = std::fs::read_to_string(&file).unwrap();
        records.extend(dualedit::data::easyedit::parse_records(&text, &file, dualedit::data::DatasetKind::Requests).unwrap().0);
    }
    assert_eq!(records.len(), 100);
    let mut s = Session::open(&root.join("model"), Some(&root.join("editor")), &SessionOptions::default()).unwrap();
    // The guard as `edit` has it: without it the 100 edits leave no locality answer at all.
    s.guard = Some(dualedit::mend::guard::GuardConfig::default());
    let examples = dualedit::data::examples::prepare(&s.engine().lm.tokenizer, &records, 512, Path::new("requests.json")).unwrap();
    let top1 = |s: &Session, e: &dualedit::data::Example| -> Tensor {
        let batch = s.engine().collate(&[e]).unwrap();
        s.engine().base_logits(&batch).unwrap().argmax(-1, false)
    };
    let before: Vec<Tensor> = examples.iter().map(|e| top1(&s, e.loc.as_ref().unwrap())).collect();
    let out = s.edit(&records).unwrap();
    assert!(out.edits_total > 0, "nothing was committed: the test would compare unedited weights");
    let mut moved = 0;
    for (i, e) in examples.iter().enumerate() {
        let after = top1(&s, e.loc.as_ref().unwrap());
        let want = after.eq_tensor(&before[i]).to_kind(Kind::Double).mean(Kind::Double).double_value(&[]);
        moved += usize::from(want < 1.0);
        assert_eq!(out.requests[i].metrics.locality, Some(want), "request {i}");
    }
    assert!(moved > 0 && moved < examples.len(), "{moved} of the locality prompts moved: the comparison is of one kind of answer only");
}
