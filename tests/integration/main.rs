//! Integration tests: the real models, the real pipeline, the real binary.

mod architecture;
mod cli;
mod docs;
mod errors;
mod fleet;
mod fuzz;
mod mlperf;
mod models;
mod mqtt;

use std::path::PathBuf;

/// A test that needs a tool (or a right) this machine lacks: says SKIPPED
/// and how to get it, except under `CI=true`, where `.ci/run` provides
/// every one and a missing one must fail the run.
pub fn skipped(why: &str) {
    assert!(std::env::var("CI").as_deref() != Ok("true"), "CI=true, but {why}");
    eprintln!("SKIPPED: {why}");
}

/// The fault-injection tests (issue 16) need the fail points compiled in:
/// `cargo test --features failpoints`, as the README and `.ci/run` run it.
#[test]
fn fault_injection_tests_are_compiled_in() {
    if !cfg!(feature = "failpoints") {
        skipped("built without --features failpoints: the fault-injection tests are left out");
    }
}

pub fn models_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("models")
}

/// The held-out split the producing script wrote: (label, 64 raw pixels).
pub fn heldout() -> Vec<(usize, Vec<f64>)> {
    let text = std::fs::read_to_string(models_dir().join("heldout/digits.csv")).unwrap();
    text.lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
        .map(|l| {
            let mut v = l.split(',').map(|x| x.parse::<f64>().unwrap());
            let label = v.next().unwrap() as usize;
            (label, v.collect())
        })
        .collect()
}

/// A JSON request for `rows` rows of `digits` input.
pub fn digits_request(id: &str, rows: &[Vec<f64>]) -> serde_json::Value {
    let data: Vec<f64> = rows.iter().flatten().copied().collect();
    serde_json::json!({
        "id": id,
        "inputs": [{"name": "input", "shape": [rows.len(), 64], "datatype": "FP32", "data": data}]
    })
}

/// Chromium, where this machine has it (Debian's `chromium`).
pub fn chromium() -> Option<std::path::PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .flat_map(|dir| ["chromium", "chromium-browser"].map(|name| dir.join(name)))
        .find(|p| p.is_file())
}

/// Runs headless Chromium on `url` with `args`, in a new empty profile and
/// without the background connections a closed network refuses.
pub fn headless(
    chromium: &std::path::Path,
    profile: &std::path::Path,
    args: &[&str],
    url: &str,
) -> std::process::Output {
    let out = std::process::Command::new(chromium)
        .args(["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run"])
        .args(["--disable-background-networking", "--disable-component-update", "--disable-sync"])
        .arg(format!("--user-data-dir={}", profile.display()))
        .args(args)
        .arg(url)
        .output()
        .unwrap();
    assert!(out.status.success(), "chromium {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    out
}
