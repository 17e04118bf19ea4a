//! One node with its embedded broker (rumqttd): the wire contract end to end.

use super::labelled_request;
use super::support::{Client, Client311, Node, free_port_pair};
use crate::{digits_request, heldout};
use edgeinfer::protocol::TensorData;
use edgeinfer::protocol::postcard::{WireReply, WireRequest};
use serde_json::{Value, json};
use std::collections::HashMap;
use std::time::Duration;

fn embedded_node(id: &str, env: &[(&str, &str)]) -> (Node, u16) {
    let port = free_port_pair();
    let mut all = vec![("EDGEINFER_MQTT__EMBEDDED_BROKER", "true")];
    all.extend_from_slice(env);
    (Node::start(&format!("mqtt://127.0.0.1:{port}"), id, &all), port)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mqtt5_round_trip_postcard_multi_row_and_status() {
    let (_node, port) = embedded_node("gw-e1", &[]);
    let mut c = Client::connect(port, "dev-e1", &["devices/e1/replies", "edgeinfer/gw-e1/status"]).await;
    let (_, status) = c.next_json().await;
    assert_eq!(status["state"], "online", "{status}");
    assert_eq!(status["node"], "gw-e1");
    assert!(
        status["models"]
            .as_array()
            .unwrap()
            .iter()
            .any(|m| m["name"] == "digits" && m["sha256"].as_str().unwrap().len() == 64)
    );

    // Binary correlation data comes back unchanged, with the content type.
    let correlation = [0u8, 255, 1, 128, 7];
    let (payload, label) = labelled_request("e1-1", 5);
    c.request(
        "edgeinfer/gw-e1/infer/digits",
        payload,
        "devices/e1/replies",
        &correlation,
        Some("application/json"),
    )
    .await;
    let (reply, body) = c.next_json().await;
    let props = reply.properties.clone().unwrap();
    assert_eq!(props.correlation_data.as_deref(), Some(&correlation[..]));
    assert_eq!(props.content_type.as_deref(), Some("application/json"));
    assert_eq!(body["id"], "e1-1");
    assert_eq!(body["parameters"]["label"], label);
    assert_eq!(body["parameters"]["node"], "gw-e1");

    // Several rows in one request.
    let rows: Vec<Vec<f64>> = heldout().iter().take(3).map(|(_, px)| px.clone()).collect();
    let payload = digits_request("e1-multi", &rows).to_string().into_bytes();
    c.request("edgeinfer/gw-e1/infer/digits-large", payload, "devices/e1/replies", b"m", None).await;
    let (_, body) = c.next_json().await;
    assert_eq!(body["outputs"][0]["shape"], json!([3, 10]));
    assert_eq!(body["model_name"], "digits-large");

    // Postcard in, postcard out.
    let (label, px) = &heldout()[9];
    let mut wire = WireRequest::from(
        serde_json::from_value::<edgeinfer::protocol::InferRequest>(digits_request(
            "e1-pc",
            std::slice::from_ref(px),
        ))
        .unwrap(),
    );
    wire.inputs[0].data = TensorData::F32(px.iter().map(|&x| x as f32).collect());
    let bytes = postcard::to_stdvec(&wire).unwrap();
    c.request(
        "edgeinfer/gw-e1/infer/digits",
        bytes,
        "devices/e1/replies",
        b"pc",
        Some("application/x-postcard"),
    )
    .await;
    let reply = c.next(Duration::from_secs(20)).await.unwrap();
    assert_eq!(reply.properties.unwrap().content_type.as_deref(), Some("application/x-postcard"));
    match postcard::from_bytes::<WireReply>(&reply.payload).unwrap() {
        WireReply::Ok(r) => {
            assert_eq!(r.id, "e1-pc");
            assert_eq!(r.label, Some(label.to_string()));
        }
        other => panic!("{other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mqtt311_client_gets_its_reply_on_reply_to() {
    let (_node, port) = embedded_node("gw-e2", &[]);
    // The embedded broker serves MQTT 3.1.1 on the next port.
    let mut c = Client311::connect(port + 1, "dev-e2", "devices/e2/replies").await;
    let (payload, label) = labelled_request("e2-1", 11);
    let mut req: Value = serde_json::from_slice(&payload).unwrap();
    req["reply_to"] = json!("devices/e2/replies");
    c.client
        .publish("edgeinfer/gw-e2/infer/digits", rumqttc::QoS::AtLeastOnce, false, req.to_string())
        .await
        .unwrap();
    let reply = tokio::time::timeout(Duration::from_secs(20), c.inbox.recv()).await.unwrap().unwrap();
    let body: Value = serde_json::from_slice(&reply.payload).unwrap();
    assert_eq!(body["id"], "e2-1");
    assert_eq!(body["parameters"]["label"], label);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_inputs_get_their_error_codes_and_the_node_keeps_serving() {
    let (_node, port) = embedded_node("gw-e3", &[("EDGEINFER_LIMITS__MAX_PAYLOAD_BYTES", "8192")]);
    let mut c = Client::connect(port, "dev-e3", &["devices/e3/replies"]).await;
    let (good, _) = labelled_request("good", 0);
    let good: Value = serde_json::from_slice(&good).unwrap();
    let with = |f: &dyn Fn(&mut Value)| {
        let mut v = good.clone();
        f(&mut v);
        v.to_string().into_bytes()
    };
    let big: Vec<Vec<f64>> = heldout().iter().take(100).map(|(_, px)| px.clone()).collect();
    // (what, model, payload, content type, expected code)
    type Case<'a> = (&'a str, &'a str, Vec<u8>, Option<&'a str>, &'a str);
    let table: Vec<Case> = vec![
        ("invalid json", "digits", b"{\"inputs\": [".to_vec(), None, "invalid_payload"),
        ("empty payload", "digits", vec![], None, "invalid_payload"),
        ("wrong shape", "digits", with(&|v| v["inputs"][0]["shape"] = json!([1, 63])), None, "invalid_input"),
        (
            "shape/data mismatch",
            "digits",
            with(&|v| v["inputs"][0]["shape"] = json!([2, 64])),
            None,
            "invalid_input",
        ),
        (
            "wrong datatype",
            "digits",
            with(&|v| v["inputs"][0]["datatype"] = json!("INT8")),
            None,
            "invalid_input",
        ),
        (
            "non-numeric data",
            "digits",
            with(&|v| v["inputs"][0]["data"][5] = json!("x")),
            None,
            "invalid_input",
        ),
        ("unknown model", "nope", with(&|_| {}), None, "unknown_model"),
        ("dot-dot model", "..", with(&|_| {}), None, "unknown_model"),
        (
            "oversized payload",
            "digits",
            digits_request("big", &big).to_string().into_bytes(),
            None,
            "too_large",
        ),
        ("undecodable postcard", "digits", vec![0xff; 16], Some("application/x-postcard"), "invalid_payload"),
    ];
    for (i, (what, model, payload, content_type, code)) in table.into_iter().enumerate() {
        let topic = format!("edgeinfer/gw-e3/infer/{model}");
        let corr = format!("bad-{i}");
        c.request(&topic, payload, "devices/e3/replies", corr.as_bytes(), content_type).await;
        let reply = c.next(Duration::from_secs(20)).await.unwrap_or_else(|| panic!("{what}: no reply"));
        assert_eq!(
            reply.properties.as_ref().unwrap().correlation_data.as_deref(),
            Some(corr.as_bytes()),
            "{what}"
        );
        let code_got = match content_type {
            Some(_) => match postcard::from_bytes::<WireReply>(&reply.payload).unwrap() {
                WireReply::Err(e) => e.code,
                other => panic!("{what}: {other:?}"),
            },
            None => {
                let body: Value = serde_json::from_slice(&reply.payload).unwrap();
                assert!(body["error"].as_str().is_some_and(|s| s.len() > 10), "{what}: {body}");
                body["parameters"]["code"].as_str().unwrap().to_string()
            }
        };
        assert_eq!(code_got, code, "{what}");
        // The node still answers a good request.
        c.request(
            "edgeinfer/gw-e3/infer/digits",
            good.to_string().into_bytes(),
            "devices/e3/replies",
            b"g",
            None,
        )
        .await;
        let (_, body) = c.next_json().await;
        assert_eq!(body["id"], "good", "after {what}");
    }

    // No reply topic at all: not processed, no reply anywhere, node fine.
    let mut watcher = Client::connect(port, "dev-e3-watch", &["#"]).await;
    c.client
        .publish(
            "edgeinfer/gw-e3/infer/digits",
            rumqttc::v5::mqttbytes::QoS::AtLeastOnce,
            false,
            good.to_string(),
        )
        .await
        .unwrap();
    let mut saw_request = false;
    while let Some(p) = watcher.next(Duration::from_millis(1500)).await {
        match std::str::from_utf8(&p.topic).unwrap() {
            "edgeinfer/gw-e3/infer/digits" => saw_request = true,
            "edgeinfer/gw-e3/status" => {}
            other => panic!("a request without a reply topic got a reply on {other}"),
        }
    }
    assert!(saw_request, "the watcher saw the request itself");
    c.request(
        "edgeinfer/gw-e3/infer/digits",
        good.to_string().into_bytes(),
        "devices/e3/replies",
        b"g2",
        None,
    )
    .await;
    let (_, body) = c.next_json().await;
    assert_eq!(body["id"], "good");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_thousand_concurrent_requests_from_four_clients_are_each_answered_once() {
    let (_node, port) = embedded_node("gw-e4", &[]);
    let mut clients = Vec::new();
    for k in 0..4 {
        clients
            .push(Client::connect(port, &format!("load-{k}"), &[&format!("devices/load-{k}/replies")]).await);
    }
    for (k, c) in clients.iter().enumerate() {
        for i in 0..250 {
            let id = format!("c{k}-{i}");
            let (payload, _) = labelled_request(&id, k * 250 + i);
            c.request(
                "edgeinfer/gw-e4/infer/digits",
                payload,
                &format!("devices/load-{k}/replies"),
                id.as_bytes(),
                None,
            )
            .await;
        }
    }
    for (k, c) in clients.iter_mut().enumerate() {
        let mut seen: HashMap<String, usize> = HashMap::new();
        while seen.len() < 250 {
            let (reply, body) = c.next_json().await;
            let id = body["id"].as_str().unwrap().to_string();
            assert_eq!(reply.properties.unwrap().correlation_data.as_deref(), Some(id.as_bytes()));
            assert!(id.starts_with(&format!("c{k}-")), "client {k} got {id}");
            assert!(body["outputs"].is_array(), "{body}");
            *seen.entry(id).or_default() += 1;
        }
        assert!(seen.values().all(|&n| n == 1));
        assert!(c.next(Duration::from_millis(300)).await.is_none(), "client {k} got a duplicate reply");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flood_beyond_the_queue_gets_overloaded_answers_and_nothing_is_lost() {
    let (_node, port) = embedded_node("gw-e5", &[("EDGEINFER_RUNTIME__QUEUE_CAPACITY", "1")]);
    let mut c = Client::connect(port, "dev-e5", &["devices/e5/replies"]).await;
    for i in 0..300 {
        let id = format!("f-{i}");
        let (payload, _) = labelled_request(&id, i);
        c.request("edgeinfer/gw-e5/infer/digits-large", payload, "devices/e5/replies", id.as_bytes(), None)
            .await;
    }
    let mut codes: HashMap<String, usize> = HashMap::new();
    let mut ids: HashMap<String, usize> = HashMap::new();
    while ids.len() < 300 {
        let (_, body) = c.next_json().await;
        *ids.entry(body["id"].as_str().unwrap().to_string()).or_default() += 1;
        let code = body["parameters"]["code"].as_str().unwrap_or("ok").to_string();
        *codes.entry(code).or_default() += 1;
    }
    assert!(ids.values().all(|&n| n == 1));
    assert!(codes.get("overloaded").copied().unwrap_or(0) > 0, "{codes:?}");
    assert!(codes.get("ok").copied().unwrap_or(0) > 0, "{codes:?}");
    assert_eq!(codes.keys().filter(|k| *k != "ok" && *k != "overloaded").count(), 0, "{codes:?}");
    eprintln!("flood of 300 with queue_capacity 1: {codes:?}");
}

fn bench(args: &[&str]) -> Value {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_edgeinfer"))
        .arg("bench")
        .args(args)
        .args(["--json", "--duration", "1", "--warmup", "0.2"])
        .env_remove("EDGEINFER_CONFIG")
        .output()
        .unwrap();
    assert!(out.status.success(), "bench failed: {}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bench_measures_a_node_in_closed_and_open_loop() {
    let (_node, port) = embedded_node("gw-e6", &[]);
    let url = format!("mqtt://127.0.0.1:{port}");
    let closed = bench(&["--url", &url, "--node", "gw-e6", "--connections", "2", "-C", "4"]);
    assert_eq!(closed["mode"], "closed");
    assert!(closed["requests"].as_u64().unwrap() > 10, "{closed}");
    assert_eq!(closed["errors"], 0, "{closed}");
    let l = &closed["latency_us"];
    assert!(
        l["p50"].as_u64().unwrap() > 0
            && l["p50"].as_u64() <= l["p99"].as_u64()
            && l["p99"].as_u64() <= l["max"].as_u64()
    );
    let open = bench(&["--url", &url, "--node", "gw-e6", "--rate", "200"]);
    assert_eq!(open["mode"], "open");
    let n = open["requests"].as_u64().unwrap();
    assert!((100..=320).contains(&n), "about 200 requests in 1 s at 200 req/s: {open}");
    // A wrong model is counted as errors, not as successes.
    let wrong = bench(&["--url", &url, "--node", "gw-e6", "--model", "nope", "-C", "2"]);
    assert_eq!(wrong["errors"], wrong["requests"], "{wrong}");
}

/// The node as a library: started in-process from a `Config`, it answers
/// over its embedded broker, and a stop signal drains it to `offline`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_started_in_process_serves_then_drains_on_stop() {
    use edgeinfer::lifecycle::{ReloadSource, Signal};
    use edgeinfer::model::{Registry, RuntimeOptions};
    let port = free_port_pair();
    let state = tempfile::tempdir().unwrap();
    let mut config = edgeinfer::config::Config::default();
    config.node.id = "gw-inproc".into();
    config.node.models_dir = crate::models_dir();
    config.node.state_dir = state.path().to_path_buf();
    config.mqtt.url = format!("mqtt://127.0.0.1:{port}");
    config.mqtt.embedded_broker = true;
    config.http.listen = String::new();
    // The metrics recorder is process-wide; the other tests run binaries.
    config.telemetry.metrics = false;
    let runtime = RuntimeOptions { batch_sizes: config.runtime.batch_sizes.clone(), defer: false };
    let registry = Registry::load(&config.node.models_dir, &runtime).unwrap();
    let source = ReloadSource { config_file: None, models_dir: None };
    let node = edgeinfer::node::Node::start(config, registry, source).await.unwrap();
    let (signals, received) = tokio::sync::mpsc::unbounded_channel();
    let running = tokio::spawn(node.run(received));

    let mut c =
        Client::connect(port, "dev-inproc", &["devices/inproc/replies", "edgeinfer/gw-inproc/status"]).await;
    let (_, status) = c.next_json().await;
    assert_eq!(status["state"], "online", "{status}");
    let (payload, label) = labelled_request("inproc-1", 3);
    c.request("edgeinfer/gw-inproc/infer/digits", payload, "devices/inproc/replies", b"c1", None).await;
    // The status topic may carry a refresh in between: read by topic.
    let body = loop {
        let (publish, body) = c.next_json().await;
        if &publish.topic[..] == b"devices/inproc/replies" {
            break body;
        }
    };
    assert_eq!(body["id"], "inproc-1", "{body}");
    assert_eq!(body["parameters"]["label"], label, "{body}");

    signals.send(Signal::Stop("test")).unwrap();
    tokio::time::timeout(Duration::from_secs(20), running).await.expect("drained within 20 s").unwrap();
    let mut states = Vec::new();
    while states.last() != Some(&"offline".to_string()) {
        let (_, status) = c.next_json().await;
        states.push(status["state"].as_str().unwrap().to_string());
    }
    states.dedup();
    assert!(states.ends_with(&["draining".to_string(), "offline".to_string()]), "{states:?}");
    assert!(states.iter().rev().skip(2).all(|s| s == "online"), "{states:?}");
}
