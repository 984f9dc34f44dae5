//! Edits of one call that cannot all be judged as independent (issue #47 item 4).
//!
//! Two kinds, found from the requests' text alone before anything is edited:
//!
//! * **locality probe of an edited subject**: request `i`'s locality prompt names the
//!   subject of a request `j` of the same call ("Lanciano is located in the country of"
//!   while Lanciano itself is edited). The edit of `j` is meant to change that answer, so
//!   its change is not a locality failure: the commit guard leaves such probes out of its
//!   verdict, and the result reports them.
//! * **contradiction**: two requests with the same prompt and different new targets
//!   (CounterFact's validation file has "Istanbul is a twin city of" → Istanbul and →
//!   London among its first 1,000 records). One batch cannot make both; in a row the later
//!   one overwrites the earlier.
//!
//! A subject is found in a prompt as a whole word sequence: the characters on either side
//! of the match are not letters or digits, so "Paris" is not found in "Parisian".
use std::path::Path;

use serde::Serialize;

use crate::data::easyedit::EditRecord;

/// One conflict between requests of an edit call (indices into the call's requests).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Conflict {
    /// Request `request`'s locality prompt names `subject`, which request `edited_by` edits.
    LocalityOfEditedSubject { request: usize, edited_by: usize, subject: String },
    /// Requests `first` and `second` edit the same prompt to different targets.
    Contradiction { first: usize, second: usize, prompt: String },
}

/// Every conflict among `records`, in request order: for each request, the first request
/// whose subject its locality prompt names (itself included: a locality prompt about the
/// edited subject is no locality probe), then each later request that contradicts it.
/// `images[i]`: the picture request `i` is asked about (E-VQA), if any; the same question
/// about two pictures is no contradiction. Missing entries are no picture.
pub fn find(records: &[EditRecord], images: &[Option<&Path>]) -> Vec<Conflict> {
    let image = |i: usize| images.get(i).copied().flatten();
    let subjects: Vec<Option<&str>> =
        records.iter().map(|r| r.subject.as_deref().map(str::trim).filter(|s| !s.is_empty())).collect();
    let mut out = Vec::new();
    for (i, r) in records.iter().enumerate() {
        if let Some(probe) = r.locality_prompt.as_deref() {
            let hit = subjects.iter().enumerate().find_map(|(j, s)| s.filter(|s| names(probe, s)).map(|s| (j, s)));
            if let Some((j, s)) = hit {
                out.push(Conflict::LocalityOfEditedSubject { request: i, edited_by: j, subject: s.to_string() });
            }
        }
        for (j, later) in records.iter().enumerate().skip(i + 1) {
            if later.prompt.trim() == r.prompt.trim() && image(j) == image(i) && later.target_new.trim() != r.target_new.trim() {
                out.push(Conflict::Contradiction { first: i, second: j, prompt: r.prompt.trim().to_string() });
            }
        }
    }
    out
}

/// Per request: whether its locality probe names an edited subject (so the guard leaves it out).
pub fn probe_excluded(conflicts: &[Conflict], n: usize) -> Vec<bool> {
    let mut out = vec![false; n];
    for c in conflicts {
        if let Conflict::LocalityOfEditedSubject { request, .. } = c {
            if let Some(x) = out.get_mut(*request) {
                *x = true;
            }
        }
    }
    out
}

/// One line for the log: how many of each kind, with the first example of each.
pub fn describe(conflicts: &[Conflict], records: &[EditRecord]) -> Option<String> {
    let probes: Vec<&Conflict> = conflicts.iter().filter(|c| matches!(c, Conflict::LocalityOfEditedSubject { .. })).collect();
    let contra: Vec<&Conflict> = conflicts.iter().filter(|c| matches!(c, Conflict::Contradiction { .. })).collect();
    let mut parts = Vec::new();
    if let Some(Conflict::LocalityOfEditedSubject { request, edited_by, subject }) = probes.first() {
        let prompt = records.get(*request).and_then(|r| r.locality_prompt.as_deref()).unwrap_or("");
        parts.push(format!(
            "{} locality prompt(s) name a subject edited in the same call, left out of the guard's verdict (e.g. request {request}'s {prompt:?} names {subject:?}, edited by request {edited_by})",
            probes.len()
        ));
    }
    if let Some(Conflict::Contradiction { first, second, prompt }) = contra.first() {
        parts.push(format!(
            "{} pair(s) of requests edit the same prompt to different targets, which one batch cannot both make (e.g. requests {first} and {second}: {prompt:?})",
            contra.len()
        ));
    }
    (!parts.is_empty()).then(|| parts.join("; "))
}

/// Whether `text` contains `word` with no letter or digit right before or after it.
fn names(text: &str, word: &str) -> bool {
    let alnum = |c: Option<char>| c.is_some_and(char::is_alphanumeric);
    text.match_indices(word).any(|(at, _)| {
        let before = text[..at].chars().next_back();
        let after = text[at + word.len()..].chars().next();
        !alnum(before) && !alnum(after)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(prompt: &str, subject: &str, target: &str, loc: &str) -> EditRecord {
        EditRecord {
            prompt: prompt.into(),
            target_new: target.into(),
            subject: Some(subject.into()),
            ground_truth: None,
            rephrase: None,
            locality_prompt: Some(loc.into()),
            locality_ground_truth: Some("x".into()),
            portability: vec![],
        }
    }

    #[test]
    fn word_bounded_subjects() {
        assert!(names("Lanciano is located in", "Lanciano"));
        assert!(names("In Paris, they", "Paris"));
        assert!(!names("A Parisian café is in", "Paris"));
        assert!(!names("XParis", "Paris"));
        assert!(names("Théâtre de Paris", "Paris"));
    }

    #[test]
    fn finds_probes_of_edited_subjects_and_contradictions() {
        let rs = vec![
            rec("Gazzola is located in", "Gazzola", "Liberia", "Lanciano is located in"),
            rec("Lanciano, located in", "Lanciano", "France", "Rome is the capital of"),
            rec("Gazzola is located in", "Gazzola", "Peru", "Milan is in"),
            rec("Gazzola is located in", "Gazzola", "Liberia", "Milan is in"),
        ];
        let c = find(&rs, &[]);
        assert_eq!(
            c,
            vec![
                Conflict::LocalityOfEditedSubject { request: 0, edited_by: 1, subject: "Lanciano".into() },
                Conflict::Contradiction { first: 0, second: 2, prompt: "Gazzola is located in".into() },
                Conflict::Contradiction { first: 2, second: 3, prompt: "Gazzola is located in".into() },
            ]
        );
        assert_eq!(probe_excluded(&c, 4), vec![true, false, false, false]);
        let line = describe(&c, &rs).unwrap();
        assert!(line.contains("1 locality prompt(s)") && line.contains("2 pair(s)"), "{line}");
        assert!(describe(&[], &rs).is_none());
        // The same question about two pictures is two edits, not a contradiction.
        let (a, b) = (Path::new("a.png"), Path::new("b.png"));
        let images = [Some(a), Some(b), Some(b), None];
        let c = find(&rs, &images);
        assert_eq!(c.iter().filter(|c| matches!(c, Conflict::Contradiction { .. })).count(), 0, "{c:?}");
        let images = [Some(a), None, Some(a), None];
        assert_eq!(find(&rs, &images)[1], Conflict::Contradiction { first: 0, second: 2, prompt: "Gazzola is located in".into() });
    }
}
