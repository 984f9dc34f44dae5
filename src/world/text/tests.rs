//! Unit tests of the text world (no libtorch).
use super::*;
use std::collections::HashSet;

fn s<'a>(v: &'a Value, k: &str) -> &'a str {
    v[k].as_str()
        .unwrap_or_else(|| panic!("missing string key {k} in {v}"))
}

#[test]
fn deterministic_per_seed() {
    let cfg = WorldConfig::default();
    let a = World::generate(&cfg);
    let b = World::generate(&cfg);
    assert_eq!(a, b);
    assert_eq!(a.corpus(), b.corpus());
    assert_eq!(a.edit_records(), b.edit_records());

    let c = World::generate(&WorldConfig {
        seed: cfg.seed + 1,
        ..cfg
    });
    assert_ne!(a.facts, c.facts);
    assert_ne!(a.corpus(), c.corpus());
    assert_ne!(a.edit_records(), c.edit_records());
}

/// Pins the generator's output for the default config, so an accidental change (which
/// would silently mismatch the embedded model trained on this world) fails loudly.
/// Update the expected values only together with retraining that model.
#[test]
fn stable_output() {
    let w = World::generate(&WorldConfig::default());
    assert_eq!(w.countries[..3], ["Lerzasand", "Dolnanesh", "Stisnoland"]);
    assert_eq!(
        w.facts[0],
        Fact {
            subject: "Lerzasand".into(),
            relation: "capital".into(),
            object: "Lakkodor".into()
        }
    );
    assert_eq!(w.corpus()[0], "Vikica does business in mining.");
    let (t, h) = w.edit_records();
    assert_eq!(
        s(&t[0], "prompt"),
        "The official language of Gremshonora is"
    );
    assert_eq!(s(&t[0], "target_new"), "Kroese");
    assert_eq!(
        s(&h[0], "prompt"),
        "Tedreand is located on the continent of"
    );
    assert_eq!(s(&h[0], "locality_prompt"), "Stonkresora is a country in");
    println!("train[0]: {:#}\nholdout[0]: {:#}", t[0], h[0]);
}

/// A hand-built world whose pool has a single value cannot be edited; it must yield
/// no records rather than panic.
#[test]
fn degenerate_pool_yields_no_records() {
    let mut w = World::generate(&WorldConfig {
        n_entities: 12,
        ..Default::default()
    });
    for pool in w.pools.values_mut() {
        pool.truncate(1);
    }
    for f in &mut w.facts {
        f.object = w.pools[&f.relation][0].clone();
    }
    let (t, h) = w.edit_records();
    assert!(t.is_empty() && h.is_empty());
}

#[test]
fn names_unique() {
    for seed in 0..20 {
        let w = World::generate(&WorldConfig {
            seed,
            n_entities: 600,
            ..Default::default()
        });
        let mut all: Vec<&String> = w
            .countries
            .iter()
            .chain(&w.cities)
            .chain(&w.people)
            .chain(&w.companies)
            .collect();
        assert_eq!(all.len(), 600);
        for r in [
            "language",
            "currency",
            "continent",
            "profession",
            "industry",
        ] {
            all.extend(&w.pools[r]);
        }
        let set: HashSet<&String> = all.iter().copied().collect();
        assert_eq!(set.len(), all.len(), "duplicate name for seed {seed}");
        for name in &all {
            assert!(
                !name.is_empty() && !name.contains(char::is_whitespace),
                "{name:?}"
            );
        }
    }
}

