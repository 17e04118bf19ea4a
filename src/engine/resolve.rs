//! Stage 2: which model version answers, found together with the inference
//! threads that run it, so the two cannot disagree. The version a transport
//! names (`/v2/models/M/versions/V/infer`) wins over
//! `parameters.model_version`, which wins over the stable version the
//! deployment state pins (`rollout`), which wins over the newest. Canary
//! and shadow routing belong here.

use super::envelope::Envelope;
use super::run::Runner;
use crate::model::Versions;
use crate::protocol::{InferError, InferRequest};

pub fn resolve<'g>(
    runners: &'g Versions<Runner>,
    envelope: &Envelope<'_>,
    req: &InferRequest,
    stable: Option<&str>,
) -> Result<&'g Runner, InferError> {
    match envelope.version.or(req.parameters.model_version.as_deref()) {
        Some(version) => runners.get(envelope.model, Some(version)),
        None => runners.serving(envelope.model, stable),
    }
}
