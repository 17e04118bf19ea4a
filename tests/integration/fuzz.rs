//! The stable-Rust fuzzer: every target in `edgeinfer::fuzz`, fed the
//! committed corpus and regressions (`fuzz/`) as they are, then
//! `EDGEINFER_FUZZ_CASES` inputs each (default 20,000; the campaign in
//! docs/BENCHMARKS.md runs 1,000,000) made by byte-level mutation of the
//! corpus and by structure-aware generation (a JSON request's tree edited,
//! postcard requests and MQTT PUBLISH packets built with extreme fields).
//! A failing input is written to `target/fuzz-failures/` and named; copy it
//! to `fuzz/regressions/TARGET/` so it is checked on every run.
//!
//! `EDGEINFER_FUZZ_SEED` picks the run (default: fixed, so CI is
//! repeatable); `EDGEINFER_FUZZ_TARGET` runs one target.

use crate::{digits_request, heldout, models_dir};
use edgeinfer::engine::{Engine, EngineOptions, Envelope};
use edgeinfer::model::{Registry, RuntimeOptions};
use edgeinfer::protocol::postcard::{WireRequest, WireTensor};
use edgeinfer::protocol::{Encoding, ErrorCode, TensorData};
use serde_json::{Value, json};
use std::panic::AssertUnwindSafe;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

const MAX_INPUT: usize = 64 * 1024;

fn fuzz_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("fuzz")
}

/// Every file under `fuzz/{corpus,regressions}/TARGET`.
fn committed(target: &str) -> Vec<Vec<u8>> {
    let mut inputs = Vec::new();
    for kind in ["corpus", "regressions"] {
        let Ok(dir) = std::fs::read_dir(fuzz_dir().join(kind).join(target)) else { continue };
        let mut files: Vec<PathBuf> = dir.map(|e| e.unwrap().path()).collect();
        files.sort();
        inputs.extend(files.iter().map(|f| std::fs::read(f).unwrap()));
    }
    inputs
}

/// Tokens that matter to the decoders, spliced in at random.
const DICTIONARY: &[&[u8]] = &[
    b"\"",
    b"{",
    b"}",
    b"[",
    b"]",
    b",",
    b":",
    b"null",
    b"true",
    b"-1",
    b"0",
    b"1e999",
    b"-1e999",
    b"18446744073709551616",
    b"NaN",
    b"\\u0000",
    b"\\ud800",
    b"\"inputs\"",
    b"\"shape\"",
    b"\"data\"",
    b"\"datatype\"",
    b"\"FP32\"",
    b"\"INT8\"",
    b"\"parameters\"",
    b"\"deadline_ms\"",
    b"\"top_k\"",
    b"\"tier\"",
    b"\"reply_to\"",
    b"\"id\"",
    b"$SYS/",
    b"edgeinfer/",
    b"/infer/",
    b"+",
    b"#",
    b"\0",
    b"[[[[[[[[[[[[[[[[",
    b"\xff\xff\xff\xff\x0f",
    b"\x80\x80\x80\x80\x80\x80\x80\x80\x80\x01",
    b"=",
    b"[models.x]",
    b"[[outputs]]",
    b"file = ",
    b"\"../\"",
    b"/etc/passwd",
    b"shape = [",
    b"\n",
    b"'''",
];

fn mutate(rng: &mut fastrand::Rng, input: &[u8], corpus: &[Vec<u8>]) -> Vec<u8> {
    let mut out = input.to_vec();
    for _ in 0..rng.usize(1..=4) {
        let len = out.len();
        match rng.u8(0..8) {
            0 if len > 0 => {
                let i = rng.usize(..len);
                out[i] ^= 1 << rng.u8(0..8);
            }
            1 if len > 0 => {
                let i = rng.usize(..len);
                out[i] = rng.choice([0u8, 0xff, 0x7f, 0x80, b'"', b'{', b'[', b'9', b'-']).unwrap();
            }
            2 if len > 0 => {
                let start = rng.usize(..len);
                let end = (start + rng.usize(1..=32)).min(len);
                out.drain(start..end);
            }
            3 => {
                let at = rng.usize(..=len);
                let junk: Vec<u8> = (0..rng.usize(1..=16)).map(|_| rng.u8(..)).collect();
                out.splice(at..at, junk);
            }
            4 if len > 0 => {
                let start = rng.usize(..len);
                let end = (start + rng.usize(1..=64)).min(len);
                let piece = out[start..end].to_vec();
                let at = rng.usize(..=out.len());
                out.splice(at..at, piece);
            }
            5 if !corpus.is_empty() => {
                let other = &corpus[rng.usize(..corpus.len())];
                let cut = rng.usize(..=len);
                let from = rng.usize(..=other.len());
                out.truncate(cut);
                out.extend_from_slice(&other[from..]);
            }
            6 => {
                let at = rng.usize(..=len);
                out.splice(at..at, DICTIONARY[rng.usize(..DICTIONARY.len())].iter().copied());
            }
            _ if len > 0 => out.truncate(rng.usize(..len)),
            _ => {}
        }
    }
    out.truncate(MAX_INPUT);
    out
}

