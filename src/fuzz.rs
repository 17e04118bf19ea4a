//! Fuzz targets: each decoder that reads what a device or an operator
//! hands the node, with the properties that must hold for any input. A
//! target panics only when one is broken. The stable runner
//! (`tests/integration/fuzz.rs`, `EDGEINFER_FUZZ_CASES`) and the
//! `cargo fuzz` targets in `fuzz/` call these same functions.

use crate::config::Config;
use crate::engine::peek;
use crate::model::Manifest;
use crate::protocol::postcard::WireReply;
use crate::protocol::{Encoding, InferError, codec};
use crate::transport::mqtt::{ReplyRefusal, Topics};

/// A request payload in the Open Inference Protocol JSON.
pub fn oip_json(data: &[u8]) {
    request(data, Encoding::Json);
}

/// A request payload in postcard.
pub fn postcard(data: &[u8]) {
    request(data, Encoding::Postcard);
}

/// Decoding never panics, and whatever the payload, the error reply built
/// from what could be read of it decodes and carries that id.
fn request(data: &[u8], encoding: Encoding) {
    let id = match codec::decode_request(data, encoding) {
        Ok(request) => request.id,
        Err(_) => peek(data, encoding).id,
    };
    let reply = codec::encode_reply(&id, Err(InferError::invalid_payload("fuzz")), encoding);
    match encoding {
        Encoding::Json => {
            let value: serde_json::Value = serde_json::from_slice(&reply).expect("an error reply is JSON");
            assert_eq!(value["id"].as_str(), Some(id.as_str()), "the reply carries the request's id");
        }
        Encoding::Postcard => match ::postcard::from_bytes::<WireReply>(&reply) {
            Ok(WireReply::Err(e)) => assert_eq!(e.id, id, "the reply carries the request's id"),
            other => panic!("an error reply decodes as one: {other:?}"),
        },
    }
}

/// An MQTT packet as the node's client reads it off the wire, and for a
/// PUBLISH what the node then reads from it: the model its topic names,
/// whether its reply topic may be used, its content type.
pub fn mqtt_packet(data: &[u8]) {
    use rumqttc::v5::mqttbytes::v5::Packet;
    let mut bytes = bytes::BytesMut::from(data);
    if let Ok(Packet::Publish(publish)) = Packet::read(&mut bytes, Some(1 << 20)) {
        let topic = String::from_utf8_lossy(&publish.topic);
        topic_and_reply(&topic, publish.properties.as_ref().and_then(|p| p.response_topic.as_deref()));
        let content_type = publish.properties.as_ref().and_then(|p| p.content_type.as_deref());
        let _ = Encoding::from_content_type(content_type);
    }
    let text = String::from_utf8_lossy(data);
    let (topic, reply) = text.split_once('\n').unwrap_or((&text, ""));
    topic_and_reply(topic, Some(reply));
}

fn topic_and_reply(topic: &str, reply: Option<&str>) {
    let topics = Topics::new("edgeinfer", "gw-01", "edgeinfer").with_reply_prefixes(&["devices".into()]);
    if let Some(model) = topics.model_of(topic) {
        assert!(topic.ends_with(model), "the model is the topic's last part");
    }
    if let Some(reply) = reply
        && topics.check_reply(reply).is_ok()
    {
        assert!(!reply.starts_with('$') && !reply.contains(['+', '#']), "{reply:?} passed the check");
        assert_ne!(topics.check_reply(reply), Err(ReplyRefusal::Reserved));
    }
}

