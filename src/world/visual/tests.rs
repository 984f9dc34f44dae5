//! Unit tests of the visual world (no libtorch).
use super::*;
use std::collections::HashSet;

fn small() -> VisualWorldConfig {
    VisualWorldConfig { n_train_scenes: 10, n_holdout_scenes: 4, ..Default::default() }
}

fn s<'a>(v: &'a Value, k: &str) -> &'a str {
    v[k].as_str().unwrap_or_else(|| panic!("missing string key {k} in {v}"))
}

fn scene_of<'a>(w: &'a VisualWorld, path: &str, render: Render) -> &'a Scene {
    let id: usize = path
        .strip_prefix(&format!("{}/scene-", render.folder()))
        .and_then(|p| p.strip_suffix(".png"))
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("{path} is not a {render:?} image path"));
    &w.scenes[id]
}

/// The answer to a question, read off the scene description independently of
/// `Scene::questions`: the question's kind and subject are parsed back from its text.
/// Exactly one (kind, template) must read the question with a subject of its kind.
fn derive<'a>(scene: &'a Scene, question: &str) -> (QuestionKind, String) {
    let mut found = Vec::new();
    for kind in QuestionKind::ALL {
        for t in kind.templates() {
            let (pre, post) = t.split_once("{x}").expect("template has {x}");
            let Some(x) = question.strip_prefix(pre).and_then(|q| q.strip_suffix(post)) else { continue };
            if !kind.subjects().contains(&x) {
                continue;
            }
            let hits: Vec<&'a Object> = scene
                .objects
                .iter()
                .filter(|o| match kind {
                    QuestionKind::Colour => o.shape.name() == x,
                    QuestionKind::Shape => o.colour.name() == x,
                    QuestionKind::PlaceColour | QuestionKind::PlaceShape => o.position.phrase() == x,
                })
                .collect();
            assert_eq!(hits.len(), 1, "{question:?} is ambiguous or unanswerable in scene {}", scene.id);
            let answer = match kind {
                QuestionKind::Colour | QuestionKind::PlaceColour => hits[0].colour.name(),
                QuestionKind::Shape | QuestionKind::PlaceShape => hits[0].shape.name(),
            };
            found.push((kind, answer.to_string()));
        }
    }
    assert_eq!(found.len(), 1, "{question:?} reads as {found:?}");
    found.remove(0)
}

#[test]
fn deterministic_per_seed() {
    let cfg = VisualWorldConfig::default();
    let a = VisualWorld::generate(&cfg).unwrap();
    assert_eq!(a, VisualWorld::generate(&cfg).unwrap());
    assert_eq!(a.records(), a.records());
    let b = VisualWorld::generate(&VisualWorldConfig { seed: cfg.seed + 1, ..cfg }).unwrap();
    assert_ne!(a.scenes, b.scenes);
    assert_ne!(a.records(), b.records());

    // Same bytes in every file, twice.
    let dirs = [tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap()];
    let w = VisualWorld::generate(&small()).unwrap();
    for d in &dirs {
        write_visual_world(&d.path().join("w"), &w).unwrap();
    }
    let files = |root: &Path| -> BTreeMap<String, Vec<u8>> {
        let mut out = BTreeMap::new();
        for sub in ["", "images", "images_rephrase"] {
            for e in std::fs::read_dir(root.join(sub)).unwrap() {
                let p = e.unwrap().path();
                if p.is_file() {
                    out.insert(p.strip_prefix(root).unwrap().display().to_string(), std::fs::read(&p).unwrap());
                }
            }
        }
        out
    };
    let (x, y) = (files(&dirs[0].path().join("w")), files(&dirs[1].path().join("w")));
    assert_eq!(x.len(), 4 + 2 * 14, "{:?}", x.keys());
    assert!(x == y, "two builds of one seed differ");
}

