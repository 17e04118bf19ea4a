//! An idle node sleeps (issue 43): connected to mosquitto, the shipped
//! models loaded, cache and HTTP on, and sent nothing, the whole process
//! wakes at most twice a second. Read from the node's own context-switch
//! counters (`/proc/PID/task/*/status`) over a quiet window: counts, not
//! times, so a slow machine does not make it pass or fail.

use super::support::{Mosquitto, node_with_http};
use std::time::Duration;

/// Context switches (voluntary and not) of every thread of `pid`, by thread.
fn switches(pid: u32) -> Vec<(String, u64)> {
    let tasks = std::fs::read_dir(format!("/proc/{pid}/task")).unwrap();
    tasks
        .filter_map(|t| {
            let dir = t.ok()?.path();
            let name = std::fs::read_to_string(dir.join("comm")).ok()?.trim().to_string();
            let status = std::fs::read_to_string(dir.join("status")).ok()?;
            let count = status
                .lines()
                .filter(|l| {
                    l.starts_with("voluntary_ctxt_switches") || l.starts_with("nonvoluntary_ctxt_switches")
                })
                .filter_map(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok())
                .sum();
            Some((format!("{} {name}", dir.file_name()?.to_string_lossy()), count))
        })
        .collect()
}

#[test]
fn an_idle_node_wakes_at_most_twice_a_second() {
    let Some(mosquitto) = Mosquitto::start() else { return };
    let state = tempfile::tempdir().unwrap();
    let s = state.path().display().to_string();
    let (node, _http) =
        node_with_http(&mosquitto.url(), "gw-idle", &[("EDGEINFER_NODE__STATE_DIR", s.as_str())]);
    // Past the start: the plans of the larger batches, the first status.
    std::thread::sleep(Duration::from_secs(5));
    let window = Duration::from_secs(15);
    let before = switches(node.pid());
    std::thread::sleep(window);
    let after = switches(node.pid());
    let mut woken: Vec<(String, u64)> = after
        .iter()
        .map(|(thread, n)| {
            let was = before.iter().find(|(t, _)| t == thread).map_or(0, |(_, b)| *b);
            (thread.clone(), n - was)
        })
        .filter(|(_, n)| *n > 0)
        .collect();
    woken.sort_by_key(|(_, n)| std::cmp::Reverse(*n));
    let total: u64 = woken.iter().map(|(_, n)| n).sum();
    eprintln!("{total} wake-ups in {window:?}: {woken:?}");
    assert!(total <= 2 * window.as_secs(), "{total} wake-ups in {window:?}, by thread: {woken:?}");
}
