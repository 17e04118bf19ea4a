//! Issue 41: OpenTelemetry traces on real binaries, received by a real OTLP
//! decoder (tests/otlp/receiver.py: the OpenTelemetry project's protobuf
//! definitions, PyPI `opentelemetry-proto`), which writes each span it
//! decoded as a JSON line.

use super::cascade::wait_http;
use super::support::{Client, embedded_node_with_http, free_port_pair, sample, scrape};
use crate::{digits_request, heldout};
use rumqttc::v5::mqttbytes::QoS;
use rumqttc::v5::mqttbytes::v5::{Publish, PublishProperties};
use serde_json::{Value, json};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The receiver, stopped on drop.
pub struct Receiver {
    child: Child,
    pub url: String,
    out: PathBuf,
    _dir: tempfile::TempDir,
}

impl Receiver {
    /// A receiver answering each export `sleep_s` late; `None` (a failure
    /// under CI=true) without Python's opentelemetry-proto.
    pub fn start(sleep_s: f64) -> Option<Receiver> {
        let python = std::env::var("OTLP_PYTHON").unwrap_or_else(|_| "python3".into());
        let import = "import opentelemetry.proto.collector.trace.v1.trace_service_pb2";
        let found = Command::new(&python).args(["-c", import]).status().is_ok_and(|s| s.success());
        if !found {
            crate::skipped("Python's opentelemetry-proto is not installed (pip install opentelemetry-proto)");
            return None;
        }
        let dir = tempfile::tempdir().unwrap();
        let (out, port_file) = (dir.path().join("spans.jsonl"), dir.path().join("port"));
        let child = Command::new(python)
            .arg(concat!(env!("CARGO_MANIFEST_DIR"), "/tests/otlp/receiver.py"))
            .arg("--out")
            .arg(&out)
            .arg("--port-file")
            .arg(&port_file)
            .arg("--sleep")
            .arg(sleep_s.to_string())
            .stdin(Stdio::null())
            .spawn()
            .unwrap();
        let started = Instant::now();
        let port = loop {
            if let Ok(port) = std::fs::read_to_string(&port_file) {
                break port;
            }
            assert!(started.elapsed() < Duration::from_secs(20), "the OTLP receiver did not start");
            std::thread::sleep(Duration::from_millis(50));
        };
        let url = format!("http://127.0.0.1:{}/v1/traces", port.trim());
        Some(Receiver { child, url, out, _dir: dir })
    }

    /// Every span received so far; an export it could not decode fails the test.
    pub fn spans(&self) -> Vec<Value> {
        let text = std::fs::read_to_string(&self.out).unwrap_or_default();
        // The receiver may be writing a line now: only whole lines count.
        let whole = &text[..text.rfind('\n').map_or(0, |end| end + 1)];
        let spans: Vec<Value> = whole.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
        if let Some(bad) = spans.iter().find(|s| s.get("error").is_some()) {
            panic!("the receiver could not decode an export: {bad}");
        }
        spans
    }