/// Pins the default world, which the embedded VL model is pretrained on: a change here
/// must go together with rebuilding that model.
#[test]
fn stable_output() {
    let w = VisualWorld::generate(&VisualWorldConfig::default()).unwrap();
    let (t, h) = w.records();
    println!("scene 0: {}\ntrain[0]: {:#}\nholdout[0]: {:#}", serde_json::to_string(&w.scenes[0]).unwrap(), t[0], h[0]);
    println!("train {} records, held-out {}, pretrain triples {}", t.len(), h.len(), w.pretrain_corpus().vqa.len());
    let q: Vec<(String, String)> = w.scenes[0].questions().into_iter().map(|q| (q.phrasings[0].clone(), q.answer)).collect();
    assert_eq!(q, PINNED_SCENE_0.iter().map(|(a, b)| (a.to_string(), b.to_string())).collect::<Vec<_>>());
    assert_eq!((s(&t[0], "src"), s(&t[0], "pred"), s(&t[0], "alt")), PINNED_TRAIN_0);
    assert_eq!((t.len(), h.len(), w.pretrain_corpus().vqa.len()), PINNED_COUNTS);
}
const PINNED_SCENE_0: &[(&str, &str)] = &[
    ("What colour is the object at the bottom?", "purple"),
    ("Which shape is at the bottom?", "dot"),
    ("What colour is the object at the top?", "green"),
    ("Which shape is at the top?", "square"),
    ("What colour is the object in the centre?", "blue"),
    ("Which shape is in the centre?", "dot"),
    ("What colour is the object on the left?", "blue"),
    ("Which shape is on the left?", "bar"),
    ("What colour is the square?", "green"),
    ("What colour is the bar?", "blue"),
    ("Which shape is green?", "square"),
    ("Which shape is purple?", "dot"),
];
const PINNED_TRAIN_0: (&str, &str, &str) = ("Which shape is in the centre?", "pillar", "cross");
const PINNED_COUNTS: (usize, usize, usize) = (2011, 505, 10064);

fn check_records(cfg: &VisualWorldConfig) {
    let w = VisualWorld::generate(cfg).unwrap();
    let (train, holdout) = w.records();
    let keys: BTreeSet<&str> =
        ["src", "pred", "alt", "rephrase", "image", "image_rephrase", "loc", "loc_ans", "m_loc", "m_loc_q", "m_loc_a"].into();
    let pools = w.answer_pools();
    let mut pairs = [HashSet::new(), HashSet::new()];
    let mut scenes = [HashSet::new(), HashSet::new()];
    for (side, recs) in [&train, &holdout].into_iter().enumerate() {
        let split = if side == 0 { w.train_scenes() } else { w.holdout_scenes() };
        let questions: usize = split.iter().map(|sc| sc.questions().len()).sum();
        assert_eq!(recs.len(), questions, "one record per question of the split");
        for r in recs {
            let obj = r.as_object().expect("record is an object");
            assert_eq!(obj.keys().map(String::as_str).collect::<BTreeSet<_>>(), keys);
            for k in &keys {
                assert!(!s(r, k).is_empty(), "empty {k} in {r}");
            }
            let scene = scene_of(&w, s(r, "image"), Render::Original);
            assert_eq!(scene_of(&w, s(r, "image_rephrase"), Render::Rephrase).id, scene.id);
            assert!(split.iter().any(|sc| sc.id == scene.id), "record of scene {} in the wrong split", scene.id);
            let (kind, truth) = derive(scene, s(r, "src"));
            assert_eq!(s(r, "pred"), truth, "{r}");
            assert_eq!(derive(scene, s(r, "rephrase")), (kind, truth.clone()));
            assert_ne!(s(r, "rephrase"), s(r, "src"));
            assert_ne!(s(r, "alt"), s(r, "pred"));
            assert!(kind.vocabulary().contains(&s(r, "alt")), "alt {} is no {kind:?} answer", s(r, "alt"));
            assert!(pools[&kind].iter().any(|a| a == s(r, "alt")), "alt {} is never a true answer", s(r, "alt"));
            assert!(NQ_FACTS.contains(&(s(r, "loc"), s(r, "loc_ans"))));
            let other = scene_of(&w, s(r, "m_loc"), Render::Original);
            assert_ne!(other.id, scene.id);
            assert!(split.iter().any(|sc| sc.id == other.id), "image locality from the other split");
            assert_eq!(derive(other, s(r, "m_loc_q")).1, s(r, "m_loc_a"));
            assert!(pairs[side].insert((scene.id, s(r, "src").to_string())), "repeated (scene, question) {r}");
            scenes[side].insert(scene.id);
        }
    }
    assert!(pairs[0].is_disjoint(&pairs[1]));
    assert!(scenes[0].is_disjoint(&scenes[1]));
    assert_eq!((scenes[0].len(), scenes[1].len()), (cfg.n_train_scenes, cfg.n_holdout_scenes));
}

