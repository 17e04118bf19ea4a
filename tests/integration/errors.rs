//! Every error code that can arise without a transport, through `Engine::handle`,
//! and a good request answered right after each bad one.

use crate::{digits_request, heldout, models_dir};
use edgeinfer::config::LimitsConfig;
use edgeinfer::engine::{Engine, EngineOptions, Envelope, Reply};
use edgeinfer::model::{Registry, RuntimeOptions};
use edgeinfer::protocol::postcard::{WireReply, WireRequest};
use edgeinfer::protocol::{Encoding, ErrorCode, InferRequest, TensorData, codec};
use serde_json::{Value, json};
use std::sync::Arc;

fn engine(options: EngineOptions) -> Engine {
    let registry = Registry::load(&models_dir(), &RuntimeOptions::default()).unwrap();
    Engine::new(Arc::new(registry), options, edgeinfer::engine::Cache::off())
}

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap()
}

fn handle(engine: &Engine, model: &str, payload: &[u8]) -> (Reply, Value) {
    let handled = rt().block_on(engine.handle(Envelope::model(model), payload, Encoding::Json));
    let reply: Value = serde_json::from_slice(&handled.payload).unwrap();
    (handled, reply)
}

fn good_payload() -> Vec<u8> {
    let (_, px) = &heldout()[0];
    digits_request("good", std::slice::from_ref(px)).to_string().into_bytes()
}

/// Asserts the error reply's code, that its sentence names `field`, and that
/// the engine still answers a good request afterwards.
fn expect_error(engine: &Engine, model: &str, payload: &[u8], code: ErrorCode, field: &str) {
    let (handled, reply) = handle(engine, model, payload);
    assert_eq!(handled.outcome, Err(code), "reply: {reply}");
    assert_eq!(reply["parameters"]["code"], code.as_str(), "reply: {reply}");
    let sentence = reply["error"].as_str().unwrap();
    assert!(sentence.contains(field), "error {sentence:?} should name {field:?}");
    assert!(reply.get("outputs").is_none());
    let (after, good) = handle(engine, "digits", &good_payload());
    assert_eq!(after.outcome, Ok(()), "good request after a bad one: {good}");
    assert_eq!(good["model_name"], "digits");
}

fn with_input(f: impl FnOnce(&mut Value)) -> Vec<u8> {
    let (_, px) = &heldout()[0];
    let mut req = digits_request("bad", std::slice::from_ref(px));
    f(&mut req["inputs"][0]);
    req.to_string().into_bytes()
}

#[test]
fn invalid_payload() {
    let e = engine(EngineOptions::default());
    expect_error(&e, "digits", b"{\"inputs\": [", ErrorCode::InvalidPayload, "not valid JSON");
    expect_error(&e, "digits", b"", ErrorCode::InvalidPayload, "empty");
    expect_error(&e, "digits", b"[1, 2, 3]", ErrorCode::InvalidPayload, "JSON object");
    expect_error(&e, "digits", b"{\"id\": \"x\"}", ErrorCode::InvalidPayload, "inputs");
    expect_error(
        &e,
        "digits",
        br#"{"inputs": [], "parameters": {"tier": "ultra"}}"#,
        ErrorCode::InvalidPayload,
        "parameters.tier",
    );
}

#[test]
fn invalid_input() {
    let e = engine(EngineOptions::default());
    expect_error(
        &e,
        "digits",
        &with_input(|i| i["shape"] = json!([1, 65])),
        ErrorCode::InvalidInput,
        "inputs[0].shape",
    );
    expect_error(
        &e,
        "digits",
        &with_input(|i| i["shape"] = json!([64])),
        ErrorCode::InvalidInput,
        "inputs[0].shape",
    );
    expect_error(
        &e,
        "digits",
        &with_input(|i| i["shape"] = json!([2, 64])),
        ErrorCode::InvalidInput,
        "inputs[0].data",
    );
    expect_error(
        &e,
        "digits",
        &with_input(|i| i["datatype"] = json!("INT32")),
        ErrorCode::InvalidInput,
        "inputs[0].datatype",
    );
    expect_error(
        &e,
        "digits",
        &with_input(|i| i["datatype"] = json!("FLOAT")),
        ErrorCode::InvalidInput,
        "inputs[0].datatype",
    );
    expect_error(
        &e,
        "digits",
        &with_input(|i| i["data"][3] = json!("seven")),
        ErrorCode::InvalidInput,
        "inputs[0].data[3]",
    );
    expect_error(
        &e,
        "digits",
        &with_input(|i| i["data"][0] = json!(1e300)),
        ErrorCode::InvalidInput,
        "inputs[0].data",
    );
    expect_error(
        &e,
        "digits",
        &with_input(|i| i["name"] = json!("pixels")),
        ErrorCode::InvalidInput,
        "inputs[0].name",
    );
    let mut req: Value = serde_json::from_slice(&good_payload()).unwrap();
    req["outputs"] = json!([{"name": "logits"}]);
    expect_error(&e, "digits", req.to_string().as_bytes(), ErrorCode::InvalidInput, "outputs[0].name");
}

