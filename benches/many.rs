//! Many edits on the embedded default (issue #36): the key-statistics pass over the
//! world's corpus (`dualedit stats`: 840 lines, about 9,500 tokens through the model,
//! `Σ k kᵀ` of the three edited output projections) and one 100-edit `mend-ls` batch
//! (`--method auto`'s several requests: capture, editor, least-squares solve against the
//! statistics, re-solve rounds), the guard off. CPU, one thread.
//!
//! `./x bench --bench many`; results in docs/notebook/many-edits.md ("Many edits by default").
use std::path::Path;

use criterion::{criterion_group, criterion_main, Criterion};
use dualedit::data::easyedit::{load_records, DatasetKind};
use dualedit::data::examples::prepare;
use dualedit::edit::session::Session;
use dualedit::edit::{LoadOptions, MethodSpec};
use dualedit::mend::stats::KeyStats;

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

fn bench(c: &mut Criterion) {
    tch::set_num_threads(1);
    let opts = LoadOptions::default();
    let many = root().join("data/editor-many");
    let names = dualedit::edit::editor_params(&many).expect("data/editor-many");
    let engine = dualedit::edit::open_engine(&root().join("data/model"), &opts, &names).expect("data/model");
    let corpus = root().join("data/world/corpus.txt");
    let mut g = c.benchmark_group("many");
    g.sample_size(10);
    g.bench_function("key statistics, world corpus", |b| b.iter(|| KeyStats::compute(&engine, &corpus, usize::MAX, false).expect("stats")));
    let spec = MethodSpec::Auto { editor: root().join("data/editor"), ls: Default::default(), unrelated: None, many: true };
    let mut session = Session::open_method(&root().join("data/model"), &spec, &opts).expect("session");
    let data = root().join("tests/fixtures/many/distinct-100.json");
    let (records, _) = load_records(&data, DatasetKind::Requests).expect("requests");
    let examples = prepare(&session.engine().lm.tokenizer, &records, 32, &data).expect("examples");
    g.bench_function("mend-ls, 100 edits in one batch (edit, measure, answers)", |b| {
        b.iter(|| {
            session.reset().expect("reset");
            session.edit_examples(&records, &examples, false).expect("edit")
        })
    });
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