#[test]
fn records_valid_complete_and_split() {
    check_records(&VisualWorldConfig::default());
    for seed in 0..5 {
        check_records(&VisualWorldConfig { seed, ..small() });
    }
    check_records(&VisualWorldConfig { min_objects: 5, max_objects: 5, ..small() });
    check_records(&VisualWorldConfig { n_holdout_scenes: 0, ..small() });
    check_records(&VisualWorldConfig { n_train_scenes: 0, n_holdout_scenes: 2, ..small() });
}

#[test]
fn questions_cover_every_kind_and_are_unambiguous() {
    let w = VisualWorld::generate(&VisualWorldConfig::default()).unwrap();
    let mut kinds = BTreeMap::new();
    for scene in &w.scenes {
        let qs = scene.questions();
        assert!(!qs.is_empty());
        let texts: HashSet<&str> = qs.iter().flat_map(|q| q.phrasings.iter().map(String::as_str)).collect();
        assert_eq!(texts.len(), 2 * qs.len(), "a phrasing repeats in scene {}", scene.id);
        for q in &qs {
            assert_eq!(q.phrasings.len(), 2);
            for p in &q.phrasings {
                assert_eq!(derive(scene, p), (q.kind, q.answer.clone()));
            }
            *kinds.entry(q.kind).or_insert(0) += 1;
        }
    }
    println!("questions per kind: {kinds:?}");
    assert_eq!(kinds.len(), 4);
    let pools = w.answer_pools();
    for (kind, pool) in &pools {
        assert_eq!(pool.len(), kind.vocabulary().len(), "{kind:?}: every answer occurs: {pool:?}");
    }
}

#[test]
fn rephrase_images_differ_but_show_the_same_objects() {
    for cfg in [VisualWorldConfig::default(), VisualWorldConfig { width: 140, height: 84, ..small() }] {
        let w = VisualWorld::generate(&cfg).unwrap();
        let (width, height) = (cfg.width, cfg.height);
        for scene in &w.scenes {
            assert_ne!(scene.original.background, scene.rephrase.background);
            let imgs = [Render::Original, Render::Rephrase].map(|r| (r, scene.render(r, width, height)));
            assert_ne!(imgs[0].1, imgs[1].1);
            let mut areas = [Vec::new(), Vec::new()];
            for (k, (render, img)) in imgs.iter().enumerate() {
                assert_eq!(img.dimensions(), (width, height));
                // The corner cell is never a place: the background shows there.
                assert_eq!(img.get_pixel(0, 0).0, scene.view(*render).background.rgb());
                for (i, o) in scene.objects.iter().enumerate() {
                    let (col, row) = o.position.cell(width / GRID, height / GRID);
                    let (x0, y0) = (col * GRID, row * GRID);
                    let (cx, cy, r) = scene.placement(i, *render, width, height);
                    assert_eq!((cx, cy), ((x0 + GRID / 2) as f64, (y0 + GRID / 2) as f64), "centred in its cell");
                    // Every pixel of its colour in its cell; the cell's border is background.
                    let in_cell = |x: u32, y: u32| (x0..x0 + GRID).contains(&x) && (y0..y0 + GRID).contains(&y);
                    let edge = (0..GRID).flat_map(|t| [(x0 + t, y0), (x0 + t, y0 + GRID - 1), (x0, y0 + t), (x0 + GRID - 1, y0 + t)]);
                    for (x, y) in edge {
                        assert_eq!(img.get_pixel(x, y).0, scene.view(*render).background.rgb(), "scene {} object {i} touches its cell's edge", scene.id);
                    }
                    assert_eq!(img.get_pixel(cx as u32, cy as u32).0, o.colour.rgb(), "scene {} {render:?} object {i}", scene.id);
                    let area = (0..height)
                        .flat_map(|y| (0..width).map(move |x| (x, y)))
                        .filter(|&(x, y)| in_cell(x, y) && img.get_pixel(x, y).0 == o.colour.rgb())
                        .count();
                    assert!(area as f64 > 0.5 * r * r, "scene {} object {i}: {area} pixels for radius {r}", scene.id);
                    areas[k].push(area as f64);
                }
                // No pixel of a colour that no object wears, nor of a third one.
                let allowed: HashSet<[u8; 3]> =
                    scene.objects.iter().map(|o| o.colour.rgb()).chain([scene.view(*render).background.rgb()]).collect();
                assert!(img.pixels().all(|p| allowed.contains(&p.0)));
            }
            for (a, b) in areas[0].iter().zip(&areas[1]) {
                let ratio = b / a;
                let s2 = scene.rephrase.scale * scene.rephrase.scale;
                // Smaller, but not vanishing (a thin band's width is rounded to pixels,
                // so its area shrinks by less than scale²).
                assert!(ratio < 1.0 && ratio > s2 - 0.25, "scene {}: area {a} -> {b}, scale² {s2}", scene.id);
            }
        }
    }
}

