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

/// A reply sent after the request's first one, encoded, and who waits to
/// hear the broker has it.
#[derive(Debug)]
pub struct FollowUp {
    pub route: ReplyRoute,
    pub payload: Vec<u8>,
    pub delivery: Delivery,
}

/// Tells the owner of a follow-up (the cloud spool, which keeps the entry
/// until then) that the broker acknowledged it: `confirm`. Dropped without
/// a confirmation (the node stopped, the session was lost with it) it says
/// so too, and the owner sends it again later.
#[derive(Debug)]
pub struct Delivery {
    key: Vec<u8>,
    to: Option<tokio::sync::mpsc::UnboundedSender<(Vec<u8>, bool)>>,
}

impl Delivery {
    /// Reports `(key, delivered)` on `to`.
    pub fn new(key: Vec<u8>, to: tokio::sync::mpsc::UnboundedSender<(Vec<u8>, bool)>) -> Delivery {
        Delivery { key, to: Some(to) }
    }

    /// Nobody waits (tests, and replies with no owner).
    pub fn untracked() -> Delivery {
        Delivery { key: Vec::new(), to: None }
    }

    /// The broker has it (or refused it for good, which is logged and
    /// counted where it is seen): the owner may forget it.
    pub fn confirm(mut self) {
        if let Some(to) = self.to.take() {
            let _ = to.send((std::mem::take(&mut self.key), true));
        }
    }
}

impl Drop for Delivery {
    fn drop(&mut self) {
        if let Some(to) = self.to.take() {
            let _ = to.send((std::mem::take(&mut self.key), false));
        }
    }
}
