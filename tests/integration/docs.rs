//! The documentation a user reads: the README stays a front door, and
//! every relative link in it and in docs/ reaches a file and a heading
//! that exist (the docs were split out of one long README; a moved
//! section must not leave links behind).

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// The text outside fenced code blocks.
fn prose(text: &str) -> String {
    text.split("```").step_by(2).collect::<Vec<_>>().join("\n")
}

/// GitHub's anchor for a heading: lower case, punctuation dropped,
/// spaces to hyphens.
fn slug(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter(|c| c.is_alphanumeric() || *c == '-' || *c == '_' || *c == ' ')
        .map(|c| if c == ' ' { '-' } else { c })
        .collect()
}

fn anchors(path: &Path) -> BTreeSet<String> {
    let text = prose(&std::fs::read_to_string(path).unwrap());
    text.lines()
        .filter_map(|l| l.trim_start_matches('#').strip_prefix(' ').filter(|_| l.starts_with('#')))
        .map(slug)
        .collect()
}

fn markdown_files() -> Vec<PathBuf> {
    let mut files = vec![root().join("README.md")];
    for entry in std::fs::read_dir(root().join("docs")).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "md") {
            files.push(path);
        }
    }
    files
}

#[test]
fn every_relative_link_in_the_docs_reaches_a_file_and_a_heading() {
    let mut broken = Vec::new();
    let mut checked = 0;
    for file in markdown_files() {
        let text = prose(&std::fs::read_to_string(&file).unwrap());
        for (start, _) in text.match_indices("](") {
            let rest = &text[start + 2..];
            let Some(end) = rest.find(')') else { continue };
            let link = &rest[..end];
            if link.starts_with("http") || link.contains(' ') {
                continue;
            }
            checked += 1;
            let (path, anchor) = link.split_once('#').unwrap_or((link, ""));
            let target = if path.is_empty() { file.clone() } else { file.parent().unwrap().join(path) };
            if !target.exists() {
                broken.push(format!("{}: {link}: no such file", file.display()));
            } else if !anchor.is_empty()
                && target.extension().is_some_and(|e| e == "md")
                && !anchors(&target).contains(anchor)
            {
                broken.push(format!("{}: {link}: no such heading", file.display()));
            }
        }
    }
    assert!(checked >= 20, "only {checked} links found: is the parser right?");
    assert!(broken.is_empty(), "{broken:#?}");
}

#[test]
fn the_readme_is_a_front_door_that_maps_the_docs() {
    let readme = std::fs::read_to_string(root().join("README.md")).unwrap();
    assert!(
        readme.lines().count() <= 250,
        "README.md has {} lines: move detail to docs/",
        readme.lines().count()
    );
    for file in markdown_files().iter().skip(1) {
        let name = file.file_name().unwrap().to_str().unwrap();
        assert!(readme.contains(&format!("(docs/{name})")), "README.md's map of the docs lacks docs/{name}");
    }
}

#[test]
fn the_readmes_site_config_is_valid_and_the_example_config_too() {
    let readme = std::fs::read_to_string(root().join("README.md")).unwrap();
    let start = readme.find("```toml\n").expect("README shows a config for a real site") + "```toml\n".len();
    let block = &readme[start..start + readme[start..].find("```").unwrap()];
    let config = edgeinfer::config::Config::parse(block).unwrap_or_else(|e| panic!("README's config: {e}"));
    assert_eq!((config.node.id.as_str(), config.mqtt.url.as_str()), ("gw-01", "mqtts://broker.site:8883"));
    // Every other config the README shows (the traces section's) is valid too.
    for block in readme.split("```toml\n").skip(2) {
        let block = &block[..block.find("```").unwrap()];
        edgeinfer::config::Config::parse(block).unwrap_or_else(|e| panic!("README's config {block}: {e}"));
    }
    let shipped = std::fs::read_to_string(root().join("systemd/edgeinfer.toml")).unwrap();
    edgeinfer::config::Config::parse(&shipped).unwrap_or_else(|e| panic!("systemd/edgeinfer.toml: {e}"));
}

/// docs/examples/first-hour.sh (run by CI in a fresh clone) runs every
/// command of the README, in the README's order; the site's commands with
/// its scratch `$etc` for /etc/edgeinfer. The test command is .ci/run's own,
/// and so is installing the package (packaging/deb/check.sh --install).
#[test]
fn the_first_hour_script_runs_every_readme_command_in_order() {
    let normalize = |text: &str| text.replace("\\\n", " ").split_whitespace().collect::<Vec<_>>().join(" ");
    let readme = std::fs::read_to_string(root().join("README.md")).unwrap();
    let script = std::fs::read_to_string(root().join("docs/examples/first-hour.sh")).unwrap();
    let script = normalize(&script);
    let mut commands = Vec::new();
    for block in readme.split("```sh\n").skip(1) {
        let block = &block[..block.find("```").unwrap()];
        for command in block.replace("\\\n", " ").lines() {
            let command = command.split(" # ").next().unwrap().trim();
            let ci_runs_it = command == "cargo test --features failpoints"
                || command.starts_with("apt install ./edgeinfer");
            if !command.is_empty() && !ci_runs_it {
                commands.push(normalize(&command.replace("/etc/edgeinfer", "$etc")));
            }
        }
    }
    assert!(commands.len() >= 6, "README's commands not found: {commands:?}");
    let mut from = 0;
    for command in &commands {
        let at = script[from..].find(command.as_str()).map(|i| from + i);
        let at =
            at.unwrap_or_else(|| panic!("first-hour.sh does not run, after the ones before it: {command}"));
        from = at + command.len();
    }
}
