//! A synthetic "knowledge world": invented countries, cities, people and companies, the
//! facts that tie them together, a pretraining corpus that states every fact, and
//! CounterFact-shaped edit records for training and evaluating a MEND editor.
//!
//! Why synthetic: the embedded default model must be tiny (a few hundred thousand
//! parameters) yet genuinely *know* the facts it is asked to edit. Real-world facts would
//! need a large model; invented ones can be memorised completely by a tiny one in minutes,
//! and because every name is made up the model cannot have learned them anywhere else.
//!
//! Everything is a pure function of [`WorldConfig`]: the module carries its own PRNG
//! (SplitMix64) instead of depending on an RNG crate, so a given seed yields byte-identical
//! files on every machine, platform and crate-version combination.
use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

use crate::{Error, Result};

// ---------------------------------------------------------------------------------------
// Configuration and public types
// ---------------------------------------------------------------------------------------

/// What world to generate.
///
/// `n_entities` counts the invented entities (countries, cities, people, companies); the
/// attribute words (languages, currencies, continents, professions, industries) come on
/// top. Values below [`MIN_ENTITIES`] are raised to it so every entity type and both edit
/// splits always have at least two subjects.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct WorldConfig {
    pub seed: u64,
    pub n_entities: usize,
    pub n_edit_train: usize,
    pub n_edit_holdout: usize,
}

impl Default for WorldConfig {
    /// 120 entities give 280 facts and 840 corpus sentences (about 30 K characters): small
    /// enough for a tiny model to memorise on a CPU in minutes. 200 + 50 edits fit in the
    /// 224 train-side + 56 held-out facts, so by default no fact is edited twice.
    fn default() -> Self {
        WorldConfig {
            seed: 7,
            n_entities: 120,
            n_edit_train: 200,
            n_edit_holdout: 50,
        }
    }
}

/// The smallest world generated: 2 countries, 2 cities, 4 people, 4 companies.
impl WorldConfig {
    /// The world the embedded default is built from (`build-default`, `dualedit world`).
    pub fn shipped() -> Self {
        Self { n_edit_train: 1000, ..Self::default() }
    }
}

/// What `dualedit world` reports of a text world it wrote.
#[derive(Debug, Clone, Serialize)]
pub struct WrittenTextWorld {
    pub dir: std::path::PathBuf,
    pub facts: usize,
    // Alphabetical, as `dualedit world` has always printed them.
    pub holdout_edits: usize,
    pub train_edits: usize,
}

/// Generates the world `cfg` describes and writes it into `dir`.
pub fn generate_and_write(dir: &Path, cfg: &WorldConfig) -> Result<WrittenTextWorld> {
    let world = World::generate(cfg);
    write_world(dir, &world)?;
    let (train, holdout) = world.edit_records();
    Ok(WrittenTextWorld { dir: dir.to_path_buf(), facts: world.facts.len(), train_edits: train.len(), holdout_edits: holdout.len() })
}

pub const MIN_ENTITIES: usize = 12;

/// One (subject, relation, object) triple. `relation` is one of the names in [`RELATIONS`].
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct Fact {
    pub subject: String,
    pub relation: String,
    pub object: String,
}

/// A relation: its name, and the phrasings of a prompt whose answer is the object.
///
/// Every template contains `{s}` once (the subject) and ends just before the object, so a
/// causal LM answers it by continuing the text. Template 0 is the canonical phrasing
/// (used for edit prompts); the others serve as rephrasings.
#[derive(Clone, Copy, Debug)]
pub struct Relation {
    pub name: &'static str,
    pub templates: &'static [&'static str],
}

/// All relations in the world, grouped by the kind of subject they describe.
pub const RELATIONS: &[Relation] = &[
    // Countries.
    Relation {
        name: "capital",
        templates: &[
            "The capital of {s} is",
            "{s}'s capital city is",
            "In {s}, the seat of government is",
        ],
    },
    Relation {
        name: "language",
        templates: &[
            "The official language of {s} is",
            "People in {s} speak",
            "The main language spoken in {s} is",
        ],
    },
    Relation {
        name: "currency",
        templates: &[
            "The currency of {s} is the",
            "In {s}, people pay with the",
            "The official money of {s} is the",
        ],
    },
    Relation {
        name: "continent",
        templates: &[
            "{s} is located on the continent of",
            "{s} is a country in",
            "The country {s} belongs to the continent of",
        ],
    },
    // People.
    Relation {
        name: "born_in",
        templates: &[
            "{s} was born in",
            "The birthplace of {s} is",
            "{s} came into the world in",
        ],
    },
    Relation {
        name: "profession",
        templates: &[
            "The profession of {s} is",
            "{s} works as a",
            "By trade, {s} is a",
        ],
    },
    // Companies.
    Relation {
        name: "founder",
        templates: &[
            "{s} was founded by",
            "The founder of {s} is",
            "The company {s} was started by",
        ],
    },
    Relation {
        name: "headquarters",
        templates: &[
            "The headquarters of {s} are in",
            "{s} is headquartered in",
            "The main office of {s} is located in",
        ],
    },
    Relation {
        name: "industry",
        templates: &[
            "The industry of {s} is",
            "{s} does business in",
            "{s} is known for its work in",
        ],
    },
];

