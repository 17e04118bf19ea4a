//! Replies after the first: where one goes, and one on its way. A request
//! escalated with `enrich = "async"` gets its final reply later, on the
//! reply topic it named, after the cloud answered (or will not).

use serde::{Deserialize, Serialize};

/// Where a later reply goes: the request's reply topic, correlation data
/// and content type.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ReplyRoute {
    pub topic: String,
    pub correlation: Option<Vec<u8>>,
    pub content_type: Option<String>,
}

/// A reply sent after the request's first one, encoded.
#[derive(Debug, Clone)]
pub struct FollowUp {
    pub route: ReplyRoute,
    pub payload: Vec<u8>,
}
