//! Living under systemd: sd_notify messages, draining on SIGTERM, reloading
//! on SIGHUP, on the real binary.

use super::support::{
    Client, Mosquitto, Node, copy_digits_version, embedded_node_with_http, free_port_pair, get_json, http,
};
use crate::{digits_request, heldout, models_dir};
use serde_json::{Value, json};
use std::collections::{BTreeMap, BTreeSet};
use std::os::unix::net::UnixDatagram;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// A socket standing in for systemd's `NOTIFY_SOCKET`, in `dir`.
fn notify_socket(dir: &Path, timeout: Duration) -> (std::path::PathBuf, UnixDatagram) {
    let path = dir.join("notify");
    let socket = UnixDatagram::bind(&path).unwrap();
    socket.set_read_timeout(Some(timeout)).unwrap();
    (path, socket)
}

/// The next sd_notify message the node sent.
fn notification(socket: &UnixDatagram) -> std::io::Result<String> {
    let mut buf = [0u8; 4096];
    let n = socket.recv(&mut buf)?;
    Ok(String::from_utf8_lossy(&buf[..n]).into_owned())
}

#[test]
fn a_node_waiting_for_its_broker_asks_systemd_for_more_start_time() {
    let dir = tempfile::tempdir().unwrap();
    let (socket_path, socket) = notify_socket(dir.path(), Duration::from_secs(40));
    // Nothing listens there: the broker is down at boot. A config file, so
    // the first-run fallback (an embedded broker) stays off.
    let port = free_port_pair();
    let config = dir.path().join("edgeinfer.toml");
    std::fs::write(&config, "").unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_edgeinfer"))
        .arg("serve")
        .arg("--config")
        .arg(&config)
        .arg("--models-dir")
        .arg(models_dir())
        .env_remove("EDGEINFER_CONFIG")
        .env("NOTIFY_SOCKET", &socket_path)
        .env("EDGEINFER_MQTT__URL", format!("mqtt://127.0.0.1:{port}"))
        .env("EDGEINFER_MQTT__EMBEDDED_BROKER", "false")
        .env("EDGEINFER_HTTP__LISTEN", "")
        .env("EDGEINFER_NODE__STATE_DIR", dir.path().join("state"))
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut seen = Vec::new();
    let text = loop {
        let text = notification(&socket).unwrap_or_else(|e| panic!("{e}; got {seen:?}"));
        assert!(!text.contains("READY=1"), "{text}");
        if text.contains("EXTEND_TIMEOUT_USEC") {
            break text;
        }
        seen.push(text);
    };
    let _ = child.kill();
    let _ = child.wait();
    assert!(
        text.contains("EXTEND_TIMEOUT_USEC=60000000") && text.contains("STATUS=waiting for the broker"),
        "{text}"
    );
}