#[test]
fn unknown_model() {
    let e = engine(EngineOptions::default());
    for name in ["nope", "..", ".", "digits/../digits", "+", "#", "digits+", ""] {
        expect_error(&e, name, &good_payload(), ErrorCode::UnknownModel, "model");
    }
    let mut req: Value = serde_json::from_slice(&good_payload()).unwrap();
    req["parameters"] = json!({"model_version": "9"});
    expect_error(
        &e,
        "digits",
        req.to_string().as_bytes(),
        ErrorCode::UnknownModel,
        "parameters.model_version",
    );
}

#[test]
fn too_large() {
    let limits = LimitsConfig { max_payload_bytes: 4096, max_rows: 4, ..LimitsConfig::default() };
    let e = engine(EngineOptions { limits, ..Default::default() });
    let rows: Vec<Vec<f64>> = heldout().iter().take(100).map(|(_, px)| px.clone()).collect();
    let big = digits_request("big", &rows).to_string();
    assert!(big.len() > 4096);
    expect_error(&e, "digits", big.as_bytes(), ErrorCode::TooLarge, "limits.max_payload_bytes");
    let five: Vec<Vec<f64>> = (0..5).map(|_| vec![0.0; 64]).collect();
    expect_error(
        &e,
        "digits",
        digits_request("rows", &five).to_string().as_bytes(),
        ErrorCode::TooLarge,
        "limits.max_rows",
    );
}

#[test]
fn deadline_exceeded_without_running() {
    let e = engine(EngineOptions::default());
    let mut req: Value = serde_json::from_slice(&good_payload()).unwrap();
    req["parameters"] = json!({"deadline_ms": 0});
    expect_error(
        &e,
        "digits",
        req.to_string().as_bytes(),
        ErrorCode::DeadlineExceeded,
        "parameters.deadline_ms",
    );
}

#[test]
fn overloaded_when_the_queue_is_full_and_no_request_is_lost() {
    let e = engine(EngineOptions { queue_capacity: 1, threads_per_model: 1, ..Default::default() });
    let payload = good_payload();
    let rt = rt();
    let results = rt.block_on(async {
        let futures = (0..64).map(|_| e.handle(Envelope::model("digits-large"), &payload, Encoding::Json));
        futures_join_all(futures).await
    });
    let overloaded = results.iter().filter(|h| h.outcome == Err(ErrorCode::Overloaded)).count();
    let ok = results.iter().filter(|h| h.outcome.is_ok()).count();
    assert_eq!(ok + overloaded, 64, "every request gets exactly one final reply");
    assert!(overloaded > 0 && ok > 0, "ok {ok}, overloaded {overloaded}");
    let reply: Value =
        serde_json::from_slice(&results.iter().find(|h| h.outcome.is_err()).unwrap().payload).unwrap();
    assert!(reply["error"].as_str().unwrap().contains("queue"), "{reply}");
}

/// Polls every future concurrently on the current task (no extra dependency).
async fn futures_join_all<F: std::future::Future>(futures: impl Iterator<Item = F>) -> Vec<F::Output> {
    let mut set = Vec::new();
    for f in futures {
        set.push(Box::pin(f));
    }
    let mut out: Vec<Option<F::Output>> = set.iter().map(|_| None).collect();
    std::future::poll_fn(|cx| {
        let mut pending = false;
        for (i, f) in set.iter_mut().enumerate() {
            if out[i].is_none() {
                match f.as_mut().poll(cx) {
                    std::task::Poll::Ready(v) => out[i] = Some(v),
                    std::task::Poll::Pending => pending = true,
                }
            }
        }
        if pending { std::task::Poll::Pending } else { std::task::Poll::Ready(()) }
    })
    .await;
    out.into_iter().map(Option::unwrap).collect()
}

