//! The response cache on the real binary: layers, restarts, TTL, versions,
//! byte bounds, crashes, a damaged store and single flight.

use super::support::{
    Client, Node, copy_digits_version, copy_test_version, embedded_node_with_http, free_port_pair, get_json,
    infer_digits, sample, scrape,
};
use crate::{digits_request, heldout};
use serde_json::{Value, json};
use std::path::Path;
use std::time::Duration;

/// A digits request for held-out row `i`, made distinct per `variant` (the
/// first pixel), with extra `parameters`.
fn request(id: &str, i: usize, variant: usize, parameters: Value) -> Value {
    let split = heldout();
    let mut px = split[i % split.len()].1.clone();
    px[0] = (variant % 17) as f64;
    px[1] = (variant / 17 % 17) as f64;
    let mut req = digits_request(id, &[px]);
    req["parameters"] = parameters;
    req
}

fn cache_of(reply: &Value) -> &str {
    reply["parameters"]["cache"].as_str().unwrap_or_else(|| panic!("no parameters.cache in {reply}"))
}

fn state_env(dir: &Path) -> (&'static str, String) {
    ("EDGEINFER_NODE__STATE_DIR", dir.display().to_string())
}

fn start(id: &str, env: &[(&str, String)]) -> (Node, u16, u16) {
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
    embedded_node_with_http(id, &env)
}

#[test]
fn miss_then_memory_then_disk_after_a_restart_with_identical_outputs() {
    let state = tempfile::tempdir().unwrap();
    let env = [state_env(state.path())];
    let (mut first, _, port) = start("gw-c1", &env);
    let req = request("a", 3, 0, json!({"top_k": 3}));
    let miss = infer_digits(port, &req);
    assert_eq!(cache_of(&miss), "miss");
    let mut again = req.clone();
    again["id"] = json!("b");
    again["parameters"]["deadline_ms"] = json!(5000);
    let hit = infer_digits(port, &again);
    assert_eq!(cache_of(&hit), "memory", "id and deadline are not part of the key");
    assert_eq!(hit["id"], "b", "a hit carries its own request's id");
    assert_eq!(hit["outputs"], miss["outputs"]);
    assert_eq!(hit["parameters"]["top_k"], miss["parameters"]["top_k"]);
    let mut bypass = req.clone();
    bypass["parameters"]["cache"] = json!(false);
    assert_eq!(cache_of(&infer_digits(port, &bypass)), "miss", "cache = false skips the lookup");
    let mut other_k = req.clone();
    other_k["parameters"]["top_k"] = json!(2);
    let k2 = infer_digits(port, &other_k);
    assert_eq!(cache_of(&k2), "miss", "top_k is part of the key");
    assert_eq!(k2["parameters"]["top_k"].as_array().unwrap().len(), 2);
    assert!(first.terminate().success());

    let (_second, _, port) = start("gw-c1", &env);
    let from_disk = infer_digits(port, &req);
    assert_eq!(cache_of(&from_disk), "disk", "{from_disk}");
    assert_eq!(from_disk["outputs"], miss["outputs"], "the stored answer, bit for bit");
    assert_eq!(from_disk["parameters"]["label"], miss["parameters"]["label"]);
    assert_eq!(from_disk["model_version"], miss["model_version"]);
    assert_eq!(cache_of(&infer_digits(port, &req)), "memory", "a disk hit is promoted to memory");
    let m = scrape(port);
    assert_eq!(sample(&m, &["edgeinfer_cache_lookups_total{", "result=\"disk\""]), 1.0);
    assert_eq!(sample(&m, &["edgeinfer_cache_lookups_total{", "result=\"memory\""]), 1.0);
    assert_eq!(
        sample(&m, &["edgeinfer_batch_rows_count{", "model=\"digits\""]),
        0.0,
        "no model run in this process: both answers came from the cache"
    );
}

#[test]
fn entries_expire_after_their_ttl_and_a_zero_ttl_model_is_never_cached() {
    let (_node, _, port) = start("gw-c2", &[("EDGEINFER_CACHE__TTL_S", "1".into())]);
    let req = request("t", 5, 0, json!({}));
    assert_eq!(cache_of(&infer_digits(port, &req)), "miss");
    assert_eq!(cache_of(&infer_digits(port, &req)), "memory");
    std::thread::sleep(Duration::from_millis(1300));
    assert_eq!(cache_of(&infer_digits(port, &req)), "miss", "expired entries are ignored");
    assert_eq!(cache_of(&infer_digits(port, &req)), "memory", "and replaced by the fresh answer");

    let (_node, _, port) = start("gw-c3", &[("EDGEINFER_MODELS__DIGITS__CACHE_TTL_S", "0".into())]);
    assert_eq!(cache_of(&infer_digits(port, &req)), "miss");
    assert_eq!(
        cache_of(&infer_digits(port, &req)),
        "miss",
        "models.digits.cache_ttl_s = 0 turns caching off"
    );
}