/// The phrasings of `relation`, or `None` for a name not in [`RELATIONS`].
pub fn templates(relation: &str) -> Option<&'static [&'static str]> {
    RELATIONS
        .iter()
        .find(|r| r.name == relation)
        .map(|r| r.templates)
}

/// A generated world. All lists are in a deterministic order.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct World {
    /// The configuration as used (after raising `n_entities` to [`MIN_ENTITIES`]).
    pub config: WorldConfig,
    pub facts: Vec<Fact>,
    pub countries: Vec<String>,
    /// Every city is the capital of exactly one country; cities are never subjects.
    pub cities: Vec<String>,
    pub people: Vec<String>,
    pub companies: Vec<String>,
    /// For each relation, the values its object is drawn from (and `target_new` too).
    /// Every value is the true object of at least one fact, so the model has seen it.
    pub pools: BTreeMap<String, Vec<String>>,
    /// Subjects whose facts feed the train edits; disjoint from `holdout_subjects`.
    pub train_subjects: Vec<String>,
    pub holdout_subjects: Vec<String>,
}

// ---------------------------------------------------------------------------------------
// Deterministic PRNG
// ---------------------------------------------------------------------------------------

use crate::rng::SplitMix64;

// Stream ids: one per phase of generation.
const STREAM_NAMES: u64 = 1;
const STREAM_FACTS: u64 = 2;
const STREAM_SPLIT: u64 = 3;
const STREAM_CORPUS: u64 = 4;
const STREAM_EDITS: u64 = 5;

// ---------------------------------------------------------------------------------------
// Name generation
// ---------------------------------------------------------------------------------------

const ONSETS: &[&str] = &[
    "b", "d", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z", "th", "br", "dr", "kr",
    "tr", "st", "gr", "sh",
];
const VOWELS: &[&str] = &["a", "e", "i", "o", "u", "a", "e", "o"];
// Empty codas are listed twice so open syllables (easier to read) are more common.
const CODAS: &[&str] = &["", "", "", "n", "r", "l", "s", "k", "m"];

/// Type-flavoured endings: they make a name's kind guessable for a human reading the
/// corpus, and give the model a cue, while leaving every name a single word.
const COUNTRY_ENDS: &[&str] = &["ia", "ar", "and", "esh", "ora", "istan"];
const COMPANY_ENDS: &[&str] = &["tek", "corp", "ex", "on", "ica"];
const LANGUAGE_ENDS: &[&str] = &["ish", "ese", "ic", "an"];
const CURRENCY_ENDS: &[&str] = &["dral", "kor", "mark", "tal"];
const CONTINENT_ENDS: &[&str] = &["ea", "ica", "asia", "ora"];

/// Real words: professions and industries read naturally as ordinary vocabulary. All
/// professions start with a consonant so "works as a {object}" stays grammatical.
const PROFESSIONS: &[&str] = &[
    "painter", "chemist", "sailor", "poet", "banker", "farmer", "surgeon", "judge", "baker",
    "tailor", "potter", "merchant",
];
const INDUSTRIES: &[&str] = &[
    "shipping",
    "mining",
    "textiles",
    "software",
    "banking",
    "brewing",
    "publishing",
    "aviation",
    "farming",
    "insurance",
];

/// Hands out invented names, never the same one twice (across all kinds), so a name
/// always identifies one entity or value.
struct Namer {
    rng: SplitMix64,
    used: BTreeSet<String>,
}

impl Namer {
    fn syllable(&mut self) -> String {
        let mut s = String::new();
        s.push_str(self.rng.pick::<&str>(ONSETS));
        s.push_str(self.rng.pick::<&str>(VOWELS));
        s.push_str(self.rng.pick::<&str>(CODAS));
        s
    }