/// A value that stresses a decoder where a normal one sits.
fn extreme(rng: &mut fastrand::Rng) -> Value {
    match rng.u8(0..12) {
        0 => Value::Null,
        1 => json!(true),
        2 => json!(-1),
        3 => json!(0),
        4 => json!(1e308),
        5 => json!(u64::MAX),
        6 => json!(i64::MIN),
        7 => json!(""),
        8 => json!("x".repeat(rng.usize(1..2000))),
        9 => json!([]),
        10 => json!({}),
        _ => (0..rng.usize(1..200)).fold(json!(1), |v, _| json!([v])),
    }
}

/// A JSON request with one node of its tree replaced, removed or repeated.
fn edited_json(rng: &mut fastrand::Rng, seed: &Value) -> Vec<u8> {
    /// The JSON pointer of every node under `v`.
    fn pointers(v: &Value, at: String, all: &mut Vec<String>) {
        match v {
            Value::Array(items) => {
                items.iter().enumerate().for_each(|(i, x)| pointers(x, format!("{at}/{i}"), all))
            }
            Value::Object(map) => map.iter().for_each(|(k, x)| pointers(x, format!("{at}/{k}"), all)),
            _ => {}
        }
        all.push(at);
    }
    let mut tree = seed.clone();
    for _ in 0..rng.usize(1..=3) {
        let mut all = Vec::new();
        pointers(&tree, String::new(), &mut all);
        let at = &all[rng.usize(..all.len())];
        let replacement = extreme(rng);
        let Some(node) = tree.pointer_mut(at) else { continue };
        match (rng.u8(0..4), &mut *node) {
            (0, Value::Object(map)) if !map.is_empty() => {
                let key = map.keys().nth(rng.usize(..map.len())).unwrap().clone();
                map.remove(&key);
            }
            (1, Value::Array(items)) if !items.is_empty() => {
                let item = items[rng.usize(..items.len())].clone();
                items.extend(std::iter::repeat_n(item, rng.usize(1..100)));
            }
            _ => *node = replacement,
        }
    }
    tree.to_string().into_bytes()
}

fn some_f32(rng: &mut fastrand::Rng) -> f32 {
    rng.choice([
        0.0,
        -0.0,
        1.0,
        16.0,
        f32::NAN,
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::MAX,
        f32::MIN_POSITIVE,
    ])
    .unwrap()
}

/// A postcard request built with extreme fields.
fn built_postcard(rng: &mut fastrand::Rng) -> Vec<u8> {
    let n = rng.usize(0..200);
    let data = match rng.u8(0..5) {
        0 => TensorData::F32((0..n).map(|_| some_f32(rng)).collect()),
        1 => TensorData::I8((0..n).map(|_| rng.i8(..)).collect()),
        2 => TensorData::I64((0..n).map(|_| rng.i64(..)).collect()),
        3 => TensorData::U8((0..n).map(|_| rng.u8(..)).collect()),
        _ => TensorData::F64((0..n).map(|_| some_f32(rng) as f64).collect()),
    };
    let shape: Vec<i64> = (0..rng.usize(0..5))
        .map(|_| rng.choice([-1, 0, 1, 64, n as i64, i64::MAX, i64::MIN]).unwrap())
        .collect();
    let wire = WireRequest {
        id: "p".repeat(rng.usize(0..40)),
        reply_to: rng.bool().then(|| "devices/x".into()),
        inputs: (0..rng.usize(0..3))
            .map(|_| WireTensor { name: "input".into(), shape: shape.clone(), data: data.clone() })
            .collect(),
        outputs: if rng.bool() { vec![] } else { vec!["probabilities".into(), "nope".into()] },
        tier: None,
        deadline_ms: rng.bool().then(|| rng.u64(..)),
        cache: Some(rng.bool()),
        top_k: rng.bool().then(|| rng.u32(..)),
        model_version: rng.bool().then(|| "1".into()),
    };
    postcard::to_stdvec(&wire).unwrap()
}