#[test]
fn a_new_model_version_never_serves_the_old_answer() {
    let state = tempfile::tempdir().unwrap();
    let models = tempfile::tempdir().unwrap();
    copy_digits_version(models.path(), "1", false);
    let env = [state_env(state.path()), ("EDGEINFER_NODE__MODELS_DIR", models.path().display().to_string())];
    let req = request("v", 7, 0, json!({}));
    let (mut node_v1, _, port) = start("gw-c4", &env);
    let v1 = infer_digits(port, &req);
    assert_eq!((v1["model_version"].as_str(), cache_of(&v1)), (Some("1"), "miss"));
    assert_eq!(cache_of(&infer_digits(port, &req)), "memory");
    assert!(node_v1.terminate().success());

    copy_digits_version(models.path(), "2", false);
    let (_node_v2, _, port) = start("gw-c4", &env);
    let v2 = infer_digits(port, &req);
    assert_eq!((v2["model_version"].as_str(), cache_of(&v2)), (Some("2"), "miss"), "{v2}");
    let mut pinned = req.clone();
    pinned["parameters"]["model_version"] = json!("1");
    let old = infer_digits(port, &pinned);
    assert_eq!((old["model_version"].as_str(), cache_of(&old)), (Some("1"), "disk"), "{old}");
}