#[test]
fn sd_notify_says_ready_watchdog_reloading_and_stopping_in_order() {
    let dir = tempfile::tempdir().unwrap();
    let (socket_path, socket) = notify_socket(dir.path(), Duration::from_secs(20));
    let port = free_port_pair();
    // systemd sets WATCHDOG_PID to the service's pid; `exec` keeps the shell's.
    // EDGEINFER_TEST_BIN measures another build's cold start (a release one).
    let bin = std::env::var("EDGEINFER_TEST_BIN").unwrap_or_else(|_| env!("CARGO_BIN_EXE_edgeinfer").into());
    let start = Instant::now();
    let mut child = Command::new("sh")
        .args(["-c", "WATCHDOG_PID=$$ exec \"$0\" serve --models-dir \"$1\"", &bin])
        .arg(models_dir())
        .env_remove("EDGEINFER_CONFIG")
        .env("NOTIFY_SOCKET", &socket_path)
        .env("WATCHDOG_USEC", "400000")
        .env("EDGEINFER_MQTT__URL", format!("mqtt://127.0.0.1:{port}"))
        .env("EDGEINFER_MQTT__EMBEDDED_BROKER", "true")
        .env("EDGEINFER_HTTP__LISTEN", "")
        .env("EDGEINFER_NODE__STATE_DIR", dir.path().join("state"))
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut messages: Vec<String> = Vec::new();
    let receive = |messages: &mut Vec<String>, until: &str| loop {
        let text =
            notification(&socket).unwrap_or_else(|e| panic!("waiting for {until}: {e}; got {messages:?}"));
        let done = text.lines().any(|l| l == until);
        messages.push(text);
        if done {
            return;
        }
    };
    receive(&mut messages, "READY=1");
    let ready_after = start.elapsed();
    assert!(messages[0].contains("STATUS=serving digits v1"), "{messages:?}");
    // The watchdog pets at half of WATCHDOG_USEC once a probe went through.
    receive(&mut messages, "WATCHDOG=1");
    receive(&mut messages, "WATCHDOG=1");
    let kill =
        |sig: &str| Command::new("kill").arg(format!("-{sig}")).arg(child.id().to_string()).status().unwrap();
    kill("HUP");
    receive(&mut messages, "RELOADING=1");
    receive(&mut messages, "READY=1");
    kill("TERM");
    receive(&mut messages, "STOPPING=1");
    assert!(child.wait().unwrap().success(), "exit code 0 after SIGTERM");
    let kinds: Vec<&str> = messages
        .iter()
        .filter_map(|m| {
            m.lines().find(|l| ["READY=1", "WATCHDOG=1", "RELOADING=1", "STOPPING=1"].contains(l))
        })
        .collect();
    let first = |k: &str| kinds.iter().position(|x| *x == k).unwrap();
    let last = |k: &str| kinds.iter().rposition(|x| *x == k).unwrap();
    assert_eq!(kinds[0], "READY=1", "{kinds:?}");
    assert!(first("READY=1") < first("WATCHDOG=1"), "{kinds:?}");
    assert!(
        first("WATCHDOG=1") < first("RELOADING=1") && first("RELOADING=1") < last("READY=1"),
        "{kinds:?}"
    );
    assert_eq!(*kinds.last().unwrap(), "STOPPING=1", "{kinds:?}");
    eprintln!("exec to READY=1: {:.1} ms ({bin}); messages {kinds:?}", ready_after.as_secs_f64() * 1e3);
}

