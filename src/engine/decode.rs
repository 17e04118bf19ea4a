//! Stage 1: bytes to a request, refusing oversized payloads before parsing.

use crate::config::LimitsConfig;
use crate::protocol::{Encoding, InferError, InferRequest, codec};
use std::time::Instant;

/// A payload read once: the request, or why it is not one, with the `id`
/// and `reply_to` an error reply needs either way.
#[derive(Debug)]
pub struct Decoded {
    pub id: String,
    /// Where an MQTT 3.1.1 request wants its reply.
    pub reply_to: Option<String>,
    pub request: Result<InferRequest, InferError>,
    /// When decoding started and ended (the trace's `decode` span).
    pub timed: (Instant, Instant),
}

pub fn decode(payload: &[u8], encoding: Encoding, limits: &LimitsConfig) -> Decoded {
    let started = Instant::now();
    let request = if payload.len() > limits.max_payload_bytes {
        Err(InferError::too_large(format!(
            "the payload has {} bytes, more than limits.max_payload_bytes = {}; send fewer rows per request \
             (messages over limits.max_packet_bytes = {} are dropped by the broker unanswered)",
            payload.len(),
            limits.max_payload_bytes,
            limits.max_packet_bytes
        )))
    } else {
        codec::decode_request(payload, encoding)
    };
    match request {
        Ok(req) => {
            let timed = (started, Instant::now());
            Decoded { id: req.id.clone(), reply_to: req.reply_to.clone(), request: Ok(req), timed }
        }
        Err(e) => {
            let peek = peek(payload, encoding);
            Decoded {
                id: peek.id,
                reply_to: peek.reply_to,
                request: Err(e),
                timed: (started, Instant::now()),
            }
        }
    }
}

/// The `id` and `reply_to` of a request, read without the rest: to address
/// an error reply for a request that failed to decode, and to refuse one
/// (overloaded, nowhere to reply) without doing its work.
#[derive(Debug, Default, serde::Deserialize)]
pub struct Peek {
    #[serde(default)]
    pub id: String,
    #[serde(default)]
    pub reply_to: Option<String>,
}

pub fn peek(payload: &[u8], encoding: Encoding) -> Peek {
    match encoding {
        Encoding::Json => serde_json::from_slice::<Peek>(payload).unwrap_or_default(),
        // Postcard is read in field order: the first two fields alone, so a
        // request refused for its contents (NaN data, say, or its size)
        // still has an id to answer, and its data is never read.
        Encoding::Postcard => match ::postcard::take_from_bytes::<WireHead>(payload) {
            Ok((head, _)) => Peek { id: head.id, reply_to: head.reply_to },
            Err(_) => Peek::default(),
        },
    }
}

/// The leading fields of a postcard `WireRequest`.
#[derive(serde::Deserialize)]
struct WireHead {
    id: String,
    reply_to: Option<String>,
}