#[test]
fn byte_bounds_hold_under_a_flood_of_distinct_inputs() {
    // The smallest bounds the config allows.
    let bounds = [("memory", 65_536.0), ("disk", 1_048_576.0)];
    let env = [
        ("EDGEINFER_CACHE__MEMORY_BYTES", bounds[0].1.to_string()),
        ("EDGEINFER_CACHE__DISK_BYTES", bounds[1].1.to_string()),
    ];
    let (_node, _, port) = start("gw-c5", &env);
    // About 5,700 answers fit the disk bound; four senders for speed.
    let n = 8000;
    std::thread::scope(|s| {
        for part in 0..4 {
            s.spawn(move || {
                for i in (part..n).step_by(4) {
                    let reply = infer_digits(port, &request(&i.to_string(), i, i / 7, json!({})));
                    assert_eq!(cache_of(&reply), "miss");
                }
            });
        }
    });
    let (_, stats) = get_json(port, "/cache/stats");
    eprintln!("after the flood: {stats}");
    let m = scrape(port);
    for (layer, bound) in bounds {
        let bytes = sample(&m, &["edgeinfer_cache_bytes{", &format!("layer=\"{layer}\"")]);
        let evicted = sample(&m, &["edgeinfer_cache_evictions_total{", &format!("layer=\"{layer}\"")]);
        assert!(bytes > bound / 2.0 && bytes <= bound, "{layer}: {bytes} bytes against a bound of {bound}");
        assert!(evicted > 0.0, "{layer}: nothing evicted");
    }
    assert!(stats["memory_bytes"].as_f64().unwrap() <= bounds[0].1);
    let disk = &stats["disk"];
    assert!(disk["bytes"].as_f64().unwrap() <= bounds[1].1);
    assert!(
        disk["size_on_disk"].as_f64().unwrap() <= bounds[1].1,
        "every file of the disk layer counts: {disk}"
    );
    let entries = disk["entries"].as_u64().unwrap();
    assert!(entries > 500 && entries < n as u64, "{entries} disk entries");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_during_a_write_storm_reopens_cleanly_and_every_answer_is_right() {
    let state = tempfile::tempdir().unwrap();
    // Batch size 1 throughout: a batched run's floats can differ from a
    // single row's in the last bit, and this test compares bits.
    let env = [state_env(state.path()), ("EDGEINFER_RUNTIME__MAX_BATCH", "1".into())];
    let (mut node, mqtt, _) = start("gw-c6", &env);
    let mut client = Client::connect(mqtt, "storm", &["storm/replies"]).await;
    let n = 800;
    for i in 0..n {
        let payload = request(&i.to_string(), i, i / 3, json!({})).to_string().into_bytes();
        client.request("edgeinfer/gw-c6/infer/digits", payload, "storm/replies", b"", None).await;
    }
    // Kill it while answers are still being written.
    let mut answered = 0;
    while answered < n / 3 {
        client.next(Duration::from_secs(20)).await.expect("replies during the storm");
        answered += 1;
    }
    node.kill9();
    drop(node);

    let (_node, _, port) = tokio::task::spawn_blocking(move || start("gw-c6", &env)).await.unwrap();
    let (_, status) = get_json(port, "/cache/stats");
    assert_eq!(status["disk"]["enabled"], true, "{status}");
    assert_eq!(status["disk"]["problem"], Value::Null, "the store reopened without trouble: {status}");
    let checked = tokio::task::spawn_blocking(move || {
        let mut from_disk = 0;
        for i in 0..n {
            let req = request(&i.to_string(), i, i / 3, json!({}));
            let cached = infer_digits(port, &req);
            let mut fresh_req = req.clone();
            fresh_req["parameters"]["cache"] = json!(false);
            let fresh = infer_digits(port, &fresh_req);
            assert_eq!(
                cached["outputs"], fresh["outputs"],
                "request {i}: a cached answer differs from the model's"
            );
            from_disk += (cache_of(&cached) == "disk") as usize;
        }
        from_disk
    })
    .await
    .unwrap();
    eprintln!("after kill -9: {checked} of {n} answers came from disk, all equal to the model's");
    assert!(checked > 0, "nothing survived on disk, so nothing was checked");
}

/// Issue 37: the answers live in the value log's segments, so a damaged
/// index is moved aside (kept for inspection) and rebuilt from them: the
/// answers stored before survive it. A store of the format before the
/// value log (sled files in `cache/` itself) is removed.
#[test]
fn a_damaged_store_is_moved_aside_and_the_node_serves() {
    let state = tempfile::tempdir().unwrap();
    let store = state.path().join("cache");
    let env = [state_env(state.path())];
    let req = request("q", 1, 0, json!({}));
    let (mut node, _, port) = start("gw-c7", &env);
    let first = infer_digits(port, &req);
    assert_eq!(cache_of(&first), "miss");
    assert!(node.terminate().success());
    std::fs::write(store.join("index/conf"), b"segment_size: banana\n\x00\xff garbage").unwrap();
    std::fs::write(store.join("index/db"), vec![0xa5u8; 4096]).unwrap();
    std::fs::write(store.join("conf"), b"the store of an earlier version").unwrap();
    std::fs::write(store.join("db"), vec![0x5au8; 4096]).unwrap();
    let (node, mqtt, port) = start("gw-c7", &env);
    let again = infer_digits(port, &req);
    assert_eq!(cache_of(&again), "disk", "the answer survived the damaged index: {again}");
    assert_eq!(again["outputs"], first["outputs"]);
    let aside: Vec<_> = std::fs::read_dir(&store)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("index.quarantined-"))
        .collect();
    assert_eq!(aside.len(), 1, "the damaged index is kept aside for inspection");
    assert!(!store.join("conf").exists() && !store.join("db").exists(), "the old-format store is gone");
    assert!(node.log.lock().unwrap().iter().any(|l| l.contains("ERROR") && l.contains("moved it aside")));
    let m = scrape(port);
    assert_eq!(sample(&m, &["edgeinfer_cache_quarantined_stores_total"]), 1.0);
    assert_eq!(sample(&m, &["edgeinfer_cache_disk_enabled"]), 1.0, "a fresh store serves");
    // The retained status says so too.
    let status = tokio::runtime::Runtime::new().unwrap().block_on(async {
        let mut c = Client::connect(mqtt, "watch", &["edgeinfer/gw-c7/status"]).await;
        c.next_json().await.1
    });
    let problem = status["cache"]["problem"].as_str().unwrap_or_else(|| panic!("{status}"));
    assert!(
        problem.contains("moved it aside") && !problem.contains('/'),
        "no paths in the status: {problem}"
    );
}

