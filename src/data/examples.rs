//! EasyEdit records -> tokenised edit examples (inner / outer / locality), as EasyEdit
//! builds its MEND batches, with the target scored as the continuation of the prompt.
use std::path::Path;

use super::batch::{EditExample, Example};
use super::easyedit::EditRecord;
use crate::model::Tokenizer;
use crate::{Error, Result};

/// Tokenises every record, refusing any example longer than `max_len` tokens (the model's
/// context or the configured maximum) with the record's index and the file.
pub fn prepare(tok: &Tokenizer, records: &[EditRecord], max_len: usize, path: &Path) -> Result<Vec<EditExample>> {
    records
        .iter()
        .enumerate()
        .map(|(i, r)| {
            let fail = |e: Error| Error::file(path, format!("record {i}: {e}"));
            let check = |what: &str, e: Example| -> Result<Example> {
                if e.ids.len() > max_len {
                    return Err(fail(Error::input(format!(
                        "{what} is {} tokens, longer than the maximum of {max_len}",
                        e.ids.len()
                    ))));
                }
                Ok(e)
            };
            let inner = check("prompt + target", Example::new(tok, &r.prompt, &r.target_new).map_err(fail)?)?;
            let outer = match &r.rephrase {
                Some(rp) => check("rephrase + target", Example::new(tok, rp, &r.target_new).map_err(fail)?)?,
                None => inner.clone(),
            };
            let loc = match (&r.locality_prompt, &r.locality_ground_truth) {
                (Some(p), Some(a)) => Some(check("locality prompt + answer", Example::new(tok, p, a).map_err(fail)?)?),
                _ => None,
            };
            let portability = r
                .portability
                .iter()
                .map(|(p, a)| check("portability prompt + answer", Example::new(tok, p, a).map_err(fail)?))
                .collect::<Result<Vec<_>>>()?;
            Ok(EditExample { inner, outer, rephrased: r.rephrase.is_some(), loc, portability })
        })
        .collect()
}
