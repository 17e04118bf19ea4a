//! The wire contract: Open Inference Protocol (KServe v2) types, their JSON
//! and postcard encodings, and the error codes of `shared/PRODUCT.md`.

pub mod codec;
mod error;
mod json;
pub mod postcard;
mod reply;
mod types;

pub use error::{ErrorCode, ErrorParameters, ErrorReply, InferError};
pub use reply::{Delivery, FirstReply, FirstReplyPending, FollowUp, FollowUpTo, ReplyRoute, first_reply};
pub use types::*;

/// How a payload is encoded; replies use the request's encoding.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Encoding {
    Json,
    Postcard,
}

impl Encoding {
    pub const JSON_CONTENT_TYPE: &'static str = "application/json";
    pub const POSTCARD_CONTENT_TYPE: &'static str = "application/x-postcard";

    /// Anything but the postcard content type is JSON, the contract's default.
    pub fn from_content_type(content_type: Option<&str>) -> Self {
        match content_type.map(|c| c.split(';').next().unwrap_or("").trim()) {
            Some(c) if c.eq_ignore_ascii_case(Self::POSTCARD_CONTENT_TYPE) => Encoding::Postcard,
            _ => Encoding::Json,
        }
    }

    pub fn content_type(self) -> &'static str {
        match self {
            Encoding::Json => Self::JSON_CONTENT_TYPE,
            Encoding::Postcard => Self::POSTCARD_CONTENT_TYPE,
        }
    }
}
