//! An idle node sleeps (issue 43): connected to mosquitto, the shipped
//! models loaded, cache and HTTP on, and sent nothing, the whole process
//! wakes at most twice a second. Read from the node's own context-switch
//! counters (`/proc/PID/task/*/status`) over quiet windows: counts, not
//! times, so a slow machine does not make it pass or fail.

use super::support::{Mosquitto, infer_digits, node_with_http, scrape};
use crate::{digits_request, heldout};
use std::time::Duration;

/// The gauge of entries by cache layer.
const CACHE_ENTRIES: &str = "edgeinfer_cache_entries{";

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

/// Wake-ups over `window`, by thread, busiest first, and their sum.
fn wakeups(pid: u32, window: Duration) -> (u64, Vec<(String, u64)>) {
    let before = switches(pid);
    std::thread::sleep(window);
    let after = switches(pid);
    let mut woken: Vec<(String, u64)> = after
        .iter()
        .map(|(thread, n)| {
            let was = before.iter().find(|(t, _)| t == thread).map_or(0, |(_, b)| *b);
            (thread.clone(), n - was)
        })
        .filter(|(_, n)| *n > 0)
        .collect();
    woken.sort_by_key(|(_, n)| std::cmp::Reverse(*n));
    (woken.iter().map(|(_, n)| n).sum(), woken)
}

/// Idle from the start, then idle again after one answer was computed and
/// stored on disk: the disk cache's first write starts sled's I/O pool,
/// whose threads woke every second forever until the pinned patch
/// (vendor/sled).
#[test]
fn an_idle_node_wakes_at_most_twice_a_second() {
    let Some(mosquitto) = Mosquitto::start() else { return };
    let state = tempfile::tempdir().unwrap();
    let s = state.path().display().to_string();
    let (node, http) =
        node_with_http(&mosquitto.url(), "gw-idle", &[("EDGEINFER_NODE__STATE_DIR", s.as_str())]);
    // Past the start: the plans of the larger batches, the first status.
    std::thread::sleep(Duration::from_secs(5));
    let window = Duration::from_secs(15);
    let (total, woken) = wakeups(node.pid(), window);
    eprintln!("sent nothing: {total} wake-ups in {window:?}: {woken:?}");
    assert!(
        total <= 2 * window.as_secs(),
        "sent nothing: {total} wake-ups in {window:?}, by thread: {woken:?}"
    );

    let reply = infer_digits(http, &digits_request("idle-warm", &[heldout()[0].1.clone()]));
    assert_eq!(reply["id"], "idle-warm", "{reply}");
    // The disk layer counts an entry once the writer indexed it in sled
    // (within 5 ms of the write): sled has been written, and its I/O
    // pool started, before the second window opens.
    let indexed = || {
        scrape(http).lines().any(|l| {
            l.starts_with(CACHE_ENTRIES) && l.contains("layer=\"disk\"") && l.rsplit(' ').next() != Some("0")
        })
    };
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while !indexed() && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(indexed(), "the disk layer never counted the answer:\n{}", scrape(http));
    std::thread::sleep(Duration::from_secs(2));
    let (total, woken) = wakeups(node.pid(), window);
    eprintln!("one answer stored: {total} wake-ups in {window:?}: {woken:?}");
    assert!(
        total <= 2 * window.as_secs(),
        "one answer stored: {total} wake-ups in {window:?}, by thread: {woken:?}"
    );
}
