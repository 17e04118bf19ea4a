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

    /// The owner's key for it (the spool's entry).
    pub fn key(&self) -> &[u8] {
        &self.key
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

/// Where a later reply goes, and what it waits for: the request's first
/// reply, so a device never gets the final reply before the provisional one
/// (a fast cloud answers before the provisional reply has left).
#[derive(Debug, Clone)]
pub struct FollowUpTo {
    pub route: ReplyRoute,
    pub after: FirstReply,
}

/// Resolves once the transport handed a request's first reply on.
#[derive(Debug, Clone)]
pub struct FirstReply(tokio::sync::watch::Receiver<()>);

/// Held by the transport while a request's first reply is on its way to
/// it; dropping it says the reply was handed on.
#[derive(Debug)]
pub struct FirstReplyPending {
    _handed_on_when_dropped: tokio::sync::watch::Sender<()>,
}

/// A pair for one request: the transport keeps the first, the pipeline
/// passes the second to whatever sends a later reply.
pub fn first_reply() -> (FirstReplyPending, FirstReply) {
    let (tx, rx) = tokio::sync::watch::channel(());
    (FirstReplyPending { _handed_on_when_dropped: tx }, FirstReply(rx))
}

impl FirstReply {
    /// Waits until the first reply was handed on (its guard dropped).
    pub async fn sent(mut self) {
        while self.0.changed().await.is_ok() {}
    }
}