    /// A fresh capitalised name of `min_syl..=max_syl` syllables plus an optional ending.
    fn fresh(&mut self, min_syl: usize, max_syl: usize, ends: &[&str]) -> String {
        // The name space (thousands of names per syllable count) dwarfs what is asked
        // for, so collisions are rare; after many in a row, grow the name instead.
        let mut extra = 0;
        let mut tries = 0;
        loop {
            let n = min_syl + self.rng.below(max_syl - min_syl + 1) + extra;
            let mut name: String = (0..n).map(|_| self.syllable()).collect();
            if !ends.is_empty() {
                name.push_str(self.rng.pick::<&str>(ends));
            }
            let name = capitalise(&name);
            if self.used.insert(name.clone()) {
                return name;
            }
            tries += 1;
            if tries % 50 == 0 {
                extra += 1;
            }
        }
    }

    fn many(&mut self, n: usize, min_syl: usize, max_syl: usize, ends: &[&str]) -> Vec<String> {
        (0..n).map(|_| self.fresh(min_syl, max_syl, ends)).collect()
    }
}

fn capitalise(s: &str) -> String {
    let mut cs = s.chars();
    match cs.next() {
        Some(c) => c.to_uppercase().chain(cs).collect(),
        None => String::new(),
    }
}

/// `n` values that cover `pool` as evenly as possible (each used `n / len` or one more
/// times when `n >= len`), in random order. Covering the pool guarantees every value is
/// stated somewhere in the corpus, so a `target_new` is always a word the model knows.
fn spread(rng: &mut SplitMix64, pool: &[String], n: usize) -> Vec<String> {
    let mut order: Vec<usize> = (0..pool.len()).collect();
    rng.shuffle(&mut order);
    let mut out: Vec<String> = (0..n)
        .map(|i| pool[order[i % pool.len()]].clone())
        .collect();
    rng.shuffle(&mut out);
    out
}

fn words(ws: &[&str], n: usize) -> Vec<String> {
    ws.iter().take(n).map(|w| w.to_string()).collect()
}

// ---------------------------------------------------------------------------------------
// World generation
// ---------------------------------------------------------------------------------------

impl World {
    /// Build the world described by `cfg`. Deterministic: equal configs give equal worlds.
    pub fn generate(cfg: &WorldConfig) -> World {
        let n = cfg.n_entities.max(MIN_ENTITIES);
        let config = WorldConfig {
            n_entities: n,
            ..cfg.clone()
        };

        // Entity budget: a sixth countries, as many cities (their capitals), and the rest
        // split between people and companies, which carry most of the facts.
        let n_countries = n / 6;
        let n_cities = n_countries;
        let n_people = (n - n_countries - n_cities) / 2;
        let n_companies = n - n_countries - n_cities - n_people;

        let mut namer = Namer {
            rng: SplitMix64::new(cfg.seed, STREAM_NAMES),
            used: BTreeSet::new(),
        };
        let countries = namer.many(n_countries, 2, 2, COUNTRY_ENDS);
        let cities = namer.many(n_cities, 2, 3, &[]);
        let people = namer.many(n_people, 2, 3, &[]);
        let companies = namer.many(n_companies, 1, 2, COMPANY_ENDS);
        // Attribute pools are smaller than the subject sets they describe, so each value
        // is shared by several subjects and an edit to another value is plausible.
        let languages = namer.many((n_countries / 3).max(2), 1, 2, LANGUAGE_ENDS);
        let currencies = namer.many((n_countries / 3).max(2), 1, 2, CURRENCY_ENDS);
        let continents = namer.many((n_countries / 4).clamp(2, 5), 1, 2, CONTINENT_ENDS);
        let professions = words(PROFESSIONS, (n_people / 3).clamp(2, PROFESSIONS.len()));
        let industries = words(INDUSTRIES, (n_companies / 3).clamp(2, INDUSTRIES.len()));

        let mut pools = BTreeMap::new();
        pools.insert("capital".to_string(), cities.clone());
        pools.insert("language".to_string(), languages);
        pools.insert("currency".to_string(), currencies);
        pools.insert("continent".to_string(), continents);
        pools.insert("born_in".to_string(), cities.clone());
        pools.insert("profession".to_string(), professions);
        pools.insert("founder".to_string(), people.clone());
        pools.insert("headquarters".to_string(), cities.clone());
        pools.insert("industry".to_string(), industries);

        // Which relations describe which kind of subject.
        let kinds: [(&[String], &[&str]); 3] = [
            (
                &countries,
                &["capital", "language", "currency", "continent"],
            ),
            (&people, &["born_in", "profession"]),
            (&companies, &["founder", "headquarters", "industry"]),
        ];

        let mut rng = SplitMix64::new(cfg.seed, STREAM_FACTS);
        let mut facts = Vec::new();
        for (subjects, rels) in kinds {
            // One column of objects per relation, then facts subject by subject so a
            // subject's facts sit together in facts.json.
            let columns: Vec<Vec<String>> = rels
                .iter()
                .map(|r| {
                    if *r == "capital" {
                        // Capitals are a bijection: each city is the capital of one country.
                        let mut c = cities.clone();
                        rng.shuffle(&mut c);
                        c
                    } else {
                        spread(&mut rng, &pools[*r], subjects.len())
                    }
                })
                .collect();
            for (i, s) in subjects.iter().enumerate() {
                for (r, col) in rels.iter().zip(&columns) {
                    facts.push(Fact {
                        subject: s.clone(),
                        relation: r.to_string(),
                        object: col[i].clone(),
                    });
                }
            }
        }

        // Split subjects, per kind, in proportion to the requested edit counts, so both
        // splits cover every relation. Whole subjects go to one side: a held-out edit is
        // then about a subject the editor never saw during its training.
        let total = cfg.n_edit_train + cfg.n_edit_holdout;
        let mut rng = SplitMix64::new(cfg.seed, STREAM_SPLIT);
        let mut train_subjects = Vec::new();
        let mut holdout_subjects = Vec::new();
        for (subjects, _) in kinds {
            let len = subjects.len();
            let k = if cfg.n_edit_holdout == 0 {
                0
            } else if cfg.n_edit_train == 0 {
                len
            } else {
                // Rounded share, but leave at least one subject on each side.
                ((len * cfg.n_edit_holdout + total / 2) / total).clamp(1, len - 1)
            };
            let mut order = subjects.to_vec();
            rng.shuffle(&mut order);
            holdout_subjects.extend(order.drain(..k));
            train_subjects.extend(order);
        }
        train_subjects.sort();
        holdout_subjects.sort();

        World {
            config,
            facts,
            countries,
            cities,
            people,
            companies,
            pools,
            train_subjects,
            holdout_subjects,
        }
    }