/// An MQTT 5 PUBLISH as a broker would send it, with extreme properties.
fn built_publish(rng: &mut fastrand::Rng) -> Vec<u8> {
    use rumqttc::v5::mqttbytes::QoS;
    use rumqttc::v5::mqttbytes::v5::{Publish, PublishProperties};
    let topic = rng
        .choice([
            "edgeinfer/gw-01/infer/digits",
            "edgeinfer/infer/..",
            "$share/x/edgeinfer/infer/a",
            "",
            "a/+/#",
        ])
        .unwrap();
    let reply =
        rng.choice(["devices/d/replies", "$SYS/x", "edgeinfer/gw-01/status", "devices/#", ""]).unwrap();
    let props = PublishProperties {
        response_topic: rng.bool().then(|| reply.to_string()),
        correlation_data: rng.bool().then(|| bytes::Bytes::from(vec![0u8; rng.usize(0..300)])),
        content_type: rng.bool().then(|| "application/x-postcard; x=1".into()),
        message_expiry_interval: rng.bool().then(|| rng.u32(..)),
        user_properties: (0..rng.usize(0..3)).map(|i| (format!("k{i}"), "v".into())).collect(),
        ..Default::default()
    };
    let mut publish = Publish::new(topic, QoS::AtLeastOnce, vec![b'{'; rng.usize(0..100)], Some(props));
    publish.pkid = rng.u16(1..);
    let mut out = bytes::BytesMut::new();
    publish.write(&mut out).unwrap();
    out.to_vec()
}

/// A script for `edgeinfer::fuzz::mqtt_session`: a CONNACK, then broker
/// packets split at random points, interleaved with the node's publishes,
/// the requests it takes, dropped connections and time passing.
fn built_session_script(rng: &mut fastrand::Rng) -> Vec<u8> {
    use rumqttc::v5::mqttbytes::QoS;
    use rumqttc::v5::mqttbytes::v5::{Packet, PubAck, PubComp, PubRec, PubRel, Publish};
    let mut script = Vec::new();
    let feed = |script: &mut Vec<u8>, rng: &mut fastrand::Rng, bytes: &[u8]| {
        for chunk in bytes.chunks(rng.usize(1..=43)) {
            script.push(6 * (chunk.len() as u8 - 1));
            script.extend_from_slice(chunk);
        }
    };
    let connack = |rng: &mut fastrand::Rng| [0x20, 0x03, rng.u8(0..2), 0x00, 0x00];
    let first = connack(rng);
    feed(&mut script, rng, &first);
    for _ in 0..rng.usize(1..40) {
        let pkid = rng.u16(1..6);
        let packet = match rng.u8(0..10) {
            0 | 1 => {
                let qos = if rng.bool() { QoS::AtLeastOnce } else { QoS::ExactlyOnce };
                let mut publish =
                    Publish::new("edgeinfer/fuzz/infer/m", qos, vec![b'{'; rng.usize(0..60)], None);
                (publish.pkid, publish.dup) = (pkid, rng.bool());
                Some(Packet::Publish(publish))
            }
            2 => Some(Packet::PubAck(PubAck::new(pkid, None))),
            3 => Some(Packet::PubRec(PubRec::new(pkid, None))),
            4 => Some(Packet::PubRel(PubRel::new(pkid, None))),
            5 => Some(Packet::PubComp(PubComp::new(pkid, None))),
            6 => {
                script.push(rng.choice([2u8, 8]).unwrap());
                None
            }
            7 => {
                script.push(3 + 6 * rng.u8(0..8));
                None
            }
            8 => {
                script.push(4);
                let again = connack(rng);
                feed(&mut script, rng, &again);
                None
            }
            _ => {
                script.push(5 + 6 * rng.u8(0..10));
                None
            }
        };
        if let Some(packet) = packet {
            let mut bytes = bytes::BytesMut::new();
            packet.write(&mut bytes, None).unwrap();
            feed(&mut script, rng, &bytes);
        }
    }
    script
}

fn seeds(target: &str) -> Vec<Vec<u8>> {
    let mut seeds = committed(target);
    if target == "oip_json" {
        let rows: Vec<Vec<f64>> = heldout().iter().take(2).map(|(_, px)| px.clone()).collect();
        seeds.push(digits_request("seed", &rows).to_string().into_bytes());
    }
    seeds
}

/// One input, generated or mutated.
fn next_input(target: &str, rng: &mut fastrand::Rng, corpus: &[Vec<u8>], json_seed: &Value) -> Vec<u8> {
    let base = match (target, rng.u8(0..3)) {
        ("oip_json", 0) => return edited_json(rng, json_seed),
        ("postcard", 0) => built_postcard(rng),
        ("mqtt_packet", 0) => built_publish(rng),
        ("mqtt_session", 0 | 1) => built_session_script(rng),
        _ if corpus.is_empty() => Vec::new(),
        _ => corpus[rng.usize(..corpus.len())].clone(),
    };
    if rng.u8(0..4) == 0 { base } else { mutate(rng, &base, corpus) }
}

/// Runs `target` on `input`; the panic message if it broke.
fn run(target: fn(&[u8]), input: &[u8]) -> Option<String> {
    std::panic::catch_unwind(AssertUnwindSafe(|| target(input))).err().map(|p| {
        p.downcast_ref::<String>()
            .cloned()
            .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
            .unwrap_or_default()
    })
}

