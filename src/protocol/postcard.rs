//! The `application/x-postcard` encoding: the same request and reply as the
//! JSON ones, in a fixed field order for devices without a JSON parser.
//!
//! These types are the schema a device encodes against; change them only by
//! appending fields at the end (postcard is not self-describing).

use super::{
    CacheStatus, InferError, InferRequest, InferResponse, InputTensor, OutputTensor, RequestParameters,
    RequestedOutput, ResponseParameters, ServedBy, TensorData, Tier, TopK,
};
use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct WireRequest {
    pub id: String,
    pub reply_to: Option<String>,
    pub inputs: Vec<WireTensor>,
    /// Requested output names; empty means all.
    pub outputs: Vec<String>,
    pub tier: Option<Tier>,
    pub deadline_ms: Option<u64>,
    pub cache: Option<bool>,
    pub top_k: Option<u32>,
    pub model_version: Option<String>,
}

/// A tensor; its datatype is the variant of `data`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct WireTensor {
    pub name: String,
    pub shape: Vec<i64>,
    pub data: TensorData,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum WireReply {
    Ok(WireResponse),
    Err(WireError),
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct WireResponse {
    pub id: String,
    pub model_name: String,
    pub model_version: String,
    pub outputs: Vec<WireTensor>,
    pub node: String,
    pub served_by: ServedBy,
    pub cache: CacheStatus,
    pub label: Option<String>,
    pub confidence: Option<f32>,
    pub top_k: Vec<TopK>,
    /// Appended with the cloud tier (older decoders stop before them).
    pub degraded: bool,
    pub is_final: Option<bool>,
    /// Appended with config rollouts.
    pub config_version: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct WireError {
    pub id: String,
    /// One of the contract's error codes, e.g. `invalid_input`.
    pub code: String,
    pub error: String,
}

impl From<WireRequest> for InferRequest {
    fn from(w: WireRequest) -> Self {
        InferRequest {
            id: w.id,
            reply_to: w.reply_to,
            inputs: w
                .inputs
                .into_iter()
                .map(|t| InputTensor {
                    name: t.name,
                    shape: t.shape,
                    // Untyped numbers cannot be sent in postcard's typed variants
                    // except as `Number`, which validation then types.
                    datatype: t.data.datatype().map(|d| d.as_str()).unwrap_or("").to_string(),
                    data: t.data,
                })
                .collect(),
            outputs: w.outputs.into_iter().map(|name| RequestedOutput { name }).collect(),
            parameters: RequestParameters {
                tier: w.tier,
                deadline_ms: w.deadline_ms,
                cache: w.cache,
                top_k: w.top_k,
                model_version: w.model_version,
                // Not in the postcard schema: the model's `enrich` setting applies.
                enrich: None,
            },
        }
    }
}

impl From<InferRequest> for WireRequest {
    fn from(r: InferRequest) -> Self {
        WireRequest {
            id: r.id,
            reply_to: r.reply_to,
            inputs: r
                .inputs
                .into_iter()
                .map(|t| WireTensor { name: t.name, shape: t.shape, data: t.data })
                .collect(),
            outputs: r.outputs.into_iter().map(|o| o.name).collect(),
            tier: r.parameters.tier,
            deadline_ms: r.parameters.deadline_ms,
            cache: r.parameters.cache,
            top_k: r.parameters.top_k,
            model_version: r.parameters.model_version,
        }
    }
}

impl From<InferResponse> for WireResponse {
    fn from(r: InferResponse) -> Self {
        WireResponse {
            id: r.id,
            model_name: r.model_name,
            model_version: r.model_version,
            outputs: r
                .outputs
                .into_iter()
                .map(|t| WireTensor {
                    name: t.name,
                    shape: t.shape.into_iter().map(|d| d as i64).collect(),
                    data: t.data,
                })
                .collect(),
            node: r.parameters.node,
            served_by: r.parameters.served_by,
            cache: r.parameters.cache,
            label: r.parameters.label,
            confidence: r.parameters.confidence,
            top_k: r.parameters.top_k.unwrap_or_default(),
            degraded: r.parameters.degraded,
            is_final: r.parameters.is_final,
            config_version: r.parameters.config_version,
        }
    }
}

impl From<WireResponse> for InferResponse {
    fn from(w: WireResponse) -> Self {
        InferResponse {
            id: w.id,
            model_name: w.model_name,
            model_version: w.model_version,
            outputs: w
                .outputs
                .into_iter()
                .map(|t| OutputTensor {
                    name: t.name,
                    shape: t.shape.into_iter().map(|d| d.max(0) as u64).collect(),
                    datatype: t.data.datatype().unwrap_or(super::Datatype::Fp64),
                    data: t.data,
                })
                .collect(),
            parameters: ResponseParameters {
                node: w.node,
                served_by: w.served_by,
                cache: w.cache,
                label: w.label,
                confidence: w.confidence,
                top_k: (!w.top_k.is_empty()).then_some(w.top_k),
                degraded: w.degraded,
                is_final: w.is_final,
                config_version: w.config_version,
            },
        }
    }
}

impl WireError {
    pub fn new(id: impl Into<String>, err: &InferError) -> Self {
        WireError { id: id.into(), code: err.code.as_str().to_string(), error: err.message.clone() }
    }
}
