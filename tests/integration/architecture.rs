//! The import structure docs/ARCHITECTURE.md promises, read from the
//! source: the library's top-level modules import each other without a
//! circle, and the request pipeline's stage files import their siblings,
//! never the engine module that declares them, also without a circle.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

fn src() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("src")
}

fn rust_files(dir: &Path) -> Vec<PathBuf> {
    let mut files = Vec::new();
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            files.extend(rust_files(&path));
        } else if path.extension().is_some_and(|e| e == "rs") {
            files.push(path);
        }
    }
    files.sort();
    files
}

/// The code of a file without its test module (tests may import anything).
fn code(path: &Path) -> String {
    let text = std::fs::read_to_string(path).unwrap();
    match text.find("#[cfg(test)]\nmod tests") {
        Some(at) => text[..at].to_string(),
        None => text,
    }
}

/// The identifiers that follow each `prefix` in `text`.
fn names_after<'a>(text: &'a str, prefix: &str) -> Vec<&'a str> {
    text.match_indices(prefix)
        .map(|(at, _)| {
            let rest = &text[at + prefix.len()..];
            let end = rest.find(|c: char| !(c.is_ascii_alphanumeric() || c == '_')).unwrap_or(rest.len());
            &rest[..end]
        })
        .collect()
}

/// A circle in `graph`, as the path around it, if there is one.
fn circle(graph: &BTreeMap<String, BTreeSet<String>>) -> Option<Vec<String>> {
    fn visit(
        node: &str,
        graph: &BTreeMap<String, BTreeSet<String>>,
        path: &mut Vec<String>,
        done: &mut BTreeSet<String>,
    ) -> Option<Vec<String>> {
        if let Some(at) = path.iter().position(|n| n == node) {
            let mut around = path[at..].to_vec();
            around.push(node.to_string());
            return Some(around);
        }
        if done.contains(node) {
            return None;
        }
        path.push(node.to_string());
        for next in graph.get(node).into_iter().flatten() {
            if let Some(found) = visit(next, graph, path, done) {
                return Some(found);
            }
        }
        path.pop();
        done.insert(node.to_string());
        None
    }
    let mut done = BTreeSet::new();
    graph.keys().find_map(|node| visit(node, graph, &mut Vec::new(), &mut done))
}

#[test]
fn the_top_level_modules_import_each_other_without_a_circle() {
    let mut graph: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for path in rust_files(&src()) {
        let relative = path.strip_prefix(src()).unwrap();
        let first = relative.components().next().unwrap().as_os_str().to_string_lossy();
        let module = first.trim_end_matches(".rs").to_string();
        // The binary (main.rs, cli/) uses the library through `edgeinfer::`.
        if module == "main" || module == "cli" || module == "lib" {
            continue;
        }
        let deps = graph.entry(module.clone()).or_default();
        for name in names_after(&code(&path), "crate::") {
            if name != module {
                deps.insert(name.to_string());
            }
        }
    }
    // The reading works: edges the design has are found.
    assert!(graph["engine"].contains("model") && graph["node"].contains("engine"), "{graph:?}");
    assert!(graph["protocol"].is_empty(), "the wire contract imports nothing of ours: {graph:?}");
    assert_eq!(circle(&graph), None, "a circle among the top-level modules; {graph:?}");
}

#[test]
fn the_engine_stages_import_their_siblings_without_a_circle() {
    for dir in [src().join("engine"), src().join("engine/cache")] {
        let siblings: BTreeSet<String> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().path())
            .map(|p| p.file_stem().unwrap().to_string_lossy().into_owned())
            .filter(|name| name != "mod")
            .collect();
        let mut graph: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
        for name in &siblings {
            let file = dir.join(format!("{name}.rs"));
            let file = if file.is_file() { file } else { dir.join(name).join("mod.rs") };
            let deps = graph.entry(name.clone()).or_default();
            for imported in names_after(&code(&file), "super::") {
                assert!(
                    siblings.contains(imported),
                    "{}: `super::{imported}` reaches into the parent module; import the sibling that defines it",
                    file.display()
                );
                deps.insert(imported.to_string());
            }
        }
        assert!(graph.values().any(|d| !d.is_empty()), "no imports read in {}", dir.display());
        assert_eq!(circle(&graph), None, "a circle among {}: {graph:?}", dir.display());
    }
}

#[test]
fn a_circle_is_found_when_there_is_one() {
    let edge = |a: &str, b: &str| (a.to_string(), BTreeSet::from([b.to_string()]));
    let looped = BTreeMap::from([edge("a", "b"), edge("b", "c"), edge("c", "a")]);
    assert_eq!(circle(&looped), Some(vec!["a".into(), "b".into(), "c".into(), "a".into()]));
    let straight = BTreeMap::from([edge("a", "b"), edge("b", "c")]);
    assert_eq!(circle(&straight), None);
}