fn save_failure(target: &str, input: &[u8]) -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("target/fuzz-failures").join(target);
    std::fs::create_dir_all(&dir).unwrap();
    use sha2::Digest;
    let path = dir.join(hex::encode(&sha2::Sha256::digest(input)[..8]));
    std::fs::write(&path, input).unwrap();
    path
}

#[test]
fn every_decoder_holds_its_properties_on_mutated_and_generated_inputs() {
    let cases: usize =
        std::env::var("EDGEINFER_FUZZ_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(20_000);
    let seed: u64 = std::env::var("EDGEINFER_FUZZ_SEED").ok().and_then(|v| v.parse().ok()).unwrap_or(17);
    let only = std::env::var("EDGEINFER_FUZZ_TARGET").ok();
    let registry = Registry::load(&models_dir(), &RuntimeOptions::default()).unwrap();
    let engine = Engine::new(Arc::new(registry), EngineOptions::default(), edgeinfer::engine::Cache::off());
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let json_seed: Value = serde_json::from_slice(&seeds("oip_json").pop().unwrap()).unwrap();
    let mut failures = Vec::new();
    // Quiet: the targets' own panics are reported below, not as backtraces.
    let hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(|_| {}));
    for (name, target) in edgeinfer::fuzz::TARGETS {
        if only.as_deref().is_some_and(|o| o != name) {
            continue;
        }
        let corpus = seeds(name);
        let mut rng = fastrand::Rng::with_seed(seed ^ name.len() as u64);
        let started = Instant::now();
        let (mut through_engine, mut failed) = (0, 0);
        let committed_inputs = corpus.clone();
        for (i, input) in committed_inputs.into_iter().map(Some).chain((0..cases).map(|_| None)).enumerate() {
            let input = input.unwrap_or_else(|| next_input(name, &mut rng, &corpus, &json_seed));
            if let Some(why) = run(target, &input) {
                failed += 1;
                failures.push(format!("{name}: {why} ({})", save_failure(name, &input).display()));
            }
            // Every 16th decodable request also goes through the whole
            // pipeline: no input may make it fail with `internal`.
            let encoding = match name {
                "oip_json" => Encoding::Json,
                "postcard" => Encoding::Postcard,
                _ => continue,
            };
            if i % 16 == 0 && edgeinfer::protocol::codec::decode_request(&input, encoding).is_ok() {
                through_engine += 1;
                let reply = rt.block_on(engine.handle(Envelope::model("digits"), &input, encoding));
                if reply.outcome == Err(ErrorCode::Internal) {
                    failures.push(format!(
                        "{name}: answered internal ({})",
                        save_failure(name, &input).display()
                    ));
                }
            }
        }
        let took = started.elapsed();
        eprintln!(
            "fuzz {name}: {} inputs ({} committed), {through_engine} through the engine, {failed} failures, {:.1} s, {:.0} inputs/s",
            cases + corpus.len(),
            corpus.len(),
            took.as_secs_f64(),
            (cases + corpus.len()) as f64 / took.as_secs_f64()
        );
    }
    std::panic::set_hook(hook);
    assert!(failures.is_empty(), "{} failing inputs:\n{}", failures.len(), failures.join("\n"));
}

/// `EDGEINFER_FUZZ_SAVE_SEEDS=1`: writes generated seeds for the binary
/// formats into `fuzz/corpus/` (how the committed ones were made).
#[test]
fn seeds_for_the_binary_formats_can_be_regenerated() {
    let mut rng = fastrand::Rng::with_seed(1);
    let postcard: Vec<Vec<u8>> = (0..8).map(|_| built_postcard(&mut rng)).collect();
    let publish: Vec<Vec<u8>> = (0..8).map(|_| built_publish(&mut rng)).collect();
    let session: Vec<Vec<u8>> = (0..8).map(|_| built_session_script(&mut rng)).collect();
    for input in postcard.iter() {
        assert!(run(edgeinfer::fuzz::postcard, input).is_none());
    }
    for input in publish.iter() {
        assert!(run(edgeinfer::fuzz::mqtt_packet, input).is_none());
    }
    for input in session.iter() {
        assert!(run(edgeinfer::fuzz::mqtt_session, input).is_none());
    }
    if std::env::var("EDGEINFER_FUZZ_SAVE_SEEDS").as_deref() == Ok("1") {
        for (target, inputs) in
            [("postcard", &postcard), ("mqtt_packet", &publish), ("mqtt_session", &session)]
        {
            let dir: &Path = &fuzz_dir().join("corpus").join(target);
            std::fs::create_dir_all(dir).unwrap();
            for (i, input) in inputs.iter().enumerate() {
                std::fs::write(dir.join(format!("generated-{i}")), input).unwrap();
            }
        }
    }
}
