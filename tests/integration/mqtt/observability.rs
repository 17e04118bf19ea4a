//! /metrics, the HTTP v2 endpoints and readiness, on a real node.

use super::labelled_request;
use super::support::{
    Client, Mosquitto, Node, embedded_node_with_http, free_port_pair, get_json, http, node_with_http, sample,
};
use serde_json::{Value, json};
use std::io::Write;
use std::time::{Duration, Instant};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_count_exactly_the_requests_served_and_pass_promtool() {
    let (_node, port, http_port) = embedded_node_with_http("gw-o1", &[]);
    let mut c = Client::connect(port, "dev-o1", &["devices/o1/replies"]).await;
    let n = 25;
    for i in 0..n {
        let (payload, _) = labelled_request(&format!("o1-{i}"), i);
        c.request("edgeinfer/gw-o1/infer/digits", payload, "devices/o1/replies", b"o", None).await;
    }
    for _ in 0..3 {
        c.request("edgeinfer/gw-o1/infer/digits", b"{nope".to_vec(), "devices/o1/replies", b"o", None).await;
    }
    for _ in 0..n + 3 {
        c.next_json().await;
    }
    let (status, body) = http(http_port, "GET", "/metrics", b"", "text/plain");
    assert_eq!(status, 200);
    let scrape = String::from_utf8(body).unwrap();
    let ok = ["edgeinfer_requests_total{", "model=\"digits\"", "transport=\"mqtt\"", "outcome=\"ok\""];
    assert_eq!(sample(&scrape, &ok), n as f64);
    let bad = ["edgeinfer_requests_total{", "transport=\"mqtt\"", "outcome=\"invalid_payload\""];
    assert_eq!(sample(&scrape, &bad), 3.0);
    let count = |stage: &str| {
        sample(
            &scrape,
            &["edgeinfer_stage_duration_seconds_count{", "model=\"digits\"", &format!("stage=\"{stage}\"")],
        )
    };
    assert_eq!(count("end_to_end"), (n + 3) as f64);
    for stage in ["preprocess", "cache_lookup", "queue", "inference", "postprocess"] {
        assert_eq!(count(stage), n as f64, "{stage}");
    }
    assert_eq!(sample(&scrape, &["edgeinfer_batch_rows_sum{", "model=\"digits\""]), n as f64, "rows batched");
    // Buckets resolve tens of microseconds.
    assert!(scrape.contains("le=\"0.00002\""), "{scrape}");
    // The latency SLO buckets deploy/prometheus/edgeinfer-rules.yml reads, as written there.
    for le in ["0.01", "0.1"] {
        let bucket = format!("le=\"{le}\"");
        assert!(
            scrape.lines().any(|l| l.contains("stage=\"end_to_end\"") && l.contains(&bucket)),
            "{le}: {scrape}"
        );
    }
    assert_eq!(sample(&scrape, &["edgeinfer_model_versions_refused"]), 0.0);
    assert_eq!(sample(&scrape, &["edgeinfer_mqtt_connected"]), 1.0);
    assert_eq!(sample(&scrape, &["edgeinfer_model_info{", "model=\"digits\"", "quantization=\"int8\""]), 1.0);
    assert_eq!(
        sample(&scrape, &["edgeinfer_build_info{", "target=\"x86_64-unknown-linux", "version=\""]),
        1.0
    );
    assert!(!scrape.contains("git_sha=\"unknown\""), "a git checkout records its commit");
    assert!(sample(&scrape, &["edgeinfer_process_resident_memory_bytes"]) > 1e6);

    let promtool = ["/usr/bin/promtool", "/usr/local/bin/promtool"]
        .into_iter()
        .find(|p| std::path::Path::new(p).exists());
    match promtool {
        Some(promtool) => {
            let mut child = std::process::Command::new(promtool)
                .args(["check", "metrics"])
                .stdin(std::process::Stdio::piped())
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::piped())
                .spawn()
                .unwrap();
            child.stdin.take().unwrap().write_all(scrape.as_bytes()).unwrap();
            let out = child.wait_with_output().unwrap();
            let said =
                format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
            assert!(out.status.success(), "promtool check metrics: {said}");
            assert!(said.trim().is_empty(), "promtool has remarks: {said}");
        }
        None => crate::skipped("promtool is not installed (apt-get install prometheus)"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_infer_answers_like_mqtt_and_errors_get_oip_json_with_status_codes() {
    let (_node, port, http_port) =
        embedded_node_with_http("gw-o2", &[("EDGEINFER_LIMITS__MAX_PAYLOAD_BYTES", "4096")]);
    let (payload, label) = labelled_request("o2", 7);
    let mut c = Client::connect(port, "dev-o2", &["devices/o2/replies"]).await;
    c.request("edgeinfer/gw-o2/infer/digits", payload.clone(), "devices/o2/replies", b"o", None).await;
    let (_, over_mqtt) = c.next_json().await;
    let (status, body) = http(http_port, "POST", "/v2/models/digits/infer", &payload, "application/json");
    assert_eq!(status, 200);
    let over_http: Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(over_http["outputs"], over_mqtt["outputs"], "same outputs over both transports");
    assert_eq!(over_http["parameters"]["label"], label);
    let (status, body) =
        http(http_port, "POST", "/v2/models/digits/versions/1/infer", &payload, "application/json");
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));

    // Requested outputs are honoured; an unknown one is invalid_input.
    let mut req: Value = serde_json::from_slice(&payload).unwrap();
    req["outputs"] = json!([{"name": "nope"}]);
    let (status, body) =
        http(http_port, "POST", "/v2/models/digits/infer", req.to_string().as_bytes(), "application/json");
    assert_eq!(status, 400);
    assert_eq!(serde_json::from_slice::<Value>(&body).unwrap()["parameters"]["code"], "invalid_input");

    let (status, body) = http(http_port, "POST", "/v2/models/nope/infer", &payload, "application/json");
    assert_eq!(status, 404);
    let err: Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(err["parameters"]["code"], "unknown_model");
    assert!(err["error"].as_str().unwrap().contains("nope"));
    let (status, body) =
        http(http_port, "POST", "/v2/models/digits/infer", b"{\"inputs\": [", "application/json");
    assert_eq!(status, 400);
    assert_eq!(serde_json::from_slice::<Value>(&body).unwrap()["parameters"]["code"], "invalid_payload");
    let big = vec![b' '; 10_000];
    let (status, body) = http(http_port, "POST", "/v2/models/digits/infer", &big, "application/json");
    assert_eq!(status, 413);
    assert_eq!(serde_json::from_slice::<Value>(&body).unwrap()["parameters"]["code"], "too_large");

    // Refused before the pipeline, still counted; junk model names share one label.
    let (_, body) = http(http_port, "GET", "/metrics", b"", "text/plain");
    let scrape = String::from_utf8(body).unwrap();
    let too_large =
        ["edgeinfer_requests_total{", "model=\"digits\"", "transport=\"http\"", "outcome=\"too_large\""];
    assert_eq!(sample(&scrape, &too_large), 1.0);
    let junk = ["edgeinfer_requests_total{", "model=\"unknown\"", "outcome=\"unknown_model\""];
    assert_eq!(sample(&scrape, &junk), 1.0);
    assert!(!scrape.contains("model=\"nope\""), "unknown names never become labels");

    let (status, meta) = get_json(http_port, "/v2/models/digits");
    assert_eq!(status, 200);
    assert_eq!(meta["name"], "digits");
    assert_eq!(meta["versions"], json!(["1"]));
    assert_eq!(meta["inputs"][0], json!({"name": "input", "datatype": "FP32", "shape": [-1, 64]}));
    assert_eq!(meta["outputs"][0]["name"], "probabilities");
    assert_eq!(get_json(http_port, "/v2/models/nope").0, 404);
    assert_eq!(get_json(http_port, "/v2/models/digits/ready").0, 200);
    assert_eq!(get_json(http_port, "/v2/health/live"), (200, json!({"live": true})));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readiness_follows_the_mqtt_session() {
    let Some(broker) = Mosquitto::start() else { return };
    let port = broker.port;
    let (node, http_port) = node_with_http(&broker.url(), "gw-o3", &[]);
    assert_eq!(get_json(http_port, "/v2/health/ready").0, 200);
    drop(broker);
    let wait_for = |want: u16| {
        let start = Instant::now();
        while get_json(http_port, "/v2/health/ready").0 != want {
            assert!(start.elapsed() < Duration::from_secs(20), "readiness never became {want}");
            std::thread::sleep(Duration::from_millis(100));
        }
    };
    wait_for(503);
    let (_, body) = get_json(http_port, "/v2/health/ready");
    assert_eq!(body["mqtt_connected"], false);
    assert_eq!(get_json(http_port, "/v2/health/live").0, 200, "alive while not ready");
    let _broker = Mosquitto::start_on(port).unwrap();
    node.wait_for_line("MQTT connected", Duration::from_secs(15));
    wait_for(200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stats_messages_and_the_refreshed_status_carry_counts_rates_and_percentiles() {
    let port = free_port_pair();
    let _node = Node::start(
        &format!("mqtt://127.0.0.1:{port}"),
        "gw-o4",
        &[
            ("EDGEINFER_MQTT__EMBEDDED_BROKER", "true"),
            ("EDGEINFER_TELEMETRY__STATS_INTERVAL_S", "1"),
            ("EDGEINFER_LOG_FORMAT", "json"),
        ],
    );
    let mut c = Client::connect(port, "dev-o4", &["devices/o4/replies"]).await;
    for i in 0..5 {
        let (payload, _) = labelled_request(&format!("o4-{i}"), i);
        c.request("edgeinfer/gw-o4/infer/digits", payload, "devices/o4/replies", b"o", None).await;
        c.next_json().await;
    }
    let mut fleet =
        Client::connect(port, "fleet-o4", &["edgeinfer/gw-o4/stats", "edgeinfer/gw-o4/status"]).await;
    let deadline = Instant::now() + Duration::from_secs(15);
    let (mut saw_stats, mut saw_status) = (false, false);
    while !(saw_stats && saw_status) {
        assert!(Instant::now() < deadline, "stats {saw_stats}, refreshed status {saw_status}");
        let (p, body) = fleet.next_json().await;
        match std::str::from_utf8(&p.topic).unwrap() {
            "edgeinfer/gw-o4/stats" => {
                let digits = &body["models"]["digits"];
                assert_eq!(body["interval_s"], 1);
                if digits["requests"].as_u64() == Some(5) {
                    assert!(digits["p50_ms"].as_f64().unwrap() > 0.0, "{body}");
                    assert!(digits["p99_ms"].as_f64() >= digits["p50_ms"].as_f64());
                    assert!(digits["rate_rps"].as_f64().unwrap() > 0.0);
                    saw_stats = true;
                }
                assert_eq!(digits["requests_total"], 5, "{body}");
            }
            _ => {
                assert_eq!(body["state"], "online");
                assert!(body["uptime_s"].is_u64(), "{body}");
                if body["requests"]["digits"] == 5 {
                    saw_status = true;
                }
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn json_logs_are_one_object_a_line() {
    let port = free_port_pair();
    let node = Node::start(
        &format!("mqtt://127.0.0.1:{port}"),
        "gw-o5",
        &[("EDGEINFER_MQTT__EMBEDDED_BROKER", "true"), ("EDGEINFER_LOG_FORMAT", "json")],
    );
    let log = node.log.lock().unwrap().clone();
    assert!(log.len() >= 2);
    for line in &log {
        let v: Value = serde_json::from_str(line).unwrap_or_else(|e| panic!("not JSON ({e}): {line}"));
        assert!(v["level"].is_string() && v["fields"]["message"].is_string(), "{line}");
    }
}

/// Issue 19: with the default batching policy (`max_delay_us = 2000`), a
/// lone request on an idle model is not held for a window: the node's own
/// queue-stage histogram puts them under a millisecond (a window would put
/// each at 2 ms or more).
#[test]
fn a_lone_request_waits_for_no_batch_window_by_default() {
    let (_node, _, port) = embedded_node_with_http("gw-o9", &[]);
    let n = 20;
    for i in 0..n {
        let (payload, _) = labelled_request(&format!("lone-{i}"), i);
        let mut request: Value = serde_json::from_slice(&payload).unwrap();
        request["parameters"] = json!({"cache": false});
        super::support::infer_digits(port, &request);
    }
    let metrics = super::support::scrape(port);
    let queue = |le: &str| {
        sample(
            &metrics,
            &[
                "stage_duration_seconds_bucket{",
                "model=\"digits\"",
                "stage=\"queue\"",
                &format!("le=\"{le}\""),
            ],
        )
    };
    let total = sample(&metrics, &["stage_duration_seconds_count{", "model=\"digits\"", "stage=\"queue\""]);
    assert!(total >= n as f64, "{total}");
    // A 2 ms window would put every one above 2 ms; a machine loaded by the
    // rest of the suite delays some threads' wake-ups (seen: 3 of 20), so
    // most, not all, must start within 1 ms.
    assert!(queue("0.001") >= total / 2.0, "{} of {total} started within 1 ms", queue("0.001"));
}
