//! Stage 1: bytes to a request, refusing oversized payloads before parsing.

use crate::config::LimitsConfig;
use crate::protocol::postcard::WireRequest;
use crate::protocol::{Encoding, InferError, InferRequest, codec};

/// A payload read once: the request, or why it is not one, with the `id`
/// and `reply_to` an error reply needs either way.
#[derive(Debug)]
pub struct Decoded {
    pub id: String,
    /// Where an MQTT 3.1.1 request wants its reply.
    pub reply_to: Option<String>,
    pub request: Result<InferRequest, InferError>,
}

pub fn decode(payload: &[u8], encoding: Encoding, limits: &LimitsConfig) -> Decoded {
    let request = if payload.len() > limits.max_payload_bytes {
        Err(InferError::too_large(format!(
            "the payload has {} bytes, more than limits.max_payload_bytes = {}; send fewer rows per request",
            payload.len(),
            limits.max_payload_bytes
        )))
    } else {
        codec::decode_request(payload, encoding)
    };
    match request {
        Ok(req) => Decoded { id: req.id.clone(), reply_to: req.reply_to.clone(), request: Ok(req) },
        Err(e) => {
            let peek = peek(payload, encoding);
            Decoded { id: peek.id, reply_to: peek.reply_to, request: Err(e) }
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
        // The wire struct alone: a request refused for its contents (NaN
        // data, say) still has an id to answer.
        Encoding::Postcard => match ::postcard::from_bytes::<WireRequest>(payload) {
            Ok(wire) => Peek { id: wire.id, reply_to: wire.reply_to },
            Err(_) => Peek::default(),
        },
    }
}
