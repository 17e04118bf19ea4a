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
    /// Who sent it, as far as the transport can tell (the reply topic over
    /// MQTT; `X-Device-Id` or the peer's address over HTTP): a rollout
    /// splits devices by it, so one device keeps one version.
    pub device: Option<&'a str>,
    /// The caller's W3C trace context (an MQTT 5 user property, HTTP
    /// headers), continued where `[tracing]` is on.
    pub trace: crate::trace::Caller<'a>,
}

impl<'a> Envelope<'a> {
    pub fn model(model: &'a str) -> Self {
        Envelope {
            model,
            version: None,
            deadline: None,
            transport: "cli",
            follow_up: None,
            device: None,
            trace: Default::default(),
        }
    }
}