#[test]
fn sizes_on_the_28_grid() {
    for (w, h) in [(84, 140), (140, 140), (420, 84)] {
        let cfg = VisualWorldConfig { width: w, height: h, ..small() };
        let world = VisualWorld::generate(&cfg).unwrap();
        assert_eq!(world.scenes[0].render(Render::Rephrase, w, h).dimensions(), (w, h));
    }
    let refused = |cfg: VisualWorldConfig, needle: &str| {
        let e = VisualWorld::generate(&cfg).unwrap_err().to_string();
        assert!(e.contains(needle), "{e}");
    };
    refused(VisualWorldConfig { width: 100, ..small() }, "width 100: must be an odd multiple of 28");
    refused(VisualWorldConfig { width: 112, ..small() }, "width 112: must be an odd multiple of 28");
    refused(VisualWorldConfig { height: 28, ..small() }, "height 28");
    refused(VisualWorldConfig { height: 448, ..small() }, "height 448");
    refused(VisualWorldConfig { width: 0, ..small() }, "width 0");
    refused(VisualWorldConfig { min_objects: 0, ..small() }, "objects per scene");
    refused(VisualWorldConfig { min_objects: 3, max_objects: 2, ..small() }, "objects per scene");
    refused(VisualWorldConfig { max_objects: 6, ..small() }, "objects per scene");
    refused(VisualWorldConfig { n_holdout_scenes: 1, ..small() }, "1 held-out scene");
    refused(VisualWorldConfig { n_train_scenes: 0, n_holdout_scenes: 0, ..small() }, "no scenes");
}

#[test]
fn files_decode_and_match_the_world() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("world");
    let cfg = VisualWorldConfig { width: 140, height: 84, ..small() };
    let w = VisualWorld::generate(&cfg).unwrap();
    let written = write_visual_world(&out, &w).unwrap();
    assert_eq!(VisualWorld::read(&out).unwrap(), w);
    for scene in &w.scenes {
        for render in [Render::Original, Render::Rephrase] {
            let path = out.join(image_path(scene.id, render));
            let bytes = std::fs::read(&path).unwrap();
            let img = image::load_from_memory_with_format(&bytes, image::ImageFormat::Png).unwrap().to_rgb8();
            assert_eq!(img.dimensions(), (140, 84));
            assert_eq!(img, scene.render(render, 140, 84), "{}", path.display());
        }
    }
    let read = |name: &str| -> Value { serde_json::from_str(&std::fs::read_to_string(out.join(name)).unwrap()).unwrap() };
    let (train, holdout) = w.records();
    assert_eq!(read("vqa-train.json"), Value::Array(train.clone()));
    assert_eq!(read("vqa-holdout.json"), Value::Array(holdout.clone()));
    assert_eq!((written.train_records, written.holdout_records), (train.len(), holdout.len()));
    for r in train.iter().chain(&holdout) {
        for k in ["image", "image_rephrase", "m_loc"] {
            assert!(out.join(s(r, k)).is_file(), "{k} {} missing", s(r, k));
        }
    }
    let corpus: PretrainCorpus = serde_json::from_value(read("pretrain.json")).unwrap();
    assert_eq!(corpus, w.pretrain_corpus());
    // Every triple is true of its image's scene, and every record's facts are in it.
    let triples: HashSet<(&str, &str, &str)> = corpus.vqa.iter().map(|t| (t.image.as_str(), t.question.as_str(), t.answer.as_str())).collect();
    for t in &corpus.vqa {
        let render = if t.image.starts_with("images_rephrase/") { Render::Rephrase } else { Render::Original };
        assert_eq!(derive(scene_of(&w, &t.image, render), &t.question).1, t.answer);
    }
    for r in train.iter().chain(&holdout) {
        for (img, q, a) in [("image", "src", "pred"), ("image", "rephrase", "pred"), ("image_rephrase", "src", "pred"), ("image_rephrase", "rephrase", "pred"), ("m_loc", "m_loc_q", "m_loc_a")] {
            assert!(triples.contains(&(s(r, img), s(r, q), s(r, a))), "({img}, {q}, {a}) of {r} not in pretrain.json");
        }
        assert!(corpus.text.iter().any(|f| f.question == s(r, "loc") && f.answer == s(r, "loc_ans")));
    }
}