/// The MQTT session (issue 36) fed broker bytes in chunks of any size,
/// interleaved with what the node does (publish, take a request, lose the
/// connection, let time pass): it never panics, what it writes decodes,
/// its read buffer stays within one packet, and what it holds of the
/// broker's publishes stays within the broker's packet ids.
pub fn mqtt_session(data: &[u8]) {
    use crate::transport::mqtt::session::{Event, Options, Session};
    use rumqttc::v5::mqttbytes::QoS;
    use rumqttc::v5::mqttbytes::v5::{Packet, Publish};
    use std::time::Duration;
    const RECEIVE_MAXIMUM: u16 = 4;
    const MAX_PACKET: u32 = 1024;
    let options = Options {
        client_id: "fuzz".into(),
        keep_alive: Duration::from_secs(30),
        clean_start: true,
        session_expiry_s: 60,
        receive_maximum: RECEIVE_MAXIMUM,
        max_packet_size: MAX_PACKET,
        connect_timeout: Duration::from_secs(10),
        ping_timeout: Duration::from_secs(5),
        login: None,
        will: None,
    };
    let mut session = Session::new(options.clone());
    let mut now = std::time::Instant::now();
    session.connect(now);
    let (mut arrivals, mut out, mut rest) = (Vec::new(), bytes::BytesMut::new(), data);
    // PUBRECs of journaled publishes, whose PUBREL waits for `release`.
    let mut received = Vec::new();
    while let Some((&op, tail)) = rest.split_first() {
        rest = tail;
        match op % 6 {
            0 | 1 => {
                let (chunk, tail) = rest.split_at((op as usize / 6 + 1).min(rest.len()));
                rest = tail;
                session.handle_read(now, chunk);
            }
            2 => {
                let qos = if op & 8 == 0 { QoS::AtLeastOnce } else { QoS::ExactlyOnce };
                let publish = Publish::new("r", qos, vec![op], None);
                let _ = if op & 16 == 0 { session.publish(publish) } else { session.publish_held(publish) };
            }
            3 if op & 16 != 0 && !received.is_empty() => {
                session.release(received.remove(op as usize % received.len()));
            }
            3 if !arrivals.is_empty() => session.acknowledge(arrivals.remove(op as usize % arrivals.len())),
            // A new process: what a journal kept, under its old ids.
            4 if op & 16 != 0 => {
                session = Session::new(Options { clean_start: false, ..options.clone() });
                for pkid in [u16::from(op) + 1, u16::from(op) + 2] {
                    let mut publish = Publish::new("r", QoS::ExactlyOnce, vec![op], None);
                    publish.pkid = pkid;
                    session.restore(publish, pkid % 2 == 0);
                }
                (arrivals, received) = (Vec::new(), Vec::new());
                session.connect(now);
            }
            4 => {
                session.handle_closed();
                session.connect(now);
            }
            _ => {
                now += Duration::from_secs(u64::from(op / 6));
                session.handle_timeout(now);
            }
        }
        while let Some(event) = session.poll_event() {
            match event {
                Event::Publish { arrival: Some(arrival), .. } => arrivals.push(arrival),
                Event::Received { pkid } => received.push(pkid),
                _ => {}
            }
        }
        out.clear();
        session.poll_goodbye(&mut out);
        let n = session.poll_transmit(&mut out);
        session.wrote(now, n / 2);
        while !out.is_empty() {
            Packet::read(&mut out, None).expect("what the session writes decodes");
        }
        assert!(session.buffered() <= MAX_PACKET as usize + 5 + 43, "{} bytes buffered", session.buffered());
        assert!(session.incoming_in_flight() <= 3 * usize::from(u16::MAX), "more held than there are ids");
    }
}

/// A model manifest's text: refused with a reason, or its files are plain
/// names inside the version directory.
pub fn manifest(data: &[u8]) {
    if let Ok(manifest) = Manifest::parse(&String::from_utf8_lossy(data)) {
        let inside = |f: &str| {
            std::path::Path::new(f).components().all(|c| matches!(c, std::path::Component::Normal(_)))
        };
        assert!(inside(&manifest.file), "{:?} was accepted", manifest.file);
        if let Some(golden) = &manifest.golden {
            assert!(inside(&golden.file), "{:?} was accepted", golden.file);
        }
    }
}

/// A config file's text: refused naming a key, or valid.
pub fn config(data: &[u8]) {
    if let Err(e) = Config::parse(&String::from_utf8_lossy(data)) {
        assert!(!e.to_string().is_empty());
    }
}

/// A target: panics only when a property is broken.
pub type Target = fn(&[u8]);

/// Every target by name, for runners.
pub const TARGETS: [(&str, Target); 6] = [
    ("oip_json", oip_json),
    ("postcard", postcard),
    ("mqtt_packet", mqtt_packet),
    ("mqtt_session", mqtt_session),
    ("manifest", manifest),
    ("config", config),
];
