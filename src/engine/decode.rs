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

/// The `id` of a JSON request that failed to decode, so the device can still
/// match the error reply to what it sent.
pub fn salvage_id(payload: &[u8], encoding: Encoding) -> String {
    #[derive(serde::Deserialize)]
    struct IdOnly {
        id: String,
    }
    match encoding {
        Encoding::Json => serde_json::from_slice::<IdOnly>(payload).map(|r| r.id).unwrap_or_default(),
        Encoding::Postcard => String::new(),
    }
}