#[test]
fn refuses_foreign_folders_and_rewrites_its_own() {
    let dir = tempfile::tempdir().unwrap();
    let foreign = dir.path().join("foreign");
    std::fs::create_dir(&foreign).unwrap();
    std::fs::write(foreign.join("notes.txt"), "mine").unwrap();
    let w = VisualWorld::generate(&small()).unwrap();
    let e = write_visual_world(&foreign, &w).unwrap_err().to_string();
    assert!(e.contains(&foreign.display().to_string()) && e.contains("refusing"), "{e}");
    assert_eq!(std::fs::read_dir(&foreign).unwrap().count(), 1, "nothing written");
    // A scenes.json that is not ours is refused too.
    std::fs::write(foreign.join(SCENES_FILE), "{\"format\": \"something else\"}").unwrap();
    let e = write_visual_world(&foreign, &w).unwrap_err().to_string();
    assert!(e.contains("not a visual world"), "{e}");
    // A file where the folder should be.
    let e = write_visual_world(&foreign.join("notes.txt"), &w).unwrap_err().to_string();
    assert!(e.contains("notes.txt"), "{e}");

    // An empty folder is fine; a previous world is rewritten, and the images of a
    // larger world before it are removed (other files are left alone).
    let out = dir.path().join("empty");
    std::fs::create_dir(&out).unwrap();
    let big = VisualWorld::generate(&VisualWorldConfig { seed: 3, n_train_scenes: 12, ..small() }).unwrap();
    write_visual_world(&out, &big).unwrap();
    std::fs::write(out.join("images").join("README"), "kept").unwrap();
    write_visual_world(&out, &w).unwrap();
    assert_eq!(VisualWorld::read(&out).unwrap(), w);
    for render in [Render::Original, Render::Rephrase] {
        let mut names: Vec<String> =
            std::fs::read_dir(out.join(render.folder())).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
        names.sort();
        let mut expected: Vec<String> = w.scenes.iter().map(|sc| image_path(sc.id, render)[render.folder().len() + 1..].to_string()).collect();
        if render == Render::Original {
            expected.push("README".into());
        }
        expected.sort();
        assert_eq!(names, expected);
    }
    // An older version's world is named as such, with how to rebuild it; a rebuild
    // writes over it.
    let scenes = out.join(SCENES_FILE);
    std::fs::write(&scenes, r#"{"format": "dualedit-visual-world/1", "config": {}, "scenes": [{"shape": "circle"}]}"#).unwrap();
    let e = VisualWorld::read(&out).unwrap_err().to_string();
    assert!(e.contains("dualedit-visual-world/1") && e.contains("dualedit world --vl") && e.contains(SCENES_FILE), "{e}");
    write_visual_world(&out, &w).unwrap();
    assert_eq!(VisualWorld::read(&out).unwrap(), w);
}

#[test]
fn default_world_builds_in_seconds() {
    let dir = tempfile::tempdir().unwrap();
    let start = std::time::Instant::now();
    let w = VisualWorld::generate(&VisualWorldConfig::default()).unwrap();
    let written = write_visual_world(&dir.path().join("w"), &w).unwrap();
    let secs = start.elapsed().as_secs_f64();
    println!("{written:?} in {secs:.2} s");
    assert_eq!(written.scenes, 250);
    assert!(written.train_records >= 1000 && written.holdout_records >= 200, "{written:?}");
    assert!(secs < 30.0, "{secs} s");
}
