//! Last stage: the one final reply, in the request's encoding.

use crate::protocol::{Encoding, InferError, InferResponse, codec};

pub fn encode(id: &str, result: Result<InferResponse, InferError>, encoding: Encoding) -> Vec<u8> {
    codec::encode_reply(id, result, encoding)
}
