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
