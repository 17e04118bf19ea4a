//! One node with its embedded broker (rumqttd): the wire contract end to end.

use super::labelled_request;
use super::support::{Client, Client311, Node, embedded_node_with_http, free_port_pair, sample, scrape};
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
    let (rss, peak) = (status["rss_bytes"].as_u64().unwrap(), status["peak_rss_bytes"].as_u64().unwrap());
    assert!(rss > 1 << 20 && peak >= rss, "resident memory now and at its peak: {status}");
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
    let port = free_port_pair();
    let v311 = format!("127.0.0.1:{}", port + 1);
    let _node = Node::start(
        &format!("mqtt://127.0.0.1:{port}"),
        "gw-e2",
        &[("EDGEINFER_MQTT__EMBEDDED_BROKER", "true"), ("EDGEINFER_MQTT__EMBEDDED_V311_LISTEN", &v311)],
    );
    // The embedded broker serves MQTT 3.1.1 on its own listener, when asked.
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

/// The distinct `model` label values in a scrape.
fn model_labels(scrape: &str) -> std::collections::BTreeSet<String> {
    scrape.lines().filter_map(|l| l.split("model=\"").nth(1)?.split('"').next().map(str::to_string)).collect()
}

/// A postcard `digits` request with `bad` as one pixel.
fn postcard_with(bad: f32) -> Vec<u8> {
    let (_, px) = &heldout()[0];
    let request = serde_json::from_value::<edgeinfer::protocol::InferRequest>(digits_request(
        "pc-bad",
        std::slice::from_ref(px),
    ))
    .unwrap();
    let mut wire = WireRequest::from(request);
    let mut data: Vec<f32> = px.iter().map(|&x| x as f32).collect();
    data[3] = bad;
    wire.inputs[0].data = TensorData::F32(data);
    postcard::to_stdvec(&wire).unwrap()
}

