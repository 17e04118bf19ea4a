//! The import structure docs/ARCHITECTURE.md promises, read from the
//! source: the library's top-level modules import each other without a
//! circle, the files of every folder too, and the request pipeline's stage
//! files import their siblings, never the engine module that declares them.

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

/// Every folder under `src/`, itself included.
fn folders(dir: &Path) -> Vec<PathBuf> {
    let mut all = vec![dir.to_path_buf()];
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            all.extend(folders(&path));
        }
    }
    all.sort();
    all
}

/// The files of one folder as a graph of which sibling each imports, by
/// `super::NAME` or by `crate::PATH::NAME`. A name that is not a sibling
/// (an item of the folder's `mod.rs`, or an outer module) is no edge here.
fn sibling_imports(dir: &Path) -> (BTreeSet<String>, BTreeMap<String, BTreeSet<String>>) {
    let siblings: BTreeSet<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.is_dir() || p.extension().is_some_and(|e| e == "rs"))
        .filter(|p| !p.is_dir() || p.join("mod.rs").is_file())
        .map(|p| p.file_stem().unwrap().to_string_lossy().into_owned())
        .filter(|name| name != "mod" && name != "lib" && name != "main")
        .collect();
    let module_path = dir.strip_prefix(src()).unwrap().to_string_lossy().replace('/', "::");
    let mut graph: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for name in &siblings {
        let file = dir.join(format!("{name}.rs"));
        let file = if file.is_file() { file } else { dir.join(name).join("mod.rs") };
        let text = code(&file);
        let mut imported = names_after(&text, "super::");
        if !module_path.is_empty() {
            imported.extend(names_after(&text, &format!("crate::{module_path}::")));
        }
        let deps = graph.entry(name.clone()).or_default();
        deps.extend(imported.into_iter().filter(|n| siblings.contains(*n) && *n != name).map(str::to_string));
    }
    (siblings, graph)
}

#[test]
fn the_files_of_every_folder_import_each_other_without_a_circle() {
    let mut read = 0;
    for dir in folders(&src()).into_iter().filter(|d| *d != src()) {
        let (_, graph) = sibling_imports(&dir);
        read += graph.values().filter(|d| !d.is_empty()).count();
        assert_eq!(circle(&graph), None, "a circle among the files of {}: {graph:?}", dir.display());
    }
    assert!(read > 10, "the reading works: {read} files import a sibling");
    // The rollout's files are layered: candidate, gates, state, plan.
    let (_, rollout) = sibling_imports(&src().join("rollout"));
    assert!(rollout["plan"].contains("state") && rollout["state"].contains("gates"), "{rollout:?}");
    // The integer ops' files too: numbers, layouts and what a convolution
    // computes below the kernels, the kernels below the ops.
    let (_, quant) = sibling_imports(&src().join("model/quant"));
    let ops = ["conv", "depthwise", "dense", "add", "pool", "layout", "pattern", "choice", "tests"];
    for below in ["cpu", "requant", "patches", "transpose", "spec", "igemm", "udot", "gemm", "planar"] {
        let imports = &quant[below];
        assert!(imports.iter().all(|d| !ops.contains(&d.as_str())), "{below} imports an op: {imports:?}");
    }
    assert!(quant["planar"].contains("spec") && quant["conv"].contains("udot"), "{quant:?}");
}

#[test]
fn the_engine_stages_import_their_siblings_never_the_engine_module() {
    for dir in [src().join("engine"), src().join("engine/cache")] {
        let (siblings, graph) = sibling_imports(&dir);
        for name in &siblings {
            let file = dir.join(format!("{name}.rs"));
            let file = if file.is_file() { file } else { dir.join(name).join("mod.rs") };
            for imported in names_after(&code(&file), "super::") {
                assert!(
                    siblings.contains(imported),
                    "{}: `super::{imported}` reaches into the parent module; import the sibling that defines it",
                    file.display()
                );
            }
        }
        assert!(graph.values().any(|d| !d.is_empty()), "no imports read in {}", dir.display());
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
