//! Stage 1: bytes to a request, refusing oversized payloads before parsing.

use crate::config::LimitsConfig;
use crate::protocol::{Encoding, InferError, InferRequest, codec};

pub fn decode(payload: &[u8], encoding: Encoding, limits: &LimitsConfig) -> Result<InferRequest, InferError> {
    if payload.len() > limits.max_payload_bytes {
        return Err(InferError::too_large(format!(
            "the payload has {} bytes, more than limits.max_payload_bytes = {}; send fewer rows per request",
            payload.len(),
            limits.max_payload_bytes
        )));
    }
    codec::decode_request(payload, encoding)
}

/// The `id` and `reply_to` of a request, read without the rest: to address
/// an error reply for a request that failed to decode, and to drop a request
/// with nowhere to reply before doing any work for it.
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
        Encoding::Postcard => match codec::decode_request(payload, encoding) {
            Ok(req) => Peek { id: req.id, reply_to: req.reply_to },
            Err(_) => Peek::default(),
        },
    }
}