#[test]
fn structure() {
    let w = World::generate(&WorldConfig::default());
    assert!(RELATIONS.len() >= 6);
    for r in RELATIONS {
        assert!(r.templates.len() >= 3, "{}", r.name);
        for t in r.templates {
            assert_eq!(t.matches("{s}").count(), 1, "{t}");
            assert!(!t.ends_with(' ') && !t.ends_with('.'), "{t}");
        }
        // Every relation has facts, and every pool value is some fact's object.
        let objs: HashSet<&str> = w
            .facts
            .iter()
            .filter(|f| f.relation == r.name)
            .map(|f| f.object.as_str())
            .collect();
        assert!(!objs.is_empty(), "{}", r.name);
        for v in &w.pools[r.name] {
            assert!(objs.contains(v.as_str()), "{} value {v} never used", r.name);
        }
        assert!(w.pools[r.name].len() >= 2);
    }
    // One fact per (subject, relation).
    let keys: HashSet<(&str, &str)> = w
        .facts
        .iter()
        .map(|f| (f.subject.as_str(), f.relation.as_str()))
        .collect();
    assert_eq!(keys.len(), w.facts.len());
    // Capitals are a bijection onto cities.
    let caps: HashSet<&str> = w
        .facts
        .iter()
        .filter(|f| f.relation == "capital")
        .map(|f| f.object.as_str())
        .collect();
    assert_eq!(caps.len(), w.cities.len());
}

fn check_records(cfg: &WorldConfig) {
    let w = World::generate(cfg);
    let (train, holdout) = w.edit_records();
    assert_eq!(train.len(), cfg.n_edit_train);
    assert_eq!(holdout.len(), cfg.n_edit_holdout);

    let corpus: HashSet<String> = w.corpus().into_iter().collect();
    let text: HashSet<String> = corpus
        .iter()
        .flat_map(|l| {
            l.trim_end_matches('.')
                .split(' ')
                .map(str::to_string)
                .collect::<Vec<_>>()
        })
        .collect();
    let keys = [
        "case_id",
        "prompt",
        "subject",
        "target_new",
        "ground_truth",
        "rephrase_prompt",
        "locality_prompt",
        "locality_ground_truth",
    ];
    let mut ids = HashSet::new();
    let mut subj = [HashSet::new(), HashSet::new()];
    for (side, recs) in [&train, &holdout].into_iter().enumerate() {
        for r in recs {
            let obj = r.as_object().expect("record is an object");
            assert_eq!(obj.len(), keys.len());
            for k in keys {
                assert!(obj.contains_key(k), "missing {k}");
            }
            assert!(ids.insert(r["case_id"].as_u64().expect("case_id")));
            let (p, sub, tn, gt) = (
                s(r, "prompt"),
                s(r, "subject"),
                s(r, "target_new"),
                s(r, "ground_truth"),
            );
            let (rp, lp, lgt) = (
                s(r, "rephrase_prompt"),
                s(r, "locality_prompt"),
                s(r, "locality_ground_truth"),
            );
            assert_ne!(tn, gt);
            assert_ne!(rp, p);
            assert!(p.contains(sub) && rp.contains(sub));
            assert!(!lp.contains(sub), "locality prompt {lp:?} mentions {sub}");
            // Every prompt's true answer is stated verbatim in the corpus, and the
            // new target is a word the model has seen.
            for (q, a) in [(p, gt), (rp, gt), (lp, lgt)] {
                assert!(
                    corpus.contains(&format!("{q} {a}.")),
                    "{q} {a}. not in corpus"
                );
            }
            assert!(text.contains(tn), "{tn} never in corpus");
            subj[side].insert(sub.to_string());
            // Locality subject is from the same split.
            let loc_subject = w
                .facts
                .iter()
                .find(|f| w.prompts(f).iter().any(|q| q == lp))
                .map(|f| f.subject.clone())
                .expect("locality fact exists");
            assert_ne!(loc_subject, sub);
            let split = if side == 0 {
                &w.train_subjects
            } else {
                &w.holdout_subjects
            };
            assert!(split.contains(&loc_subject));
        }
    }
    assert!(subj[0].is_disjoint(&subj[1]));
    let ts: HashSet<&String> = w.train_subjects.iter().collect();
    assert!(w.holdout_subjects.iter().all(|h| !ts.contains(h)));
}