#[test]
fn postcard_round_trip_and_undecodable_postcard() {
    let e = engine(EngineOptions::default());
    let (label, px) = &heldout()[0];
    let req: InferRequest = serde_json::from_value(digits_request("pc-1", std::slice::from_ref(px))).unwrap();
    let mut wire = WireRequest::from(req);
    wire.inputs[0].data = TensorData::F32(px.iter().map(|&x| x as f32).collect());
    wire.top_k = Some(2);
    let bytes = postcard::to_stdvec(&wire).unwrap();
    let rt = rt();
    let envelope = Envelope::model("digits");
    let handled = rt.block_on(e.handle(envelope, &bytes, Encoding::Postcard));
    assert_eq!(handled.outcome, Ok(()));
    match postcard::from_bytes::<WireReply>(&handled.payload).unwrap() {
        WireReply::Ok(r) => {
            assert_eq!(r.id, "pc-1");
            assert_eq!(r.label.as_deref(), Some(label.to_string().as_str()));
            assert_eq!(r.top_k.len(), 2);
            assert_eq!(r.outputs[0].shape, vec![1, 10]);
        }
        other => panic!("expected a result, got {other:?}"),
    }
    let handled = rt.block_on(e.handle(envelope, b"\xff\xff\xff\xff\xff", Encoding::Postcard));
    assert_eq!(handled.outcome, Err(ErrorCode::InvalidPayload));
    match codec::decode_reply(&handled.payload, Encoding::Postcard).unwrap() {
        Err(err) => {
            assert_eq!(err.parameters.code, ErrorCode::InvalidPayload);
            assert!(err.error.contains("postcard"), "{}", err.error);
        }
        Ok(r) => panic!("expected an error, got {r:?}"),
    }
}

/// Postcard carries NaN and infinities that JSON cannot: each is an
/// `invalid_input` naming the element, and the node keeps answering.
#[test]
fn postcard_nan_and_infinity_are_refused_naming_the_element() {
    let e = engine(EngineOptions::default());
    let (_, px) = &heldout()[0];
    let req: InferRequest =
        serde_json::from_value(digits_request("pc-nan", std::slice::from_ref(px))).unwrap();
    let rt = rt();
    for (at, bad) in [(3, f32::NAN), (63, f32::INFINITY), (0, f32::NEG_INFINITY)] {
        let mut wire = WireRequest::from(req.clone());
        let mut data: Vec<f32> = px.iter().map(|&x| x as f32).collect();
        data[at] = bad;
        wire.inputs[0].data = TensorData::F32(data);
        let bytes = postcard::to_stdvec(&wire).unwrap();
        let reply = rt.block_on(e.handle(Envelope::model("digits"), &bytes, Encoding::Postcard));
        assert_eq!(reply.outcome, Err(ErrorCode::InvalidInput), "{bad} at {at}");
        let Err(err) = codec::decode_reply(&reply.payload, Encoding::Postcard).unwrap() else {
            panic!("expected an error reply for {bad}");
        };
        assert_eq!(err.id, "pc-nan");
        assert!(err.error.contains(&format!("inputs[0].data element {at} is")), "{}", err.error);
        assert!(err.error.contains("finite"), "{}", err.error);
    }
    let mut wire = WireRequest::from(req);
    wire.inputs[0].data = TensorData::F32(px.iter().map(|&x| x as f32).collect());
    let bytes = postcard::to_stdvec(&wire).unwrap();
    let reply = rt.block_on(e.handle(Envelope::model("digits"), &bytes, Encoding::Postcard));
    assert_eq!(reply.outcome, Ok(()), "still serving");
}