/// A well-formed JSON request of exactly `size` bytes, id first.
fn json_of_size(id: &str, size: usize) -> Vec<u8> {
    let head = format!(
        "{{\"id\":\"{id}\",\"inputs\":[{{\"name\":\"input\",\"shape\":[1,64],\"datatype\":\"FP32\",\"data\":["
    );
    let tail = "0]}]}";
    let mut out = head.into_bytes();
    while out.len() + tail.len() + 2 <= size {
        out.extend_from_slice(b"0,");
    }
    out.resize(size - tail.len(), b' ');
    out.extend_from_slice(tail.as_bytes());
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_inputs_get_their_error_codes_and_the_node_keeps_serving() {
    let (_node, port, http_port) = embedded_node_with_http(
        "gw-e3",
        &[
            ("EDGEINFER_LIMITS__MAX_PAYLOAD_BYTES", "8192"),
            ("EDGEINFER_LIMITS__MAX_PACKET_BYTES", "8388608"),
            ("EDGEINFER_MQTT__REPLY_PREFIXES", "[\"devices\"]"),
        ],
    );
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
        (
            "NaN in postcard data",
            "digits",
            postcard_with(f32::NAN),
            Some("application/x-postcard"),
            "invalid_input",
        ),
        (
            "infinity in postcard data",
            "digits",
            postcard_with(f32::INFINITY),
            Some("application/x-postcard"),
            "invalid_input",
        ),
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

    // Between max_payload_bytes and max_packet_bytes: `too_large`, naming
    // both limits, without the payload being decoded.
    let packet_room = 8 * 1024 * 1024 - 1024;
    for (what, size) in [("1 MB", 1 << 20), ("6 MB", 6 << 20), ("just under max_packet_bytes", packet_room)] {
        let corr = format!("big-{size}");
        c.request(
            "edgeinfer/gw-e3/infer/digits",
            json_of_size(what, size),
            "devices/e3/replies",
            corr.as_bytes(),
            None,
        )
        .await;
        let reply = c.next(Duration::from_secs(30)).await.unwrap_or_else(|| panic!("{what}: no reply"));
        assert_eq!(reply.properties.unwrap().correlation_data.as_deref(), Some(corr.as_bytes()), "{what}");
        let body: Value = serde_json::from_slice(&reply.payload).unwrap();
        assert_eq!(
            (body["id"].as_str(), body["parameters"]["code"].as_str()),
            (Some(what), Some("too_large"))
        );
        let error = body["error"].as_str().unwrap();
        assert!(
            error.contains("limits.max_payload_bytes = 8192")
                && error.contains("limits.max_packet_bytes = 8388608"),
            "{what}: {error}"
        );
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

    // Reply topics a device may not use: the broker's, the fleet's (this
    // node's status), and anything outside mqtt.reply_prefixes. No
    // publish (rumqttd refuses `$SYS/#` subscriptions, so the counter
    // stands for that one), each counted, the node fine.
    for topic in ["$SYS/broker/uptime", "edgeinfer/gw-e3/status", "elsewhere/replies"] {
        c.request("edgeinfer/gw-e3/infer/digits", good.to_string().into_bytes(), topic, b"r", None).await;
    }
    while let Some(p) = watcher.next(Duration::from_millis(1500)).await {
        let topic = std::str::from_utf8(&p.topic).unwrap().to_string();
        assert!(topic.contains("/infer/"), "a refused reply topic got a publish on {topic}");
    }
    let metrics = tokio::task::spawn_blocking(move || scrape(http_port)).await.unwrap();
    let refused = "edgeinfer_mqtt_reply_topics_refused_total";
    for reason in ["system", "reserved", "not_allowed"] {
        let reason_label = format!("reason=\"{reason}\"");
        assert_eq!(sample(&metrics, &[refused, &reason_label]), 1.0, "{reason}");
    }

    // 10,000 distinct unknown model names: each answered, and the metric
    // label set stays as it was (they are all `unknown`).
    let models_before = model_labels(&metrics);
    for i in 0..10_000 {
        let topic = format!("edgeinfer/gw-e3/infer/no-such-model-{i}");
        c.request(&topic, good.to_string().into_bytes(), "devices/e3/replies", b"u", None).await;
    }
    for i in 0..10_000 {
        let (_, body) = c.next_json().await;
        assert_eq!(body["parameters"]["code"], "unknown_model", "reply {i}: {body}");
    }
    let metrics = tokio::task::spawn_blocking(move || scrape(http_port)).await.unwrap();
    let models_after = model_labels(&metrics);
    assert!(models_after.len() <= models_before.len() + 1, "{models_before:?} -> {models_after:?}");
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
    let runtime = RuntimeOptions {
        batch_sizes: config.runtime.batch_sizes.clone(),
        defer: false,
        ..Default::default()
    };
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_embedded_broker_requires_the_configured_login() {
    // It starts only once the node itself logged in and subscribed.
    let (_node, port) = embedded_node(
        "gw-e9",
        &[("EDGEINFER_MQTT__USERNAME", "site"), ("EDGEINFER_MQTT__PASSWORD", "s3cret-login")],
    );
    // What a client gets back from its CONNECT: a CONNACK, or an error.
    async fn connack(port: u16, login: Option<(&str, &str)>) -> Result<(), String> {
        use rumqttc::v5::mqttbytes::v5::Packet;
        let mut options = rumqttc::v5::MqttOptions::new("dev-e9", "127.0.0.1", port);
        if let Some((user, password)) = login {
            options.set_credentials(user, password);
        }
        let (_client, mut eventloop) = rumqttc::v5::AsyncClient::new(options, 8);
        match tokio::time::timeout(Duration::from_secs(5), eventloop.poll()).await {
            Ok(Ok(rumqttc::v5::Event::Incoming(Packet::ConnAck(_)))) => Ok(()),
            other => Err(format!("{other:?}")),
        }
    }
    assert!(connack(port, None).await.is_err(), "an anonymous client is refused");
    assert!(connack(port, Some(("site", "wrong"))).await.is_err(), "a wrong password is refused");
    assert_eq!(connack(port, Some(("site", "s3cret-login"))).await, Ok(()));
}

/// Issue 39, item 1: rumqttd 0.20.0 left Nagle on the sockets it accepts,
/// so each round trip through the embedded broker waited ~40 ms on delayed
/// ACKs; the vendored copy sets TCP_NODELAY (Cargo.toml, `[patch.crates-io]`).
/// Counted, not timed against a margin: with Nagle on, nearly every round
/// trip stalls for a delayed ACK (Linux's floor is 40 ms; the unpatched
/// broker's median was 44 ms), so the test counts the round trips that took
/// 35 ms or more and allows a few for a loaded CI machine (whose slowest
/// round trip without Nagle was 15 ms).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_round_trip_through_the_embedded_broker_takes_no_nagle_delay() {
    let (_node, port) = embedded_node("gw-nodelay", &[]);
    let mut c = Client::connect(port, "dev-nodelay", &["devices/nodelay/replies"]).await;
    let mut round_trips = Vec::new();
    for i in 0..21 {
        let (payload, _) = labelled_request(&format!("nd-{i}"), i);
        let sent = std::time::Instant::now();
        c.request("edgeinfer/gw-nodelay/infer/digits", payload, "devices/nodelay/replies", b"n", None).await;
        let (_, reply) = c.next_json().await;
        assert_eq!(reply["id"], format!("nd-{i}"), "{reply}");
        // The first one also warms the caches and plans: not counted.
        if i > 0 {
            round_trips.push(sent.elapsed());
        }
    }
    round_trips.sort();
    let median = round_trips[round_trips.len() / 2];
    let stalled = round_trips.iter().filter(|t| **t >= Duration::from_millis(35)).count();
    eprintln!(
        "20 round trips through the embedded broker: median {median:?}, max {:?}, {stalled} stalled for a delayed ACK",
        round_trips.last()
    );
    assert!(stalled <= 4, "{stalled} of 20 round trips waited for a delayed ACK: {round_trips:?}");
}