fn row_request(id: usize) -> Vec<u8> {
    let split = heldout();
    let mut px = split[id % split.len()].1.clone();
    px[0] = (id % 17) as f64;
    let mut req = digits_request(&id.to_string(), &[px]);
    req["parameters"] = json!({"cache": false});
    req.to_string().into_bytes()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_under_load_answers_or_leaves_for_redelivery_every_request() {
    let Some(broker) = Mosquitto::start() else { return };
    let state = tempfile::tempdir().unwrap();
    let state_dir = state.path().display().to_string();
    // A long batch window keeps requests in flight when SIGTERM comes.
    let env =
        [("EDGEINFER_NODE__STATE_DIR", state_dir.as_str()), ("EDGEINFER_RUNTIME__MAX_DELAY_US", "20000")];
    let url = broker.url();
    let (u, e) = (url.clone(), env.map(|(k, v)| (k.to_string(), v.to_string())));
    let start = move || {
        let env: Vec<(&str, &str)> = e.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
        Node::start(&u, "gw-l2", &env)
    };
    let start2 = start.clone();
    let mut node = tokio::task::spawn_blocking(start).await.unwrap();
    let mut client = Client::connect(broker.port, "load-l2", &["l2/replies"]).await;
    let n = 600;
    let mut answered: BTreeMap<String, usize> = BTreeMap::new();
    let mut terminated = None;
    for i in 0..n {
        client
            .request(
                "edgeinfer/gw-l2/infer/digits",
                row_request(i),
                "l2/replies",
                i.to_string().as_bytes(),
                None,
            )
            .await;
        tokio::time::sleep(Duration::from_micros(500)).await;
        if i == n / 3 {
            node.signal("TERM");
            terminated = Some(Instant::now());
        }
        while let Ok(p) = client.inbox.try_recv() {
            *answered
                .entry(String::from_utf8_lossy(&p.properties.unwrap().correlation_data.unwrap()).into_owned())
                .or_default() += 1;
        }
    }
    let status = tokio::task::spawn_blocking(move || node.wait(Duration::from_secs(20))).await.unwrap();
    assert!(status.success(), "SIGTERM exits 0: {status:?}");
    eprintln!(
        "drain took {:?}; {} answered before the restart",
        terminated.unwrap().elapsed(),
        answered.len()
    );
    let _node = tokio::task::spawn_blocking(start2).await.unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    while answered.len() < n && Instant::now() < deadline {
        if let Some(p) = client.next(Duration::from_secs(2)).await {
            let reply: Value = serde_json::from_slice(&p.payload).unwrap();
            assert!(reply.get("error").is_none(), "{reply}");
            *answered
                .entry(String::from_utf8_lossy(&p.properties.unwrap().correlation_data.unwrap()).into_owned())
                .or_default() += 1;
        }
    }
    let missing: Vec<usize> = (0..n).filter(|i| !answered.contains_key(&i.to_string())).collect();
    let duplicates = answered.values().filter(|&&c| c > 1).count();
    eprintln!(
        "after the restart: {} of {n} answered, {duplicates} answered twice (at-least-once)",
        answered.len()
    );
    assert!(missing.is_empty(), "lost requests: {missing:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sighup_swaps_in_a_new_version_under_load_and_a_bad_reload_keeps_the_old() {
    let models = tempfile::tempdir().unwrap();
    copy_digits_version(models.path(), "1", false);
    let config = models.path().join("edgeinfer.toml");
    std::fs::write(&config, "[node]\ndrain_timeout_s = 5\n").unwrap();
    let (models_env, config_env) = (models.path().display().to_string(), config.display().to_string());
    let (node, mqtt, http_port) = tokio::task::spawn_blocking(move || {
        embedded_node_with_http(
            "gw-l3",
            &[("EDGEINFER_NODE__MODELS_DIR", &models_env), ("EDGEINFER_CONFIG", &config_env)],
        )
    })
    .await
    .unwrap();
    let mut client = Client::connect(mqtt, "load-l3", &["l3/replies"]).await;
    let mut versions = Vec::new();
    let mut sent = 0;
    let started = Instant::now();
    let mut reloaded = false;
    while started.elapsed() < Duration::from_secs(4) {
        client.request("edgeinfer/gw-l3/infer/digits", row_request(sent), "l3/replies", b"", None).await;
        sent += 1;
        tokio::time::sleep(Duration::from_millis(2)).await;
        if !reloaded && started.elapsed() > Duration::from_secs(1) {
            copy_digits_version(models.path(), "2", false);
            node.signal("HUP");
            reloaded = true;
        }
        while let Ok(p) = client.inbox.try_recv() {
            versions.push(serde_json::from_slice::<Value>(&p.payload).unwrap());
        }
    }
    while versions.len() < sent {
        let (_, reply) = client.next_json().await;
        versions.push(reply);
    }
    let errors: Vec<&Value> = versions.iter().filter(|r| r.get("error").is_some()).collect();
    assert!(errors.is_empty(), "{} errors, first {:?}", errors.len(), errors.first());
    let seen: Vec<&str> = versions.iter().map(|r| r["model_version"].as_str().unwrap()).collect();
    let first_v2 = seen.iter().position(|v| *v == "2").expect("replies switched to version 2");
    assert_eq!(seen[0], "1");
    assert!(
        seen[first_v2..].iter().filter(|v| **v == "1").count() <= 8,
        "a few in flight may finish on v1: {seen:?}"
    );
    assert!(seen[seen.len() - 20..].iter().all(|v| *v == "2"), "the tail is all version 2");
    eprintln!("{sent} requests, 0 errors, first version 2 reply at #{first_v2}");

    // A broken new version and a bad config are refused; version 2 serves on.
    copy_digits_version(models.path(), "3", true);
    node.signal("HUP");
    tokio::time::sleep(Duration::from_millis(1500)).await;
    // A setting only a restart applies: served on as before, and said so.
    std::fs::write(&config, "[node]\ndrain_timeout_s = 5\n[limits]\nmax_packet_bytes = 1000000\n").unwrap();
    node.signal("HUP");
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let mut watcher = Client::connect(mqtt, "watch-l3a", &["edgeinfer/gw-l3/status"]).await;
    let (_, status) = watcher.next_json().await;
    let waiting = status["restart_needed"].as_array().unwrap_or_else(|| panic!("{status}"));
    assert!(waiting.iter().any(|s| s.as_str().unwrap().starts_with("limits.max_packet_bytes")), "{status}");
    drop(watcher);
    std::fs::write(&config, "[runtime]\nmax_batch = 0\n").unwrap();
    node.signal("HUP");
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let req = digits_request("after", &[heldout()[0].1.clone()]).to_string();
    let (status, body) = tokio::task::spawn_blocking(move || {
        http(http_port, "POST", "/v2/models/digits/infer", req.as_bytes(), "application/json")
    })
    .await
    .unwrap();
    let reply: Value = serde_json::from_slice(&body).unwrap();
    assert_eq!((status, reply["model_version"].as_str()), (200, Some("2")), "{reply}");
    let log = node.log.lock().unwrap().join("\n");
    assert!(log.contains("refused") && log.contains("digits/3"), "the bad version is named in the log");
    assert!(log.contains("runtime.max_batch"), "the bad config key is named in the log");
    let mut watcher = Client::connect(mqtt, "watch-l3", &["edgeinfer/gw-l3/status"]).await;
    let (_, status) = watcher.next_json().await;
    let problem = status["reload_error"].as_str().unwrap_or_else(|| panic!("{status}"));
    assert!(
        problem.contains("runtime.max_batch") && !problem.contains('/'),
        "no paths in the status: {problem}"
    );
    let (_, meta) =
        tokio::task::spawn_blocking(move || get_json(http_port, "/v2/models/digits")).await.unwrap();
    let versions: BTreeSet<&str> =
        meta["versions"].as_array().unwrap().iter().map(|v| v.as_str().unwrap()).collect();
    assert_eq!(versions, BTreeSet::from(["1", "2"]), "{meta}");

    // Version 1 removed: its info gauge goes to 0, version 2's stays 1.
    std::fs::write(&config, "[node]\ndrain_timeout_s = 5\n").unwrap();
    std::fs::remove_dir_all(models.path().join("digits/1")).unwrap();
    node.signal("HUP");
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let metrics = tokio::task::spawn_blocking(move || super::support::scrape(http_port)).await.unwrap();
    let info = |version: &str| {
        super::support::sample(
            &metrics,
            &["edgeinfer_model_info{", "model=\"digits\"", &format!("version=\"{version}\"")],
        )
    };
    assert_eq!((info("1"), info("2")), (0.0, 1.0), "{metrics}");
}

#[cfg(feature = "failpoints")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_unfinished_at_the_drain_timeout_are_redelivered_to_the_next_node() {
    let Some(broker) = Mosquitto::start() else { return };
    let state = tempfile::tempdir().unwrap();
    let state_dir = state.path().display().to_string();
    let url = broker.url();
    // A one-second delay holds every request past a zero drain timeout.
    let (u, s) = (url.clone(), state_dir.clone());
    let mut slow = tokio::task::spawn_blocking(move || {
        Node::start(
            &u,
            "gw-l4",
            &[
                ("EDGEINFER_NODE__STATE_DIR", &s),
                ("FAILPOINTS", "request_delay=return(1000)"),
                ("EDGEINFER_NODE__DRAIN_TIMEOUT_S", "0"),
            ],
        )
    })
    .await
    .unwrap();
    let mut client = Client::connect(broker.port, "load-l4", &["l4/replies"]).await;
    for i in 0..5 {
        client
            .request(
                "edgeinfer/gw-l4/infer/digits",
                row_request(i),
                "l4/replies",
                i.to_string().as_bytes(),
                None,
            )
            .await;
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    let stopped_at = Instant::now();
    slow.signal("TERM");
    let (status, slow) =
        tokio::task::spawn_blocking(move || (slow.wait(Duration::from_secs(5)), slow)).await.unwrap();
    assert!(status.success(), "{status:?}");
    assert!(stopped_at.elapsed() < Duration::from_millis(900), "it did not wait for the requests");
    assert!(client.next(Duration::from_millis(100)).await.is_none(), "nothing was answered before the stop");
    let log = slow.log.lock().unwrap().join("\n");
    assert!(log.contains("5 unfinished"), "{log}");

    let _next = tokio::task::spawn_blocking(move || {
        Node::start(&url, "gw-l4", &[("EDGEINFER_NODE__STATE_DIR", &state_dir)])
    })
    .await
    .unwrap();
    let mut answered = BTreeSet::new();
    while answered.len() < 5 {
        let p = client.next(Duration::from_secs(20)).await.expect("the redelivered requests are answered");
        answered
            .insert(String::from_utf8_lossy(&p.properties.unwrap().correlation_data.unwrap()).into_owned());
    }
    assert_eq!(answered, (0..5).map(|i| i.to_string()).collect());
}