#[test]
fn multi_row_request_answers_every_row_and_labels_row_zero() {
    let e = engine(EngineOptions::default());
    let split = heldout();
    let rows: Vec<Vec<f64>> = split.iter().take(5).map(|(_, px)| px.clone()).collect();
    let mut req = digits_request("multi", &rows);
    req["parameters"] = json!({"top_k": 3});
    let (handled, reply) = handle(&e, "digits-large", req.to_string().as_bytes());
    assert_eq!(handled.outcome, Ok(()), "{reply}");
    assert_eq!(reply["id"], "multi");
    assert_eq!(reply["model_version"], "1");
    assert_eq!(reply["outputs"][0]["shape"], json!([5, 10]));
    assert_eq!(reply["outputs"][0]["datatype"], "FP32");
    let data = reply["outputs"][0]["data"].as_array().unwrap();
    assert_eq!(data.len(), 50);
    for row in 0..5 {
        let sum: f64 = data[row * 10..(row + 1) * 10].iter().map(|v| v.as_f64().unwrap()).sum();
        assert!((sum - 1.0).abs() < 1e-4, "row {row} probabilities sum to {sum}");
    }
    assert_eq!(reply["parameters"]["label"], split[0].0.to_string());
    assert_eq!(reply["parameters"]["served_by"], "edge");
    assert_eq!(reply["parameters"]["cache"], "miss");
    let top = reply["parameters"]["top_k"].as_array().unwrap();
    assert_eq!(top.len(), 3);
    assert_eq!(top[0]["label"], reply["parameters"]["label"]);
    assert!(top[0]["confidence"].as_f64() >= top[1]["confidence"].as_f64());
}

/// The time each version has to answer the watchdog's probe here: long,
/// since a debug build on a shared machine is slow.
const PROBE_WITHIN: std::time::Duration = std::time::Duration::from_secs(5);

/// The watchdog's probe runs on the edge only: a zeros input below a
/// model's threshold used to escalate, so a slow cloud made a healthy node
/// miss its watchdog. Here every answer escalates (threshold 1.0) to a
/// cloud that never answers; the probe must not even connect to it.
#[test]
fn the_watchdog_probe_never_asks_the_cloud_tier() {
    use edgeinfer::cloud::{Cloud, CloudOptions};
    use edgeinfer::engine::CloudTier;
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    silent.set_nonblocking(true).unwrap();
    let mut config = edgeinfer::config::Config::default();
    config.cloud.enabled = true;
    config.cloud.url = format!("http://{}", silent.local_addr().unwrap());
    let cloud = Arc::new(Cloud::new(CloudOptions::from_config(&config).unwrap().unwrap()).unwrap());
    let always = edgeinfer::config::ModelConfig { threshold: 1.0, ..Default::default() };
    config.models.insert("digits".into(), always);
    let options = EngineOptions { node_id: "edgeinfer".into(), ..EngineOptions::from_config(&config) };
    let e = engine(options).with_cloud_tier(CloudTier { cloud, spool: None });
    let rt = rt();
    rt.block_on(e.probe(PROBE_WITHIN)).unwrap();
    let connected = silent.accept();
    assert!(connected.is_err(), "the probe connected to the cloud tier: {connected:?}");
}

/// The watchdog probes every model in service, not only the first: here
/// the second panics on the probe's zeros input. (The fail point is
/// process-wide, so the failing model is a copy of `digits` no other test
/// loads.)
#[cfg(feature = "failpoints")]
#[test]
fn the_watchdog_probe_tries_every_model() {
    let dir = tempfile::tempdir().unwrap();
    for (name, from) in [("digits", "digits"), ("zz-probe", "digits")] {
        let version = dir.path().join(name).join("1");
        std::fs::create_dir_all(&version).unwrap();
        for entry in std::fs::read_dir(models_dir().join(from).join("1")).unwrap() {
            let entry = entry.unwrap();
            std::fs::copy(entry.path(), version.join(entry.file_name())).unwrap();
        }
        let manifest = std::fs::read_to_string(version.join("model.toml")).unwrap();
        let renamed = manifest.replace("name = \"digits\"", &format!("name = \"{name}\""));
        std::fs::write(version.join("model.toml"), renamed).unwrap();
    }
    let registry = Registry::load(dir.path(), &RuntimeOptions::default()).unwrap();
    let e = Engine::new(Arc::new(registry), EngineOptions::default(), edgeinfer::engine::Cache::off());
    let rt = rt();
    rt.block_on(e.probe(PROBE_WITHIN)).unwrap();
    fail::cfg("inference_panic", "return(zz-probe:0)").unwrap();
    let probed = rt.block_on(e.probe(PROBE_WITHIN));
    fail::remove("inference_panic");
    let err = probed.unwrap_err().to_string();
    assert!(err.contains("zz-probe v1 (serving)") && err.contains("failpoint"), "{err}");
    rt.block_on(e.probe(PROBE_WITHIN)).unwrap();
}
