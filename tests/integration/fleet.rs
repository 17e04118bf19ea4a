//! The fleet operator's kit (`deploy/`): the Prometheus rules pass
//! `promtool check rules` and their unit tests, every alert has a runbook
//! section, and the Grafana dashboard's queries parse and name only metrics
//! the node exports. Needs promtool (Debian's `prometheus` package).

use std::path::{Path, PathBuf};
use std::process::Command;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn promtool() -> Option<PathBuf> {
    let found =
        ["/usr/bin/promtool", "/usr/local/bin/promtool"].into_iter().map(PathBuf::from).find(|p| p.exists());
    if found.is_none() {
        crate::skipped("promtool is not installed (apt-get install prometheus)");
    }
    found
}

fn promtool_ok(promtool: &Path, args: &[&str], dir: &Path) {
    let out = Command::new(promtool).args(args).current_dir(dir).output().unwrap();
    assert!(
        out.status.success(),
        "promtool {args:?}:\n{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The `edgeinfer_*` metric names in `text`, histogram suffixes removed.
fn metric_names(text: &str) -> Vec<String> {
    text.match_indices("edgeinfer_")
        .map(|(at, _)| {
            let rest = &text[at..];
            let end = rest
                .find(|c: char| !(c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_'))
                .unwrap_or(rest.len());
            let name = &rest[..end];
            ["_bucket", "_sum", "_count"]
                .iter()
                .find_map(|s| {
                    name.strip_suffix(s).filter(|base| base.ends_with("_seconds") || base.ends_with("_rows"))
                })
                .unwrap_or(name)
                .to_string()
        })
        .collect()
}

/// Every metric the node exports: the names in src/telemetry/mod.rs, and
/// the rollout's own in src/rollout/mod.rs.
fn exported() -> Vec<String> {
    ["src/telemetry/mod.rs", "src/rollout/mod.rs"]
        .iter()
        .map(|file| std::fs::read_to_string(root().join(file)).unwrap())
        .flat_map(|source| {
            let names: Vec<String> = source
                .lines()
                .filter(|l| l.starts_with("pub const ") && l.contains(": &str = \"edgeinfer_"))
                .flat_map(metric_names)
                .collect();
            names
        })
        .collect()
}

#[test]
fn the_alerting_rules_pass_promtool_and_every_alert_has_a_test_and_a_runbook_section() {
    let Some(promtool) = promtool() else { return };
    let dir = root().join("deploy/prometheus");
    promtool_ok(&promtool, &["check", "rules", "edgeinfer-rules.yml"], &dir);
    promtool_ok(&promtool, &["test", "rules", "edgeinfer-rules.test.yml"], &dir);
    let rules = std::fs::read_to_string(dir.join("edgeinfer-rules.yml")).unwrap();
    let tests = std::fs::read_to_string(dir.join("edgeinfer-rules.test.yml")).unwrap();
    let runbook = std::fs::read_to_string(root().join("docs/RUNBOOK.md")).unwrap();
    let anchors: Vec<String> = runbook
        .lines()
        .filter_map(|l| l.strip_prefix("## "))
        .map(|h| h.to_lowercase().replace(' ', "-"))
        .collect();
    let alerts: Vec<&str> = rules.lines().filter_map(|l| l.trim().strip_prefix("- alert: ")).collect();
    assert!(alerts.len() >= 8, "{alerts:?}");
    for alert in &alerts {
        // A firing case: an alert_rule_test for it whose exp_alerts is not empty.
        let firing = tests.split("alertname: ").skip(1).any(|case| {
            case.starts_with(alert) && !case.lines().nth(1).is_some_and(|l| l.contains("exp_alerts: []"))
        });
        assert!(firing, "{alert} has no firing test case in edgeinfer-rules.test.yml");
    }
    for url in rules.lines().filter_map(|l| l.trim().strip_prefix("runbook_url: ")) {
        let anchor = url.trim_matches('"').rsplit_once('#').unwrap().1;
        assert!(anchors.iter().any(|a| a == anchor), "{url}: no section `{anchor}` in docs/RUNBOOK.md");
    }
    let exported = exported();
    for name in metric_names(&rules) {
        assert!(exported.contains(&name), "the rules use {name}, which the node does not export");
    }
}

#[test]
fn the_dashboard_queries_parse_and_name_only_metrics_the_node_exports() {
    let Some(promtool) = promtool() else { return };
    let text = std::fs::read_to_string(root().join("deploy/grafana/edgeinfer-dashboard.json")).unwrap();
    let dashboard: serde_json::Value = serde_json::from_str(&text).unwrap();
    let variables: Vec<&str> = dashboard["templating"]["list"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v["name"].as_str().unwrap())
        .collect();
    assert_eq!(variables, vec!["datasource", "node"]);
    let mut queries: Vec<String> = dashboard["panels"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|p| p["targets"].as_array().unwrap().iter())
        .map(|t| t["expr"].as_str().unwrap().to_string())
        .collect();
    assert!(queries.len() >= 20, "{} queries", queries.len());
    // The annotations (rollout decisions on every panel) too.
    let annotations = dashboard["annotations"]["list"].as_array().unwrap();
    assert!(annotations.iter().any(|a| a["name"] == "Rollout decisions"), "{annotations:?}");
    queries.extend(annotations.iter().map(|a| a["expr"].as_str().unwrap().to_string()));
    queries.push(
        dashboard["templating"]["list"][1]["definition"]
            .as_str()
            .unwrap()
            .replace("label_values(edgeinfer_build_info, instance)", "edgeinfer_build_info"),
    );
    // Grafana's variables as a query would see them.
    let rules: String = queries
        .iter()
        .enumerate()
        .map(|(i, q)| {
            let q = q.replace("$__rate_interval", "5m").replace("$node", ".*");
            format!(
                "      - record: dashboard:query{i}\n        expr: {}\n",
                serde_json::to_string(&q).unwrap()
            )
        })
        .collect();
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("dashboard.yml"),
        format!("groups:\n  - name: dashboard\n    rules:\n{rules}"),
    )
    .unwrap();
    promtool_ok(&promtool, &["check", "rules", "dashboard.yml"], dir.path());
    let exported = exported();
    for name in queries.iter().flat_map(|q| metric_names(q)) {
        assert!(exported.contains(&name), "the dashboard uses {name}, which the node does not export");
    }
}