    /// The spans of `trace_id`, once `done` says they are all there.
    pub fn trace(&self, trace_id: &str, done: impl Fn(&[Value]) -> bool) -> Vec<Value> {
        let started = Instant::now();
        loop {
            let spans: Vec<Value> = self.spans().into_iter().filter(|s| s["trace_id"] == trace_id).collect();
            if done(&spans) {
                return spans;
            }
            assert!(
                started.elapsed() < Duration::from_secs(20),
                "trace {trace_id} is incomplete after 20 s: {}",
                names(&spans).join(", ")
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Receiver {
    fn drop(&mut self) {
        self.kill();
    }
}

fn names(spans: &[Value]) -> Vec<String> {
    spans.iter().map(|s| format!("{}@{}", s["name"], s["resource"]["service.instance.id"])).collect()
}

/// The span named `name` on node `node` (the only one).
fn one<'a>(spans: &'a [Value], name: &str, node: &str) -> &'a Value {
    let found: Vec<&Value> =
        spans.iter().filter(|s| s["name"] == name && s["resource"]["service.instance.id"] == node).collect();
    assert_eq!(found.len(), 1, "one {name} span of {node} in {:?}", names(spans));
    found[0]
}

fn has(spans: &[Value], name: &str, node: &str) -> bool {
    spans.iter().any(|s| s["name"] == name && s["resource"]["service.instance.id"] == node)
}

/// `child` nests under `parent`: its parent id, and inside its time.
fn assert_nested(child: &Value, parent: &Value) {
    assert_eq!(child["parent_span_id"], parent["span_id"], "{} under {}", child["name"], parent["name"]);
    let (start, end) = (child["start"].as_u64().unwrap(), child["end"].as_u64().unwrap());
    assert!(start <= end, "{child}");
    assert!(
        start >= parent["start"].as_u64().unwrap() && end <= parent["end"].as_u64().unwrap(),
        "{} [{start}, {end}] lies inside {} [{}, {}]",
        child["name"],
        parent["name"],
        parent["start"],
        parent["end"]
    );
}

/// The environment of a traced node exporting to `receiver`.
fn traced<'a>(receiver: &'a Receiver, ratio: &'a str, headers: &'a str) -> Vec<(&'a str, &'a str)> {
    vec![
        ("EDGEINFER_TRACING__ENABLED", "true"),
        ("EDGEINFER_TRACING__ENDPOINT", receiver.url.as_str()),
        ("EDGEINFER_TRACING__SAMPLE_RATIO", ratio),
        ("EDGEINFER_TRACING__HEADERS_FILE", headers),
    ]
}

/// Publishes `id` (held-out row `i`) for `digits` with `parameters`, and
/// a `traceparent` user property where given.
async fn send(client: &Client, id: &str, i: usize, parameters: Value, traceparent: Option<&str>) {
    let split = heldout();
    let mut req = digits_request(id, &[split[i % split.len()].1.clone()]);
    req["parameters"] = parameters;
    send_raw(client, id, req.to_string().into_bytes(), traceparent).await;
}

async fn send_raw(client: &Client, id: &str, payload: Vec<u8>, traceparent: Option<&str>) {
    let props = PublishProperties {
        response_topic: Some("dev/t/replies".into()),
        correlation_data: Some(bytes::Bytes::copy_from_slice(id.as_bytes())),
        user_properties: traceparent
            .map(|t| ("traceparent".to_string(), t.to_string()))
            .into_iter()
            .collect(),
        ..Default::default()
    };
    let topic = "edgeinfer/edge/infer/digits";
    client.client.publish_with_properties(topic, QoS::AtLeastOnce, false, payload, props).await.unwrap();
}

/// The reply's `traceresponse` user property: (trace id, root span id, exported).
fn traceresponse(reply: &Publish) -> (String, String, bool) {
    let props = reply.properties.as_ref().expect("reply properties");
    let value = props
        .user_properties
        .iter()
        .find(|(k, _)| k == "traceresponse")
        .map(|(_, v)| v.clone())
        .unwrap_or_else(|| panic!("no traceresponse on the reply: {props:?}"));
    let parts: Vec<&str> = value.split('-').collect();
    assert_eq!((parts.len(), parts[0]), (4, "00"), "{value}");
    (parts[1].to_string(), parts[2].to_string(), parts[3] == "01")
}

async fn reply(client: &mut Client) -> (Publish, Value) {
    let p = client.next(Duration::from_secs(20)).await.expect("a reply within 20 s");
    let v = serde_json::from_slice(&p.payload).unwrap();
    (p, v)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_is_one_trace_from_the_device_through_the_edge_and_the_cloud_tier() {
    let Some(receiver) = Receiver::start(0.0) else { return };
    let dir = tempfile::tempdir().unwrap();
    let headers = dir.path().join("otlp-headers");
    std::fs::write(&headers, "# the collector's key\nX-Api-Key: trace-secret\n").unwrap();
    let headers = headers.display().to_string();
    // Both nodes sample no new trace: what is exported here is the
    // device's sampled trace (parent-based) and the keep rule.
    let cloud_port = free_port_pair();
    let listen = format!("127.0.0.1:{cloud_port}");
    let mut env = traced(&receiver, "0", &headers);
    env.push(("EDGEINFER_HTTP__LISTEN", &listen));
    let (_cloud, _, _) = tokio::task::block_in_place(|| embedded_node_with_http("cloud", &env));
    tokio::task::block_in_place(|| wait_http(cloud_port));
    let cloud_url = format!("http://127.0.0.1:{cloud_port}");
    let failpoints = "request_delay=return(slow-1:300);request_panic=return(panic-1)";
    let mut env = traced(&receiver, "0", &headers);
    env.extend([
        ("EDGEINFER_CLOUD__ENABLED", "true"),
        ("EDGEINFER_CLOUD__URL", cloud_url.as_str()),
        ("EDGEINFER_MODELS__DIGITS__CLOUD_MODEL", "digits-large"),
        ("EDGEINFER_MODELS__DIGITS__THRESHOLD", "1.0"),
        ("EDGEINFER_TRACING__SLOW_MS", "200"),
    ]);
    if cfg!(feature = "failpoints") {
        env.push(("FAILPOINTS", failpoints));
    }
    let (edge, port, _) = tokio::task::block_in_place(|| embedded_node_with_http("edge", &env));
    let mut client = Client::connect(port, "dev-t", &["dev/t/replies"]).await;

    // 1. A device's sampled trace, escalated synchronously: one trace
    // across the device, the edge and the cloud tier.
    let trace_id = "4bf92f3577b34da6a3ce929d0e0e4736";
    let device_span = "00f067aa0ba902b7";
    let traceparent = format!("00-{trace_id}-{device_span}-01");
    send(&client, "sync-1", 0, json!({}), Some(&traceparent)).await;
    let (p, v) = reply(&mut client).await;
    assert_eq!(v["parameters"]["served_by"], "cloud", "{v}");
    let (replied_trace, replied_root, exported) = traceresponse(&p);
    assert_eq!((replied_trace.as_str(), exported), (trace_id, true));
    let spans = tokio::task::block_in_place(|| {
        receiver.trace(trace_id, |s| has(s, "infer", "edge") && has(s, "infer", "cloud"))
    });
    let root = one(&spans, "infer", "edge");
    assert_eq!(root["span_id"], replied_root.as_str(), "the reply names the root span");
    assert_eq!(root["parent_span_id"], device_span, "the device's span is the parent");
    assert_eq!(root["kind"], 2, "a server span");
    assert_eq!(root["attributes"]["edgeinfer.model"], "digits");
    assert_eq!(root["attributes"]["edgeinfer.code"], "ok");
    assert_eq!(root["attributes"]["edgeinfer.served_by"], "cloud");
    assert_eq!(root["attributes"]["edgeinfer.node"], "edge");
    assert_eq!(root["attributes"]["edgeinfer.tier"], "standard");
    assert_eq!(root["attributes"]["edgeinfer.cache"], "miss");
    assert_eq!(root["resource"]["service.name"], "edgeinfer");
    assert_eq!(root["headers"]["x-api-key"], "trace-secret", "headers_file's headers go with each export");
    for stage in [
        "decode",
        "resolve",
        "preprocess",
        "cache.lookup",
        "queue",
        "inference",
        "postprocess",
        "cascade",
        "reply.publish",
    ] {
        assert_nested(one(&spans, stage, "edge"), root);
    }
    let lookup = one(&spans, "cache.lookup", "edge");
    for layer in ["cache.memory", "cache.disk"] {
        let span = one(&spans, layer, "edge");
        assert_nested(span, lookup);
        assert_eq!(span["attributes"]["edgeinfer.cache.result"], "miss");
    }
    let inference = one(&spans, "inference", "edge");
    assert_eq!(inference["attributes"]["edgeinfer.batch.requests"], 1);
    let call = one(&spans, "cloud.call", "edge");
    assert_nested(call, one(&spans, "cascade", "edge"));
    assert_eq!(call["kind"], 3, "a client span");
    assert_eq!(call["attributes"]["edgeinfer.cloud.outcome"], "ok");
    // The cloud tier continued the trace under the edge's call.
    let cloud_root = one(&spans, "infer", "cloud");
    assert_eq!(cloud_root["parent_span_id"], call["span_id"]);
    assert_nested(one(&spans, "inference", "cloud"), cloud_root);

    // 2. An async escalation: its follow-up joins the request's trace.
    let async_trace = "0af7651916cd43dd8448eb211c80319c";
    let traceparent = format!("00-{async_trace}-b7ad6b7169203331-01");
    send(&client, "async-1", 1, json!({"enrich": "async", "cache": false}), Some(&traceparent)).await;
    let (first, v) = reply(&mut client).await;
    assert_eq!(v["parameters"]["final"], false, "{v}");
    let (_, v) = reply(&mut client).await;
    assert_eq!(
        (v["parameters"]["final"].as_bool(), v["parameters"]["served_by"].as_str()),
        (Some(true), Some("cloud"))
    );
    let (_, async_root, _) = traceresponse(&first);
    let spans = tokio::task::block_in_place(|| {
        receiver.trace(async_trace, |s| {
            has(s, "infer", "edge") && has(s, "follow_up", "edge") && has(s, "infer", "cloud")
        })
    });
    let root = one(&spans, "infer", "edge");
    assert_eq!(root["span_id"], async_root.as_str());
    let follow_up = one(&spans, "follow_up", "edge");
    assert_eq!(follow_up["parent_span_id"], root["span_id"], "the follow-up nests under its request");
    assert!(
        follow_up["links"].as_array().unwrap().iter().any(|l| l["span_id"] == root["span_id"]),
        "{follow_up}"
    );
    let call = one(&spans, "cloud.call", "edge");
    assert_nested(call, follow_up);
    assert_eq!(one(&spans, "infer", "cloud")["parent_span_id"], call["span_id"]);

    // 3. At ratio 0, with no trace from the device: a fast success is not
    // exported; an error reply and a slow request are.
    send(&client, "fast-1", 2, json!({"tier": "fast"}), None).await;
    let (p, _) = reply(&mut client).await;
    let (fast_trace, _, exported) = traceresponse(&p);
    assert!(!exported, "a fast success at ratio 0 is not exported");
    send_raw(&client, "bad-1", br#"{"id": "bad-1", "inputs": []}"#.to_vec(), None).await;
    let (p, v) = reply(&mut client).await;
    assert_eq!(v["parameters"]["code"], "invalid_input", "{v}");
    let (bad_trace, _, exported) = traceresponse(&p);
    assert!(exported, "an error reply is exported");
    let spans = tokio::task::block_in_place(|| receiver.trace(&bad_trace, |s| has(s, "infer", "edge")));
    let root = one(&spans, "infer", "edge");
    assert_eq!(root["status"], 2, "an error status: {root}");
    assert_eq!(root["attributes"]["edgeinfer.code"], "invalid_input");
    let mut last = bad_trace;
    if cfg!(feature = "failpoints") {
        send(&client, "slow-1", 3, json!({"tier": "fast", "cache": false}), None).await;
        let (p, v) = reply(&mut client).await;
        assert_eq!(v["parameters"]["served_by"], "edge", "{v}");
        let (slow_trace, _, exported) = traceresponse(&p);
        assert!(exported, "a request slower than slow_ms is exported");
        let spans = tokio::task::block_in_place(|| receiver.trace(&slow_trace, |s| has(s, "infer", "edge")));
        let root = one(&spans, "infer", "edge");
        let took_ms = (root["end"].as_u64().unwrap() - root["start"].as_u64().unwrap()) / 1_000_000;
        assert!(took_ms >= 300, "the slow request's root span took {took_ms} ms");
        assert_eq!(root["attributes"]["edgeinfer.code"], "ok");
        assert_eq!(root["attributes"]["edgeinfer.tier"], "fast");
        // 4. Log lines name the trace: an unsampled request's panic by a
        // field of its own, a sampled request's lines by their span.
        let sampled_panic = "5bf92f3577b34da6a3ce929d0e0e4736";
        let traceparent = format!("00-{sampled_panic}-00f067aa0ba902b7-01");
        let mut panics = Vec::new();
        for caller in [None, Some(traceparent.as_str())] {
            send(&client, "panic-1", 4, json!({"tier": "fast"}), caller).await;
            let (p, v) = reply(&mut client).await;
            assert_eq!(v["parameters"]["code"], "internal", "{v}");
            panics.push(traceresponse(&p).0);
        }
        assert_eq!(panics[1], sampled_panic);
        for (panic_trace, shown) in panics.iter().zip(["trace_id=", "request{trace_id="]) {
            let needle = format!("{shown}{panic_trace}");
            tokio::task::block_in_place(|| edge.wait_for_line(&needle, Duration::from_secs(10)));
            let logged =
                edge.log.lock().unwrap().iter().any(|l| l.contains("panicked") && l.contains(&needle));
            assert!(logged, "the panic's log line names trace {panic_trace} as {needle}");
        }
        last = panics[0].clone();
    }
    // The exporter keeps the order traces ended in: once the last one is
    // in, the fast one would have been too.
    tokio::task::block_in_place(|| receiver.trace(&last, |s| has(s, "infer", "edge")));
    assert!(
        receiver.spans().iter().all(|s| s["trace_id"] != fast_trace.as_str()),
        "the fast success's trace was not exported"
    );
}

/// Sends `n` requests, `in_flight` at a time: each reply's latency; panics
/// on an error reply.
async fn load(client: &mut Client, prefix: &str, n: usize, in_flight: usize) -> Vec<Duration> {
    let mut sent = std::collections::HashMap::new();
    let mut latencies = Vec::new();
    let mut next = 0;
    while latencies.len() < n {
        while next < n && sent.len() < in_flight {
            let id = format!("{prefix}-{next}");
            sent.insert(id.clone(), Instant::now());
            send(client, &id, next, json!({"cache": false}), None).await;
            next += 1;
        }
        let (p, v) = reply(client).await;
        assert!(v["parameters"]["code"].is_null(), "an error reply: {v}");
        let id = String::from_utf8(p.properties.unwrap().correlation_data.unwrap().to_vec()).unwrap();
        latencies.push(sent.remove(&id).expect("a reply to a request sent").elapsed());
    }
    latencies
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_or_dead_collector_costs_dropped_spans_and_never_a_reply() {
    // Each export is answered 3 s late, past the node's 2 s timeout: a reply
    // that waited on an export would take 2 s or more.
    let Some(mut receiver) = Receiver::start(3.0) else { return };
    let mut env = traced(&receiver, "1", "");
    env.retain(|(k, _)| *k != "EDGEINFER_TRACING__HEADERS_FILE");
    env.extend([("EDGEINFER_TRACING__TIMEOUT_MS", "2000"), ("EDGEINFER_TRACING__QUEUE_SPANS", "64")]);
    let (_edge, port, http_port) = tokio::task::block_in_place(|| embedded_node_with_http("edge", &env));
    let mut client = Client::connect(port, "dev-t", &["dev/t/replies"]).await;
    let dropped = |reason: &str| {
        let scrape = scrape(http_port);
        let needle = format!("reason=\"{reason}\"");
        if scrape.contains(&needle) {
            sample(&scrape, &["edgeinfer_trace_spans_dropped_total", &needle])
        } else {
            0.0
        }
    };

    // Every request is sampled and the collector is slow: the queue fills.
    let slow = load(&mut client, "slow", 300, 8).await;
    let worst = slow.iter().max().unwrap();
    assert!(*worst < Duration::from_millis(1500), "a reply waited {worst:?} behind a 3 s collector");
    let full = tokio::task::block_in_place(|| dropped("queue_full"));
    assert!(full > 0.0, "spans dropped with the queue full: {full}");
    // The first export (after the 500 ms batch window) times out 2 s later.
    let started = Instant::now();
    while tokio::task::block_in_place(|| dropped("export_failed")) == 0.0 {
        assert!(started.elapsed() < Duration::from_secs(10), "no spans of a timed-out export dropped");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    // The collector is gone: its spans are dropped, the replies go on.
    receiver.kill();
    tokio::time::sleep(Duration::from_secs(1)).await;
    let before = tokio::task::block_in_place(|| dropped("queue_full") + dropped("export_failed"));
    let down = load(&mut client, "down", 300, 8).await;
    let worst = down.iter().max().unwrap();
    assert!(*worst < Duration::from_millis(1500), "a reply waited {worst:?} with the collector down");
    tokio::time::sleep(Duration::from_secs(1)).await;
    let after = tokio::task::block_in_place(|| dropped("queue_full") + dropped("export_failed"));
    assert!(after >= before + 300.0, "each of 300 traces dropped spans: {before} then {after}");
}
