//! The watchdog's probe: which versions it tries, the request it sends
//! them, and what a failure names. Every version that takes requests is
//! tried, a rollout's candidate too: a wedged candidate answering its
//! share of devices (up to all of them) is as wedged a node as a wedged
//! stable.

use super::run::Runner;
use crate::config::RolloutMode;
use crate::model::{LoadedModel, Versions};
use crate::protocol::{InferRequest, TensorData, Tier};
use crate::rollout::Deployments;
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

/// Why a version is in service.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// It answers requests naming no version (the pinned stable, or the
    /// newest).
    Serving,
    /// A rollout's candidate: it answers a share of devices (canary, ab) or
    /// runs beside stable to be compared (shadow).
    Candidate(RolloutMode),
}

impl fmt::Display for Role {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Role::Serving => f.write_str("serving"),
            Role::Candidate(mode) => write!(f, "{} candidate", mode.as_str()),
        }
    }
}

/// A version the probe tries: its inference threads, and why it is in service.
pub struct InService<'g> {
    pub runner: &'g Arc<Runner>,
    pub role: Role,
}

/// The versions in service: each model's serving version, and the candidate
/// of a model with a rollout. A candidate whose directory is gone is not in
/// service (stable answers its share), so it is not tried.
pub fn in_service<'g>(
    runners: &'g Versions<Arc<Runner>>,
    deployments: Option<&Deployments>,
) -> Vec<InService<'g>> {
    let mut versions = Vec::new();
    for newest in runners.active() {
        let name = newest.model().name();
        let deployment = deployments.and_then(|d| d.models.get(name));
        let Ok(serving) = runners.serving(name, deployment.map(|d| d.stable.as_str())) else { continue };
        versions.push(InService { runner: serving, role: Role::Serving });
        if let Some(candidate) = deployment.and_then(|d| d.candidate.as_ref())
            && let Ok(runner) = runners.get(name, Some(&candidate.version))
            && !Arc::ptr_eq(runner, serving)
        {
            versions.push(InService { runner, role: Role::Candidate(candidate.mode) });
        }
    }
    versions
}

/// One row of zeros for `model`, pinned to its version (so it takes no part
/// in a rollout's figures), past the cache, on the edge only (tier `fast`:
/// a zeros input may fall below the model's threshold, and a slow cloud
/// must not make a healthy node miss its watchdog), due `within`.
pub fn request(model: &LoadedModel, within: Duration) -> InferRequest {
    let spec = &model.manifest.input;
    let shape: Vec<i64> = spec.shape.iter().map(|&d| if d < 0 { 1 } else { d }).collect();
    let elements = shape.iter().product::<i64>() as usize;
    let zeros = TensorData::Number(vec![0.0; elements]);
    let mut req = InferRequest::single("watchdog", &spec.name, shape, spec.datatype, zeros);
    req.parameters.cache = Some(false);
    // Also the deadline of the queued copy: an inference thread that comes
    // back from a wedge skips the probes nobody waits for any more.
    req.parameters.deadline_ms = Some(within.as_millis().max(1) as u64);
    req.parameters.tier = Some(Tier::Fast);
    req.parameters.model_version = Some(model.version().to_string());
    req
}

/// A version in service that did not answer its probe.
#[derive(Debug, Clone, thiserror::Error)]
#[error("{model} v{version} ({role}): {why}")]
pub struct Unanswered {
    pub model: String,
    pub version: String,
    pub role: Role,
    pub why: String,
}

impl Unanswered {
    pub fn new(version: &InService<'_>, why: String) -> Unanswered {
        let model = version.runner.model();
        Unanswered { model: model.name().into(), version: model.version().into(), role: version.role, why }
    }
}

/// Why the watchdog does not pet.
#[derive(Debug, Clone, thiserror::Error)]
pub enum ProbeError {
    #[error("no model is in service")]
    NothingInService,
    /// Every version that failed, not only the first: an operator reading
    /// the log sees whether the candidate, stable, or both are wedged.
    #[error("{}", .0.iter().map(ToString::to_string).collect::<Vec<_>>().join("; "))]
    Unanswered(Vec<Unanswered>),
}