    /// The prompt of `fact` in every phrasing, canonical first; empty for an unknown relation.
    pub fn prompts(&self, fact: &Fact) -> Vec<String> {
        templates(&fact.relation)
            .unwrap_or(&[])
            .iter()
            .map(|t| t.replace("{s}", &fact.subject))
            .collect()
    }

    /// Pretraining sentences: every fact in every phrasing, as "prompt object.".
    /// Shuffled (deterministically) so sequential reading does not see one subject's
    /// sentences in a block.
    pub fn corpus(&self) -> Vec<String> {
        let mut out: Vec<String> = self
            .facts
            .iter()
            .flat_map(|f| {
                self.prompts(f)
                    .into_iter()
                    .map(move |p| format!("{p} {}.", f.object))
            })
            .collect();
        SplitMix64::new(self.config.seed, STREAM_CORPUS).shuffle(&mut out);
        out
    }

    /// (train, held-out) edit records in the EasyEdit / CounterFact shape:
    /// `case_id` (unique across both lists), `prompt` (canonical phrasing), `subject`,
    /// `target_new` (another value of the relation's pool), `ground_truth`,
    /// `rephrase_prompt` (another phrasing of the same fact), `locality_prompt` and
    /// `locality_ground_truth` (a fact about another subject of the same split, with its
    /// true object).
    ///
    /// No subject of one list appears as `subject` or in a locality prompt of the other.
    /// A split with fewer facts than requested edits reuses facts, each time with a
    /// different `target_new` while the pool has unused values.
    pub fn edit_records(&self) -> (Vec<Value>, Vec<Value>) {
        let mut rng = SplitMix64::new(self.config.seed, STREAM_EDITS);
        let train = self.split_records(&mut rng, &self.train_subjects, self.config.n_edit_train, 0);
        let holdout = self.split_records(
            &mut rng,
            &self.holdout_subjects,
            self.config.n_edit_holdout,
            self.config.n_edit_train,
        );
        (train, holdout)
    }