#[cfg(feature = "failpoints")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn identical_concurrent_requests_run_the_model_once() {
    // A slow model keeps the first request in flight while the rest arrive.
    let env = [("FAILPOINTS", "inference_delay=return(300)".to_string())];
    let (_node, mqtt, port) = tokio::task::spawn_blocking(move || start("gw-c8", &env)).await.unwrap();
    let mut client = Client::connect(mqtt, "same", &["same/replies"]).await;
    let n = 16;
    for i in 0..n {
        let payload = request(&format!("s{i}"), 9, 0, json!({})).to_string().into_bytes();
        client
            .request("edgeinfer/gw-c8/infer/digits", payload, "same/replies", i.to_string().as_bytes(), None)
            .await;
    }
    let mut outputs = Vec::new();
    let mut seen = std::collections::BTreeMap::new();
    for _ in 0..n {
        let (_, reply) = client.next_json().await;
        *seen.entry(cache_of(&reply).to_string()).or_insert(0) += 1;
        outputs.push(reply["outputs"].clone());
    }
    assert!(outputs.windows(2).all(|w| w[0] == w[1]), "every request got the same answer");
    assert_eq!(seen.get("miss"), Some(&1), "{seen:?}");
    let m = tokio::task::spawn_blocking(move || scrape(port)).await.unwrap();
    assert_eq!(sample(&m, &["edgeinfer_batch_rows_sum{", "model=\"digits\""]), 1.0, "the model ran once");
    assert_eq!(sample(&m, &["edgeinfer_batch_rows_count{", "model=\"digits\""]), 1.0);
    let coalesced = sample(&m, &["edgeinfer_cache_lookups_total{", "result=\"coalesced\""]);
    assert_eq!(coalesced, (n - 1) as f64, "the others waited for the first: {seen:?}");
}

