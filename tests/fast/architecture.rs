//! ARCHITECTURE.md's table of which module may use which, checked against every
//! `crate::` path in `src/` (comments excluded), so the page cannot drift from the code;
//! and the test layout: every test file is a module of one of the few test binaries.
use crate::common;
use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

/// `module -> modules it may use`; `None` for "anything below".
fn allowed() -> BTreeMap<String, Option<BTreeSet<String>>> {
    let root = common::root();
    let text = std::fs::read_to_string(root.join("ARCHITECTURE.md")).unwrap();
    let mut out = BTreeMap::new();
    for line in text.lines().filter(|l| l.starts_with("| `")) {
        let cells: Vec<&str> = line.trim_matches('|').split('|').map(str::trim).collect();
        assert_eq!(cells.len(), 3, "table row with three cells: {line}");
        let uses = match cells[2] {
            "—" => Some(BTreeSet::new()),
            "anything below" => None,
            list => Some(list.split(',').map(|m| m.trim().to_string()).collect()),
        };
        for m in cells[0].split(',') {
            out.insert(m.trim().trim_matches('`').to_string(), uses.clone());
        }
    }
    out
}

fn rust_files(dir: &Path, out: &mut Vec<std::path::PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            rust_files(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

#[test]
fn modules_use_only_what_architecture_md_allows() {
    let allowed = allowed();
    let src = common::root().join("src");
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    let mut violations = Vec::new();
    for f in files {
        let rel = f.strip_prefix(&src).unwrap();
        let module = rel.iter().next().unwrap().to_str().unwrap().trim_end_matches(".rs").to_string();
        if module == "lib" || module == "main" {
            continue;
        }
        let rule = allowed.get(&module).unwrap_or_else(|| panic!("module {module} ({}) is not in ARCHITECTURE.md's table", rel.display()));
        let Some(may) = rule else { continue };
        let text = std::fs::read_to_string(&f).unwrap();
        for (n, line) in text.lines().enumerate().filter(|(_, l)| !l.trim_start().starts_with("//")) {
            for (i, _) in line.match_indices("crate::") {
                let rest = &line[i + 7..];
                // `crate::{a, b::c}` names several modules at once.
                let names: Vec<&str> = match rest.strip_prefix('{') {
                    Some(group) => group.split('}').next().unwrap_or("").split(',').collect(),
                    None => vec![rest],
                };
                for name in names {
                    let used: String = name.trim().chars().take_while(|c| c.is_ascii_alphanumeric() || *c == '_').collect();
                    let own = used.is_empty() || used == module || ["Result", "Error", "error"].contains(&used.as_str());
                    if !own && !may.contains(&used) {
                        violations.push(format!("src/{}:{}: {module} uses crate::{used}", rel.display(), n + 1));
                    }
                }
            }
        }
    }
    assert!(violations.is_empty(), "uses that ARCHITECTURE.md does not allow:\n{}", violations.join("\n"));
}

/// The worlds are data generation only: they must build without libtorch (ARCHITECTURE.md:
/// `world` uses io and rng), so no file under src/world names tch.
#[test]
fn the_worlds_need_no_libtorch() {
    let dir = common::root().join("src/world");
    let mut files = Vec::new();
    rust_files(&dir, &mut files);
    assert!(!files.is_empty(), "src/world has no Rust files");
    for f in files {
        let text = std::fs::read_to_string(&f).unwrap();
        assert!(!text.contains("tch::") && !text.contains("use tch"), "{} uses tch", f.display());
    }
}

/// Every test file is compiled, into one of the few test binaries: each `tests/<group>/*.rs`
/// is a `mod` of its group's `main.rs` (a file without its line would never run, silently),
/// and there is no top-level `tests/*.rs` (each would be one more binary linking libtorch).
#[test]
fn every_test_file_is_a_module_of_a_test_binary() {
    let tests = common::root().join("tests");
    let mut problems = Vec::new();
    let mut groups = 0;
    for entry in std::fs::read_dir(&tests).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        if path.extension().is_some_and(|e| e == "rs") {
            problems.push(format!("tests/{name}: a binary of its own; move it into tests/fast or tests/slow as a module"));
            continue;
        }
        let Ok(main) = std::fs::read_to_string(path.join("main.rs")) else { continue };
        groups += 1;
        let declared: BTreeSet<String> =
            main.lines().filter_map(|l| l.trim().strip_prefix("mod ")?.strip_suffix(';').map(str::to_string)).collect();
        for file in std::fs::read_dir(&path).unwrap() {
            let file = file.unwrap().path();
            let Some(stem) = file.file_stem().map(|s| s.to_string_lossy().into_owned()) else { continue };
            if file.extension().is_some_and(|e| e == "rs") && stem != "main" && !declared.contains(&stem) {
                problems.push(format!("tests/{name}/{stem}.rs has no `mod {stem};` in tests/{name}/main.rs"));
            }
        }
    }
    assert!(groups >= 2, "found {groups} test binaries under {}", tests.display());
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

/// The module a file is (`src/a/b.rs` and `src/a/b/mod.rs` are `a::b`; `lib.rs` is the root).
fn module_of(src: &Path, file: &Path) -> Vec<String> {
    let rel = file.strip_prefix(src).unwrap().with_extension("");
    let mut parts: Vec<String> = rel.iter().map(|p| p.to_string_lossy().into_owned()).collect();
    if parts.last().is_some_and(|p| p == "mod" || p == "lib" || p == "main") {
        parts.pop();
    }
    parts
}

/// The `use` paths of a Rust file's non-test code, braces expanded (`a::{b, c::d}` →
/// `a::b`, `a::c::d`), each with whether it is a `pub use` (a re-export).
fn use_paths(text: &str) -> Vec<(bool, String)> {
    let code: String = text.split("#[cfg(test)]").next().unwrap().lines().map(|l| l.split("//").next().unwrap()).collect::<Vec<_>>().join("\n");
    fn expand(prefix: &str, body: &str, out: &mut Vec<String>) {
        let body = body.trim();
        let Some(open) = body.find('{') else {
            out.push(format!("{prefix}{body}"));
            return;
        };
        let (head, inner) = (&body[..open], &body[open + 1..body.rfind('}').unwrap()]);
        let (mut depth, mut start) = (0, 0);
        for (i, c) in inner.char_indices().chain([(inner.len(), ',')]) {
            match c {
                '{' => depth += 1,
                '}' => depth -= 1,
                ',' if depth == 0 => {
                    if !inner[start..i].trim().is_empty() {
                        expand(&format!("{prefix}{head}"), &inner[start..i], out);
                    }
                    start = i + 1;
                }
                _ => {}
            }
        }
    }
    let mut out = Vec::new();
    for stmt in code.split(';') {
        let s = stmt.trim();
        let Some(at) = s.find("use ") else { continue };
        let before = s[..at].trim_end();
        if !(before.is_empty() || before.ends_with('}') || before.ends_with(']') || before.starts_with("pub") || before.ends_with('{')) {
            continue;
        }
        let public = before.split_whitespace().last().is_some_and(|w| w.starts_with("pub"));
        let mut paths = Vec::new();
        expand("", &s[at + 4..], &mut paths);
        out.extend(paths.into_iter().map(|p| (public, p.split(" as ").next().unwrap().trim().to_string())));
    }
    out
}

/// No two files import each other, directly or round a circle: every file's `use` of
/// another file of the crate (a parent's re-export of its own child aside, which is a
/// facade, not a dependency) points down a layering (issue #50: the circles in `model/`,
/// `planner/`, `mend/` and `serve/` were taken apart).
#[test]
fn no_files_import_each_other_in_a_circle() {
    let src = common::root().join("src");
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    let modules: BTreeSet<Vec<String>> = files.iter().map(|f| module_of(&src, f)).collect();
    let resolve = |path: &[String]| (0..=path.len()).rev().map(|n| path[..n].to_vec()).find(|p| modules.contains(p));
    let mut edges: BTreeMap<Vec<String>, BTreeSet<Vec<String>>> = BTreeMap::new();
    for f in &files {
        let me = module_of(&src, f);
        let dir_module = f.ends_with("mod.rs") || f.ends_with("lib.rs");
        let text = std::fs::read_to_string(f).unwrap();
        for (public, path) in use_paths(&text) {
            let segs: Vec<String> = path.split("::").map(str::trim).filter(|s| !s.is_empty()).map(String::from).collect();
            let Some(first) = segs.first() else { continue };
            let mut target = match first.as_str() {
                "crate" => segs[1..].to_vec(),
                "super" | "self" => {
                    let mut base = me.clone();
                    let mut rest = &segs[..];
                    while rest.first().is_some_and(|s| s == "super") {
                        base.pop();
                        rest = &rest[1..];
                    }
                    if rest.first().is_some_and(|s| s == "self") {
                        rest = &rest[1..];
                    }
                    [base, rest.to_vec()].concat()
                }
                name if modules.contains(&[me.clone(), vec![name.to_string()]].concat()) => [me.clone(), segs.clone()].concat(),
                _ => continue,
            };
            if target.last().is_some_and(|s| s == "*" || s == "self") {
                target.pop();
            }
            let Some(t) = resolve(&target) else { continue };
            if t.is_empty() || t == me || (public && dir_module && t.starts_with(&me)) {
                continue;
            }
            edges.entry(me.clone()).or_default().insert(t);
        }
    }
    // A file on a circle reaches itself.
    let mut circles = Vec::new();
    for start in edges.keys() {
        let mut seen = BTreeSet::new();
        let mut stack: Vec<Vec<String>> = edges[start].iter().cloned().collect();
        while let Some(m) = stack.pop() {
            if &m == start {
                circles.push(start.join("::"));
                break;
            }
            if seen.insert(m.clone()) {
                stack.extend(edges.get(&m).into_iter().flatten().cloned());
            }
        }
    }
    assert!(circles.is_empty(), "files on an import circle: {}", circles.join(", "));
}

/// Callers outside `model/` reach a vision-language family through `model::vision` and
/// `VisionLanguage` only, and no source file grows past 900 lines (issue #50).
#[test]
fn no_family_named_outside_model_and_no_file_over_900_lines() {
    let root = common::root();
    let mut files = Vec::new();
    for dir in ["src", "tests", "python/src", "benches"] {
        rust_files(&root.join(dir), &mut files);
    }
    let mut problems = Vec::new();
    for f in &files {
        let rel = f.strip_prefix(&root).unwrap();
        let text = std::fs::read_to_string(f).unwrap();
        let lines = text.lines().count();
        if lines > 900 {
            problems.push(format!("{}: {lines} lines", rel.display()));
        }
        if rel.starts_with("src") && !rel.starts_with("src/model") {
            for (n, l) in text.lines().enumerate().filter(|(_, l)| !l.trim_start().starts_with("//")) {
                if l.contains("qwen2_vl::") {
                    problems.push(format!("{}:{}: names qwen2_vl outside model/", rel.display(), n + 1));
                }
            }
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}
