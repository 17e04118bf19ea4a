//! The node against mosquitto, the site broker the contract is tested on:
//! persistence across a node crash, broker restarts, the last will, shared
//! subscriptions, and the README's mosquitto_rr example.

use super::labelled_request;
use super::support::{Client, Client311, Mosquitto, Node};
use serde_json::{Value, json};
use std::collections::HashMap;
use std::time::{Duration, Instant};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn round_trips_for_mqtt5_and_311_and_the_readme_mosquitto_rr_example() {
    let Some(broker) = Mosquitto::start() else { return };
    let _node = Node::start(&broker.url(), "gw-m1", &[]);
    let mut c = Client::connect(broker.port, "dev-m1", &["devices/m1/replies"]).await;
    let (payload, label) = labelled_request("m1-1", 2);
    c.request(
        "edgeinfer/gw-m1/infer/digits",
        payload.clone(),
        "devices/m1/replies",
        &[9, 0, 9],
        Some("application/json"),
    )
    .await;
    let (reply, body) = c.next_json().await;
    assert_eq!(reply.properties.unwrap().correlation_data.as_deref(), Some(&[9u8, 0, 9][..]));
    assert_eq!(body["parameters"]["label"], label);

    let mut old = Client311::connect(broker.port, "dev-m1-311", "devices/m1-311/replies").await;
    let mut req: Value = serde_json::from_slice(&payload).unwrap();
    req["reply_to"] = json!("devices/m1-311/replies");
    req["id"] = json!("m1-311");
    old.client
        .publish("edgeinfer/gw-m1/infer/digits", rumqttc::QoS::AtLeastOnce, false, req.to_string())
        .await
        .unwrap();
    let reply = tokio::time::timeout(Duration::from_secs(20), old.inbox.recv()).await.unwrap().unwrap();
    let body: Value = serde_json::from_slice(&reply.payload).unwrap();
    assert_eq!(body["id"], "m1-311");

    // The README's example, as written (with the port of this broker).
    if std::path::Path::new("/usr/bin/mosquitto_rr").exists() {
        let request = std::fs::read_to_string(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/docs/examples/digits-request.json"
        ))
        .unwrap();
        let out = std::process::Command::new("mosquitto_rr")
            .args(["-h", "127.0.0.1", "-p", &broker.port.to_string(), "-t", "edgeinfer/gw-m1/infer/digits"])
            .args(["-e", "devices/cam-3/replies", "-m", request.trim(), "-W", "10"])
            .output()
            .unwrap();
        let body: Value = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
            panic!("mosquitto_rr printed {:?}: {e}", String::from_utf8_lossy(&out.stdout))
        });
        assert_eq!(body["id"], "req-17");
        assert_eq!(body["parameters"]["label"], "7");
    } else {
        eprintln!("SKIPPED (README example): mosquitto_rr is not installed");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_published_while_the_node_is_down_are_all_answered_after_restart() {
    let Some(broker) = Mosquitto::start() else { return };
    let mut node = Node::start(&broker.url(), "gw-m2", &[]);
    let mut status = Client::connect(broker.port, "fleet-m2", &["edgeinfer/gw-m2/status"]).await;
    let (_, s) = status.next_json().await;
    assert_eq!(s["state"], "online");
    let mut c = Client::connect(broker.port, "dev-m2", &["devices/m2/replies"]).await;

    node.kill9();
    // The last will turns the retained status offline.
    let (_, s) = status.next_json().await;
    assert_eq!(s["state"], "offline", "{s}");
    let mut late = Client::connect(broker.port, "fleet-m2-late", &["edgeinfer/gw-m2/status"]).await;
    let (retained, s) = late.next_json().await;
    assert!(retained.retain, "status is retained");
    assert_eq!(s["state"], "offline");

    for i in 0..100 {
        let id = format!("down-{i}");
        let (payload, _) = labelled_request(&id, i);
        c.request("edgeinfer/gw-m2/infer/digits", payload, "devices/m2/replies", id.as_bytes(), None).await;
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    let _node = Node::start(&broker.url(), "gw-m2", &[]);
    let mut answered: HashMap<String, usize> = HashMap::new();
    while answered.len() < 100 {
        let (_, body) = c.next_json().await;
        *answered.entry(body["id"].as_str().unwrap().to_string()).or_default() += 1;
    }
    assert!((0..100).all(|i| answered.contains_key(&format!("down-{i}"))));
    let (_, s) = late.next_json().await;
    assert_eq!(s["state"], "online");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_node_serves_again_within_seconds_of_a_broker_restart() {
    let Some(broker) = Mosquitto::start() else { return };
    let port = broker.port;
    let node = Node::start(&broker.url(), "gw-m3", &[]);
    drop(broker);
    std::thread::sleep(Duration::from_millis(500));
    let restarted_at = Instant::now();
    let broker = Mosquitto::start_on(port).unwrap();
    node.wait_for_line("MQTT connected", Duration::from_secs(15));
    let reconnect = restarted_at.elapsed();
    let mut c = Client::connect(broker.port, "dev-m3", &["devices/m3/replies"]).await;
    let (payload, label) = labelled_request("m3", 4);
    c.request("edgeinfer/gw-m3/infer/digits", payload, "devices/m3/replies", b"m3", None).await;
    let (_, body) = c.next_json().await;
    assert_eq!(body["parameters"]["label"], label);
    assert!(reconnect < Duration::from_secs(10), "reconnected after {reconnect:?}");
    eprintln!("node reconnected {reconnect:?} after the broker came back");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_nodes_in_one_share_group_split_requests_and_answer_each_once() {
    let Some(broker) = Mosquitto::start() else { return };
    let _a = Node::start(&broker.url(), "gw-ma", &[]);
    let _b = Node::start(&broker.url(), "gw-mb", &[]);
    let mut c = Client::connect(broker.port, "dev-m4", &["devices/m4/replies"]).await;
    for i in 0..200 {
        let id = format!("s-{i}");
        let (payload, _) = labelled_request(&id, i);
        c.request("edgeinfer/infer/digits", payload, "devices/m4/replies", id.as_bytes(), None).await;
    }
    let mut by_node: HashMap<String, usize> = HashMap::new();
    let mut ids: HashMap<String, usize> = HashMap::new();
    while ids.len() < 200 {
        let (_, body) = c.next_json().await;
        *ids.entry(body["id"].as_str().unwrap().to_string()).or_default() += 1;
        *by_node.entry(body["parameters"]["node"].as_str().unwrap().to_string()).or_default() += 1;
    }
    assert!(c.next(Duration::from_millis(500)).await.is_none(), "a request was answered twice");
    assert!(ids.values().all(|&n| n == 1));
    assert!(
        by_node.get("gw-ma").copied().unwrap_or(0) > 0 && by_node.get("gw-mb").copied().unwrap_or(0) > 0,
        "{by_node:?}"
    );
    eprintln!("share group split: {by_node:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_publishes_offline_and_exits_0() {
    let Some(broker) = Mosquitto::start() else { return };
    let mut node = Node::start(&broker.url(), "gw-m5", &[]);
    let mut status = Client::connect(broker.port, "fleet-m5", &["edgeinfer/gw-m5/status"]).await;
    let (_, s) = status.next_json().await;
    assert_eq!(s["state"], "online");
    let code = node.terminate();
    assert!(code.success(), "exit {code:?}");
    let (_, s) = status.next_json().await;
    assert_eq!(s["state"], "offline");
}