    fn split_records(
        &self,
        rng: &mut SplitMix64,
        subjects: &[String],
        n: usize,
        first_id: usize,
    ) -> Vec<Value> {
        let in_split: BTreeSet<&str> = subjects.iter().map(String::as_str).collect();
        // A fact is editable only if its relation's pool offers some other value (always
        // true for a generated world, whose pools hold >= 2 values).
        let editable = |f: &Fact| {
            self.pools
                .get(&f.relation)
                .is_some_and(|p| p.iter().any(|v| *v != f.object))
        };
        let facts: Vec<&Fact> = self
            .facts
            .iter()
            .filter(|f| in_split.contains(f.subject.as_str()) && editable(f))
            .collect();
        if n == 0 || facts.is_empty() {
            return Vec::new();
        }
        let mut order: Vec<usize> = (0..facts.len()).collect();
        rng.shuffle(&mut order);
        // Targets already used per fact, so a reused fact gets a new target.
        let mut used: Vec<BTreeSet<&str>> = vec![BTreeSet::new(); facts.len()];

        let mut out = Vec::with_capacity(n);
        for k in 0..n {
            let i = order[k % order.len()];
            let fact = facts[i];
            let prompts = self.prompts(fact);
            let pool = self
                .pools
                .get(&fact.relation)
                .map(Vec::as_slice)
                .unwrap_or(&[]);

            let others: Vec<&str> = pool
                .iter()
                .map(String::as_str)
                .filter(|v| *v != fact.object)
                .collect();
            let fresh: Vec<&str> = others
                .iter()
                .copied()
                .filter(|v| !used[i].contains(v))
                .collect();
            let candidates = if fresh.is_empty() { &others } else { &fresh };
            // `facts` holds only editable facts, so `candidates` is never empty.
            let target_new = candidates[rng.below(candidates.len())];
            used[i].insert(target_new);

            let rephrase = &prompts[1 + rng.below(prompts.len() - 1)];

            // Locality like CounterFact's neighbourhood prompts: preferably another subject
            // with the same relation *and* the same true object (the fact most at risk of
            // being dragged along by the edit), else same relation, else anything.
            let other_subject = |f: &&&Fact| f.subject != fact.subject;
            let tiers: [Vec<&Fact>; 3] = [
                facts
                    .iter()
                    .filter(other_subject)
                    .filter(|f| f.relation == fact.relation && f.object == fact.object)
                    .copied()
                    .collect(),
                facts
                    .iter()
                    .filter(other_subject)
                    .filter(|f| f.relation == fact.relation)
                    .copied()
                    .collect(),
                facts.iter().filter(other_subject).copied().collect(),
            ];
            let loc = tiers.iter().find(|t| !t.is_empty()).map(|t| *rng.pick(t));
            let (loc_prompt, loc_truth) = match loc {
                Some(l) => {
                    let ps = self.prompts(l);
                    (rng.pick(&ps).clone(), l.object.clone())
                }
                // Unreachable with a generated world (each split has >= 3 subjects), but
                // an empty pair is safer than a panic for a hand-built one.
                None => (String::new(), String::new()),
            };

            out.push(json!({
                "case_id": first_id + k,
                "prompt": prompts[0],
                "subject": fact.subject,
                "target_new": target_new,
                "ground_truth": fact.object,
                "rephrase_prompt": rephrase,
                "locality_prompt": loc_prompt,
                "locality_ground_truth": loc_truth,
            }));
        }
        out
    }
}

// ---------------------------------------------------------------------------------------
// Writing
// ---------------------------------------------------------------------------------------

/// Write `corpus.txt` (one sentence per line), `facts.json`, `edits-train.json` and
/// `edits-holdout.json` (pretty JSON) into `dir`, creating it if needed. Each file is
/// written to a temporary file in `dir` and renamed into place, so a reader never sees a
/// half-written file and an interrupted run leaves the previous version intact.
pub fn write_world(dir: &Path, world: &World) -> Result<()> {
    std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;

    let mut corpus = world.corpus().join("\n");
    corpus.push('\n');
    crate::io::write_atomic(&dir.join("corpus.txt"), corpus.as_bytes())?;

    let (train, holdout) = world.edit_records();
    let facts = serde_json::to_value(&world.facts)
        .map_err(|e| Error::file(dir.join("facts.json"), e.to_string()))?;
    for (name, value) in [
        ("facts.json", facts),
        ("edits-train.json", Value::Array(train)),
        ("edits-holdout.json", Value::Array(holdout)),
    ] {
        let path = dir.join(name);
        let mut text =
            serde_json::to_string_pretty(&value).map_err(|e| Error::file(&path, e.to_string()))?;
        text.push('\n');
        crate::io::write_atomic(&path, text.as_bytes())?;
    }
    Ok(())
}

#[cfg(test)]
mod tests;
