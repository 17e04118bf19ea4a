//! Bytes to requests and replies to bytes, in either encoding.

use super::postcard::{WireError, WireReply, WireRequest};
use super::{Encoding, ErrorReply, InferError, InferRequest, InferResponse, TensorData};

/// Decodes a request. Schema errors name the offending field by its path
/// (`inputs[0].data[3]`); errors inside `inputs` are `invalid_input`, the rest
/// `invalid_payload`.
pub fn decode_request(payload: &[u8], encoding: Encoding) -> Result<InferRequest, InferError> {
    if payload.is_empty() {
        return Err(InferError::invalid_payload(
            "the payload is empty; send an Open Inference Protocol request with an `inputs` list",
        ));
    }
    match encoding {
        Encoding::Json => {
            // serde would read a struct from a JSON array too; the contract says object.
            if payload.iter().find(|b| !b.is_ascii_whitespace()) != Some(&b'{') {
                return Err(InferError::invalid_payload(
                    "the payload is not a JSON object; send an Open Inference Protocol request \
                     {\"inputs\": [...]} (or set content type application/x-postcard for postcard)",
                ));
            }
            let mut de = serde_json::Deserializer::from_slice(payload);
            let result: Result<InferRequest, _> = serde_path_to_error::deserialize(&mut de);
            let req = result.map_err(json_error)?;
            de.end().map_err(|e| {
                InferError::invalid_payload(format!(
                    "the payload has trailing bytes after the JSON request ({e}); send one JSON object"
                ))
            })?;
            Ok(req)
        }
        Encoding::Postcard => {
            let wire: WireRequest = ::postcard::from_bytes(payload).map_err(|e| {
                InferError::invalid_payload(format!(
                    "the payload is not a postcard-encoded edgeinfer::protocol::postcard::WireRequest ({e}); \
                     encode it with the crate's protocol types, or send JSON with content type application/json"
                ))
            })?;
            let req: InferRequest = wire.into();
            finite_floats(&req)?;
            Ok(req)
        }
    }
}

/// Postcard carries IEEE floats as they are, NaN and infinities included;
/// JSON cannot, and a model given them answers garbage (and an async
/// escalation could not be written as JSON for the cloud).
fn finite_floats(req: &InferRequest) -> Result<(), InferError> {
    for (n, input) in req.inputs.iter().enumerate() {
        let bad = match &input.data {
            TensorData::F32(v) => v.iter().position(|x| !x.is_finite()).map(|i| (i, v[i] as f64)),
            TensorData::F64(v) | TensorData::Number(v) => {
                v.iter().position(|x| !x.is_finite()).map(|i| (i, v[i]))
            }
            _ => None,
        };
        if let Some((i, x)) = bad {
            return Err(InferError::invalid_input(format!(
                "inputs[{n}].data element {i} is {x}; send finite numbers (no NaN or infinity)"
            )));
        }
    }
    Ok(())
}

fn json_error(e: serde_path_to_error::Error<serde_json::Error>) -> InferError {
    let path = e.path().to_string();
    let inner = e.into_inner();
    if inner.is_syntax() || inner.is_eof() {
        return InferError::invalid_payload(format!(
            "the payload is not valid JSON ({inner}); send a JSON object like \
             {{\"inputs\":[{{\"name\":\"input\",\"shape\":[1,64],\"datatype\":\"FP32\",\"data\":[...]}}]}}"
        ));
    }
    if path == "." {
        return InferError::invalid_payload(format!(
            "the request does not match the Open Inference Protocol ({inner}); \
             it must be a JSON object with an `inputs` list"
        ));
    }
    let message = format!("field `{path}`: {inner}");
    if path.starts_with("inputs") {
        InferError::invalid_input(message)
    } else {
        InferError::invalid_payload(message)
    }
}

/// Encodes the one final reply of a request.
pub fn encode_reply(id: &str, result: Result<InferResponse, InferError>, encoding: Encoding) -> Vec<u8> {
    match (encoding, result) {
        (Encoding::Json, Ok(resp)) => serde_json::to_vec(&resp),
        (Encoding::Json, Err(err)) => serde_json::to_vec(&ErrorReply::new(id, &err)),
        (Encoding::Postcard, Ok(resp)) => {
            return ::postcard::to_stdvec(&WireReply::Ok(resp.into()))
                .expect("postcard encoding into a Vec cannot fail");
        }
        (Encoding::Postcard, Err(err)) => {
            return ::postcard::to_stdvec(&WireReply::Err(WireError::new(id, &err)))
                .expect("postcard encoding into a Vec cannot fail");
        }
    }
    .expect("JSON encoding of protocol types cannot fail")
}

/// Decodes a reply (for clients: `bench`, tests, the cloud tier).
pub fn decode_reply(payload: &[u8], encoding: Encoding) -> Result<Result<InferResponse, ErrorReply>, String> {
    match encoding {
        Encoding::Json => {
            let v: serde_json::Value = serde_json::from_slice(payload).map_err(|e| e.to_string())?;
            if v.get("error").is_some() {
                serde_json::from_value(v).map(Err).map_err(|e| e.to_string())
            } else {
                serde_json::from_value(v).map(Ok).map_err(|e| e.to_string())
            }
        }
        Encoding::Postcard => match ::postcard::from_bytes::<WireReply>(payload) {
            Ok(WireReply::Ok(r)) => Ok(Ok(r.into())),
            Ok(WireReply::Err(e)) => Ok(Err(ErrorReply {
                id: e.id,
                error: e.error,
                parameters: super::ErrorParameters {
                    code: super::ErrorCode::parse(&e.code).unwrap_or(super::ErrorCode::Internal),
                },
            })),
            Err(e) => Err(e.to_string()),
        },
    }
}