#[test]
fn cache_stats_and_purge_work_against_a_live_node_and_a_stopped_one() {
    let state = tempfile::tempdir().unwrap();
    let env = [state_env(state.path())];
    let (mut node, _, port) = start("gw-c9", &env);
    for i in 0..5 {
        infer_digits(port, &request(&i.to_string(), i, 0, json!({})));
    }
    let cli = |args: &[&str]| {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_edgeinfer"))
            .args(["cache"])
            .args(args)
            .env_remove("EDGEINFER_CONFIG")
            .env("EDGEINFER_NODE__STATE_DIR", state.path())
            .env("EDGEINFER_HTTP__LISTEN", format!("127.0.0.1:{port}"))
            .output()
            .unwrap();
        assert!(out.status.success(), "cache {args:?}: {}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8(out.stdout).unwrap()
    };
    let wait_for_disk = |want: u64| {
        for _ in 0..100 {
            let stats: Value = serde_json::from_str(&cli(&["stats", "--json"])).unwrap();
            if stats["disk"]["entries"] == want {
                return stats;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        panic!("the disk layer never held {want} entries");
    };
    let live = wait_for_disk(5);
    assert_eq!(live["memory_entries"], 5);
    assert!(cli(&["stats"]).contains("running node"));
    let purged = cli(&["purge", "--model", "digits"]);
    assert!(purged.contains("5 disk entries removed"), "{purged}");
    assert_eq!(
        cache_of(&infer_digits(port, &request("0", 0, 0, json!({})))),
        "miss",
        "purged from memory too"
    );
    assert!(node.terminate().success());

    // With the node stopped the command opens the store itself.
    let http_port = free_port_pair();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_edgeinfer"))
        .args(["cache", "stats"])
        .env_remove("EDGEINFER_CONFIG")
        .env("EDGEINFER_NODE__STATE_DIR", state.path())
        .env("EDGEINFER_HTTP__LISTEN", format!("127.0.0.1:{http_port}"))
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && text.contains("no node running") && text.contains("disk:   1 entries"),
        "{text}"
    );
}

/// A small tmpfs, unmounted on drop; `None` (with a clear message) where
/// this process may not mount (CI runs as root and can).
struct SmallDisk(tempfile::TempDir);

impl SmallDisk {
    fn mount(size: &str) -> Option<SmallDisk> {
        let dir = tempfile::tempdir().unwrap();
        let ok = std::process::Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs"])
            .arg(dir.path())
            .stderr(std::process::Stdio::null())
            .status()
            .is_ok_and(|s| s.success());
        if !ok {
            crate::skipped("(full disk) cannot mount a tmpfs here (needs root)");
            return None;
        }
        Some(SmallDisk(dir))
    }

    /// Writes `path` until the disk has no room left.
    fn fill(&self, path: &std::path::Path) {
        use std::io::Write;
        let mut file = std::fs::File::create(path).unwrap();
        let chunk = vec![7u8; 16 * 1024];
        while file.write_all(&chunk).and_then(|_| file.sync_data()).is_ok() {}
        while file.write_all(&chunk[..512]).is_ok() {}
    }
}

impl Drop for SmallDisk {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount").arg(self.0.path()).status();
    }
}

#[test]
fn a_full_disk_turns_the_disk_layer_off_serving_continues_and_it_comes_back_when_space_is_freed() {
    let Some(disk) = SmallDisk::mount("4m") else { return };
    let state = disk.0.path().join("state");
    std::fs::create_dir(&state).unwrap();
    let (mut node, _, port) = start("gw-c10", &[state_env(&state)]);
    let filler = disk.0.path().join("filler");
    disk.fill(&filler);
    let enabled = |port| sample(&scrape(port), &["edgeinfer_cache_disk_enabled"]);
    let mut i = 0;
    let next = |port, i: &mut usize| {
        *i += 1;
        let reply = infer_digits(port, &request(&i.to_string(), *i, *i / 360, json!({})));
        assert_eq!(cache_of(&reply), "miss", "request {i}: {reply}");
    };
    // The disk fills: the layer goes off, every request is still answered.
    for _ in 0..4000 {
        next(port, &mut i);
        if i % 20 == 0 && enabled(port) == 0.0 {
            break;
        }
    }
    assert_eq!(enabled(port), 0.0, "the full disk turned the layer off within {i} requests");
    let off_at = i;
    let (_, stats) = get_json(port, "/cache/stats");
    let problem = stats["disk"]["problem"].as_str().unwrap_or_default().to_string();
    assert!(problem.contains("No space left"), "{stats}");
    assert!(sample(&scrape(port), &["edgeinfer_cache_disk_errors_total"]) >= 1.0);
    assert!(node.log.lock().unwrap().iter().any(|l| l.contains("disk cache disabled")));
    // Still full: the probes fail and serving goes on.
    for _ in 0..50 {
        next(port, &mut i);
    }
    std::thread::sleep(Duration::from_secs(2));
    assert_eq!(enabled(port), 0.0, "no room yet");
    // Space is freed: the layer comes back on its own, and stores again.
    std::fs::remove_file(&filler).unwrap();
    let freed = std::time::Instant::now();
    while enabled(port) == 0.0 {
        assert!(freed.elapsed() < Duration::from_secs(90), "the disk layer did not come back");
        next(port, &mut i);
        std::thread::sleep(Duration::from_millis(200));
    }
    let back_after = freed.elapsed();
    let before = get_json(port, "/cache/stats").1["disk"]["entries"].as_u64().unwrap();
    for _ in 0..20 {
        next(port, &mut i);
    }
    node.wait_for_line("re-enabled", Duration::from_secs(5));
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let stats = loop {
        let (_, stats) = get_json(port, "/cache/stats");
        if stats["disk"]["entries"].as_u64().unwrap() >= before + 20 || std::time::Instant::now() > deadline {
            break stats;
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    assert!(
        stats["disk"]["entries"].as_u64().unwrap() >= before + 20,
        "stores reach the disk again: {stats}"
    );
    assert_eq!(stats["disk"]["problem"], Value::Null, "{stats}");
    eprintln!(
        "disk layer off after {off_at} requests, back {back_after:?} after the space was freed; {i} requests, 0 errors"
    );
    assert!(node.terminate().success());
}

/// Issue 19: a disk read used to run on a runtime worker, so a slow disk
/// (a worn card, sled paging in or cleaning) held up every request on that
/// worker, cached or not. With every disk read made 3 s slow, requests that
/// look in the cache count a miss after `cache.disk_read_timeout_ms` and
/// run the model, and requests that do not are not held up at all.
#[test]
fn a_slow_disk_costs_a_miss_and_never_delays_a_request() {
    let state = tempfile::tempdir().unwrap();
    let n = 12;
    // The answers on disk first: a key the disk layer does not hold is a
    // miss without a read, so only a stored one tests a slow read.
    let (mut node, _, port) = start("gw-c12", &[state_env(state.path())]);
    for i in 0..n {
        assert_eq!(cache_of(&infer_digits(port, &request(&format!("on-{i}"), i, i, json!({})))), "miss");
    }
    let disk_entries = || sample(&scrape(port), &["edgeinfer_cache_entries{", "layer=\"disk\""]);
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while disk_entries() < n as f64 {
        assert!(std::time::Instant::now() < deadline, "the disk layer never held {n} answers");
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(node.terminate().success());
    // Restarted with an empty memory layer and a disk that takes 3 s a read.
    let env = [state_env(state.path()), ("FAILPOINTS", "disk_read_delay=return(3000)".to_string())];
    let (_node, _, port) = start("gw-c12", &env);
    let cached = std::thread::spawn(move || {
        (0..n)
            .map(|i| {
                let started = std::time::Instant::now();
                let reply = infer_digits(port, &request(&format!("on-{i}"), i, i, json!({})));
                (cache_of(&reply).to_string(), started.elapsed())
            })
            .collect::<Vec<_>>()
    });
    for i in 0..n {
        let started = std::time::Instant::now();
        infer_digits(port, &request(&format!("off-{i}"), i, 100 + i, json!({"cache": false})));
        // Well under the 3 s a read takes: nothing waits for the disk.
        assert!(started.elapsed() < Duration::from_secs(1), "cache-off request {i}: {:?}", started.elapsed());
    }
    for (i, (cache, took)) in cached.join().unwrap().into_iter().enumerate() {
        assert_eq!(cache, "miss", "request {i}");
        assert!(took < Duration::from_secs(1), "cache-on request {i}: {took:?}");
    }
    // The node's own view: every lookup ended within 20 ms (the timeout is
    // 5 ms), and the reads it gave up on are counted.
    let metrics = scrape(port);
    let lookups = |le: &str| {
        sample(
            &metrics,
            &[
                "stage_duration_seconds_bucket{",
                "model=\"digits\"",
                "stage=\"cache_lookup\"",
                &format!("le=\"{le}\""),
            ],
        )
    };
    let total =
        sample(&metrics, &["stage_duration_seconds_count{", "model=\"digits\"", "stage=\"cache_lookup\""]);
    assert!(total >= n as f64, "{total}");
    assert_eq!(lookups("0.02"), total, "lookups over 20 ms");
    let skipped = sample(&metrics, &["edgeinfer_cache_disk_reads_skipped_total{", "reason=\"slow\""]);
    assert!(skipped >= n as f64, "{skipped} reads given up on");
}

/// Issue 35, finding 8, on the node's own layers: version "1" replaced in
/// place with other contents is not answered from what the old contents
/// left in memory (after a reload) or on disk (after a restart).
#[test]
fn finding_8_a_version_replaced_in_place_is_not_answered_from_its_old_contents_cache() {
    let (models, state) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    copy_digits_version(models.path(), "1", false);
    let env = [state_env(state.path()), ("EDGEINFER_NODE__MODELS_DIR", models.path().display().to_string())];
    let (mut node, _, port) = start("gw-c8", &env);
    let req = request("a", 2, 0, json!({}));
    let stock = infer_digits(port, &req);
    assert_eq!(cache_of(&stock), "miss");
    assert_eq!(cache_of(&infer_digits(port, &req)), "memory");
    // Another model file (trained on labels shifted by one) under "1".
    copy_test_version(models.path(), "digits-wrong-labels", "1");
    node.signal("HUP");
    node.wait_for_line("reloaded: serving", Duration::from_secs(30));
    let replaced = infer_digits(port, &req);
    assert_eq!((cache_of(&replaced), replaced["model_version"].as_str()), ("miss", Some("1")), "{replaced}");
    assert_ne!(replaced["parameters"]["label"], stock["parameters"]["label"], "the new model's answer");
    assert!(node.terminate().success());
    // The shipped file again, its labels renamed (the manifest alone), and
    // a restart on the same store.
    copy_digits_version(models.path(), "1", false);
    let manifest = models.path().join("digits/1/model.toml");
    let names = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"];
    let text = std::fs::read_to_string(&manifest).unwrap();
    let renamed = text.replace(
        r#"["0", "1", "2", "3", "4", "5", "6", "7", "8", "9"]"#,
        &format!("[{}]", names.map(|n| format!("{n:?}")).join(", ")),
    );
    std::fs::write(&manifest, renamed).unwrap();
    let (_again, _, port) = start("gw-c8", &env);
    let relabelled = infer_digits(port, &req);
    assert_eq!(cache_of(&relabelled), "miss", "{relabelled}");
    let digit: usize = stock["parameters"]["label"].as_str().unwrap().parse().unwrap();
    assert_eq!(relabelled["parameters"]["label"], names[digit], "its own labels");
}
