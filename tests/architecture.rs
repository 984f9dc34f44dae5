//! ARCHITECTURE.md's table of which module may use which, checked against every
//! `crate::` path in `src/` (comments excluded), so the page cannot drift from the code.
use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

/// `module -> modules it may use`; `None` for "anything below".
fn allowed() -> BTreeMap<String, Option<BTreeSet<String>>> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
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
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
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
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("src/world");
    let mut files = Vec::new();
    rust_files(&dir, &mut files);
    assert!(!files.is_empty(), "src/world has no Rust files");
    for f in files {
        let text = std::fs::read_to_string(&f).unwrap();
        assert!(!text.contains("tch::") && !text.contains("use tch"), "{} uses tch", f.display());
    }
}
