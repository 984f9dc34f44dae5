//! The library API (`dualedit::session`): edit then generate returns the new target,
//! reset restores the original scores exactly, typed errors for bad input, and greedy
//! decoding with the KV cache equals recomputing the full prefix on every family.
mod common;

use std::path::Path;

use common::{fixture, records, trained_editor_session};
use dualedit::model::{load_model, ForwardInput, KvCache, ParamView};
use dualedit::session::{Session, SessionOptions};
use dualedit::Error;
use tch::{Device, Kind, Tensor};

#[test]
fn scratch() {
    let (mut s, _) = trained_editor_session();
    let recs = records();
    for r in &recs {
        let g = s.generate(&r.prompt, 4).unwrap();
        println!("before {:?} -> {:?}", r.prompt, g.text);
    }
    let out = s.edit(&recs[..1]).unwrap();
    println!("{}", serde_json::to_string_pretty(&out).unwrap());
    for r in &recs {
        let g = s.generate(&r.prompt, 4).unwrap();
        println!("after {:?} -> {:?}", r.prompt, g.text);
    }
}