#[test]
fn edit_records_valid() {
    check_records(&WorldConfig::default());
    for seed in 0..10 {
        check_records(&WorldConfig {
            seed,
            ..Default::default()
        });
    }
    // More edits than facts: facts are reused, still all invariants hold.
    check_records(&WorldConfig {
        seed: 3,
        n_entities: 120,
        n_edit_train: 1000,
        n_edit_holdout: 300,
    });
    // Tiny and lopsided configs.
    check_records(&WorldConfig {
        seed: 1,
        n_entities: 0,
        n_edit_train: 5,
        n_edit_holdout: 5,
    });
    check_records(&WorldConfig {
        seed: 1,
        n_entities: 30,
        n_edit_train: 0,
        n_edit_holdout: 20,
    });
    check_records(&WorldConfig {
        seed: 1,
        n_entities: 30,
        n_edit_train: 20,
        n_edit_holdout: 0,
    });
    check_records(&WorldConfig {
        seed: 1,
        n_entities: 400,
        n_edit_train: 1500,
        n_edit_holdout: 500,
    });
}

#[test]
fn default_edits_do_not_repeat_facts() {
    let w = World::generate(&WorldConfig::default());
    let (train, holdout) = w.edit_records();
    for recs in [&train, &holdout] {
        let ps: HashSet<&str> = recs.iter().map(|r| s(r, "prompt")).collect();
        assert_eq!(ps.len(), recs.len());
    }
}

#[test]
fn corpus_covers_every_fact_in_every_phrasing() {
    let w = World::generate(&WorldConfig::default());
    let corpus: HashSet<String> = w.corpus().into_iter().collect();
    let mut n = 0;
    for f in &w.facts {
        let ps = w.prompts(f);
        assert!(ps.len() >= 3);
        for p in ps {
            assert!(corpus.contains(&format!("{p} {}.", f.object)));
            n += 1;
        }
    }
    assert_eq!(corpus.len(), n, "corpus has duplicate or extra sentences");
}

#[test]
fn sizes() {
    let cfg = WorldConfig::default();
    let w = World::generate(&cfg);
    let corpus = w.corpus();
    let chars: usize = corpus.iter().map(|l| l.chars().count() + 1).sum();
    let words: BTreeSet<&str> = corpus
        .iter()
        .flat_map(|l| l.split(|c: char| c.is_whitespace() || c == '.' || c == ','))
        .filter(|t| !t.is_empty())
        .collect();
    let max_len = corpus.iter().map(|l| l.len()).max().unwrap_or(0);
    println!(
        "config {cfg:?}\nentities: {} countries, {} cities, {} people, {} companies",
        w.countries.len(),
        w.cities.len(),
        w.people.len(),
        w.companies.len()
    );
    for (r, p) in &w.pools {
        println!("pool {r}: {} values", p.len());
    }
    println!(
        "facts {}, train subjects {}, held-out subjects {}",
        w.facts.len(),
        w.train_subjects.len(),
        w.holdout_subjects.len()
    );
    println!(
        "corpus: {} sentences, {chars} characters (with newlines), {} distinct words, longest line {max_len} chars",
        corpus.len(),
        words.len()
    );
    assert_eq!(corpus.len(), w.facts.len() * 3);
    assert!(chars < 60_000);
}

#[test]
fn writes_files_atomically() {
    let dir = std::env::temp_dir().join(format!("synthetic-world-test-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let w = World::generate(&WorldConfig::default());
    write_world(&dir, &w).expect("write");
    write_world(&dir, &w).expect("overwrite");
    let mut names: Vec<String> = std::fs::read_dir(&dir)
        .expect("read dir")
        .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    assert_eq!(
        names,
        [
            "corpus.txt",
            "edits-holdout.json",
            "edits-train.json",
            "facts.json"
        ]
    );
    let corpus = std::fs::read_to_string(dir.join("corpus.txt")).expect("corpus");
    assert_eq!(corpus.lines().count(), w.facts.len() * 3);
    let facts: Vec<Fact> =
        serde_json::from_str(&std::fs::read_to_string(dir.join("facts.json")).expect("facts"))
            .expect("facts parse");
    assert_eq!(facts, w.facts);
    let train: Vec<Value> = serde_json::from_str(
        &std::fs::read_to_string(dir.join("edits-train.json")).expect("train"),
    )
    .expect("train parse");
    assert_eq!(train, w.edit_records().0);
    let _ = std::fs::remove_dir_all(&dir);
}
