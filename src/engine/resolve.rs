//! Stage 2: which model version answers, found together with the inference
//! threads that run it, so the two cannot disagree. The version a transport
//! names (`/v2/models/M/versions/V/infer`) wins over
//! `parameters.model_version`, which wins over the active version. Rollout
//! routing (canary and shadow versions) belongs here.

use super::envelope::Envelope;
use super::run::Runner;
use crate::model::Versions;
use crate::protocol::{InferError, InferRequest};

pub fn resolve<'g>(
    runners: &'g Versions<Runner>,
    envelope: &Envelope<'_>,
    req: &InferRequest,
) -> Result<&'g Runner, InferError> {
    let version = envelope.version.or(req.parameters.model_version.as_deref());
    runners.get(envelope.model, version)
}
