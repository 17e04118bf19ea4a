//! What a transport hands the pipeline with a payload.

use crate::protocol::FollowUpTo;
use std::time::Duration;

/// What a transport knows about a request besides its payload.
#[derive(Debug, Clone, Copy)]
pub struct Envelope<'a> {
    /// The model the topic or URL names.
    pub model: &'a str,
    /// A version named by the transport (`/v2/models/M/versions/V/infer`);
    /// otherwise `parameters.model_version`, otherwise the active version.
    pub version: Option<&'a str>,
    /// A deadline the transport imposes (MQTT 5 Message Expiry), on top of
    /// `parameters.deadline_ms`; the earlier one wins.
    pub deadline: Option<Duration>,
    /// `mqtt`, `http` or `cli`: the `transport` label of the request metrics.
    pub transport: &'static str,
    /// Where a second reply can go (MQTT); without one, async enrichment
    /// is answered synchronously.
    pub follow_up: Option<&'a FollowUpTo>,
}

impl<'a> Envelope<'a> {
    pub fn model(model: &'a str) -> Self {
        Envelope { model, version: None, deadline: None, transport: "cli", follow_up: None }
    }
}
